"""Cost of one store call of the coordinator: a real TCPStore over loopback (its server in a
process of its own), ``N`` calls each of ``get``, ``set`` and ``add`` through a
``StoreCoordinator``'s client (``_store``: since session 58 a ``Deadlined`` client, each call
made on a thread of its own with a deadline), CPU and wall time per call of this process.

    python bench/coordinator_store_calls.py N RUNS   (PYTHONPATH: the tree measured)
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import time

from torch.distributed import TCPStore

from llmtailor.distributed.coordinator import StoreCoordinator

SERVER = ("import datetime, sys, torch.distributed as d\n"
          "s = d.TCPStore('127.0.0.1', 0, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False)\n"
          "print(s.port, flush=True)\nsys.stdin.read()")


def main(n: int, runs: int) -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        client = TCPStore("127.0.0.1", int(server.stdout.readline()), 2, False, timeout=datetime.timedelta(seconds=60))
        store = StoreCoordinator.over(client, 1, 2, timeout=60)._store
        store.set("k", "v" * 64)
        calls = {"get": lambda: store.get("k"), "set": lambda: store.set("k", "v" * 64), "add": lambda: store.add("n", 1)}
        for run in range(runs):
            for op, call in calls.items():
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(n):
                    call()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                print(f"run {run} {op}: wall {wall / n * 1e6:.1f} us/call, cpu {cpu / n * 1e6:.1f} us/call", flush=True)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
