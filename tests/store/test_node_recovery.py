"""Recovery of a node-local tier planned from what each node holds (``store/tiers/recovery.py``),
on fake holdings written as a node-local tier lays its copies out (NODES.md): which composite a
restore takes after a node loss, which files move from which node, and what a writer's start
removes from every node."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import on_threads, tiny, train

from llmtailor import Parity, Tailor, Tier
from llmtailor.constants import MANIFEST_FILE, SCHEMA_VERSION, writer_rank
from llmtailor.distributed.coordinator import CoordinationError, LocalCoordinator
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import IntegrityError, NodeTierError
from llmtailor.store.commit import SnapshotCommit
from llmtailor.store.manifest import FileEntry, Manifest, UnitEntry, UnitRef
from llmtailor.store.node_commit import NodePlacement
from llmtailor.store.retention import discard_snapshots
from llmtailor.store.run import Run
from llmtailor.store.storage.local import LocalSink
from llmtailor.store.tensor_files import checksum
from llmtailor.store.tiers import Tiers
from llmtailor.store.tiers import healing as recovery_healing
from llmtailor.store.tiers.collective import NodeUploader, node_files
from llmtailor.store.tiers.healing import Receiving, clear, held_here
from llmtailor.store.tiers.recovery import (
    Held, NodeChoice, Transfer, choose_on_nodes, clearing, composite_problem, healing, of_json, served_by,
)

UNITS = ("embed", "layer.0", "layer.1")


def snapshot_files(step: int, world: int) -> dict[str, list]:
    """Every file of a snapshot of ``world`` ranks: global files, one index per unit, each rank's
    unit files and own state (ranks >= 1), as the writer names them."""
    files = {"global.json": [100 + step, f"{step:016x}"], "global.safetensors": [200, f"{step + 1:016x}"]}
    for unit in UNITS:
        files[f"index/{unit}.json"] = [50, f"{step + 2:016x}"]
        for rank in range(world):
            files[f"units/{unit}.rank-{rank:05d}.safetensors"] = [1000 + rank, f"{step * 10 + rank:016x}"]
    for rank in range(1, world):
        files[f"ranks/rank-{rank:05d}.json"] = [30, f"{rank:016x}"]
    return files


def copies(step: int, node_of: tuple[int, ...], replicas: int = 2, jump: int = 1, needs: tuple[int, ...] = (),
           on: tuple[int, ...] | None = None) -> dict[int, Held]:
    """Each node's committed copy of the snapshot of ``step`` (only nodes ``on``, default all):
    its manifest, the global files and indexes, and the parts of the nodes it keeps."""
    nodes = Nodes(node_of)
    files = snapshot_files(step, len(node_of))
    placement = {"node_of": list(node_of), "replicas": replicas, "jump": jump}
    held = {}
    for node in (range(nodes.count) if on is None else on):
        kept = set(nodes.held_by(node, replicas, jump))
        present = {path: size for path, (size, _) in files.items() if _owner(path, nodes) in kept | {None}}
        present[MANIFEST_FILE] = 400
        held[node] = Held([400, f"{step + 3:016x}"], placement, sorted({step, *needs}), files, present)
    return held


def _owner(path: str, nodes: Nodes) -> int | None:
    if "rank-" not in path:
        return None
    return nodes.node_of_rank(int(path.split("rank-")[1][:5]))


def holdings(*snapshots: dict[int, Held], count: int) -> dict[int, dict[int, Held]]:
    """node -> step -> Held, from each snapshot's copies (steps read from the manifest's checksum)."""
    out: dict[int, dict[int, Held]] = {node: {} for node in range(count)}
    for held in snapshots:
        for node, h in held.items():
            out[node][int(h.manifest[1], 16) - 3] = h
    return out


TWO = (0, 0, 1, 1)  # 2 nodes x 2 ranks
THREE = (0, 1, 2)  # 3 nodes x 1 rank


def test_every_node_whole_takes_the_newest_and_moves_nothing():
    held = holdings(copies(6, TWO), copies(7, TWO, needs=(6,)), count=2)
    assert choose_on_nodes(held, TWO) == (7, {})
    assert healing(held, 7) == []


def test_a_wiped_node_gets_every_file_from_its_partner_checksums_and_manifest_included():
    held = holdings(copies(6, TWO), copies(7, TWO, needs=(6,)), count=2)
    held[1] = {}  # node 1 replaced: its memory is empty
    choice = choose_on_nodes(held, TWO)
    assert choice.step == 7
    moves = healing(held, 7)
    assert {m.dest for m in moves} == {1} and {m.source for m in moves} == {0}
    assert {(m.step, m.path) for m in moves} == {(s, p) for s in (6, 7) for p in [*snapshot_files(s, 4), MANIFEST_FILE]}
    some = next(m for m in moves if m.path == "units/layer.1.rank-00003.safetensors" and m.step == 7)
    assert some == Transfer(7, some.path, 1003, f"{73:016x}", 0, 1)
    assert served_by(moves) == {1: [0]}


def test_one_stream_sends_every_snapshots_manifest_indexes_and_global_state_first_then_the_parts_unit_by_unit():
    """The files of a healing go in the order the restore beside it reads them
    (``healing._sending``): every snapshot's small files (its checks), then the parts, unit by
    unit (``layer.2`` before ``layer.10``), each unit's versions newest first, the ranks' own
    state last; each named by its snapshot."""
    held = holdings(copies(6, TWO), copies(7, TWO, needs=(6,)), count=2)
    held[1] = {}
    outgoing, sources = recovery_healing._sending(healing(held, 7), 0, Nodes(TWO))
    assert sources == [] and list(outgoing) == [2]  # node 1's leader
    sent = [recovery_healing._unnamed(name) for name, _ in outgoing[2]]
    kinds = ["small" if writer_rank(path) is None else "state" if path.startswith("ranks/") else "part" for _, path in sent]
    assert kinds == sorted(kinds, key=["small", "part", "state"].index) and sent[:2] == [(7, MANIFEST_FILE), (6, MANIFEST_FILE)]
    parts = [(path, step) for step, path in sent if not path.startswith("ranks/") and writer_rank(path) is not None]
    assert parts[:4] == [("units/embed.rank-00000.safetensors", 7), ("units/embed.rank-00000.safetensors", 6),
                         ("units/embed.rank-00001.safetensors", 7), ("units/embed.rank-00001.safetensors", 6)]


def test_three_nodes_the_wiped_node_gets_its_own_parts_from_its_replica_and_its_partners_from_their_owner():
    held = holdings(copies(4, THREE), count=3)
    held[1] = {}
    assert choose_on_nodes(held, THREE).step == 4
    moves = healing(held, 4)
    by_path = {m.path: m.source for m in moves}
    assert by_path["units/layer.0.rank-00001.safetensors"] == 2  # node 1's own parts: their replica is on node 2
    assert by_path["units/layer.0.rank-00000.safetensors"] == 0  # node 0's parts, which node 1 keeps a copy of
    assert "units/layer.0.rank-00002.safetensors" not in by_path  # node 2's parts live on nodes 2 and 0
    assert by_path["global.json"] == 0 and by_path[MANIFEST_FILE] == 0
    assert served_by(moves) == {1: [0, 2]}


def test_without_replicas_a_lost_node_leaves_no_whole_composite_and_says_which_files():
    held = holdings(copies(6, TWO, replicas=1), copies(7, TWO, replicas=1, needs=(6,)), count=2)
    held[1] = {}
    choice = choose_on_nodes(held, TWO)
    assert choice.step is None
    assert set(choice.skipped) == {6, 7}
    assert "file(s) on no live node" in choice.skipped[7] and "rank-00002" in choice.skipped[7]
    assert clearing(held, TWO) == {0: [6, 7]}  # nothing of them can be restored


def test_a_crash_between_local_commits_passes_over_the_partial_snapshot_and_clearing_removes_it():
    # Step 8 committed on node 0 only (3 nodes, 2 copies): node 1's parts are on nodes 1 and 2, which lack it.
    held = holdings(copies(7, THREE), copies(8, THREE, needs=(7,), on=(0,)), count=3)
    choice = choose_on_nodes(held, THREE)
    assert choice.step == 7 and "step 8: " in choice.skipped[8] and "rank-00001" in choice.skipped[8]
    assert clearing(held, THREE) == {0: [8]}
    assert healing(held, 7) == []


def test_a_snapshot_on_one_node_of_two_with_two_copies_is_whole_and_healed():
    held = holdings(copies(7, TWO), copies(8, TWO, needs=(7,), on=(0,)), count=2)
    assert choose_on_nodes(held, TWO).step == 8
    assert {(m.step, m.dest) for m in healing(held, 8)} == {(8, 1)}
    assert clearing(held, TWO) == {}


def test_another_placement_is_passed_over_with_the_reason_and_not_cleared():
    held = holdings(copies(5, TWO), count=2)
    elsewhere = (0, 1, 0, 1)
    choice = choose_on_nodes(held, elsewhere)
    assert choice.step is None and "another placement" in choice.skipped[5]
    assert clearing(held, elsewhere) == {}


def test_a_composite_reading_a_lost_older_snapshot_is_not_whole():
    held = holdings(copies(6, TWO, replicas=1), copies(7, TWO, needs=(6,)), count=2)
    held[1].pop(6)
    problem = composite_problem(held, 7, TWO)
    assert problem is not None and problem.startswith("it reads step 6: ")
    assert choose_on_nodes(held, TWO, step=7).step is None


def test_nodes_disagreeing_on_a_manifest_is_not_whole():
    held = holdings(copies(6, TWO), count=2)
    held[1][6] = held[1][6]._replace(manifest=[400, "f" * 16])
    assert "manifests of step 6 differ" in choose_on_nodes(held, TWO).skipped[6]


def test_a_file_of_the_wrong_size_counts_as_lacking():
    held = holdings(copies(6, TWO), count=2)
    path = "units/layer.0.rank-00002.safetensors"
    for node in (0, 1):
        held[node][6].present[path] = 1
    assert path in choose_on_nodes(held, TWO).skipped[6]


def test_holdings_travel_as_json():
    held = holdings(copies(6, TWO), count=2)
    assert of_json(json.loads(json.dumps(held))) == held


# -- on disk: node-local copies written by hand as NODES.md lays them out -----------------------

def write_snapshot(copies: list, step: int, parent: int | None, node_of: tuple[int, ...], replicas: int) -> None:
    """The snapshot of ``step`` (one unit, a file per rank, each rank's own state, the global
    state) committed into each node's copy (``copies[node]``) with what that node keeps."""
    def entry(path: str, content: bytes) -> FileEntry:
        return FileEntry(path=path, bytes=len(content), xxh3_64=checksum(content))

    contents = {f"units/layer.0.rank-{r:05d}.safetensors": os.urandom(64 + r) for r in range(len(node_of))}
    contents.update({f"ranks/rank-{r:05d}.json": f'{{"rank": {r}, "step": {step}}}'.encode() for r in range(1, len(node_of))})
    contents["global.json"] = f'{{"step": {step}}}'.encode()
    index = UnitEntry(unit="layer.0", step=step, files=[entry(p, contents[p]) for p in contents if p.startswith("units/")],
                      tensors=[]).dumps().encode()
    contents["index/layer.0.json"] = index
    manifest = Manifest(
        schema_version=5, step=step, parent=parent, save_index=step, created="now", world_size=len(node_of),
        notes={"nodes": {"node_of": list(node_of), "replicas": replicas, "jump": 1}}, policy="full", layout={},
        units={"layer.0": UnitRef(index=entry("index/layer.0.json", index), bytes=sum(len(contents[p]) for p in contents if p.startswith("units/")))},
        composite={"layer.0": step}, files=[entry(p, contents[p]) for p in contents if not p.startswith(("units/", "index/"))],
    ).dumps().encode()
    nodes = Nodes(node_of)
    for node, copy in enumerate(copies):
        kept = set(nodes.held_by(node, replicas, 1))
        where = copy / "snapshots" / f"step-{step:08d}"
        for path, content in {**contents, MANIFEST_FILE: manifest}.items():
            if _owner(path, nodes) in kept | {None}:
                (where / path).parent.mkdir(parents=True, exist_ok=True)
                (where / path).write_bytes(content)


