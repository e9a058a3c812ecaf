"""What a save's look at a frozen base costs: the fingerprints of every frozen tensor, taken at
every save (``FrozenParts.survey`` -> ``frozen.fingerprints``: ``sample_checksums`` with
``store.samples.covering``, schema 7), at Llama-7B shapes: a 32000 x 4096 embedding and head and
32 layers of four 4096 x 4096 attention weights and three MLP weights (4096 x 11008, 11008 x
4096), bf16. Against the 1024-element sample schema 6 recorded (``samples.sampled``) and a full
xxh3 of every tensor (``tensor_checksum``).

Holding the whole 13.5 GB base is more than a shared machine gives a bench: ``--layers`` layers
(distinct random tensors, together far larger than any cache, so no sampled line is found in
cache from the round before) are timed with the embedding and head, and the per-layer cost is
multiplied up to ``--model-layers``. Thread CPU time (``time.thread_time``), medians over
``--repeats``; one torch thread.

    PYTHONPATH=. .venv/bin/python bench/bench_frozen_survey.py --layers 4 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmtailor.store.samples import covering, sample_checksums, sampled
from llmtailor.store.staged import Piece
from llmtailor.store.tensor_files import tensor_checksum

HIDDEN, INTERMEDIATE, VOCAB = 4096, 11008, 32000
LAYER = [(HIDDEN, HIDDEN)] * 4 + [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def cpu_median(call, repeats: int) -> float:
    """Median thread CPU seconds of ``call``."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def make(shapes: list[tuple[int, int]], seed: int) -> list[Piece]:
    generator = torch.Generator().manual_seed(seed)
    return [Piece.whole(f"weight/t{seed}.{i}", torch.randn(*shape, generator=generator).to(torch.bfloat16))
            for i, shape in enumerate(shapes)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4, help="layers held and timed")
    parser.add_argument("--model-layers", type=int, default=32, help="layers of the model the figures are scaled to")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ends = make([(VOCAB, HIDDEN), (VOCAB, HIDDEN)], 0)  # embedding and head
    layers = make(LAYER * args.layers, 1)
    held = sum(p.tensor.numel() for p in ends + layers) * 2
    print(f"held: embedding + head + {args.layers} layers, {held / 2**30:.2f} GiB bf16; scaled to {args.model_layers} layers")
    elements = {name: sum(len(take(p)) for p in layers) for name, take in (("covering", covering), ("sampled", sampled))}
    rows = []
    for name, check in (("covering (schema 7)", lambda ps: sample_checksums(ps, covering)),
                        ("sampled 1024 (schema 6)", lambda ps: sample_checksums(ps, sampled)),
                        ("full xxh3", lambda ps: [tensor_checksum(p.tensor) for p in ps])):
        repeats = args.repeats if not name.startswith("full") else max(1, args.repeats // 3)
        end = cpu_median(lambda: check(ends), repeats)
        per_layer = cpu_median(lambda: check(layers), repeats) / args.layers
        rows.append((name, end, per_layer, end + per_layer * args.model_layers))
    for name, end, per_layer, total in rows:
        print(f"{name:24s} embed+head {end * 1e3:9.2f} ms | per layer {per_layer * 1e3:9.2f} ms | "
              f"{args.model_layers}-layer base per save {total * 1e3:10.1f} ms CPU")
    print(f"sampled elements per layer: covering {elements['covering'] // args.layers}, "
          f"sampled {elements['sampled'] // args.layers}")


if __name__ == "__main__":
    main()
