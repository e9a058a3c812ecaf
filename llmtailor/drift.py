"""Per-unit drift: how much each unit changed since its last saved version.

For a unit, drift is the relative L2 change of its tensors since the version the run last
saved, per kind: ``weight`` (the parameters, or fp32 masters under DeepSpeed) and ``moments``
(every optimizer state tensor that has the parameter's shape, e.g. AdamW's ``exp_avg`` and
``exp_avg_sq``)::

    drift(unit, kind) = || x_now - x_saved || / || x_saved ||    over the unit's tensors of that kind

**An estimate, from a fixed sample.** Keeping a copy of every saved tensor would double the
memory of training, so the tracker keeps, per tensor piece a rank holds, a fixed systematic
sample of up to ``SAMPLE`` elements (every k-th element from a start drawn once from a seed
and the piece's key, k sharing no factor with the row length, so the sample spreads over rows
and columns; the same positions at every save) and their values at the unit's last save.
Drift is computed over those samples. The sums of squares are per-rank partial sums, added up
over the ranks with one all-reduce per save, so every rank sees the same figures (and a
policy decides the same) on any provider: FSDP2 shards, DeepSpeed fragments, DDP replicas
(whose equal copies cancel in the ratio). ``tests/test_drift.py`` measures the estimate
against the exact value; the documented bound (docs/training-loops.md) is what it checks.

Cost, at save time only: the samples are strided views of the live tensors, built once and
kept while the provider's tensors keep their memory (checked at every gather by their data
pointers), so a gather is one ``torch.cat`` per kind and the comparison a few vector
operations; ``bench/bench_drift.py`` measures it against a training step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from llmtailor.store.keys import split_key
from llmtailor.store.run import Run
from llmtailor.store.samples import SAMPLE, flat as _flat, sample_slots, sampled  # noqa: F401 (drift.sampled, drift.SAMPLE)
from llmtailor.store.staged import Piece

KINDS = ("weight", "moments")


def kind_of(key: str, piece: Piece, weight_shapes: dict[str, tuple[int, ...]]) -> str | None:
    """``weight`` for a parameter (or master), ``moments`` for a state tensor of the parameter's
    shape, None for anything else (step counters, buffers)."""
    return _kind_of_split(split_key(key), piece, weight_shapes)


def _kind_of_split(split: tuple[str, str, str | None], piece: Piece, weight_shapes: dict[str, tuple[int, ...]]) -> str | None:
    """``kind_of`` of a key already split (``split_key``)."""
    kind, name, state_key = split
    if kind in ("weight", "master"):
        return "weight" if piece.tensor.is_floating_point() else None
    if state_key is not None and weight_shapes.get(name) == piece.global_shape and piece.tensor.is_floating_point():
        return "moments"
    return None


class SampleSource(Protocol):
    """What the tracker samples: a provider (``StateProvider``) or anything alike."""

    def pieces_by_unit(self, units: list[str]) -> dict[str, list[Piece]]: ...

    def live_tensors(self, units: list[str]) -> list[torch.Tensor]: ...

    def optimizers(self) -> list[torch.optim.Optimizer]: ...


@dataclass
class _KindPlan:
    """How to read one kind's sample of every unit with one ``torch.cat``."""

    views: list[torch.Tensor | None]
    """Per sampled piece, a strided view of its live memory (None: sampled at each gather)."""
    copies: list[tuple[int, torch.Tensor, int, int]]
    """Non-contiguous pieces, sampled from a flat copy at each gather: (index in ``views``,
    tensor, first element, spacing)."""
    weights: torch.Tensor
    """Each sampled value's weight (its tensor's elements per sampled element), float32."""
    spans: dict[str, tuple[tuple, int, int]]
    """Unit -> (its pieces' signature, first and end index in the flat sample), in sample order."""
    starts: np.ndarray
    """The spans' first indexes, in the same order (each span is non-empty; they tile the sample)."""


@dataclass
class _Plan:
    units: tuple[str, ...]
    fingerprint: tuple[int, ...] | None
    """The data pointers of the provider's live tensors when the views were built: equal
    pointers, same memory (the views keep what they read allocated, so no other tensor can take
    its addresses). None: some piece is not a view of those tensors (a copy), so the plan
    serves one gather only."""
    kinds: dict[str, _KindPlan]


@dataclass(frozen=True)
class Sample:
    """One gather: every unit's sampled values, flat per kind (float32 copies)."""

    plan: _Plan
    values: dict[str, torch.Tensor]



