"""A job for tests/distributed/test_collective_promotion.py, run by ``torchrun --nnodes 2`` (one
launch per "node", each with its own ``$NODE_DIR`` and TMPDIR): FSDP2, Parity saves at steps
``start..start+5`` into a node-local tier (``replicas=1``: each node holds its own parts only)
at ``$NODE_DIR``, promoted every 2 steps to ``$RUN_HOME`` (the moto server's bucket), then
``close()``. Resumes from the newest composite of any tier when there is one.

Each process records the files it uploaded in promotions (``collective.upload``). With
``HOLD_AT=<step>``, each node's leader, once it has uploaded its node's parts for the promotion
of that step, writes ``<out>/holding`` (its process id) and stops there for good (until the test
kills the job: torchrun's workers run in sessions of their own).

    python -m torch.distributed.run --nnodes 2 --node_rank I ... promote_job.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_job import build, rank, train  # noqa: E402

from llmtailor import Parity, Tailor, Tier  # noqa: E402
from llmtailor.store.tiers import collective  # noqa: E402


def recording_uploads(out: Path) -> list[str]:
    """Record each file this process uploads in a promotion (``step:path``); hold at ``HOLD_AT``."""
    uploaded: list[str] = []
    upload, hold = collective.upload, os.environ.get("HOLD_AT")

    def recorded(source, dst, staging, node):
        done = upload(source, dst, staging, node)
        uploaded.extend(f"{step}:{entry.path}" for step in staging for entry in collective.node_files(source, step, node))
        if hold and node is not None and int(hold) in staging:
            (out / "holding").write_text(json.dumps({"pid": os.getpid(), "staging": sorted(staging)}))
            threading.Event().wait()  # mid-promotion, for good: the test kills the job now
        return done

    collective.upload = recorded
    return uploaded


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    uploaded = recording_uploads(out)
    model, optimizer, scheduler = build("fsdp", seed=0)
    tiers = [Tier(os.environ["NODE_DIR"], scope="node", replicas=1, keep=2, promote_every=2)]
    tailor = Tailor(os.environ["RUN_HOME"], model, optimizer, scheduler, policy=Parity(), tiers=tiers,
                    timeout=float(os.environ.get("TIMEOUT", "60")))
    start = tailor.restore().step + 1 if tailor.latest_step() is not None else 1
    for step in range(start, start + 6):
        train(model, optimizer, scheduler, [step])
        tailor.save(step)
    tailor.close()
    result = {"start": start, "uploaded": uploaded, "promoted": [p.step for p in tailor.tiers.promotions]}
    (out / f"result-{rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
