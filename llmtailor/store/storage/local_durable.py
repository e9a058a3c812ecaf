"""Durable local file I/O: fsync (on a helper thread while the next file is written), atomic
replacement, streamed reads of an open file, and removing what a failed operation created.

Part of the storage floor: imports nothing of llmtailor but ``errors``.
"""

from __future__ import annotations

import collections
import mmap
import os
import queue
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from llmtailor.errors import IntegrityError
from llmtailor.store.storage.base import PIECE

FLUSH_EVERY = 256 << 20
"""A file larger than this is made durable and dropped from the page cache as it is written:
growing the cache by gigabytes is what a large write spends its time on (bench/RESULTS.md)."""

WRITE_OUT_FROM = 2 << 20
"""A file being written is handed to its batch's syncer once it holds this many bytes (its
fsync, on a helper thread, starts the disk on what is written so far), again every
``FLUSH_EVERY`` bytes, and at its close: a small save's pack is written out while its last MiBs
are written and the rest of the save is done, not all after its last byte (bench/RESULTS.md,
issue 33, session 48)."""

CACHED_UNDER = 16 << 20
"""A written file smaller than this stays in the page cache once durable (``LocalSink``): a
rank's small files of a save (its last pack of small units, its global state, the unit indexes)
cost the cache about one small unit's bytes at most (``constants.PACK_UNIT_BYTES``), and the
next restore on this machine (after a process crash; a small model's or adapter's) reads them
without waiting on the disk, as it reads a Trainer checkpoint (bench/RESULTS.md, issue 33,
session 45). Larger files are dropped (``make_durable``)."""


def _nothing() -> None:
    pass