class DriftTracker:
    """Sampled references of each unit's last saved version, and drift against them.

    ``gather`` takes one sample of the live values per save; ``partial_sums`` compares it with
    the references; ``adopt`` makes (part of) it the new references once those units are saved.
    The sample is read through strided views of the live tensors built once and kept while
    the provider's tensors keep their memory, so a gather is one ``torch.cat`` per kind.
    """

    def __init__(self, sample_size: int = SAMPLE, seed: int = 0):
        self.sample_size = sample_size
        self.seed = seed
        self._reference: dict[str, dict[str, tuple[tuple, torch.Tensor, float]]] = {}
        """Unit -> kind -> (signature, sampled values at its last save, their weighted sum of squares)."""
        self._plan: _Plan | None = None
        self.plans_built = 0
        """How many times the views were (re)built: once, unless the live tensors moved."""

    def gather(self, units: list[str], source: SampleSource) -> Sample:
        """The current sampled values of ``units`` (copies), per kind."""
        held = source.live_tensors(units)
        fingerprint = tuple(t.data_ptr() for t in held)
        plan = self._plan
        if plan is None or plan.units != tuple(units) or plan.fingerprint != fingerprint:
            plan = self._plan = self._build(units, source.pieces_by_unit(units), held, fingerprint)
        values = {}
        with torch.no_grad():
            for kind, part in plan.kinds.items():
                views = part.views
                if part.copies:
                    views = list(views)
                    for index, tensor, start, spacing in part.copies:
                        views[index] = _flat(tensor)[start::spacing][: self.sample_size]
                values[kind] = torch.cat(views).to("cpu", torch.float32)
        return Sample(plan, values)

    def _build(self, units: list[str], pieces: dict[str, list[Piece]], held: list[torch.Tensor], fingerprint: tuple) -> _Plan:
        """The views (and each sampled value's weight) of every piece of ``units``: Python work per
        piece kept to its view, so a restore (which builds the plan of a fresh tracker) pays
        one pass, the weights made at the end by one ``np.repeat`` per kind."""
        self.plans_built += 1
        memory = {t.untyped_storage().data_ptr() for t in held}
        kept = True
        parts: dict[str, _KindPlan] = {}
        weights: dict[str, tuple[list[float], list[int]]] = {}
        filled: dict[str, int] = {}
        for unit in units:
            named = [(piece, split_key(piece.key)) for piece in pieces[unit]]
            shapes = {name: p.global_shape for p, (kind, name, _) in named if kind in ("weight", "master")}
            signatures: dict[str, list] = {}
            starts = dict(filled)
            for piece, split in named:
                kind = _kind_of_split(split, piece, shapes)
                numel = piece.tensor.numel()
                if kind is None or numel == 0:
                    continue
                # A piece outside the held tensors' memory (a copy) goes stale: list again next time.
                kept = kept and piece.tensor.untyped_storage().data_ptr() in memory
                part = parts.get(kind)
                if part is None:
                    part = parts[kind] = _KindPlan([], [], torch.empty(0), {}, np.empty(0, dtype=np.intp))
                start, spacing = sample_slots(piece, self.sample_size, self.seed)
                taken = len(range(start, numel, spacing)[: self.sample_size])
                if piece.tensor.is_contiguous():
                    flat = piece.tensor.view(-1)
                    part.views.append(flat.as_strided((taken,), (spacing,), flat.storage_offset() + start))
                else:
                    part.copies.append((len(part.views), piece.tensor, start, spacing))
                    part.views.append(None)
                # Each sampled element stands for numel / taken elements of its tensor, so the
                # sums estimate the whole unit's, whatever the tensors' sizes.
                values, counts = weights.setdefault(kind, ([], []))
                values.append(numel / taken)
                counts.append(taken)
                signatures.setdefault(kind, []).append((piece.key, piece.offsets))
                filled[kind] = filled.get(kind, 0) + taken
            for kind, signature in signatures.items():
                parts[kind].spans[unit] = (tuple(signature), starts.get(kind, 0), filled[kind])
        for kind, part in parts.items():
            values, counts = weights[kind]
            part.weights = torch.from_numpy(np.repeat(np.array(values, dtype=np.float32), counts))
            part.starts = np.array([start for _, start, _ in part.spans.values()], dtype=np.intp)
        return _Plan(tuple(units), fingerprint if kept else None, parts)

    def forget(self) -> None:
        """Drop the views of the live tensors (the references stay): the next gather rebuilds
        them. For when the live tensors are replaced, so their old memory is not held."""
        self._plan = None

    def partial_sums(self, units: list[str], now: Sample) -> torch.Tensor:
        """This rank's sums over its samples: ``[unit, kind, (||now - saved||^2, ||saved||^2)]``;
        zeros for units without a reference (or whose tensors changed since it was taken)."""
        if tuple(units) != now.plan.units:
            raise ValueError("partial_sums needs the units the sample was gathered for")
        rows = {unit: i for i, unit in enumerate(units)}
        # In numpy, as ``_segment_sums``: a torch index or assignment of a few elements cost
        # ~10-30 us each, several per kind, at every save.
        change = np.zeros((len(units), len(KINDS)))
        norm = np.zeros((len(units), len(KINDS)))
        for k, kind in enumerate(KINDS):
            part = now.plan.kinds.get(kind)
            if part is None:
                continue
            saved, compared, norms = [], [], []
            for unit, (signature, start, end) in part.spans.items():
                reference = self._reference.get(unit, {}).get(kind)
                if reference is not None and reference[0] == signature:
                    saved.append(reference[1])
                    compared.append(rows[unit])
                    norms.append(reference[2])
                else:  # no comparable reference: its span compares with itself, unread
                    saved.append(now.values[kind][start:end])
                    compared.append(-1)
            difference = now.values[kind].numpy() - np.concatenate([t.numpy() for t in saved])
            per_unit = _segment_sums(np.square(difference, out=difference), part).numpy()
            index = np.array(compared, dtype=np.intp)
            mine = index >= 0
            change[index[mine], k] = per_unit[mine]
            norm[index[mine], k] = norms
        return torch.from_numpy(np.stack((change, norm), axis=-1))

    def adopt(self, sample: Sample, units: list[str] | None = None) -> None:
        """Take ``sample`` (from ``gather``) as the last saved versions of ``units`` (default:
        every unit it holds)."""
        chosen = set(sample.plan.units if units is None else units)
        for kind, part in sample.plan.kinds.items():
            values = sample.values[kind]
            norms = _segment_sums(np.square(values.numpy()), part).tolist()
            for (unit, (signature, start, end)), norm in zip(part.spans.items(), norms):
                if unit in chosen:
                    self._reference.setdefault(unit, {})[kind] = (signature, values[start:end], norm)

    def known(self) -> set[str]:
        return set(self._reference)

    def references(self, units: list[str]) -> dict[str, dict[str, tuple] | None]:
        """The references of ``units`` as they are now (``put_back`` restores them)."""
        return {unit: dict(self._reference[unit]) if unit in self._reference else None for unit in units}

    def put_back(self, references: dict[str, dict[str, tuple] | None]) -> None:
        """The references ``references`` took, again."""
        for unit, kinds in references.items():
            if kinds is None:
                self._reference.pop(unit, None)
            else:
                self._reference[unit] = kinds


