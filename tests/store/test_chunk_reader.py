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
