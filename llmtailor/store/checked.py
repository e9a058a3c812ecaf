"""A run's files against their manifest entries: each written with its size and checksum
(``write_bytes_to``; tensor files: ``tensor_files.stream_tensors``), and read through the run's
storage checked against them (``read_stored``, ``verify_stored``, ``stored_header``...) before
anything read is trusted."""

from __future__ import annotations

import mmap
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from llmtailor.distributed.progress import advance, carried
from llmtailor.errors import DamagedFileError, IntegrityError, TailorError
from llmtailor.store import dtypes
from llmtailor.store.fetch import fetch, fetch_into, new_buffer, request_parts
from llmtailor.store.manifest import FileEntry
from llmtailor.store.storage.base import LazyPool, Sink, Storage
from llmtailor.store.storage.local import LocalStorage
from llmtailor.store.tensor_files import byte_view, checksum, decode_tensors, parse_header

if TYPE_CHECKING:
    import torch


def write_bytes_to(sink: Sink, data: bytes, relpath: str) -> FileEntry:
    """Write ``data`` through ``sink`` and close it; its manifest entry as ``relpath``."""
    write_to(sink, data)
    return FileEntry(path=relpath, bytes=len(data), xxh3_64=checksum(data))


def write_to(sink: Sink, data: bytes | memoryview) -> None:
    """Write ``data`` through ``sink`` and close it; on any failure the sink is aborted (no
    partial file left). For bytes already checked against their entry (no checksum again)."""
    try:
        sink.write(data)
    except BaseException:
        sink.abort()
        raise
    closed(sink)


def closed(sink: Sink) -> None:
    """``sink`` closed (its file durable), or aborted where that fails (no partial file left)."""
    try:
        sink.close()
    except BaseException:
        sink.abort()
        raise


def _check_found_size(storage: Storage, key: str, entry: FileEntry, size: int | None) -> None:
    """The file ``key``, of ``size`` bytes as the store answered (None: missing), against ``entry``."""
    if size is None:
        raise DamagedFileError(f"{storage.where(key)}: file is missing")
    if size != entry.bytes:
        raise DamagedFileError(f"{storage.where(key)}: {size} bytes stored, manifest says {entry.bytes} (truncated or replaced)")


def verify_stored(storage: Storage, key: str, entry: FileEntry) -> None:
    """Check the file ``key`` against its manifest ``entry``: size, then checksum (streamed)."""
    _check_found_size(storage, key, entry, storage.size(key))
    hasher = xxhash.xxh3_64()
    seen = 0
    for piece in storage.pieces(key):
        hasher.update(piece)
        seen += len(piece)
        advance()
    if seen != entry.bytes:
        raise IntegrityError(f"{storage.where(key)}: {seen} bytes read, manifest says {entry.bytes} (changed while read)")
    if hasher.hexdigest() != entry.xxh3_64:
        raise DamagedFileError(f"{storage.where(key)}: checksum mismatch (file is corrupted)")


def stored_problem(storage: Storage, key: str, entry: FileEntry) -> str | None:
    """A problem with the file ``key`` (``verify_stored``), or None when it matches."""
    try:
        verify_stored(storage, key, entry)
    except TailorError as err:  # damaged or missing (IntegrityError), or unreadable (StorageError)
        return str(err)
    return None


def read_stored(storage: Storage, key: str, entry: FileEntry) -> bytearray | mmap.mmap:
    """The bytes of the file ``key``, read once and checked against ``entry`` (size and
    checksum) before they are returned."""
    return check_stored(read_recorded(storage, key), entry, storage.where(key))


def read_recorded(storage: Storage, key: str, start: int = 0, length: int | None = None) -> Any:
    """The bytes of ``key``, a file a committed manifest records (all of it, or ``length`` bytes
    from ``start``), as the storage reads them, unchecked (the caller checks what it takes). The
    storage's IntegrityError (the file missing, shorter than read) is then the run's damage: a
    DamagedFileError, which the CLI follows with how to find every such file (``verify``); an
    error reading it (a StorageError: permission denied, say) stays what it is."""
    try:
        return storage.read(key) if length is None else storage.read_range(key, start, length)
    except DamagedFileError:
        raise
    except IntegrityError as err:
        raise DamagedFileError(str(err)) from None


