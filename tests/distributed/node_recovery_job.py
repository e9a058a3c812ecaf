"""The job of tests/distributed/test_node_recovery.py: FSDP2 or DDP on gloo, launched as "nodes"
(as ``torchrun --nnodes N --node_rank i``: ``helpers.node_launches``), each node with its own memory directory ``$NODE_DIR``
(the node-local tier: ``scope="node"``, ``replicas=2``) in front of the run ``$RUN_HOME`` (an
``s3://`` URL on moto's server: no directory is shared between nodes).

    python -m torch.distributed.run --nnodes N --node_rank I ... node_recovery_job.py SCENARIO KIND DIR [NAME=VALUE ...] ...

Several jobs (``SCENARIO KIND DIR``, each followed by the environment variables it is run with,
``NAME=VALUE``: its ``RUN_HOME``, ``NODE_DIR``, ``LAST``...) run in turn in one launch, so the
tests of several runs share the start-up of their processes; a job that kills its node is the
only one of its launch. Each rank writes its pid to ``DIR/pid-<rank>`` first (the test kills
ranks by it) and, at the end of a job, ``DIR/result-<scenario>-<rank>.json``. Rank 0 writes every tensor's full value at each save to
``DIR/versions/<step>.safetensors`` (its node's own disk, not its memory tier).

``train``  Parity saves at every step from 1 to ``$LAST``, async. With ``$KILL_NODE`` and
    ``$KILL_AT``: the ranks of that node SIGKILL themselves, ``$KILL_IN`` = ``training``: after
    the save of ``$KILL_AT`` was handed over (in flight) and its versions written; ``replication``:
    as they send their files of that save to their partner node (inside ``Courier.exchange_packed``);
    ``commit``: as that node's leader commits its copy of that save (the other nodes commit theirs;
    with ``$IN_FLIGHT`` = 2, only once the next save was handed over, as for ``announced``);
    ``announced``: once its files of that save were sent to and received from its partners (step 2
    of the node commit done), before it reports them to rank 0 (so no node commits that save), and
    only after the training thread handed the next save over and wrote its versions (with
    ``$IN_FLIGHT`` = 2: that save staged, in flight behind it); it writes ``DIR/staged-<next>``
    first. ``$REPLICAS`` (default 2): copies of each node's parts; ``$IN_FLIGHT`` (default 1):
    ``async_in_flight``.
``resume``  a writer that restores what ``latest_step`` finds (recording the report and the
    tensors that differ from their composite versions), then trains and saves up to ``$LAST``
    (if past the restored step; once the first of those saves committed, each node's leader
    verifies its node's copy: ``verified_after_training``) and closes (the last save promoted to
    ``$RUN_HOME``); it records the steps its node's copy holds once the writer started (what a
    crash left cleared).
    With ``$HOLD_LAST`` = 1 (2 ranks per node, node 1 replaced): the leader of node 0 holds the
    last file of its healing's stream until the second rank of node 1 (its leader alone
    receives) has taken a file of that healing for its restore (``hold_the_last_file``); each
    records what it saw (``held``, ``taken``). ``$TIMEOUT``: the Tailor's (default 120 s: a busy machine's slow rank is not a dead one).
``start``  a writer's start alone: the steps its node's copy holds once it started, and what
    ``latest_step`` answers; closed without a save (the error the close raised, if any).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from torch_job import build, compare_with_composite, rank, train, write_versions  # noqa: E402

from llmtailor import Parity, PromotionError, Tailor, Tier  # noqa: E402
from llmtailor.distributed.courier import Courier  # noqa: E402
from llmtailor.store.commit import SnapshotCommit  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402


def node() -> int:
    return int(os.environ["GROUP_RANK"])


def tailor_of(model, optimizer, scheduler) -> Tailor:
    tiers = [Tier(os.environ["NODE_DIR"], scope="node", replicas=int(os.environ.get("REPLICAS", "2")), keep=2, promote_every=1)]
    return Tailor(os.environ["RUN_HOME"], model, optimizer, scheduler, policy=Parity(), tiers=tiers, async_save=True,
                  async_in_flight=int(os.environ.get("IN_FLIGHT", "1")), timeout=float(os.environ.get("TIMEOUT", "120")))


def doomed() -> bool:
    return os.environ.get("KILL_NODE", "") == str(node())


def die_in_replication(step: int) -> dict:
    """This rank SIGKILLs itself when it sends its files of the save of ``step`` to its partners.
    Which save is sending is told by the thread that runs it (an async save's is named after its
    step), not by the step the training loop has reached: the loop may have moved on to the next
    step before the save in flight reaches its replication."""
    real, saving = Courier.exchange_packed, {"step": None}

    def exchange_packed(self, outgoing, sources, **landing):
        thread = threading.current_thread().name
        sending = int(thread.rsplit("-", 1)[1]) if thread.startswith("llmtailor-save-") else saving["step"]
        if sending == step and outgoing:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, outgoing, sources, **landing)

    Courier.exchange_packed = exchange_packed
    return saving


def die_in_commit(step: int, out: Path, in_flight: bool) -> threading.Event | None:
    """This node's leader SIGKILLs itself as it commits its copy of the save of ``step``; with
    ``in_flight``, only once the returned event is set (the next save handed over: in flight
    behind it), as ``die_once_announced``."""
    real, next_staged = SnapshotCommit.commit, threading.Event() if in_flight else None

    def commit(self, manifest, *args, **kwargs):
        if self.step == step:
            if next_staged is not None:
                next_staged.wait(300)
                (out / f"staged-{step + 1}").write_text(str(next_staged.is_set()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, manifest, *args, **kwargs)

    SnapshotCommit.commit = commit
    return next_staged


def die_once_announced(step: int, out: Path) -> threading.Event:
    """This rank SIGKILLs itself in the save of ``step`` after its files were replicated and before it
    reports them to rank 0 (``node_commit._announce``), once the returned event is set (the next save
    handed over): that save is then in flight behind it."""
    from llmtailor.store import node_commit

    real, next_staged = node_commit._announce, threading.Event()

    def announce(staged, placement, coord, round_, report):
        if staged.step == step:
            next_staged.wait(300)
            (out / f"staged-{step + 1}").write_text(str(next_staged.is_set()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(staged, placement, coord, round_, report)

    node_commit._announce = announce
    return next_staged


HELD = 120.0
"""The longest the leader of node 0 holds the last file (``hold_the_last_file``): the bound on a
restore that never takes a file before the healing ended (then it goes on, and says so)."""


def hold_the_last_file(seen: dict) -> None:
    """Rank 0 (node 0's leader, the sender) holds the last file its healing streams to node 1
    until rank 3 (node 1's second rank) has taken, for its restore, a file of that healing
    (``UnitReader.arrival`` handing it bytes while the file was registered as coming), at most
    ``HELD`` seconds; ``seen`` records whether it came first (``held``) and, on rank 3, the file
    (``taken``). The events, no timing: a restore that reads node 1's copy only once the
    healing ended takes nothing before the last file, and rank 0 waits in vain."""
    from datetime import timedelta

    from llmtailor.store.tiers import healing
    from llmtailor.store.units import UnitReader

    store, key = dist.distributed_c10d._get_default_store(), "test/taken-before-the-last-file"
    if rank() == 0:
        fill = healing.Healing._fill

        def held_fill(self, dst, name, into):
            if name == self._outgoing[dst][-1][0] and "held" not in seen:
                waiter = store.clone()  # a client of its own: a wait holds it (the restore's own calls go on)
                try:
                    waiter.wait([key], timedelta(seconds=HELD))
                    seen["held"] = {"file": name, "taken first": True}
                except Exception:  # noqa: BLE001 (the store's timeout)
                    seen["held"] = {"file": name, "taken first": False}
            return fill(self, dst, name, into)

        healing.Healing._fill = held_fill
    elif rank() == 3:
        arrival = UnitReader.arrival

        def taken(self, storage, key_, entry):
            coming = key_ in self.coming
            got = arrival(self, storage, key_, entry)
            if coming and got is not None and "taken" not in seen:
                seen["taken"] = key_
                store.set(key, "1")
            return got

        UnitReader.arrival = taken


def save_steps(tailor: Tailor, model, optimizer, scheduler, out: Path, first: int, last: int) -> None:
    kill_at = int(os.environ.get("KILL_AT", "0")) if doomed() else 0
    saving = die_in_replication(kill_at) if kill_at and os.environ.get("KILL_IN") == "replication" else {}
    next_staged = die_once_announced(kill_at, out) if kill_at and os.environ.get("KILL_IN") == "announced" else None
    if kill_at and os.environ.get("KILL_IN") == "commit":
        next_staged = die_in_commit(kill_at, out, in_flight=int(os.environ.get("IN_FLIGHT", "1")) > 1)
    for step in range(first, last + 1):
        train(model, optimizer, scheduler, [step])
        saving["step"] = step
        tailor.save(step, extra={"rank": rank(), "next": step + 1})
        write_versions(out, step, model, optimizer)  # collective: the async save's copies are taken by then
        if step == kill_at and os.environ.get("KILL_IN") == "training":
            os.kill(os.getpid(), signal.SIGKILL)
        if next_staged is not None and step == kill_at + 1:
            next_staged.set()


def verified_after_training(tailor: Tailor) -> list[str] | None:
    """Once the first step trained after the restore (writing into the optimizer's state, which
    the restore made with no live tensor to land in) and its save committed: what ``Run.verify``
    finds wrong in this node's copy (a Run of its own), raised at once; None on a rank other than
    its node's leader. The restored snapshot is still kept (``keep=2``): a healed copy whose bytes
    the restore was handed as they are committed (a view of them written into by training) fails."""
    tailor.wait()
    dist.barrier()  # every node's commit of that save ended: no retention under way while the copy is read
    if int(os.environ["LOCAL_RANK"]) != 0:
        return None
    problems = Run(os.environ["NODE_DIR"]).verify()
    if problems:  # said at once: a corrupted copy fails this job's later saves and its close (their promotion) too
        raise SystemExit(f"node {node()}: its copy after the first step trained since the restore: {problems}")
    return problems


def resume(kind: str, out: Path) -> dict:
    model, optimizer, scheduler = build(kind, seed=5)
    tailor = tailor_of(model, optimizer, scheduler)
    seen: dict = {}
    if os.environ.get("HOLD_LAST") == "1":
        hold_the_last_file(seen)
    held_at_start = Run(os.environ["NODE_DIR"]).steps()
    found = tailor.latest_step()
    report = tailor.restore()
    tailor.tiers.settle_healing()  # a healed copy is committed once the restore ended: read below through a Run of its own
    result = {"held_at_start": held_at_start, "latest": found, "restored": report.step, "tier": report.tier, "served_by": report.served_by,
              "skipped": report.skipped, "extra": report.extra,
              "mismatches": compare_with_composite(out, report.tier, model, optimizer), **seen}
    last = int(os.environ.get("LAST", "0"))
    save_steps(tailor, model, optimizer, scheduler, out, report.step + 1, min(last, report.step + 1))
    if last > report.step:
        result["verified after training"] = verified_after_training(tailor)
    save_steps(tailor, model, optimizer, scheduler, out, report.step + 2, last)
    tailor.close()
    result["promoted"] = [p.step for p in tailor.tiers.promotions]
    return result


def jobs(args: list[str]) -> list[tuple[str, str, Path, dict[str, str]]]:
    """``SCENARIO KIND DIR [NAME=VALUE ...]`` groups: each job and its environment."""
    parsed: list[tuple[str, str, Path, dict[str, str]]] = []
    while args:
        if len(args) < 3 or any("=" in arg for arg in args[:3]):
            raise SystemExit(f"expected SCENARIO KIND DIR [NAME=VALUE ...], got {args}")
        scenario, kind, out, args = args[0], args[1], Path(args[2]), args[3:]
        settings = {}
        while args and "=" in args[0]:
            name, value = args.pop(0).split("=", 1)
            settings[name] = value
        parsed.append((scenario, kind, out, settings))
    return parsed


def run_in_turn(run_job) -> None:
    """The jobs of the command line, ``run_job(scenario, kind, dir)`` for each in turn, in one
    process group, each with its environment."""
    work = jobs(sys.argv[1:])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for scenario, kind, out, settings in work:
        out.mkdir(parents=True, exist_ok=True)
        with environment(settings):
            run_job(scenario, kind, out)
        dist.barrier()
    dist.destroy_process_group()


@contextmanager
def environment(settings: dict[str, str]):
    """``os.environ`` with ``settings`` for one job's turn, as it was afterwards."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def run_job(scenario: str, kind: str, out: Path) -> None:
    (out / f"pid-{rank()}").write_text(str(os.getpid()))
    if scenario == "train":
        model, optimizer, scheduler = build(kind, seed=0)
        tailor = tailor_of(model, optimizer, scheduler)
        save_steps(tailor, model, optimizer, scheduler, out, 1, int(os.environ["LAST"]))
        tailor.close()
        result = {"promoted": [p.step for p in tailor.tiers.promotions]}
        del model, optimizer, scheduler, tailor  # the DDP model gone before the group is destroyed (bench_object_store.worker: pytorch#56297)
    elif scenario == "resume":
        result = resume(kind, out)
    elif scenario == "start":
        tailor = tailor_of(*build(kind, seed=5))
        result = {"held_at_start": Run(os.environ["NODE_DIR"]).steps(), "latest": tailor.latest_step()}
        try:
            tailor.close()  # promotes the newest composite: step 2 (what the promoter knew of 3 is gone)
            result["closed"] = None
        except PromotionError as err:
            result["closed"] = str(err)
        result["promoted"] = [p.step for p in tailor.tiers.promotions]
        del tailor  # the DDP model gone before the group is destroyed (bench_object_store.worker: pytorch#56297)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    (out / f"result-{scenario}-{rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_in_turn(run_job)
