"""Reading parts of tensors from committed snapshots, by byte range.

A rank restoring its own shards reads only the boxes of the stored chunks that overlap them:
the file's header, then the byte range of each box, from a local file or an object store
alike (``Storage.read_range``). ``verify=True`` reads each
chunk it touches whole, once, and checks it against the chunk's checksum in the unit index
before slicing it; ``verify=False`` reads only the byte ranges needed and leaves checking to ``llmtailor verify``.

Each box is one read of a byte range (``span`` says which, before it is read); a distributed
restore may fetch those ranges ahead, once in the job and in large requests
(``store.shared_ranges``), and hand them over in ``ChunkReader.received``: a read finds its
bytes there and goes to the store only for those it does not find. The checks are the same
either way: done here, on the bytes as read. A box received straight into its live target
(``landing``) is handed over as segments, margin | box | margin: each page is checked across
them before the box is given where it lies; a page that fails says the target holds its bytes.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import xxhash

from llmtailor.errors import DamagedFileError, IntegrityError
from llmtailor.store import dtypes
from llmtailor.store.checked import stored_header
from llmtailor.store.fetch import fetch
from llmtailor.store.tensor_files import checksum, parse_header
from llmtailor.store.manifest import Chunk, TensorEntry, UnitEntry
from llmtailor.store.run import Run
from llmtailor.store.storage import Storage

if TYPE_CHECKING:
    import torch

_LANDED = "; its bytes were received into the live tensor before this check: that tensor holds them, not restored"

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, shape)`` of a box inside a tensor."""

Span = tuple[Storage, str, int, int]
"""``(storage, key, start, length)``: one byte range of a file, as one read of a box takes it."""


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of one tensor, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)) and lo:
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def flat_range_boxes(shape: tuple[int, ...], start: int, length: int) -> list[Box]:
    """The boxes (in row-major order) that make up elements ``[start, start + length)`` of a
    tensor of ``shape`` flattened: at most two partial rows at the ends and whole rows (or
    whole blocks, recursively) between them. Used for flat fragments (DeepSpeed)."""
    if length <= 0:
        return []
    if len(shape) <= 1:
        return [((start,), (length,))] if shape else [((), ())]
    inner = 1
    for d in shape[1:]:
        inner *= d
    boxes: list[Box] = []
    end = start + length
    row, col = divmod(start, inner)
    if col:
        take = min(inner - col, end - start)
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], col, take)]
        start += take
        row += 1
    rows = (end - start) // inner
    if rows:
        boxes.append(((row, *(0,) * (len(shape) - 1)), (rows, *shape[1:])))
        start += rows * inner
        row += rows
    if start < end:
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, end - start)]
    return boxes


