"""What ``shared_ranges._scratch`` leaves in the glibc heap: ``rounds`` batches of ``pieces``
buffers of ``MiB`` each, taken on 4 threads (a read plan reads on its threads) as a restore's
pieces are, their pages touched, then all dropped; the process's RSS at each batch's peak and
after it, and with ``trim`` a ``malloc_trim(0)`` after each batch (its CPU, and the minor faults
of the whole run). Usage: ``python bench/scratch_heap.py MiB pieces rounds none|trim``."""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from llmtailor.store.shared_ranges import _scratch


def rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    size, pieces, rounds, trim = int(sys.argv[1]) << 20, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "trim"
    libc, pool = ctypes.CDLL("libc.so.6"), ThreadPoolExecutor(4)

    def one(_: int) -> memoryview:
        buffer = _scratch(size)
        buffer[::4096] = b"\1" * len(buffer[::4096])  # its pages touched, as a read fills them
        return buffer

    faults, cpu, trims = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), 0.0
    print(f"start: {rss():.0f} MiB")
    for r in range(rounds):
        held = list(pool.map(one, range(pieces)))
        peak = rss()
        del held
        gc.collect()
        if trim:
            began = time.thread_time()
            libc.malloc_trim(0)
            trims += time.thread_time() - began
        print(f"batch {r}: peak {peak:.0f} MiB, after {rss():.0f} MiB", flush=True)
    print(f"{sys.argv[4]}: process CPU {time.process_time() - cpu:.2f} s, malloc_trim CPU {trims * 1000:.0f} ms, "
          f"minor faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}")


if __name__ == "__main__":
    main()
