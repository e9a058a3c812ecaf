"""Cost of measuring drift (``llmtailor.drift``) vs a training step, on the demo model.

    .venv/bin/python bench/bench_drift.py

Trains the model of ``make demo`` (16-layer Llama, hidden 64, on pydoc_data.topics, batch 8 x
128 tokens, one thread as the demo runs) and times, side by side, a training step and what a
save adds for drift: sampling the live values once (``gather``, which also gives the saved
units their new references) and comparing them with the references (``partial_sums`` +
``drift_figures``). Medians of ``--repeats``.
The PRODUCT target: measuring costs < 2% of a training step. Drift is measured once per save,
so its share of training time is that figure divided by the steps between saves.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from llmtailor.demo import DEMO_BATCH_SIZE, DEMO_CONFIG
from llmtailor.distributed.coordinator import LocalCoordinator
from llmtailor.drift import SAMPLE, DriftTracker, drift_figures
from llmtailor.providers import make_provider
from llmtailor.training_example import build_model, build_optimizer, corpus_tokens, train_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=DEMO_CONFIG.hidden_size, help="another width than the demo's")
    parser.add_argument("--layers", type=int, default=DEMO_CONFIG.layers)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = replace(DEMO_CONFIG, hidden_size=args.hidden, layers=args.layers, intermediate_size=2 * args.hidden)
    model = build_model(config, seed=0)
    optimizer, scheduler = build_optimizer(model, total_steps=1000)
    tokens = corpus_tokens()
    provider = make_provider(model, optimizer, scheduler, LocalCoordinator())
    units = list(provider.layout.units)
    tracker = DriftTracker()
    step_s, measure_s, sample_s = [], [], []
    steps = iter(train_steps(model, optimizer, scheduler, tokens, range(1, 10**6), DEMO_BATCH_SIZE, config.seq_len))
    next(steps)
    tracker.adopt(tracker.gather(units, provider))
    for _ in range(args.repeats):
        start = time.perf_counter()
        next(steps)
        step_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        gathered = tracker.gather(units, provider)
        sample_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        drift_figures(units, tracker.partial_sums(units, gathered), tracker.known())
        tracker.adopt(gathered)
        measure_s.append(time.perf_counter() - start)
    step, measure, sample = (statistics.median(x) for x in (step_s, measure_s, sample_s))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M params (hidden {args.hidden} x {args.layers} layers), {len(units)} units; sample of {SAMPLE} elements per tensor; "
          f"median of {args.repeats}, one thread")
    print(f"  training step          {step * 1e3:8.2f} ms")
    print(f"  sampling the values    {sample * 1e3:8.2f} ms  = {100 * sample / step:5.2f}% of a step")
    print(f"  drift vs references    {measure * 1e3:8.2f} ms  = {100 * measure / step:5.2f}% of a step")
    print(f"  both, once per save    {(measure + sample) * 1e3:8.2f} ms  = {100 * (measure + sample) / step:5.2f}% of a step "
          f"(target < 2%)")


if __name__ == "__main__":
    main()
