"""How a local run commits a snapshot: a save writes into a private directory under ``.tmp/``
and renames it into ``snapshots/`` atomically (fsyncing what it adds first, the parent after:
a failure of that fsync, or of ``latest``'s, is returned, never raised, the snapshot committed:
``Unconfirmed``);
retention renames a snapshot into ``.trash/``, fsyncs the directory it left, then removes its
files (a writer's retention does both on a background thread, ``purge_later``: its save returns
once its own snapshot and ``latest`` are durable, and a crash before that fsync brings the old
snapshot back whole, one composite more than ``keep`` until the next retention). The old
``latest`` file a commit replaces is unlinked on that thread too (a second link to it in
``.tmp/`` through the replace). The writer lock's holder clears both of what crashed writers
left.

A committed snapshot whose name could not be confirmed durable (``doubtful``) stays doubtful
until the machine restarts: a crash before the storage writes the name out may lose it, whichever
process runs then. So the doubt is kept beside the run (``DOUBTFUL_FILE``: the boot's id, then
each name), for the next writer of this boot; after a restart of the machine, a name found in
``snapshots/`` was read from the disk, and the file is ignored (and dropped by the next change).
It is not fsynced: a crash that could lose it starts another boot."""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from llmtailor.constants import MANIFEST_FILE, RANKS_DIR, SNAPSHOTS_DIR, TMP_DIR, TRASH_DIR, parse_snapshot_name
from llmtailor.errors import StorageError, TailorError
from llmtailor.store.storage.local_durable import (create_file, create_replacement, fsync_beside, fsync_dir, fsync_together,
                                                   remove_tree_for_work, replace_with)
from llmtailor.store.storage.local_lock import LEASE_FILE
from llmtailor.store.storage.strategies import Leftovers, SnapshotCommits, Unconfirmed

log = logging.getLogger(__name__)

DOUBTFUL_FILE = ".doubtful"
"""Beside ``snapshots/``: the names of committed snapshots not confirmed durable (module docstring)."""


