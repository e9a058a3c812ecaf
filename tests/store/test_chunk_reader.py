"""Ranged reads of chunks when one rank's file holds several chunks of one tensor: a ZeRO
partition boundary that falls mid-row stores a flat fragment as a partial row, whole rows and
another partial row, all in that rank's file (``providers/deepspeed/``)."""

from __future__ import annotations

import pytest
import torch

from llmtailor.layouts import layout_from_names
from llmtailor.store.reader import ChunkReader, flat_range_boxes
from llmtailor.store.run import Run
from llmtailor.store.staged import Piece, StagedSnapshot, StagedUnit
from llmtailor.store.writer import persist

SHAPE = (5, 7)
FULL = torch.arange(35, dtype=torch.float32).view(SHAPE)


def _pieces(start: int, numel: int) -> list[Piece]:
    return [
        Piece("weight/w", FULL[tuple(slice(o, o + n) for o, n in zip(offsets, extent))].clone(), tuple(offsets), SHAPE)
        for offsets, extent in flat_range_boxes(SHAPE, start, numel)
    ]


@pytest.fixture
def run(tmp_path) -> Run:
    """One snapshot whose only file holds the tensor as five boxes: elements 0..3 (a partial
    row), 3..31 (a partial row and whole rows) and 31..35 (two partial rows' worth)."""
    layout = layout_from_names(["w"])
    pieces = _pieces(0, 3) + _pieces(3, 28) + _pieces(31, 4)
    assert len(pieces) >= 4
    staged = StagedSnapshot(
        step=1, parent=None, save_index=0, policy="test", layout=layout.to_record(),
        units=iter([StagedUnit(layout.unit_of("w"), pieces)]), composite={u: 1 for u in layout.units},
        global_doc={}, global_tensors={},
    )
    persist(Run(tmp_path), staged)
    return Run(tmp_path)


@pytest.mark.parametrize("verify", [True, False])
def test_every_chunk_of_a_file_is_read_as_itself(run, verify):
    unit = run.unit_entry(1, next(iter(run.manifest(1).units)))
    [tensor] = unit.tensors
    assert len({c.file for c in tensor.chunks}) == 1 and len(tensor.chunks) >= 4
    reader = ChunkReader(run, verify=verify)
    assert torch.equal(reader.read_region(1, unit, tensor, (0, 0), SHAPE), FULL)
    # Box by box, in an order that alternates between chunks.
    for row in (3, 0, 4, 1):
        assert torch.equal(reader.read_region(1, unit, tensor, (row, 0), (1, 7)), FULL[row : row + 1])
    reader.close()


def _one_paged_chunk(tmp_path):
    """A snapshot of one 600 KiB tensor in one chunk, with page checksums (pages of 4 KiB)."""
    big = torch.randn(512, 300)
    layout = layout_from_names(["w"])
    staged = StagedSnapshot(
        step=1, parent=None, save_index=0, policy="test", layout=layout.to_record(),
        units=iter([StagedUnit(layout.unit_of("w"), [Piece("weight/w", big, (0, 0), tuple(big.shape))])]),
        composite={u: 1 for u in layout.units}, global_doc={}, global_tensors={},
    )
    persist(Run(tmp_path), staged)
    run = Run(tmp_path)
    unit = run.unit_entry(1, next(iter(run.manifest(1).units)))
    [tensor] = unit.tensors
    [chunk] = tensor.chunks
    return big, run, unit, tensor, chunk