def node_copies(tmp_path, count: int = 2, replicas: int = 2) -> list:
    copies = [tmp_path / f"node{n}" for n in range(count)]
    for copy in copies:
        copy.mkdir()
    write_snapshot(copies, 1, None, tuple(range(count)), replicas)
    write_snapshot(copies, 2, 1, tuple(range(count)), replicas)
    return copies


def move_in_process(runs: list, moves: list[Transfer], nodes: Nodes, damage: str | None = None) -> None:
    """What ``healing.heal`` does over the courier, in one process: each destination's files read
    from its sources' copies (node n is rank n here), each into where its ``Receiving`` lands it
    (``land``: its staged file, or a fresh buffer), handed to it as they come."""
    for step in sorted({m.step for m in moves}):
        for dest in sorted({m.dest for m in moves if m.step == step}):
            mine = [m for m in moves if m.step == step and m.dest == dest]
            receiving = Receiving(runs[dest], step, mine, nodes)
            for m in mine:
                content = (runs[m.source].snapshot_dir(step) / m.path).read_bytes()
                if m.path == damage:
                    content = content[:-1] + bytes([content[-1] ^ 1])
                landed = receiving.land(m.source, m.path, len(content))
                if landed is not None:
                    landed[:] = content
                receiving.take(m.source, m.path, landed if landed is not None else memoryview(content))
            error = receiving.finish()
            runs[dest].settle_commits()  # a new snapshot's writes and commit finish in the background
            error = error or runs[dest].commit_failure()
            if error is not None:
                raise IntegrityError(error)


def node_one_wiped(tmp_path) -> tuple[list, list, dict]:
    """Two nodes' copies of steps 1 and 2, node 1's wiped: the copies, their runs, their holdings."""
    copies = node_copies(tmp_path)
    shutil.rmtree(copies[1])
    copies[1].mkdir()
    runs = [Run(copy) for copy in copies]
    return copies, runs, {node: held_here(run) for node, run in enumerate(runs)}


def test_the_ranks_wait_on_for_a_node_whose_healing_goes_on_past_the_timeout():
    """The ranks met at the end of a healing (``settle``) within the timeout, whatever the
    healing node did meanwhile: a node receiving and writing a large copy for longer failed
    every rank, alive as it was. It is inside ``working`` while it waits for its healing, so the
    others wait on while that advances (here past 1.5 x the timeout); one silent is still named.
    Two ranks as threads over one store, timeout 2 s; rank 1's healing stands for the long one."""
    from torch.distributed import HashStore

    from llmtailor.distributed.coordinator import _LOOKS, StoreCoordinator
    from llmtailor.distributed.progress import Scope
    from llmtailor.store.tiers.healing import settle
    from helpers import progressing

    store, gave_up = HashStore(), []
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=2) for rank in range(2)]

    class Healing:
        def __init__(self, rank: int, looks: int):
            self.rank, self.looks, self.progress = rank, looks, Scope()

        def outcome(self) -> None:
            if self.rank == 1:
                progressing(store, [0], self.looks, gave_up)
                while self.looks == 1 and not gave_up:  # stuck, once seen
                    threading.Event().wait(0.01)

    def heal(rank: int, tag: str, looks: int) -> None:
        try:
            return settle(Healing(rank, looks), coordinators[rank], tag)
        except CoordinationError:
            gave_up.append(rank)
            raise

    assert on_threads(2, lambda rank: heal(rank, "r1/healed", _LOOKS + 2)) == [None, None]
    outcomes = on_threads(2, lambda rank: heal(rank, "r2/healed", 1))
    assert isinstance(outcomes[0], CoordinationError), outcomes
    assert str(outcomes[0]).startswith("rank(s) [1] did not report on 'r2/healed' within 2 s"), outcomes


