"""A job for tests/distributed/test_collective_promotion.py, run as by ``torchrun --nnodes 2`` (``helpers.node_launches``) (one
launch per "node", each with its own TMPDIR):

``promote``  FSDP2, Parity saves at steps ``start..start+5`` into a node-local tier
(``replicas=1``: each node holds its own parts only) at ``$NODE_DIR``, promoted every 2 steps to
``$RUN_HOME`` (the moto server's bucket), then ``close()``. Resumes from the newest composite of
any tier when there is one.
``unclosed``  FSDP2, async Parity saves at steps 1..4 into a node-local tier (``replicas=2``: each
node holds the whole composite) at ``$NODE_DIR/<variant>`` in front of ``$RUN_HOME/<variant>``, in
two runs: ``between`` (``promote_every=100``: step 1 promoted, none due at the last save) then
``due`` (``promote_every=1``: a promotion due at every save, the last one's at exit). Versions
under ``DIR/<variant>``. Neither Tailor is closed, ``between``'s dropped (a local of a function
that returned), ``due``'s kept (a script's global): the script ends with
``dist.destroy_process_group()`` right after the last save, then exits, the last save in flight:
``due``'s copies of step 4 to the partner node are sent only once the group is destroyed (its
exchange held until then). Must be the last job of its launch.
With ``HOLD_EXIT=<step>``, node 1's leader takes an order naming that step up only once its
interpreter began its at-exit work (every save and promotion thread ended by then): the latest a
follower can be, for the promotion due at the last save.
``dropped``  FSDP2, four writers in turn, each saving step 1 of its own run
(``$RUN_HOME/<i>``, a node-local tier at ``$NODE_DIR/<i>``, promoted at every save), the first
closed and kept, the others dropped without ``close()``: what each rank still runs, keeps and
holds connected for them once its uploaders ended (``dropped``).
``fsdp-url``  torch_job.py's scenario of that name (test_object_store_nodes.py's run, saved to
``$RUN_ROOT``), in the launch of the promotions: the tests share its start-up.

    python -m torch.distributed.run --nnodes 2 --node_rank I ... promote_job.py SCENARIO KIND DIR [NAME=VALUE ...] ...

Several jobs in turn in one launch, each with its environment (``node_recovery_job.run_in_turn``);
each rank writes ``DIR/result-<scenario>-<rank>.json``. A job that holds for good (``HOLD_AT``)
is the only one of its launch.

Each process of a ``promote`` job records the files it uploaded in promotions
(``collective.upload``); every job logs llmtailor's INFO messages to its stderr (a follower's order
found gone says so there). With ``HOLD_AT=<step>``, each node's leader, once it has uploaded its
node's parts for the promotion of the first composite at or after that step (the same order on
every node), writes ``DIR/holding`` (its process id and the steps of the order) and stops there
for good (until the test kills the job: each rank runs in a session of its own); node
1's leader takes that order up only once its Tailor began to close: every save of its node
committed and its node's retention ran after each (the worst case for the order, whenever it was
posted).

With ``KEEP=<k>`` the node-local tier keeps ``k`` composites (default 2). With
``HOLD_FOLLOWER=<n>``, node 1's leader takes its first promotion order (of the composite of
step ``c``) up, before it leases or reads anything, only once its own saves have committed step
``c + n`` and run the node's retention after it (the event, not a time: an uploader as late as
it can be); it then records what it waited for in ``DIR/held.json`` and serves the order. What a job patches in llmtailor is put back when it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_recovery_job import run_in_turn  # noqa: E402
from torch_job import build, rank, run_scenario, train, write_versions  # noqa: E402

from llmtailor import Parity, Tailor, Tier  # noqa: E402
from llmtailor.store import node_commit  # noqa: E402
from llmtailor.store.tiers import collective, runtime  # noqa: E402

HOLD_PATIENCE = 300.0
"""Seconds a held follower waits for its node's retention before it gives up holding (and says so
in ``held.json``: the test then fails rather than hangs)."""


def retentions(patches: ExitStack) -> tuple[threading.Condition, list[int]]:
    """The steps after whose commit this process ran its node's retention (``Tiers.committed``),
    as they run, until ``patches`` closes."""
    ran, steps = threading.Condition(), []
    committed = runtime.Tiers.committed

    def recorded(self, step, *args):
        committed(self, step, *args)
        with ran:
            steps.append(step)
            ran.notify_all()

    patches.enter_context(mock.patch.object(runtime.Tiers, "committed", recorded))
    return ran, steps


def holding_follower(out: Path, ahead: int, patches: ExitStack) -> None:
    """Node 1's uploader (``NodeUploader._serve`` runs on a follower only) takes its first order
    up only once its node's retention ran after the commit of ``ahead`` steps past the composite
    ordered (module docstring)."""
    ran, steps = retentions(patches)
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

    patches.enter_context(mock.patch.object(collective.NodeUploader, "_serve", held))


def serving_late(hold: int, patches: ExitStack) -> None:
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

    patches.enter_context(mock.patch.object(runtime.Tiers, "close", closed))
    patches.enter_context(mock.patch.object(collective.NodeUploader, "_serve", late))


def serving_at_exit(step: int, patches: ExitStack) -> None:
    """Node 1's uploader takes an order naming ``step`` up only once the interpreter's at-exit
    work began (module docstring): a hook registered now, after llmtailor's, runs before them."""
    began, serve = threading.Event(), collective.NodeUploader._serve
    atexit.register(began.set)

    def late(self, order):
        if step in (int(s) for s in order.get("staging", {})):
            began.wait(HOLD_PATIENCE)
        return serve(self, order)

    patches.enter_context(mock.patch.object(collective.NodeUploader, "_serve", late))