def test_a_large_chunk_is_read_and_checked_by_the_pages_a_box_covers(tmp_path):
    """A chunk larger than a page carries page checksums: a box (a rank's shard at another world
    size) reads only the pages it lies in, each checked; damage in another page goes unread,
    damage in its own pages is named with its byte range."""
    from llmtailor.store.tensor_files import page_size
    from llmtailor.store.storage.local import LocalStorage

    big, run, unit, tensor, chunk = _one_paged_chunk(tmp_path)
    assert chunk.page_bytes == page_size(big.numel() * 4) and len(chunk.pages) == -(-big.numel() * 4 // chunk.page_bytes)
    fetched = []
    real, real_into = LocalStorage.read_range, LocalStorage.read_into

    def counted(self, key, start, length):
        fetched.append(length)
        return real(self, key, start, length)

    def counted_into(self, key, start, into):  # the ranged reads of a fetch (store/fetch.py)
        fetched.append(len(into))
        return real_into(self, key, start, into)

    LocalStorage.read_range, LocalStorage.read_into = counted, counted_into
    try:
        reader = ChunkReader(run, verify=True)
        rows = (100, 300)  # a fifth of the rows, as a rank of 5 would hold
        assert torch.equal(reader.read_region(1, unit, tensor, (200, 0), rows), big[200:300])
        needed = 100 * 300 * 4
        assert needed <= sum(fetched) - 8 - 1000 <= needed + 2 * chunk.page_bytes  # header reads aside
        # Damage a byte in the last page: the box above does not read it ...
        path = tmp_path / "snapshots/step-00000001" / unit.files[0].path
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
        fresh = ChunkReader(Run(tmp_path), verify=True)
        assert torch.equal(fresh.read_region(1, unit, tensor, (200, 0), rows), big[200:300])
        # ... the last rows do, and name the damaged bytes.
        with pytest.raises(Exception, match=r"checksum mismatch in tensor 'weight/w', bytes \d+-\d+"):
            fresh.read_region(1, unit, tensor, (500, 0), (12, 300))
    finally:
        LocalStorage.read_range, LocalStorage.read_into = real, real_into


def test_a_box_of_received_pages_is_checked_and_given_where_it_was_received_and_damage_there_is_refused(tmp_path):
    """A box of a paged chunk whose pages a distributed restore received ahead
    (``ChunkReader.received``: ``store.shared_ranges``) is checked page by page and given as a
    view of the received bytes, which the caller copies into its shard: no copy into fresh
    memory of its own first. A damaged byte in those pages is refused, naming the bytes."""
    big, run, unit, tensor, chunk = _one_paged_chunk(tmp_path)
    offsets, shape = (200, 0), (100, 300)
    storage, key, start, length = ChunkReader(run).span(1, unit, tensor, chunk, offsets, shape)
    received = torch.frombuffer(bytearray(run.storage.read_range(key, start, length)), dtype=torch.uint8)
    reader = ChunkReader(run, verify=True)
    reader.received = {(storage.identity(), key, start, length): memoryview(received.numpy())}
    box = reader.read_box(1, unit, tensor, chunk, offsets, shape)
    assert torch.equal(box, big[200:300])
    assert received.data_ptr() <= box.data_ptr() < received.data_ptr() + length, "copied out of the received bytes"
    received[length // 2] ^= 0xFF
    with pytest.raises(Exception, match=r"checksum mismatch in tensor 'weight/w', bytes \d+-\d+"):
        reader.read_box(1, unit, tensor, chunk, offsets, shape)


def _landed(run, unit, tensor, chunk, offsets, shape, damage: int | None = None):
    """What a distributed restore hands the reader for a box it lands (``store.shared_ranges``'s
    ``landing``): the span's bytes as segments, margin | box | margin, the box's in its live
    target; ``damage``: a byte of the span flipped (offset in the span). The reader and target."""
    (storage, key, start, length), (at, n) = ChunkReader(run).landing(1, unit, tensor, chunk, offsets, shape)
    span = bytearray(run.storage.read_range(key, start, length))
    if damage is not None:
        span[damage] ^= 0xFF
    target = torch.empty(shape, dtype=tensor.torch_dtype)
    memory = target.view(-1).view(torch.uint8)
    memory.copy_(torch.frombuffer(span[at - start : at - start + n], dtype=torch.uint8))
    segments = [s for s in (memoryview(span[: at - start]), memoryview(memory.numpy()), memoryview(span[at - start + n :])) if len(s)]
    reader = ChunkReader(run, verify=True)
    reader.received = {(storage.identity(), key, start, length): segments}
    return reader, target


@pytest.mark.parametrize("offsets,shape", [((200, 0), (100, 300)),  # a margin on each side
                                           ((0, 0), (37, 300)),  # none before it
                                           ((475, 0), (37, 300)),  # none after it
                                           ((0, 0), (512, 300)),  # the whole chunk
                                           ((3, 0), (1, 300)),  # one row inside one page
                                           ((7, 11), (1, 101))])  # part of one row, at odd byte offsets
def test_a_box_received_into_its_live_target_is_checked_across_the_margins_and_given_there(tmp_path, offsets, shape):
    """A box of a paged chunk that a distributed restore received straight into its live target,
    the pages' margins around it elsewhere (``received`` as segments): each page is checked
    across the segments it lies in, and the box is given where it is, the target's memory (the
    copy into the target then has nothing to do: ``SnapshotReader.read_data``)."""
    big, run, unit, tensor, chunk = _one_paged_chunk(tmp_path)
    reader, target = _landed(run, unit, tensor, chunk, offsets, shape)
    box = reader.read_box(1, unit, tensor, chunk, offsets, shape)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
    assert torch.equal(box, big[index]) and torch.equal(target, big[index])
    assert box.data_ptr() == target.data_ptr(), "not given where it landed"


@pytest.mark.parametrize("where", ["box", "margin before", "margin after"])
def test_a_damaged_box_received_into_its_live_target_is_refused_and_says_the_target_holds_it(tmp_path, where):
    """A damaged byte in the pages of a box received into its live target (in the box itself,
    or in a margin page it shares) is refused by the page check before the box is given: the
    error names the bytes and says the live tensor holds what came (the restore reports the
    live state touched on every rank: ``Coordinator.agree``)."""
    big, run, unit, tensor, chunk = _one_paged_chunk(tmp_path)
    offsets, shape = (200, 0), (100, 300)
    (_, _, start, length), (at, n) = ChunkReader(run).landing(1, unit, tensor, chunk, offsets, shape)
    damage = {"box": at - start + n // 2, "margin before": 0, "margin after": length - 1}[where]
    assert (at - start <= damage < at - start + n) == (where == "box")
    reader, target = _landed(run, unit, tensor, chunk, offsets, shape, damage)
    with pytest.raises(Exception, match=r"checksum mismatch in tensor 'weight/w', bytes \d+-\d+ \(file is corrupted\); "
                                        r"its bytes were received into the live tensor before this check"):
        reader.read_box(1, unit, tensor, chunk, offsets, shape)


def test_only_a_box_whose_bytes_are_one_run_lands_and_a_small_chunk_only_whole(tmp_path, run):
    """``landing``: a box of whole rows or inside one row of a paged chunk lands (its bytes are
    one run, in the target's order); a box of part of several rows does not (its bytes are not
    one run); of a chunk checked whole (no pages), only the box that is all of it, which is then
    checked and given in its target."""
    big, paged, unit, tensor, chunk = _one_paged_chunk(tmp_path / "paged")
    reader = ChunkReader(paged)
    assert reader.landing(1, unit, tensor, chunk, (10, 3), (2, 5)) is None
    assert reader.landing(1, unit, tensor, chunk, (10, 0), (2, 300))[1][1] == 2 * 300 * 4
    small_unit = run.unit_entry(1, next(iter(run.manifest(1).units)))
    [small] = small_unit.tensors
    whole = next(c for c in small.chunks if c.shape[0] > 1)  # whole rows: elements 7..28, rows 1..3
    assert ChunkReader(run).landing(1, small_unit, small, whole, (0, 0), (1, 7)) is None  # not all of a chunk checked whole
    reader, target = _landed(run, small_unit, small, whole, (0, 0), tuple(whole.shape))
    box = reader.read_box(1, small_unit, small, whole, (0, 0), tuple(whole.shape))
    offsets = tuple(whole.offsets)
    assert torch.equal(box, FULL[offsets[0] : offsets[0] + whole.shape[0], offsets[1] : offsets[1] + whole.shape[1]])
    assert box.data_ptr() == target.data_ptr()


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_load_plans_boxes_land_in_contiguous_targets_only_and_are_not_copied_again(tmp_path, monkeypatch, contiguous):
    """``PlannedLoad.landings``: a box whose target is a contiguous CPU tensor lands in the
    target's memory; a non-contiguous target (a transposed shard) gets none (its bytes go through
    a buffer and are copied in). The load of a landed box leaves the target as the restore put
    it there, no copy onto itself (``read_data``)."""
    from llmtailor.store.dcp import PlannedLoad, SnapshotReader

    big, run, unit, tensor, chunk = _one_paged_chunk(tmp_path)
    target = torch.zeros(512, 300) if contiguous else torch.zeros(300, 512).t()
    reader = ChunkReader(run, verify=True)
    planned = PlannedLoad({unit.unit: (SnapshotReader(reader, 1, unit, {tensor.key}), {tensor.key: target})})
    landings = planned.landings(unit.unit)
    if not contiguous:
        assert landings == []
        return
    [((storage, key, start, length), (at, n), memory)] = landings
    assert memory.data_ptr() == target.data_ptr() and n == memory.numel() == big.numel() * 4
    memory.copy_(torch.frombuffer(bytearray(run.storage.read_range(key, at, n)), dtype=torch.uint8))  # as received
    reader.received = {(storage.identity(), key, start, length): [memoryview(memory.numpy())]}
    copies = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: copies.append(self.shape) or real(self, src, *a, **k))
    planned.load(unit.unit)
    assert torch.equal(target, big) and copies == []
