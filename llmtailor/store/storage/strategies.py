"""What differs most between a filesystem and an object store, beside the bytes: each a small
strategy a ``Storage`` carries, written next to its backend.

- ``SnapshotCommits`` (``storage.commits``): how a snapshot becomes committed at once, and stops
  being one. A filesystem writes into a private temporary directory and renames it into
  ``snapshots/`` atomically; an object store has no rename, so files go straight to their final
  keys and the manifest, written last and only if absent, is the commit marker (``store.commit``
  writes it the same way on both).
- ``RunLocks`` (``storage.locks``): the writer lock (``flock`` on a filesystem; a lease object
  written conditionally, with its holder, renewed while held, on an object store) and reader
  leases (retention never removes a snapshot a reader holds).
- ``RunDetection`` (``storage.detection``): whether a location is a run, or may become one.
"""

from __future__ import annotations

import errno
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

CANNOT_CREATE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
"""Errors that say a location is one this process may not write to (a run on read-only storage,
or someone else's): its snapshots are read without a lease, and a writer is refused there."""


def this_process() -> str:
    """How a lock names its holder: this process (``pid P on HOST``)."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


# -- the snapshot commit ------------------------------------------------------------------------


@dataclass(frozen=True)
class Leftovers:
    """What ``SnapshotCommits.clear_leftovers`` removed: ``files`` of saves that never committed
    and of snapshots discarded but not yet purged (``noun``: what the storage calls a file), and
    unfinished multipart ``uploads`` aborted."""

    files: int = 0
    uploads: int = 0
    noun: str = "file"


@dataclass(frozen=True)
class Unconfirmed:
    """What a commit could not do, or could not confirm, once its snapshot was committed: visible
    to readers and whole (its files and manifest were durable before it became visible). Returned,
    never raised (``SnapshotCommits.commit``): the save is committed, and undoing it is not sound
    (a reader may hold the snapshot already; the undo would be made durable through the very
    directory whose fsync just failed)."""

    durable: OSError | None = None
    """The snapshot's name was not confirmed durable (locally: the fsync of ``snapshots/`` after
    its rename failed): a crash of the machine before the storage writes it out may lose the
    snapshot and bring back the composite before it, whole."""
    pointer: OSError | None = None
    """The run's ``latest`` was not replaced: it names what it named before. ``pointer is durable``:
    left so on purpose (a pointer names a snapshot only once its rename is durable)."""
    pointer_durable: OSError | None = None
    """``latest`` was replaced, but that was not confirmed durable (the fsync of its directory
    failed): a crash of the machine may bring back the pointer before it."""


class SnapshotCommits(ABC):
    """How snapshots are committed and discarded in one storage (module docstring)."""

    @abstractmethod
    def begin(self, name: str, final: str, world_size: int) -> str:
        """A staging prefix for the snapshot that will be ``final`` (``snapshots/<name>``),
        ready to be written into by every rank. Raises TailorError when ``final`` is committed
        already."""

    def key(self, staging: str, relpath: str) -> str:
        """The key a file of the snapshot being written at ``staging`` has."""
        return f"{staging}/{relpath}"

    @abstractmethod
    def commit(self, staging: str, final: str, manifest: bytes, pointer: tuple[str, bytes] | None = None,
               pending: Callable[[], None] | None = None, parent: int | None = None,
               publish: Callable[[], None] | None = None) -> Unconfirmed | None:
        """Write ``manifest`` as the snapshot's ``MANIFEST_FILE`` at ``staging``, last and only
        if absent (TailorError if there is one), and make the snapshot written there committed
        at ``final``, durably. Every other file staged is durable already, or once ``pending()``
        returns (files still in flight: it raises if one failed); nothing is committed before it
        has returned. ``pointer`` ``(key, data)``: then replace the file ``key`` with ``data``
        atomically and durably (the run's ``latest``), only once the snapshot is committed
        durably. A failure raised means nothing was committed; once the snapshot is visible,
        what fails (the pointer's replacement, the durability of either name) is returned as
        ``Unconfirmed``, the snapshot committed all the same. ``parent``: the step of the
        snapshot's parent, when no snapshot of the run is being committed meanwhile (a storage
        may make the pointer durable beside the commit when that parent is the run's newest
        snapshot: ``LocalCommits``). ``publish``: called once everything but the publishing step
        is done and durable, just before that step (the rename; on an object store, the
        manifest's write): what it raises fails the commit with nothing published (a node's
        gate, ``node_commit._gate``)."""

    def doubtful(self) -> frozenset[str]:
        """The committed snapshots (their keys, as ``commit``'s ``final``) whose names this
        storage's commits could not confirm durable (``Unconfirmed.durable``) and that are still
        there: a crash of the machine may lose them, so retention keeps a composite that needs
        none of them (``store.retention``). None by default (a storage whose commit is durable
        once it returns)."""
        return frozenset()

    @abstractmethod
    def abandon(self, staging: str) -> None:
        """Remove what a failed save wrote at ``staging`` (never a committed snapshot)."""

    @abstractmethod
    def discard(self, snapshot: str) -> str:
        """Make the committed snapshot at ``snapshot`` not a snapshot any more, at once (the
        caller holds its removal lease and the writer lock); returns a token for ``purge`` to
        remove its files. Durably by the time ``purge`` removes anything (locally, the fsync of
        the directory it left is ``purge``'s first step): a crash before brings it back whole."""

    @abstractmethod
    def purge(self, token: str) -> None:
        """Remove the files of a discarded snapshot; raises StorageError on failure (the next
        writer retries)."""

    def purge_later(self, token: str) -> None:
        """``purge``, where the storage can, on a background thread, so that the writer's save
        does not wait for it (failures logged; ``wait_purged`` waits for it). Nothing is lost
        if the process dies first: the token's files are leftovers the next writer clears.
        By default, ``purge`` now (StorageError on failure)."""
        self.purge(token)

    def wait_purged(self) -> None:
        """Return once every ``purge_later`` of this storage's run is done; called before the
        writer lock is let go, so that the next holder's ``clear_leftovers`` never races one."""

    def settle(self) -> None:
        """Before the writer lock is let go: settle, where the storage can now, the commits this
        process left unsettled (``ObjectCommits``: a manifest whose write may still be stored),
        so that the next holder's ``clear_leftovers`` never removes the files of a snapshot whose
        manifest lands after it. Failures are logged, never raised."""

    @abstractmethod
    def clear_leftovers(self) -> Leftovers:
        """Remove what crashed writers left (temporary snapshots, discarded ones, unfinished
        uploads) and say what that was; called by the holder of the writer lock."""


# -- locks and leases ---------------------------------------------------------------------------


class Lease(ABC):
    """A lease on one snapshot (``RunLocks.lease_for_reading`` / ``lease_for_removal``), held
    until ``release``. ``held`` is False for a snapshot read unprotected (storage the reader may
    not write to)."""

    held: bool = True
    marker: bytes | None = None
    """The snapshot's manifest as the lease read it once written, where it reads it to find the
    snapshot committed (an object store: a GET in place of a HEAD, so its reader need not ask for
    it again); None where it only looked."""

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

    def forsake(self) -> None:
        """In a forked child, which holds none of its parent's locks: let go of what the fork
        copied of this hold (a descriptor), leaving the lock to the parent; nothing asked of the
        storage (``store.lock._forked``)."""

    def check_held(self) -> None:
        """Raise TailorError if the lock was lost since it was taken (an object-store lease
        another writer took over); a commit checks this before its manifest is written."""

    @abstractmethod
    def holder_if_other(self) -> str | None:
        """The holder's description when a writer other than this process holds the lock now,
        else None; takes nothing."""


class RunLocks(ABC):
    """The writer lock and the reader leases of one storage (module docstring)."""

    checks_committed: bool = False
    """Whether ``lease_for_reading`` finds by itself a snapshot that is not committed (its
    manifest read once the lease is written: ``Lease.marker``), so its caller need not look
    first, nor read it after (on an object store, each a round trip of its own)."""

    @abstractmethod
    def writer(self) -> WriterLockBackend:
        """The run's writer lock, not taken yet."""

    @abstractmethod
    def lease_for_reading(self, snapshot: str, *, marker: bool = False) -> Lease | None:
        """A shared lease on the committed snapshot at ``snapshot``, or None when it is gone
        (or being removed). ``marker``: the caller will read the snapshot's manifest, so a lease
        that checks it is committed (``checks_committed``) reads it for it (``Lease.marker``)."""

    @abstractmethod
    def lease_for_removal(self, snapshot: str) -> Lease | None:
        """An exclusive lease, taken without waiting; None while a reader holds one."""

    def confirm_writer(self) -> None:
        """Raise TailorError where this process's writer lock of the run was lost (an object
        store's lease another writer took over while this process was paused past it:
        ``object_lock``); a commit asks before each file it stages and before its manifest's
        write. A lock that cannot be lost while its holder lives (``flock``): nothing to ask."""


# -- what a location is -------------------------------------------------------------------------


class RunDetection(ABC):
    """Whether a storage's location is a run (module docstring)."""

    @abstractmethod
    def describe_non_run(self) -> str | None:
        """Why this location is not an llmtailor run, or None when it is one."""

    @abstractmethod
    def is_fresh(self) -> bool:
        """Whether this location is missing or empty (a writer may make a run of it)."""
