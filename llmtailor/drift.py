"""Per-unit drift: how much each unit changed since its last saved version.

For a unit, drift is the relative L2 change of its tensors since the version the run last
saved, per kind: ``weight`` (the parameters, or fp32 masters under DeepSpeed) and ``moments``
(every optimizer state tensor that has the parameter's shape, e.g. AdamW's ``exp_avg`` and
``exp_avg_sq``)::

    drift(unit, kind) = || x_now - x_saved || / || x_saved ||    over the unit's tensors of that kind

**An estimate, from a fixed sample.** Keeping a copy of every saved tensor would double the
memory of training, so the tracker keeps, per tensor piece a rank holds, a fixed uniform random
sample of up to ``SAMPLE`` elements (the same positions at every save, drawn once from a seed
and the piece's key) and their values at the unit's last save. Drift is computed over those
samples. The sums of squares are per-rank partial sums, added up over the ranks with one
all-reduce per save, so every rank sees the same figures (and a policy decides the same) on
any provider: FSDP2 shards, DeepSpeed fragments, DDP replicas (whose equal copies cancel in
the ratio). ``tests/test_drift.py`` measures the estimate against the exact value; the
documented bound (README) is what it checks.

Cost: one gather of ``SAMPLE`` elements per tensor piece and a few reductions, at save time
only; ``bench/bench_drift.py`` measures it against a training step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmtailor.store.keys import split_key
from llmtailor.store.run import Run
from llmtailor.store.writer import Piece

SAMPLE = 1024
KINDS = ("weight", "moments")


def kind_of(key: str, piece: Piece, weight_shapes: dict[str, tuple[int, ...]]) -> str | None:
    """``weight`` for a parameter (or master), ``moments`` for a state tensor of the parameter's
    shape, None for anything else (step counters, buffers)."""
    kind, name, state_key = split_key(key)
    if kind in ("weight", "master"):
        return "weight" if piece.tensor.is_floating_point() else None
    if state_key is not None and weight_shapes.get(name) == piece.global_shape and piece.tensor.is_floating_point():
        return "moments"
    return None


Sample = dict[str, tuple[tuple, torch.Tensor, torch.Tensor]]
"""Per kind: (the pieces' signature, the sampled values, each value's weight), float32."""


class DriftTracker:
    """Sampled references of each unit's last saved version, and drift against them.

    ``gather`` takes one sample of the live values per save; ``partial_sums`` compares it with
    the references; ``adopt`` makes (part of) it the new references once those units are saved.
    """

    def __init__(self, sample_size: int = SAMPLE, seed: int = 0):
        self.sample_size = sample_size
        self.seed = seed
        self._indices: dict[tuple[str, tuple[int, ...]], torch.Tensor | None] = {}
        self._reference: dict[str, Sample] = {}
        self._plans: dict[str, tuple[tuple, dict]] = {}

    def _positions(self, piece: Piece) -> torch.Tensor | None:
        """The sampled positions of a piece (None: all of it, a piece no larger than the sample)."""
        key = (piece.key, piece.offsets)
        if key not in self._indices:
            numel = piece.tensor.numel()
            if numel <= self.sample_size:
                self._indices[key] = None
            else:
                digest = hashlib.sha256(f"{self.seed}/{piece.key}/{piece.offsets}".encode()).digest()
                generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
                self._indices[key] = torch.randperm(numel, generator=generator)[: self.sample_size]
        return self._indices[key]

    def gather(self, units: list[str], pieces_of: Callable[[str], list[Piece]]) -> dict[str, Sample]:
        """The current sampled values of ``units`` (copies), per kind."""
        out: dict[str, Sample] = {}
        with torch.no_grad():
            for unit in units:
                pieces = pieces_of(unit)
                plan = self._plan(unit, pieces)
                sample: Sample = {}
                for kind, (signature, steps, weights) in plan.items():
                    chunks = [
                        _flat(pieces[i].tensor) if positions is None else torch.take(pieces[i].tensor, positions)
                        for i, positions in steps
                    ]
                    sample[kind] = (signature, torch.cat(chunks).to("cpu", torch.float32, copy=True), weights)
                out[unit] = sample
        return out

    def _plan(self, unit: str, pieces: list[Piece]) -> dict[str, tuple[tuple, list, torch.Tensor]]:
        """Per kind: the pieces' signature, ``(piece index, positions)`` to read, and each sampled
        value's weight. Cached while the unit's pieces keep their keys and offsets."""
        keys = tuple((p.key, p.offsets) for p in pieces)
        cached = self._plans.get(unit)
        if cached is not None and cached[0] == keys:
            return cached[1]
        shapes = {split_key(p.key)[1]: p.global_shape for p in pieces if split_key(p.key)[0] in ("weight", "master")}
        parts: dict[str, tuple[list, list, list]] = {}
        for i, piece in enumerate(pieces):
            kind = kind_of(piece.key, piece, shapes)
            numel = piece.tensor.numel()
            if kind is None or numel == 0:
                continue
            positions = self._positions(piece)
            taken = numel if positions is None else len(positions)
            signature, steps, weights = parts.setdefault(kind, ([], [], []))
            signature.append(keys[i])
            steps.append((i, positions))
            # Each sampled element stands for numel / sample elements of its tensor, so the sums
            # estimate the whole unit's, whatever the tensors' sizes.
            weights.append(torch.full((taken,), numel / taken, dtype=torch.float32))
        plan = {kind: (tuple(sig), steps, torch.cat(w)) for kind, (sig, steps, w) in parts.items()}
        self._plans[unit] = (keys, plan)
        return plan

    def partial_sums(self, units: list[str], now: dict[str, Sample]) -> torch.Tensor:
        """This rank's sums over its samples: ``[unit, kind, (||now - saved||^2, ||saved||^2)]``;
        zeros for units without a reference (or whose tensors changed since it was taken)."""
        sums = torch.zeros(len(units), len(KINDS), 2, dtype=torch.float64)
        for i, unit in enumerate(units):
            reference = self._reference.get(unit, {})
            for kind, (signature, values, weights) in now.get(unit, {}).items():
                saved = reference.get(kind)
                if saved is None or saved[0] != signature:
                    continue
                k = KINDS.index(kind)
                sums[i, k, 0] = torch.dot(weights, (values - saved[1]).square())
                sums[i, k, 1] = torch.dot(weights, saved[1].square())
        return sums

    def adopt(self, samples: dict[str, Sample]) -> None:
        """Take ``samples`` (from ``gather``) as the units' last saved versions."""
        self._reference.update(samples)

    def known(self) -> set[str]:
        return set(self._reference)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