def test_the_ranks_agree_on_a_restore_once_a_healing_beside_it_that_goes_on_past_the_timeout_ended():
    """A healing run beside a restore's first attempt is waited for (``_Restoring._healed``) before
    the ranks agree on the attempt: a rank whose node still received its copy past the timeout
    was waited for at the agreement within the timeout and failed every rank, alive as it was.
    Its wait is inside ``working``: the others wait on while the healing advances (here past 1.5 x
    the timeout). Two ranks as threads over one store, timeout 2 s; rank 1's healing stands for
    the long one, each rank then agrees as the restore does."""
    from torch.distributed import HashStore

    from llmtailor.distributed.coordinator import _LOOKS, StoreCoordinator
    from llmtailor.tailor import _Restoring
    from helpers import progressing

    store, gave_up = HashStore(), []

    class Healing:  # ``Tiers.healed``: this rank's part of the healing, waited for
        healing_progress = ()

        def __init__(self, rank: int):
            self.rank = rank

        def healed(self) -> None:
            if self.rank == 1:
                progressing(store, [0], _LOOKS + 2, gave_up)

    def restore(rank: int):
        restoring = _Restoring(Healing(rank), None, StoreCoordinator.over(store, rank, 2, timeout=2))
        try:
            return restoring.coordinator.agree(f"{restoring.round}/loaded/0", 4, restoring._healed(None), True)
        except CoordinationError:
            gave_up.append(rank)
            raise

    assert on_threads(2, restore) == [(None, False)] * 2


def test_a_wiped_node_copy_is_healed_from_its_partner_and_committed_whole(tmp_path):
    copies, runs, held = node_one_wiped(tmp_path)
    assert held[1] == {} and sorted(held[0]) == [1, 2]
    assert choose_on_nodes(held, (0, 1)).step == 2
    moves = healing(held, 2)
    assert {(m.step, m.source, m.dest) for m in moves} == {(2, 0, 1)}  # the composite of step 2 reads step 2 alone
    move_in_process(runs, moves, Nodes((0, 1)))
    healed = Run(copies[1])
    assert healed.steps() == [2] and healed.resolve().step == 2
    for step in (2,):
        for path in (copies[0] / "snapshots" / f"step-{step:08d}").rglob("*"):
            if path.is_file():
                twin = copies[1] / path.relative_to(copies[0])
                assert twin.read_bytes() == path.read_bytes(), twin
    assert not list((copies[1] / ".tmp").iterdir())  # staged, then renamed into place
    again = {node: held_here(Run(copy)) for node, copy in enumerate(copies)}
    assert healing(again, 2) == []


def test_a_file_damaged_on_the_way_is_refused_and_nothing_is_committed(tmp_path):
    copies, runs, held = node_one_wiped(tmp_path)
    moves = [m for m in healing(held, 2) if m.step == 2]
    with pytest.raises(IntegrityError, match=r"step 2: units/layer.0.rank-00001.safetensors from node 0: got 65 bytes"):
        move_in_process(runs, moves, Nodes((0, 1)), damage="units/layer.0.rank-00001.safetensors")
    assert Run(copies[1]).steps() == []


