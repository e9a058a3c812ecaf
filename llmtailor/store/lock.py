"""Locks of a run: one writer per run, and reader leases on snapshots.

``WriterLock`` is the rule (one writer per run, shared by the Tailors of one process, leftovers
of crashed writers cleared by the holder); each storage brings its mechanism
(``Storage.writer_lock``, ``Storage.lease_for_reading``). What follows is the local
filesystem's; an object store's is in ``store.storage.objects``.

**Writer lock.** An exclusive advisory lock on ``RUN/.lock``. ``flock`` is released by the
kernel when its holder exits, however it exits (SIGKILL included), so a lock can never be
left stale. Holding it also proves that nothing under ``.tmp/`` or ``.trash/`` belongs to a
live writer: the holder clears both. It is taken only in a run directory, or in a missing or
empty directory a writer is about to make one (``describe_non_run``): a directory that is
something else (a Trainer ``checkpoint-N/``, a project folder with its own ``.tmp/``) is
refused before anything in it is created or deleted. A writer whose start failed ``abandon``s
the lock: it removes the lock file and the directories that taking the lock created, so the
location is left as it was found. That is safe because the holder unlinks the file while it
holds the lock, and a taker checks, once its ``flock`` is granted, that the file it locked is
still ``.lock`` (else it locked a file on its way out, and opens the new one).

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
import socket
from pathlib import Path
from typing import IO, TYPE_CHECKING

from llmtailor.constants import LATEST_FILE, LOCK_FILE, SNAPSHOTS_DIR
from llmtailor.errors import StorageError, TailorError, describe_os_error
from llmtailor.store.storage.local_durable import remove_empty
from llmtailor.store.storage.base import Lease as LeaseBase, Leftovers, WriterLockBackend

if TYPE_CHECKING:
    from llmtailor.store.storage.base import Storage

LEASE_FILE = ".readers"
"""The lease file inside each snapshot directory (empty; never listed in a manifest)."""

# Where these errors come from, the directory is one we may not write to (a run on read-only
# storage, or someone else's): its snapshots are read without a lease.
_CANNOT_CREATE = {errno.EACCES, errno.EPERM, errno.EROFS}


def describe_non_run(path: Path) -> str | None:
    """Why ``path`` is not an llmtailor run directory, or None when it is one: a directory
    holding ``snapshots/``, ``latest`` or ``.lock`` (what a writer leaves)."""
    try:
        if not path.exists():
            return f"{path}: no such run directory"
        if not path.is_dir():
            return f"{path}: is a file, not a run directory"
        if any((path / name).exists() for name in (SNAPSHOTS_DIR, LATEST_FILE, LOCK_FILE)):
            return None
        kind = _foreign_kind(path)
    except OSError as err:
        return describe_os_error(err, path)
    if kind:
        return f"{path}: is {kind}, not an llmtailor run"
    return f"{path}: not an llmtailor run directory (no {SNAPSHOTS_DIR}/ in it)"


def _foreign_kind(path: Path) -> str | None:
    # The interop modules that only know file names (they import nothing but errors).
    from llmtailor.interop.deepspeed.files import is_deepspeed_checkpoint
    from llmtailor.interop.hf.files import CONFIG_FILE, TRAINER_STATE_FILE

    if (path / TRAINER_STATE_FILE).is_file():
        return (f"a Hugging Face Trainer checkpoint ({TRAINER_STATE_FILE}; import it with `llmtailor import-hf` to "
                f"inspect, verify or assemble it, or name it as a source of a `llmtailor merge` plan)")
    if is_deepspeed_checkpoint(path):
        return ("a DeepSpeed checkpoint (import it with `llmtailor import-deepspeed` to inspect, verify or assemble "
                "it, or name it as a source of a `llmtailor merge` plan)")
    if (path / CONFIG_FILE).is_file() and any(path.glob("*.safetensors")):
        return "a model directory (config.json and safetensors weights; a source for a `llmtailor merge` plan)"
    return None


class WriterLock:
    """Exclusive write access to a run, held until ``release`` or process exit. The run is a
    local directory (``flock``, module docstring) or an object-store URL (a lease object:
    ``store.storage.objects``); ``root`` is a path, a URL or a ``Storage``.

    ``new_run=True`` (a writer): the location may also be missing or empty, and becomes a
    run. ``new_run=False`` (gc): it must already be a run."""

    def __init__(self, root: Path | str | Storage, *, new_run: bool = True, storage_options: dict | None = None):
        from llmtailor.store.storage import open_storage

        self.storage = open_storage(root, storage_options)
        self.root = self.storage.root
        self.new_run = new_run
        self._backend: WriterLockBackend | None = None
        self.cleared = Leftovers()
        """What this lock's ``acquire`` cleared of crashed writers' leftovers."""

    @property
    def held(self) -> bool:
        return self._backend is not None

    def acquire(self) -> None:
        """Take the lock or raise TailorError naming the holder (or saying why the location
        is not a run); then clear what crashed writers left behind.

        Within one process the lock is shared: a second ``Tailor`` of the same run (one that
        saved, another that restores) holds it too, and only the first clears leftovers (the
        other's save may be in flight). Between processes it is exclusive."""
        if self.held:
            return
        key = self._key()
        if key in _HELD:
            _HELD[key][1] += 1
            self._backend = _HELD[key][0]
            return
        self._refuse_non_run()
        backend = self.storage.writer_lock()
        backend.take()
        self._backend = backend
        _HELD[key] = [backend, 1, None]
        self.cleared = self.storage.clear_leftovers()

    def claim(self) -> None:
        """``acquire``, and be the one writer of this process's share of the lock: another
        holder of it in this process that writes (a second Tailor saving to the run) is
        refused until this one releases."""
        self.acquire()
        held = _HELD.get(self._key())
        if held is None:  # not shared (acquired before the registry knew it): exclusive anyway
            return
        if held[2] not in (None, id(self)):
            raise TailorError(
                f"{self.root} is being written by another writer ({_holder()}, another Tailor of this process); "
                "a run has one writer at a time"
            )
        held[2] = id(self)

    def check_held(self) -> None:
        """Raise TailorError if the lock was lost since it was taken (an object-store lease
        another writer took over after this one failed to renew it)."""
        if self._backend is not None:
            self._backend.check_held()

    def acquire_or_look(self) -> None:
        """``acquire`` where the run can be written; where it cannot (a read-only copy), only
        refuse a run another process holds: restoring from it still works, saving will fail
        then, naming why."""
        try:
            self.acquire()
        except StorageError as err:
            if err.errno not in _CANNOT_CREATE:
                raise
            self.refuse_if_held()

    def refuse_if_held(self) -> None:
        """Raise TailorError naming the holder when another process holds the lock now; take
        nothing (a reader may only read the run, even a read-only one). A writer calls it when
        it is built, so a second trainer fails before it trains; ``acquire`` at its first save
        still decides a race between two that both looked."""
        holder = self.storage.writer_lock().holder_if_other()
        if holder is not None and holder != _holder():  # this very process (another Tailor of it) may hold it
            raise TailorError(f"{self.root} is being written by another writer ({holder}); a run has one writer at a time")

    def _refuse_non_run(self) -> None:
        why = self.storage.describe_non_run()
        if why is None:
            return
        if self.new_run and self.storage.is_fresh():
            return
        raise TailorError(f"{why}; refusing to {'write into' if self.new_run else 'clean'} it")

    def _key(self) -> str:
        return f"{type(self.storage).__name__}:{self.storage.identity()}"

    def release(self) -> None:
        self._let_go(abandon=False)

    def abandon(self) -> None:
        """``release``, and where this is the process's last holder of the lock, remove what
        taking it created (the lock file, the run's new directories): for a writer whose start
        failed, which leaves the location as it found it."""
        self._let_go(abandon=True)

    def _let_go(self, abandon: bool) -> None:
        backend = self._backend
        if backend is None:
            return
        key = self._key()
        held = _HELD.get(key)
        last = True
        if held is not None and held[0] is backend:
            held[1] -= 1
            if held[2] == id(self):
                held[2] = None
            last = held[1] == 0
            if last:
                del _HELD[key]
        if last and abandon:
            backend.abandon()
        elif last:
            backend.release()
        self._backend = None

    def __del__(self) -> None:
        self.release()  # a Tailor dropped without close(): its share of the lock goes with it


_HELD: dict[str, list] = {}
"""The runs this process holds the lock of: storage identity -> [lock backend, holders, id of
the holder that writes (or None)]."""


def _holder() -> str:
    """How the lock file names its holder: this process."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


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
            self._handle.write(_holder() + "\n")
            self._handle.flush()
        except OSError as err:
            self.abandon()
            raise StorageError(f"cannot write to the run: {describe_os_error(err, self.root / LOCK_FILE)}", err) from None

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor releases the flock
            self._handle = None

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
    fd = _open_lease(directory)
    if fd is _GONE:
        return None
    if fd is None:
        return Lease(None)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:  # a filesystem without flock: read unprotected, as before leases
            return Lease(fd)
        if not _still_in_place(fd, directory / LEASE_FILE):
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return Lease(fd)


def lease_for_removal(directory: Path) -> Lease | None:
    """An exclusive lease on the snapshot in ``directory``, taken without waiting; None while
    a reader holds it (or when the snapshot is gone already)."""
    fd = _open_lease(directory)
    if fd is _GONE:
        return None
    if fd is None:
        return Lease(None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # a filesystem without flock: no reader can hold a lease either
        pass
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
        if err.errno in _CANNOT_CREATE or err.errno == errno.ELOOP:
            return None
        raise StorageError(describe_os_error(err, path), err) from None
    try:
        return os.open(path, flags | os.O_CREAT, 0o644)
    except (FileNotFoundError, NotADirectoryError):
        return _GONE
    except OSError as err:
        if err.errno in _CANNOT_CREATE or err.errno == errno.ELOOP:
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
