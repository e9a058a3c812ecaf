"""The commit refuses a snapshot that would lack part of the model: its composite must name every
unit of its layout and every unit some rank holds or wrote, and the ranks' units together must be
its layout (``writer._check_whole``). Found with
pipeline stages (ranks holding different layers): the leader committed its own stage's units,
the other stage's files orphaned, and ``verify`` passed the snapshot. It refuses too, in one
line, a tensor two ranks wrote the same elements of (``writer._check_written_once``)."""

from __future__ import annotations

import pytest
import torch

from llmtailor.distributed.coordinator import LocalCoordinator, StoreCoordinator
from llmtailor.errors import TailorError
from llmtailor.layouts import Layout, layout_from_names
from llmtailor.store.manifest import FileEntry
from llmtailor.store.run import Run
from llmtailor.store.staged import ChunkPart, Piece, RankPart, StagedSnapshot, StagedUnit, TensorPart, UnitPart
from llmtailor.store.writer import persist

NAMES = ["model.embed_tokens.weight", *(f"model.layers.{i}.mlp.weight" for i in range(4)), "model.norm.weight"]
WHOLE = layout_from_names(NAMES)
FIRST_STAGE = layout_from_names(NAMES[:3])  # embed, layer.0, layer.1


class TwoStages(LocalCoordinator):
    """Rank 0 of a world of two, whose rank 1 (the second pipeline stage) reported ``other``."""

    world_size = 2

    def __init__(self, other: dict):
        super().__init__()
        self.other = other

    def gather(self, tag, value):
        if isinstance(value, BaseException):
            raise value
        return [value, self.other]


def staged(layout: Layout, units: list[str], world_size: int = 1, stage: Layout | None = None) -> StagedSnapshot:
    """Step 1 writing ``units`` of ``layout`` whole, its composite naming them only; ``stage``:
    the leader holds that stage's units of the run's ``layout`` and the composite names all of it."""
    source = stage or layout
    return StagedSnapshot(
        step=1, parent=None, save_index=0, policy="test", layout=layout.to_record(),
        units=iter([StagedUnit.whole(u, {f"weight/{n}": torch.ones(2)}) for u in units for n in source.units[u]]),
        composite={u: 1 for u in (layout.units if stage else units)}, global_doc={}, global_tensors={},
        world_size=world_size, holds=list(stage.units) if stage else None,
    )


def second_stage_part(holds: tuple[str, ...] = ("layer.2", "layer.3", "norm")) -> dict:
    """Rank 1's report: it holds ``holds`` (layers 2 and 3 and the norm), and wrote layers 2 and 3."""
    def unit(i: int) -> UnitPart:
        file = FileEntry(path=f"units/layer.{i}.rank-00001.safetensors", bytes=8, xxh3_64="0" * 16)
        chunk = ChunkPart(offsets=[0], shape=[2], xxh3_64="0" * 16)
        return UnitPart(file=file, tensors=[TensorPart(key=f"weight/model.layers.{i}.mlp.weight", dtype="float32",
                                                       shape=[2], chunks=[chunk])])

    return RankPart(units={"layer.2": unit(2), "layer.3": unit(3)}, holds=list(holds)).to_message()


def assert_nothing_committed(root) -> None:
    assert Run(root).steps() == [] and not (root / "latest").exists()
    assert not any((root / ".tmp").iterdir())  # what was staged is removed


def test_a_composite_lacking_units_of_its_layout_is_not_committed(tmp_path):
    """The first stage's units saved under the whole model's layout: committed before."""
    with pytest.raises(TailorError, match=r"step 1 was not committed, as it would lack part of the model: its composite "
                                          r"names no version of units \[layer.2, layer.3, norm\] that its layout holds"):
        persist(Run(tmp_path), staged(WHOLE, ["embed", "layer.0", "layer.1"]))
    assert_nothing_committed(tmp_path)