def test_a_file_lands_in_its_staged_file_unwritten_checked_there_and_a_damaged_or_untaken_one_is_removed(
        tmp_path, monkeypatch):
    """A new snapshot's files are received straight into their staged files (``land``: no
    buffer written out after); what lands is checked there: one damaged is removed at once and
    nothing more lands, one that landed and was never taken (the stream ended) is removed at the
    end, and the snapshot is not committed; the manifest never lands (written last, by the commit)."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = [m for m in healing(held, 2) if m.step == 2]
    written = []
    monkeypatch.setattr(LocalSink, "write", lambda self, data: written.append(self.path.name))
    units = [m for m in moves if m.path.startswith("units/")]
    receiving = Receiving(runs[1], 2, moves, Nodes((0, 1)))
    manifest = next(m for m in moves if m.path == MANIFEST_FILE)
    assert receiving.land(manifest.source, manifest.path, manifest.bytes) is None
    landed = {m.path: receiving.land(m.source, m.path, m.bytes) for m in [*units, next(m for m in moves if m.path == "global.json")]}
    assert None not in landed.values()
    staged = {path: next((copies[1] / ".tmp").rglob(Path(path).name)) for path in landed}
    good, bad = units[0], units[1]
    landed[good.path][:] = (runs[0].snapshot_dir(2) / good.path).read_bytes()
    receiving.take(good.source, good.path, landed[good.path])
    content = (runs[0].snapshot_dir(2) / bad.path).read_bytes()
    landed[bad.path][:] = content[:-1] + bytes([content[-1] ^ 1])
    receiving.take(bad.source, bad.path, landed[bad.path])
    assert f"{bad.path} from node 0: got {bad.bytes} bytes" in receiving.error
    assert not staged[bad.path].exists()  # removed at once, before the stream ends
    assert receiving.land(units[0].source, "index/layer.0.json", 1) is None  # nothing lands after a failure
    assert staged["global.json"].exists()  # landed, never taken
    assert receiving.finish() is not None
    assert not staged["global.json"].exists() and not list((copies[1] / ".tmp").rglob("*.safetensors"))
    assert written == [] and Run(copies[1]).steps() == []


class LandingSender:
    """Node 1's side of a stream (``Courier.stream`` in one process) whose sender sends every
    file of the snapshot of ``step`` from ``source``: each received where ``land`` asks (its
    staged file's mapping; unless ``landing`` is False), else into a fresh buffer, as the
    courier's receives land them, then taken."""

    def __init__(self, source: Run, step: int, paths: list[str], landing: bool = True):
        self.source, self.step, self.paths, self.landing = source, step, paths, landing

    def stream(self, outgoing, fill, sources, take, meanwhile=None, land=None):
        for path in self.paths:
            content = (self.source.snapshot_dir(self.step) / path).read_bytes()
            name = f"{self.step}:{path}"
            into = land(0, name, len(content)) if land is not None and self.landing else None
            into = into if into is not None else memoryview(bytearray(len(content)))
            into[:] = content
            take(0, name, into)


def healing_node_1(tmp_path, tokens, landing: bool):
    """Node 0's copy of step 1 (a tiny model trained a step) healed into node 1's empty copy
    (``LandingSender``), under way: ``(snapshot, moves, healed run, Healing)``."""
    model, opt, sched = tiny(seed=0)
    train(model, opt, sched, tokens, [1])
    tailor = Tailor(tmp_path / "node0", model, opt, sched, policy=Parity(), keep=None)
    tailor.save(1)
    tailor.close()
    source = Run(tmp_path / "node0")
    snapshot = source.snapshot_dir(1)
    files = sorted(path for path in snapshot.rglob("*") if path.is_file())
    moves = [Transfer(1, path.relative_to(snapshot).as_posix(), path.stat().st_size, checksum(path.read_bytes()), 0, 1)
             for path in files]
    (tmp_path / "node1").mkdir()
    healed = Run(tmp_path / "node1")
    sender = LandingSender(source, 1, [m.path for m in moves], landing)
    return snapshot, moves, healed, recovery_healing.Healing(healed, moves, Nodes((0, 1)), sender, 1)


@pytest.mark.parametrize("landing", [True, False], ids=["landed", "fresh-buffer"])
def test_training_that_writes_into_the_tensors_restored_from_a_healing_leaves_the_healed_copy_as_it_checked_out(
        tmp_path, tokens, landing):
    """The restore after a healing reads the files that arrived (``UnitReader.arrived``), and a
    tensor with no live one to land in (the optimizer's state in a fresh process) is a view of
    those bytes, which the optimizer keeps and training then writes into. Node 1's healed copy,
    committed from what arrived once the restore ended, must stay as it checked out: every file
    of it matches its checksum after training wrote into every tensor restored, whether the
    files landed in their staged files (``land``) or in fresh buffers (the bytes handed to the
    restore are the process's own, neither the committed file's nor those it is written from).
    Before: ``packs/rank-00000.0.safetensors: checksum mismatch (file is corrupted)``, both ways."""
    snapshot, moves, healed, under_way = healing_node_1(tmp_path, tokens, landing)
    try:
        assert under_way.outcome() is None
        restored = [tensor for unit in healed.manifest(1).units for tensor in healed.read_unit(1, unit)[0].values()]
        assert restored and healed.units.arrived  # read from what arrived
        for tensor in restored:  # as training's first steps write into the optimizer's state
            tensor.view(-1).view(torch.uint8).bitwise_not_()
    finally:
        healed.release_held()  # as the restore ends: the healed copy is committed now
    healed.settle_commits()
    assert healed.commit_failure() is None and Run(tmp_path / "node1").steps() == [1]
    assert Run(tmp_path / "node1").verify() == []
    committed = tmp_path / "node1" / "snapshots" / "step-00000001"
    assert all((committed / m.path).read_bytes() == (snapshot / m.path).read_bytes() for m in moves)


def test_the_tensors_restored_from_a_healing_hold_no_mapping_of_the_healed_copy_once_retention_removed_it(
        tmp_path, tokens):
    """A tensor restored with no live one to land in (the optimizer's state in a fresh process)
    lives as long as training does. Made as a view of a file's private mapping (a healed file
    that landed in its staged file, ``Receiving._own``), it kept the whole file mapped, so once
    retention removed that snapshot the file's memory (a ``/dev/shm`` tier's) stayed taken for as
    long as the process ran. Before: node 1's ``packs/rank-00000.0.safetensors (deleted)`` still
    in ``/proc/self/maps``."""
    import gc

    _, _, healed, under_way = healing_node_1(tmp_path, tokens, landing=True)
    try:
        assert under_way.outcome() is None
        restored = [tensor for unit in healed.manifest(1).units for tensor in healed.read_unit(1, unit)[0].values()]
    finally:
        healed.release_held()  # as the restore ends
        healed.units.arrived.clear()
    healed.settle_commits()
    del under_way
    discard_snapshots(Run(tmp_path / "node1"), [1])  # retention moved on
    gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = [line.split(maxsplit=5)[-1].strip() for line in maps if str(tmp_path / "node1") in line]
    assert restored
    assert mapped == [], mapped


def test_a_writer_clears_from_every_node_a_snapshot_that_is_not_whole(tmp_path):
    copies = node_copies(tmp_path, count=3)
    write_snapshot(copies, 3, 2, (0, 1, 2), 2)
    shutil.rmtree(copies[1] / "snapshots" / "step-00000003")  # node 1 crashed before its local commit of step 3
    shutil.rmtree(copies[2] / "snapshots" / "step-00000003")  # and node 2 too: node 1's parts are nowhere whole
    held = {node: held_here(Run(copy)) for node, copy in enumerate(copies)}
    assert choose_on_nodes(held, (0, 1, 2)).step == 2
    doomed = clearing(held, (0, 1, 2))
    assert doomed == {0: [3]}
    run0 = Run(copies[0])
    clear(run0, doomed, Nodes((0,)), LocalCoordinator(), "t")  # node 0's leader: rank 0 of a one-node view
    assert run0.steps() == [1, 2]
    assert clearing({node: held_here(Run(copy)) for node, copy in enumerate(copies)}, (0, 1, 2)) == {}


def test_the_choice_takes_what_the_nodes_offer_and_falls_back_to_the_next_tier_saying_why(tmp_path, tokens):
    model, opt, sched = tiny(seed=0)
    tailor = Tailor(tmp_path / "home", model, opt, sched, policy=Parity(), keep=None,
                    tiers=[Tier(tmp_path / "memory", keep=None, promote_every=100)])
    for step in (1, 2, 3):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
    tailor.wait(promoted=True)  # step 1 promoted (the first composite), 2 and 3 not yet
    tiers = Tiers(tmp_path / "home", [Tier(tmp_path / "memory")])
    chosen, lease = tiers.choose(None, NodeChoice(2, {3: "node-local tier: step 3: 1 file(s) on no live node (x)"}))
    lease.close()
    assert (chosen.level, chosen.step) == (0, 2) and "on no live node" in chosen.skipped[3]
    chosen, lease = tiers.choose(None, NodeChoice(None, {3: "node-local tier: why 3", 2: "node-local tier: why 2"}))
    lease.close()
    assert (chosen.level, chosen.step) == (1, 1)
    assert chosen.skipped == {3: f"{tmp_path / 'memory'}: node-local tier: why 3", 2: f"{tmp_path / 'memory'}: node-local tier: why 2"}
    assert tiers.candidates(NodeChoice(2, {3: "x"})).attempts == [(0, 2), (1, 1)]  # fallback: the offer, then the next tier
    assert tiers.candidates(NodeChoice(None, {3: "x"})).attempts == [(1, 1)]
    tailor.close()


def test_a_healing_hands_the_restore_at_most_its_bound_of_received_bytes(tmp_path, monkeypatch):
    """What a healing keeps in memory for the restore after it is bounded (``HAND_OVER_BYTES``):
    the files past the bound are read back from the copy, never held twice in host memory."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    sizes = {m.path: m.bytes for m in moves}
    monkeypatch.setattr(recovery_healing, "HAND_OVER_BYTES", sum(sizes.values()) - 1)
    move_in_process(runs, moves, Nodes((0, 1)))
    handed = {key.split("/", 2)[-1] for key in runs[1].units.arrived}
    assert handed and len(handed) < len(sizes) and sum(sizes[p] for p in handed) <= sum(sizes.values()) - 1
    assert Run(copies[1]).resolve().step == 2  # every file written all the same


def test_a_node_receiving_several_snapshots_keeps_at_most_the_bound_for_them_all(tmp_path, monkeypatch):
    """The bound on what a healing keeps in memory for its restore (``HAND_OVER_BYTES``) holds
    for the node, not for each snapshot it receives: node 1, wiped, receives steps 1 and 2 in
    one healing with a bound of one snapshot's bytes; what it keeps stays within it (the newest
    snapshot's files first), the rest is read back from its copy, and both are committed whole.
    Before: ``assert 1862 <= 962`` (each snapshot kept up to the bound)."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 1) + healing(held, 2)
    assert {m.step for m in moves} == {1, 2} and {m.dest for m in moves} == {1}
    bound = sum(m.bytes for m in moves if m.step == 2)
    monkeypatch.setattr(recovery_healing, "HAND_OVER_BYTES", bound)
    paths = {step: [m.path for m in moves if m.step == step] for step in (1, 2)}
    under_way = recovery_healing.Healing(runs[1], moves, Nodes((0, 1)), TwoSnapshots(runs[0], paths), 1)
    try:
        assert under_way.outcome() is None
        kept = {key: len(content) for key, (_, _, content) in runs[1].units.arrived.items()}
    finally:
        runs[1].release_held()  # as the restore ends: the copy's writes held back go on (none left waiting)
    assert sum(kept.values()) <= bound
    assert kept and all("step-00000002" in key for key in kept)  # the newest's first: the restore reads it
    runs[1].settle_commits()
    assert runs[1].commit_failure() is None and Run(copies[1]).steps() == [1, 2]
    for m in moves:
        assert (copies[1] / "snapshots" / f"step-{m.step:08d}" / m.path).read_bytes() == \
            (runs[0].snapshot_dir(m.step) / m.path).read_bytes()


class TwoSnapshots:
    """Node 1's side of a stream (``Courier.stream`` in one process) whose sender sends every
    file ``paths`` names by step, from ``source``, the newest snapshot's first."""

    def __init__(self, source: Run, paths: dict[int, list[str]]):
        self.source, self.paths = source, paths

    def stream(self, outgoing, fill, sources, take, meanwhile=None, land=None):
        for step in sorted(self.paths, reverse=True):
            for path in self.paths[step]:
                take(0, f"{step}:{path}", memoryview((self.source.snapshot_dir(step) / path).read_bytes()))


def received_from_node_0(runs: list, moves: list[Transfer]) -> str | None:
    """Node 1's ``Receiving`` of ``moves`` (step 2), fed from node 0's copy; what ``finish`` said."""
    receiving = Receiving(runs[1], 2, moves, Nodes((0, 1)))
    for m in moves:
        receiving.take(m.source, m.path, memoryview((runs[0].snapshot_dir(2) / m.path).read_bytes()))
    return receiving.finish()


def test_a_healed_snapshot_is_read_from_what_arrived_while_its_copy_is_written_in_the_background(tmp_path, monkeypatch):
    """The restore after a healing does not wait for the healed node's copy to be written:
    ``finish`` returns once every file arrived and checked out; this process lists the snapshot,
    leases it and reads it from the arrived bytes meanwhile; the copy (files, then the manifest)
    is committed once settled."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    release, write = threading.Event(), recovery_healing.write_to
    monkeypatch.setattr(recovery_healing, "write_to", lambda sink, data: (release.wait(10), write(sink, data)))
    assert received_from_node_0(runs, moves) is None
    snapshot = copies[1] / "snapshots" / "step-00000002"
    assert not snapshot.exists()  # not committed yet: every write waits for ``release``
    assert runs[1].steps() == [2]
    with runs[1].lease(2) as composite:
        assert composite.step == 2 and runs[1].units.stored_entry(2, "layer.0").unit == "layer.0"  # from what arrived
    release.set()
    runs[1].settle_commits()
    assert runs[1].commit_failure() is None and Run(copies[1]).steps() == [2]
    assert all((snapshot / m.path).read_bytes() == (runs[0].snapshot_dir(2) / m.path).read_bytes() for m in moves)


def test_a_healed_copy_is_written_once_the_restore_that_reads_what_arrived_has_ended(tmp_path, monkeypatch):
    """The healed copy's writes wait (``Catalog.hold_back``) until the restore that reads what
    arrived has ended (``release_held``, as ``Tailor.restore`` ends) or something waits for the
    copy's commit: that restore has the CPUs to itself, the bytes it reads being in memory."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    wrote, write = threading.Event(), recovery_healing.write_to
    monkeypatch.setattr(recovery_healing, "write_to", lambda sink, data: (wrote.set(), write(sink, data)))
    assert received_from_node_0(runs, moves) is None
    assert not wrote.wait(0.5)  # held back: nothing can be written before the release
    runs[1].release_held()
    assert wrote.wait(60)
    runs[1].settle_commits()
    assert runs[1].commit_failure() is None and Run(copies[1]).steps() == [2]


def test_a_healed_copy_whose_background_write_fails_is_abandoned_and_refuses_every_save_until_a_restore(
        tmp_path, monkeypatch, caplog):
    """A write of the healed copy that fails on the background thread commits nothing, is
    logged at once and raised by ``Tiers.settle_healing`` (every save's first step, ``close``),
    naming the node, the step and the cause; and again by every later save until a restore
    lists the copies anew (``Tiers.recover``) and heals them: a save in between would extend a
    composite this node's copy lacks part of."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    tiers = Tiers(tmp_path / "home", [Tier(copies[1])])

    def full(sink, data):
        sink.abort()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recovery_healing, "write_to", full)
    assert received_from_node_0([runs[0], tiers.first.run], moves) is None  # the restore goes on from what arrived
    with pytest.raises(NodeTierError, match="node 1: step 2: its healed copy could not be written: .*No space left"):
        tiers.settle_healing()
    for _ in range(2):  # every save, not the first only
        with pytest.raises(NodeTierError, match=r"step 3 was not saved: .*step 2: its healed copy could not be written.*"
                                                r"no save extends it: restore\(\) again"):
            tiers.prepare_save(3, 1.0)
    assert "its healed copy could not be written" in caplog.text
    assert Run(copies[1]).steps() == [] and tiers.first.run.steps() == []
    assert not list((copies[1] / ".tmp").iterdir())
    # A restore's recovery lists this node's copy anew (one node here: nothing to heal) and lifts it.
    tiers.placement = NodePlacement(Nodes((0,)), 1, 1, courier=None)
    assert tiers.recover(LocalCoordinator(), None)[0].step is None
    tiers.settle_healing()


def test_a_close_after_rank_0s_healed_copy_failed_raises_that_failure_on_every_rank_at_once(tmp_path):
    """Rank 0's node's healed copy could not be written (``Tiers.unhealed``): its ``close``
    raises, and every other rank's raises the same failure in the same close, rather than waiting
    in a message rank 0 never sends until the coordination timeout. Two ranks as threads over one
    c10d ``HashStore``, each its own node's copy, in front of one home; no final promotion."""
    from torch.distributed import HashStore

    from llmtailor.distributed.coordinator import StoreCoordinator
    from llmtailor.tailor import _Pending

    store = HashStore()
    tiers = [Tiers(tmp_path / "home", [Tier(tmp_path / f"node{n}", scope="node")]) for n in range(2)]
    for each in tiers:
        each.placement = NodePlacement(Nodes((0, 1)), 1, 1, courier=None)
    tiers[0].unhealed = "node 0: step 2: its healed copy could not be written: [Errno 28] No space left on device"

    def close(rank: int) -> None:
        tailor = Tailor.__new__(Tailor)  # what close uses: its tiers and coordinator; no async saves, no drift hooks
        tailor.tiers, tailor.coordinator = tiers[rank], StoreCoordinator.over(store, rank, 2, timeout=20)
        tailor._stager = tailor._drift = None
        tailor._pending = _Pending(None, None, None, None)  # nothing staged: only its closed flag is used
        tailor.close()

    outcomes = on_threads(2, close)
    assert [type(o) for o in outcomes] == [NodeTierError, NodeTierError], outcomes
    for outcome in outcomes:
        assert "node 0: step 2: its healed copy could not be written: [Errno 28] No space left" in str(outcome)
        assert "restore() again (on every rank" in str(outcome)


def test_a_close_waits_on_while_a_nodes_healed_copy_is_still_written_past_the_timeout(tmp_path):
    """``close`` settles each node's healed copy (its background writes) before the ranks tell
    one another how their healing ended: a node whose copy was still written past the timeout (a
    large copy, a slow disk) failed every rank's close, alive as it was. Its wait is inside
    ``working``: the others wait on while its writes advance (here past 1.5 x the timeout). Two
    ranks as threads over one store, timeout 2 s; rank 1's settling stands for the long one."""
    from torch.distributed import HashStore

    from llmtailor.distributed.coordinator import _LOOKS, StoreCoordinator
    from llmtailor.tailor import _Pending
    from helpers import progressing

    store, gave_up = HashStore(), []
    tiers = [Tiers(tmp_path / "home", [Tier(tmp_path / f"node{n}", scope="node")]) for n in range(2)]
    for each in tiers:
        each.placement = NodePlacement(Nodes((0, 1)), 1, 1, courier=None)
    tiers[1].settle_healing = lambda: progressing(store, [0], _LOOKS + 2, gave_up)

    def close(rank: int) -> None:
        tailor = Tailor.__new__(Tailor)  # as in the test above
        tailor.tiers, tailor.coordinator = tiers[rank], StoreCoordinator.over(store, rank, 2, timeout=2)
        tailor._stager = tailor._drift = None
        tailor._pending = _Pending(None, None, None, None)
        try:
            tailor.close()
        except CoordinationError:
            gave_up.append(rank)
            raise

    assert on_threads(2, close) == [None, None]


EXITS_AFTER_HEALING = """
import json, sys, time
from llmtailor.distributed.nodes import Nodes
from llmtailor.store.run import Run
from llmtailor.store.tiers import healing
from llmtailor.store.tiers.recovery import Transfer

source, copy, moves = sys.argv[1], sys.argv[2], [Transfer(*move) for move in json.loads(sys.argv[3])]
write = healing.write_to
healing.write_to = lambda sink, data: (time.sleep(0.2), write(sink, data))  # still writing when it exits
run = Run(copy)
receiving = healing.Receiving(run, 2, moves, Nodes((0, 1)))
for move in moves:
    receiving.take(move.source, move.path, memoryview((Run(source).snapshot_dir(2) / move.path).read_bytes()))
assert receiving.finish() is None  # the restore would read what arrived, then release the writes as it ends:
run.release_held()  # as ``Tailor.restore`` does; this process then exits: no save, no close
"""


def test_a_process_that_exits_after_a_healing_without_a_save_or_close_leaves_its_copy_committed(tmp_path):
    """The healed copy is written in the background; a process that restores and exits at once
    (no save, no ``close``) waits for that write as it exits, and leaves the copy committed."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    proc = subprocess.run([sys.executable, "-c", EXITS_AFTER_HEALING, str(copies[0]), str(copies[1]), json.dumps(moves)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert Run(copies[1]).steps() == [2]
    assert all((copies[1] / "snapshots" / "step-00000002" / m.path).read_bytes()
               == (runs[0].snapshot_dir(2) / m.path).read_bytes() for m in moves)


def test_a_nodes_uploader_waits_for_its_healed_copy_to_be_committed_before_it_serves_a_promotion(tmp_path, monkeypatch):
    """A close right after a healing restore promotes the composite restored while the healed
    node's copy may still be written in the background: that node's uploader waits for it,
    rather than finding the snapshot gone (the promotion would then give way for good, and
    the close report nothing)."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    release, write = threading.Event(), recovery_healing.write_to
    monkeypatch.setattr(recovery_healing, "write_to", lambda sink, data: (release.wait(30), write(sink, data)))
    assert received_from_node_0(runs, moves) is None  # node 1's copy of step 2 is written in the background
    (tmp_path / "durable").mkdir()
    durable = Run(tmp_path / "durable")
    staging = SnapshotCommit.begin(durable, 2).staging
    parts = sum(entry.bytes for entry in node_files(runs[0], 2, 1))  # node 1's parts (node 0 holds a replica)
    threading.Thread(target=release.set).start()  # the writes go on while the uploader serves
    report = NodeUploader(runs[1], durable, 1, LocalCoordinator())._serve({"staging": {"2": staging}})
    assert report == {"bytes": parts}
    runs[1].settle_commits()
    assert runs[1].commit_failure() is None


class RetainingCourier:
    """A courier (``Courier.stream``'s sending side, in one process) that runs the sending
    node's retention of every snapshot its copy holds before it reads each file it sends."""

    def __init__(self, run: Run):
        self.run, self.in_use, self.sent = run, [], {}

    def stream(self, outgoing, fill, sources, take, meanwhile=None, land=None):
        assert sources == []  # node 0 only sends here
        for dest, files in outgoing.items():
            for path, size in files:
                self.in_use.append(discard_snapshots(Run(self.run.root), Run(self.run.root).steps()).in_use)
                buffer = bytearray(size)
                filled = fill(dest, path, memoryview(buffer))
                self.sent[path.partition(":")[2]] = bytes(filled if filled is not None else buffer)  # named "<step>:<path>"
        if meanwhile is not None:
            meanwhile()


def test_a_healing_sender_holds_what_it_sends_against_its_own_retention(tmp_path):
    """Retention on the sending node while it heals another leaves the snapshot sent in place
    (read under a lease): every file goes out whole; what it does not send is removed."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    courier = RetainingCourier(runs[0])
    recovery_healing.heal(runs[0], moves, Nodes((0, 1)), courier, LocalCoordinator(), "t")
    assert courier.in_use and all(in_use == [2] for in_use in courier.in_use)
    snapshot = copies[0] / "snapshots" / "step-00000002"
    assert courier.sent == {m.path: (snapshot / m.path).read_bytes() for m in moves}
    assert Run(copies[0]).steps() == [2]  # step 1, not sent, went


class SendingCourier:
    """A courier's sending side in one process: each file ``fill`` gives, as it would go out;
    then ``meanwhile``, as the courier runs it once every send is posted; what the sending ``run`` had handed to
    its own restore before that (``handed_while_posting``), and just after each file's ``fill``
    (``handed_at_fill``: name -> the keys handed over by then)."""

    def __init__(self, run: Run):
        self.run, self.sent, self.handed_while_posting, self.handed_at_fill = run, {}, None, {}

    def stream(self, outgoing, fill, sources, take, meanwhile=None, land=None):
        for dest, files in outgoing.items():
            for path, size in files:
                buffer = bytearray(size)
                filled = fill(dest, path, memoryview(buffer))
                self.sent[path.partition(":")[2]] = bytes(filled if filled is not None else buffer)  # named "<step>:<path>"
                self.handed_at_fill[path.partition(":")[2]] = sorted([*self.run.units.arrived, *self.run.units.unchecked])
        self.handed_while_posting = sorted([*self.run.units.arrived, *self.run.units.unchecked])
        if meanwhile is not None:
            meanwhile()


def test_a_healing_sender_hands_its_own_restore_the_files_it_sent_checked_by_their_reads_and_a_damaged_one_not(
        tmp_path, monkeypatch):
    """The sending node's own restore takes the bytes of the files it sent, as mapped while they
    went out (``UnitReader.unchecked``), instead of reading them again: the first read of one
    checks them against its record (``UnitReader.arrival``); one that does not match is not
    taken: its restore reads the file, and the check fails there. A file that restore never
    reads (a partner's part) is never hashed by the sender: before, each file was hashed as it
    was handed over, read or not (here the sizes of every file sent). The small files of no
    rank's part (manifest, indexes, global state: the restore's first reads, shared with the
    other ranks before any part is read) are handed over as each goes out, so that the sending
    node's restore does not wait for every part's send to be posted."""
    from llmtailor.store import units as units_module

    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    damaged = "units/layer.0.rank-00000.safetensors"
    path = copies[0] / "snapshots" / "step-00000002" / damaged
    path.write_bytes(bytes([path.read_bytes()[0] ^ 1]) + path.read_bytes()[1:])
    hashed: list[int] = []
    for module in (recovery_healing, units_module):
        monkeypatch.setattr(module, "checksum", lambda data, real=module.checksum: hashed.append(len(data)) or real(data))
    courier = SendingCourier(runs[0])
    recovery_healing.heal(runs[0], moves, Nodes((0, 1)), courier, LocalCoordinator(), "t")
    prefix = "snapshots/step-00000002/"
    small = sorted(prefix + m.path for m in moves if writer_rank(m.path) is None)
    assert small and courier.handed_while_posting == small
    assert all(prefix + name in handed for name, handed in courier.handed_at_fill.items() if writer_rank(name) is None)
    assert hashed == [] and runs[0].units.arrived == {}
    assert sorted(runs[0].units.unchecked) == sorted(prefix + m.path for m in moves)
    read = [move for move in moves if move.path == damaged or writer_rank(move.path) is None]  # a restore's reads
    for move in read:
        got = runs[0].units.arrival(runs[0].storage, prefix + move.path,
                                    FileEntry(path=move.path, bytes=move.bytes, xxh3_64=move.xxh3))
        sent = (copies[0] / prefix / move.path).read_bytes()
        if move.path == damaged:
            assert got is None  # read from the file, where its check fails
        else:
            assert bytes(got) == courier.sent[move.path] == sent
            assert runs[0].units.arrived[prefix + move.path][:2] == (move.bytes, move.xxh3)
    again = next(move for move in read if move.path != damaged)
    assert bytes(runs[0].units.arrival(runs[0].storage, prefix + again.path, FileEntry(
        path=again.path, bytes=again.bytes, xxh3_64=again.xxh3))) == courier.sent[again.path]
    assert sorted(hashed) == sorted(move.bytes for move in read)  # each read checked once; the others never hashed
    assert sorted(runs[0].units.unchecked) == sorted(prefix + m.path for m in moves if m not in read)


# -- the restore reads each file as it arrives (``healing.Healing``, ``UnitReader.coming``) ---------

def node_1_reads(runs: list, move: Transfer) -> dict:
    """Node 1's restore reading the file of ``move`` on a thread of its own (as it does while its
    healing streams): what it got or raised, once ``thread`` ended."""
    said: dict = {}

    def read() -> None:
        try:
            said["got"] = bytes(runs[1].units.read_small(f"snapshots/step-00000002/{move.path}",
                                                         FileEntry(path=move.path, bytes=move.bytes, xxh3_64=move.xxh3)))
        except Exception as err:
            said["raised"] = err

    said["thread"] = threading.Thread(target=read)
    said["thread"].start()
    return said


def test_a_file_still_coming_is_read_once_it_arrived_and_checked_and_its_snapshot_counts_as_committed_meanwhile(tmp_path):
    """While node 1's healing receives (its restore runs meanwhile), the snapshot new there is
    listed and leased there, and a read of a file not in yet waits for it, then takes the bytes
    that arrived and checked out; nothing is read from the node's copy."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    receiving = Receiving(runs[1], 2, moves, Nodes((0, 1)))
    assert runs[1].steps() == [2]
    index = next(m for m in moves if m.path.startswith("index/"))
    reading = node_1_reads(runs, index)
    for m in moves:
        if m is not index:
            receiving.take(m.source, m.path, memoryview((runs[0].snapshot_dir(2) / m.path).read_bytes()))
    assert reading["thread"].is_alive() and "raised" not in reading  # its file has not arrived: it cannot be read yet
    receiving.take(index.source, index.path, memoryview((runs[0].snapshot_dir(2) / index.path).read_bytes()))
    reading["thread"].join(60)
    assert reading.get("got") == (runs[0].snapshot_dir(2) / index.path).read_bytes(), reading
    assert receiving.finish() is None
    runs[1].settle_commits()
    assert runs[1].commit_failure() is None and Run(copies[1]).steps() == [2]


