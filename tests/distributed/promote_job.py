"""A job for tests/distributed/test_collective_promotion.py, run by ``torchrun --nnodes 2`` (one
launch per "node", each with its own ``$NODE_DIR`` and TMPDIR): FSDP2, Parity saves at steps
``start..start+5`` into a node-local tier (``replicas=1``: each node holds its own parts only)
at ``$NODE_DIR``, promoted every 2 steps to ``$RUN_HOME`` (the moto server's bucket), then
``close()``. Resumes from the newest composite of any tier when there is one.

Each process records the files it uploaded in promotions (``collective.upload``) and logs
llmtailor's INFO messages to its stderr (a follower's order found gone says so there). With
``HOLD_AT=<step>``, each node's leader, once it has uploaded its node's parts for the promotion
of the first composite at or after that step (the same order on every node), writes
``<out>/holding`` (its process id and the steps of the order) and stops there for good (until the
test kills the job: torchrun's workers run in sessions of their own); node 1's leader takes that
order up only once its Tailor began to close: every save of its node committed and its node's
retention ran after each (the worst case for the order, whenever it was posted).

With ``KEEP=<k>`` the node-local tier keeps ``k`` composites (default 2). With
``HOLD_FOLLOWER=<n>``, node 1's leader takes its first promotion order (of the composite of
step ``c``) up, before it leases or reads anything, only once its own saves have committed step
``c + n`` and run the node's retention after it (the event, not a time: an uploader as late as
it can be); it then records what it waited for in ``<out>/held.json`` and serves the order.

    python -m torch.distributed.run --nnodes 2 --node_rank I ... promote_job.py OUT
"""

from __future__ import annotations

import json
import logging
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
from llmtailor.store.tiers import collective, runtime  # noqa: E402

HOLD_PATIENCE = 300.0
"""Seconds a held follower waits for its node's retention before it gives up holding (and says so
in ``held.json``: the test then fails rather than hangs)."""


def retentions() -> tuple[threading.Condition, list[int]]:
    """The steps after whose commit this process ran its node's retention (``Tiers.committed``), as they run."""
    ran, steps = threading.Condition(), []
    committed = runtime.Tiers.committed

    def recorded(self, step, *args):
        committed(self, step, *args)
        with ran:
            steps.append(step)
            ran.notify_all()

    runtime.Tiers.committed = recorded
    return ran, steps


def holding_follower(out: Path, ahead: int) -> None:
    """Node 1's uploader (``NodeUploader._serve`` runs on a follower only) takes its first order
    up only once its node's retention ran after the commit of ``ahead`` steps past the composite
    ordered (module docstring)."""
    ran, steps = retentions()
    first, serve = threading.Event(), collective.NodeUploader._serve

    def held(self, order):
        if not first.is_set():
            first.set()
            staging = sorted(int(step) for step in order["staging"])
            until = staging[-1] + ahead
            with ran:
                reached = ran.wait_for(lambda: any(step >= until for step in steps), HOLD_PATIENCE)
                seen = list(steps)
            (out / "held.json").write_text(json.dumps({"staging": staging, "until": until, "reached": reached,
                                                       "retained": seen}))
        return serve(self, order)

    collective.NodeUploader._serve = held


def serving_late(hold: int) -> None:
    """Node 1's uploader (``NodeUploader._serve`` runs on a follower only) takes up the order of
    the first composite at or after ``hold`` only once this process's Tailor began to close
    (module docstring)."""
    closing = threading.Event()
    close, serve = runtime.Tiers.close, collective.NodeUploader._serve

    def closed(self, *args, **kwargs):
        closing.set()
        close(self, *args, **kwargs)

    def late(self, order):
        if max((int(step) for step in order.get("staging", {})), default=0) >= hold:
            closing.wait(HOLD_PATIENCE)
        return serve(self, order)

    runtime.Tiers.close = closed
    collective.NodeUploader._serve = late


def recording_uploads(out: Path) -> list[str]:
    """Record each file this process uploads in a promotion (``step:path``); hold at ``HOLD_AT``."""
    uploaded: list[str] = []
    upload, hold = collective.upload, os.environ.get("HOLD_AT")
    if hold:
        serving_late(int(hold))

    def recorded(source, dst, staging, node):
        done = upload(source, dst, staging, node)
        uploaded.extend(f"{step}:{entry.path}" for step in staging for entry in collective.node_files(source, step, node))
        if hold and node is not None and max(staging) >= int(hold):
            (out / "holding.tmp").write_text(json.dumps({"pid": os.getpid(), "staging": sorted(staging)}))
            os.replace(out / "holding.tmp", out / "holding")  # whole when the test finds it
            threading.Event().wait()  # mid-promotion, for good: the test kills the job now
        return done

    collective.upload = recorded
    if os.environ.get("HOLD_FOLLOWER"):
        holding_follower(out, int(os.environ["HOLD_FOLLOWER"]))
    return uploaded


def main() -> None:
    out = Path(sys.argv[1])
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))
    logging.getLogger("llmtailor").addHandler(handler)
    logging.getLogger("llmtailor").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    uploaded = recording_uploads(out)
    model, optimizer, scheduler = build("fsdp", seed=0)
    tiers = [Tier(os.environ["NODE_DIR"], scope="node", replicas=1, keep=int(os.environ.get("KEEP", "2")),
                  promote_every=2)]
    tailor = Tailor(os.environ["RUN_HOME"], model, optimizer, scheduler, policy=Parity(), tiers=tiers,
                    timeout=float(os.environ.get("TIMEOUT", "60")))
    start = tailor.restore().step + 1 if tailor.latest_step() is not None else 1
    for step in range(start, start + 6):
        train(model, optimizer, scheduler, [step])
        tailor.save(step)
    tailor.close()
    result = {"start": start, "uploaded": uploaded, "promoted": [p.step for p in tailor.tiers.promotions],
              "superseded": [s for p in tailor.tiers.promotions for s in p.superseded]}
    (out / f"result-{rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