@contextmanager
def recording_uploads(out: Path):
    """Each file this process uploads in a promotion inside the block (``step:path``), in a list;
    holds at ``HOLD_AT``, or node 1's first order (``HOLD_FOLLOWER``)."""
    uploaded: list[str] = []
    upload, hold, ahead = collective.upload, os.environ.get("HOLD_AT"), os.environ.get("HOLD_FOLLOWER")

    def recorded(source, dst, staging, node):
        done = upload(source, dst, staging, node)
        uploaded.extend(f"{step}:{entry.path}" for step in staging for entry in collective.node_files(source, step, node))
        if hold and node is not None and max(staging) >= int(hold):
            (out / "holding.tmp").write_text(json.dumps({"pid": os.getpid(), "staging": sorted(staging)}))
            os.replace(out / "holding.tmp", out / "holding")  # whole when the test finds it
            threading.Event().wait()  # mid-promotion, for good: the test kills the job now
        return done

    with ExitStack() as patches:
        if hold:
            serving_late(int(hold), patches)
        if ahead:
            holding_follower(out, int(ahead), patches)
        patches.enter_context(mock.patch.object(collective, "upload", recorded))
        yield uploaded


def promote(kind: str, out: Path) -> dict:
    with recording_uploads(out) as uploaded:
        model, optimizer, scheduler = build(kind, seed=0)
        tiers = [Tier(os.environ["NODE_DIR"], scope="node", replicas=1, keep=int(os.environ.get("KEEP", "2")),
                      promote_every=2)]
        tailor = Tailor(os.environ["RUN_HOME"], model, optimizer, scheduler, policy=Parity(), tiers=tiers,
                        timeout=float(os.environ.get("TIMEOUT", "60")))
        start = tailor.restore().step + 1 if tailor.latest_step() is not None else 1
        for step in range(start, start + 6):
            train(model, optimizer, scheduler, [step])
            tailor.save(step)
        tailor.close()
    return {"start": start, "uploaded": uploaded, "promoted": [p.step for p in tailor.tiers.promotions],
            "superseded": [s for p in tailor.tiers.promotions for s in p.superseded]}


UNCLOSED: list[Tailor] = []
"""``unclosed``'s Tailor kept alive until the interpreter ends, as a script's global."""
DESTROYED = threading.Event()
"""Set once ``unclosed``'s script destroyed its process group (``run_job``)."""


def replicating_after_destroy(step: int, patches: ExitStack) -> None:
    """``due``'s save of ``step`` sends its copies to the partner node only once the script
    destroyed its process group: the save in flight at ``destroy_process_group()``, whatever the
    machine's speed."""
    replicate = node_commit._replicate

    def late(snapshot, part, placement, rank, turn, *into):
        if snapshot is not None and snapshot.step == step and UNCLOSED and placement is UNCLOSED[0].tiers.placement:
            DESTROYED.wait(HOLD_PATIENCE)
        return replicate(snapshot, part, placement, rank, turn, *into)

    patches.enter_context(mock.patch.object(node_commit, "_replicate", late))


def unclosed(kind: str, out: Path) -> dict:
    patches = ExitStack()  # never closed: the patch holds until the process ends
    if os.environ.get("HOLD_EXIT"):
        serving_at_exit(int(os.environ["HOLD_EXIT"]), patches)
    replicating_after_destroy(4, patches)
    for variant, every in (("between", 100), ("due", 1)):
        model, optimizer, scheduler = build(kind, seed=0)
        tiers = [Tier(f"{os.environ['NODE_DIR']}/{variant}", scope="node", replicas=2, keep=2, promote_every=every)]
        tailor = Tailor(f"{os.environ['RUN_HOME']}/{variant}", model, optimizer, scheduler, policy=Parity(),
                        tiers=tiers, async_save=True, timeout=float(os.environ.get("TIMEOUT", "60")))
        if variant == "due":
            UNCLOSED.append(tailor)
        for step in range(1, 5):
            train(model, optimizer, scheduler, [step])
            tailor.save(step, extra={"next": step + 1})
            write_versions(out / variant, step, model, optimizer)  # collective: the save's copies are taken by then
    return {"saved": [1, 2, 3, 4]}  # no close(): the last save, and the promotion due, end at exit