def _as_is(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


_durable_one: Callable[[], None] = _nothing
"""Called each time a file (or a range of one) was made durable (``report_progress``)."""
_carried: Callable[[Callable[..., Any]], Callable[..., Any]] = _as_is
"""A function to run on another thread on behalf of the caller's work (``report_progress``)."""
_waiting: Callable[[], AbstractContextManager[Any]] = nullcontext
"""Around each fsync: the calling thread waits on the disk for its work (``report_progress``)."""


def report_progress(to: Callable[[], None], carry: Callable[[Callable[..., Any]], Callable[..., Any]],
                    waiting: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
    """``to()`` once each file, or range of a large one, is made durable, for the work of the
    thread that handed it over (``carry(fn)``: ``fn`` to run on another thread on behalf of the
    calling thread's work), and each fsync under ``waiting()`` (a wait on the disk for that work):
    the store passes the commit coordinator's progress (``distributed.progress.advance``,
    ``carried`` and ``waiting``; this floor imports nothing above it), so a rank whose fsyncs run
    long (a large save, a slow disk; one fsync longer than the timeout) shows the ranks waiting
    for it that it is live (``Coordinator.working``)."""
    global _durable_one, _carried, _waiting
    _durable_one, _carried, _waiting = to, carry, waiting


def carried(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` to run on another thread (a pool's) on behalf of the calling thread's work: the
    progress it reports (``make_durable``) counts for that work (``report_progress``)."""
    return _carried(fn)


@contextmanager
def waited_on_for_work() -> Iterator[None]:
    """``with waited_on_for_work():`` the calling thread waits on the system for its work (a
    disk's fsync or removal of a tree, a remote store's answer through its client's retries):
    shown live meanwhile for a bounded time (``_waiting``), then a piece of work done
    (``_durable_one``). A wait outside it that outlasts the timeout is silence, and the ranks
    waiting for this one call it dead."""
    with _waiting():
        yield
    _durable_one()


def fsync_for_work(fd: int) -> None:
    """fsync ``fd`` for the calling thread's work (``waited_on_for_work``). Every fsync of this
    floor goes through it, a directory's too (a commit's rename made durable)."""
    with waited_on_for_work():
        os.fsync(fd)


def remove_tree_for_work(path: Path, ignore_errors: bool = False) -> None:
    """``shutil.rmtree(path)`` for the calling thread's work (``waited_on_for_work``): a
    snapshot's many files on a slow disk (an abandoned save's, a synchronous purge's) can take
    longer than the timeout."""
    with waited_on_for_work():
        shutil.rmtree(path, ignore_errors=ignore_errors)


def make_durable(fd: int, start: int = 0, end: int | None = None, drop: bool = True,
                 sync: Callable[[int], None] | None = None) -> None:
    """fsync a file, then (``drop``) its bytes ``[start, end)`` (to the end of the file by
    default) dropped from the page cache: they are durable and will not be read soon, so a save's
    cache footprint stays about one unit instead of the whole checkpoint. ``sync``: the fsync,
    for the work that handed it over (``Syncer``: ``carried(fsync_for_work)``)."""
    (fsync_for_work if sync is None else sync)(fd)
    if drop:
        os.posix_fadvise(fd, start, 0 if end is None else end - start, os.POSIX_FADV_DONTNEED)


SYNC_THREADS = 4
"""fsyncs a ``Syncer`` runs at once. The journal of a filesystem commits the fsyncs waiting
together in one transaction (ext4's jbd2: one journal write and one cache flush for all): a
small save's few files made durable side by side cost about one fsync, not one each in turn
(bench/RESULTS.md, issue 33, session 43)."""

FSYNC_THREADS = 2 * SYNC_THREADS
"""Most threads of the process's fsync pool (``_FsyncPool``): two writers side by side (a save
and a promotion to another tier) each run ``SYNC_THREADS`` fsyncs at once."""


FILES_AHEAD = 64
"""Most files a ``Syncer`` takes over before the oldest is durable: each holds its descriptor
until its fsync has run, so a batch of many small files (under ``depth`` bytes) on a lagging disk
held one per file (EMFILE past the soft limit, often 1024)."""


class _FsyncPool:
    """The process's fsync threads, shared by every ``Syncer`` and kept from one to the next: a
    save at every step made four Syncers, which started about eleven threads per save, each
    start waiting for its thread to run (bench/RESULTS.md, issue 32, session 45). A thread is
    started when a file waits and no thread is free, up to ``FSYNC_THREADS``; then it waits for
    the next file for the rest of the process.

    Daemon threads, started by the process's first writes (not an executor, which refuses work
    once the interpreter begins to exit: an async save still in flight when a script ends, one
    that forgot ``close()``, still becomes durable while the interpreter waits for it; and a
    script that ends leaves no thread to join). A forked child starts with a pool of its own."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, int, int | None, bool, Callable[[], None], Future]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._free = 0
        """Threads started; those of them waiting for a file (none taken since it was queued)."""
        self._waiting = 0
        """Files queued, not yet taken by a thread."""

    def put(self, task: tuple[int, int, int | None, bool, Callable[[], None], Future]) -> None:
        with self._lock:
            self._waiting += 1
            grow = self._waiting > self._free and self._threads < FSYNC_THREADS
            if grow:
                self._threads += 1
        if grow:
            try:
                threading.Thread(target=self._work, name="llmtailor-fsync", daemon=True).start()
            except RuntimeError:  # the interpreter is exiting: the threads already started do the work
                with self._lock:
                    self._threads -= 1
                    alone = self._threads == 0
                    self._waiting -= alone
                if alone:
                    raise
        self._queue.put(task)

    def _work(self) -> None:
        while True:
            with self._lock:
                self._free += 1
            fd, start, end, drop, sync, done = self._queue.get()
            with self._lock:
                self._free -= 1
                self._waiting -= 1
            error: BaseException | None = None
            try:
                make_durable(fd, start, end, drop, sync)
            except BaseException as failed:  # handed to the writer, which raises it
                error = failed
            finally:
                try:  # closed before the writer learns the outcome: a drained Syncer holds no descriptor
                    os.close(fd)
                except OSError as failed:
                    error = error or failed
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)


_pool = _FsyncPool()


def _pool_of_the_child() -> None:
    """A forked child's own pool: the parent's threads are not in it, only their count."""
    global _pool
    _pool = _FsyncPool()


os.register_at_fork(after_in_child=_pool_of_the_child)


class Syncer:
    """Makes written files durable on background threads (up to ``threads`` fsyncs at once, on
    the process's fsync threads: ``_FsyncPool``) while the caller writes the next ones: at most
    ``depth`` bytes wait (the dirty page cache stays bounded), and at most ``FILES_AHEAD`` files
    (each holds its descriptor until durable). ``drain()`` returns once every submitted file is durable, or raises
    the first failure (in the order submitted); use it as a context manager so that, on any exit,
    every descriptor it took is closed when it returns."""

    def __init__(self, depth: int = 2 * FLUSH_EVERY, threads: int = SYNC_THREADS):
        self._pending: list[tuple[Path, Future, int]] = []
        self._held: collections.deque[tuple[int, int, int | None, bool, Callable[[], None], Future]] = collections.deque()
        """Files beyond the ``threads`` in the pool, each handed over as one of those ends."""
        self._lock = threading.Lock()
        self._running = 0
        self._depth, self._most = depth, threads

    def submit(self, path: Path, fd: int, start: int = 0, end: int | None = None, size: int = 0,
               drop: bool = True) -> None:
        """Take over ``fd`` (a descriptor of a written file, ``size`` bytes not yet durable):
        fsync it, drop ``[start, end)`` from the page cache (with ``drop``: ``make_durable``),
        close it."""
        done: Future = Future()
        self._pending.append((path, done, size))
        with self._lock:
            self._held.append((fd, start, end, drop, carried(fsync_for_work), done))
        self._hand_over()
        while len(self._pending) > 1 and (len(self._pending) > FILES_AHEAD or sum(p[2] for p in self._pending) > self._depth):
            self._wait_first()

    def _hand_over(self, ended: Future | None = None) -> None:
        """The held files to the pool while fewer than ``threads`` of this Syncer's run there
        (again as each ends: ``ended``, its future's callback)."""
        while True:
            with self._lock:
                if ended is not None:
                    self._running, ended = self._running - 1, None
                if not self._held or self._running >= self._most:
                    return
                task = self._held.popleft()
                self._running += 1
            task[-1].add_done_callback(self._hand_over)
            try:
                _pool.put(task)
            except BaseException as error:  # no thread to run it: the writer raises it
                os.close(task[0])
                task[-1].set_exception(error)

    def drain(self) -> None:
        while self._pending:
            self._wait_first()

    def _wait_first(self) -> None:
        path, future, _ = self._pending.pop(0)
        try:
            future.result()
        except OSError as error:
            raise OSError(error.errno, f"making {path} durable failed: {error.strerror}") from error

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.drain()
        finally:  # what a failure left: the held files closed, those in the pool waited for (they close theirs)
            with self._lock:
                held, self._held = list(self._held), collections.deque()
            for fd, *_, done in held:
                os.close(fd)
                done.cancel()
            # A cancelled future is never "done" for a wait begun after its cancel (only an
            # executor's notified cancel is): waited for, it hung the failed commit for good.
            futures_wait([future for _, future, _ in self._pending if not future.cancelled()])
            self._pending.clear()


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
        fsync_for_work(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync_for_work(fd)
    finally:
        os.close(fd)


def create_file(path: Path, data: bytes) -> None:
    """Write ``data`` as the new file ``path`` (FileExistsError if there is one), not yet
    durable: the caller fsyncs it (``fsync_together``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def fsync_together(paths: list[Path], beside: Callable[[], None] | None = None) -> None:
    """fsync every file or directory of ``paths`` side by side (a ``Syncer``: the journal
    commits them together, ``SYNC_THREADS``); returns once all are durable, raising the first
    failure in the order given. ``beside``: called once they are in flight (waiting for other
    fsyncs under way, say), so that the journal commits those and these together; its failure
    is raised once these have ended. Nothing is dropped from the page cache: what a commit fsyncs
    here (its manifest, its directories) is what the next restore reads first (bench/RESULTS.md,
    issue 33, session 45: dropped, a LoRA restore read its manifests back from the disk)."""
    with Syncer() as syncer:
        for path in paths:
            syncer.submit(path, os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)), drop=False)
        if beside is not None:
            beside()


def fsync_beside(first: Path, second: Path) -> tuple[OSError | None, OSError | None]:
    """fsync the directories ``first`` and ``second`` side by side (one wait on the disk, as
    ``fsync_together``); returns each one's failure, or None: each failure is told apart from
    the first fsync that reports it (a second fsync after a failed one may succeed with the data
    lost), and neither is raised (a commit's names, already visible: ``Unconfirmed``)."""
    failures: list[OSError | None] = []
    with Syncer() as syncer:
        for path in (first, second):
            try:
                syncer.submit(path, os.open(path, os.O_RDONLY | os.O_DIRECTORY), drop=False)
            except OSError as failed:  # not opened: not made durable, said as the fsync's own failure
                failures.append(failed)
                continue
            failures.append(None)
        opened = [i for i, failed in enumerate(failures) if failed is None]
        for i in opened:
            try:
                syncer._wait_first()
            except OSError as failed:
                failures[i] = failed
    return failures[0], failures[1]


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
                fsync_for_work(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def replace_with(new: Path, path: Path, durable: bool = True) -> None:
    """Replace ``path`` with the durable file ``new`` atomically, and (``durable``) make that
    durable (its directory fsynced; else the caller fsyncs it); on a failure ``new`` is removed."""
    try:
        os.replace(new, path)
    except BaseException:
        new.unlink(missing_ok=True)
        raise
    if durable:
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
