"""The safetensors format, as the store writes and reads it: a streaming writer, one validated
header parser, and the checksums of tensors and of their pages.

Checksums are xxh3-64 over a file's bytes, computed while the bytes are written.

Tensor files are *written* here, streaming, through a storage's sink (``store.storage``: a
local directory or an object store, so one path serves both): the header, then each tensor's
bytes straight from its memory in 16 MiB pieces, hashed on the way. On this project's VM, with
a training process's memory in use, safetensors' own ``save_file`` wrote a 6.2 GB checkpoint at
0.3-0.8 GB/s and these pieces at 1.6 GB/s (``bench/RESULTS.md``), and hashing on the way spares
a read-back. The format (little-endian u64 header size, JSON header padded with spaces to 8
bytes, then the data) is safetensors' published one; tensors are ordered by item size, so each
is naturally aligned. They are *read* from their header (``parse_header``, validated: every
tensor's range inside the file, matching its dtype and shape) and byte ranges, so a reader of
part of a file, local or remote, reads only that part (``store.checked`` reads a run's files
so, checked against their manifest entries).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from llmtailor.distributed.progress import advance
from llmtailor.errors import DamagedFileError, IntegrityError, describe_os_error
from llmtailor.store import dtypes
from llmtailor.store.manifest import FileEntry
from llmtailor.store.storage.base import PIECE
from llmtailor.store.storage.local import LocalSink
from llmtailor.store.storage.local_durable import Syncer, read_pieces

if TYPE_CHECKING:
    import torch

    from llmtailor.store.storage.base import Sink, Storage

MAX_HEADER = 100 << 20
"""No credible safetensors header is larger (a header's size is read before the header)."""

HASHED = 1 << 20
"""Bytes of a written piece hashed at a time: the file's, the tensor's and the pages' checksums
each read it while it is in the CPU's cache, not three times from memory (a 16 MiB piece is
not: on the project's VM, 6.6 ms against 12.4 ms of CPU per 68 MB, bench/RESULTS.md issue 32
session 49)."""

MIN_PAGE, MAX_PAGES = 4096, 256
PAGED_FROM = 256 << 10
"""A chunk of more bytes than this carries page checksums; a smaller one is read and checked
whole by a reader of part of it (at most this much more read, against ~60 bytes of index per
page saved: a LoRA's 8 KiB chunks carried two pages each, a few % of a small save's bytes)."""


def page_size(nbytes: int) -> int:
    """The page of a chunk of ``nbytes`` bytes: at most ``MAX_PAGES`` pages (so a chunk's page
    list stays small), each a multiple of ``MIN_PAGE`` bytes (every item size divides it). A
    reader of a range reads at most one page more at each end: about 1% of a chunk."""
    pages = -(-nbytes // MAX_PAGES)
    return max(MIN_PAGE, -(-pages // MIN_PAGE) * MIN_PAGE)


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def checksum_file(path: Path) -> str:
    """xxh3-64 of a whole file, read in pieces."""
    hasher = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as handle:
        while piece := handle.read(PIECE):
            hasher.update(piece)
    return hasher.hexdigest()


def tensor_checksum(tensor: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes, as ``stream_tensors`` records it per tensor."""
    hasher = xxhash.xxh3_64()
    for piece in _pieces(tensor):
        hasher.update(piece)
    return hasher.hexdigest()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], root: Path) -> FileEntry:
    """Write ``tensors`` as one safetensors file, durably; return its manifest entry."""
    return write_tensor_file(path, tensors, root)[0]


class ByteSource:
    """A tensor's bytes as they lie in a file (a range of a safetensors file, say), copied to a
    new file without being decoded: ``stream_tensors`` streams them through and hashes them on
    the way. ``expect_xxh3`` (the checksum the source recorded for these bytes) is checked
    against the bytes copied; a mismatch fails the write. ``dtype`` is a manifest dtype name
    (``float32``): copying bytes needs no torch. The file is a local ``path``, or ``key`` of a
    ``storage`` (a run's file wherever the run lies; ``path`` then names it in messages)."""

    def __init__(self, path: Path | str, offset: int, length: int, dtype: str, shape: tuple[int, ...],
                 expect_xxh3: str | None = None, *, storage: Storage | None = None, key: str | None = None):
        self.path, self.offset, self.length = path if storage is not None else Path(path), offset, length
        self.dtype, self.shape, self.expect_xxh3 = dtypes.name_of(dtype), tuple(shape), expect_xxh3
        self.storage, self.key = storage, key

    def numel(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count

    def element_size(self) -> int:
        return dtypes.itemsize(self.dtype)

    def dim(self) -> int:
        return len(self.shape)

    def load(self) -> torch.Tensor:
        """The tensor itself, read from the file (for a merge that transforms it)."""
        import torch

        data = bytearray()
        for piece in _file_pieces(self):
            data += piece
        dtype = dtypes.to_torch(self.dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(self.shape) if self.length else torch.empty(self.shape, dtype=dtype)

    def detach(self) -> ByteSource:
        return self

    def contiguous(self) -> ByteSource:
        return self


def write_tensor_file(
    path: Path,
    tensors: dict[str, torch.Tensor | ByteSource],
    root: Path,
    metadata: dict[str, str] | None = None,
    syncer: Syncer | None = None,
) -> tuple[FileEntry, dict[str, str]]:
    """Write ``tensors`` as one safetensors file at ``path``, durably; return its manifest
    entry (relative to ``root``) and the xxh3-64 checksum of each tensor's bytes (``stream_tensors``).
    With a ``syncer``, the final fsync is left to it (durable once ``syncer.drain()`` returns),
    so the next file is written while this one is flushed."""
    entry, sums = stream_tensors(LocalSink(path, syncer), tensors, path.relative_to(root).as_posix(), metadata)
    return entry, sums


def stream_tensors(
    sink: Sink, tensors: dict[str, torch.Tensor | ByteSource], relpath: str, metadata: dict[str, str] | None = None,
    pages: dict[str, dict[str, Any]] | None = None, groups: dict[str, int] | None = None,
) -> tuple[FileEntry, dict[str, str]]:
    """Write ``tensors`` as one safetensors file through ``sink`` (closed at the end, aborted on
    failure); return its manifest entry as ``relpath`` and the xxh3-64 checksum of each
    tensor's bytes (both computed on the way out, in one pass). ``pages``, when given, receives
    for each tensor larger than ``PAGED_FROM`` and one page its ``page_bytes`` (``page_size``) and ``pages`` (their
    checksums), as a chunk of the unit index records them. ``groups`` (key -> group number,
    say the unit of a pack file) keeps each group's tensors adjacent within each item size, so
    a reader of one group reads a few ranges, not one per tensor.

    Memory: no copy of a contiguous CPU tensor is made; a tensor on another device is copied
    to the CPU one tensor at a time; a ``ByteSource`` is copied from its file in pieces."""
    group = groups or {}
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), group.get(item[0], 0), item[0]))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, tensor in ordered:
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": dtypes.code_of(tensor.dtype), "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    hasher = xxhash.xxh3_64()
    sums: dict[str, str] = {}
    try:
        head = struct.pack("<Q", len(encoded)) + encoded
        hasher.update(head)
        sink.write(head)
        for key, tensor in ordered:
            piece_hasher = xxhash.xxh3_64()
            nbytes = tensor.numel() * tensor.element_size()
            page = page_size(nbytes)
            paged = _Pages(page) if pages is not None and nbytes > max(page, PAGED_FROM) else None
            for piece in _pieces(tensor):
                for start in range(0, len(piece), HASHED):  # each part's checksums while it is in the cache
                    part = piece[start : start + HASHED]
                    hasher.update(part)
                    piece_hasher.update(part)
                    if paged is not None:
                        paged.update(part)
                if isinstance(tensor, ByteSource):
                    sink.write(piece)  # a buffer the next piece is read into
                else:
                    sink.write_stable(piece)  # a tensor's memory: written meanwhile, on the sink's thread where it has one
                advance()  # a rank writing a large part to a slow store shows it is live (``Coordinator.working``)
            sums[key] = piece_hasher.hexdigest()
            if paged is not None:
                pages[key] = {"page_bytes": page, "pages": paged.finish()}
            if isinstance(tensor, ByteSource) and tensor.expect_xxh3 not in (None, sums[key]):
                raise DamagedFileError(f"{tensor.path}: checksum mismatch in the bytes of {key!r} (file is corrupted)")
        sink.close()
    except BaseException:
        sink.abort()
        raise
    entry = FileEntry(path=relpath, bytes=8 + len(encoded) + offset, xxh3_64=hasher.hexdigest())
    return entry, sums


class _Pages:
    """xxh3-64 of consecutive pages of a byte stream fed in pieces of any size."""

    def __init__(self, size: int):
        self.size, self.filled, self.sums = size, 0, []
        self.hasher = xxhash.xxh3_64()

    def update(self, piece: memoryview | bytes) -> None:
        view = memoryview(piece)
        if self.filled:  # the page an earlier piece began
            take = min(self.size - self.filled, len(view))
            self.hasher.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled < self.size:
                return
            self.sums.append(self.hasher.hexdigest())
            self.hasher.reset()
            self.filled = 0
        # The piece's whole pages, each hashed in one call (the same digest as streamed): a
        # small save's tensors are hundreds of 4 KiB pages, and a streamed page cost ~5 calls.
        size, whole = self.size, len(view) - len(view) % self.size
        self.sums.extend([xxhash.xxh3_64_hexdigest(view[start : start + size]) for start in range(0, whole, size)])
        if whole < len(view):
            self.hasher.update(view[whole:])
            self.filled = len(view) - whole

    def finish(self) -> list[str]:
        if self.filled:
            self.sums.append(self.hasher.hexdigest())
        return self.sums


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor in CPU memory, as a view of that memory (writable: what
    is written through it is the tensor's new value; autograd is not told)."""
    import torch  # a tensor is given: torch is loaded already

    if not tensor.numel():
        return memoryview(bytearray())
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def readable_into(tensor: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether the bytes of a stored tensor of ``dtype`` and ``shape`` can be read straight into
    ``tensor``'s memory (``byte_view``): a plain tensor or parameter (not a subclass such as a
    DTensor, whose memory is not its global shape), in CPU memory, contiguous, of that dtype
    and shape, not an inference tensor nor a lazily conjugated or negated view."""
    import torch

    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu" and tensor.dtype == dtype
            and list(tensor.shape) == list(shape) and tensor.is_contiguous() and not tensor.is_inference()
            and not tensor.is_conj() and not tensor.is_neg())


def _pieces(tensor: torch.Tensor | ByteSource):
    if isinstance(tensor, ByteSource):
        yield from _file_pieces(tensor)
        return
    import torch  # a tensor is given: torch is loaded already

    data = byte_view(tensor.detach().to("cpu").contiguous())
    for start in range(0, len(data), PIECE):
        yield data[start : start + PIECE]


def _file_pieces(source: ByteSource):
    """The bytes of ``source``, read from its file in pieces (no decode)."""
    if source.storage is not None:
        yield from source.storage.pieces(source.key, source.offset, source.length)
        return
    try:
        handle = open(source.path, "rb", buffering=0)
    except FileNotFoundError:
        raise IntegrityError(f"{source.path}: file is missing") from None
    except OSError as err:
        raise IntegrityError(describe_os_error(err, source.path)) from None
    with handle:
        yield from read_pieces(handle, source.path, source.offset, source.offset + source.length, "the tensor")


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """``(offset of the data, header)`` of the local safetensors file ``path``, from its header
    alone, validated (``parse_header``); an OS error (a missing file) is raised as it is."""
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size

        def read(start: int, length: int) -> bytes:
            handle.seek(start)
            return handle.read(length)

        return parse_header(read, size, str(path))


def parse_header(read, size: int, where: str) -> tuple[int, dict[str, dict]]:
    """``(offset of the data, header)`` of a safetensors file of ``size`` bytes whose bytes
    ``read(start, length)`` gives; IntegrityError naming ``where`` when it is not one."""
    if size < 8:
        raise IntegrityError(f"{where}: not a readable safetensors file (too short for a header)")
    (length,) = struct.unpack("<Q", bytes(read(0, 8)))
    if length > MAX_HEADER or 8 + length > size:
        raise IntegrityError(f"{where}: not a readable safetensors file (header of {length} bytes)")
    try:
        header = json.loads(bytes(read(8, length)))
    except (ValueError, RecursionError) as err:
        raise IntegrityError(f"{where}: not a readable safetensors file (header: {err})") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{where}: not a readable safetensors file (header is not an object)")
    data = 8 + length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            count = 1
            for d in info["shape"]:
                count *= int(d)
            itemsize = dtypes.itemsize(dtypes.from_code(info["dtype"]))
            valid = isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end and data + end <= size
            valid = valid and end - begin == count * itemsize
        except (TypeError, KeyError, ValueError, IntegrityError):
            valid = False
        if not valid:
            raise IntegrityError(f"{where}: not a readable safetensors file (tensor {name!r} is malformed)")
    return data, header


def decode_tensors(data: bytearray | mmap.mmap | memoryview, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a whole safetensors file held in ``data`` (views into it, no copy)."""
    import torch

    offset, header = parse_header(lambda start, length: memoryview(data)[start : start + length], len(data), where)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = dtypes.to_torch(dtypes.from_code(info["dtype"]))
        begin, end = info["data_offsets"]
        shape = [int(d) for d in info["shape"]]
        if end == begin:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(data, dtype=dtype, count=(end - begin) // dtypes.itemsize(dtypes.from_code(info["dtype"])),
                                         offset=offset + begin).reshape(shape)
    return out
