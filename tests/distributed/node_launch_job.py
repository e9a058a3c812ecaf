"""The job of test_node_tiers.py's check of the node launches themselves (``helpers.node_launches``,
forked_nodes.py): what each rank was started with, and how its node ends.

    (a node launch of) node_launch_job.py SCENARIO DIR

Each rank writes ``DIR/rank-<rank>.json`` first: its pid, session, torchrun's variables, its
TMPDIR (as ``tempfile`` finds it), its hash of a string and a draw of ``random``.

``report``  then meets the other ranks (gloo, through node 0's store) and ends.
``fail``    rank 1 exits 3 once rank 0 wrote its file; every other rank waits (for a SIGTERM from its
    node, or its node's end).
``hold``    every rank waits (for its node's end).
``outlive``  rank 1 exits 3 once rank 0 wrote its file; rank 0 exits 0 once rank 1 has ended (a node
    launched with ``statuses_of`` runs every rank to its end: rank 0 is not ended).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
         "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_USE_AGENT_STORE", "NODE_DIR")


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    out.mkdir(parents=True, exist_ok=True)
    said = {"pid": os.getpid(), "session": os.getsid(0), "env": {name: os.environ.get(name) for name in NAMES},
            "tmp": tempfile.gettempdir(), "hash": hash("llmtailor"), "random": random.random()}
    (out / f"rank-{rank}.json").write_text(json.dumps(said))
    if scenario == "report":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
    elif scenario in ("fail", "outlive") and rank == 1:
        deadline = time.monotonic() + 300  # once rank 0 started (the event; a bound on a hang)
        while not (out / "rank-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)
    elif scenario == "outlive":
        deadline = time.monotonic() + 300  # once rank 1 ended (the event; a bound on a hang)
        while not _ended(out / "rank-1.json") and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        time.sleep(3600)  # ended by its node (the test's bound on a hang is the launch's)


def _ended(said: Path) -> bool:
    """Whether the rank that wrote ``said`` (its pid) has ended and was reaped."""
    try:
        pid = json.loads(said.read_text())["pid"]
    except (OSError, ValueError):  # not written yet, or half written
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


if __name__ == "__main__":
    main()