def test_a_file_damaged_on_the_way_fails_the_readers_of_every_file_not_in_yet_at_once_naming_it(tmp_path):
    """A file that does not check out fails every read of a file not handed over yet, at once
    (not when the stream ends), naming the damaged file and the node that sent it; once the
    restore took the outcome, what was handed over is withdrawn and the snapshot no longer
    counts as committed there (not before: a lease refused on one rank only would leave the
    ranks' collective reads out of step)."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    receiving = Receiving(runs[1], 2, moves, Nodes((0, 1)))
    damaged = next(m for m in moves if m.path.startswith("units/"))
    waiting = next(m for m in moves if m.path == "global.json")
    reading = node_1_reads(runs, waiting)
    content = (runs[0].snapshot_dir(2) / damaged.path).read_bytes()
    receiving.take(damaged.source, damaged.path, memoryview(content[:-1] + bytes([content[-1] ^ 1])))
    reading["thread"].join(60)  # before any other file arrives
    assert isinstance(reading.get("raised"), IntegrityError), reading
    assert f"{damaged.path} from node 0: got {damaged.bytes} bytes" in str(reading["raised"])
    assert receiving.finish() is not None
    assert runs[1].steps() == [2]  # until the restore reading beside it took the outcome: its reads fail on the error
    receiving.withdraw()
    assert runs[1].steps() == [] and not runs[1].units.arrived and Run(copies[1]).steps() == []


class DyingSender:
    """Node 1's side of a stream (``Courier.stream`` in one process) whose sender dies once the
    files of ``delivered`` are in and ``died`` is set: the stream fails as the courier's does
    when a peer dies, naming its rank."""

    def __init__(self, source: Run, delivered: list[str], died: threading.Event):
        self.source, self.delivered, self.died = source, delivered, died

    def stream(self, outgoing, fill, sources, take, meanwhile=None, land=None):
        assert outgoing == {} and sources == [0]
        for path in self.delivered:  # as the stream names a snapshot's file: "<step>:<path>"
            take(0, f"2:{path}", memoryview((self.source.snapshot_dir(2) / path).read_bytes()))
        self.died.wait(60)
        raise CoordinationError("receiving files from rank 0 failed: the rank died or its connection failed (closed)")


def test_a_sender_dying_after_the_restore_read_what_arrived_fails_the_readers_of_the_rest_naming_it(tmp_path):
    """Node 1's healing streams while its restore reads: the files in are read from what arrived;
    then the sender dies: every read of a file not in raises the stream's failure, naming the
    rank, and so does the healing's outcome; nothing is committed and what arrived is withdrawn."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    first, rest = [m for m in moves if writer_rank(m.path) is None], [m for m in moves if writer_rank(m.path) is not None]
    died = threading.Event()
    under_way = recovery_healing.Healing(runs[1], moves, Nodes((0, 1)), DyingSender(runs[0], [m.path for m in first], died), 1)
    reading = node_1_reads(runs, first[-1])
    reading["thread"].join(60)
    assert reading.get("got") == (runs[0].snapshot_dir(2) / first[-1].path).read_bytes(), reading
    with runs[1].lease(2) as composite:  # listed and leased on node 1 while the rest streams
        assert composite.step == 2
    reading = node_1_reads(runs, rest[0])
    died.set()
    reading["thread"].join(60)
    assert isinstance(reading.get("raised"), CoordinationError) and "files from rank 0 failed" in str(reading["raised"])
    with pytest.raises(CoordinationError, match="receiving files from rank 0 failed"):
        under_way.outcome()
    assert runs[1].steps() == [] and not runs[1].units.arrived and Run(copies[1]).steps() == []
    assert not list((copies[1] / ".tmp").iterdir())