def drift_figures(units: list[str], sums: torch.Tensor, known: set[str]) -> dict[str, dict[str, float | None]]:
    """``{unit: {"weight": d, "moments": d}}`` from all-reduced sums; None where a unit has no
    reference (never saved by this process) or no tensor of that kind."""
    out: dict[str, dict[str, float | None]] = {}
    for i, unit in enumerate(units):
        figures: dict[str, float | None] = {}
        for k, kind in enumerate(KINDS):
            diff, ref = float(sums[i, k, 0]), float(sums[i, k, 1])
            # None: no reference yet, nothing of that kind, or a reference of zeros (no scale).
            figures[kind] = (diff / ref) ** 0.5 if unit in known and ref > 0 else None
        out[unit] = figures
    return out


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
    """Step -> bytes a Full save would have written then (every unit at its newest size)."""
    policy: dict[int, str]


def drift_history(run: Run, step: int | None = None) -> DriftHistory:
    """The lineage of the composite of ``step`` (default: newest), oldest first, from manifests
    alone (no tensor byte is read)."""
    lineage = []
    current: int | None = run.resolve(step).step
    while current is not None and current in run.steps():
        lineage.append(current)
        current = run.manifest(current).parent
    lineage.reverse()
    newest = run.manifest(lineage[-1])
    units = list(newest.composite)
    drift, saved, written, full, policy = {}, {}, {}, {}, {}
    sizes: dict[str, int] = {}
    for s in lineage:
        manifest = run.manifest(s)
        drift[s] = manifest.decision.get("drift", {})
        saved[s] = list(manifest.units)
        written[s] = manifest.total_bytes()
        sizes.update({u: manifest.unit_bytes(u) for u in manifest.units})
        full[s] = sum(sizes.get(u, 0) for u in units) + (written[s] - sum(manifest.unit_bytes(u) for u in manifest.units))
        policy[s] = manifest.policy
    return DriftHistory(lineage, units, drift, saved, written, full, policy)