def test_units_another_rank_holds_and_wrote_that_the_composite_lacks_are_not_left_out(tmp_path):
    """The leader holds the first stage; rank 1, the second, wrote its own units: the leader
    committed its own only (rank 1's files orphaned in the snapshot) before."""
    with pytest.raises(TailorError, match=r"rank\(s\) \[1\] hold units \[layer.2, layer.3, norm\] that its composite "
                                          r"does not name; rank\(s\) \[1\] wrote units \[layer.2, layer.3\] that its "
                                          r"composite does not name at this step"):
        persist(Run(tmp_path), staged(FIRST_STAGE, ["embed", "layer.0", "layer.1"], world_size=2),
                coordinator=TwoStages(second_stage_part()))
    assert_nothing_committed(tmp_path)


def test_a_snapshot_of_the_whole_layout_commits(tmp_path):
    """The check passes what every save writes: the composite names every unit of the layout."""
    persist(Run(tmp_path), staged(WHOLE, list(WHOLE.units)))
    assert Run(tmp_path).steps() == [1] and Run(tmp_path).verify() == []


def test_a_shard_two_ranks_wrote_fails_the_commit_in_one_line_naming_tensor_and_ranks(tmp_path):
    """Rank 1 also wrote the embedding's chunk rank 0 wrote (two ranks holding one shard, as the
    tensor-parallel ranks of a tensor on the data sub-mesh did): the commit raised a raw pydantic
    ValidationError ("chunks cover 4 of 2 elements and overlap") before; now one TailorError
    naming the tensor, the unit, both ranks and the chunks, and nothing is committed."""
    file = FileEntry(path="units/embed.rank-00001.safetensors", bytes=8, xxh3_64="0" * 16)
    chunk = ChunkPart(offsets=[0], shape=[2], xxh3_64="0" * 16)
    again = UnitPart(file=file, tensors=[TensorPart(key="weight/model.embed_tokens.weight", dtype="float32", shape=[2],
                                                    chunks=[chunk])])
    other = RankPart(units={"embed": again}, holds=list(WHOLE.units)).to_message()
    with pytest.raises(TailorError) as raised:
        persist(Run(tmp_path), staged(WHOLE, list(WHOLE.units), world_size=2), coordinator=TwoStages(other))
    assert str(raised.value) == (
        "step 1 was not committed: tensor 'weight/model.embed_tokens.weight' of unit 'embed' was written twice in "
        "part: rank 0 wrote its chunk at [0] of shape [2], rank 1 its chunk at [0] of shape [2] (the ranks hold "
        "copies of one shard, and each wrote it)")
    assert_nothing_committed(tmp_path)


def test_a_unit_of_the_run_no_stage_holds_is_not_committed(tmp_path):
    """Two pipeline stages under the run's layout (the union of theirs), the norm held by neither."""
    with pytest.raises(TailorError, match=r"would lack part of the model: no rank holds units \[norm\] of its layout; "
                                          r"no rank wrote units \[norm\]$"):
        persist(Run(tmp_path), staged(WHOLE, ["embed", "layer.0", "layer.1"], world_size=2, stage=FIRST_STAGE),
                coordinator=TwoStages(second_stage_part(holds=("layer.2", "layer.3"))))
    assert_nothing_committed(tmp_path)


def test_the_leader_validates_its_own_part_once_in_the_indexes_and_the_other_ranks_on_arrival(tmp_path, monkeypatch):
    """The leader's own part is not dumped to a message and validated back (every chunk twice
    per save before); another rank's report still is, and the commit still refuses what the
    indexes' validation finds wrong in either."""
    calls = {"to_message": 0, "from_message": 0}
    to_message, from_message = RankPart.to_message, RankPart.from_message.__func__

    def counted_to(self):
        calls["to_message"] += 1
        return to_message(self)

    def counted_from(cls, message):
        calls["from_message"] += 1
        return from_message(cls, message)

    monkeypatch.setattr(RankPart, "to_message", counted_to)
    monkeypatch.setattr(RankPart, "from_message", classmethod(counted_from))
    persist(Run(tmp_path / "one"), staged(WHOLE, list(WHOLE.units)))
    assert calls == {"to_message": 0, "from_message": 0} and Run(tmp_path / "one").verify() == []
    file = FileEntry(path="units/embed.rank-00001.safetensors", bytes=8, xxh3_64="0" * 16)
    again = UnitPart(file=file, tensors=[TensorPart(key="weight/model.embed_tokens.weight", dtype="float32", shape=[2],
                                                    chunks=[ChunkPart(offsets=[0], shape=[2], xxh3_64="0" * 16)])])
    other = RankPart(units={"embed": again}, holds=list(WHOLE.units)).to_message()
    calls.update(to_message=0, from_message=0)
    with pytest.raises(TailorError, match=r"rank 0 wrote its chunk at \[0\] of shape \[2\], rank 1 its chunk"):
        persist(Run(tmp_path / "two"), staged(WHOLE, list(WHOLE.units), world_size=2), coordinator=TwoStages(other))
    assert calls == {"to_message": 0, "from_message": 1}  # rank 1's report, validated where it arrives


