"""The node-scoped commit's meetings between nodes, in one process: two "nodes" of one rank each
(threads), their coordinators over one c10d ``HashStore``, copies carried between the threads
as the courier carries them. A node opens its staging place without waiting for the other
(no round before the parts are written), and a node that cannot open it fails the save on
every rank, naming it, with nothing committed anywhere. The same commit with real processes:
tests/distributed/test_node_tiers.py."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed import HashStore
from helpers import landed, on_threads

from llmtailor.constants import MANIFEST_FILE, TMP_DIR, snapshot_dirname
from llmtailor.distributed.coordinator import StoreCoordinator
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
    (source, destination) pair one queue."""

    def __init__(self, rank: int, lanes: dict[tuple[int, int], queue.Queue]):
        self.rank, self.lanes = rank, lanes

    def exchange_packed(self, outgoing, sources, into=None):
        for destination, packed in outgoing.items():
            self.lanes[self.rank, destination].put(packed)
        return {source: landed(self.lanes[source, self.rank].get(timeout=60), source, into) for source in sources}


def staged(rank: int) -> StagedSnapshot:
    """Rank ``rank``'s share of step 1 (DDP: rank 0 writes the units, both their global state)."""
    units = iter([StagedUnit.whole(u, {f"weight/{n}": torch.full((4,), float(rank + 1))})
                  for u in LAYOUT.units for n in LAYOUT.units[u]] if rank == 0 else [])
    return StagedSnapshot(step=1, parent=None, save_index=0, policy="test", layout=LAYOUT.to_record(), units=units,
                          composite={u: 1 for u in LAYOUT.units}, global_doc={} if rank == 0 else None,
                          global_tensors={} if rank == 0 else None, rank_doc={} if rank else None,
                          rank_tensors={} if rank else None, world_size=2)


def save_on_two_nodes(tmp_path, prepare=None, wait_for_node_0=False, spare=None):
    """Step 1 saved by two one-rank nodes, each into its own copy; ``prepare(rank)``: each
    leader's ``prepare``, ``spare(rank)`` each rank's ``spare``; ``wait_for_node_0``: node 1
    begins its commit only once node 0 has written a unit into its copy. Each rank's result or
    error."""
    store, lanes = HashStore(), {(a, b): queue.Queue() for a in range(2) for b in range(2)}
    node_0_wrote = threading.Event()

    def run(rank):
        if rank == 1 and wait_for_node_0 and not node_0_wrote.wait(60):
            raise AssertionError("node 0 wrote nothing of its part before node 1 began the save")
        placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=ThreadCourier(rank, lanes))
        coord = StoreCoordinator.over(store, rank, 2, timeout=60)  # a bound on a hang: no test here waits it out
        wrote = (lambda unit, size: node_0_wrote.set()) if rank == 0 else None
        return persist_on_nodes(Run(tmp_path / f"node{rank}"), staged(rank), placement, coord,
                                on_unit=wrote, prepare=prepare and (lambda: prepare(rank)),
                                spare=spare and (lambda: spare(rank)))

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
