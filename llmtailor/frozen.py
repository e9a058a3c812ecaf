"""Frozen tensors are written once: LoRA / PEFT and partly frozen training save only what trains.

A unit is the granule a policy picks, but a unit can hold parameters that do not train (a
LoRA layer's base weights, frozen embeddings; ``StateProvider.frozen_names``). Such a tensor,
once saved, is not written again while it does not change: the unit's new version *keeps* it
from the snapshot that holds it (``UnitEntry.kept``), and a unit whose tensors are all frozen
and unchanged is not written at all, whatever the policy picks.

"Has not changed" is checked, not assumed: each frozen tensor's fingerprint is recorded when
its bytes are saved or restored, and a tensor whose fingerprint differs is written again (a
parameter frozen mid-run is saved once more after its last change). The fingerprint of every
piece this rank holds: its data pointer (a replaced tensor moves it), its version counter (any
in-place change made through the tensor bumps it) and the checksum of a fixed sample of its
values (``store.samples.covering``: an element of every row of the piece, and of every column
of one of at least 64 rows; about as many as the larger of rows and row length). The sample is
for changes that bump no counter, made through ``param.data``: every such change of a tensor of
at most ``SAMPLE`` elements is seen, and in a larger one every change that alters a sampled
element (a change of any whole row, of any whole column of 64 rows or more, of the whole tensor
or of much of it); a change confined to a few elements of a larger tensor may be missed.
Reading every frozen byte at every save would be certain but costs a pass over the frozen
weights (gigabytes for a LoRA's base); the sample costs about a cache line per sampled element
(32008 of them for a 32000 x 4096 embedding). Until a changed tensor is written its unit is not
quiet: it still counts for ``Adaptive``'s staleness bound. In a distributed job the ranks agree: a tensor
changed on any rank is written by every rank holding a piece of it.

A base model by reference (``Tailor(..., base=DIR)``, a ``save_pretrained`` directory): a
frozen tensor equal to the base's (compared by checksum when first seen; under peft,
``q_proj.base_layer.weight`` is the base's ``q_proj.weight``) is never copied: the unit keeps
it from the base (``UnitEntry.base``) and the manifest lists the base's files with their
sizes and checksums (``BaseDir``); a restore reads those tensors from there, each checked
against its checksum. One process or DDP (frozen tensors whole on a rank); sharded frozen
tensors are written once instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from llmtailor.distributed.coordinator import Coordinator
from llmtailor.errors import ConfigError, TailorError
from llmtailor.interop.hf.weights import ModelWeights, has_weights
from llmtailor.providers.base import StateProvider
from llmtailor.store import dtypes
from llmtailor.store.catalog import Composite
from llmtailor.store.tensor_files import checksum, checksum_file, tensor_checksum
from llmtailor.store.keys import split_key, weight_key
from llmtailor.store.manifest import BaseDir, FileEntry, TensorEntry
from llmtailor.store.run import Run
from llmtailor.store.samples import covering, sample_checksums
from llmtailor.store.staged import Piece, StagedUnit, version_of

Holder = int | str
"""Where a frozen tensor's saved bytes are: a snapshot's step, or ``"base"``."""


def fingerprints(pieces: dict[str, list[Piece]], known: dict[str, str] | None = None) -> dict[str, tuple]:
    """Per tensor key, what changes when the tensor's values may have: of every piece, its
    memory and version counter (a change made through the tensor bumps the counter, a replaced
    tensor moves the memory; an inference-mode tensor keeps no counter: ``version_of``) and the
    checksum of a fixed sample of its values (``store.samples.covering``: a change through
    ``.data``, or to an inference tensor, bumps no counter; it shows when it alters a sampled
    element, as a change of a whole row or column does).
    ``known``: key -> the sampled checksum of its one whole piece, known to be its values' (a
    restore just checked them against it), not computed again."""
    known = known or {}
    found = [piece for key, key_pieces in pieces.items() if key not in known for piece in key_pieces]
    sums = iter(sample_checksums(found, covering))
    return {key: tuple((p.offsets, p.tensor.data_ptr(), version_of(p.tensor), known[key] if key in known else next(sums))
                       for p in key_pieces)
            for key, key_pieces in pieces.items()}


PEFT_WRAPPED = (".base_layer.", ".original_module.")
"""The parts peft puts in a base module's names when it wraps the module (``BaseModel.find``)."""