def test_the_unit_indexes_are_validated_once_and_written_as_validated_without_pydantic_serialising(tmp_path, monkeypatch):
    """Each unit's index line is built in its written (compact) form, validated once as it is
    (``UnitEntry``) and encoded as it is: no chunk is dumped into a dict and no index is dumped
    back out of its model (a fixed cost of every save, per chunk; bench/RESULTS.md, issue 33,
    session 46). What is written reads back to the entry that was validated, in the same bytes
    as that entry dumps, for whole tensors, pieces (a world of two) and page checksums alike."""
    from pydantic import BaseModel

    from llmtailor.constants import INDEXES_FILE, snapshot_dirname
    from llmtailor.store.manifest import UnitEntry

    dumped: dict[str, int] = {}
    model_dump = BaseModel.model_dump

    def counted(self, *args, **kwargs):
        dumped[type(self).__name__] = dumped.get(type(self).__name__, 0) + 1
        return model_dump(self, *args, **kwargs)

    monkeypatch.setattr(BaseModel, "model_dump", counted)
    _saved_with_a_paged_chunk(tmp_path / "one")
    assert dumped == {"Manifest": 1}
    monkeypatch.undo()
    lines = (tmp_path / "one" / "snapshots" / snapshot_dirname(1) / INDEXES_FILE).read_bytes().splitlines(keepends=True)
    assert len(lines) == len(WHOLE.units) and Run(tmp_path / "one").verify() == []
    assert any(b'"pages":[' in line for line in lines)
    for line in lines:
        assert (UnitEntry.model_validate_json(line).dumps() + "\n").encode() == line
    # A world of two: rank 1 wrote the second half of a norm rank 0 wrote the first half of.
    half = FileEntry(path="units/norm.rank-00001.safetensors", bytes=8, xxh3_64="0" * 16)
    other = RankPart(units={"norm": UnitPart(file=half, tensors=[TensorPart(
        key=f"weight/{NAMES[-1]}", dtype="float32", shape=[4], chunks=[ChunkPart(offsets=[2], shape=[2], xxh3_64="1" * 16)])])},
        holds=list(WHOLE.units)).to_message()
    pieces = iter([*(StagedUnit.whole(u, {f"weight/{n}": torch.ones(2)}) for u in list(WHOLE.units)[:-1] for n in WHOLE.units[u]),
                   StagedUnit("norm", [Piece(f"weight/{NAMES[-1]}", torch.ones(2), (0,), (4,))])])
    two = StagedSnapshot(step=1, parent=None, save_index=0, policy="test", layout=WHOLE.to_record(), units=pieces,
                         composite={u: 1 for u in WHOLE.units}, global_doc={}, global_tensors={}, world_size=2)
    persist(Run(tmp_path / "two"), two, coordinator=TwoStages(other))
    norm = (tmp_path / "two" / "snapshots" / snapshot_dirname(1) / INDEXES_FILE).read_bytes().splitlines(keepends=True)[-1]
    entry = UnitEntry.model_validate_json(norm)
    assert (entry.dumps() + "\n").encode() == norm
    assert [(c.file, c.offsets, c.shape) for c in entry.tensors[0].chunks] == [(0, [0], [2]), (1, [2], [2])]


