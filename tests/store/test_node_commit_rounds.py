"""The node-scoped commit's meetings between nodes, in one process: two "nodes" of one rank each
(threads), their coordinators over one c10d ``HashStore``, copies carried between the threads
as the courier carries them. A node opens its staging place without waiting for the other
(no round before the parts are written), and a node that cannot open it fails the save on
every rank, naming it, with nothing committed anywhere. The same commit with real processes:
tests/distributed/test_node_tiers.py."""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import HashStore
from helpers import landed, on_threads, progressing

from llmtailor.constants import MANIFEST_FILE, TMP_DIR, snapshot_dirname
from llmtailor.distributed.coordinator import _LOOKS, CoordinationError, StoreCoordinator
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import NodeTierError
from llmtailor.layouts import layout_from_names
from llmtailor.store.node_commit import NodePlacement, persist_on_nodes
from llmtailor.store.run import Run
from llmtailor.store.staged import StagedSnapshot, StagedUnit
from llmtailor.store.storage.local_lock import LEASE_FILE

LAYOUT = layout_from_names(["model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.norm.weight"])


class ThreadCourier:
    """What ``Courier.exchange_packed`` does between processes, between threads: each
    (source, destination) pair one queue; a source's files not in within ``timeout`` fail the
    exchange, as the courier's receive does."""

    def __init__(self, rank: int, lanes: dict[tuple[int, int], queue.Queue], timeout: float = 60):
        self.rank, self.lanes, self.timeout = rank, lanes, timeout

    def exchange_packed(self, outgoing, sources, into=None):
        for destination, packed in outgoing.items():
            self.lanes[self.rank, destination].put(packed)
        try:
            return {source: landed(self.lanes[source, self.rank].get(timeout=self.timeout), source, into)
                    for source in sources}
        except queue.Empty:
            raise CoordinationError(f"rank {self.rank}: a receipt timed out after {self.timeout:g} s") from None


def staged(rank: int) -> StagedSnapshot:
    """Rank ``rank``'s share of step 1 (DDP: rank 0 writes the units, both their global state)."""
    units = iter([StagedUnit.whole(u, {f"weight/{n}": torch.full((4,), float(rank + 1))})
                  for u in LAYOUT.units for n in LAYOUT.units[u]] if rank == 0 else [])
    return StagedSnapshot(step=1, parent=None, save_index=0, policy="test", layout=LAYOUT.to_record(), units=units,
                          composite={u: 1 for u in LAYOUT.units}, global_doc={} if rank == 0 else None,
                          global_tensors={} if rank == 0 else None, rank_doc={} if rank else None,
                          rank_tensors={} if rank else None, world_size=2)


def save_on_two_nodes(tmp_path, prepare=None, wait_for_node_0=False, spare=None, confirm=None, wrote=None,
                      timeout=60, gave_up=None):
    """Step 1 saved by two one-rank nodes, each into its own copy; ``prepare(rank)``: each
    leader's ``prepare``, ``spare(rank)`` each rank's ``spare``, ``confirm(rank, store)`` each
    leader's ``confirm``; ``wrote(store)``: called as node 0 writes its first unit; ``wait_for_node_0``:
    node 1 begins its commit only once node 0 has written a unit into its copy. ``timeout``:
    the coordinators' and the courier's (60 s: a bound on a hang, which no test waits out);
    ``gave_up``: the ranks whose coordinator gave up waiting are added to it. Each rank's result
    or error."""
    store, lanes = HashStore(), {(a, b): queue.Queue() for a in range(2) for b in range(2)}
    node_0_wrote = threading.Event()

    def written(unit, size):
        if not node_0_wrote.is_set() and wrote is not None:
            wrote(store)
        node_0_wrote.set()

    def run(rank):
        if rank == 1 and wait_for_node_0 and not node_0_wrote.wait(60):
            raise AssertionError("node 0 wrote nothing of its part before node 1 began the save")
        placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=ThreadCourier(rank, lanes, timeout))
        coord = StoreCoordinator.over(store, rank, 2, timeout=timeout)
        try:
            return persist_on_nodes(Run(tmp_path / f"node{rank}"), staged(rank), placement, coord,
                                    on_unit=written if rank == 0 else None, prepare=prepare and (lambda: prepare(rank)),
                                    spare=spare and (lambda: spare(rank)), confirm=confirm and (lambda: confirm(rank, store)))
        except CoordinationError:
            if gave_up is not None:
                gave_up.append(rank)
            raise

    return on_threads(2, run)


