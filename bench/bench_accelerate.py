"""An accelerate loop's checkpoints: ours (``TailorAccelerator.save_state``, Full and Parity) vs
accelerate's own ``Accelerator.save_state`` of the same state, side by side in one process.

The model is the Llama of ``bench_save.py`` (Llama-3.1-8B's proportions scaled down: hidden
1024, 32 layers, intermediate 3584, vocab 32000; built from ``transformers.LlamaConfig``, never
downloaded, fp32) with AdamW in HF Trainer's decay / no-decay groups and a LambdaLR, prepared by
an ``Accelerator(cpu=True)`` (one process); moments from one real training step.

- ``accelerate``  ``Accelerator.save_state(DIR)`` (model.safetensors, optimizer.bin,
  scheduler.bin, random_states_0.pkl; no fsync);
- ``ours Full`` / ``ours Parity``  ``TailorAccelerator.save_state(step=N)`` into a run of its
  own (a Tailor's first save is full, so the measured save is each run's second).

Each save is timed between two ``os.sync()`` calls (durable time), contenders taking turns in
each repeat; medians over ``--repeats``, ratios to accelerate's, then issue 25's targets: Full
<= 1.0x and Parity <= 0.6x accelerate's time.

    .venv/bin/python bench/bench_accelerate.py --repeats 3
    .venv/bin/python bench/bench_accelerate.py --layers 4 --hidden 256 --intermediate 896 --vocab 4096 --repeats 2  # quick
"""

from __future__ import annotations

import os
import platform
import shutil

import accelerate
import torch

from common import MB, dir_bytes, durable, model_arguments, print_ratios, scratch

from llmtailor import Full, Parity
from llmtailor.integrations.accelerate import TailorAccelerator
from llmtailor.store.run import Run
from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens, hf_param_groups



def main() -> None:
    args = model_arguments(__doc__)
    print(f"python {platform.python_version()}, torch {torch.__version__}, accelerate {accelerate.__version__}, "
          f"{os.cpu_count()} CPUs")
    with scratch(args.out, "bench_accelerate") as out:
        accelerator = TailorAccelerator(cpu=True, tailor_run_dir=out / "unused")
        model = build_model(TinyConfig(hidden_size=args.hidden, layers=args.layers, heads=args.heads,
                                       kv_heads=args.kv_heads, intermediate_size=args.intermediate, seq_len=2048,
                                       vocab_size=args.vocab), seed=0)
        optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        batch = batch_at(corpus_tokens(), step=1, batch_size=1, seq_len=16)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params fp32, {args.layers} layers; AdamW")
        results: dict[str, list[tuple[float, int]]] = {"accelerate": [], "ours Full": [], "ours Parity": []}
        for repeat in range(args.repeats):
            folder = out / f"accelerate-{repeat}"
            seconds = durable(lambda: accelerate.Accelerator.save_state(accelerator, str(folder)))
            results["accelerate"].append((seconds, dir_bytes(folder)))
            shutil.rmtree(folder)
            for name, policy in (("Full", Full()), ("Parity", Parity())):
                run = out / f"{name}-{repeat}"
                accelerator.tailor_run_dir, accelerator.tailor_config = run, accelerator.tailor_config.model_copy(
                    update={"policy": policy})
                accelerator.save_state(step=1)  # a Tailor's first save is full: not measured
                seconds = durable(lambda: accelerator.save_state(step=2))
                results[f"ours {name}"].append((seconds, dir_bytes(Run(run).snapshot_dir(2))))
                accelerator.end_training()  # closes this run's Tailor; the next repeat makes another
                shutil.rmtree(run)
            for name, values in results.items():
                print(f"  repeat {repeat + 1} {name:<12} {values[-1][1] / MB:9.1f} MB  durable {values[-1][0]:6.2f} s",
                      flush=True)
        print_ratios(results, "accelerate", "acc", {"ours Full": 1.0, "ours Parity": 0.6},
                     "issue 25 targets (time vs Accelerator.save_state: Full <= 1.0x, Parity <= 0.6x)")


if __name__ == "__main__":
    main()
