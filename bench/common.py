"""What the save benchmarks share: bytes of an output, a durable timing, the ratio table."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MB = 1e6


def model_arguments(doc: str, more: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """The command line of a benchmark on ``bench_save.py``'s Llama (Llama-3.1-8B's proportions
    scaled down; each size a flag), ``--repeats`` and ``--out``, and what ``more`` adds to the
    parser; ``doc``'s first paragraph is its description."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if more is not None:
        more(parser)
    sizes = {"layers": 32, "hidden": 1024, "intermediate": 3584, "heads": 16, "kv-heads": 8, "vocab": 32000}
    for flag, default in sizes.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default})")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    return parser.parse_args()


@contextlib.contextmanager
def scratch(parent: Path, name: str) -> Iterator[Path]:
    """``parent/<name>.<pid>``, made now and removed (with ``parent`` if then empty) at the end."""
    out = parent / f"{name}.{os.getpid()}"
    out.mkdir(parents=True)
    try:
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.suppress(OSError):
            parent.rmdir()


def dir_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def durable(call: Callable[[], object]) -> float:
    """Seconds of ``call()`` plus a following ``os.sync()`` (one before, so no earlier dirty page
    is flushed inside the measurement)."""
    os.sync()
    start = time.perf_counter()
    call()
    os.sync()
    return time.perf_counter() - start


def print_ratios(results: dict[str, list[tuple[float, int]]], baseline: str, short: str,
                 targets: dict[str, float], goal: str) -> None:
    """Medians of (durable seconds, bytes) per contender with their ratios to ``baseline``'s,
    then each target (contender -> largest time ratio allowed) as PASS or FAIL."""
    base_s = statistics.median(s for s, _ in results[baseline])
    base_b = statistics.median(b for _, b in results[baseline])
    print(f"\n{'contender':<14}{'MB':>9}{'bytes/' + short:>11}{'durable s':>11}{'time/' + short:>10}")
    for name, values in results.items():
        seconds, size = statistics.median(s for s, _ in values), statistics.median(b for _, b in values)
        print(f"{name:<14}{size / MB:>9.1f}{size / base_b:>11.3f}{seconds:>11.2f}{seconds / base_s:>10.3f}")
    print(f"\n{goal}")
    for name, target in targets.items():
        ratio = statistics.median(s for s, _ in results[name]) / base_s
        print(f"  {name:<12} {ratio:.3f}x (target <= {target}x): {'PASS' if ratio <= target else 'FAIL'}")