def test_the_leaders_own_chunks_are_not_built_as_pydantic_models(tmp_path, monkeypatch):
    """The leader's own part is never sent, so its chunks and tensors are plain tuples of the
    same fields, not ``ChunkPart`` / ``TensorPart`` models (``model_construct`` twice per chunk was
    a fixed cost of every save: bench/RESULTS.md, issue 33, session 47); a rank that sends its
    part still builds them. The snapshot verifies, and every chunk's index line is as before
    (page checksums included)."""
    from llmtailor.constants import INDEXES_FILE, snapshot_dirname
    from llmtailor.store.manifest import UnitEntry

    built: dict[str, int] = {}
    for model in (ChunkPart, TensorPart):
        real = model.model_construct

        def counted(*args, real=real, name=model.__name__, **kwargs):
            built[name] = built.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(model, "model_construct", counted)
    big = _saved_with_a_paged_chunk(tmp_path / "one")
    assert built == {}
    monkeypatch.undo()
    run = Run(tmp_path / "one")
    assert run.verify() == []
    lines = (tmp_path / "one" / "snapshots" / snapshot_dirname(1) / INDEXES_FILE).read_bytes().splitlines()
    embed = UnitEntry.model_validate_json(lines[0])
    chunk = embed.tensors[0].chunks[0]
    assert (chunk.file, chunk.offsets, chunk.shape, chunk.page_bytes, len(chunk.pages)) == (0, [0], [300 << 10], 8192, 150)
    assert torch.equal(run.read_unit(1, "embed")[0][f"weight/{NAMES[0]}"], big)


def _saved_with_a_paged_chunk(root) -> torch.Tensor:
    """Step 1 of ``WHOLE`` persisted at ``root`` in one process, its embedding a 1.2 MB tensor (a
    chunk with page checksums), the rest tiny; returns that tensor."""
    big = torch.arange(300 << 10, dtype=torch.float32)
    units = iter([StagedUnit.whole("embed", {f"weight/{NAMES[0]}": big}),
                  *(StagedUnit.whole(u, {f"weight/{n}": torch.ones(2)}) for u in list(WHOLE.units)[1:] for n in WHOLE.units[u])])
    one = StagedSnapshot(step=1, parent=None, save_index=0, policy="test", layout=WHOLE.to_record(), units=units,
                         composite={u: 1 for u in WHOLE.units}, global_doc={}, global_tensors={})
    persist(Run(root), one)
    return big


def test_the_leaders_own_whole_tensor_indexes_are_checked_by_construction_and_validated_where_read(tmp_path, monkeypatch):
    """A unit index the leader built from its own part alone, every tensor one whole chunk of a
    known dtype in a file it wrote, nothing kept, is valid by construction: it is not validated
    as a ``UnitEntry`` at save (~0.7 ms of a small save's main thread: bench/RESULTS.md, issue 33,
    session 49), but read back and validated wherever it is read. An index holding another rank's
    chunks, or kept tensors, is still validated at save, and refused there when invalid."""
    from llmtailor.store.manifest import UnitEntry

    validated: list[str] = []
    model_validate = UnitEntry.model_validate.__func__

    def counted(cls, obj, *args, **kwargs):
        validated.append(obj["unit"])
        return model_validate(cls, obj, *args, **kwargs)

    monkeypatch.setattr(UnitEntry, "model_validate", classmethod(counted))
    persist(Run(tmp_path / "one"), staged(WHOLE, list(WHOLE.units)))
    assert validated == []
    assert Run(tmp_path / "one").verify() == []  # every line read back and validated
    ends = layout_from_names([*NAMES[:3], NAMES[-1]])  # the leader's stage: the embedding, layers 0 and 1, the norm
    persist(Run(tmp_path / "two"), staged(WHOLE, list(ends.units), world_size=2, stage=ends),
            coordinator=TwoStages(second_stage_part(holds=("layer.2", "layer.3"))))
    assert validated == ["layer.2", "layer.3"]  # rank 1's units; the leader's own ones not
    kept = StagedUnit.whole("embed", {f"weight/{NAMES[0]}": torch.ones(2)})
    kept.kept = {"weight/model.embed_tokens.extra": 1}  # kept from this very step: invalid
    # An optimizer value under a key that is not a string (JSON would write it as one): invalid too.
    odd = StagedUnit.whole("embed", {f"weight/{NAMES[0]}": torch.ones(2)}, values={NAMES[0]: {0: 1}})
    for name, embed, reason in (("three", kept, r".* kept from step 1, not before step 1"), ("four", odd, " the ranks reported is invalid")):
        bad = StagedSnapshot(step=1, parent=None, save_index=0, policy="test", layout=WHOLE.to_record(),
                             units=iter([embed, *(StagedUnit.whole(u, {f"weight/{n}": torch.ones(2)})
                                                  for u in list(WHOLE.units)[1:] for n in WHOLE.units[u])]),
                             composite={u: 1 for u in WHOLE.units}, global_doc={}, global_tensors={})
        with pytest.raises(TailorError, match=f"index of unit 'embed'{reason}"):
            persist(Run(tmp_path / name), bad)
        assert_nothing_committed(tmp_path / name)


