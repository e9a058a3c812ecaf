"""Durable file I/O: checksummed writes, verified reads, atomic replacement.

Checksums are xxh3-64 over a file's bytes, computed while the bytes are written.

Files are written through a storage's sinks and read through the storage
(``store.storage``: a local directory or an object store), so one path serves both. Tensor
files are safetensors files. They are *written* here, streaming: the header, then each tensor's bytes straight from its memory in 16 MiB
pieces, hashed on the way. On this project's VM, with a training process's memory in use,
safetensors' own ``save_file`` wrote a 6.2 GB checkpoint at 0.3-0.8 GB/s and these pieces at
1.6 GB/s (``bench/RESULTS.md``), and hashing on the way spares a read-back. The format
(little-endian u64 header size, JSON header padded with spaces to 8 bytes, then the data) is
safetensors' published one; tensors are ordered by item size, so each is naturally aligned.
They are *read* from their header (validated: every tensor's range inside the file, matching
its dtype and shape) and byte ranges, so a reader of part of a file, local or remote, reads
only that part.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import struct
import queue
import threading
from concurrent.futures import Future
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from llmtailor.errors import IntegrityError, TailorError
from llmtailor.store import dtypes
from llmtailor.store.manifest import FileEntry


if TYPE_CHECKING:
    import torch

    from llmtailor.store.storage.base import Sink, Storage

_PIECE = 16 << 20
FLUSH_EVERY = 256 << 20
"""A file larger than this is made durable and dropped from the page cache as it is written:
growing the cache by gigabytes is what a large write spends its time on (bench/RESULTS.md)."""
MAX_HEADER = 100 << 20
"""No credible safetensors header is larger (a header's size is read before the header)."""
MIN_PAGE, MAX_PAGES = 4096, 256


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
        while piece := handle.read(_PIECE):
            hasher.update(piece)
    return hasher.hexdigest()


def write_bytes_to(sink: Sink, data: bytes, relpath: str) -> FileEntry:
    """Write ``data`` through ``sink`` and close it; its manifest entry as ``relpath``."""
    try:
        sink.write(data)
        sink.close()
    except BaseException:
        sink.abort()
        raise
    return FileEntry(path=relpath, bytes=len(data), xxh3_64=checksum(data))


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


def safetensors_layout(path: Path) -> tuple[int, dict[str, dict]]:
    """``(offset of the data, header)`` of a safetensors file, from its header alone (the
    format: a little-endian u64 header size, then the JSON header, then the data)."""
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        if size > MAX_HEADER:
            raise IntegrityError(f"{path}: safetensors header of {size} bytes is not credible")
        header = json.loads(handle.read(size))
    return 8 + size, header


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
    from llmtailor.store.storage.local import LocalSink

    entry, sums = stream_tensors(LocalSink(path, syncer), tensors, path.relative_to(root).as_posix(), metadata)
    return entry, sums


def stream_tensors(
    sink: Sink, tensors: dict[str, torch.Tensor | ByteSource], relpath: str, metadata: dict[str, str] | None = None,
    pages: dict[str, dict[str, Any]] | None = None,
) -> tuple[FileEntry, dict[str, str]]:
    """Write ``tensors`` as one safetensors file through ``sink`` (closed at the end, aborted on
    failure); return its manifest entry as ``relpath`` and the xxh3-64 checksum of each
    tensor's bytes (both computed on the way out, in one pass). ``pages``, when given, receives
    for each tensor larger than one page its ``page_bytes`` (``page_size``) and ``pages`` (their
    checksums), as a chunk of the unit index records them.

    Memory: no copy of a contiguous CPU tensor is made; a tensor on another device is copied
    to the CPU one tensor at a time; a ``ByteSource`` is copied from its file in pieces."""
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
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
            paged = _Pages(page) if pages is not None and nbytes > page else None
            for piece in _pieces(tensor):
                hasher.update(piece)
                piece_hasher.update(piece)
                if paged is not None:
                    paged.update(piece)
                sink.write(piece)
            sums[key] = piece_hasher.hexdigest()
            if paged is not None:
                pages[key] = {"page_bytes": page, "pages": paged.finish()}
            if isinstance(tensor, ByteSource) and tensor.expect_xxh3 not in (None, sums[key]):
                raise IntegrityError(f"{tensor.path}: checksum mismatch in the bytes of {key!r} (file is corrupted)")
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
        while len(view):
            take = min(self.size - self.filled, len(view))
            self.hasher.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.size:
                self.sums.append(self.hasher.hexdigest())
                self.hasher.reset()
                self.filled = 0

    def finish(self) -> list[str]:
        if self.filled:
            self.sums.append(self.hasher.hexdigest())
        return self.sums


def make_durable(fd: int, start: int = 0, end: int | None = None) -> None:
    """fsync a file, then drop its bytes ``[start, end)`` (to the end of the file by default)
    from the page cache: they are durable and will not be read soon, so a save's cache
    footprint stays about one unit instead of the whole checkpoint."""
    os.fsync(fd)
    os.posix_fadvise(fd, start, 0 if end is None else end - start, os.POSIX_FADV_DONTNEED)


class Syncer:
    """Makes written files durable on a background thread, in order, while the caller writes
    the next ones: at most ``depth`` bytes wait (the dirty page cache stays bounded; many small
    files queue up without holding the writer back).
    ``drain()`` returns once every submitted file is durable, or raises the first failure;
    use it as a context manager so its thread and descriptors are released on any exit.

    Its own thread, not a ``ThreadPoolExecutor``: an executor refuses new work once the
    interpreter begins to exit, and an async save still in flight when a script ends (one that
    forgot ``close()``) must still become durable while the interpreter waits for it."""

    def __init__(self, depth: int = 2 * FLUSH_EVERY):
        self._queue: queue.SimpleQueue[tuple[int, int, int | None, Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="llmtailor-fsync", daemon=True)
        self._thread.start()
        self._pending: list[tuple[Path, Future, int]] = []
        self._depth = depth

    def submit(self, path: Path, fd: int, start: int = 0, end: int | None = None, size: int = 0) -> None:
        """Take over ``fd`` (a descriptor of a written file, ``size`` bytes not yet durable):
        fsync it, drop ``[start, end)`` from the page cache (``make_durable``), close it."""
        done: Future = Future()
        self._queue.put((fd, start, end, done))
        self._pending.append((path, done, size))
        while len(self._pending) > 1 and sum(p[2] for p in self._pending) > self._depth:
            self._wait_first()

    def drain(self) -> None:
        while self._pending:
            self._wait_first()

    def _wait_first(self) -> None:
        path, future, _ = self._pending.pop(0)
        try:
            future.result()
        except OSError as error:
            raise OSError(error.errno, f"making {path} durable failed: {error.strerror}") from error

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            fd, start, end, done = task
            try:
                make_durable(fd, start, end)
                done.set_result(None)
            except BaseException as error:  # handed to the writer, which raises it
                done.set_exception(error)
            finally:
                os.close(fd)

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.drain()
        finally:
            self._queue.put(None)  # descriptors still queued are closed by the thread first
            self._thread.join()


def tensor_checksum(tensor: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes, as ``stream_tensors`` records it per tensor."""
    hasher = xxhash.xxh3_64()
    for piece in _pieces(tensor):
        hasher.update(piece)
    return hasher.hexdigest()


def _pieces(tensor: torch.Tensor | ByteSource):
    if isinstance(tensor, ByteSource):
        yield from _file_pieces(tensor)
        return
    import torch  # a tensor is given: torch is loaded already

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    for start in range(0, len(data), _PIECE):
        yield data[start : start + _PIECE]


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


def read_pieces(handle, where: Path | str, start: int, end: int, what: str = "the data") -> Iterator[memoryview]:
    """Bytes ``start`` to ``end`` of the open file ``handle``, in pieces of at most 16 MiB read
    into one reused buffer (a piece is valid until the next is taken). IntegrityError naming
    ``where`` when the file is shorter than ``what`` it should hold."""
    if os.fstat(handle.fileno()).st_size < end:
        raise IntegrityError(f"{where}: shorter than {what} it should hold (truncated)")
    buffer = memoryview(mmap.mmap(-1, min(_PIECE, end - start)) if end > start else bytearray())
    handle.seek(start)
    position = start
    while position < end:
        got = handle.readinto(buffer[: min(len(buffer), end - position)])
        if not got:
            raise IntegrityError(f"{where}: ended while reading {what} (truncated)")
        position += got
        yield buffer[:got]


# -- reading a run's files through its storage -------------------------------------------------


def _check_size(storage: Storage, key: str, entry: FileEntry) -> None:
    size = storage.size(key)
    if size is None:
        raise IntegrityError(f"{storage.where(key)}: file is missing")
    if size != entry.bytes:
        raise IntegrityError(f"{storage.where(key)}: {size} bytes stored, manifest says {entry.bytes} (truncated or replaced)")


def verify_stored(storage: Storage, key: str, entry: FileEntry) -> None:
    """Check the file ``key`` against its manifest ``entry``: size, then checksum (streamed)."""
    _check_size(storage, key, entry)
    hasher = xxhash.xxh3_64()
    seen = 0
    for piece in storage.pieces(key):
        hasher.update(piece)
        seen += len(piece)
    if seen != entry.bytes:
        raise IntegrityError(f"{storage.where(key)}: {seen} bytes read, manifest says {entry.bytes} (changed while read)")
    if hasher.hexdigest() != entry.xxh3_64:
        raise IntegrityError(f"{storage.where(key)}: checksum mismatch (file is corrupted)")


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
    data = storage.read(key)
    if len(data) != entry.bytes:
        raise IntegrityError(f"{storage.where(key)}: {len(data)} bytes stored, manifest says {entry.bytes} (truncated or replaced)")
    if checksum(data) != entry.xxh3_64:
        raise IntegrityError(f"{storage.where(key)}: checksum mismatch (file is corrupted)")
    return data if isinstance(data, (bytearray, mmap.mmap)) else bytearray(data)


def read_stored_tensors(storage: Storage, key: str, entry: FileEntry) -> dict[str, torch.Tensor]:
    """Every tensor of a checked safetensors file (``read_stored``); never unpickles."""
    return decode_tensors(read_stored(storage, key, entry), storage.where(key))


def stored_header(storage: Storage, key: str, entry: FileEntry) -> tuple[int, dict[str, dict]]:
    """``(offset of the data, header)`` of the safetensors file ``key``, from its header alone,
    after checking its size against ``entry``."""
    _check_size(storage, key, entry)
    return parse_header(lambda start, length: storage.read_range(key, start, length), entry.bytes, storage.where(key))


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


def decode_tensors(data: bytearray | mmap.mmap, where: str) -> dict[str, torch.Tensor]:
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


def check_stored_header(storage: Storage, key: str, entry: FileEntry, expected: dict[str, tuple[str, list[int]]]) -> None:
    """Compare a tensor file's header (read alone, no tensor bytes) with what the manifest says
    it holds: each key present, with the manifest's dtype (by name) and shape."""
    _, header = stored_header(storage, key, entry)
    where = storage.where(key)
    for name, (dtype, shape) in expected.items():
        info = header.get(name)
        if info is None or name == "__metadata__":
            raise IntegrityError(f"{where}: tensor {name!r} is missing")
        found = (dtypes.from_code(info["dtype"]), [int(d) for d in info["shape"]])
        if found != (dtype, shape):
            raise IntegrityError(f"{where}: tensor {name!r} is {info['dtype']} {found[1]}, manifest says {dtype} {shape}")


def read_tensors(root: Path, entry: FileEntry) -> dict[str, torch.Tensor]:
    """Load a verified safetensors file of the directory ``root`` (never unpickles)."""
    from llmtailor.store.storage.local import LocalStorage

    return read_stored_tensors(LocalStorage(root), entry.path, entry)


def read_checked_tensors(storage: Storage, key: str, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (name -> xxh3-64 of its bytes) of the safetensors file ``key``,
    each read alone (its byte range) and checked against its checksum: for a large file of
    which only a few tensors are wanted (a base model's shard); never unpickles."""
    import torch

    size = storage.size(key)
    if size is None:
        raise IntegrityError(f"{storage.where(key)}: file is missing")
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
            raise IntegrityError(f"{where}: tensor {name!r} differs from the one the run recorded (checksum mismatch)")
        dtype = dtypes.to_torch(dtypes.from_code(info["dtype"]))
        shape = [int(d) for d in info["shape"]]
        out[name] = torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
    return out


def confine(path: Path, within: Path) -> Path:
    """``path``, after checking that it resolves (every symlink followed) inside ``within``, a
    resolved directory; IntegrityError naming both otherwise. A run's files are read only
    inside the run: a link out of it is not part of the checkpoint, whatever it points to."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(within):
        raise IntegrityError(
            f"{path}: resolves to {real}, outside the run {within}; llmtailor does not follow links out of a run"
        )
    return path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a mix."""
    replace_bytes_atomically(path, text.encode("utf-8"))


def replace_bytes_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave a stray temporary file
        raise
    fsync_dir(path.parent)


# -- OS errors in plain words ------------------------------------------------------------------


class StorageError(TailorError, OSError):
    """An OS error met while reading or writing a run or an export: a TailorError whose message
    names the path and the reason in one line, and still an OSError (with the original
    ``errno``), so code that caught the OS error before catches this one."""

    def __init__(self, message: str, cause: OSError | None = None):
        super().__init__(message)
        if cause is not None:
            self.errno = os_errno(cause)

    def __str__(self) -> str:
        return str(self.args[0])


_REASONS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "is a directory",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "already exists and is not empty",
    errno.ENODEV: "no such device (not a place to read or write files)",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "file name too long",
}
_BY_TYPE = ((PermissionError, errno.EACCES), (FileNotFoundError, errno.ENOENT), (FileExistsError, errno.EEXIST),
            (NotADirectoryError, errno.ENOTDIR), (IsADirectoryError, errno.EISDIR))


def os_errno(err: OSError) -> int | None:
    """``err``'s errno, also for errors raised without one (safetensors names it in the
    message, or by the exception's class only)."""
    if err.errno is not None:
        return err.errno
    found = re.search(r"os error (\d+)", str(err))
    if found:
        return int(found.group(1))
    return next((code for kind, code in _BY_TYPE if isinstance(err, kind)), None)


def describe_os_error(err: OSError, path: Path | str | None = None) -> str:
    """One line for an OS error: the path it concerns (the error's own, else ``path``) and the
    reason in plain words (``/run/x: permission denied``)."""
    code = os_errno(err)
    reason = _REASONS.get(code) or err.strerror or (os.strerror(code) if code else None) or str(err) or type(err).__name__
    where = err.filename if err.filename is not None else path
    if err.filename2 is not None:
        where = f"{where} -> {err.filename2}"
    return f"{where}: {reason}" if where is not None else reason


def remove_empty(directories: list[Path]) -> None:
    """Remove ``directories`` (innermost first) that a failed operation created, each only if
    empty, stopping at the first that is not: anything in them is not the caller's to remove."""
    for made in directories:  # innermost first
        try:
            made.rmdir()  # only if empty: anything else is not ours to remove
        except FileNotFoundError:
            continue  # never made (the failure came first), or removed already
        except OSError:
            return