def test_a_node_writes_its_part_before_the_other_node_has_begun_the_save(tmp_path):
    """Node 1 begins only once node 0 has written a unit into its own copy: opening the
    snapshot is no meeting between nodes (each node waited there for every other: node 0 waited
    for node 1, which waited for node 0's unit, until the timeout), and the snapshot commits on
    both nodes, each holding both nodes' parts and the same manifest."""
    outcomes = save_on_two_nodes(tmp_path, wait_for_node_0=True)
    assert [type(o).__name__ for o in outcomes] == ["PersistResult"] * 2, outcomes
    copies = [Run(tmp_path / f"node{node}") for node in range(2)]
    assert [copy.steps() for copy in copies] == [[1], [1]]
    manifests = [(tmp_path / f"node{node}" / "snapshots").glob("*/manifest.json") for node in range(2)]
    texts = [next(found).read_bytes() for found in manifests]
    assert texts[0] == texts[1]
    listings = [sorted(p.relative_to(tmp_path / f"node{n}" / "snapshots") for p in (tmp_path / f"node{n}" / "snapshots").rglob("*")
                       if p.is_file()) for n in range(2)]
    assert listings[0] == listings[1] and any("rank-00001" in str(p) for p in listings[0])


@pytest.mark.parametrize("failing_node", [0, 1])
def test_a_node_that_cannot_open_the_snapshot_fails_every_rank_naming_it_and_nothing_is_committed(tmp_path, failing_node):
    def prepare(rank):
        if rank == failing_node:
            raise OSError(28, "No space left on device")

    outcomes = save_on_two_nodes(tmp_path, prepare=prepare)
    assert [type(o) for o in outcomes] == [NodeTierError, NodeTierError], outcomes
    assert {str(o) for o in outcomes} == {str(outcomes[0])}
    assert f"could not be written on node(s) [{failing_node}]" in str(outcomes[0])
    for node in range(2):
        copy = Run(tmp_path / f"node{node}")
        assert copy.steps() == [] and not (tmp_path / f"node{node}" / "latest").exists()
        tmp = tmp_path / f"node{node}" / ".tmp"
        assert not tmp.exists() or not any(tmp.iterdir())


def test_a_node_whose_commit_goes_on_past_the_timeout_keeps_the_others_waiting_and_one_stuck_is_named(tmp_path):
    """Rank 0 waited for every node's commit (``_settle``) within the timeout, whatever that
    node did meanwhile: a node whose commit took longer (its copies' fsyncs on a slow disk) failed
    every rank, alive as it was. Every rank is inside ``working`` throughout the node commit, so
    rank 0 waits on while node 1's commit advances (here past 1.5 x the timeout: it saw the
    progress 6 times, 4 looks a timeout); a node whose commit stops making progress there is
    named once it has shown none for the timeout. Node 1's leader's ``confirm`` (just before its
    manifest) stands for the slow work. Timeout 2 s."""
    gave_up: list[int] = []

    def slow(rank, store):
        if rank == 1:
            progressing(store, [0], _LOOKS + 2, gave_up)

    outcomes = save_on_two_nodes(tmp_path / "slow", confirm=slow, timeout=2, gave_up=gave_up)
    assert [type(o).__name__ for o in outcomes] == ["PersistResult"] * 2, outcomes

    def stuck(rank, store):
        if rank == 1:
            progressing(store, [0], 1, gave_up)
            while not gave_up:
                time.sleep(0.01)

    outcomes = save_on_two_nodes(tmp_path / "stuck", confirm=stuck, timeout=2, gave_up=gave_up)
    assert isinstance(outcomes[0], CoordinationError), outcomes
    assert re.match(r"rank\(s\) \[1\] did not report on its commit of step 1 within 2 s", str(outcomes[0])), outcomes
    # Node 1's commit goes on once rank 0 gave up: it never publishes the snapshot (rank 0 claimed
    # its gate first), every rank raises alike, and neither copy holds it. Before: node 1 committed
    # and returned success, node 0's copy kept it too, and rank 0 reported the save failed.
    assert type(outcomes[1]) is CoordinationError and str(outcomes[1]) == str(outcomes[0]), outcomes
    assert "rank 0 gave up on the commit of node(s) [1], which never commit it" in str(outcomes[0])
    assert [Run(tmp_path / "stuck" / f"node{node}").steps() for node in range(2)] == [[], []]