def test_the_leader_keeps_the_manifest_it_built_not_one_parsed_back_from_its_bytes(tmp_path, monkeypatch):
    """The leader's run keeps the manifest it built and validated (no parse of the bytes it just
    wrote: ~0.2 ms of a small save); the run's view of the snapshot equals the committed file's."""
    from llmtailor.constants import MANIFEST_FILE, snapshot_dirname
    from llmtailor.store import writer
    from llmtailor.store.manifest import parse_manifest

    parsed = []
    monkeypatch.setattr(writer, "parse_manifest", lambda *args, **kwargs: parsed.append(args) or parse_manifest(*args, **kwargs))
    run = Run(tmp_path)
    persist(run, staged(WHOLE, list(WHOLE.units)))
    assert parsed == []
    raw = (tmp_path / "snapshots" / snapshot_dirname(1) / MANIFEST_FILE).read_bytes()
    assert run.manifest(1) == parse_manifest(raw, "manifest", 1)
    assert run.manifest(1).dumps().encode() == raw


def ddp_part(rank: int) -> StagedSnapshot:
    """Rank ``rank``'s share of step 1 of a world of two (DDP: rank 0 writes the units, both
    their global state)."""
    units = [StagedUnit.whole(u, {f"weight/{n}": torch.ones(2)}) for u in WHOLE.units for n in WHOLE.units[u]]
    return StagedSnapshot(step=1, parent=None, save_index=0, policy="test", layout=WHOLE.to_record(),
                          units=iter(units if rank == 0 else []), composite={u: 1 for u in WHOLE.units},
                          global_doc={} if rank == 0 else None, global_tensors={} if rank == 0 else None,
                          rank_doc={} if rank else None, rank_tensors={} if rank else None, world_size=2)


def claims_told(event) -> type[StoreCoordinator]:
    """A ``StoreCoordinator`` that sets ``event`` once a claim of its has been made (rank 1's of
    the save's gate, when it gives up on rank 0's outcome)."""
    class Watched(StoreCoordinator):
        def claim(self, tag, value):
            try:
                return super().claim(tag, value)
            finally:
                event.set()

    return Watched


@pytest.mark.parametrize("stalls", ["before its gate", "past its gate"])
def test_a_rank_that_gives_up_on_rank_0s_commit_and_rank_0_agree_on_the_save(tmp_path, monkeypatch, stalls):
    """Two ranks (threads over one c10d store, timeout 1 s) save step 1 into one run; rank 0's
    commit stalls without progress (a lock's confirm, a hung rename) until rank 1 gave up waiting
    for its outcome (twice the timeout). Rank 0's word settles the save: stalled before the last
    step that publishes the snapshot, rank 1 claims that step first, so rank 0 never commits, and
    both raise; stalled past it, rank 1 waits on for rank 0's word and both return the committed
    save. Before, rank 1 raised while rank 0 went on and committed: the save failed on one rank,
    committed on the other."""
    import threading

    from torch.distributed import HashStore

    from llmtailor.distributed.coordinator import CoordinationError
    from llmtailor.store.storage.local_commit import LocalCommits

    from helpers import on_threads

    given_up = threading.Event()  # rank 1 claimed the save's gate, or its save ended
    Watched = claims_told(given_up)

    def stall(*_):
        assert given_up.wait(60), "rank 1 neither gave up nor ended"

    real = LocalCommits._named
    if stalls == "past its gate":
        monkeypatch.setattr(LocalCommits, "_named", lambda self, *args: (stall(), real(self, *args))[1])
    store = HashStore()

    def save(rank: int):
        coord = (Watched if rank else StoreCoordinator).over(store, rank, 2, timeout=1)
        try:
            return persist(Run(tmp_path), ddp_part(rank), coordinator=coord,
                           confirm=stall if stalls == "before its gate" else None)
        finally:
            if rank == 1:
                given_up.set()

    outcomes = on_threads(2, save)
    if stalls == "before its gate":
        assert [type(o) for o in outcomes] == [CoordinationError] * 2, outcomes
        assert str(outcomes[0]) == "step 1 was not committed: rank 1 gave up waiting for rank 0's commit first", outcomes
        assert "rank 1 gave up on rank 0's commit of step 1, which never commits it" in str(outcomes[1]), outcomes
        assert_nothing_committed(tmp_path)
    else:
        assert [type(o).__name__ for o in outcomes] == ["PersistResult"] * 2, outcomes
        assert Run(tmp_path).steps() == [1]


