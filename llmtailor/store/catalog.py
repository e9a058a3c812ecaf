"""A run's catalog: its committed snapshots, its ``latest`` pointer, its lineages and composites,
and the leases that keep what a reader reads from retention.

A run lives at a local directory or an object-store URL; every byte is read through its
``Storage`` (``store.storage``), so what follows holds for both. Layout (directories are key
prefixes on an object store)::

    RUN/
      latest                       name of the newest committed snapshot (replaced atomically)
      snapshots/step-00000100/     one committed snapshot
        manifest.json              written last: no manifest, no snapshot (small at any size)
        global.json                step, optimizer groups, scheduler, model config; rank 0's RNG
                                   states and extras (JSON)
        global.safetensors         the tensors global.json refers to
        ranks/rank-00001.json      rank 1's own RNG states and extras (+ .safetensors); one per
                                   rank >= 1 in a distributed save
        index/<unit>.json          the unit's files, tensors and chunks
        units/<unit>.safetensors   weights and optimizer state of each unit saved at this step
                                   (units/<unit>.rank-00001.safetensors: rank 1's pieces of it)
        .readers                   the snapshot's reader lease (``storage.local_lock``; not in the manifest)
      .tmp/                        snapshots being written (local runs); never read

This module only reads (manifests and pointers; a unit's tensors: ``units.py``); ``writer.py``
writes. ``Run`` (``run.py``) is the catalog with its units' read path and verification.

Invariants of reading:

- Every file read lies inside the run: a local run's files resolve (symlinks followed) inside
  its root, itself resolved first; a link out of the run is refused with an IntegrityError
  naming it.
- A reader that must not lose what it reads to retention (``gc``, ``keep=K``) holds a lease on
  every snapshot of its composite (``reading``): retention leaves leased snapshots in place.
  A composite that lost a snapshot before its lease was taken is never read in part: it is
  resolved again (the newest) or refused, before any tensor byte is read.

The small requests of a restore from an object store (each a round trip, and on a server such
as moto some milliseconds of its CPU whatever its size), each asked once in the job (rank 0
lists, reads the pointer and leases; ``store.shared_reads`` sends what one rank read to the
others), and why each is needed:

- a LIST of ``snapshots/``: a snapshot committed after the one ``latest`` names (a crash between
  a commit and the pointer's update) is followed (``latest_step``); a HEAD of the manifest of each
  one listed newer than the pointer, none of the others (``_newest_to_lease``);
- a GET of ``latest``: a branch left by a restore of an older step is not followed;
- the reader lease (``ObjectLocks.lease_for_reading``) of each snapshot the composite needs: its
  PUT, then a HEAD of the removal mark and a GET of the manifest, after the PUT (retention writes
  its mark, then looks for leases: one of the two sides sees the other), the GET also giving the
  manifest read; and its DELETE (a bulk one) once the restore's reads are done;
- a GET of the composite's unit indexes (``indexes.json``) and of its global state
  (``global.json``, ``global.safetensors``), by whichever rank the read plan picks;
- a GET of each rank's own state (``ranks/rank-N.json`` and ``.safetensors``), by that rank.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtailor.constants import LATEST_FILE, MANIFEST_FILE, SNAPSHOTS_DIR, TMP_DIR, parse_snapshot_name, snapshot_dirname
from llmtailor.errors import IntegrityError, SnapshotNotFoundError, TailorError
from llmtailor.layouts import name_units
from llmtailor.store.manifest import Manifest, parse_manifest
from llmtailor.store.storage import Lease, Storage, open_storage
from llmtailor.store.storage.object_lock import is_committed

_RESOLVE_ATTEMPTS = 50
"""How often the newest composite is resolved again when retention removed part of it before
it could be leased (each time, a writer committed a newer one meanwhile)."""


@dataclass(frozen=True)
class Composite:
    """The checkpoint as of ``step``: each unit from the snapshot at ``sources[unit]``, global
    state from ``step`` itself."""

    step: int
    manifest: Manifest
    sources: dict[str, int]


class ReadLeases:
    """Shared leases on snapshots of one run (``storage.locks``), held until ``close``; a context
    manager. While a lease is held, retention does not remove that snapshot."""

    def __init__(self, run: Catalog):
        self.run = run
        self._held: dict[int, Lease] = {}

    def take(self, step: int) -> bool:
        """Lease the snapshot of ``step``; False when it is not (or no longer) a committed
        snapshot of the run. A snapshot directory that resolves outside the run raises."""
        if step in self._held or self.run.committing_here(step):
            return True  # committed by this process in the background: nothing else removes it meanwhile
        snapshot = self.run.snapshot_key(step)
        storage = self.run.storage
        locks = storage.locks
        committed = locks.checks_committed or storage.is_file(f"{snapshot}/{MANIFEST_FILE}")  # not looked for twice
        # Its manifest, when not known yet, read by the lease's own check (an object store's).
        lease = locks.lease_for_reading(snapshot, marker=step not in self.run._manifests) if committed else None
        if lease is None:
            self.run.forget([step])  # a snapshot of this step written later is another one
            return False
        self._held[step] = lease
        self.run._doubted.discard(step)  # committed after all: a snapshot saved again at a step removed before
        if lease.marker is not None:  # the manifest as read once the lease was written: not read again
            self.run.manifest_read(step, lease.marker)
        return True

    def holds(self, step: int) -> bool:
        return step in self._held

    def release(self, step: int) -> None:
        lease = self._held.pop(step, None)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        for step in list(self._held):
            self.release(step)

    def __enter__(self) -> ReadLeases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LeasedComposite:
    """A composite with the leases on every snapshot it reads (``Catalog.lease``), held until
    ``close``; a context manager giving the composite."""

    def __init__(self, composite: Composite, leases: ReadLeases):
        self.composite, self.leases = composite, leases

    def close(self) -> None:
        self.leases.close()

    def __enter__(self) -> Composite:
        return self.composite

    def __exit__(self, *exc: object) -> None:
        self.close()


class Catalog:
    """What a run holds, at a local path or an object-store URL (``storage_options``: the
    store's options, ``store.storage.open_storage``): its committed snapshots, their manifests
    (cached), ``latest``, lineages and composites, and the read leases that keep a composite
    from retention while it is read (module docstring)."""

    def __init__(self, root: str | Path | Storage, storage_options: dict[str, Any] | None = None):
        self.storage: Storage = open_storage(root, storage_options)
        self.root = self.storage.root
        self._manifests: dict[int, Manifest] = {}
        self._manifest_bytes: dict[int, bytes] = {}
        """Step -> its manifest's bytes as a reader lease read them (``manifest_read``), parsed
        when first asked for (``manifest``)."""
        self._listed = threading.local()
        """``listing``: inside ``listed``, the listing taken there (empty until the first); per
        thread, so a promoter's or a stager's thread never sees a restore's listing."""
        self._committing: dict[int, Future[None]] = {}
        """Step -> the commit of that snapshot this process runs in the background (``commit_later``)."""
        self._commit_failures: list[str] = []
        self._tombstoned: list[int] | None = None
        """The steps whose manifest key held a tombstone at the last listing (``_list_steps``;
        None: not listed yet), for ``tombstones``."""
        self._held_back: list[threading.Event] = []
        """Gates of background commits' writes not yet opened (``hold_back``)."""
        self._doubted: set[int] = set()
        """Steps forgotten (``forget``: a lease found no committed snapshot there, or it was removed):
        a listing for a lease looks for their manifest first (``_newest_to_lease``)."""

    @property
    def is_local(self) -> bool:
        return isinstance(self.root, Path)

    @property
    def snapshots_dir(self) -> Path:
        """Where a local run's committed snapshots lie."""
        return self._local_path(SNAPSHOTS_DIR)

    @property
    def tmp_dir(self) -> Path:
        """Where a local run's snapshots are written before their commit."""
        return self._local_path(TMP_DIR)

    def snapshot_dir(self, step: int) -> Path:
        """The directory of the snapshot of ``step`` (a local run's)."""
        return self._local_path(self.snapshot_key(step))

    def _local_path(self, key: str) -> Path:
        if not isinstance(self.root, Path):
            raise TailorError(f"{self.root} is not a local directory (no path for {key})")
        return self.root / key

    @staticmethod
    def snapshot_key(step: int) -> str:
        """Where the snapshot of ``step`` lies in the run (``snapshots/step-00000100``)."""
        return f"{SNAPSHOTS_DIR}/{snapshot_dirname(step)}"

    def where(self, step: int, relpath: str = "") -> str:
        """How a message names a file of the snapshot of ``step``."""
        return self.storage.where(f"{self.snapshot_key(step)}/{relpath}" if relpath else self.snapshot_key(step))

    def steps(self) -> list[int]:
        """Steps of the committed snapshots (those whose manifest exists, and those this process
        commits in the background: ``commit_later``), ascending (inside ``listed``: as first
        listed there; by a lease's listing, ``_newest_to_lease``, those up to ``latest`` as listed)."""
        listing = getattr(self._listed, "listing", None)
        if listing:
            return list(listing[0])
        return self._listed_steps(self._list_steps())

    def _listed_steps(self, committed: list[int]) -> list[int]:
        """``steps`` from the ``committed`` steps just listed: with those this process commits in
        the background, kept inside ``listed``."""
        found = sorted({*committed, *(step for step in list(self._committing) if self.committing_here(step))})
        listing = getattr(self._listed, "listing", None)
        if listing is not None:
            listing.append(found)
        return list(found)

    # -- snapshots committed in the background (a node's copy healed: ``tiers.healing``) ------

    def commit_later(self, manifest: Manifest, done: Future[None]) -> None:
        """Count the snapshot of ``manifest`` as committed in this process while ``done`` (its
        commit, files then manifest, on a background thread) runs: it is listed (``steps``),
        its manifest known, and read under no lease (``ReadLeases.take``: nothing removes a
        snapshot that is not committed yet, and this process's writers settle it first). Its
        readers must take its files' bytes from memory (``UnitReader.arrived``) meanwhile.
        ``settle_commits`` waits for it; a failure is kept for ``commit_failure``."""
        self._manifests[manifest.step] = manifest
        self._committing[manifest.step] = done

    def commit_coming(self, step: int) -> Future[None]:
        """Count the snapshot of ``step`` as committed in this process while its files are still
        on their way here (a node's copy healed beside the restore that reads it:
        ``tiers.healing.Receiving``), as ``commit_later`` does once they are in, its manifest
        known from elsewhere meanwhile (rank 0's: ``share_manifests``) and its files' bytes waited
        for (``UnitReader.coming``). The future given is resolved by its receiver (a failure
        withdraws it first: ``not_coming``), or replaced by ``commit_later``."""
        coming: Future[None] = Future()
        self._committing[step] = coming
        return coming

    def not_coming(self, step: int, coming: Future[None]) -> None:
        """The snapshot of ``step`` will not be committed by ``coming`` (``commit_coming``): its
        healing failed, and said so where it failed; its manifest is no longer known here."""
        if self._committing.get(step) is coming:
            del self._committing[step]
            self._manifests.pop(step, None)

    def committing_here(self, step: int) -> bool:
        """Whether this process is committing the snapshot of ``step`` in the background."""
        done = self._committing.get(step)
        return done is not None and not (done.done() and done.exception() is not None)

    def committing_in_background(self) -> bool:
        """Whether this process commits any snapshot of the run in the background now."""
        return any(self.committing_here(step) for step in list(self._committing))

    def hold_back(self) -> threading.Event:
        """A gate the writes of a background commit wait on (a healed snapshot's,
        ``tiers.healing.Receiving``), opened by ``release_held``: at the end of the restore that
        reads the bytes the healing received (``Tailor.restore``: in memory already, so that
        restore has the CPUs to itself), or by anything that waits for the commit
        (``wait_commits``, ``settle_commits``)."""
        gate = threading.Event()
        self._held_back.append(gate)
        return gate

    def release_held(self) -> None:
        """Open every gate ``hold_back`` gave: the writes held back start."""
        held, self._held_back = self._held_back, []
        for gate in held:
            gate.set()

    def wait_commits(self) -> None:
        """Wait for the background commits (``commit_later``), their writes released first
        (``release_held``), settling none (their failures stay for ``settle_commits``): another
        reader of the store (a fresh ``Run`` of it) then finds what they committed."""
        self.release_held()
        futures.wait(list(self._committing.values()))

    def settle_commits(self) -> None:
        """Wait for the background commits (``commit_later``), their writes released first
        (``release_held``); each failure kept (and its snapshot forgotten) for ``commit_failure``."""
        self.release_held()
        for step, done in list(self._committing.items()):
            failure = done.exception()
            del self._committing[step]
            if failure is not None:
                self._commit_failures.append(str(failure))
                self.forget([step])

    def commit_failure(self) -> str | None:
        """The failures of the background commits settled so far, each said once; None if none."""
        failures, self._commit_failures = self._commit_failures, []
        return "; ".join(failures) if failures else None

    def _list_steps(self) -> list[int]:
        # On an object store a tombstone is no manifest (``object_commit.tombstone``): kept aside.
        sizes = self._manifest_sizes()
        if self.storage.remote:
            self._tombstoned = sorted(step for step, size in sizes if size is not None and not is_committed(size))
        return sorted(step for step, size in sizes if self._marks_commit(size))

    def tombstones(self) -> list[int]:
        """The steps whose manifest key holds a tombstone (on an object store: ``object_commit``),
        ascending: no snapshot, and kept for good (``object_commit.TOMBSTONES``). As the last
        listing of the snapshots here found them (``steps``), the run listed now where it was not
        yet: ``inspect`` and ``verify`` ask after they listed it, and list it (a LIST and a HEAD per
        snapshot) no more for this (before, once more). A save of such a step since replaced its
        tombstone: the next listing no longer names it."""
        if not self.storage.remote:
            return []
        if self._tombstoned is None:
            self._list_steps()
        return list(self._tombstoned or [])

    def _snapshot_names(self) -> list[tuple[int, str]]:
        """Each snapshot directory's step and name (one listing: a LIST on an object store)."""
        return [(step, name) for name in self.storage.list_dir(SNAPSHOTS_DIR) if (step := parse_snapshot_name(name)) is not None]

    def _manifest_sizes(self, named: list[tuple[int, str]] | None = None) -> list[tuple[int, int | None]]:
        """Each snapshot directory's step and the size of its manifest (None: none there), of the
        directories ``named`` (default: listed now)."""
        named = self._snapshot_names() if named is None else named
        # Each snapshot's manifest looked for at once (on an object store a HEAD each, side by side).
        sizes = self.storage.together(*(functools.partial(self.storage.size, f"{SNAPSHOTS_DIR}/{name}/{MANIFEST_FILE}")
                                        for _, name in named))
        return [(step, size) for (step, _), size in zip(named, sizes)]

    def _marks_commit(self, size: int | None) -> bool:
        """Whether a manifest of ``size`` bytes (None: none) commits its snapshot: any one there on
        a local disk (an empty one is a damaged snapshot, said by ``verify``), no tombstone on an
        object store (``object_lock.is_committed``)."""
        return is_committed(size) if self.storage.remote else size is not None

    def manifest(self, step: int) -> Manifest:
        if step not in self._manifests:
            key = f"{self.snapshot_key(step)}/{MANIFEST_FILE}"
            raw = self._manifest_bytes.pop(step, None)
            if raw is None:
                try:  # read, not looked for first: on an object store a HEAD is a round trip of its own
                    raw = self.storage.read(key)
                except IntegrityError:
                    if not self.storage.is_file(key):  # not there (never committed, or removed by retention)
                        raise SnapshotNotFoundError(self._no_snapshot_message(step)) from None
                    raise
            if not self._marks_commit(len(raw)):  # a tombstone (``object_commit.tombstone``): no snapshot
                raise SnapshotNotFoundError(self._no_snapshot_message(step))
            manifest = parse_manifest(bytes(raw), self.storage.where(key))
            if manifest.step != step:
                raise IntegrityError(f"{self.storage.where(key)}: manifest says step {manifest.step}, directory says {step}")
            self._manifests[step] = manifest
        return self._manifests[step]

    def manifest_read(self, step: int, raw: bytes) -> None:
        """The bytes of the manifest of ``step`` as a reader lease read them once written
        (``Lease.marker``): ``manifest`` parses (and checks) these instead of reading it again."""
        if step not in self._manifests:
            self._manifest_bytes[step] = raw

    def remember(self, manifest: Manifest) -> None:
        """Keep ``manifest``, the one its writer just committed (``writer.persist``), as if read:
        a committed snapshot's manifest never changes, so reading it back would only cost."""
        self._manifests[manifest.step] = manifest

    def load_manifests(self) -> list[int]:
        """Read (and cache) the manifest of every committed snapshot, each under a lease, so a
        caller listing them all (``inspect``, ``drift``) meets none removed half-way; returns
        the steps read. A snapshot removed before it was leased is left out."""
        read = []
        with ReadLeases(self) as leases:
            for step in self.steps():
                if leases.take(step):
                    self.manifest(step)
                    read.append(step)
                    leases.release(step)
        return read

    def forget(self, steps: list[int]) -> None:
        """Drop cached manifests of snapshots that were removed (and a listing that held them)."""
        for step in steps:
            self._manifests.pop(step, None)
            self._manifest_bytes.pop(step, None)
            self._doubted.add(step)
        listing = getattr(self._listed, "listing", None)
        if listing:
            listing.clear()

    def latest_step(self) -> int | None:
        """The newest committed composite: the ``latest`` pointer, followed forward through any
        snapshot committed after it whose parent it is (a crash can fall between the commit
        and the pointer update). Snapshots of an abandoned branch are not followed."""
        # The pointer read while the snapshots are listed (on an object store, side by side):
        # either order is handled below (a pointer newer than the listing counts as absent).
        steps, pointer = self.storage.together(self.steps, self._read_pointer)
        return _followed(steps, pointer, self._parent_if_present)

    def _newest_to_lease(self) -> int | None:
        """``latest_step`` for ``lease_composite``, which leases the step it returns at once (and
        each snapshot its composite needs, each lease looking for that snapshot's manifest once
        written). On an object store the listing therefore looks for the manifests of the
        snapshots newer than ``latest`` alone (a HEAD each: a crash between a commit and the
        pointer's update leaves one, followed as ``latest_step`` does): the pointer's own is
        read by its lease (a GET, the check that it is committed and its bytes at once:
        ``ObjectLocks.lease_for_reading``), and the older ones are counted as listed, each
        looked for by its lease if the composite needs it. So a restore costs the same requests
        whatever the number of snapshots. Inside ``listed`` the steps so listed are the block's
        (``newest_held`` looks no further back than the newest non-carrier). A pointer whose lease
        found no committed snapshot (``forget``), or none listed (newer than the listing, or no
        ``latest``), is looked for as every snapshot is, and passed over."""
        if not self.storage.locks.checks_committed or getattr(self._listed, "listing", None):
            return self.latest_step()  # a lease that checks nothing (a local run's), or listed already in this block
        named, pointer = self.storage.together(self._snapshot_names, self._read_pointer)
        if pointer is None or pointer in self._doubted or all(step != pointer for step, _ in named):
            sizes, older = self._manifest_sizes(named), []
        else:
            sizes = self._manifest_sizes([(step, name) for step, name in named if step > pointer])
            older = [step for step, _ in named if step <= pointer]
        steps = self._listed_steps([*older, *(step for step, size in sizes if self._marks_commit(size))])
        return _followed(steps, pointer, self._parent_if_present)

    def lineage(self, step: int | None = None, *, through_damage: bool = False) -> Iterator[int]:
        """The composite of ``step`` (default: the newest) and its ancestors, newest first,
        following ``parent`` links while the parent is a committed snapshot (an ancestor removed
        by retention ends the walk). ``through_damage`` (``restore(fallback=True)`` looking for
        a composite that verifies): where the newest cannot be found, a manifest cannot be read
        or a parent is gone, the next older committed snapshot stands in."""
        steps = self.steps()
        try:
            current = self.latest_step() if step is None else step
        except TailorError:
            if not through_damage:
                raise
            current = steps[-1] if steps else None
        while current is not None and current in steps:
            yield current
            try:
                parent = self.manifest(current).parent
            except TailorError:
                if not through_damage:
                    raise
                parent = None
            if through_damage and (parent is None or parent not in steps):
                parent = max((s for s in steps if s < current), default=None)
            current = parent

    def _parent_if_present(self, step: int) -> int | None:
        """The parent of the snapshot of ``step``; None also when it was removed since listed."""
        try:
            return self.manifest(step).parent
        except SnapshotNotFoundError:
            return None

    def _read_pointer(self) -> int | None:
        try:
            name = bytes(self.storage.read(LATEST_FILE)).decode("utf-8").strip()
        except (TailorError, OSError, UnicodeDecodeError):
            return None  # a damaged pointer is ignored: the newest committed snapshot stands in
        return parse_snapshot_name(name)

    def resolve(self, step: int | None = None) -> Composite:
        """The composite as of ``step`` (default: the newest). Reads one manifest. Takes no
        lease: a reader of the composite's files uses ``reading``."""
        if step is not None:
            manifest = self.manifest(step)
            return Composite(step=step, manifest=manifest, sources=dict(manifest.composite))
        for _ in range(_RESOLVE_ATTEMPTS):
            newest = self.latest_step()
            if newest is None and (newest := self._listed_again()) is None:
                raise SnapshotNotFoundError(self._no_snapshot_message(None))
            try:
                return self.resolve(newest)
            except SnapshotNotFoundError:
                if self.storage.exists(self.snapshot_key(newest)):
                    raise  # still there: not a snapshot removed meanwhile
        raise SnapshotNotFoundError(self._unsettled_message())

    @contextmanager
    def reading(self, step: int | None = None, *, newest_if_removed: bool = False) -> Iterator[Composite]:
        """The composite as of ``step`` (default: the newest), with a lease on every snapshot it
        needs, held until the block ends: retention leaves them in place meanwhile (``lease``)."""
        with self.lease(step, newest_if_removed=newest_if_removed) as composite:
            yield composite

    def lease(self, step: int | None = None, *, newest_if_removed: bool = False) -> LeasedComposite:
        """The composite as of ``step`` (default: the newest), with a lease on every snapshot it
        needs, held until the ``LeasedComposite`` is closed (a context manager giving the
        composite): retention leaves them in place meanwhile.

        When a snapshot of the composite was removed before its lease was taken (a writer
        with ``keep=K`` moved on), the newest composite is resolved and leased instead if
        ``step`` is None or ``newest_if_removed``; otherwise, and when a snapshot the newest
        composite needs is simply not in the run, SnapshotNotFoundError names it. Either way
        this happens before this returns, so before any tensor byte is read."""
        leases = ReadLeases(self)
        try:
            composite, lost = self.lease_composite(leases, step, follow=step is None or newest_if_removed)
            if lost:
                raise SnapshotNotFoundError(f"{self.root}: {not_restorable(composite.step, lost)}; nothing was read")
        except BaseException:
            leases.close()
            raise
        return LeasedComposite(composite, leases)

    @contextmanager
    def listed(self) -> Iterator[None]:
        """Inside the block, the run's committed snapshots are listed once (``steps``): one
        decision (which composite a restore takes) reads one listing, not one per question
        asked of it. What is committed meanwhile is seen by the next listing; other threads list
        afresh."""
        outer = getattr(self._listed, "listing", None) is not None
        if not outer:
            self._listed.listing = []
        try:
            yield
        finally:
            if not outer:
                self._listed.listing = None

    def lease_composite(
        self, leases: ReadLeases, step: int | None, follow: bool
    ) -> tuple[Composite, dict[int, list[str]]]:
        """The composite of ``step`` (default: the newest) with every snapshot of it that is in
        the run leased, and those that are not (step -> the units it should give)."""
        wanted = step
        for _ in range(_RESOLVE_ATTEMPTS):
            target = self._newest_to_lease() if wanted is None else wanted
            if target is None and (wanted is not None or (target := self._listed_again()) is None):
                raise SnapshotNotFoundError(self._no_snapshot_message(None))
            composite, lost = None, {}
            if leases.take(target):
                composite = self.resolve(target)
                # Each unit's version leased before its manifest is read (``needs``): its lease reads
                # it once written (on an object store, not looked for by a HEAD after a GET).
                refused = {source for source in sorted(set(composite.sources.values())) if not leases.take(source)}
                for source, units in self.needs(composite).items():
                    if source in refused or not leases.take(source):
                        lost.setdefault(source, []).extend(units)
                if not lost:
                    return composite, lost
            # Lost to retention only if a newer composite took over meanwhile (retention never
            # removes what the newest composite needs); otherwise the snapshot is just absent.
            if not follow or self.latest_step() == target:
                if composite is None:
                    raise SnapshotNotFoundError(self._no_snapshot_message(target))
                return composite, lost
            leases.close()
            wanted = None
        raise SnapshotNotFoundError(self._unsettled_message())

    def _listed_again(self) -> int | None:
        """``latest_step`` once more, after a listing found no committed snapshot: a run that has
        one can look empty to a listing that is not one request (a local run's: the directories,
        then each one's manifest) when, in between, a writer committed a newer snapshot and its
        retention (``keep=1``) removed the one listed. Inside ``listed`` the block's listing
        (empty) stands."""
        return self.latest_step()

    def _unsettled_message(self) -> str:
        return (
            f"{self.root}: the newest composite changed {_RESOLVE_ATTEMPTS} times while it was being resolved "
            "(a writer with keep= removes what the older ones need); try again"
        )

    def needs(self, composite: Composite) -> dict[int, list[str]]:
        """Every snapshot the composite reads, with the units it reads there: its own step (the
        global state), each unit's version, and the older snapshots whose files hold the frozen
        tensors a version keeps. Manifests only."""
        needed: dict[int, list[str]] = {composite.step: []}
        for unit, source in composite.sources.items():
            needed.setdefault(source, []).append(unit)
            try:
                ref = self.manifest(source).units.get(unit)
            except SnapshotNotFoundError:
                continue  # the version itself is gone: what it keeps is moot
            for holder in ref.kept if ref is not None else ():
                needed.setdefault(holder, []).append(unit)
        return needed

    def _no_snapshot_message(self, step: int | None) -> str:
        steps = self.steps()
        if not steps:
            return empty_run(self.root)
        if step is None:
            return f"{self.root}: no committed snapshot"
        return f"{self.root}: no committed snapshot at step {step}; committed steps: {_ranges(steps)}"


def _followed(steps: list[int], pointer: int | None, parent_of: Callable[[int], int | None]) -> int | None:
    """The newest committed composite among ``steps`` (committed, ascending) where the ``latest``
    pointer names ``pointer`` (None: none, or damaged): it, followed forward through the
    snapshots whose parent it is (``Catalog.latest_step``); the newest step where it names none
    of them (newer than the listing, or removed)."""
    if not steps:
        return None
    if pointer is None or pointer not in steps:
        return steps[-1]
    current = pointer
    while True:
        children = [s for s in steps if s > current and parent_of(s) == current]
        if not children:
            return current
        current = max(children)


def empty_run(root: object) -> str:
    """What a run directory with no committed snapshot is, and what to do (two lines)."""
    return (f"{root}: no committed snapshot in this run directory\n"
            "give a run that has saved, or call Tailor.save() into this one first")


def not_restorable(step: int, lost: dict[int, list[str]]) -> str:
    needs = "; ".join(f"step {source} (units {name_units(units)})" for source, units in sorted(lost.items()))
    return f"the composite of step {step} needs {needs}, which {'is' if len(lost) == 1 else 'are'} not in the run"


def _ranges(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:12])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > 12 else "")