class ChunkReader:
    """Reads boxes of chunks of one run's snapshots (module docstring). Keeps the headers of
    the files it has read and the chunk it checked last until ``close``."""

    def __init__(self, run: Run, verify: bool = True):
        self.run = run
        self.verify = verify
        self._headers: dict[tuple[str, str], tuple[int, dict]] = {}
        self._checked: dict[tuple, torch.Tensor] = {}
        self.received: dict[tuple[str, str, int, int], bytearray | memoryview | list[memoryview]] = {}
        """Bytes fetched ahead (module docstring), by ``(storage identity, key, start, length)``
        of the ``span`` they are: a read of exactly that range takes them instead of fetching.
        A list: the span's bytes in consecutive segments, as ``landing`` cut it (the box's
        bytes received into its live target, the page margins around it elsewhere)."""

    def close(self) -> None:
        self._headers.clear()
        self._checked.clear()
        self.received.clear()

    def take_headers(self, storage: Storage, headers: dict[str, tuple[int, dict]]) -> None:
        """``stored_header`` of files of ``storage`` by key, read (and their sizes checked)
        elsewhere: not read again here (``store.shared_ranges.share_headers``)."""
        self._headers.update({(storage.identity(), key): header for key, header in headers.items()})

    def span(self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk,
             offsets: tuple[int, ...], shape: tuple[int, ...]) -> Span | None:
        """The byte range ``read_box`` of the same box reads (reading only the file's header to
        say it): the whole chunk when it is checked whole, the pages the box lies in when it is
        checked by page, else the box's own span; None when it reads no byte."""
        if self.verify and chunk.pages is None:
            storage, key, begin = self._located(step, unit, tensor, chunk)
            return storage, key, begin, _chunk_bytes(tensor, chunk)
        if _numel(shape) == 0:
            return None
        storage, key, begin = self._located(step, unit, tensor, chunk)
        start, end = _box_bytes(tensor, chunk, offsets, shape)
        if self.verify:
            start, end = _pages_around(tensor, chunk, start, end)
        return storage, key, begin + start, end - start

    def landing(self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk,
                offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Span, tuple[int, int]] | None:
        """``(span, (start, length))``: the ``span`` a read of the box takes and the bytes of the
        file that are the box's elements alone, in their row-major order (a box of whole rows,
        or inside one row), which may be fetched straight into the box's live target (``received``
        as segments: margin, box, margin); None where they are not one run of bytes, or where the
        read checks the whole chunk and the box is not all of it (the chunk is then checked and
        sliced as one buffer)."""
        span = self.span(step, unit, tensor, chunk, offsets, shape)
        if span is None:
            return None
        storage, key, begin = self._located(step, unit, tensor, chunk)
        start, end = _box_bytes(tensor, chunk, offsets, shape)
        if end - start != _numel(shape) * dtypes.itemsize(tensor.dtype):
            return None
        if self.verify and chunk.pages is None and (start, end) != (0, _chunk_bytes(tensor, chunk)):
            return None
        return span, (begin + start, end - start)

    def _fetch(self, storage: Storage, key: str, start: int, length: int, hasher=None) -> bytearray | memoryview:
        """``length`` bytes of ``key`` from ``start``: those received ahead when they are there
        (``hasher`` fed them; received in segments, put together), else fetched (``store.fetch``)."""
        data = self.received.get((storage.identity(), key, start, length))
        if data is None:
            return fetch(storage, key, start, length, hasher)
        if isinstance(data, list):
            data = data[0] if len(data) == 1 else bytearray().join(data)
        if hasher is not None:
            hasher.update(data)
        return data

    def read_box(
        self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk, offsets: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The box (``offsets``/``shape`` relative to the chunk) of ``chunk`` of ``tensor``, in
        the index ``unit`` of the snapshot at ``step``."""
        if self.verify and chunk.pages is None:  # a chunk of one page: read and checked whole
            index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
            return self._checked_chunk(step, unit, tensor, chunk)[index]
        return self._read_box(step, unit, tensor, chunk, tuple(offsets), tuple(shape), check=self.verify)

    def read_region(
        self, step: int, unit: UnitEntry, tensor: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The box ``offsets``/``shape`` of the global tensor ``tensor`` (of the unit index
        ``unit`` at ``step``), assembled from the chunks that overlap it."""
        import torch

        out = torch.empty(shape, dtype=tensor.torch_dtype)
        wanted: Box = (tuple(offsets), tuple(shape))
        covered = 0
        for chunk in tensor.chunks:
            overlap = intersect(wanted, (tuple(chunk.offsets), tuple(chunk.shape)))
            if overlap is None:
                continue
            lo, extent = overlap
            inside = tuple(l - c for l, c in zip(lo, chunk.offsets))
            target = tuple(slice(l - o, l - o + n) for l, o, n in zip(lo, offsets, extent))
            out[target] = self.read_box(step, unit, tensor, chunk, inside, extent)
            covered += _numel(extent)
        if covered != _numel(shape):
            raise IntegrityError(f"snapshot {step}: the chunks of {tensor.key!r} do not cover {list(offsets)}+{list(shape)}")
        return out

    # -- internals -----------------------------------------------------------------------------

    def _located(self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk) -> tuple[Storage, str, int]:
        """The storage and key of the file holding ``chunk``, and where its bytes begin there
        (checked against the file's header: the key present, with the index's dtype and shape)."""
        file = unit.chunk_file(chunk)
        storage, key = self.run.file_location(step, file)
        cached = (storage.identity(), key)
        if cached not in self._headers:  # a file that arrived in a healing: its header from those bytes (not yet written)
            arrived = self.run.units.arrival(storage, key, file)
            self._headers[cached] = (stored_header(storage, key, file) if arrived is None else
                                     parse_header(lambda start, length: arrived[start:start + length], len(arrived),
                                                  storage.where(key)))
        data, header = self._headers[cached]
        name = tensor.chunk_key(chunk)
        info = header.get(name) if name != "__metadata__" else None
        where = storage.where(key)
        if info is None:
            raise IntegrityError(f"{where}: tensor {name!r} is missing")
        if [int(d) for d in info["shape"]] != chunk.shape or dtypes.code_of(tensor.dtype) != info["dtype"]:
            raise IntegrityError(f"{where}: tensor {name!r} is {info['dtype']} {info['shape']}, index says {tensor.dtype} {chunk.shape}")
        return storage, key, data + info["data_offsets"][0]

    def _read_box(self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk,
                  offsets: tuple[int, ...], shape: tuple[int, ...], check: bool = False) -> torch.Tensor:
        """Only the bytes of the box: the span from its first to its last element in the
        chunk's row-major order (exact for a box of whole rows, or inside one row); with
        ``check``, the pages that span covers, each checked against its checksum."""
        import torch

        if _numel(shape) == 0:
            return torch.empty(shape, dtype=tensor.torch_dtype)
        storage, key, begin = self._located(step, unit, tensor, chunk)
        start, end = _box_bytes(tensor, chunk, offsets, shape)
        arrived = self.run.units.arrival(storage, key, unit.chunk_file(chunk))
        if arrived is not None:  # the whole file checked as it arrived here (``UnitReader.arrived``)
            data = bytearray(arrived[begin + start : begin + end])
        elif check:
            data = self._checked_pages(storage, key, begin, tensor, chunk, start, end)
        else:
            data = self._fetch(storage, key, begin + start, end - start)
        span = torch.frombuffer(data, dtype=tensor.torch_dtype)
        return span.as_strided(shape, _strides(chunk.shape))

    def _checked_pages(self, storage: Storage, key: str, begin: int, tensor: TensorEntry, chunk: Chunk,
                       start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the chunk, read as the whole pages they lie in, each page
        checked against the chunk's page checksums: a view of what was read or received (the
        caller copies the box where it goes: a copy into fresh memory first would cost a buffer
        and a pass over the bytes more)."""
        page = chunk.page_bytes
        low, high = _pages_around(tensor, chunk, start, end)
        segments = self.received.get((storage.identity(), key, begin + low, high - low))
        landed = isinstance(segments, list)
        if not landed:  # read, or received as one buffer
            segments = [memoryview(self._fetch(storage, key, begin + low, high - low))]
        ends = list(itertools.accumulate(len(s) for s in segments))  # where each segment ends in [low, high)
        first = 0  # the segment the page begins in
        for at in range(low, high, page):
            a, b = at - low, min(at + page, high) - low
            while ends[first] <= a:
                first += 1
            if b <= ends[first]:  # the page lies in one segment
                base = ends[first] - len(segments[first])
                found = checksum(segments[first][a - base : b - base])
            else:  # a page across a margin and the box: one hash fed both
                hasher = xxhash.xxh3_64()
                for piece in _spanning(segments, a, b):
                    hasher.update(piece)
                found = hasher.hexdigest()
            if found != chunk.pages[at // page]:
                raise DamagedFileError(f"{storage.where(key)}: checksum mismatch in tensor {tensor.chunk_key(chunk)!r}, "
                                     f"bytes {at}-{min(at + page, high)} (file is corrupted){_LANDED if landed else ''}")
        box = list(_spanning(segments, start - low, end - low))
        return box[0] if len(box) == 1 else memoryview(bytearray().join(box))

    def _checked_chunk(self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk) -> torch.Tensor:
        import torch

        # A chunk is named by its offsets, not its file: one rank's file holds several chunks of
        # a tensor when a flat ZeRO fragment starts or ends mid-row.
        cache_key = (step, unit.unit, tensor.key, chunk.file, tuple(chunk.offsets))
        if cache_key not in self._checked:
            storage, key, begin = self._located(step, unit, tensor, chunk)
            length = _chunk_bytes(tensor, chunk)
            data = self.run.units.arrival(storage, key, unit.chunk_file(chunk))
            if data is not None:  # the whole file checked as it arrived here (``UnitReader.arrived``)
                data = data[begin : begin + length]
            else:
                hasher = xxhash.xxh3_64()
                landed = isinstance(self.received.get((storage.identity(), key, begin, length)), list)
                data = self._fetch(storage, key, begin, length, hasher)  # checksummed while it is fetched
                if hasher.hexdigest() != chunk.xxh3_64:
                    raise DamagedFileError(f"{storage.where(key)}: checksum mismatch in tensor {tensor.chunk_key(chunk)!r} "
                                         f"(file is corrupted){_LANDED if landed else ''}")
            whole = (torch.frombuffer(data, dtype=tensor.torch_dtype).reshape(chunk.shape) if length
                     else torch.empty(chunk.shape, dtype=tensor.torch_dtype))
            # One chunk is kept: consecutive boxes of a tensor come from the same chunk.
            self._checked = {cache_key: whole}
        return self._checked[cache_key]


def _spanning(segments: list[memoryview], start: int, end: int):
    """Views of bytes ``[start, end)`` of ``segments`` taken one after another, in order."""
    at = 0
    for segment in segments:
        low, high = max(start, at), min(end, at + len(segment))
        if low < high:
            yield segment[low - at : high - at]
        at += len(segment)
        if at >= end:
            break


def _chunk_bytes(tensor: TensorEntry, chunk: Chunk) -> int:
    """The bytes of a whole chunk of ``tensor``."""
    return _numel(tuple(chunk.shape)) * dtypes.itemsize(tensor.dtype)


def _box_bytes(tensor: TensorEntry, chunk: Chunk, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int]:
    """``(start, end)``: the bytes of the chunk from the box's first element to its last, in the
    chunk's row-major order (exactly the box for a box of whole rows, or inside one row)."""
    strides = _strides(chunk.shape)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, shape, strides))
    item = dtypes.itemsize(tensor.dtype)
    return first * item, (last + 1) * item


def _pages_around(tensor: TensorEntry, chunk: Chunk, start: int, end: int) -> tuple[int, int]:
    """``(low, high)``: bytes ``[start, end)`` of a paged chunk widened to the whole pages they lie in."""
    size, page = _chunk_bytes(tensor, chunk), chunk.page_bytes
    return start // page * page, min(-(-end // page) * page, size)


def _strides(shape: list[int]) -> list[int]:
    strides, running = [], 1
    for d in reversed(shape):
        strides.append(running)
        running *= d
    return list(reversed(strides))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