def _boot() -> str:
    """This boot of the machine's id ("" where the system has none to read: the doubt is kept)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class LocalCommits(SnapshotCommits):
    """The snapshot commit of the local run at ``root`` (module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self._left: dict[str, Path] = {}
        """Token of a snapshot ``discard`` renamed -> the directory it left, not yet fsynced
        (``purge`` of a token not here: ``snapshots/``, where every committed snapshot lies)."""
        self._doubtful: set[str] = self._doubted()
        """The snapshots committed on this boot whose rename was not confirmed durable
        (``doubtful``), until one is discarded or committed again (kept in ``DOUBTFUL_FILE``)."""
        self._doubt = threading.Lock()

    def _doubted(self) -> set[str]:
        """The names ``DOUBTFUL_FILE`` keeps, when written on this boot."""
        try:
            boot, *names = (self.root / DOUBTFUL_FILE).read_text().splitlines()
        except (OSError, ValueError):  # none (the usual case), or unreadable
            return set()
        return set(names) if boot == _boot() else set()

    def _doubt_changed(self, before: frozenset[str]) -> None:
        """``DOUBTFUL_FILE`` written again where the doubtful names changed (the caller holds
        ``_doubt``); a failure is logged: this process still knows them."""
        if before == self._doubtful:
            return
        path = self.root / DOUBTFUL_FILE
        try:
            if not self._doubtful:
                path.unlink(missing_ok=True)
                return
            new = self.root / TMP_DIR / f"{DOUBTFUL_FILE}.{uuid.uuid4().hex[:8]}"
            new.parent.mkdir(exist_ok=True)
            new.write_text("\n".join([_boot(), *sorted(self._doubtful)]) + "\n")
            os.replace(new, path)
        except OSError as err:
            log.warning("llmtailor: %s: could not keep the names not confirmed durable (%s): a writer after this "
                        "process will not know them", path, err)

    def begin(self, name: str, final: str, world_size: int) -> str:
        if (self.root / final).exists():
            raise TailorError(f"{self.root / final} already exists; refusing to overwrite a committed snapshot")
        staging = f"{TMP_DIR}/{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        (self.root / staging).mkdir(parents=True)  # its subdirectories, as files need them (LocalSink)
        # The reader lease exists from the commit on: a reader never has to create one in a
        # snapshot of this version (local_lock).
        (self.root / staging / LEASE_FILE).touch()
        if world_size > 1:
            (self.root / staging / RANKS_DIR).mkdir()
        return staging

    def commit(self, staging: str, final: str, manifest: bytes, pointer: tuple[str, bytes] | None = None,
               pending: Callable[[], None] | None = None, parent: int | None = None,
               publish: Callable[[], None] | None = None) -> Unconfirmed | None:
        tmp, target = self.root / staging, self.root / final
        try:
            create_file(tmp / MANIFEST_FILE, manifest)
        except FileExistsError:
            raise TailorError(f"{tmp / MANIFEST_FILE} already exists; refusing to overwrite it") from None
        # The pointer's new file is written once the manifest is (a full disk fails the pointer,
        # not the commit) and made durable beside it; its rename waits for the snapshot's. It
        # lies in .tmp/ meanwhile: what a crash leaves there the next writer removes.
        new, failed = None, None
        if pointer is not None:
            try:
                new = create_replacement(self.root / TMP_DIR / pointer[0], pointer[1])
            except OSError as err:
                failed = err
        try:
            # The manifest and every directory holding a staged file, so its entries are durable
            # (the snapshot's subdirectories: units/, packs/, ranks/ ..., whichever this save
            # made; then itself), fsynced at once, beside the staged files still in flight
            # (``pending``): the journal commits them together, one wait on the disk, not two
            # (bench/RESULTS.md, issue 33, session 48). Nothing is renamed before all are durable:
            # until then the manifest lies in .tmp/, which no reader reads.
            subdirectories = [Path(sub.path) for sub in os.scandir(tmp) if sub.is_dir(follow_symlinks=False)]
            fsync_together([tmp / MANIFEST_FILE, *subdirectories, tmp, *([new] if new is not None else [])], beside=pending)
            if publish is not None:  # everything durable: the rename is all that is left
                publish()
            target.parent.mkdir(parents=True, exist_ok=True)
            together = new is not None and parent is not None and _newest_is(target.parent, parent)
            os.rename(tmp, target)
        except BaseException:
            if new is not None:
                new.unlink(missing_ok=True)
            raise
        unconfirmed = self._named(target, new, self.root / pointer[0] if pointer is not None else None, failed, together)
        with self._doubt:
            before = frozenset(self._doubtful)
            if unconfirmed is not None and unconfirmed.durable is not None:
                self._doubtful.add(final)
            else:  # a snapshot of that step committed again, durably (the doubtful one was discarded first)
                self._doubtful.discard(final)
            self._doubt_changed(before)
        return unconfirmed

    def doubtful(self) -> frozenset[str]:
        """A committed snapshot's name whose fsync failed stays doubtful for this boot: a second
        fsync after a failed one may succeed with the name lost (``Unconfirmed.durable``)."""
        with self._doubt:
            return frozenset(self._doubtful)

    def _named(self, target: Path, new: Path | None, path: Path | None, failed: OSError | None,
               together: bool) -> Unconfirmed | None:
        """A commit's last part, once its snapshot was renamed to ``target``: its rename made
        durable and the pointer at ``path`` replaced with ``new`` (``together``: both made durable
        at once); ``failed``: why ``new`` could not be written. Committed from here: readers see
        the snapshot, whole. What fails now is returned (``Unconfirmed``), never raised: a save
        reported failed whose snapshot is the run's newest would have its writer go back to the
        composite before it, and save the same step again, refused (docs/failures.md)."""
        if not together:
            durable = _fsynced(target.parent)
            if new is None:  # no pointer, or its new file could not be written
                return _unconfirmed(durable=durable, pointer=failed)
            if durable is not None:  # a pointer names a snapshot only once its rename is durable
                try:
                    new.unlink(missing_ok=True)
                except OSError:  # the filesystem refuses changes now (read-only once its journal failed): a leftover in .tmp/
                    pass
                return Unconfirmed(durable=durable, pointer=durable)
            try:
                self._replace_pointer(new, path)
            except OSError as err:
                return Unconfirmed(pointer=err)
            return _unconfirmed(pointer_durable=_fsynced(path.parent))
        # The parent is the run's newest snapshot (``_newest_is``): the snapshot's rename and
        # the pointer's are made durable together, one wait on the disk, not one after the
        # other (bench/RESULTS.md, issue 33, session 50). A crash before both are durable leaves
        # either rename or both or neither: a pointer naming a snapshot not renamed in stands
        # for the newest committed one (``Catalog.latest_step``), which is the parent, the
        # composite before this save; a snapshot renamed in, the pointer not, is found
        # through its parent link. Neither is durable before the snapshot's own files.
        try:
            self._replace_pointer(new, path)
        except OSError as err:
            return Unconfirmed(durable=_fsynced(target.parent), pointer=err)  # the snapshot made durable all the same
        except BaseException:
            fsync_dir(target.parent)
            raise
        durable, pointer_durable = fsync_beside(target.parent, path.parent)
        return _unconfirmed(durable=durable, pointer_durable=pointer_durable)

    def _replace_pointer(self, new: Path, path: Path) -> None:
        """``replace_with(new, path)``, the old pointer's file kept linked in ``.tmp/`` through
        the replace and its last link removed on the purger's thread: on this project's ext4,
        dropping a file's last link waited up to a 4 ms tick (``os.replace`` over the old pointer
        2.5-3.6 ms, over a second link of it 0.01 ms), and the run directory's fsync after it took
        longer too (the two 1.8-8.1 ms, then 0.2-3.9 ms): the longest step of a small save's
        commit (bench/RESULTS.md, issue 33, session 47). What a crash leaves in ``.tmp/`` the
        next writer removes (``clear_leftovers``). Not durable: the caller fsyncs its directory."""
        kept = new.parent / f"{path.name}.{uuid.uuid4().hex[:8]}"  # in .tmp/, beside the new file
        try:
            os.link(path, kept, follow_symlinks=False)  # a link of the pointer itself, whatever it is
        except (OSError, NotImplementedError):  # no pointer yet, no hard links there (or no linkat): replaced as it is
            kept = None
        try:
            replace_with(new, path, durable=False)
        finally:
            if kept is not None:
                _PURGER.submit(kept, None)

    def abandon(self, staging: str) -> None:
        remove_tree_for_work(self.root / staging, ignore_errors=True)

    def discard(self, snapshot: str) -> str:
        source = self.root / snapshot
        token = f"{TRASH_DIR}/{source.name}.{uuid.uuid4().hex[:8]}"
        (self.root / TRASH_DIR).mkdir(exist_ok=True)
        os.rename(source, self.root / token)
        with self._doubt:
            before = frozenset(self._doubtful)
            self._doubtful.discard(snapshot)
            self._doubt_changed(before)
        self._left[token] = source.parent  # fsynced by ``purge``, before anything is removed
        return token

    def purge(self, token: str) -> None:
        target = self.root / token
        try:
            fsync_dir(self._left.pop(token, self.root / SNAPSHOTS_DIR))  # the rename durable before any removal
            _remove(target)
        except OSError as err:
            raise StorageError(f"{target}: could not delete ({err.strerror}); the next writer retries", err) from None

    def purge_later(self, token: str) -> None:
        _PURGER.submit(self.root / token, self._left.pop(token, self.root / SNAPSHOTS_DIR))

    def wait_purged(self) -> None:
        _PURGER.wait(self.root)

    def clear_leftovers(self) -> Leftovers:
        files = 0
        for leftover in (TMP_DIR, TRASH_DIR):
            files += sum(len(names) for _, _, names in os.walk(self.root / leftover))  # unreadable: not counted
            remove_tree_for_work(self.root / leftover, ignore_errors=True)
        return Leftovers(files=files)


class _Purger:
    """Removes discarded snapshots' directories (already renamed into ``.trash/``; the directory
    each left fsynced first) and replaced pointers' files on one background thread of the process, in order; ``wait(root)``
    returns once none of ``root``'s is left to do. A daemon thread: a process that exits
    mid-removal leaves the rest in ``.trash/``, which the next writer clears (``clear_leftovers``)."""

    def __init__(self):
        self._queue: queue.SimpleQueue[tuple[Path, Path | None, Path]] = queue.SimpleQueue()
        self._pending: dict[Path, int] = {}
        """Run root -> removals queued or under way in its ``.trash/`` and ``.tmp/``."""
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, target: Path, left: Path | None) -> None:
        """Remove ``target`` (a directory, or a file; in ``.trash/`` or ``.tmp/`` of a run) once
        the directory it was renamed out of, ``left`` (if any), is fsynced."""
        # The same run however its root was spelled; the target itself unresolved: a link (a
        # snapshot or ``latest`` that was one) is removed as a link, never what it points to.
        root = Path(os.path.realpath(target.parent.parent))
        with self._changed:
            self._pending[root] = self._pending.get(root, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="llmtailor-purge", daemon=True)
                self._thread.start()
        self._queue.put((Path(os.path.realpath(target.parent)) / target.name, left, root))

    def wait(self, root: Path) -> None:
        if sys.is_finalizing():  # the thread may be stopped already: what is left stays in the trash
            return
        root = Path(os.path.realpath(root))
        with self._changed:
            self._changed.wait_for(lambda: not self._pending.get(root))

    def _work(self) -> None:
        while True:
            target, left, root = self._queue.get()
            try:
                if left is not None:
                    fsync_dir(left)  # the rename durable before any removal: a crash finds it whole or gone
                _remove(target)
            except OSError as err:
                log.warning("llmtailor retention: %s: could not delete (%s); the next writer retries", target, err.strerror)
            finally:
                with self._changed:
                    self._pending[root] -= 1
                    if not self._pending[root]:
                        del self._pending[root]
                    self._changed.notify_all()