def check_stored(data: bytes | bytearray | mmap.mmap, entry: FileEntry, where: str) -> bytearray | mmap.mmap:
    """``data``, the bytes of the file ``where``, once checked against ``entry`` (size and checksum)."""
    if len(data) != entry.bytes:
        raise DamagedFileError(f"{where}: {len(data)} bytes stored, manifest says {entry.bytes} (truncated or replaced)")
    if checksum(data) != entry.xxh3_64:
        raise DamagedFileError(f"{where}: checksum mismatch (file is corrupted)")
    return data if isinstance(data, (bytearray, mmap.mmap)) else bytearray(data)


def fetch_stored_tensors(storage: Storage, key: str, entry: FileEntry, expected: dict[str, tuple[str, list[int]]],
                         into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``key``, its bytes read once: fetched in concurrent
    parts and checksummed on the way (``store.fetch``), its size checked against ``entry`` (from
    the answer to its first request where the store gives it there: no request of its own),
    the checksum compared with ``entry``'s, then its header with what the manifest says it
    holds (``check_header``), all before a tensor is made; never unpickles.

    ``into``: tensors to read straight into (name -> a live tensor of the manifest's dtype and
    shape, contiguous, in CPU memory: ``readable_into``), which are the ones returned for those
    names. Their bytes land before the file's checksum is compared: on an IntegrityError they
    may hold damaged bytes (the caller treats them as touched). The header is then read first
    and checked before any byte lands; a file whose tensors do not tile its data is read whole."""
    where, hasher = storage.where(key), xxhash.xxh3_64()
    if into and storage.remote:
        return _fetch_parts_into(storage, key, entry, expected, into)
    if into:
        layout = _tiled_layout(storage, key, entry, expected)
        if layout is not None:
            return _fetch_into(storage, key, entry, layout, into, hasher)
    data = fetch(storage, key, 0, entry.bytes, hasher, sized=lambda size: _check_found_size(storage, key, entry, size))
    if hasher.hexdigest() != entry.xxh3_64:
        raise DamagedFileError(f"{where}: checksum mismatch (file is corrupted)")
    view = memoryview(data)
    check_header(parse_header(lambda start, length: view[start : start + length], len(data), where)[1], where, expected)
    return decode_tensors(data, where)


def _fetch_parts_into(storage: Storage, key: str, entry: FileEntry, expected: dict[str, tuple[str, list[int]]],
                      into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``fetch_stored_tensors`` with ``into`` from a remote store (``_landed``): the file's
    checksum over every part in file order, compared once all are in; where its header was not
    usable (``_landed``), the plain fetch's checks in its order: the checksum, then the header."""
    where, hasher = storage.where(key), xxhash.xxh3_64()
    header, got = _landed(storage, key, entry, expected, into, hasher)
    if header is None:
        if checksum(got) != entry.xxh3_64:
            raise DamagedFileError(f"{where}: checksum mismatch (file is corrupted)")
        view = memoryview(got)
        check_header(parse_header(lambda start, length: view[start : start + length], len(got), where)[1], where, expected)
        return decode_tensors(got, where)
    if hasher.hexdigest() != entry.xxh3_64:
        raise DamagedFileError(f"{where}: checksum mismatch (file is corrupted)")
    return got


def fetch_whole_into(storage: Storage, key: str, entry: FileEntry, expected: dict[str, tuple[str, list[int]]],
                     into: dict[str, torch.Tensor]) -> tuple[tuple[int, dict[str, dict]], dict[str, torch.Tensor] | bytearray | mmap.mmap]:
    """``fetch_whole`` of a remote tensor file with the bytes of ``into``'s tensors landing in
    their memory (``_landed``): ``(its parsed header, its tensors by name)``, or where its header
    was not usable there, ``(its parsed header, its bytes)`` as ``fetch_whole`` gives them. No
    checksum compared: the caller checks each tensor it takes against its own (``checked_landed``
    or ``checked_parts``)."""
    header, got = _landed(storage, key, entry, expected, into, None)
    if header is None:
        view = memoryview(got)
        return parse_header(lambda start, length: view[start : start + length], len(got), storage.where(key)), got
    return header, got


def checked_landed(tensors: dict[str, torch.Tensor], names: dict[str, str], where: str) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (name -> xxh3-64 of its bytes) of ``tensors`` (``fetch_whole_into``'s),
    each checked against its checksum where it landed before it is returned (as ``checked_parts``)."""
    out = {}
    for name, expected in names.items():
        if name not in tensors:
            raise IntegrityError(f"{where}: tensor {name!r} is missing")
        if checksum(byte_view(tensors[name])) != expected:
            raise DamagedFileError(f"{where}: checksum mismatch in tensor {name!r} (file is corrupted)")
        out[name] = tensors[name]
    return out


def _landed(storage: Storage, key: str, entry: FileEntry, expected: dict[str, tuple[str, list[int]]],
            into: dict[str, torch.Tensor], hasher: xxhash.xxh3_64 | None) -> tuple[tuple[int, dict[str, dict]] | None, Any]:
    """The remote tensor file ``key`` fetched in the requests of a plain fetch of it
    (``fetch.request_parts``; the first one's answer checks the size), no header request before
    them: each part's bytes are kept as the store answered them; the header is parsed from the
    first part's and checked against ``expected`` before a byte lands; then each part, in file
    order, is fed to ``hasher`` (where given) and copied where its bytes go: the memory of
    ``into``'s tensors, one new buffer for the others. ``(header, tensors by name)``. So the bytes
    of a read into live tensors do not pass through fresh memory of their own (a new buffer's
    pages are faulted in, zeroed and freed again: on a 2-vCPU VM about 1 ms of CPU per MB, five
    times the copy). ``(None, the file's bytes)`` where the header does not lie whole in the first
    part, does not parse, does not match ``expected`` or its tensors do not tile the data: no
    byte landed in ``into``'s then."""
    where = storage.where(key)
    cuts, parts = request_parts(storage, key, entry.bytes, lambda size: _check_found_size(storage, key, entry, size))
    ends = [*cuts[1:], entry.bytes]
    try:
        targets = _landing(memoryview(parts.take(0)).cast("B"), entry, where, expected, into)
        if targets is None:
            data = new_buffer(entry.bytes)
            view = memoryview(data)
            for index, (start, end) in enumerate(zip(cuts, ends)):
                view[start:end] = memoryview(parts.take(index)).cast("B")
            return None, data
        header, places, out = targets
        for index, (start, end) in enumerate(zip(cuts, ends)):
            data = memoryview(parts.take(index)).cast("B")
            if hasher is not None:
                hasher.update(data)
            for begin, stop, dest in places:  # the tensors this part's bytes belong to
                if begin < end and stop > start:
                    low, high = max(begin, start), min(stop, end)
                    dest[low - begin : high - begin] = data[low - start : high - start]
        return header, out
    except BaseException:
        parts.stop()  # no request left running behind the caller
        raise


def _landing(head: memoryview, entry: FileEntry, where: str, expected: dict[str, tuple[str, list[int]]],
             into: dict[str, torch.Tensor]) -> tuple[tuple[int, dict[str, dict]], list[tuple[int, int, memoryview]],
                                                     dict[str, torch.Tensor]] | None:
    """Where each tensor's bytes of a tensor file go (``_landed``): ``(its parsed header, [(begin,
    end, memory)] in file order, the tensors by name)``, from its header as the file's first bytes
    ``head`` hold it, checked against ``expected``; its tensors tiling its data end to end, as
    the writer lays them out. None where the header is not whole in ``head``, is not one, does not
    match, or the tensors do not tile the data."""
    import torch

    class _Beyond(Exception):
        pass

    def read(start: int, length: int) -> memoryview:
        if start + length > len(head):
            raise _Beyond
        return head[start : start + length]

    try:
        data, header = parse_header(read, entry.bytes, where)
        check_header(header, where, expected)
    except (_Beyond, IntegrityError):
        return None
    spans = _tiling(header, data, entry.bytes)
    if spans is None:
        return None
    buffer = new_buffer(sum(end - begin for begin, end, name, _ in spans if not _fits(into, name, end - begin)))
    places, out, at = [], {}, 0
    for begin, end, name, info in spans:
        if _fits(into, name, end - begin):
            places.append((data + begin, data + end, byte_view(into[name])))
            out[name] = into[name]
            continue
        places.append((data + begin, data + end, memoryview(buffer)[at : at + end - begin]))
        code = dtypes.from_code(info["dtype"])
        dtype, shape = dtypes.to_torch(code), [int(d) for d in info["shape"]]
        out[name] = (torch.frombuffer(buffer, dtype=dtype, count=(end - begin) // dtypes.itemsize(code), offset=at).reshape(shape)
                     if end > begin else torch.empty(shape, dtype=dtype))
        at += end - begin
    return (data, header), places, out


def checked_tensors(data: memoryview, where: str, expected: dict[str, tuple[str, list[int]]],
                    into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``expected`` of the tensor file ``where`` from ``data``, its whole bytes as
    already checked against its entry (size and checksum: ``UnitReader.arrived``), with no
    second pass over them: its header checked against ``expected`` (``check_header``), each
    tensor a view of ``data``, those of ``into`` copied into its tensors' memory and returned as
    them (as ``fetch_stored_tensors`` returns them); never unpickles. Where ``data`` maps a file
    (a healed file's private mapping), a tensor with none of ``into`` to land in is copied into
    memory of its own: a view would keep the whole file mapped for as long as it lives (the
    optimizer's state: all of training), its memory taken (a ``/dev/shm`` tier's) after
    retention removed the file."""
    into = into or {}
    header = parse_header(lambda start, length: data[start : start + length], len(data), where)[1]
    check_header(header, where, expected)
    tensors = decode_tensors(data, where)
    mapping = isinstance(data.obj if isinstance(data, memoryview) else data, mmap.mmap)
    out = {}
    for name in expected:
        if _fits(into, name, tensors[name].nbytes):
            out[name] = into[name]
        else:
            out[name] = tensors[name].new_empty(tensors[name].shape) if mapping else tensors[name]
    copy_bytes([(out[name], tensors[name]) for name in expected if out[name] is not tensors[name]])
    return out


COPIERS = 4
"""Threads that copy the bytes of a file already in memory into live tensors (``copy_bytes``):
one core copies a few GB/s, so a healed node's hundreds of MB take a tenth of a second or more on
the training thread alone, while the host has idle cores (torch's copy releases the GIL)."""

COPY_PIECE = 8 << 20
"""Bytes a copier copies at a time (``copy_bytes``: a large tensor in pieces of this size, small
ones together up to it); a copy of no more is done where it is asked."""

_copiers = LazyPool(COPIERS, "llmtailor-copy")


def copy_bytes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The bytes of each ``(dst, src)`` pair of contiguous CPU tensors of the same size copied
    into ``dst`` (autograd not told, as ``byte_view``), in tasks of about ``COPY_PIECE`` bytes on
    the copiers' pool, the first on this thread; returns once every byte is copied (a failure
    raised, after every task ended)."""
    import torch

    tasks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    filled = 0  # bytes of the last task
    for dst, src in pairs:
        dst, src = dst.detach().reshape(-1).view(torch.uint8), src.detach().reshape(-1).view(torch.uint8)
        for at in range(0, dst.numel(), COPY_PIECE):
            if filled >= COPY_PIECE:
                tasks.append([])
                filled = 0
            tasks[-1].append((dst[at : at + COPY_PIECE], src[at : at + COPY_PIECE]))
            filled += min(COPY_PIECE, dst.numel() - at)
    copying = [_copiers.submit(carried(_copy), task) for task in tasks[1:]]
    try:
        _copy(tasks[0])
    finally:  # every task ended before a failure is raised: none copies on behind it into the live state
        futures_wait(copying)
    for task in copying:
        task.result()


def _copy(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pieces:
        dst.copy_(src)
        advance()


_HEAD = 64 << 10
"""Bytes read for a tensor file's header when the data goes straight into live tensors: a unit
file's header is a few KiB, so one request."""


def _tiled_layout(storage: Storage, key: str, entry: FileEntry,
                  expected: dict[str, tuple[str, list[int]]]) -> tuple[bytes, list[tuple]] | None:
    """``(the bytes before the data, [(begin, end, name, header entry)] in file order)`` of a tensor file
    whose header matches ``expected`` (``check_header``) and whose tensors cover its data end to
    end with no gap (how the writer lays them out, so hashing the header and then each tensor
    as it lands is the file's checksum); None for any other layout."""
    where = storage.where(key)
    size, head = storage.read_start(key, min(_HEAD, entry.bytes))  # the size checked by the header's request
    _check_found_size(storage, key, entry, size)
    head = bytes(head)

    def read(start: int, length: int) -> bytes:
        return head[start : start + length] if start + length <= len(head) else bytes(storage.read_range(key, start, length))

    data, header = parse_header(read, entry.bytes, where)
    check_header(header, where, expected)
    spans = _tiling(header, data, entry.bytes)
    return None if spans is None else (read(0, data), spans)


def _tiling(header: dict[str, dict], data: int, size: int) -> list[tuple] | None:
    """``[(begin, end, name, header entry)]`` of a parsed tensor file header in file order, where
    its tensors cover its data (from ``data`` to the file's ``size``) end to end with no gap (how
    the writer lays them out); None for any other layout."""
    spans = sorted((*info["data_offsets"], name, info) for name, info in header.items() if name != "__metadata__")
    position = 0
    for begin, end, _, _ in spans:
        if begin != position:
            return None
        position = end
    return spans if data + position == size else None


def _fetch_into(storage: Storage, key: str, entry: FileEntry, layout: tuple[bytes, list[tuple]],
                into: dict[str, torch.Tensor], hasher: xxhash.xxh3_64) -> dict[str, torch.Tensor]:
    """``fetch_stored_tensors`` of a tiled file (``_tiled_layout``): the tensors of ``into``
    read straight into their memory, the others into one new buffer, all in one concurrent
    fetch hashed in file order after the header."""
    import torch

    head, spans = layout
    rest = sum(end - begin for begin, end, name, _ in spans if name not in into)
    buffer = new_buffer(rest)
    views, out, at = [], {}, 0
    for begin, end, name, info in spans:
        if _fits(into, name, end - begin):  # the caller checked dtype and shape; a size mismatch is not read into
            views.append(byte_view(into[name]))
            out[name] = into[name]
            continue
        views.append(memoryview(buffer)[at : at + end - begin])
        dtype, shape = dtypes.from_code(info["dtype"]), [int(d) for d in info["shape"]]
        out[name] = (torch.frombuffer(buffer, dtype=dtypes.to_torch(dtype), count=(end - begin) // dtypes.itemsize(dtype),
                                      offset=at).reshape(shape) if end > begin else torch.empty(shape, dtype=dtypes.to_torch(dtype)))
        at += end - begin
    hasher.update(head)
    fetch_into(storage, key, len(head), views, hasher)
    if hasher.hexdigest() != entry.xxh3_64:
        raise DamagedFileError(f"{storage.where(key)}: checksum mismatch (file is corrupted)")
    return out
def read_stored_tensors(storage: Storage, key: str, entry: FileEntry) -> dict[str, torch.Tensor]:
    """Every tensor of a checked safetensors file (``read_stored``); never unpickles."""
    return decode_tensors(read_stored(storage, key, entry), storage.where(key))


HEADER_READ = 64 << 10
"""At most this many bytes ``stored_header`` reads from the start of a remote tensor file in
its first request (the header's length word, the header, and any data bytes the caller could
not rule out): a longer header is read on."""


def stored_header(storage: Storage, key: str, entry: FileEntry, known: int | None = None) -> tuple[int, dict[str, dict]]:
    """``(offset of the data, header)`` of the safetensors file ``key``, from its header alone,
    after checking its size against ``entry``; ``known``: bytes of
    the file's tensor data the caller knows of (its chunks in the indexes at hand). The rest of
    the file is at most the length word and the header: from a remote store (a round trip a
    request) they come with the file's size in one request when the rest is under
    ``HEADER_READ`` (every chunk known: no data byte read twice), where a HEAD and two GETs
    took them. None: the size and the length word first, then the header (no data byte read)."""
    first = min(max(8, entry.bytes - known), HEADER_READ) if storage.remote and known is not None else 8
    size, head = storage.read_start(key, min(first, entry.bytes))
    _check_found_size(storage, key, entry, size)

    def read(start: int, length: int) -> memoryview | bytes:  # past what came first: read on
        return head[start : start + length] if start + length <= len(head) else storage.read_range(key, start, length)

    return parse_header(read, entry.bytes, storage.where(key))


def check_stored_header(storage: Storage, key: str, entry: FileEntry, expected: dict[str, tuple[str, list[int]]],
                        known: int | None = None) -> tuple[int, dict[str, dict]]:
    """Compare a tensor file's header (read alone, no tensor bytes) with what the manifest says
    it holds: each key present, with the manifest's dtype (by name) and shape. Returns
    ``stored_header``'s ``(offset of the data, header)`` (``known``: as there)."""
    offset, header = stored_header(storage, key, entry, known)
    check_header(header, storage.where(key), expected)
    return offset, header


def check_header(header: dict[str, dict], where: str, expected: dict[str, tuple[str, list[int]]]) -> None:
    """A tensor file's parsed header against what the manifest says it holds (``expected``:
    name -> (dtype name, shape)): each present, with that dtype and shape; IntegrityError
    naming ``where`` and the tensor otherwise."""
    for name, (dtype, shape) in expected.items():
        info = header.get(name)
        if info is None or name == "__metadata__":
            raise IntegrityError(f"{where}: tensor {name!r} is missing")
        found = (dtypes.from_code(info["dtype"]), [int(d) for d in info["shape"]])
        if found != (dtype, shape):
            raise IntegrityError(f"{where}: tensor {name!r} is {info['dtype']} {found[1]}, manifest says {dtype} {shape}")


def read_tensors(root: Path, entry: FileEntry) -> dict[str, torch.Tensor]:
    """Load a verified safetensors file of the directory ``root`` (never unpickles)."""
    return read_stored_tensors(LocalStorage(root), entry.path, entry)


def read_checked_tensors(storage: Storage, key: str, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (name -> xxh3-64 of its bytes) of the safetensors file ``key``,
    each read alone (its byte range) and checked against its checksum: for a large file of
    which only a few tensors are wanted (a base model's shard); never unpickles."""
    import torch

    size = storage.size(key)
    if size is None:
        raise DamagedFileError(f"{storage.where(key)}: file is missing")
    where = storage.where(key)
    offset, header = parse_header(lambda start, length: storage.read_range(key, start, length), size, where)
    out = {}
    for name, expected in names.items():
        info = header.get(name)
        if info is None or name == "__metadata__":
            raise IntegrityError(f"{where}: tensor {name!r} is missing")
        begin, end = info["data_offsets"]
        data = bytearray(storage.read_range(key, offset + begin, end - begin))
        if checksum(data) != expected:
            raise DamagedFileError(f"{where}: tensor {name!r} differs from the one the run recorded (checksum mismatch)")
        dtype = dtypes.to_torch(dtypes.from_code(info["dtype"]))
        shape = [int(d) for d in info["shape"]]
        out[name] = torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
    return out


def read_stored_parts(storage: Storage, key: str, header: tuple[int, dict[str, dict]],
                      names: dict[str, str], into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (name -> xxh3-64 of its bytes) of the safetensors file ``key``
    (a pack file, holding other units' tensors too) whose checked header (``check_stored_header``)
    is ``header``: adjacent tensors read as one range, each checked against its own checksum;
    never unpickles. A pack file keeps each unit's tensors adjacent (``_Pack``), so a unit
    costs a read or two, not one per tensor. ``into``: as ``fetch_stored_tensors``' (the
    tensors read straight into, returned as themselves; damaged bytes may have landed in them
    when this raises)."""
    import torch

    where, into = storage.where(key), into or {}
    offset, header = header
    spans = []
    for name in names:
        info = header.get(name)
        if info is None or name == "__metadata__":
            raise IntegrityError(f"{where}: tensor {name!r} is missing")
        spans.append((*info["data_offsets"], name))
    spans.sort()
    runs: list[list] = []  # [begin, end, names]: tensors that follow each other, read at once
    for begin, end, name in spans:
        if runs and runs[-1][1] == begin:
            runs[-1][1] = end
            runs[-1][2].append((begin, end, name))
        else:
            runs.append([begin, end, [(begin, end, name)]])
    out = {}
    for run_begin, run_end, members in runs:
        data = new_buffer(sum(end - begin for begin, end, name in members if not _fits(into, name, end - begin)))
        views, at = [], 0
        for begin, end, name in members:
            if _fits(into, name, end - begin):
                views.append(byte_view(into[name]))
                out[name] = into[name]
                continue
            views.append(memoryview(data)[at : at + end - begin])
            info = header[name]
            dtype, shape = dtypes.to_torch(dtypes.from_code(info["dtype"])), [int(d) for d in info["shape"]]
            count = (end - begin) // dtypes.itemsize(dtypes.from_code(info["dtype"]))
            out[name] = (torch.frombuffer(data, dtype=dtype, count=count, offset=at).reshape(shape)
                         if count else torch.empty(shape, dtype=dtype))
            at += end - begin
        fetch_into(storage, key, offset + run_begin, views)
        for (begin, end, name), view in zip(members, views):
            if checksum(view) != names[name]:
                raise DamagedFileError(f"{where}: checksum mismatch in tensor {name!r} (file is corrupted)")
    return out


def fetch_whole(storage: Storage, key: str, entry: FileEntry) -> tuple[bytearray | mmap.mmap, tuple[int, dict[str, dict]]]:
    """The bytes of the tensor file ``key`` whole, fetched in concurrent parts (``store.fetch``;
    its size checked against ``entry`` in the answer to its first request), and its parsed
    header ``(offset of the data, header)``; the file's checksum is not compared: a pack file
    several units of which are taken from these bytes has each tensor checked against its own
    checksum as it is taken (``checked_parts``), so a damaged tensor is named with the unit it
    belongs to, and bytes no one takes are not hashed."""
    data = fetch(storage, key, 0, entry.bytes, sized=lambda size: _check_found_size(storage, key, entry, size))
    view = memoryview(data)
    return data, parse_header(lambda start, length: view[start : start + length], len(data), storage.where(key))


def checked_parts(data: bytearray | mmap.mmap, header: tuple[int, dict[str, dict]], names: dict[str, str],
                  where: str) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (name -> xxh3-64 of its bytes) of the tensor file ``where`` whose
    bytes ``data`` and parsed header ``header`` are at hand (``fetch_whole``), each a view of
    ``data`` checked against its checksum before it is returned (as ``read_stored_parts``
    checks those it reads); never unpickles."""
    import torch

    offset, parsed = header
    view, out = memoryview(data), {}
    for name, expected in names.items():
        info = parsed.get(name)
        if info is None or name == "__metadata__":
            raise IntegrityError(f"{where}: tensor {name!r} is missing")
        begin, end = info["data_offsets"]
        if checksum(view[offset + begin : offset + end]) != expected:
            raise DamagedFileError(f"{where}: checksum mismatch in tensor {name!r} (file is corrupted)")
        code = dtypes.from_code(info["dtype"])
        shape, count = [int(d) for d in info["shape"]], (end - begin) // dtypes.itemsize(code)
        out[name] = (torch.frombuffer(data, dtype=dtypes.to_torch(code), count=count, offset=offset + begin).reshape(shape)
                     if count else torch.empty(shape, dtype=dtypes.to_torch(code)))
    return out


def _fits(into: dict[str, torch.Tensor], name: str, length: int) -> bool:
    """Whether the stored tensor ``name`` of ``length`` bytes is read straight into ``into``'s."""
    return name in into and into[name].nbytes == length