def test_a_save_stuck_in_its_commit_is_not_shown_live_by_the_next_save_of_its_rank_in_flight(tmp_path):
    """Two async saves in flight (``InTurn``): the next save's part is written while this one
    commits, each on a thread of its own, both inside ``working``. Node 1's commit of step 1
    hangs (its ``confirm``, before the manifest: a hung disk) while its writer of step 2 advances
    (its ``prepare``, a slow disk). Rank 0 waits for node 1's commit of step 1: it gives up after
    the timeout of silence, naming rank 1, never having seen progress of step 1's. Before: every
    block of a rank beat in one lane, so step 2's progress showed step 1's commit live, and rank 0
    waited on (here until it had seen it _LOOKS + 2 times): "within 2 s of its last sign of
    progress". Each save's block now beats in its round's lane. Timeout 2 s."""
    from dataclasses import replace

    from llmtailor.store.staged import InTurn

    store, lanes = HashStore(), {(a, b): queue.Queue() for a in range(2) for b in range(2)}
    coords = [StoreCoordinator.over(store, rank, 2, timeout=2) for rank in range(2)]
    gave_up: list[int] = []

    def hung(rank):
        while rank == 1 and not gave_up:
            time.sleep(0.01)

    def slow(rank):
        if rank == 1:
            progressing(store, [0], _LOOKS + 2, gave_up)

    def save(rank, step, turn, prepare=None, confirm=None):
        placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=ThreadCourier(rank, lanes, 60))
        share = replace(staged(rank), step=step, parent=step - 1 or None, round=f"r{step}", turn=turn,
                        composite={u: step for u in LAYOUT.units})
        try:
            result = persist_on_nodes(Run(tmp_path / f"node{rank}"), share, placement, coords[rank],
                                      prepare=prepare and (lambda: prepare(rank)), confirm=confirm and (lambda: confirm(rank)))
        except BaseException as err:
            if isinstance(err, CoordinationError):
                gave_up.append(rank)
            turn.end(False)
            raise
        turn.end(True)
        return result

    turns = [InTurn(step=1) for _ in range(2)]
    nexts = [InTurn(step=2, before=turns[rank]) for rank in range(2)]
    outcomes = on_threads(4, lambda n: save(n % 2, 1, turns[n % 2], confirm=hung) if n < 2
                          else save(n % 2, 2, nexts[n % 2], prepare=slow))
    assert isinstance(outcomes[0], CoordinationError), outcomes
    assert re.match(r"rank\(s\) \[1\] did not report on its commit of step 1 within 2 s: a rank died", str(outcomes[0])), outcomes


def test_each_file_a_commit_makes_durable_is_progress_its_rank_shows(tmp_path):
    """A leader's commit drains its files' fsyncs (its received copies: every other node's part),
    which on a slow disk outlast the timeout: each fsync ended is progress (``advance``), which
    its rank's beat shows the ranks waiting for it (``working``); none was, so a commit's fsyncs
    were silence however many ended."""
    from llmtailor.distributed.progress import Scope, within
    from llmtailor.store.commit import SnapshotCommit

    snapshot = SnapshotCommit.begin(Run(tmp_path), 1)
    with within(scope := Scope()), snapshot.files() as create:  # the fsyncs run on threads of their own
        for n in range(3):
            sink = create(f"copy-{n}")
            sink.write(b"copied")  # no progress of its own (the checked writes' is theirs)
            sink.close()
        create.drain()
    assert scope.ticks >= 3