def node_of_two_ranks(runs: list, copies: list, moves: list, sender) -> tuple:
    """Node 1 run by two ranks (1, its leader, and 2) beside node 0's rank 0, over one store
    (``StoreCoordinator.over`` a ``HashStore``): the leader's healing (it alone receives, from
    ``sender``) and rank 2's, each a ``Run`` of node 1's copy of its own; rank 2's run."""
    from torch.distributed import HashStore

    from llmtailor.distributed.coordinator import StoreCoordinator

    store, nodes = HashStore(), Nodes((0, 1, 1))
    posts = [recovery_healing.NodePosts(StoreCoordinator.over(store, rank, 3, timeout=60), "r1/staged") for rank in (1, 2)]
    second = Run(copies[1])
    assert not recovery_healing.committed_first(moves, nodes, 1)  # every snapshot new there: read as it arrives
    leader = recovery_healing.Healing(runs[1], moves, nodes, sender, 1, posts[0])
    follower = recovery_healing.Healing(second, moves, nodes, None, 2, posts[1])
    return leader, follower, second


def test_a_second_rank_of_the_replacement_node_reads_each_file_its_leader_wrote_checked_and_fails_on_the_streams_failure(tmp_path):
    """Node 1 runs two ranks and only its leader receives: its second rank's restore reads each
    file as the leader posts that it received, checked and wrote it (staged: the snapshot is not
    committed yet, counted as committed there meanwhile), checked again where it lies; then the
    sender dies: that rank's read of a file not in raises the stream's failure naming the rank,
    as its outcome does; nothing is committed, and what it was handed is withdrawn."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    first, rest = [m for m in moves if writer_rank(m.path) is None], [m for m in moves if writer_rank(m.path) is not None]
    died = threading.Event()
    leader, follower, second = node_of_two_ranks(runs, copies, moves, DyingSender(runs[0], [m.path for m in first], died))
    assert second.steps() == [2] and Run(copies[1]).steps() == []  # listed for its restore, not committed
    taken = next(m for m in first if m.path != MANIFEST_FILE)
    reading = node_1_reads([runs[0], second], taken)
    reading["thread"].join(60)
    assert reading.get("got") == (runs[0].snapshot_dir(2) / taken.path).read_bytes(), reading
    assert f"snapshots/step-00000002/{taken.path}" in second.units.arrived
    reading = node_1_reads([runs[0], second], rest[0])
    died.set()
    reading["thread"].join(60)
    assert isinstance(reading.get("raised"), CoordinationError) and "files from rank 0 failed" in str(reading["raised"])
    for under_way in (leader, follower):
        with pytest.raises(CoordinationError, match="receiving files from rank 0 failed"):
            under_way.outcome()
    assert second.steps() == [] and not second.units.arrived and Run(copies[1]).steps() == []


def test_a_file_a_leader_wrote_that_does_not_check_out_where_it_lies_fails_its_second_ranks_read_naming_it(tmp_path):
    """A file the leader posted as written, damaged where it lies before node 1's second rank
    maps it: that rank's read raises IntegrityError naming the file (it is checked against its
    move again, never taken on the leader's word)."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    taken = next(m for m in moves if m.path.startswith("units/"))
    damaged = copies[1] / "damaged"
    content = (runs[0].snapshot_dir(2) / taken.path).read_bytes()
    damaged.write_bytes(content[:-1] + bytes([content[-1] ^ 1]))

    class Posting:  # the leader's post, pointing at the damaged bytes (as a leader's staged file)
        def stream(self, outgoing, fill, sources, take, meanwhile=None, land=None):
            died.wait(60)
            raise CoordinationError("receiving files from rank 0 failed: stopped by the test")

    died = threading.Event()
    leader, follower, second = node_of_two_ranks(runs, copies, moves, Posting())
    leader._posts.file(1, 2, taken.path, {"at": os.path.relpath(damaged, copies[1])})
    reading = node_1_reads([runs[0], second], taken)
    reading["thread"].join(60)
    assert isinstance(reading.get("raised"), IntegrityError), reading
    assert f"{taken.path}: as node 1's leader received and wrote it: {taken.bytes} bytes" in str(reading["raised"])
    died.set()
    for under_way in (leader, follower):
        with pytest.raises(CoordinationError):
            under_way.outcome()


