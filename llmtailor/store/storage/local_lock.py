"""The locks of a local run: ``flock`` for the one writer, and reader leases on snapshots.

**Writer lock.** An exclusive advisory lock on ``RUN/.lock``. ``flock`` is released by the
kernel when its holder exits, however it exits (SIGKILL included), so a lock can never be
left stale. Holding it also proves that nothing under ``.tmp/`` or ``.trash/`` belongs to a
live writer: the holder clears both. It is taken only in a run directory, or in a missing or
empty directory a writer is about to make one (``RunDetection``): a directory that is
something else (a Trainer ``checkpoint-N/``, a project folder with its own ``.tmp/``) is
refused before anything in it is created or deleted (``store.lock.WriterLock``). A writer
whose start failed ``abandon``s the lock: it removes the lock file and the directories that
taking the lock created, so the location is left as it was found. That is safe because the
holder unlinks the file while it holds the lock, and a taker checks, once its ``flock`` is
granted, that the file it locked is still ``.lock`` (else it locked a file on its way out, and
opens the new one).

**Reader leases.** Every committed snapshot holds a lease file (``LEASE_FILE``, created in the
temporary directory before the commit rename; for a snapshot written before leases existed,
created on first use where the directory is writable). A reader holds ``flock(LOCK_SH)`` on
it while it reads; retention takes ``LOCK_EX | LOCK_NB`` before it moves a snapshot out of
``snapshots/`` and leaves a snapshot in use alone. After taking a shared lease the reader
checks that the lease file it holds is still the one in ``snapshots/`` (same inode): if not,
the snapshot was removed before the lease was taken, and the reader treats it as gone. So a
snapshot is never removed while a lease on it is held, and a reader never reads a snapshot
that is being removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from llmtailor.constants import LOCK_FILE
from llmtailor.errors import StorageError, TailorError, describe_os_error
from llmtailor.store.storage.local_durable import remove_empty
from llmtailor.store.storage.strategies import CANNOT_CREATE, Lease as LeaseBase, RunLocks, WriterLockBackend, this_process

LEASE_FILE = ".readers"
"""The lease file inside each snapshot directory (empty; never listed in a manifest)."""


class FlockLocks(RunLocks):
    """The locks of the local run at ``root`` (module docstring); ``resolve`` gives the path of a
    key checked to lie inside the run (``LocalStorage.path``)."""

    def __init__(self, root: Path, resolve: Callable[[str], Path]):
        self.root, self._resolve = root, resolve

    def writer(self) -> WriterLockBackend:
        return FlockWriter(self.root)

    def lease_for_reading(self, snapshot: str, *, marker: bool = False) -> LeaseBase | None:
        return lease_for_reading(self._resolve(snapshot))

    def lease_for_removal(self, snapshot: str) -> LeaseBase | None:
        return lease_for_removal(self.root / snapshot)


class FlockWriter(WriterLockBackend):
    """The writer lock of a local run: ``flock(LOCK_EX)`` on ``RUN/.lock`` (module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self._handle = None
        self._made_file = False
        """Whether ``take`` created the lock file."""
        self._made_dirs: list[Path] = []
        """The directories ``take`` created, innermost first."""

    def take(self) -> None:
        made: list[Path] = []
        try:
            made = [p for p in (self.root, *self.root.parents) if not p.exists()]
            self.root.mkdir(parents=True, exist_ok=True)
            self._handle, self._made_file = _locked_file(self.root)
        except BaseException as err:
            remove_empty(made)  # a take that failed leaves no directory of its own
            if isinstance(err, OSError) and not isinstance(err, StorageError):
                raise StorageError(f"cannot write to the run: {describe_os_error(err, self.root)}", err) from None
            raise
        self._made_dirs = made
        try:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write(this_process() + "\n")
            self._handle.flush()
        except OSError as err:
            self.abandon()
            raise StorageError(f"cannot write to the run: {describe_os_error(err, self.root / LOCK_FILE)}", err) from None

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor releases the flock
            self._handle = None

    def forsake(self) -> None:
        self.release()  # the child's copy of the descriptor: the parent's still holds the flock

    def abandon(self) -> None:
        if self._handle is not None and self._made_file:
            (self.root / LOCK_FILE).unlink(missing_ok=True)  # while held: a taker that opened it meanwhile sees it gone
        self.release()
        remove_empty(self._made_dirs)
        self._made_file, self._made_dirs = False, []

    def holder_if_other(self) -> str | None:
        try:
            fd = os.open(self.root / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return None  # no lock file (a new run), or not readable: the first save will tell
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts only with a writer's LOCK_EX
            except BlockingIOError:
                with os.fdopen(os.dup(fd), encoding="utf-8") as handle:
                    return handle.read().strip() or "unknown process"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


_TAKE_ATTEMPTS = 20
"""Tries at locking ``.lock`` while holders abandon it under the taker (each try, one did)."""


def _locked_file(root: Path) -> tuple[IO[str], bool]:
    """``root/.lock`` opened (created if missing) and locked exclusively, and whether this
    created it; TailorError naming the holder when another writer holds it. The file locked is
    the one at ``.lock`` once the lock is granted (module docstring)."""
    path = root / LOCK_FILE
    for _ in range(_TAKE_ATTEMPTS):
        try:
            handle, created = open(path, "x+", encoding="utf-8"), True
        except FileExistsError:
            handle, created = open(path, "a+", encoding="utf-8"), False
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown process"
            handle.close()
            raise TailorError(f"{root} is being written by another writer ({holder}); a run has one writer at a time") from None
        except BaseException:
            handle.close()
            raise
        if _still_in_place(handle.fileno(), path):
            return handle, created
        handle.close()  # a holder abandoning it unlinked it under us: lock the file at .lock now
    raise StorageError(f"{path}: replaced {_TAKE_ATTEMPTS} times while being locked; try again")


class Lease(LeaseBase):
    """A lease on one snapshot (module docstring), held until ``release``. ``held`` is False
    for a snapshot that cannot be leased (its directory is not writable and holds no lease
    file): it is read unprotected."""

    def __init__(self, fd: int | None):
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def lease_for_reading(directory: Path) -> Lease | None:
    """A shared lease on the snapshot in ``directory``, or None when the snapshot is no longer
    there (removed, or being removed: this waits the moment retention holds it)."""

    def shared(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:  # a filesystem without flock: read unprotected, as before leases
            return True
        return _still_in_place(fd, directory / LEASE_FILE)

    return _leased(directory, shared)


def lease_for_removal(directory: Path) -> Lease | None:
    """An exclusive lease on the snapshot in ``directory``, taken without waiting; None while
    a reader holds it (or when the snapshot is gone already)."""

    def exclusive(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:  # a filesystem without flock: no reader can hold a lease either
            pass
        return True

    return _leased(directory, exclusive)


def _leased(directory: Path, take: Callable[[int], bool]) -> Lease | None:
    """A lease on ``directory``'s lease file once ``take(fd)`` says it holds it; None when
    ``take`` does not or the snapshot is gone; an unprotected lease where no lease file can be
    made."""
    fd = _open_lease(directory)
    if fd is _GONE:
        return None
    if fd is None:
        return Lease(None)
    try:
        taken = take(fd)
    except BaseException:
        os.close(fd)
        raise
    if not taken:
        os.close(fd)
        return None
    return Lease(fd)


_GONE = -1


def _open_lease(directory: Path) -> int | None:
    """A descriptor of ``directory``'s lease file, created if missing; None when it cannot be
    created; ``_GONE`` when the directory itself is not there."""
    path = directory / LEASE_FILE
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        pass
    except OSError as err:
        if err.errno == errno.ENOTDIR:
            return _GONE
        if err.errno in CANNOT_CREATE or err.errno == errno.ELOOP:
            return None
        raise StorageError(describe_os_error(err, path), err) from None
    try:
        return os.open(path, flags | os.O_CREAT, 0o644)
    except (FileNotFoundError, NotADirectoryError):
        return _GONE
    except OSError as err:
        if err.errno in CANNOT_CREATE or err.errno == errno.ELOOP:
            return None
        raise StorageError(describe_os_error(err, path), err) from None


def _still_in_place(fd: int, path: Path) -> bool:
    """Whether the file open at ``fd`` is still the one at ``path``."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