def test_rank_0s_outcome_announced_just_after_rank_1_stopped_waiting_for_it_is_taken(tmp_path, monkeypatch):
    """Two ranks (threads over one c10d store, timeout 1 s) save step 1; rank 0 passed its gate
    and renamed the snapshot in, then stalls without progress until rank 1 has given up waiting
    for its outcome, and announces it (committed) just before rank 1 looks whether it announced
    one. Rank 1 takes that word: both return the committed save. Before, rank 1 took any outcome
    found announced then for rank 0's failure and raised its silence ('did not announce'), while
    rank 0 had committed step 1."""
    import threading
    import time

    from torch.distributed import HashStore

    from llmtailor.store.storage.local_commit import LocalCommits

    from helpers import on_threads

    looking = threading.Event()  # rank 1 stopped waiting, and looks whether rank 0 announced its outcome

    class Late(StoreCoordinator):
        def poll(self, tag):
            if tag.endswith("/outcome") and not looking.is_set():
                looking.set()
                deadline = time.monotonic() + 60
                while not super().poll(tag)[0]:  # rank 0 announces it meanwhile
                    assert time.monotonic() < deadline, "rank 0 never announced its outcome"
                    time.sleep(0.01)
            return super().poll(tag)

    real = LocalCommits._named
    monkeypatch.setattr(LocalCommits, "_named", lambda self, *args: (looking.wait(60), real(self, *args))[1])
    store = HashStore()

    def save(rank: int):
        coord = (Late if rank else StoreCoordinator).over(store, rank, 2, timeout=1)
        return persist(Run(tmp_path), ddp_part(rank), coordinator=coord)

    outcomes = on_threads(2, save)
    assert looking.is_set()
    assert [type(o).__name__ for o in outcomes] == ["PersistResult"] * 2, outcomes
    assert Run(tmp_path).steps() == [1]


def test_a_manifest_fsync_that_hangs_until_rank_1_gave_up_then_fails_leaves_every_rank_failed_alike(tmp_path, monkeypatch):
    """The shared tier's twin of node_commit's (tests/store/test_node_commit_rounds.py): two
    ranks (threads over one c10d store, timeout 1 s) save step 1; rank 0's commit has its files
    durable, then the fsync of its manifest hangs (a dying disk) until rank 1 has given up on
    rank 0's outcome (its save over: the event), and then fails (EIO). Rank 0 passes the gate
    only once the manifest and directories are durable, just before the rename: rank 1's claim
    of the gate wins, every rank raises saying step 1 is not committed, and nothing is. Before
    (beat56's ``Gated`` batch, whose drain passed the gate beside the manifest's fsync), rank 1
    found the gate passed, waited on in vain and said step 1 'is committed unless that commit
    failed, and rank 0 says which', though it never was (not false, but not known)."""
    import os
    import threading

    from torch.distributed import HashStore

    from llmtailor.constants import MANIFEST_FILE
    from llmtailor.store.storage import local_durable

    from helpers import on_threads

    gave_up = threading.Event()  # rank 1's save ended
    real, hung = os.fsync, []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(f"/{MANIFEST_FILE}") and not hung:
            hung.append(path)
            assert gave_up.wait(60), "rank 1 never gave up"
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(local_durable.os, "fsync", fsync)
    store = HashStore()

    def save(rank: int):
        try:
            return persist(Run(tmp_path), ddp_part(rank), coordinator=StoreCoordinator.over(store, rank, 2, timeout=1))
        finally:
            if rank == 1:
                gave_up.set()

    outcomes = on_threads(2, save)
    monkeypatch.undo()
    assert hung, "rank 0's manifest was never fsynced"
    assert all(isinstance(o, TailorError) for o in outcomes), outcomes
    assert "input/output error" in str(outcomes[0]).lower(), [str(o) for o in outcomes]
    assert "rank 1 gave up on rank 0's commit of step 1, which never commits it" in str(outcomes[1]), outcomes
    assert_nothing_committed(tmp_path)


