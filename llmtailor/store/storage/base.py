"""The storage interface under the store: a run's files by key, wherever they lie.

A key is a relative POSIX path inside the run (``snapshots/step-00000100/manifest.json``).
Everything the store does to bytes goes through a ``Storage``: reading whole files or byte
ranges, writing files through sinks, listing, removing, and the three things that differ most
between a filesystem and an object store, each behind one method:

- **commit** (``begin_snapshot`` / ``commit_snapshot``): a filesystem writes into a private
  temporary directory and renames it into ``snapshots/`` atomically; an object store has no
  rename, so files go straight to their final keys and the manifest, written last and only if
  absent, is the commit marker (``store.writer`` writes it the same way on both);
- **the writer lock** (``writer_lock``): ``flock`` on a filesystem; a lease object written
  conditionally, with its holder, renewed while held, on an object store;
- **reader leases** (``lease_for_reading`` / ``lease_for_removal``): retention never removes a
  snapshot a reader holds.

``LocalStorage`` (``storage/local.py``) is the filesystem; ``ObjectStorage``
(``storage/objects.py``) is S3, GCS, Azure and compatible stores through obstore.
``open_storage`` picks one from a path or URL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PIECE = 16 << 20
"""Bytes read or written at a time when streaming a file."""

URL_SCHEMES = ("s3", "gs", "az", "abfs", "abfss", "memory")
"""Schemes of object stores (``file://`` is the local filesystem)."""


def is_url(location: str | Path) -> bool:
    """Whether ``location`` names an object store (``s3://...``) or a ``file://`` URL rather
    than a plain local path."""
    text = str(location)
    return "://" in text and text.split("://", 1)[0].lower() in (*URL_SCHEMES, "file")


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


class Lease(ABC):
    """A lease on one snapshot (``lease_for_reading`` / ``lease_for_removal``), held until
    ``release``. ``held`` is False for a snapshot read unprotected (storage the reader may not
    write to)."""

    held: bool = True

    @abstractmethod
    def release(self) -> None: ...


class WriterLockBackend(ABC):
    """One process's hold on a run's writer lock (``store.lock.WriterLock`` shares it between
    the Tailors of a process). ``take`` raises TailorError naming the holder when another
    writer holds it."""

    @abstractmethod
    def take(self) -> None: ...

    @abstractmethod
    def release(self) -> None: ...

    def abandon(self) -> None:
        """``release`` for a writer whose start failed: also remove what ``take`` created, so
        the location is left as it was found (an object store's lease object goes anyway)."""
        self.release()

    def check_held(self) -> None:
        """Raise TailorError if the lock was lost since it was taken (an object-store lease
        another writer took over); a commit checks this before its manifest is written."""

    @abstractmethod
    def holder_if_other(self) -> str | None:
        """The holder's description when a writer other than this process holds the lock now,
        else None; takes nothing."""


@dataclass(frozen=True)
class Leftovers:
    """What ``Storage.clear_leftovers`` removed: ``files`` of saves that never committed and
    of snapshots discarded but not yet purged (``noun``: what the storage calls a file), and
    unfinished multipart ``uploads`` aborted."""

    files: int = 0
    uploads: int = 0
    noun: str = "file"


class Storage(ABC):
    """Where a run lives (module docstring). ``root``: how messages name it (a ``Path`` for a
    local directory, the URL for an object store)."""

    root: Path | str
    url: str
    """The location as a URL-or-path string users gave (``runs/exp``, ``s3://bucket/run``)."""

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

    @abstractmethod
    def is_file(self, key: str) -> bool: ...

    @abstractmethod
    def read(self, key: str) -> bytearray | bytes:
        """The whole file. A missing file raises IntegrityError ``<where>: file is missing``;
        another failure, IntegrityError naming the file and the reason."""

    @abstractmethod
    def read_range(self, key: str, start: int, length: int) -> memoryview | bytes:
        """``length`` bytes of ``key`` from ``start`` (errors as ``read``; a file shorter than
        the range is IntegrityError ``... (truncated)``)."""

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

    @abstractmethod
    def remove_tree(self, prefix: str) -> None:
        """Remove every file under ``prefix``; failures are left for the next attempt."""

    # -- the snapshot commit ------------------------------------------------------------------

    @abstractmethod
    def begin_snapshot(self, name: str, final: str, world_size: int) -> str:
        """A staging prefix for the snapshot that will be ``final`` (``snapshots/<name>``),
        ready to be written into by every rank. Raises TailorError when ``final`` is committed
        already."""

    @abstractmethod
    def commit_snapshot(self, staging: str, final: str) -> None:
        """Make the snapshot written at ``staging`` (its manifest written last) committed at
        ``final``, durably."""

    @abstractmethod
    def abandon_snapshot(self, staging: str) -> None:
        """Remove what a failed save wrote at ``staging`` (never a committed snapshot)."""

    @abstractmethod
    def staging_key(self, staging: str, relpath: str) -> str:
        """The key a file of the snapshot being written at ``staging`` has."""

    # -- locks and retention ------------------------------------------------------------------

    @abstractmethod
    def writer_lock(self) -> WriterLockBackend: ...

    @abstractmethod
    def lease_for_reading(self, snapshot: str) -> Lease | None:
        """A shared lease on the committed snapshot at ``snapshot``, or None when it is gone
        (or being removed)."""

    @abstractmethod
    def lease_for_removal(self, snapshot: str) -> Lease | None:
        """An exclusive lease, taken without waiting; None while a reader holds one."""

    @abstractmethod
    def discard_snapshot(self, snapshot: str) -> str:
        """Make the committed snapshot at ``snapshot`` not a snapshot any more, at once and
        durably (the caller holds its removal lease and the writer lock); returns a token for
        ``purge`` to remove its files."""

    @abstractmethod
    def purge(self, token: str) -> None:
        """Remove the files of a discarded snapshot; raises StorageError on failure (the next
        writer retries)."""

    @abstractmethod
    def clear_leftovers(self) -> Leftovers:
        """Remove what crashed writers left (temporary snapshots, discarded ones, unfinished
        uploads) and say what that was; called by the holder of the writer lock."""

    @abstractmethod
    def describe_non_run(self) -> str | None:
        """Why this location is not an llmtailor run, or None when it is one."""

    @abstractmethod
    def is_fresh(self) -> bool:
        """Whether this location is missing or empty (a writer may make a run of it)."""


def open_storage(location: str | Path | Storage, options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of ``location``: a local path or ``file://`` URL (``LocalStorage``), or an
    object-store URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory://``:
    ``ObjectStorage``, configured by ``options`` and the environment, as obstore and each
    cloud's tools configure themselves). A ``Storage`` is returned as it is."""
    if isinstance(location, Storage):
        return location
    text = str(location)
    if is_url(text) and not text.lower().startswith("file://"):
        from llmtailor.store.storage.objects import ObjectStorage

        return ObjectStorage(text, options)
    from llmtailor.store.storage.local import LocalStorage

    if options:
        from llmtailor.errors import ConfigError

        raise ConfigError(f"storage options {sorted(options)} were given for {text}, a local path; "
                          "they apply to object-store URLs (s3://, gs://, az://)")
    if text.lower().startswith("file://"):
        text = text[len("file://"):]
    return LocalStorage(Path(text))


__all__ = ["Batch", "Lease", "Leftovers", "PIECE", "Sink", "Storage", "WriterLockBackend", "is_url", "open_storage"]

