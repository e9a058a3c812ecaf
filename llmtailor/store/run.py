"""A run: its committed snapshots, its ``latest`` pointer and its composites.

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
        .readers                   the snapshot's reader lease (``store.lock``; not in the manifest)
      .tmp/                        snapshots being written (local runs); never read

This module only reads; ``writer.py`` writes.

Invariants of reading:

- Every file read lies inside the run: a local run's files resolve (symlinks followed) inside
  its root, itself resolved first; a link out of the run is refused with an IntegrityError
  naming it.
- A reader that must not lose what it reads to retention (``gc``, ``keep=K``) holds a lease on
  every snapshot of its composite (``reading``): retention leaves leased snapshots in place.
  A composite that lost a snapshot before its lease was taken is never read in part: it is
  resolved again (the newest) or refused, before any tensor byte is read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.constants import (
    CARRIED_FOR,
    GLOBAL_JSON,
    GLOBAL_TENSORS,
    LATEST_FILE,
    MANIFEST_FILE,
    SNAPSHOT_PREFIX,
    SNAPSHOTS_DIR,
    STATEFUL_KEY,
    TMP_DIR,
    layer_unit,
    rank_state_files,
    snapshot_dirname,
)
from llmtailor.errors import ConfigError, IntegrityError, SnapshotNotFoundError, TailorError
from llmtailor.layouts import Layout, load_family, name_units
from llmtailor.store.files import (
    check_stored_header,
    read_checked_tensors,
    read_stored,
    read_stored_tensors,
    stored_problem,
)
from llmtailor.store.storage import Lease, Storage, open_storage
from llmtailor.store import dtypes
from llmtailor.store.keys import lacking_weights
from llmtailor.store.manifest import Chunk, FileEntry, Manifest, TensorEntry, UnitEntry, load_unit_entry, parse_manifest

if TYPE_CHECKING:
    import torch


_UNIT_CACHE = 64  # unit indexes kept in memory (each is small; a run can hold thousands)
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


@dataclass
class Verification:
    """What ``Run.check`` found. ``problems``: damage (exit 1 at the CLI). ``notes``: what is not
    damage but worth saying (a snapshot removed by retention while the check ran, an older
    composite no longer restorable because retention removed a snapshot it needs)."""

    checked: list[int] = field(default_factory=list)
    """Snapshots whose files were checked, ascending."""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    base_checked: set[tuple[str, str]] = field(default_factory=set)
    """Base model directory files checked (each once)."""


class ReadLeases:
    """Shared leases on snapshots of one run (``store.lock``), held until ``close``; a context
    manager. While a lease is held, retention does not remove that snapshot."""

    def __init__(self, run: Run):
        self.run = run
        self._held: dict[int, Lease] = {}

    def take(self, step: int) -> bool:
        """Lease the snapshot of ``step``; False when it is not (or no longer) a committed
        snapshot of the run. A snapshot directory that resolves outside the run raises."""
        if step in self._held:
            return True
        snapshot = self.run.snapshot_key(step)
        storage = self.run.storage
        lease = storage.lease_for_reading(snapshot) if storage.is_file(f"{snapshot}/{MANIFEST_FILE}") else None
        if lease is None:
            self.run.forget([step])  # a snapshot of this step written later is another one
            return False
        self._held[step] = lease
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


class Run:
    """Read access to a run, at a local path or an object-store URL (``storage_options``: the
    store's options, ``store.storage.open_storage``). Manifests are cached; tensor bytes are
    read per unit."""

    def __init__(self, root: str | Path | Storage, storage_options: dict[str, Any] | None = None):
        self.storage: Storage = open_storage(root, storage_options)
        self.root = self.storage.root
        self._manifests: dict[int, Manifest] = {}
        self._units: dict[tuple[int, str], UnitEntry] = {}
        self._bases: dict[str, Storage] = {}

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
        """Steps of the committed snapshots (those whose manifest exists), ascending."""
        found = []
        for name in self.storage.list_dir(SNAPSHOTS_DIR):
            step = parse_snapshot_name(name)
            if step is not None and self.storage.is_file(f"{SNAPSHOTS_DIR}/{name}/{MANIFEST_FILE}"):
                found.append(step)
        return sorted(found)

    def manifest(self, step: int) -> Manifest:
        if step not in self._manifests:
            key = f"{self.snapshot_key(step)}/{MANIFEST_FILE}"
            if not self.storage.is_file(key):
                raise SnapshotNotFoundError(self._no_snapshot_message(step))
            try:
                raw = self.storage.read(key)
            except IntegrityError:
                if not self.storage.is_file(key):  # removed (by retention) since it was found
                    raise SnapshotNotFoundError(self._no_snapshot_message(step)) from None
                raise
            manifest = parse_manifest(bytes(raw), self.storage.where(key))
            if manifest.step != step:
                raise IntegrityError(f"{self.storage.where(key)}: manifest says step {manifest.step}, directory says {step}")
            self._manifests[step] = manifest
        return self._manifests[step]

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
        """Drop cached manifests of snapshots that were removed."""
        for step in steps:
            self._manifests.pop(step, None)
        self._units = {k: v for k, v in self._units.items() if k[0] not in steps}

    def latest_step(self) -> int | None:
        """The newest committed composite: the ``latest`` pointer, followed forward through any
        snapshot committed after it whose parent it is (a crash can fall between the commit
        and the pointer update). Snapshots of an abandoned branch are not followed."""
        steps = self.steps()
        if not steps:
            return None
        pointer = self._read_pointer()
        if pointer is None or pointer not in steps:
            return steps[-1]
        current = pointer
        while True:
            children = [s for s in steps if s > current and self._parent_if_present(s) == current]
            if not children:
                return current
            current = max(children)

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
            if newest is None:
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
        needs, held until the block ends: retention leaves them in place meanwhile.

        When a snapshot of the composite was removed before its lease was taken (a writer
        with ``keep=K`` moved on), the newest composite is resolved and leased instead if
        ``step`` is None or ``newest_if_removed``; otherwise, and when a snapshot the newest
        composite needs is simply not in the run, SnapshotNotFoundError names it. Either way
        this happens before the block runs, so before any tensor byte is read."""
        with ReadLeases(self) as leases:
            composite, lost = self._lease_composite(leases, step, follow=step is None or newest_if_removed)
            if lost:
                raise SnapshotNotFoundError(f"{self.root}: {_not_restorable(composite.step, lost)}; nothing was read")
            yield composite

    def _lease_composite(
        self, leases: ReadLeases, step: int | None, follow: bool
    ) -> tuple[Composite, dict[int, list[str]]]:
        """The composite of ``step`` (default: the newest) with every snapshot of it that is in
        the run leased, and those that are not (step -> the units it should give)."""
        wanted = step
        for _ in range(_RESOLVE_ATTEMPTS):
            target = self.latest_step() if wanted is None else wanted
            if target is None:
                raise SnapshotNotFoundError(self._no_snapshot_message(None))
            composite, lost = None, {}
            if leases.take(target):
                composite = self.resolve(target)
                for source, units in self.needs(composite).items():
                    if not leases.take(source):
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

    def _unsettled_message(self) -> str:
        return (
            f"{self.root}: the newest composite changed {_RESOLVE_ATTEMPTS} times while it was being resolved "
            "(a writer with keep= removes what the older ones need); try again"
        )

    def unit_entry(self, step: int, unit: str) -> UnitEntry:
        """The index of ``unit`` as saved at ``step`` (its files, tensors and chunks), checked
        against the manifest's checksum; frozen tensors it keeps from older snapshots or the
        base model directory merged in (their files tagged with their ``origin``). Reads small
        files only; no tensor byte."""
        key = (step, unit, "merged")
        if key not in self._units:
            stored = self._stored_entry(step, unit)
            self._cache(key, self._merged(stored) if stored.kept or stored.base else stored)
        return self._units[key]

    def _stored_entry(self, step: int, unit: str) -> UnitEntry:
        """The index file of ``unit`` at ``step`` as written (only what it holds itself)."""
        key = (step, unit)
        if key not in self._units:
            manifest = self.manifest(step)
            ref = manifest.units.get(unit)
            if ref is None:
                raise IntegrityError(f"snapshot {step} holds no unit {unit!r} although a composite names it")
            where = f"{self.snapshot_key(step)}/{ref.index.path}"
            raw = read_stored(self.storage, where, ref.index)
            self._cache(key, load_unit_entry(bytes(raw), self.storage.where(where), unit, step))
        return self._units[key]

    def stored_files(self, step: int) -> list[FileEntry]:
        """Every file the snapshot of ``step`` holds itself but its manifest: its global state
        and rank files, its unit indexes and the unit files they list (not what a unit keeps
        from older snapshots or the base directory). Reads the indexes, checked."""
        manifest = self.manifest(step)
        files = list(manifest.files)
        for unit, ref in manifest.units.items():
            files.append(ref.index)
            files += self._stored_entry(step, unit).files
        return files

    def _cache(self, key: tuple, entry: UnitEntry) -> None:
        if len(self._units) >= _UNIT_CACHE:
            self._units.pop(next(iter(self._units)))
        self._units[key] = entry

    def _merged(self, stored: UnitEntry) -> UnitEntry:
        """``stored`` with the tensors it keeps: each from the index of the snapshot that wrote
        it (which must hold it itself), or from the base directory."""
        files = list(stored.files)
        tensors = list(stored.tensors)
        holders: dict[int, list[str]] = {}
        for tensor_key, holder in stored.kept.items():
            holders.setdefault(holder, []).append(tensor_key)
        for holder, keys in sorted(holders.items()):
            source = self._stored_entry(holder, stored.unit)
            for tensor_key in keys:
                held = source.tensor(tensor_key)
                if held is None:
                    raise IntegrityError(f"snapshot {stored.step} keeps {tensor_key!r} of unit {stored.unit!r} from step "
                                         f"{holder}, which does not hold it")
                chunks = []
                for chunk in held.chunks:
                    files.append(source.files[chunk.file].model_copy(update={"origin": holder}))
                    chunks.append(chunk.model_copy(update={"file": len(files) - 1}))
                tensors.append(held.model_copy(update={"chunks": chunks}))
        if stored.base:
            base = self.manifest(stored.step).base
            listed = {f.path: f for f in (base.files if base is not None else [])}
            for tensor_key, ref in stored.base.items():
                if ref.file not in listed:
                    raise IntegrityError(f"snapshot {stored.step}: {tensor_key!r} is kept from base file {ref.file!r}, "
                                         "which its manifest does not list")
                files.append(listed[ref.file].model_copy(update={"origin": "base"}))
                whole = Chunk(file=len(files) - 1, offsets=[0] * len(ref.shape), shape=list(ref.shape), xxh3_64=ref.xxh3_64)
                tensors.append(TensorEntry(key=tensor_key, dtype=ref.dtype, shape=list(ref.shape),
                                           chunks=[whole.model_copy(update={"stored_as": ref.name})]))
        return stored.model_copy(update={"files": files, "tensors": tensors})

    def base_ref(self, step: int, unit: str, key: str) -> dict[str, Any]:
        """Where the version of ``unit`` at ``step`` keeps tensor ``key`` from the base model
        directory (a ``BaseRef`` as JSON)."""
        ref = self._stored_entry(step, unit).base.get(key)
        if ref is None:
            raise IntegrityError(f"snapshot {step}: unit {unit!r} keeps no {key!r} from the base directory")
        return ref.model_dump(mode="json")

    def check_base(self, composite: Composite) -> None:
        """The base model directory the composite keeps tensors from is there, every file of
        it at its recorded size (a cheap check before a restore; each tensor read from it is
        checked against its checksum). IntegrityError naming the file otherwise."""
        bases = {self.manifest(s).base.path: s for s in self.needs(composite) if self.manifest(s).base}
        for step in bases.values():
            storage = self.base_storage(step)
            for file in self.manifest(step).base.files:
                try:
                    size = storage.size(file.path)
                except TailorError as err:
                    raise IntegrityError(str(err)) from None
                if size is None:
                    raise IntegrityError(f"{storage.where(file.path)}: file is missing (the base model directory the run "
                                         "keeps frozen tensors from)")
                if size != file.bytes:
                    raise IntegrityError(f"{storage.where(file.path)}: {size} bytes, the run recorded {file.bytes} "
                                         "(the base model changed)")

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

    def base_storage(self, step: int) -> Storage:
        """The storage of the base model directory the snapshot of ``step`` keeps tensors from
        (its files resolve inside it)."""
        base = self.manifest(step).base
        if base is None:
            raise IntegrityError(f"snapshot {step} keeps a base file but names no base directory")
        if base.path not in self._bases:
            self._bases[base.path] = open_storage(base.path)
        return self._bases[base.path]

    def file_location(self, step: int, file: FileEntry) -> tuple[Storage, str]:
        """Where a file of a unit's merged view (saved at ``step``) lies: the storage and key
        (the run's, or the base directory's for a base file)."""
        if file.origin == "base":
            return self.base_storage(step), file.path
        return self.storage, f"{self.snapshot_key(step if file.origin is None else file.origin)}/{file.path}"

    def read_unit(self, step: int, unit: str, skip: set[str] = frozenset()) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Tensors (by key, but those in ``skip``) and non-tensor optimizer values of ``unit`` as
        saved at ``step``.

        Every snapshot file is checked against its checksum; every tensor against the index's
        dtype and shape; a tensor kept from the base directory against its own checksum (its
        file may be large and hold other units). Chunks are assembled into the global tensor."""
        entry = self.unit_entry(step, unit)
        expected: dict[int, dict[str, tuple[str, list[int], str]]] = {}
        wanted = [t for t in entry.tensors if t.key not in skip]
        for tensor in wanted:
            for chunk in tensor.chunks:
                expected.setdefault(chunk.file, {})[tensor.chunk_key(chunk)] = (tensor.dtype, chunk.shape, chunk.xxh3_64)
        places = {position: self.file_location(step, entry.files[position]) for position in expected}
        for position, tensors in expected.items():  # every header first: no tensor byte read yet
            storage, key = places[position]
            check_stored_header(storage, key, entry.files[position], {k: v[:2] for k, v in tensors.items()})
        loaded = {}
        for position in sorted(expected):
            storage, key = places[position]
            if entry.files[position].origin == "base":
                loaded[position] = read_checked_tensors(storage, key, {k: v[2] for k, v in expected[position].items()})
            else:
                loaded[position] = read_stored_tensors(storage, key, entry.files[position])
        names = {position: storage.where(key) for position, (storage, key) in places.items()}
        tensors = {t.key: _assemble(t, entry, loaded, names) for t in wanted}
        return tensors, {name: dict(values) for name, values in entry.values.items()}

    def read_global(self, step: int) -> dict[str, Any]:
        """The global state saved at ``step``: what all ranks share (step, optimizer groups, LR
        scheduler, model config) and rank 0's own RNG states, extras and stateful objects' states."""
        return self._read_state(step, GLOBAL_JSON, GLOBAL_TENSORS)

    def read_rank_state(self, step: int, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s own RNG states, extras and stateful objects' states as saved at
        ``step`` (rank 0: from the global state), or None when no rank of that number took part
        in the save."""
        if rank == 0:
            state = self.read_global(step)
            return {key: state.get(key) for key in ("rng", "extra", STATEFUL_KEY)}
        doc, tensors = rank_state_files(rank)
        if not any(entry.path == doc for entry in self.manifest(step).files):
            return None
        return self._read_state(step, doc, tensors)

    def _read_state(self, step: int, doc_path: str, tensors_path: str) -> dict[str, Any]:
        from llmtailor.store import codec  # imports torch, which reading a layout does not need

        manifest = self.manifest(step)
        snapshot, where = self.snapshot_key(step), self.where(step, doc_path)
        raw = read_stored(self.storage, f"{snapshot}/{doc_path}", manifest.file_entry(doc_path))
        try:
            doc = json.loads(bytes(raw))
        except (ValueError, RecursionError) as err:
            raise IntegrityError(f"{where}: not valid JSON ({err})") from None
        tensors = read_stored_tensors(self.storage, f"{snapshot}/{tensors_path}", manifest.file_entry(tensors_path))
        state = codec.decode(doc, tensors, where=where)
        if not isinstance(state, dict):
            raise IntegrityError(f"{where}: expected an object at the top level")
        return state

    def verify(self, step: int | None = None) -> list[str]:
        """The problems ``check`` finds; an empty list means all is well."""
        return self.check(step).problems

    def check(self, step: int | None = None) -> Verification:
        """Verify the run: every file of every committed snapshot (or of the composite as of
        ``step``) against its size and checksum, and that the composites restore.

        The rule: a problem is a file that is missing, damaged, unreadable or outside the run,
        a composite naming a snapshot that does not hold the unit, a snapshot lacking part of
        the model (``_model_problems``: a unit of its layout its composite does not name, a
        layer its model config counts that its layout lacks), or the composite checked
        (``step``'s, or the newest) not restorable because a snapshot it needs is not in the
        run; an older composite that no longer restores because retention removed a snapshot
        it needs is a note (retention keeps only what the newest K composites need). The
        checked composite is leased for the whole check, each other snapshot while its files
        are checked; a snapshot removed by retention before it was leased is a note."""
        result = Verification()
        if step is None and not self.steps():
            return result  # nothing committed (yet): nothing to be wrong
        with ReadLeases(self) as leases:
            try:
                composite, lost = self._lease_composite(leases, step, follow=step is None)
            except SnapshotNotFoundError:
                raise  # no snapshot (at that step): the user's mistake, not damage
            except TailorError as err:  # a damaged manifest on the way to the newest composite
                result.problems.append(str(err))
                composite, lost = None, {}
            if composite is not None and lost:
                result.problems.append(f"{_not_restorable(composite.step, lost)}, so it cannot be restored")
            if step is None:
                targets: dict[int, set[str] | None] = {s: None for s in self.steps()}
            elif composite is None:
                targets = {step: None}
            else:
                targets = {source: set(units) for source, units in self.needs(composite).items() if source not in lost}
                targets[composite.step] = None  # the snapshot of `step` is needed whole (global state)
            for source, units in sorted(targets.items()):
                pinned = leases.holds(source)
                try:
                    if not leases.take(source):
                        result.notes.append(f"snapshot {source} was removed while verify ran (by retention); not checked")
                        continue
                    self._check_snapshot(source, units, step, result)
                except TailorError as err:
                    result.problems.append(str(err))
                finally:
                    if not pinned:
                        leases.release(source)  # one at a time: a run may hold more snapshots than descriptors
            if step is None:
                self._check_composites(composite.step if composite else None, result)
        result.checked.sort()
        result.problems = list(dict.fromkeys(result.problems))  # a damaged manifest is met twice
        return result

    def _check_snapshot(self, source: int, units: set[str] | None, step: int | None, result: Verification) -> None:
        manifest = self.manifest(source)
        snapshot = self.snapshot_key(source)

        def problem_of(entry: FileEntry) -> str | None:
            return stored_problem(self.storage, f"{snapshot}/{entry.path}", entry)

        lacking = sorted(set(units or ()) - set(manifest.units))
        if lacking:
            result.problems.append(f"snapshot {source} holds no unit {lacking} although the composite of step {step} names it")
        for entry in manifest.files:
            problem = problem_of(entry)
            if problem:
                result.problems.append(problem)
        for unit in sorted(set(units or manifest.units) & set(manifest.units)):
            try:
                files = self._stored_entry(source, unit).files  # what this snapshot holds itself
                self.unit_entry(source, unit)  # and what it keeps resolves
            except TailorError as err:
                result.problems.append(str(err))
                continue
            result.problems += [p for p in (problem_of(f) for f in files) if p]
        if manifest.base is not None:
            base = self.base_storage(source)
            for file in manifest.base.files:
                if (manifest.base.path, file.path) not in result.base_checked:
                    result.base_checked.add((manifest.base.path, file.path))
                    problem = stored_problem(base, file.path, file)
                    if problem:
                        result.problems.append(f"base model directory: {problem}")
        if units is None:  # checked whole: its own composite and layout too
            result.problems += self._model_problems(source, manifest)
        result.checked.append(source)

    def _model_problems(self, step: int, manifest: Manifest) -> list[str]:
        """Whether the snapshot of ``step`` holds the whole model: its composite names a version
        of every unit of its layout and no other, and its layout holds every layer its model
        config counts (where its family names the config's key). A snapshot committed by ranks
        holding different layers (pipeline stages, before they were refused) fails here."""
        try:
            layout = Layout.from_record(manifest.layout)
        except ConfigError as err:
            return [f"the manifest of step {step}: {err}"]
        problems = []
        unnamed = [u for u in layout.units if u not in manifest.composite]
        if unnamed:
            problems.append(f"the composite of step {step} names no version of units [{name_units(unnamed)}] that its "
                            "layout holds, so it cannot be restored")
        foreign = [u for u in manifest.composite if u not in layout.units]
        if foreign:
            problems.append(f"the composite of step {step} names units [{name_units(foreign)}] that its layout lacks")
        depth = self._configured_depth(step, manifest, layout.family)
        if depth is not None:
            missing = [layer_unit(i) for i in range(depth[1]) if layer_unit(i) not in layout.units]
            if missing:
                problems.append(f"the layout of step {step} lacks units [{name_units(missing)}] of the {depth[1]} "
                                f"layers its model config names ({depth[0]}): part of the model was not saved")
        for unit in manifest.units:  # each version written here holds (or keeps) every weight of its unit
            try:
                keys = {tensor.key for tensor in self.unit_entry(step, unit).tensors}
            except TailorError:
                continue  # a damaged index: reported with the snapshot's files
            lacking = lacking_weights(layout.units.get(unit, ()), keys)
            if lacking:
                problems.append(f"unit {unit!r} of step {step} lacks (neither writes nor keeps) the weights of "
                                f"[{name_units(lacking)}]")
        return problems

    def _configured_depth(self, step: int, manifest: Manifest, family: str) -> tuple[str, int] | None:
        """(key, value) of the number of layers the model config saved at ``step`` names, where
        the layout's family says which key holds it; None where it is not known."""
        try:
            key = load_family(family).num_layers_key
        except ConfigError:
            return None  # a family this version does not ship
        if key is None or not any(entry.path == GLOBAL_JSON for entry in manifest.files):
            return None
        try:
            raw = read_stored(self.storage, f"{self.snapshot_key(step)}/{GLOBAL_JSON}", manifest.file_entry(GLOBAL_JSON))
            config = json.loads(bytes(raw)).get("model_config")
        except (TailorError, OSError, ValueError, RecursionError, AttributeError):
            return None  # a damaged file: reported with the snapshot's files
        depth = config.get(key) if isinstance(config, dict) else None
        return (key, depth) if isinstance(depth, int) and not isinstance(depth, bool) else None

    def _check_composites(self, newest: int | None, result: Verification) -> None:
        """Every checked snapshot's composite: a source present but lacking the unit is damage
        (retention removes whole snapshots); a source not in the run is a note, but for the
        newest composite (a problem already)."""
        present = set(self.steps())
        for step in result.checked:
            carrier = CARRIED_FOR in self.manifest(step).notes  # promoted to a tier for a newer composite only
            lost: dict[int, list[str]] = {}
            for unit, source in self.manifest(step).composite.items():
                if source == step:
                    continue
                if source not in present:
                    lost.setdefault(source, []).append(unit)
                    continue
                try:
                    holds = unit in self.manifest(source).units
                except TailorError:
                    continue  # its manifest is damaged: reported with that snapshot
                if not holds:
                    result.problems.append(
                        f"snapshot {source} holds no unit {[unit]} although the composite of step {step} names it"
                    )
            if lost and step != newest and not carrier:
                result.notes.append(f"{_not_restorable(step, lost)} (removed by retention?)")

    def _no_snapshot_message(self, step: int | None) -> str:
        steps = self.steps()
        if not steps:
            return f"{self.root}: no committed snapshot in this run directory"
        if step is None:
            return f"{self.root}: no committed snapshot"
        return f"{self.root}: no committed snapshot at step {step}; committed steps: {_ranges(steps)}"


def _not_restorable(step: int, lost: dict[int, list[str]]) -> str:
    needs = "; ".join(f"step {source} (units {name_units(units)})" for source, units in sorted(lost.items()))
    return f"the composite of step {step} needs {needs}, which is not in the run"


def parse_snapshot_name(name: str) -> int | None:
    """The step of a snapshot directory name (``step-00000100``), or None for any other name."""
    match = re.fullmatch(re.escape(SNAPSHOT_PREFIX) + r"([0-9]+)", name)
    return int(match.group(1)) if match else None


def _assemble(
    entry: TensorEntry, unit: UnitEntry, loaded: dict[int, dict[str, torch.Tensor]], paths: dict[int, str]
) -> torch.Tensor:
    pieces = []
    for chunk in entry.chunks:
        tensors, path, key = loaded[chunk.file], paths[chunk.file], entry.chunk_key(chunk)
        if key not in tensors:
            raise IntegrityError(f"{path}: tensor {key!r} is missing")
        piece = tensors[key]
        if piece.dtype != entry.torch_dtype or list(piece.shape) != chunk.shape:
            raise IntegrityError(
                f"{path}: tensor {key!r} is {piece.dtype} {list(piece.shape)}, index says {entry.dtype} {chunk.shape}"
            )
        pieces.append((chunk, piece))
    if len(pieces) == 1 and pieces[0][0].shape == entry.shape:
        return pieces[0][1]
    import torch  # the pieces are tensors: torch is loaded already

    whole = torch.empty(entry.shape, dtype=entry.torch_dtype)
    for chunk, piece in pieces:
        index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
        whole[index] = piece
    return whole


def _ranges(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:12])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > 12 else "")


def tensor_bytes(entry: TensorEntry) -> int:
    return math.prod(entry.shape) * dtypes.itemsize(entry.dtype)