def test_a_rank_whose_partner_writes_a_large_part_past_the_timeout_waits_for_it_before_the_copies(tmp_path):
    """DDP on two one-rank nodes: rank 0 writes every unit, rank 1 only its own state, so rank 1
    was at its copies at once and waited there for rank 0's files within the courier's timeout:
    a part whose writing took longer (a large model, a slow disk) failed the save, rank 0 alive
    as it was. Each rank waits until its partners say their part is written (``_ready``, inside
    ``working``: on while they advance), then the copies start; here rank 0's part goes on past
    1.5 x the timeout. Timeout 2 s."""
    gave_up: list[int] = []
    outcomes = save_on_two_nodes(tmp_path, wrote=lambda store: progressing(store, [1], _LOOKS + 2, gave_up), timeout=2,
                                 gave_up=gave_up)
    assert [type(o).__name__ for o in outcomes] == ["PersistResult"] * 2, outcomes
    assert [Run(tmp_path / f"node{node}").steps() for node in range(2)] == [[1], [1]]


def test_rank_0s_word_on_what_retention_spares_comes_with_the_commit_to_every_node(tmp_path):
    """``spare`` (``Tiers.may_promote``: what rank 0's promoter may still read) is asked on rank 0 alone,
    once its copy committed the save, and every rank's result carries the answer: each node's
    retention after the save spares the same composites (``Tiers.committed``)."""
    asked = []

    def spare(rank):
        asked.append((rank, Run(tmp_path / "node0").steps()))
        return [7]

    outcomes = save_on_two_nodes(tmp_path, spare=spare)
    assert [getattr(o, "spare", o) for o in outcomes] == [(7,), (7,)] and asked == [(0, [1])]


def test_a_node_leader_makes_its_received_copies_and_indexes_durable_beside_its_manifest(tmp_path, monkeypatch):
    """Each node's leader keeps the copies it received and the unit indexes in flight until its
    commit, which fsyncs them beside its manifest and directories (``SnapshotCommit.commit``'s
    ``pending``, as the shared writer's leader does): one wait on the disk where there were three
    (the copies, then the indexes, then the manifest). Here node 0's received copies' fsyncs are
    each held until its manifest's fsync has begun (the event; the wait's bound is a bound on a
    hang): waited for before the manifest is written, they never see it. Durability is as before:
    on each node, every file and directory of the snapshot is fsynced before the rename that
    publishes it, and no fsync is added (13 on each node, as before)."""
    root = Path(os.path.realpath(tmp_path))
    events, lock, manifest_begun, seen = [], threading.Lock(), threading.Event(), []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(f"{root}/node0/{TMP_DIR}/"):
            if path.endswith(f"/{MANIFEST_FILE}"):
                manifest_begun.set()
            elif "/ranks/rank-00001." in path:  # a copy node 0 received from rank 1 (node 1)
                seen.append(manifest_begun.wait(60))
        size = os.fstat(fd).st_size
        real_fsync(fd)
        with lock:
            events.append(("fsync", path, size))

    def rename(src, dst, *args, **kwargs):
        with lock:
            events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    outcomes = save_on_two_nodes(root)
    monkeypatch.undo()
    assert [type(o).__name__ for o in outcomes] == ["PersistResult"] * 2, outcomes
    assert seen == [True, True]
    for node in range(2):
        final = root / f"node{node}" / "snapshots" / snapshot_dirname(1)
        published = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final))
        staging = Path(events[published][1])
        synced = {(e[1], e[2]) for e in events[:published] if e[0] == "fsync"}
        for directory, _, files in os.walk(final):
            staged = staging / Path(directory).relative_to(final)
            assert any(path == str(staged) for path, _ in synced), f"{staged} not fsynced before the snapshot's rename"
            for name in files:
                if name != LEASE_FILE:  # empty, made with the staging directory: its entry is the directory's
                    assert (str(staged / name), (Path(directory) / name).stat().st_size) in synced, staged / name
        mine = [e for e in events if e[0] == "fsync" and (e[1] + "/").startswith(f"{root}/node{node}/")]
        assert len(mine) == 13, [e[1][len(str(root)):] for e in mine]