def _segment_sums(squares: np.ndarray, part: _KindPlan) -> torch.Tensor:
    """Per unit of ``part.spans`` (in its order), the weighted sum of its span of ``squares``
    (each value times ``part.weights``), as float64. In numpy: these vectors are a few hundred
    thousand elements, where torch's intra-op threads cost more than the arithmetic (on a
    loaded machine, several ms an operation: a third of a small save's time)."""
    weighted = np.multiply(squares, part.weights.numpy(), out=squares)
    return torch.from_numpy(np.add.reduceat(weighted, part.starts, dtype=np.float64))


def drift_figures(units: list[str], sums: torch.Tensor, known: set[str]) -> dict[str, dict[str, float | None]]:
    """``{unit: {"weight": d, "moments": d}}`` from all-reduced sums; None where a unit has no
    reference (never saved by this process) or no tensor of that kind."""
    out: dict[str, dict[str, float | None]] = {}
    for unit, row in zip(units, sums.tolist()):
        figures: dict[str, float | None] = {}
        for kind, (diff, ref) in zip(KINDS, row):
            # None: no reference yet, nothing of that kind, or a reference of zeros (no scale).
            figures[kind] = (diff / ref) ** 0.5 if unit in known and ref > 0 else None
        out[unit] = figures
    return out