def dropped(kind: str, out: Path) -> dict:
    """Four writers in turn (a sweep), each of a run of its own (``$RUN_HOME/<i>``, a node-local
    tier ``$NODE_DIR/<i>`` promoted at every save), saving step 1: the first closed and kept by
    the script to the end, the others dropped without ``close()``; no collection of cycles
    meanwhile (``gc`` off: what goes, goes as its last reference does). Once the writers' own
    threads ended (the events waited for, with a bound): the uploaders still running, the
    writers the exit still keeps (``runtime._UNCLOSED``), the writers' own threads still alive
    (``WRITERS_THREADS``), by name, and the process's connections more than before the first
    writer (``connections``), once the first was closed and at the end."""
    import gc

    before, kept = set(threading.enumerate()), len(runtime._UNCLOSED)
    gc.collect()
    gc.disable()
    try:
        connected, more = connections(), []
        for i in range(4):
            model, optimizer, scheduler = build(kind, seed=0)
            tiers = [Tier(f"{os.environ['NODE_DIR']}/{i}", scope="node", replicas=1, promote_every=1)]
            tailor = Tailor(f"{os.environ['RUN_HOME']}/{i}", model, optimizer, scheduler, policy=Parity(), tiers=tiers,
                            timeout=float(os.environ.get("TIMEOUT", "60")))
            train(model, optimizer, scheduler, [1])
            tailor.save(1)
            if i == 0:
                tailor.close()
                more.append(len(connections() - connected))
                closed = tailor  # kept (a script's global): a closed writer holds no connection
            del tailor, model, optimizer, scheduler
        # The events: rank 0's promotions in flight end, then what they held goes (their tier's
        # lock and its renewal thread), and each node's uploaders, told to stop, end.
        deadline = time.monotonic() + HOLD_PATIENCE  # a bound on a hang, for all of them
        for names in (("llmtailor-promote",), WRITERS_THREADS):
            for thread in [t for t in threading.enumerate() if t.name in names and t not in before]:
                thread.join(max(deadline - time.monotonic(), 0))
        more.append(len(connections() - connected))
        left = [t for t in threading.enumerate() if t not in before]
    finally:
        gc.enable()
    del closed
    return {"uploaders": sum(t.name == "llmtailor-node-upload" for t in left), "unclosed": len(runtime._UNCLOSED) - kept,
            "threads": sorted(t.name for t in left if t.name in WRITERS_THREADS), "connections": more}


def connections() -> set[str]:
    """This process's TCP connections and listening sockets (its own: a dropped writer's gloo
    group, a coordinator's clients of the job's store), but those to moto's server (the
    process's pool of HTTP connections) and those the job's store accepted (its peers close
    them in their own time): their sockets' inodes. A writer holds the ones not there before
    it; one there before that closed meanwhile (an earlier job's, on a busy machine) is no
    connection less of the writer's (counted as one, it read -2 at load 30)."""
    moto = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1].split("/")[0])
    store = int(os.environ["MASTER_PORT"])
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor)
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = (int(end.rsplit(":", 1)[1], 16) for end in fields[1:3])
            if fields[9] in inodes and moto not in (local, remote) and local != store:
                found.add(fields[9])
    return found


WRITERS_THREADS = ("llmtailor-node-upload", "llmtailor-promote", "llmtailor-lock")
"""The threads a writer starts for itself (the others are the process's pools: fsync, uploads)."""


def run_job(scenario: str, kind: str, out: Path) -> None:
    if scenario == "promote":
        result = promote(kind, out)
    elif scenario == "dropped":
        result = dropped(kind, out)
    elif scenario == "unclosed":
        result = unclosed(kind, out)
    elif scenario == "fsdp-url":
        result = run_scenario(scenario, out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    (out / f"result-{scenario}-{rank()}.json").write_text(json.dumps(result))
    if scenario == "unclosed":  # the script's last lines, its saves in flight (no close() nor wait())
        dist.destroy_process_group()
        DESTROYED.set()
        sys.exit(0)


if __name__ == "__main__":
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))
    logging.getLogger("llmtailor").addHandler(handler)
    logging.getLogger("llmtailor").setLevel(logging.INFO)
    run_in_turn(run_job)
