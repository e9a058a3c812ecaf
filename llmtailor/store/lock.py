"""The writer lock of a run: one writer per run, shared by the Tailors of one process, leftovers
of crashed writers cleared by the holder. This is the rule; each storage brings its mechanism
(``storage.locks``: ``flock`` on a local directory, ``store.storage.local_lock``; a lease object
on an object store, ``store.storage.object_lock``), and says whether a location is a run
(``storage.detection``): the lock is taken only in a run, or in a missing or empty location a
writer is about to make one, so something else is refused before anything in it is created or
deleted.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from llmtailor.errors import StorageError, TailorError
from llmtailor.store.storage import Leftovers, Storage, WriterLockBackend, open_storage
from llmtailor.store.storage.strategies import CANNOT_CREATE, this_process


class WriterLock:
    """Exclusive write access to a run, held until ``release`` or process exit. The run is a
    local directory (``flock``) or an object-store URL (a lease object): module docstring;
    ``root`` is a path, a URL or a ``Storage``.

    ``new_run=True`` (a writer): the location may also be missing or empty, and becomes a
    run. ``new_run=False`` (gc): it must already be a run."""

    def __init__(self, root: Path | str | Storage, *, new_run: bool = True, storage_options: dict | None = None):
        self.storage = open_storage(root, storage_options)
        self.root = self.storage.root
        self.new_run = new_run
        self._backend: WriterLockBackend | None = None
        self._owner = os.getpid()
        """The process whose hold ``_backend`` is: a forked child's copy holds nothing (``_forked``)."""
        self.cleared = Leftovers()
        """What this lock's ``acquire`` cleared of crashed writers' leftovers."""
        self.closed = False
        """Released for good (``release(for_good=True)``): ``acquire`` refuses from then on."""
        self._mutex = threading.Lock()
        """Taking and letting go, one at a time (a promoter's thread claims while ``close`` releases)."""

    @property
    def held(self) -> bool:
        return self._backend is not None and self._owner == os.getpid()

    def acquire(self) -> None:
        """Take the lock or raise TailorError naming the holder (or saying why the location
        is not a run); then clear what crashed writers left behind. A failure to clear them is
        raised with the lock let go again, what taking it created removed (``abandon``): the next
        ``acquire`` takes it and clears anew.

        Within one process the lock is shared: a second ``Tailor`` of the same run (one that
        saved, another that restores) holds it too, and only the first clears leftovers (the
        other's save may be in flight). Between processes it is exclusive. A lock released for
        good (its writer closed) refuses: TailorError."""
        with self._guard():
            self._acquire()

    def _acquire(self) -> None:
        if self.closed:
            raise TailorError(f"{self.root}: this writer was closed and released the run's lock; nothing more is "
                              "written by it")
        if self.held:
            return
        key = self._key()
        if key in _HELD:
            _HELD[key][1] += 1
            self._backend, self._owner = _HELD[key][0], os.getpid()
            return
        self._refuse_non_run()
        backend = self.storage.locks.writer()
        backend.take()
        self._backend, self._owner = backend, os.getpid()
        _HELD[key] = [backend, 1, None]
        try:
            self.cleared = self.storage.commits.clear_leftovers()
        except BaseException:
            # Not taken after all: a lock kept, with nobody to release it (the caller saw a failure),
            # held this process's writers to leftovers never cleared and others off the run. Let go
            # as a failed start is (``abandon``): what this take created goes too (a new run's
            # ``.lock`` and directories), as the caller's own ``abandon`` would have removed it had
            # the lock still been held; a run found there keeps all it had.
            self._let_go_held(abandon=True)
            raise

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
                f"{self.root} is being written by another writer ({this_process()}, another Tailor of this process); "
                "a run has one writer at a time"
            )
        held[2] = id(self)

    def check_held(self) -> None:
        """Raise TailorError if this writer does not hold the lock (released: a promotion still
        running after ``close``; or never taken) or lost it since it was taken (an object-store
        lease another writer took over after this one failed to renew it)."""
        if not self.held:
            raise TailorError(f"{self.root}: this writer does not hold the run's lock (released, or never taken); "
                              "nothing more is committed")
        self._backend.check_held()

    def acquire_or_look(self) -> None:
        """``acquire`` where the run can be written; where it cannot (a read-only copy), only
        refuse a run another process holds: restoring from it still works, saving will fail
        then, naming why."""
        try:
            self.acquire()
        except StorageError as err:
            if err.errno not in CANNOT_CREATE:
                raise
            self.refuse_if_held()

    def refuse_if_held(self) -> None:
        """Raise TailorError naming the holder when another process holds the lock now; take
        nothing (a reader may only read the run, even a read-only one). A writer calls it when
        it is built, so a second trainer fails before it trains; ``acquire`` at its first save
        still decides a race between two that both looked."""
        holder = self.storage.locks.writer().holder_if_other()
        # This very process may hold it (another Tailor of it): told by its own registry, never by
        # the name the lock records: a process of another pid namespace under the same hostname
        # (a container on the host's network) has the same name, and so, until it writes its own,
        # has a new holder that took the lock over a dead holder whose pid this process now has.
        if holder is not None and self._key() not in _HELD:
            raise TailorError(f"{self.root} is being written by another writer ({holder}); a run has one writer at a time")

    def _refuse_non_run(self) -> None:
        why = self.storage.detection.describe_non_run()
        if why is None:
            return
        if self.new_run and self.storage.detection.is_fresh():
            return
        raise TailorError(f"{why}; refusing to {'write into' if self.new_run else 'clean'} it")

    def _key(self) -> str:
        return f"{type(self.storage).__name__}:{self.storage.identity()}"

    def release(self, *, for_good: bool = False) -> None:
        """Let go of this writer's share of the lock; ``for_good`` (its writer closed): and never
        take it again (``acquire`` refuses), so a promotion of that writer still running cannot
        take it back (and ``check_held`` refuses its commit)."""
        self._let_go(abandon=False, for_good=for_good)

    def abandon(self) -> None:
        """``release``, and where this is the process's last holder of the lock, remove what
        taking it created (the lock file, the run's new directories): for a writer whose start
        failed, which leaves the location as it found it."""
        self._let_go(abandon=True)

    def _let_go(self, abandon: bool, for_good: bool = False) -> None:
        with self._guard():
            self.closed = self.closed or for_good
            self._let_go_held(abandon)

    def _guard(self) -> threading.Lock:
        """This lock's mutex in this process. A forked child's copy holds nothing: the lock stays
        its parent's (``_forked``), and the copy gets a mutex of its own (a parent's thread may
        have held the one the fork copied)."""
        if self._owner != os.getpid():
            self._backend, self._owner, self._mutex = None, os.getpid(), threading.Lock()
        return self._mutex

    def _let_go_held(self, abandon: bool) -> None:
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
        if last:  # the next holder clears the trash: none of this process's removals still under way, no commit unsettled
            self.storage.commits.wait_purged()
            self.storage.commits.settle()
        if last and abandon:
            backend.abandon()
        elif last:
            backend.release()
        self._backend = None

    def __del__(self) -> None:
        self.release()  # a Tailor dropped without close(): its share of the lock goes with it (not a forked copy)


_HELD: dict[str, list] = {}
"""The runs this process holds the lock of: storage identity -> [lock backend, holders, id of
the holder that writes (or None)]."""


def _forked() -> None:
    """In a forked child (a DataLoader worker, a multiprocessing pool's): the locks held are the
    parent's, not its own. Its copies of the parent's holds let go of what the fork copied (a
    local run's descriptor, which would otherwise keep the parent's ``flock`` held after the
    parent died) without touching the lock, and its own writer takes the lock anew (refused while
    the parent holds it: one writer per run). A copy of a ``WriterLock`` dropped in the child
    releases nothing (``_guard``): before, it deleted the parent's object-store lease, or hung
    asking the store from the child."""
    for backend, _, _ in _HELD.values():
        backend.forsake()
    _HELD.clear()


os.register_at_fork(after_in_child=_forked)