class DriftWatch:
    """A writer's drift measurement over its saves (what ``Tailor`` keeps): a ``DriftTracker``
    over the layout's units, hooked to the optimizers so it lets go of replaced state at once,
    and the sample of the save being made until that save commits.

    ``measure`` at a save (collective: one all-reduce through ``reduce``, carrying the caller's rider); ``committed`` when
    that save's snapshot is committed (its units' sampled values become their references);
    ``restored`` after a restore (every unit's); ``close`` removes the hooks."""

    def __init__(self, units: list[str], source: SampleSource, reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.units, self.source, self.reduce = list(units), source, reduce
        self.tracker = tracker = DriftTracker()
        self._measured: Sample | None = None
        """The sample the last ``measure`` took, until ``saving``."""
        self._undo: list[dict[str, dict[str, tuple] | None]] = []
        """Per save staged and not committed, oldest first: the references its units had before."""
        # The tracker keeps views of the live tensors; an optimizer loading new state replaces
        # them, so it lets go at once rather than holding the old state's memory until a save.
        # (The hook holds the tracker only: an optimizer must not keep a Tailor, and its writer
        # lock, alive.)
        self._hooks = [
            opt.register_load_state_dict_pre_hook(lambda *_: tracker.forget())
            for opt in source.optimizers()
            if hasattr(opt, "_optimizer_load_state_dict_pre_hooks")  # a torch Optimizer that ran its __init__
        ]

    def measure(self, rider: torch.Tensor) -> tuple[dict[str, dict[str, float | None]], torch.Tensor]:
        """Each unit's drift since its last saved version, the same on every rank, and the sum
        over the ranks of ``rider`` (float64 figures of the caller's, summed in the same
        all-reduce: one meeting per save, not two); the sample it was measured on is kept for
        ``saving``."""
        sample = self.tracker.gather(self.units, self.source)
        partial = self.tracker.partial_sums(self.units, sample)
        reduced = self.reduce(torch.cat([partial.flatten(), rider.to(partial.dtype)]))
        sums, rider = reduced[:partial.numel()].view(partial.shape), reduced[partial.numel():]
        self._measured = sample
        # The sums are over every unit on every rank (zeros where a rank holds none of it, as a
        # pipeline stage does): one all-reduce of one size. A unit no rank has a reference of sums
        # to a zero norm, reported as None; a rank's own references (known()) are its stage's only.
        return drift_figures(self.units, sums, set(self.units)), rider

    def saving(self, units: list[str]) -> None:
        """The save just measured, staged, writes ``units``: their sample is their reference from
        now on (a save staged behind it measures from it, and is committed only if it is);
        ``committed`` / ``failed`` settle it, in order."""
        sample, self._measured = self._measured, None
        self._undo.append(self.tracker.references(units))
        if sample is not None:
            self.tracker.adopt(sample, list(units))

    def committed(self) -> None:
        """The oldest save staged committed: its units' references stay."""
        if self._undo:
            self._undo.pop(0)

    def failed(self) -> None:
        """Every save staged and not committed failed: the references the last committed one left."""
        for before in reversed(self._undo):
            self.tracker.put_back(before)
        self._undo.clear()

    def restored(self) -> None:
        """The live state now is a composite: every unit's reference."""
        self._undo.clear()
        self.tracker.adopt(self.tracker.gather(self.units, self.source))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.tracker.forget()


@dataclass(frozen=True)
class DriftHistory:
    """What a run's manifests recorded, step by step (``llmtailor drift``)."""

    steps: list[int]
    units: list[str]
    """Layout order."""
    drift: dict[int, dict[str, dict[str, float | None]]]
    """Step -> unit -> {"weight": d, "moments": d} as measured at that save."""
    saved: dict[int, list[str]]
    """Step -> the units that save wrote."""
    bytes: dict[int, int]
    """Step -> bytes the snapshot wrote."""
    full_bytes: dict[int, int]
    """Step -> bytes a Full save would have written then (every unit at its newest size then, or
    a unit not saved yet in the lineage at its first size in it)."""
    policy: dict[int, str]


def drift_history(run: Run, step: int | None = None) -> DriftHistory:
    """The lineage of the composite of ``step`` (default: newest), oldest first, from manifests
    alone (no tensor byte is read)."""
    lineage = list(run.lineage(run.resolve(step).step))[::-1]
    newest = run.manifest(lineage[-1])
    units = list(newest.composite)
    drift, saved, written, full, policy = {}, {}, {}, {}, {}
    # A unit not saved yet at a step of the lineage (its version then was older, maybe removed by
    # retention) counts at its first size in the lineage: a Full save then would have written it.
    sizes: dict[str, int] = {}
    for s in lineage[::-1]:
        manifest = run.manifest(s)
        sizes.update({u: manifest.unit_bytes(u) for u in manifest.units})
    for s in lineage:
        manifest = run.manifest(s)
        drift[s] = manifest.decision.get("drift", {})
        saved[s] = list(manifest.units)
        written[s] = manifest.total_bytes()
        sizes.update({u: manifest.unit_bytes(u) for u in manifest.units})
        full[s] = sum(sizes.get(u, 0) for u in units) + (written[s] - sum(manifest.unit_bytes(u) for u in manifest.units))
        policy[s] = manifest.policy
    return DriftHistory(lineage, units, drift, saved, written, full, policy)
