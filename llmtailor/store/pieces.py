"""A unit read in pieces by several readers: the byte ranges of its tensors, each checked by the
page checksums its chunk carries (``Chunk.pages``), so that a unit larger than a reader's share
of a restore (an embedding or LM head with its optimizer state: 24.6 MB beside 8.85 MB layers in
the bench's DDP restore) need not be read whole by one rank (``distributed.read_plan.spread``).

A unit's bytes are taken as its tensors' bytes one after another, in the order given (what a
read plan's item holds: ``read_plan.nbytes``). It may be cut between two tensors, and inside a
tensor stored whole in one chunk of a snapshot file (not a pack, not the base directory) that
carries page checksums, at a multiple of both its page and its row: each piece is then whole
rows of its tensors, and its reader reads whole pages of them, every page checked against its
checksum before a byte is used (``ChunkReader.read_box``); a tensor without pages is read and
checked whole. Readers of the pieces of one tensor read disjoint pages: each byte once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from llmtailor.constants import is_pack
from llmtailor.store.checked import stored_header
from llmtailor.store.fetch import PART, fetch
from llmtailor.store.manifest import TensorEntry, UnitEntry
from llmtailor.store.reader import ChunkReader

if TYPE_CHECKING:
    import torch

    from llmtailor.store.run import Run

CUT_FROM = 2 * PART
"""A unit of fewer bytes is read whole by one reader (a piece of it would be a request of its own
for what one request reads)."""

Segment = tuple[TensorEntry, int, int]
"""Rows ``[first, last)`` of a tensor (along its first dimension; a 0-d tensor: ``0, 1``)."""


def cut_points(run: Run, step: int, entry: UnitEntry, tensors: list[TensorEntry]) -> list[int]:
    """The byte offsets inside ``tensors``' bytes (one after another) where a reader may cut
    them (module docstring), ascending; none for a unit under ``CUT_FROM`` bytes or one with a
    tensor in several chunks or in a pack or base file, or not in a remote store."""
    sizes = [_bytes(t) for t in tensors]
    if sum(sizes) < CUT_FROM or any(len(t.chunks) != 1 or not _own_file(run, step, entry, t) for t in tensors):
        return []
    cuts, at = [], 0
    for tensor, size in zip(tensors, sizes):
        chunk = tensor.chunks[0]
        if chunk.pages is not None and tensor.shape:
            row = size // tensor.shape[0]
            step_ = math.lcm(chunk.page_bytes, row) if row else size
            cuts += [at + inside for inside in range(step_, size, step_)]
        at += size
        cuts.append(at)
    return cuts[:-1]


def segments(tensors: list[TensorEntry], start: int, end: int) -> list[Segment]:
    """The rows of ``tensors`` that bytes ``[start, end)`` of them are (a piece cut at
    ``cut_points``)."""
    out, at = [], 0
    for tensor in tensors:
        size = _bytes(tensor)
        low, high = max(start, at), min(end, at + size)
        if low < high or (size == 0 and start <= at < end):
            rows = tensor.shape[0] if tensor.shape else 1
            row = size // rows if rows else 0
            out.append((tensor, (low - at) // row if row else 0, (high - at) // row if row else rows))
        at += size
    return out


def segment_shape(segment: Segment) -> list[int]:
    tensor, first, last = segment
    return [last - first, *tensor.shape[1:]] if tensor.shape else []


class PieceReader:
    """Reads pieces of units (``segments``) of one run for one rank, checked (module docstring):
    a file's header once (with its size, in one request), the pages of each piece's tensors
    that lie next to one another in their file in one fetch."""

    def __init__(self, run: Run):
        self.run = run
        self.chunks = ChunkReader(run, verify=True)
        self._headers: set[tuple[str, str]] = set()

    def read(self, step: int, entry: UnitEntry, piece: list[Segment]) -> list[torch.Tensor]:
        boxes = [(tensor, tensor.chunks[0], _box(tensor, first, last)) for tensor, first, last in piece]
        for tensor, chunk, _ in boxes:
            self._header(step, entry, chunk)
        spans = [self.chunks.span(step, entry, tensor, chunk, *box) for tensor, chunk, box in boxes]
        for storage, key, start, length in _joined(s for s in spans if s is not None):
            data = memoryview(fetch(storage, key, start, length))
            for s in spans:
                if s is not None and s[0] is storage and s[1] == key and start <= s[2] < start + length:
                    self.chunks.received[(storage.identity(), key, s[2], s[3])] = data[s[2] - start : s[2] - start + s[3]]
        try:
            return [self.chunks.read_box(step, entry, tensor, chunk, *box).reshape(segment_shape(segment))
                    for (tensor, chunk, box), segment in zip(boxes, piece)]
        finally:
            self.chunks.received.clear()

    def _header(self, step: int, entry: UnitEntry, chunk) -> None:
        """The header of the file holding ``chunk``, read once with the file's size in one
        request (every byte of its data known from the unit's index: a unit file holds its
        unit's tensors alone)."""
        file = entry.chunk_file(chunk)
        storage, key = self.run.file_location(step, file)
        if (storage.identity(), key) in self._headers:
            return
        known = sum(_bytes(t) for t in entry.tensors for c in t.chunks if entry.chunk_file(c) is file)
        self.chunks.take_headers(storage, {key: stored_header(storage, key, file, known)})
        self._headers.add((storage.identity(), key))


def _own_file(run: Run, step: int, entry: UnitEntry, tensor: TensorEntry) -> bool:
    file = entry.chunk_file(tensor.chunks[0])
    return file.origin != "base" and not is_pack(file.path) and run.file_location(step, file)[0].remote


def _bytes(tensor: TensorEntry) -> int:
    return math.prod(tensor.shape) * tensor.torch_dtype.itemsize


def _box(tensor: TensorEntry, first: int, last: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not tensor.shape:
        return (), ()
    return (first, *[0] * (len(tensor.shape) - 1)), (last - first, *tensor.shape[1:])


def _joined(spans) -> list[tuple]:
    """``(storage, key, start, length)`` spans of one file that touch or overlap joined, in file
    order: one fetch each."""
    joined: list[list] = []
    for storage, key, start, length in sorted(spans, key=lambda s: (s[1], s[2])):
        if joined and joined[-1][1] == key and joined[-1][0] is storage and start <= joined[-1][2] + joined[-1][3]:
            joined[-1][3] = max(joined[-1][3], start + length - joined[-1][2])
        else:
            joined.append([storage, key, start, length])
    return [tuple(j) for j in joined]
