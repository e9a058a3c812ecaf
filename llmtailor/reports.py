"""What ``Tailor.save`` and ``Tailor.restore`` return: ``SaveReport``, ``PendingSave`` (an async
save in flight) and ``RestoreReport``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtailor.async_stager import BackgroundSave
from llmtailor.store.catalog import Composite
from llmtailor.store.staged import PersistResult


@dataclass(frozen=True)
class SaveReport:
    """What one save wrote."""

    step: int
    units: list[str]
    bytes: int
    """Bytes of the whole snapshot (every rank's files)."""
    seconds: float
    path: Path
    unit_bytes: dict[str, int]
    """Bytes this rank wrote per unit."""
    rank_bytes: int = 0
    """Bytes this rank wrote in all."""

    @classmethod
    def of(cls, step: int, units: list[str], result: PersistResult | None, seconds: float) -> SaveReport:
        assert result is not None
        return cls(step, units, result.bytes, seconds, result.path, result.unit_bytes, result.rank_bytes)


class PendingSave:
    """An async save in flight: ``save`` returned once the units were chosen and the global
    state captured; the copies and the write go on in the background."""

    def __init__(self, job: BackgroundSave, to_report: Callable[[int, list[str], PersistResult, float], SaveReport]):
        self._job, self._to_report = job, to_report
        self.step: int = job.step
        self.units: list[str] = job.units
        self.blocked_seconds: float = job.blocked_seconds
        """How long ``save`` blocked the training loop."""

    def done(self) -> bool:
        return self._job.done()

    @property
    def copy_seconds(self) -> float:
        """Seconds the background thread spent copying into host buffers (once done)."""
        return self._job.copy_seconds

    @property
    def persist_seconds(self) -> float:
        """Seconds the background thread spent writing and committing (once done)."""
        return self._job.persist_seconds

    def result(self, timeout: float | None = None) -> SaveReport:
        """Wait until the snapshot is committed and durable; raise what failed in the background."""
        outcome = self._job.result(timeout)
        return self._to_report(self._job.step, self._job.units, outcome, self._job.copy_seconds + self._job.persist_seconds)


@dataclass(frozen=True)
class RestoreReport:
    """What a restore loaded: the composite's step, the user extras saved with it (this rank's),
    and the step each unit came from."""

    step: int
    extra: Any
    sources: dict[str, int]
    seconds: float
    skipped: dict[int, str]
    """Newer composites passed over, and why: with ``fallback=True``, those that did not verify;
    with tiers, also those a faster tier did not hold whole (the reason names the tier)."""
    saved_world_size: int = 1
    unmapped: tuple[str, ...] = ()
    """Per-rank state that could not be mapped at this world size (empty at the saved one), and
    stateful objects the snapshot holds no state for (``providers/stateful.py``)."""
    tier: str = ""
    """Where the composite was read from: the run directory, or the tier (``Tier``) holding it."""
    served_by: dict[int, list[int]] = field(default_factory=dict)
    """With a node-local tier (``Tier(scope="node")``): node -> the nodes whose copies sent it
    the files it lacked before the restore (a replaced node's parts came from its partner's
    replica); empty when every node's copy was whole."""

    @classmethod
    def of(cls, composite: Composite, extra: Any, seconds: float, skipped: dict[Any, str],
           unmapped: tuple[str, ...], tier: str = "", served_by: dict[int, list[int]] | None = None) -> RestoreReport:
        return cls(step=composite.step, extra=extra, sources=dict(composite.sources), seconds=seconds,
                   skipped={int(k): v for k, v in skipped.items()}, saved_world_size=composite.manifest.world_size,
                   unmapped=unmapped, tier=tier, served_by=dict(served_by or {}))


def describe_sources(sources: dict[str, int]) -> str:
    """Which snapshot each unit came from, shortest first: ``every unit from step 8`` or
    ``12 units from step 8, 4 from step 6 (layer.1, layer.3, ...)``."""
    by_step: dict[int, list[str]] = {}
    for unit, step in sources.items():
        by_step.setdefault(step, []).append(unit)
    if len(by_step) == 1:
        return f"every unit from step {next(iter(by_step))}"
    ordered = sorted(by_step.items(), key=lambda item: -item[0])
    newest, *older = ordered
    parts = [f"{len(newest[1])} units from step {newest[0]}"]
    for step, units in older:
        shown = ", ".join(units[:3]) + (", ..." if len(units) > 3 else "")
        parts.append(f"{len(units)} from step {step} ({shown})")
    return ", ".join(parts)