class BaseModel:
    """A ``save_pretrained`` directory frozen tensors may be kept from: its safetensors files'
    headers (read when built), their sizes and checksums (computed once, when a save first
    keeps something from it)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise ConfigError(f"base={path}: no such model directory")
        if not has_weights(self.path):
            raise ConfigError(f"base={path}: no model.safetensors (or its index) in it (a save_pretrained directory expected)")
        try:
            self._weights = ModelWeights(self.path)
        except TailorError as err:
            raise ConfigError(f"base={path}: {err}") from None
        self.tensors: dict[str, tuple[str, str, list[int]]] = {
            name: (t.file.name, t.dtype, list(t.shape)) for name, t in self._weights.tensors.items()
        }
        """Tensor name -> (file, dtype name, shape)."""
        self._record: BaseDir | None = None

    def find(self, name: str) -> str | None:
        """The base's name of the model's parameter ``name``, or None. peft wraps a base module
        in place and keeps it as ``X.base_layer`` (an adapter's layer) or ``X.original_module``
        (a module trained whole, ``modules_to_save``: its trained copy is not the base's); the
        base's name leaves those parts out. A name matched wrongly costs nothing: ``ref``
        compares the bytes."""
        unwrapped = name
        for wrapper in PEFT_WRAPPED:
            unwrapped = unwrapped.replace(wrapper, ".")
        for candidate in (name, unwrapped):
            if candidate in self.tensors:
                return candidate
        return None

    def ref(self, name: str, tensor: torch.Tensor) -> dict[str, Any] | None:
        """Where the base holds a tensor equal, bit for bit, to ``tensor`` (a ``BaseRef``), or None."""
        found = self.find(name)
        if found is None:
            return None
        file, dtype, shape = self.tensors[found]
        if dtype != dtypes.name_of(tensor.dtype) or shape != list(tensor.shape):
            return None
        mine = tensor_checksum(tensor)
        if tensor_checksum(self._weights.read(found).load()) != mine:
            return None
        return {"file": file, "name": found, "dtype": dtype, "shape": shape, "xxh3_64": mine}

    def record(self) -> dict[str, Any]:
        """The manifest's ``BaseDir``: every safetensors file with its size and checksum."""
        if self._record is None:
            entries = []
            for file in sorted({f for f, _, _ in self.tensors.values()}):
                path = self.path / file
                entries.append(FileEntry(path=file, bytes=path.stat().st_size, xxh3_64=checksum_file(path)))
            self._record = BaseDir(path=str(self.path), files=entries)
        return self._record.model_dump(mode="json")


@dataclass
class FrozenPlan:
    """What one save leaves out: which frozen tensors it keeps, and which units it skips."""

    kept: dict[str, Holder]
    """Frozen tensor key -> where its unchanged bytes are; every other frozen tensor of a
    written unit is written again."""
    quiet: set[str]
    """Units whose tensors are all frozen and unchanged: never written (a policy may pick them:
    they cost nothing), exempt from staleness bounds."""
    fingerprints: dict[str, tuple] = field(default_factory=dict)
    """This rank's fingerprint of every frozen tensor, taken now."""
    base: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Frozen tensor key -> where the base directory holds it (for those kept from the base)."""

    def written(self, units: list[str]) -> list[str]:
        """Of the units a policy picked, those the save writes: all but the quiet ones (which
        have a version to keep: ``quiet`` holds no unit the writer has never saved)."""
        return [u for u in units if u not in self.quiet]


def _with_sample(piece: Piece, plan: FrozenPlan) -> Piece:
    """``piece``, a frozen whole weight's with its sampled checksum (recorded in its chunk: a
    restore checks a live tensor against it, ``providers/local.py``)."""
    prints = plan.fingerprints.get(piece.key)
    if prints is None or len(prints) != 1 or not piece.is_whole:
        return piece
    return replace(piece, cover_xxh3=prints[0][3])


def _recorded_sample(tensor: TensorEntry, pieces: list[Piece]) -> str | None:
    """The sampled checksum recorded at save for a tensor the live model holds as one whole
    piece, the one the piece's values have once a restore checked or read them (read: every
    byte against its checksum; held: its sample against this one); None where it must be
    computed (no sample recorded, one recorded before schema 7 over other elements, or the
    live tensor in several pieces)."""
    if len(pieces) != 1 or not pieces[0].is_whole or len(tensor.chunks) != 1:
        return None
    return tensor.chunks[0].cover_xxh3


@dataclass(frozen=True)
class FrozenSurvey:
    """One rank's frozen tensors as a save begins (``FrozenParts.survey``)."""

    prints: dict[str, tuple]
    """Fingerprint of every frozen tensor piece this rank holds, taken now."""
    report: list[Any]
    """What it tells the other ranks: the frozen tensors changed since saved (sorted keys), its
    frozen units, the units it holds."""
    news: bool
    """Whether ``report`` differs from what this rank reported at the last exchange."""


