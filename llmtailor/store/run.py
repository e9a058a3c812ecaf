"""A run directory: its committed snapshots, its ``latest`` pointer and its composites.

Layout on disk::

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
      .tmp/                        snapshots being written; never read

This module only reads; ``writer.py`` writes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.constants import (
    GLOBAL_JSON,
    GLOBAL_TENSORS,
    LATEST_FILE,
    MANIFEST_FILE,
    SNAPSHOT_PREFIX,
    SNAPSHOTS_DIR,
    TMP_DIR,
    rank_state_files,
    snapshot_dirname,
)
from llmtailor.errors import IntegrityError, SnapshotNotFoundError, TailorError
from llmtailor.store.files import check_file, check_header, read_tensors, read_verified
from llmtailor.store import dtypes
from llmtailor.store.manifest import Manifest, TensorEntry, UnitEntry, load_manifest, load_unit_entry

if TYPE_CHECKING:
    import torch


_UNIT_CACHE = 64  # unit indexes kept in memory (each is small; a run can hold thousands)


@dataclass(frozen=True)
class Composite:
    """The checkpoint as of ``step``: each unit from the snapshot at ``sources[unit]``, global
    state from ``step`` itself."""

    step: int
    manifest: Manifest
    sources: dict[str, int]


class Run:
    """Read access to a run directory. Manifests are cached; tensor bytes are read per unit."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._manifests: dict[int, Manifest] = {}
        self._units: dict[tuple[int, str], UnitEntry] = {}

    @property
    def snapshots_dir(self) -> Path:
        return self.root / SNAPSHOTS_DIR

    @property
    def tmp_dir(self) -> Path:
        return self.root / TMP_DIR

    def snapshot_dir(self, step: int) -> Path:
        return self.snapshots_dir / snapshot_dirname(step)

    def steps(self) -> list[int]:
        """Steps of the committed snapshots (those whose manifest exists), ascending."""
        if not self.snapshots_dir.is_dir():
            return []
        found = []
        for child in self.snapshots_dir.iterdir():
            step = parse_snapshot_name(child.name)
            if step is not None and (child / MANIFEST_FILE).is_file():
                found.append(step)
        return sorted(found)

    def manifest(self, step: int) -> Manifest:
        if step not in self._manifests:
            path = self.snapshot_dir(step) / MANIFEST_FILE
            if not path.is_file():
                raise SnapshotNotFoundError(self._no_snapshot_message(step))
            manifest = load_manifest(path)
            if manifest.step != step:
                raise IntegrityError(f"{path}: manifest says step {manifest.step}, directory says {step}")
            self._manifests[step] = manifest
        return self._manifests[step]

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
            children = [s for s in steps if s > current and self.manifest(s).parent == current]
            if not children:
                return current
            current = max(children)

    def _read_pointer(self) -> int | None:
        try:
            name = (self.root / LATEST_FILE).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None  # a damaged pointer is ignored: the newest committed snapshot stands in
        return parse_snapshot_name(name)

    def resolve(self, step: int | None = None) -> Composite:
        """The composite as of ``step`` (default: the newest). Reads one manifest."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise SnapshotNotFoundError(self._no_snapshot_message(None))
        manifest = self.manifest(step)
        return Composite(step=step, manifest=manifest, sources=dict(manifest.composite))

    def unit_entry(self, step: int, unit: str) -> UnitEntry:
        """The index of ``unit`` as saved at ``step`` (its files, tensors and chunks), checked
        against the manifest's checksum. Reads one small file; no tensor byte."""
        key = (step, unit)
        if key not in self._units:
            manifest = self.manifest(step)
            ref = manifest.units.get(unit)
            if ref is None:
                raise IntegrityError(f"snapshot {step} holds no unit {unit!r} although a composite names it")
            root = self.snapshot_dir(step)
            entry = load_unit_entry(read_verified(root, ref.index), root / ref.index.path, unit, step)
            if len(self._units) >= _UNIT_CACHE:
                self._units.pop(next(iter(self._units)))
            self._units[key] = entry
        return self._units[key]

    def read_unit(self, step: int, unit: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Tensors (by key) and non-tensor optimizer values of ``unit`` as saved at ``step``.

        Every file is checked against its checksum; every tensor against the index's dtype
        and shape. Chunks are assembled into the global tensor."""
        entry = self.unit_entry(step, unit)
        root = self.snapshot_dir(step)
        expected: dict[int, dict[str, tuple[str, list[int]]]] = {}
        for tensor in entry.tensors:
            for chunk in tensor.chunks:
                expected.setdefault(chunk.file, {})[tensor.chunk_key(chunk)] = (tensor.dtype, chunk.shape)
        for position, tensors in expected.items():  # every header first: no tensor byte read yet
            check_header(root, entry.files[position], tensors)
        loaded = {position: read_tensors(root, entry.files[position]) for position in sorted(expected)}
        tensors = {t.key: _assemble(t, entry, loaded, root) for t in entry.tensors}
        return tensors, {name: dict(values) for name, values in entry.values.items()}

    def read_global(self, step: int) -> dict[str, Any]:
        """The global state saved at ``step``: what all ranks share (step, optimizer groups, LR
        scheduler, model config) and rank 0's own RNG states and extras."""
        return self._read_state(step, GLOBAL_JSON, GLOBAL_TENSORS)

    def read_rank_state(self, step: int, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s own RNG states and extras as saved at ``step`` (rank 0: from the
        global state), or None when no rank of that number took part in the save."""
        if rank == 0:
            state = self.read_global(step)
            return {key: state.get(key) for key in ("rng", "extra")}
        doc, tensors = rank_state_files(rank)
        if not any(entry.path == doc for entry in self.manifest(step).files):
            return None
        return self._read_state(step, doc, tensors)

    def _read_state(self, step: int, doc_path: str, tensors_path: str) -> dict[str, Any]:
        from llmtailor.store import codec  # imports torch, which reading a layout does not need

        manifest = self.manifest(step)
        root = self.snapshot_dir(step)
        raw = read_verified(root, manifest.file_entry(doc_path))
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as err:
            raise IntegrityError(f"{root / doc_path}: not valid JSON ({err})") from None
        tensors = read_tensors(root, manifest.file_entry(tensors_path))
        state = codec.decode(doc, tensors, where=f"{root / doc_path}")
        if not isinstance(state, dict):
            raise IntegrityError(f"{root / doc_path}: expected an object at the top level")
        return state

    def verify(self, step: int | None = None) -> list[str]:
        """Problems with the composite as of ``step`` (default: every committed snapshot).

        Checks every file a composite needs (or every file of every snapshot) against its
        checksum; an empty list means all is well."""
        problems: list[str] = []
        if step is None:
            targets: dict[int, set[str] | None] = {s: None for s in self.steps()}
        else:
            composite = self.resolve(step)
            targets = {}
            for unit, source in composite.sources.items():
                targets.setdefault(source, set()).add(unit)
            targets[step] = None  # the snapshot of `step` is needed whole (global state)
        for source, units in sorted(targets.items()):
            try:
                manifest = self.manifest(source)
            except TailorError as err:
                problems.append(str(err))
                continue
            root = self.snapshot_dir(source)
            lacking = sorted(set(units or ()) - set(manifest.units))
            if lacking:
                problems.append(f"snapshot {source} holds no unit {lacking} although the composite of step {step} names it")
            for entry in manifest.files:
                problem = check_file(root, entry)
                if problem:
                    problems.append(problem)
            for unit in sorted(set(units or manifest.units) & set(manifest.units)):
                try:
                    files = self.unit_entry(source, unit).files
                except TailorError as err:
                    problems.append(str(err))
                    continue
                problems += [p for p in (check_file(root, f) for f in files) if p]
        return problems

    def _no_snapshot_message(self, step: int | None) -> str:
        steps = self.steps()
        if not steps:
            return f"{self.root}: no committed snapshot in this run directory"
        if step is None:
            return f"{self.root}: no committed snapshot"
        return f"{self.root}: no committed snapshot at step {step}; committed steps: {_ranges(steps)}"


def parse_snapshot_name(name: str) -> int | None:
    """The step of a snapshot directory name (``step-00000100``), or None for any other name."""
    match = re.fullmatch(re.escape(SNAPSHOT_PREFIX) + r"([0-9]+)", name)
    return int(match.group(1)) if match else None


def _assemble(
    entry: TensorEntry, unit: UnitEntry, loaded: dict[int, dict[str, torch.Tensor]], root: Path
) -> torch.Tensor:
    pieces = []
    for chunk in entry.chunks:
        tensors, path, key = loaded[chunk.file], root / unit.files[chunk.file].path, entry.chunk_key(chunk)
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
