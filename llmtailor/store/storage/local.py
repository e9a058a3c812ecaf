"""The local filesystem as a ``Storage``: a run is a directory.

- Durability: every file is fsynced (on helper threads, up to four at once, while the next one
  is written: ``local_durable.Syncer``), large files in 256 MiB steps; once durable, a file of
  16 MiB or more is dropped from the page cache, a smaller one stays (``CACHED_UNDER``);
  directories are fsynced after entries are added, renamed or removed.
- Commit (``local_commit``): a save writes into a private directory under ``.tmp/`` and renames
  it into ``snapshots/`` atomically; retention renames a snapshot into ``.trash/`` before
  removing its files.
- Locks (``local_lock``): ``flock``: an exclusive lock on ``.lock`` for the writer, a shared
  lease on each snapshot's ``.readers`` file for readers.
- Run detection (``local_detect``): a run directory, a missing or empty one, or what else it is.
- Confinement: every file read resolves (symlinks followed) inside the run's directory, itself
  resolved once; a link out of it is refused with an IntegrityError naming it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from llmtailor.errors import IntegrityError, StorageError, TailorError, describe_os_error
from llmtailor.store.storage import local_durable
from llmtailor.store.storage.base import Batch, LazyPool, Sink, Storage
from llmtailor.store.storage.local_commit import LocalCommits
from llmtailor.store.storage.local_detect import LocalDetection
from llmtailor.store.storage.local_durable import Syncer, fsync_for_work, replace_bytes_atomically
from llmtailor.store.storage.local_lock import FlockLocks


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


class LocalStorage(Storage):
    """A run directory on the local filesystem (module docstring)."""

    reads_in_flight = 1
    """A fetch reads a file as one stream in file order (the kernel's read-ahead follows it; parts
    read side by side at eight offsets were no faster and often slower, cold, on the project's
    VM), the caller hashing each part while the next is read."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = str(root)
        self._boundary: Path | None = None
        self.commits = LocalCommits(self.root)
        self.locks = FlockLocks(self.root, self.path)
        self.detection = LocalDetection(self.root)

    def identity(self) -> str:
        return os.path.realpath(self.root)

    def where(self, key: str) -> str:
        return str(self.root / key) if key else str(self.root)

    def boundary(self) -> Path:
        """The run root with every symlink resolved: no file outside it is read."""
        if self._boundary is None:
            self._boundary = Path(os.path.realpath(self.root))
        return self._boundary

    def path(self, key: str) -> Path:
        """Where the file ``key`` lies, checked to resolve inside the run; a link out of it is
        named at its own place (a linked snapshot directory, not a file in it)."""
        if not key:
            return self.root
        try:
            return confine(self.root / key, self.boundary())
        except IntegrityError:
            parts = key.split("/")
            for depth in range(1, len(parts) + 1):
                confine(self.root.joinpath(*parts[:depth]), self.boundary())  # raises at the first link out
            raise

    # -- reading ------------------------------------------------------------------------------

    # Looking (size, presence, listing) follows links anywhere; reading refuses links out of
    # the run (``path``), naming them.

    def _look(self, key: str, look):
        path = self.root / key
        try:
            return look(path)
        except OSError as err:
            raise StorageError(describe_os_error(err, path), err) from None

    def size(self, key: str) -> int | None:
        return self._look(key, _file_size)

    def exists(self, key: str) -> bool:
        return self._look(key, Path.exists)

    def is_file(self, key: str) -> bool:
        return self._look(key, Path.is_file)

    def read(self, key: str) -> bytearray | mmap.mmap:
        path = self.path(key)
        with _opened(path) as handle:
            return _read_into(handle, path, 0, os.fstat(handle.fileno()).st_size)

    def pieces(self, key: str, start: int = 0, length: int | None = None) -> Iterator[memoryview]:
        """``Storage.pieces`` from one open file into one reused buffer."""
        path = self.path(key)
        with _opened(path) as handle:
            end = os.fstat(handle.fileno()).st_size if length is None else start + length
            yield from local_durable.read_pieces(handle, path, start, end)

    def read_range(self, key: str, start: int, length: int) -> memoryview:
        path = self.path(key)
        with _opened(path) as handle:
            if os.fstat(handle.fileno()).st_size < start + length:
                raise IntegrityError(f"{path}: shorter than the data it should hold (truncated)")
            return memoryview(_read_into(handle, path, start, length))

    def mapped(self, key: str) -> mmap.mmap | None:
        """``Storage.mapped``: a private mapping of the file (None for an empty one, which
        cannot be mapped)."""
        path = self.path(key)
        with _opened(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            return mmap.mmap(handle.fileno(), size, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None

    def read_into(self, key: str, start: int, into: memoryview) -> None:
        """``Storage.read_into`` straight from the file into ``into`` (``preadv``: no staging copy)."""
        path = self.path(key)
        with _opened(path) as handle:
            got, fd = 0, handle.fileno()
            while got < len(into):
                count = os.preadv(fd, [into[got:]], start + got)
                if not count:
                    raise IntegrityError(f"{path}: shorter than the data it should hold (truncated)")
                got += count

    def list_dir(self, prefix: str) -> list[str]:
        path = self.root / prefix
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as err:
            raise StorageError(describe_os_error(err, path), err) from None

    def walk(self, prefix: str) -> Iterator[tuple[str, int]]:
        top = self.root / prefix if prefix else self.root
        for path in top.rglob("*"):
            try:
                if path.is_file() and not path.is_symlink():
                    yield path.relative_to(self.root).as_posix(), path.stat().st_size
            except FileNotFoundError:
                continue  # removed meanwhile

    # -- writing ------------------------------------------------------------------------------

    def batch(self) -> LocalBatch:
        return LocalBatch(self)

    def put(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        path = self.root / key
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
        try:
            fd = os.open(path, flags, 0o666)
        except FileExistsError:
            raise TailorError(f"{path} already exists; refusing to overwrite it") from None
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            fsync_for_work(out.fileno())

    def replace(self, key: str, data: bytes) -> None:
        replace_bytes_atomically(self.root / key, data)

    def remove(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)


_LARGE = 1 << 20
"""Bytes from which a read goes into fresh anonymous memory (``mmap``): a bytearray is zeroed
first, which costs as much as the read itself from host memory."""


def _read_into(handle, path: Path, start: int, length: int) -> bytearray | mmap.mmap:
    """``length`` bytes of the open file from ``start``, into a new writable buffer."""
    data = mmap.mmap(-1, length) if length >= _LARGE else bytearray(length)
    view, got = memoryview(data), 0
    handle.seek(start)
    while got < length:
        count = handle.readinto(view[got:])
        if not count:
            raise IntegrityError(f"{path}: ended while being read (truncated)")
        got += count
    return data


class _opened:
    """``open(path, "rb")`` whose failures are IntegrityErrors naming the file: missing, or the
    reason in plain words (a file that may not be read is not "missing")."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.handle = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise IntegrityError(f"{self.path}: file is missing") from None
        except OSError as err:
            raise IntegrityError(describe_os_error(err, self.path)) from None
        return self.handle

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


_writers = LazyPool(4, "llmtailor-write")
"""The threads that write ``LocalSink.write_stable``'s bytes (one piece in flight per file)."""

WRITE_BEHIND_FROM = 8 << 20
"""``write_stable`` hands a piece of at least this many bytes to a writer thread; a smaller one is
written at once: each hand-over costs the two threads a turn of the interpreter's lock (up to its
5 ms switch interval), which a small save's pieces paid per tensor (a Lightning-sized save took
1.7x Lightning's own with every piece handed over, 0.8-1.0x without, bench/RESULTS.md session 49)."""


class LocalSink(Sink):
    """A file being written: large files made durable (and dropped from the page cache) every
    ``FLUSH_EVERY`` bytes, the rest by the batch's syncer once closed (dropped too unless the
    file is small: ``CACHED_UNDER``); in a batch, its write-out started once it holds
    ``WRITE_OUT_FROM`` bytes."""

    def __init__(self, path: Path, syncer: Syncer | None):
        self.path, self._syncer = path, syncer
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(path, "wb")
        self._written = self._flushed = 0
        self._started = False
        """Whether its write-out was started early (``local_durable.WRITE_OUT_FROM``)."""
        self._behind: Future[None] | None = None
        """The write of ``write_stable``'s last bytes, on a writer thread."""

    def write_stable(self, data: memoryview) -> None:
        """``Sink.write_stable``: a piece of ``WRITE_BEHIND_FROM`` bytes or more written on a
        writer thread (``_writers``), at most one piece behind, so the caller checksums the next
        piece meanwhile (a save's background thread: its writes into a memory tier were a third
        of its CPU at every step, issue 32); a smaller one at once."""
        if len(data) < WRITE_BEHIND_FROM:
            self.write(data)
            return
        self._caught_up()
        self._behind = _writers.submit(local_durable.carried(self._write), data)

    def write(self, data: memoryview | bytes) -> None:
        self._caught_up()
        self._write(data)

    def _caught_up(self) -> None:
        """Wait for the write behind, raising its failure."""
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.result()

    def _write(self, data: memoryview | bytes) -> None:
        self._out.write(data)
        self._written += len(data)
        if self._written - self._flushed >= local_durable.FLUSH_EVERY:  # a large file: keep its cache footprint bounded
            self._durable(self._flushed, self._written)
            self._flushed = self._written
        elif not self._started and self._written >= local_durable.WRITE_OUT_FROM and self._syncer is not None:
            # Its write-out started on a helper thread (nothing dropped: ``_durable`` drops at the close)
            self._started = True
            self._out.flush()
            self._syncer.submit(self.path, os.dup(self._out.fileno()), size=0, drop=False)

    def space(self, size: int) -> memoryview | None:
        """``Sink.space``: the file's blocks allocated (``posix_fallocate``: ENOSPC here, where a
        touch of a mapping past a full device would be SIGBUS), then mapped shared. Its mapping
        lasts while the buffer is referenced (the sink keeps none once closed); ``close`` makes
        the file durable (an fsync writes back the pages written through a mapping too)."""
        if not size:
            return None
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)  # a shared writable mapping needs it open for reading too
        try:
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._written = size
        return memoryview(mapped)

    def close(self) -> None:
        try:
            self._caught_up()
            self._durable(self._flushed, None)
        finally:
            self._out.close()

    def abort(self) -> None:
        with contextlib.suppress(BaseException):  # never closed under a write still running
            self._caught_up()
        self._out.close()
        self.path.unlink(missing_ok=True)

    def _durable(self, start: int, end: int | None) -> None:
        self._out.flush()
        drop = self._written >= local_durable.CACHED_UNDER  # a small file stays cached
        if self._syncer is not None:
            self._syncer.submit(self.path, os.dup(self._out.fileno()), start, end, size=(end or self._written) - start,
                                drop=drop)
        else:
            local_durable.make_durable(self._out.fileno(), start, end, drop)


class LocalBatch(Batch):
    """Files of one batch: each file's fsync runs on the syncer's thread while the next file is
    written; every file is durable when ``drain`` returns."""

    def __init__(self, storage: LocalStorage):
        self.storage = storage
        self._syncer = Syncer()

    def create(self, key: str) -> LocalSink:
        return LocalSink(self.storage.root / key, self._syncer)

    def drain(self) -> None:
        self._syncer.drain()

    def __exit__(self, *exc: object) -> None:
        self._syncer.__exit__(*exc)


def _file_size(path: Path) -> int | None:
    """The size of the file at ``path``, None where there is none (as ``Path.is_file``: missing,
    or not a regular file): one look, so a file removed meanwhile (retention under a reader) is
    None, not an error between two looks."""
    try:
        status = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None