def test_a_save_waits_on_while_a_node_leader_settles_the_copy_its_healing_still_writes_past_the_timeout(tmp_path):
    """The first save after a restore that healed a node's copy: that node's leader settles the
    healed copy's background commit (``Tiers.prepare_save``: its writes and fsyncs, on the
    healing's threads, held back until the restore ended) inside the save's first message. That
    work's progress is the healing's (``Tiers.healing_progress``), not the save's block's, so its
    rank showed none and the others gave up after the timeout, alive as it was (the restore's and
    close's waits for a healing count it: ``working(*healing_progress)``). Here the healing's
    writes go on past 1.5 x the timeout. Two one-rank nodes as threads through
    ``Tailor._persist``, rank 1's copy healed; timeout 2 s."""
    from types import SimpleNamespace

    from llmtailor import Tier, Tailor
    from llmtailor.distributed.progress import Scope, within
    from llmtailor.store.tiers import Tiers

    store, lanes, gave_up = HashStore(), {(a, b): queue.Queue() for a in range(2) for b in range(2)}, []
    tiers = [Tiers(tmp_path / "home", [Tier(tmp_path / f"node{n}", scope="node")]) for n in range(2)]
    healing = Scope()
    tiers[1].healing_progress = (healing,)
    written = tiers[1].first.run.commit_coming(7)  # a healed snapshot still committing in the background

    def heal() -> None:  # the healing's writer thread: its progress counts for the healing alone
        with within(healing):  # seen by rank 0's waits in the save's lane (its round's: the first, "r1")
            progressing(store, [0], _LOOKS + 2, gave_up, lane="r1")
        written.set_result(None)

    def run(rank):
        tailor = Tailor.__new__(Tailor)
        tailor.tiers, tailor.run, tailor.config = tiers[rank], tiers[rank].first.run, SimpleNamespace(timeout=2.0)
        tailor.tiers.placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=ThreadCourier(rank, lanes, 2))
        tailor.coordinator = StoreCoordinator.over(store, rank, 2, timeout=2)
        if rank == 1:
            threading.Thread(target=heal, daemon=True).start()
        try:
            return tailor._persist(staged(rank))
        except CoordinationError:
            gave_up.append(rank)
            raise
        finally:
            tailor.tiers.release()

    outcomes = on_threads(2, run)
    assert [type(o).__name__ for o in outcomes] == ["PersistResult"] * 2, outcomes
    assert written.done() and [Run(tmp_path / f"node{node}").steps() for node in range(2)] == [[1], [1]]