class FrozenParts:
    """Which frozen tensors a writer can leave out (module docstring)."""

    def __init__(self, provider: StateProvider, coordinator: Coordinator, base: BaseModel | None = None):
        self.provider, self.coordinator, self.base = provider, coordinator, base
        self._base_refs: dict[str, dict[str, Any]] = {}
        """Frozen tensor key -> its ``BaseRef``, for those held by the base."""
        self._held: dict[str, tuple[Holder, tuple]] = {}
        """Frozen tensor key -> (where its saved bytes are, its fingerprint then)."""
        self._written_bytes: dict[str, int] = {}
        """Unit -> bytes of frozen tensors its newest version wrote (not what a policy weighs)."""
        self._undo: list[tuple[dict[str, tuple[Holder, tuple]], dict[str, int]]] = []
        """Per save staged and not committed, oldest first: ``_held`` and ``_written_bytes`` before it."""
        self._reported: list[Any] | None = None
        """This rank's report at the ranks' last exchange (``plan``)."""
        self._agreed: tuple[list[str], set[str]] | None = None
        """What that exchange agreed: the frozen tensors changed on any rank, the frozen units."""

    def survey(self) -> FrozenSurvey:
        """This rank's look at its frozen tensors before a save (no message): their fingerprints,
        which changed since saved, and its report for the ranks' agreement (``plan``)."""
        untrained = self.provider.frozen_names()
        frozen = {weight_key(n) for n in untrained}
        # Only the units holding a frozen tensor: listing a unit's pieces costs (its optimizer
        # state's too), at every save, for nothing when nothing is frozen.
        holding = [unit for unit, names in self.provider.layout.units.items()
                   if any(weight_key(n) in frozen for n in names)] if frozen else []
        pieces: dict[str, list[Piece]] = {}
        for unit_pieces in self.provider.pieces_by_unit(holding).values():
            for piece in unit_pieces:
                if piece.key in frozen:
                    pieces.setdefault(piece.key, []).append(piece)
        prints = fingerprints(pieces)
        changed = sorted(key for key, now in prints.items() if key not in self._held or self._held[key][1] != now)
        if self.base is not None:  # first seen (or changed): equal to the base's? then kept from there
            for key in list(changed):
                found = pieces[key]
                ref = self.base.ref(split_key(key)[1], found[0].tensor) if len(found) == 1 and found[0].is_whole else None
                if ref is not None:
                    ref["cover_xxh3"] = prints[key][0][3]  # a whole tensor's one piece
                    self._held[key], self._base_refs[key] = ("base", prints[key]), ref
                    changed.remove(key)
        report = [changed, sorted(self.provider.frozen_units(untrained)), list(self.provider.layout.units)]
        return FrozenSurvey(prints=prints, report=report, news=report != self._reported)

    def plan(self, tag: str, versioned: set[str], survey: FrozenSurvey, news_anywhere: bool) -> FrozenPlan:
        """This save's plan, the same on every rank; ``versioned``: the units the writer's
        lineage has a version of. In a distributed job the ranks exchange their reports
        (``survey``) only when ``news_anywhere`` (some rank's ``survey.news``, agreed by the
        caller on every rank alike): when no rank's report changed since the last exchange,
        that exchange's agreement is this one's too (same reports, same union), so a save
        with nothing frozen, or nothing frozen changing, spends no message on it."""
        changed, frozen_units = survey.report[0], set(survey.report[1])
        if self.coordinator.world_size > 1:
            if news_anywhere or self._agreed is None:
                # Until it completes here: a rank whose exchange failed (where others may have
                # agreed) has news at its next save, so every rank exchanges again.
                self._reported = None
                reports = self.coordinator.exchange(tag, survey.report)
                changed = sorted({key for report in reports for key in report[0]})
                # Frozen where every rank holding it says so: pipeline stages hold different units.
                frozen_units = {u for u in self.provider.stages.layout.units
                                if all(u in report[1] for report in reports if u in report[2])}
                self._reported, self._agreed = survey.report, (changed, frozen_units)
            changed, frozen_units = self._agreed
        prints = survey.prints
        kept = {key: self._held[key][0] for key in prints if key not in changed}
        unit_of = self.provider.stages.layout.unit_of
        quiet = {u for u in frozen_units if u in versioned and not any(unit_of(split_key(k)[1]) == u for k in changed)}
        base = {key: self._base_refs[key] for key, holder in kept.items() if holder == "base"}
        return FrozenPlan(kept=kept, quiet=quiet, fingerprints=prints, base=base)

    def base_record(self) -> dict[str, Any] | None:
        """The manifest's ``base`` for a save: the base directory, while anything is kept from it."""
        return self.base.record() if self.base is not None and self._base_refs else None

    def split(self, staged: StagedUnit, plan: FrozenPlan) -> StagedUnit:
        """``staged`` without the pieces of the tensors ``plan`` keeps; the unit records where they are."""
        kept = {p.key for p in staged.pieces if p.key in plan.kept}
        staged.pieces = [_with_sample(p, plan) for p in staged.pieces if p.key not in kept]
        staged.kept = {k: plan.kept[k] for k in kept if plan.kept[k] != "base"}
        staged.base = {k: plan.base[k] for k in kept if plan.kept[k] == "base"}
        return staged

    def saving(self, plan: FrozenPlan, written: list[str], step: int) -> None:
        """The save of ``step``, staged, follows ``plan`` and writes ``written``: the frozen
        tensors it writes count as held there from now on (a save staged behind it keeps them
        from it, and is committed only if it is); ``committed`` / ``failed`` settle it, in order."""
        self._undo.append((dict(self._held), dict(self._written_bytes)))
        sizes = self._sizes() if plan.fingerprints else {}
        for unit in written:
            names = self.provider.layout.units.get(unit, ())  # another pipeline stage's: none here
            wrote = [weight_key(n) for n in names if weight_key(n) in plan.fingerprints and weight_key(n) not in plan.kept]
            for key in wrote:
                self._held[key] = (step, plan.fingerprints[key])
            self._written_bytes[unit] = sum(sizes.get(split_key(k)[1], 0) for k in wrote)

    def committed(self) -> None:
        """The oldest save staged committed: what it wrote stays held there."""
        if self._undo:
            self._undo.pop(0)

    def failed(self) -> None:
        """Every save staged and not committed failed: what the last committed one left held."""
        if self._undo:
            self._held, self._written_bytes = self._undo[0]
            self._undo.clear()

    def restored(self, run: Run, composite: Composite, held: bool = True) -> None:
        """After a restore: every frozen tensor's saved bytes are where the composite read them
        from, and its fingerprint is the restored value's. ``held=False`` (read from a slower
        tier): only those kept from the base model directory count as saved; the next save
        writes the others."""
        frozen = {weight_key(n) for n in self.provider.frozen_names()}
        # Only the units holding a frozen tensor: a unit's pieces cost a save plan per tensor
        # (its optimizer state's too), 0.4 s of a sharded Llama's restore with nothing frozen.
        pieces = self.provider.pieces_by_unit([unit for unit, names in self.provider.layout.units.items()
                                               if any(weight_key(n) in frozen for n in names)])
        self._held.clear()
        self._base_refs.clear()
        self._undo.clear()
        holders: dict[str, Holder] = {}
        found: dict[str, list[Piece]] = {}
        recorded: dict[str, str] = {}
        for unit, source in composite.sources.items():
            entry = run.unit_entry(source, unit)
            tensors = {t.key: t for t in entry.tensors}
            for key in frozen & set(tensors):
                where = entry.files[tensors[key].chunks[0].file].origin
                mine = [p for p in pieces.get(unit, []) if p.key == key]
                if mine:
                    holders[key], found[key] = source if where is None else where, mine
                    if (sample := _recorded_sample(tensors[key], mine)) is not None:
                        recorded[key] = sample
                if where == "base":
                    self._base_refs[key] = run.base_ref(source, unit, key)
        prints = fingerprints(found, recorded)
        self._held = {key: (holder, prints[key]) for key, holder in holders.items()}
        if self._base_refs and self.base is None:  # kept from a base this Tailor was not given: keep it
            self.base = BaseModel(composite.manifest.base.path) if composite.manifest.base is not None else None
        if not held:
            self._held = {key: where for key, where in self._held.items() if where[0] == "base"}
        self._written_bytes.clear()

    def weighed_bytes(self, unit_bytes: dict[str, int]) -> dict[str, int]:
        """What each unit's next version would cost: its newest version's bytes without the
        frozen tensors that version wrote (a budget weighs what a save writes)."""
        return {u: max(0, b - self._written_bytes.get(u, 0)) for u, b in unit_bytes.items()}

    def _sizes(self) -> dict[str, int]:
        return {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in self.provider.live_specs().items()}


__all__ = ["BaseModel", "FrozenParts", "FrozenPlan", "FrozenSurvey", "fingerprints"]
