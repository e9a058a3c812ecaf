"""Durable local file I/O: fsync (on a helper thread while the next file is written), atomic
replacement, streamed reads of an open file, and removing what a failed operation created.

Part of the storage floor: imports nothing of llmtailor but ``errors``.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from llmtailor.errors import IntegrityError
from llmtailor.store.storage.base import PIECE

FLUSH_EVERY = 256 << 20
"""A file larger than this is made durable and dropped from the page cache as it is written:
growing the cache by gigabytes is what a large write spends its time on (bench/RESULTS.md)."""

CACHED_UNDER = 16 << 20
"""A written file smaller than this stays in the page cache once durable (``LocalSink``): a
rank's small files of a save (its last pack of small units, its global state, the unit indexes)
cost the cache about one small unit's bytes at most (``constants.PACK_UNIT_BYTES``), and the
next restore on this machine (after a process crash; a small model's or adapter's) reads them
without waiting on the disk, as it reads a Trainer checkpoint (bench/RESULTS.md, issue 33,
session 45). Larger files are dropped (``make_durable``)."""


def make_durable(fd: int, start: int = 0, end: int | None = None, drop: bool = True) -> None:
    """fsync a file, then (``drop``) its bytes ``[start, end)`` (to the end of the file by
    default) dropped from the page cache: they are durable and will not be read soon, so a save's
    cache footprint stays about one unit instead of the whole checkpoint."""
    os.fsync(fd)
    if drop:
        os.posix_fadvise(fd, start, 0 if end is None else end - start, os.POSIX_FADV_DONTNEED)


SYNC_THREADS = 4
"""fsyncs a ``Syncer`` runs at once. The journal of a filesystem commits the fsyncs waiting
together in one transaction (ext4's jbd2: one journal write and one cache flush for all): a
small save's few files made durable side by side cost about one fsync, not one each in turn
(bench/RESULTS.md, issue 33, session 43)."""


class Syncer:
    """Makes written files durable on background threads (up to ``threads`` fsyncs at once)
    while the caller writes the next ones: at most ``depth`` bytes wait (the dirty page cache
    stays bounded; many small files queue up without holding the writer back).
    ``drain()`` returns once every submitted file is durable, or raises the first failure (in
    the order submitted); use it as a context manager so its threads and descriptors are
    released on any exit.

    Its own threads, not a ``ThreadPoolExecutor``: an executor refuses new work once the
    interpreter begins to exit, and an async save still in flight when a script ends (one that
    forgot ``close()``) must still become durable while the interpreter waits for it."""

    def __init__(self, depth: int = 2 * FLUSH_EVERY, threads: int = SYNC_THREADS):
        self._queue: queue.SimpleQueue[tuple[int, int, int | None, bool, Future] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        """One started now, the others as files come, one per file up to ``threads``."""
        self._pending: list[tuple[Path, Future, int]] = []
        self._depth, self._most = depth, threads
        self._start()

    def _start(self) -> None:
        thread = threading.Thread(target=self._work, name="llmtailor-fsync", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # the interpreter is exiting: the threads already started do the work
            if not self._threads:
                raise
            self._most = len(self._threads)
            return
        self._threads.append(thread)

    def submit(self, path: Path, fd: int, start: int = 0, end: int | None = None, size: int = 0,
               drop: bool = True) -> None:
        """Take over ``fd`` (a descriptor of a written file, ``size`` bytes not yet durable):
        fsync it, drop ``[start, end)`` from the page cache (with ``drop``: ``make_durable``),
        close it."""
        done: Future = Future()
        if len(self._threads) < min(self._most, len(self._pending) + 1):  # another file waits: another thread
            self._start()
        self._queue.put((fd, start, end, drop, done))
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
            fd, start, end, drop, done = task
            try:
                make_durable(fd, start, end, drop)
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
            for _ in self._threads:  # descriptors still queued are closed by the threads first
                self._queue.put(None)
            for thread in self._threads:
                thread.join()


def read_pieces(handle, where: Path | str, start: int, end: int, what: str = "the data") -> Iterator[memoryview]:
    """Bytes ``start`` to ``end`` of the open file ``handle``, in pieces of at most 16 MiB read
    into one reused buffer (a piece is valid until the next is taken). IntegrityError naming
    ``where`` when the file is shorter than ``what`` it should hold."""
    if os.fstat(handle.fileno()).st_size < end:
        raise IntegrityError(f"{where}: shorter than {what} it should hold (truncated)")
    buffer = memoryview(mmap.mmap(-1, min(PIECE, end - start)) if end > start else bytearray())
    handle.seek(start)
    position = start
    while position < end:
        got = handle.readinto(buffer[: min(len(buffer), end - position)])
        if not got:
            raise IntegrityError(f"{where}: ended while reading {what} (truncated)")
        position += got
        yield buffer[:got]


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_file(path: Path, data: bytes) -> None:
    """Write ``data`` as the new file ``path`` (FileExistsError if there is one), not yet
    durable: the caller fsyncs it (``fsync_together``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def fsync_together(paths: list[Path]) -> None:
    """fsync every file or directory of ``paths`` side by side (a ``Syncer``: the journal
    commits them together, ``SYNC_THREADS``); returns once all are durable, raising the first
    failure in the order given. Nothing is dropped from the page cache: what a commit fsyncs
    here (its manifest, its directories) is what the next restore reads first (bench/RESULTS.md,
    issue 33, session 45: dropped, a LoRA restore read its manifests back from the disk)."""
    with Syncer() as syncer:
        for path in paths:
            syncer.submit(path, os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)), drop=False)


def replace_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a mix."""
    replace_bytes_atomically(path, text.encode("utf-8"))


def replace_bytes_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new content, never a mix."""
    replace_with(create_replacement(path, data, durable=True), path)


def create_replacement(path: Path, data: bytes, durable: bool = False) -> Path:
    """The new file that will replace ``path`` (``replace_with``), holding ``data``; durable
    when it returns with ``durable``, else the caller fsyncs it. On a failure nothing is left
    (a full disk must not also leave a stray temporary file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def replace_with(new: Path, path: Path) -> None:
    """Replace ``path`` with the durable file ``new`` atomically, and make that durable (its
    directory fsynced); on a failure ``new`` is removed."""
    try:
        os.replace(new, path)
    except BaseException:
        new.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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
