"""What the restore's check of one frozen tensor the model holds costs, against reading it.

A restore does not read a frozen tensor the live model already holds: it checks the checksum of
a sample of it against the one recorded at save (``providers/local.py``, ``_already_held``).
This times that check alone, ``store.samples.sample_checksums`` on one tensor, and the pass
``verify="exact"`` makes instead (``tensor_checksum``: every byte), on a 32000 x 4096 bf16
embedding, contiguous and as a transposed view; medians over ``--repeats`` of thread CPU time
and wall time. Runs on any tree: one whose ``store.samples`` has ``covering`` (schema 7: an
element of every row and column) is timed with it, an older one with its 1024-element sample.

    PYTHONPATH=. .venv/bin/python bench/bench_frozen_check.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmtailor.store import samples
from llmtailor.store.staged import Piece
from llmtailor.store.tensor_files import tensor_checksum


def timed(call, repeats: int) -> tuple[float, float]:
    """Median thread CPU seconds and wall seconds of ``call``."""
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.thread_time(), time.perf_counter()
        call()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32000)
    parser.add_argument("--columns", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensor = torch.randn(args.rows, args.columns, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    transposed = tensor.t().contiguous().t()  # the same values in column-major memory
    take = getattr(samples, "covering", None)
    which = "covering (schema 7)" if take else "sampled, 1024 elements (schema 6)"
    check = (lambda t: samples.sample_checksums([Piece.whole("weight/embed", t)], take)) if take else \
        (lambda t: samples.sample_checksums([Piece.whole("weight/embed", t)]))
    count = len(take(Piece.whole("weight/embed", tensor))) if take else samples.SAMPLE
    print(f"tensor {args.rows} x {args.columns} bf16 ({tensor.numel() * 2 / 2**20:.0f} MiB); sample: {which}, {count} elements")
    for name, live in (("contiguous", tensor), ("transposed view", transposed)):
        sample_cpu, sample_wall = timed(lambda: check(live), args.repeats)
        exact_cpu, exact_wall = timed(lambda: tensor_checksum(live), max(3, args.repeats // 5))
        print(f"{name:16s} sample check: {sample_cpu * 1e3:8.3f} ms CPU {sample_wall * 1e3:8.3f} ms wall | "
              f"every byte (verify='exact'): {exact_cpu * 1e3:8.1f} ms CPU {exact_wall * 1e3:8.1f} ms wall | "
              f"ratio {sample_cpu / exact_cpu:.4f} (CPU)")


if __name__ == "__main__":
    main()