def test_a_second_rank_whose_leader_never_ends_its_healing_counts_nothing_of_it_and_a_later_save_does_not_wait(tmp_path):
    """Node 1's second rank, its leader silent (died before it posted its end): the outcome
    raises a CoordinationError naming the leader once the coordinator's timeout ran out, and the
    snapshot it counted as committed meanwhile is withdrawn (what waits for the background
    commits, a save, returns: it does not wait for a commit no one runs)."""
    from torch.distributed import HashStore

    from llmtailor.distributed.coordinator import StoreCoordinator

    copies, runs, held = node_one_wiped(tmp_path)
    moves, second = healing(held, 2), Run(copies[1])
    posts = recovery_healing.NodePosts(StoreCoordinator.over(HashStore(), 2, 3, timeout=1), "r1/staged")
    follower = recovery_healing.Healing(second, moves, Nodes((0, 1, 1)), None, 2, posts)
    assert second.steps() == [2]
    with pytest.raises(CoordinationError, match=r"rank\(s\) \[1\] did not report the end of node 1's healing"):
        follower.outcome()
    settled = threading.Thread(target=second.settle_commits)
    settled.start()
    settled.join(60)
    assert not settled.is_alive() and second.steps() == [] and second.commit_failure() is None


class DeliveringSender:
    """Node 1's side of a stream (``Courier.stream`` in one process) whose sender sends every
    file of step 2 from ``source``, in the order of ``paths``; what ``take`` raised fails the
    stream, as it fails the courier's."""

    def __init__(self, source: Run, paths: list[str]):
        self.source, self.paths, self.taken = source, paths, []

    def stream(self, outgoing, fill, sources, take, meanwhile=None, land=None):
        for path in self.paths:
            take(0, f"2:{path}", memoryview((self.source.snapshot_dir(2) / path).read_bytes()))
            self.taken.append(path)


