"""The waits on the disk of a node-local tier's commit, counted (not timed): two one-rank
"nodes" as threads save step 1, each into its own copy, with the copies carried between them
(tests/store/test_node_commit_rounds.py's ``save_on_two_nodes``). For each node: the fsyncs made,
and the waits on the disk its saving thread made one after another: a ``Syncer.drain`` that
found an fsync unfinished, a commit's ``fsync_together`` (one wait, whatever it drains beside
it), an fsync on that thread itself (a directory after a rename). The tree measured is the one on ``PYTHONPATH`` (its tests/ included), so one
script counts both trees of a before/after pair:

    PYTHONPATH=<tree> python bench/node_commit_waits.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tree = Path(os.environ.get("PYTHONPATH", ".").split(os.pathsep)[0]).resolve()
    sys.path[:0] = [str(tree / "tests"), str(tree / "tests" / "store")]
    from test_node_commit_rounds import save_on_two_nodes

    from llmtailor.store.storage import local_commit, local_durable

    waits, fsyncs, lock, inside = collections.Counter(), collections.Counter(), threading.Lock(), threading.local()
    real_drain, real_fsync, real_together = local_durable.Syncer.drain, os.fsync, local_commit.fsync_together

    def saving() -> str | None:
        name = threading.current_thread().name
        return name if name.startswith("Thread-") else None  # a node's saving thread

    def wait(thread: str) -> None:
        with lock:
            waits[thread] += 1

    def drain(self) -> None:
        thread = saving()
        if thread and not getattr(inside, "together", False) and any(not f.done() for _, f, _ in self._pending):
            wait(thread)
        return real_drain(self)

    def together(*args, **kwargs) -> None:  # one wait, whatever it drains beside (``beside``)
        wait(saving() or "other")
        inside.together = True
        try:
            return real_together(*args, **kwargs)
        finally:
            inside.together = False

    def fsync(fd: int) -> None:
        node = "node0" if "/node0" in os.readlink(f"/proc/self/fd/{fd}") else "node1"
        with lock:
            fsyncs[node] += 1
        if saving():  # on the saving thread itself (a directory after a rename): a wait of its own
            wait(saving())
        return real_fsync(fd)

    local_durable.Syncer.drain, os.fsync, local_commit.fsync_together = drain, fsync, together
    for _ in range(args.repeats):
        waits.clear()
        fsyncs.clear()
        with tempfile.TemporaryDirectory() as root:
            outcomes = save_on_two_nodes(Path(root))
        assert all(type(o).__name__ == "PersistResult" for o in outcomes), outcomes
        print(f"{tree}: waits on the disk one after another per node {sorted(waits.values())}, "
              f"fsyncs per node {[fsyncs['node0'], fsyncs['node1']]}")


if __name__ == "__main__":
    main()