def test_a_node_whose_manifest_fsync_hangs_until_rank_0_gave_up_then_fails_leaves_every_rank_failed_alike(tmp_path, monkeypatch):
    """Node 1's leader's commit: its batch of received copies is durable, then the fsync of its
    manifest hangs (a dying disk) until rank 0 has given up on node 1's commit and said so
    (``r1/settled``, the event), and then fails (EIO): nothing is published on node 1. Rank 0,
    giving up, claims node 1's gate: node 1 had not yet passed it (it passes only once its
    manifest and directories are durable, just before the rename), so every rank raises alike
    and neither copy keeps step 1. Before: node 1 passed its gate beside the manifest's fsync
    (with the batch drained, before that fsync ended), so rank 0's claim found it passed and
    every rank returned success ('node 1: its commit was not confirmed ... unless that commit
    fails'), rank 1 too, though its commit had failed: node 1's copy lacked step 1. Timeout 1 s
    (the hung fsync shows node 1 live for ``_WAITED`` timeouts)."""
    from llmtailor.store.storage import local_durable

    real, hung = os.fsync, []
    node_1 = f"{os.path.realpath(tmp_path / 'node1')}/"

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(node_1) and path.endswith(f"/{MANIFEST_FILE}") and not hung:
            hung.append(path)
            deadline = time.monotonic() + 60  # a bound on a hang
            while not stores[0].check(["llmtailor/0/r1/settled"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            raise OSError(5, "Input/output error")
        real(fd)

    stores: list = []  # the job's store, for the fsync to watch (given as node 0 writes, before any commit)
    monkeypatch.setattr(local_durable.os, "fsync", fsync)
    outcomes = save_on_two_nodes(tmp_path, wrote=stores.append, timeout=1)
    monkeypatch.undo()
    assert hung, "node 1's manifest was never fsynced"
    copies = [Run(tmp_path / f"node{node}").steps() for node in range(2)]
    assert [type(o).__name__ for o in outcomes] == ["CoordinationError"] * 2 and copies == [[], []], (outcomes, copies)
    assert str(outcomes[1]) == str(outcomes[0]) and "rank 0 gave up on the commit of node(s) [1]" in str(outcomes[0])


def test_a_node_that_cannot_remove_its_copy_of_a_save_another_node_failed_says_so(tmp_path, monkeypatch):
    """Node 1 fails its commit (its ``confirm``, before its manifest: a disk error) after node 0
    committed step 1: node 0 removes its copy again (``_uncommit``). Where that removal fails too
    (here the rename into the trash: a read-only remount), node 0 keeps step 1 committed, its
    newest composite, while every rank said "the nodes that did removed their copy": every rank
    now says that node 0's copy stayed, and why, node 1's too (before, only node 0's rank did:
    rank 1's error said node 0 removed it)."""
    from llmtailor.store.storage.local_commit import LocalCommits

    real_discard = LocalCommits.discard

    def discard(self, snapshot):
        if self.root.name == "node0":
            raise OSError(30, "Read-only file system")
        return real_discard(self, snapshot)

    def failing(rank, store):
        if rank == 1:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(LocalCommits, "discard", discard)
    outcomes = save_on_two_nodes(tmp_path, confirm=failing)
    assert [type(o).__name__ for o in outcomes] == ["TailorError"] * 2, outcomes
    assert [Run(tmp_path / f"node{node}").steps() for node in range(2)] == [[1], []]
    assert "node 0 kept its copy of step 1" in str(outcomes[0]) and "read-only file system" in str(outcomes[0]).lower(), outcomes
    assert str(outcomes[1]) == str(outcomes[0]) and "removed their copy" not in str(outcomes[0]), outcomes


def test_a_node_that_does_not_say_whether_it_removed_its_copy_of_a_failed_save_is_named_so_on_the_ranks_that_waited(
        tmp_path, monkeypatch):
    """Node 0's commit fails (its ``confirm``: a disk error) after node 1 committed step 1: node 1
    removes its copy again (``_uncommit``), and that removal stays in the rename into the trash
    (a hung disk) until rank 0 gave up on its word (the event: rank 0's ``_undo`` returned).
    Rank 0 names node 1 as one that did not say within the timeout whether it removed its
    copy, never that it did, nor that it kept it; node 1, whose removal then went through, says
    it removed it; both say node 0's commit failed and that every earlier snapshot is intact. On
    disk, neither copy keeps step 1, and a restore finds no composite there. Timeout 1 s."""
    from llmtailor.store import node_commit
    from llmtailor.store.storage.local_commit import LocalCommits

    real_discard, real_undo, accounted = LocalCommits.discard, node_commit._undo, threading.Event()

    def discard(self, snapshot):
        if self.root.name == "node1":
            assert accounted.wait(60), "rank 0 never gave up on node 1's word"  # a bound on a hang
        return real_discard(self, snapshot)

    def undo(run, staged, placement, coord, *args):
        try:
            return real_undo(run, staged, placement, coord, *args)
        finally:
            if coord.rank == 0:
                accounted.set()

    def failing(rank, store):
        if rank == 0:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(LocalCommits, "discard", discard)
    monkeypatch.setattr(node_commit, "_undo", undo)
    outcomes = save_on_two_nodes(tmp_path, confirm=failing, timeout=1)
    assert [type(o).__name__ for o in outcomes] == ["TailorError"] * 2, outcomes
    said = [str(o) for o in outcomes]
    for rank in range(2):
        assert "step 1 was not saved: node(s) [0] could not commit it" in said[rank], said
        assert "input/output error" in said[rank].lower() and said[rank].endswith("every earlier snapshot is intact"), said
    assert "node(s) [1] did not say within 1 s whether they removed their copy" in said[0], said
    assert "node(s) [1] removed" not in said[0] and "kept its copy" not in said[0], said
    assert "node(s) [1] removed their copy" in said[1] and "did not say" not in said[1], said
    assert [Run(tmp_path / f"node{node}").steps() for node in range(2)] == [[], []]
    assert [Run(tmp_path / f"node{node}").latest_step() for node in range(2)] == [None, None]