def test_a_write_failing_unexpectedly_fails_the_readers_of_every_file_and_lists_nothing(tmp_path, monkeypatch):
    """A background write of a healed file that fails with an error of no kind the healing
    expects (not an OSError): every read of a file of that snapshot raises (none waits for
    ever), the stream goes on to its end (a ``take`` that raised would leave the sender's sends
    waiting until its timeout), the healing's outcome says why, and nothing is listed or left
    committing here."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    monkeypatch.setattr(recovery_healing, "HAND_OVER_BYTES", 0)  # none kept: each read waits for its write

    def broken(sink, data):
        sink.abort()
        raise RuntimeError("the sink broke")

    monkeypatch.setattr(recovery_healing, "write_to", broken)
    ordered = sorted(m.path for m in moves)
    stream = DeliveringSender(runs[0], ordered)
    under_way = recovery_healing.Healing(runs[1], moves, Nodes((0, 1)), stream, 1)
    readings = [node_1_reads(runs, m) for m in moves]
    for reading in readings:
        reading["thread"].join(60)
        assert not reading["thread"].is_alive(), "a read of a healed file waits for ever"
        assert "the sink broke" in str(reading.get("raised")), reading
    with pytest.raises(RuntimeError, match="the sink broke"):
        under_way.outcome()
    assert stream.taken == ordered  # ``take`` recorded the failure, never raised it: the sender's sends all taken
    runs[1].settle_commits()
    assert runs[1].steps() == [] and Run(copies[1]).steps() == []
    assert not list((copies[1] / ".tmp").iterdir())


def test_a_healing_whose_thread_cannot_start_leaves_nothing_counted_as_committing(tmp_path, monkeypatch):
    """A healing that cannot start its stream's thread (``can't start new thread``) raises, and
    leaves nothing behind: its snapshot new here is not listed, no reader of its files waits,
    and the next listing of the copy (a restore's survey: ``settle_commits``) does not wait for
    a commit that will never run."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)

    class Unstartable(threading.Thread):
        def start(self):
            if self.name == "llmtailor-healing":  # the stream's; its receiving's writer started
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(recovery_healing.threading, "Thread", Unstartable)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        recovery_healing.Healing(runs[1], moves, Nodes((0, 1)), DeliveringSender(runs[0], []), 1)
    monkeypatch.undo()
    assert runs[1].steps() == []
    assert all(coming.done() for coming in runs[1].units.coming.values())
    settled = threading.Thread(target=runs[1].settle_commits, daemon=True)
    settled.start()
    settled.join(60)
    assert not settled.is_alive(), "settle_commits waits for a healing that never ran"


def test_a_sender_whose_lease_cannot_be_taken_still_streams_every_file(tmp_path, monkeypatch):
    """A healing's sender that cannot take its read lease (its lease file refused: a full disk)
    still sends what it lists, from its copy as it is (a file gone meanwhile goes out as nothing,
    which its receiver refuses): its receivers, already waiting for its stream, never wait for it
    until their timeout."""
    import errno

    from llmtailor.store.catalog import ReadLeases

    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)

    def refused(self, step):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ReadLeases, "take", refused)
    courier = SendingCourier(runs[0])
    assert recovery_healing.Healing(runs[0], moves, Nodes((0, 1)), courier, 0).outcome() is None
    snapshot = copies[0] / "snapshots" / "step-00000002"
    assert courier.sent == {m.path: (snapshot / m.path).read_bytes() for m in moves}


def test_a_sender_whose_read_of_a_file_fails_unforeseen_still_streams_every_file(tmp_path, monkeypatch, caplog):
    """A healing's sender whose read of one file fails with an error of no kind it expects
    (not an OSError) logs it and sends that file as its buffer was (its receiver refuses it,
    naming the file and the sender), then every other: a raise would end its stream there, and
    its receivers would wait for the rest until their timeout."""
    copies, runs, held = node_one_wiped(tmp_path)
    moves = healing(held, 2)
    broken = next(m.path for m in moves if m.path.startswith("units/"))
    mapped = type(runs[0].storage).mapped

    def failing(self, key):
        if key.endswith(broken):
            raise RuntimeError("the mapping broke")
        return mapped(self, key)

    monkeypatch.setattr(type(runs[0].storage), "mapped", failing)
    courier = SendingCourier(runs[0])
    assert recovery_healing.Healing(runs[0], moves, Nodes((0, 1)), courier, 0).outcome() is None
    snapshot = copies[0] / "snapshots" / "step-00000002"
    assert sorted(courier.sent) == sorted(m.path for m in moves)
    assert all(courier.sent[m.path] == (snapshot / m.path).read_bytes() for m in moves if m.path != broken)
    assert courier.sent[broken] != (snapshot / broken).read_bytes() and "the mapping broke" in caplog.text
