"""The storage interface under the store: a run's files by key, wherever they lie.

The bottom floor of the store (with everything in ``store/storage/``): it imports nothing of
llmtailor but ``errors`` and ``constants``; what it must know from above (what else a local
directory may be) is told to it (``local_detect.recognise_other_formats``).

A key is a relative POSIX path inside the run (``snapshots/step-00000100/manifest.json``).
Everything the store does to bytes goes through a ``Storage``: reading whole files, byte ranges
or pieces, listing, writing files through sinks (in batches), small writes (only if absent, or
replacing), removing. What differs most between a filesystem and an object store beside the
bytes is each a strategy the storage carries (``strategies``): its snapshot ``commits``, its
``locks`` (the writer lock, reader leases) and its run ``detection``, written next to each
backend.

``LocalStorage`` (``local.py``) is the filesystem; ``ObjectStorage`` (``objects.py``) is S3, GCS,
Azure and compatible stores through obstore. ``open_storage`` (``location.py``) picks one from
a path or URL.
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llmtailor.store.storage.strategies import RunDetection, RunLocks, SnapshotCommits

PIECE = 16 << 20
"""Bytes read or written at a time when streaming a file."""


class LazyPool:
    """A pool of ``workers`` threads named ``name``, started at its first use (calling this gives
    it), shut down at exit without waiting; a forked child starts a pool of its own (the
    parent's threads do not exist there) and at its exit shuts down that one only: the parent's,
    copied with the fork, may hold a lock a parent thread held then. Work goes in through ``submit``."""

    def __init__(self, workers: int, name: str):
        self.workers, self.name = workers, name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        os.register_at_fork(after_in_child=self._forget)
        atexit.register(self._shut_down)

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._pool

    def _shut_down(self) -> None:
        """At exit: this process's pool, if it started one."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        """``fn(*args)`` on the pool; here and now once the interpreter takes no more pool work
        (a script that ends without ``close()``: its last save, retention and promotions run on
        threads that outlive that point): the same answer, one request after another."""
        try:
            return self().submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future[Any] = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as error:  # as the pool hands it over: raised by result()
                done.set_exception(error)
            return done

    def _forget(self) -> None:
        self._lock, self._pool = threading.Lock(), None


class Sink(ABC):
    """A file being written: ``write`` its bytes in order, then ``close`` (durable once the
    storage's batch drains; see ``Storage.batch``). ``abort`` drops it: nothing is left that a
    reader could take for the file."""

    @abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...

    def write_stable(self, data: memoryview) -> None:
        """``write`` bytes that the caller leaves as they are until ``close`` or ``abort``
        returns (a staged tensor's memory): a sink may write them on another thread while the
        caller goes on (``close`` returns once they are written; a failure is raised by the
        sink's next call)."""
        self.write(data)

    def space(self, size: int) -> memoryview | None:
        """The file's whole content, ``size`` bytes, as a writable buffer that maps the file:
        what is put into it is the file's content (``close`` makes it durable, as ``write``
        would), its space taken now (a full device fails here, never at a touch of the
        buffer); or None where this sink does not map its file (then ``write`` its bytes).
        Once given, the file is not ``write``-n to."""
        return None


class Batch(ABC):
    """Files written together (a rank's part of a snapshot): ``create`` one sink at a time;
    every file closed in the batch is durable when ``drain`` returns (the context manager drains
    on a clean exit and releases its helpers on any exit)."""

    @abstractmethod
    def create(self, key: str) -> Sink: ...

    @abstractmethod
    def drain(self) -> None: ...

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.drain()


class Storage(ABC):
    """Where a run lives (module docstring). ``root``: how messages name it (a ``Path`` for a
    local directory, the URL for an object store)."""

    root: Path | str
    url: str
    """The location as a URL-or-path string users gave (``runs/exp``, ``s3://bucket/run``)."""
    commits: SnapshotCommits
    """How a snapshot is committed here, and discarded (``strategies``)."""
    locks: RunLocks
    """The writer lock and reader leases here (``strategies``)."""
    detection: RunDetection
    """Whether this location is a run (``strategies``)."""
    reads_in_flight: int | None = None
    """Parts of one range a fetch keeps requested at once (``store.fetch``); None: as many as
    its pool runs (an object store serves ranged requests side by side)."""
    request_bytes: int | None = None
    """Bytes of one request of a large range (``store.fetch.part_bytes``); None: ``fetch.PART``."""

    remote = False
    """Whether each read is a request over the network (an object store): a read then costs a
    round trip whatever its size, so many small ranged reads are slow where a few large ones are
    not, and a distributed restore fetches the byte ranges its ranks need once in the job, in
    large requests (``store.shared_ranges``)."""

    def together(self, *asks: Callable[[], Any]) -> list[Any]:
        """The answers of ``asks`` (small requests that depend on no other's answer: a listing,
        a pointer, a lease's checks), in order. Here one after another; where each request is a
        round trip (an object store) they are asked side by side, so a chain of them waits for
        the slowest, not for their sum. The first failure (in ``asks``' order) is raised, once
        every ask has ended."""
        return [ask() for ask in asks]

    def where(self, key: str) -> str:
        """How a message names the file ``key``."""
        return f"{self.root}/{key}" if key else str(self.root)

    def same_place(self, other: Storage) -> bool:
        """Whether ``other`` is this very location."""
        return type(self) is type(other) and self.identity() == other.identity()

    @abstractmethod
    def identity(self) -> str:
        """A canonical name of the location (a resolved path, a normalised URL)."""

    # -- reading ------------------------------------------------------------------------------

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size of the file ``key`` in bytes, or None when there is none (raises StorageError
        for any other failure)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is a file or holds files (a directory, a prefix)."""

    def is_file(self, key: str) -> bool:
        return self.size(key) is not None

    @abstractmethod
    def read(self, key: str) -> bytearray | bytes:
        """The whole file. A missing file raises IntegrityError ``<where>: file is missing``;
        another failure, IntegrityError naming the file and the reason."""

    @abstractmethod
    def read_range(self, key: str, start: int, length: int) -> memoryview | bytes:
        """``length`` bytes of ``key`` from ``start`` (errors as ``read``; a file shorter than
        the range is IntegrityError ``... (truncated)``)."""

    def read_start(self, key: str, length: int) -> tuple[int | None, memoryview | bytes]:
        """``(size of key, its first min(length, size) bytes)``; ``(None, b"")`` when there is no
        such file (errors as ``read_range``). Here the size, then the bytes; one request where a
        store's ranged read answers the size too (an object store): a file's header and its
        size check, read before its data, cost one round trip, not two or three."""
        size = self.size(key)
        if size is None:
            return None, b""
        return size, self.read_range(key, 0, min(length, size))

    def read_into(self, key: str, start: int, into: memoryview) -> None:
        """Fill ``into`` with the bytes of ``key`` from ``start`` (errors as ``read_range``).
        Called from several threads at once (``store.fetch``), each with its own ``into``."""
        into[:] = self.read_range(key, start, len(into))

    def mapped(self, key: str) -> mmap.mmap | None:
        """The whole bytes of ``key`` as a writable buffer that maps the file rather than copies
        it (a local file: a private mapping, its pages shared with the page cache until written,
        read as they are touched), or None where this storage does not map files (then read
        them: ``read_into``). Only for files nothing truncates while mapped (a committed
        snapshot's). Errors as ``read``."""
        return None

    def pieces(self, key: str, start: int = 0, length: int | None = None) -> Iterator[memoryview | bytes]:
        """The bytes of ``key`` (from ``start``, ``length`` of them or to the end) in pieces of
        at most ``PIECE`` bytes, streamed. A piece may be reused for the next one: use it (hash
        it, write it) before taking the next."""
        total = self.size(key) if length is None else start + length
        if total is None:
            self.read(key)  # raises the missing-file error
            return
        position = start
        while position < total:
            take = min(PIECE, total - position)
            yield self.read_range(key, position, take)
            position += take

    @abstractmethod
    def list_dir(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (files and sub-directories), unsorted; [] when there
        are none."""

    @abstractmethod
    def walk(self, prefix: str) -> Iterator[tuple[str, int]]:
        """``(key, size)`` of every file under ``prefix``."""

    # -- writing ------------------------------------------------------------------------------

    @abstractmethod
    def batch(self) -> Batch:
        """A batch of files to write (``Batch``)."""

    @abstractmethod
    def put(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a small file durably. ``exclusive``: only if no file ``key`` exists (an
        object store's conditional write); else TailorError ``... already exists``. Where a
        put's answer can be lost after the file was stored (an object store: the client's
        retry meets the file), a file found holding exactly ``data`` is this put's own:
        written, a success."""

    @abstractmethod
    def replace(self, key: str, data: bytes) -> None:
        """Replace a small file so a reader sees the old or the new content, never a mix."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """Remove one file; a missing one is no error (nor is a retried removal that meets
        the file gone: its first attempt removed it, and its answer was lost)."""