NEWEST_LISTED_UP_TO = 1024
"""A commit lists ``snapshots/`` to tell whether its parent is the newest snapshot there
(``_newest_is``) only up to this many entries: beyond, its two renames are made durable one
after the other, as for any other parent (the listing's cost stays bounded)."""


def _newest_is(snapshots: Path, parent: int) -> bool:
    """Whether the snapshot of ``parent`` is in ``snapshots`` and none there is of a later
    step (any entry not read as a step counts as later: the answer errs on the side of the
    ordered renames)."""
    found = False
    try:
        with os.scandir(snapshots) as entries:
            for count, entry in enumerate(entries):
                step = parse_snapshot_name(entry.name)
                if count >= NEWEST_LISTED_UP_TO or step is None or step > parent:
                    return False
                found = found or step == parent
    except OSError:  # not listed: the renames one after the other
        return False
    return found


def _fsynced(directory: Path) -> OSError | None:
    """``fsync_dir(directory)``'s failure, returned (a commit's names, once visible: ``Unconfirmed``)."""
    try:
        fsync_dir(directory)
    except OSError as err:
        return err
    return None


def _unconfirmed(**failures: OSError | None) -> Unconfirmed | None:
    """``Unconfirmed(**failures)``, or None when nothing failed."""
    return Unconfirmed(**failures) if any(failure is not None for failure in failures.values()) else None


def _remove(target: Path) -> None:
    """Remove ``target``: a directory with its files, a file, or a link as a link (never what it
    points to: a snapshot linked outside the run is not this run's to delete)."""
    if target.is_dir() and not target.is_symlink():
        remove_tree_for_work(target)
    else:
        target.unlink()


_PURGER = _Purger()
# A forked child (a multiprocessing worker of a sweep) has no purger thread, only the parent's
# queue and counts as the fork found them: one of its own, or its writers' release waits for ever.
os.register_at_fork(after_in_child=_PURGER.__init__)