@pytest.mark.parametrize("held", ["indexes until rank 1 claimed the gate", "manifest until rank 1 claimed the gate",
                                  "manifest until rank 1's save ended"])
def test_a_rank_giving_up_while_rank_0s_upload_is_held_agrees_with_it_on_an_object_store(monkeypatch, held):
    """The save's gate over an object store (moto behind ``faulty_moto``), two ranks (threads over
    one c10d store, timeout 1 s) saving step 1: the server holds one of rank 0's PUTs unanswered
    until rank 1 has given up on rank 0's outcome (its claim of the gate made, or its save over),
    then acts on it. Held before the gate (the unit indexes, which rank 0's commit waits for):
    rank 1's claim wins, every rank raises, no manifest is ever sent. Held past it (the manifest's
    conditional PUT: the gate is passed just before it), the PUT lands after rank 1's claim:
    rank 0 committed, and rank 1 either waited on and returned the save, or (its second wait over
    first) says step 1 is committed unless rank 0's commit failed; no rank says it failed. Before
    the gate (4310fc5), rank 1 gave up and raised while rank 0 went on and committed step 1, the
    indexes' case too."""
    import threading

    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from objectstore import faulty_moto, keys, new_bucket, set_environment
    from torch.distributed import HashStore

    from llmtailor.constants import INDEXES_FILE, MANIFEST_FILE

    from helpers import on_threads

    claimed, ended = threading.Event(), threading.Event()
    gave_up = ended if held.endswith("save ended") else claimed
    target = f"/{INDEXES_FILE if held.startswith('indexes') else MANIFEST_FILE}"

    Watched = claims_told(claimed)

    kept: list[str] = []

    def hold(method, key):
        if method == "PUT" and key.endswith(target) and not kept:
            kept.append(key)
            assert gave_up.wait(60), "rank 1 never gave up"
        return None  # then moto acts on it

    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        bucket = new_bucket(endpoint)
        url = f"s3://{bucket}/run"
        faults.rule = hold
        store = HashStore()

        def save(rank: int):
            try:
                coord = (Watched if rank else StoreCoordinator).over(store, rank, 2, timeout=1)
                return persist(Run(url), ddp_part(rank), coordinator=coord)
            finally:
                if rank == 1:
                    claimed.set()
                    ended.set()

        outcomes = on_threads(2, save)
        assert kept, f"no PUT of {target} was sent"
        manifests = [key for key in keys(endpoint, bucket) if key.endswith(f"/{MANIFEST_FILE}")]
        puts = [key for method, key, _ in faults.seen if method == "PUT" and key.endswith(f"/{MANIFEST_FILE}")]
        said = [str(o) for o in outcomes]
        if held.startswith("indexes"):
            assert all(isinstance(o, TailorError) for o in outcomes), outcomes
            assert said[0] == "step 1 was not committed: rank 1 gave up waiting for rank 0's commit first", said
            assert "rank 1 gave up on rank 0's commit of step 1, which never commits it" in said[1], said
            assert manifests == [] and puts == [] and Run(url).steps() == [], (manifests, puts)
        else:
            assert type(outcomes[0]).__name__ == "PersistResult", outcomes
            assert manifests == ["run/snapshots/step-00000001/manifest.json"] and Run(url).steps() == [1], manifests
            assert Run(url).verify() == []
            maybe = "rank 0 passed the last step before committing step 1: it is committed unless that commit failed"
            if held.endswith("save ended"):
                assert isinstance(outcomes[1], TailorError) and maybe in said[1], said
            else:  # rank 0's word in rank 1's second wait, or (a slow commit) the same doubt
                assert type(outcomes[1]).__name__ == "PersistResult" or maybe in said[1], said
