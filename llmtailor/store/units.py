"""A run's units, read: the unit indexes (checked against the manifest, cached, and merged with
the frozen tensors a version keeps from older snapshots or the base model directory) and the
tensors and values they name, each file checked against its checksum and each tensor against
the index's dtype and shape before it is used; and the global and per-rank state of a snapshot.
The run's catalog (``catalog.py``: manifests, composites) says which snapshot holds what.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llmtailor.constants import GLOBAL_JSON, GLOBAL_TENSORS, STATEFUL_KEY, is_pack, rank_state_files
from llmtailor.errors import IntegrityError, TailorError
from llmtailor.store.catalog import Catalog, Composite
from llmtailor.store.checked import check_stored_header, read_checked_tensors, read_stored, read_stored_parts, read_stored_tensors
from llmtailor.store.manifest import Chunk, FileEntry, TensorEntry, UnitEntry, load_unit_entry
from llmtailor.store.storage import Storage, open_storage

if TYPE_CHECKING:
    import torch

_UNIT_CACHE = 512
"""Unit indexes kept in memory (each is small; a run can hold thousands). A restore of a
composite looks each unit's index up several times, stored and merged, with those of the
snapshots it keeps frozen tensors from: at 64 a 32-layer LoRA's working set (about 100) was
evicted before it was used again, and read and validated some 300 times a restore."""
_PACK_HEADERS = 8
"""Pack-file headers kept (``UnitReader.read``): a pack holds every small unit of a rank, so its
header is read and validated once for all of them, not once per unit."""


class UnitReader:
    """The unit read path of a run (module docstring), over its ``catalog``. Unit indexes and
    base-directory storages are cached; tensor bytes are read per unit."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self._units: dict[tuple, UnitEntry] = {}
        self._bases: dict[str, Storage] = {}
        self._pack_headers: dict[tuple[str, str], tuple[int, dict[str, dict]]] = {}

    def forget(self, steps: list[int]) -> None:
        """Drop cached indexes of snapshots that were removed."""
        self._units = {k: v for k, v in self._units.items() if k[0] not in steps}
        self._pack_headers.clear()

    def entry(self, step: int, unit: str) -> UnitEntry:
        """The index of ``unit`` as saved at ``step`` (its files, tensors and chunks), checked
        against the manifest's checksum; frozen tensors it keeps from older snapshots or the
        base model directory merged in (their files tagged with their ``origin``). Reads small
        files only; no tensor byte."""
        key = (step, unit, "merged")
        if key not in self._units:
            stored = self.stored_entry(step, unit)
            self._cache(key, self._merged(stored) if stored.kept or stored.base else stored)
        return self._units[key]

    def stored_entry(self, step: int, unit: str) -> UnitEntry:
        """The index file of ``unit`` at ``step`` as written (only what it holds itself)."""
        key = (step, unit)
        if key not in self._units:
            manifest = self.catalog.manifest(step)
            ref = manifest.units.get(unit)
            if ref is None:
                raise IntegrityError(f"snapshot {step} holds no unit {unit!r} although a composite names it")
            where = f"{self.catalog.snapshot_key(step)}/{ref.index.path}"
            raw = read_stored(self.catalog.storage, where, ref.index)
            self._cache(key, load_unit_entry(bytes(raw), self.catalog.storage.where(where), unit, step))
        return self._units[key]

    def stored_files(self, step: int) -> list[FileEntry]:
        """Every file the snapshot of ``step`` holds itself but its manifest: its global state
        and rank files, its unit indexes and the unit files they list (not what a unit keeps
        from older snapshots or the base directory). Reads the indexes, checked."""
        manifest = self.catalog.manifest(step)
        files = list(manifest.files)
        for unit, ref in manifest.units.items():
            files.append(ref.index)
            files += self.stored_entry(step, unit).files
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
            source = self.stored_entry(holder, stored.unit)
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
            base = self.catalog.manifest(stored.step).base
            listed = {f.path: f for f in (base.files if base is not None else [])}
            for tensor_key, ref in stored.base.items():
                if ref.file not in listed:
                    raise IntegrityError(f"snapshot {stored.step}: {tensor_key!r} is kept from base file {ref.file!r}, "
                                         "which its manifest does not list")
                files.append(listed[ref.file].model_copy(update={"origin": "base"}))
                whole = Chunk(file=len(files) - 1, offsets=[0] * len(ref.shape), shape=list(ref.shape), xxh3_64=ref.xxh3_64,
                              sample_xxh3=ref.sample_xxh3)
                tensors.append(TensorEntry(key=tensor_key, dtype=ref.dtype, shape=list(ref.shape),
                                           chunks=[whole.model_copy(update={"stored_as": ref.name})]))
        return stored.model_copy(update={"files": files, "tensors": tensors})

    def base_ref(self, step: int, unit: str, key: str) -> dict[str, Any]:
        """Where the version of ``unit`` at ``step`` keeps tensor ``key`` from the base model
        directory (a ``BaseRef`` as JSON)."""
        ref = self.stored_entry(step, unit).base.get(key)
        if ref is None:
            raise IntegrityError(f"snapshot {step}: unit {unit!r} keeps no {key!r} from the base directory")
        return ref.model_dump(mode="json")

    def check_base(self, composite: Composite) -> None:
        """The base model directory the composite keeps tensors from is there, every file of
        it at its recorded size (a cheap check before a restore; each tensor read from it is
        checked against its checksum). IntegrityError naming the file otherwise."""
        bases = {self.catalog.manifest(s).base.path: s for s in self.catalog.needs(composite) if self.catalog.manifest(s).base}
        for step in bases.values():
            storage = self.base_storage(step)
            for file in self.catalog.manifest(step).base.files:
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

    def base_storage(self, step: int) -> Storage:
        """The storage of the base model directory the snapshot of ``step`` keeps tensors from
        (its files resolve inside it)."""
        base = self.catalog.manifest(step).base
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
        return self.catalog.storage, f"{self.catalog.snapshot_key(step if file.origin is None else file.origin)}/{file.path}"

    def read(self, step: int, unit: str, skip: set[str] = frozenset()) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Tensors (by key, but those in ``skip``) and non-tensor optimizer values of ``unit`` as
        saved at ``step``.

        Every snapshot file is checked against its checksum; every tensor against the index's
        dtype and shape; a tensor of a pack file, or kept from the base directory, is read alone
        (its byte range) and checked against its own checksum (the file holds other units).
        Chunks are assembled into the global tensor."""
        entry = self.entry(step, unit)
        expected: dict[int, dict[str, tuple[str, list[int], str]]] = {}
        wanted = [t for t in entry.tensors if t.key not in skip]
        for tensor in wanted:
            for chunk in tensor.chunks:
                expected.setdefault(chunk.file, {})[tensor.chunk_key(chunk)] = (tensor.dtype, chunk.shape, chunk.xxh3_64)
        places = {position: self.file_location(step, entry.files[position]) for position in expected}
        headers = {}
        for position, tensors in expected.items():  # every header first: no tensor byte read yet
            storage, key = places[position]
            file = entry.files[position]
            kept = (storage.where(key), file.xxh3_64)
            headers[position] = check_stored_header(storage, key, file, {k: v[:2] for k, v in tensors.items()},
                                                    self._pack_headers.get(kept))
            if is_pack(file.path) and file.origin != "base":
                # Its size is checked at each use; its bytes, each tensor's against its checksum.
                if len(self._pack_headers) >= _PACK_HEADERS:
                    self._pack_headers.pop(next(iter(self._pack_headers)))
                self._pack_headers[kept] = headers[position]
        loaded = {}
        for position in sorted(expected):
            storage, key = places[position]
            sums = {k: v[2] for k, v in expected[position].items()}
            if entry.files[position].origin == "base":
                loaded[position] = read_checked_tensors(storage, key, sums)
            elif is_pack(entry.files[position].path):
                loaded[position] = read_stored_parts(storage, key, headers[position], sums)
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
        if not any(entry.path == doc for entry in self.catalog.manifest(step).files):
            return None
        return self._read_state(step, doc, tensors)

    def _read_state(self, step: int, doc_path: str, tensors_path: str) -> dict[str, Any]:
        from llmtailor.store import codec  # imports torch, which reading a layout does not need

        manifest = self.catalog.manifest(step)
        snapshot, where = self.catalog.snapshot_key(step), self.catalog.where(step, doc_path)
        raw = read_stored(self.catalog.storage, f"{snapshot}/{doc_path}", manifest.file_entry(doc_path))
        try:
            doc = json.loads(bytes(raw))
        except (ValueError, RecursionError) as err:
            raise IntegrityError(f"{where}: not valid JSON ({err})") from None
        tensors = read_stored_tensors(self.catalog.storage, f"{snapshot}/{tensors_path}", manifest.file_entry(tensors_path))
        state = codec.decode(doc, tensors, where=where)
        if not isinstance(state, dict):
            raise IntegrityError(f"{where}: expected an object at the top level")
        return state


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
