"""``Tailor``: tailored checkpointing for a PyTorch training loop.

    tailor = Tailor("runs/exp1", model, optimizer, lr_scheduler, policy=Parity())
    if tailor.latest_step() is not None:
        start = tailor.restore().step
    ...
    tailor.save(step, extra={"epoch": epoch})

Each save writes the units the policy picks plus the global state; ``restore`` loads the
composite (each unit from its newest version, global state from the composite's step) into
the live objects in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtailor.errors import ConfigError, IntegrityError, TailorError
from llmtailor.layouts import Layout, build_layout
from llmtailor.policies import Full, Policy, SaveContext
from llmtailor.state import tree
from llmtailor.state.training import TrainingState
from llmtailor.store.lock import WriterLock
from llmtailor.store.retention import apply_retention, check_keep, plan_retention
from llmtailor.store.run import Composite, Run
from llmtailor.store.writer import StagedSnapshot, persist


@dataclass(frozen=True)
class SaveReport:
    """What one save wrote."""

    step: int
    units: list[str]
    bytes: int
    seconds: float
    path: Path
    unit_bytes: dict[str, int]


@dataclass(frozen=True)
class RestoreReport:
    """What a restore loaded: the composite's step, the user extras saved with it, and the
    step each unit came from."""

    step: int
    extra: Any
    sources: dict[str, int]
    seconds: float
    skipped: dict[int, str]
    """With ``fallback=True``: newer composites passed over, and why."""


class Tailor:
    """Save and restore tailored checkpoints of one process's model, optimizer and scheduler.

    Invariants: a save never touches an earlier snapshot; after ``restore(T)`` every weight and
    optimizer tensor equals, bit for bit, the version the composite of T names, and with the
    ``Full`` policy training continues bitwise as if uninterrupted (on CPU). Optimizer state is
    matched by parameter name. Restoring never unpickles. One ``Tailor`` at a time may write to
    a run directory (a lock, taken at the first save, released by ``close`` or process exit).
    """

    def __init__(
        self,
        run_dir: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        policy: Policy | None = None,
        *,
        family: str | None = None,
        keep: int | None = None,
    ):
        """``keep=K``: after each save, delete every snapshot that the newest K composites do not
        need (``llmtailor gc`` does the same on demand)."""
        if policy is not None and not isinstance(policy, Policy):
            raise ConfigError(f"policy must be a llmtailor policy (Full(), Parity(), ...), got {policy!r}")
        self.keep = keep if keep is None else check_keep(keep)
        self.run = Run(run_dir)
        self._lock = WriterLock(self.run.root)
        self.layout: Layout = build_layout(model, family)
        self.policy: Policy = policy or Full()
        self.state = TrainingState(model, optimizer, lr_scheduler, self.layout)
        # The lineage this process extends: set by restore() or by its own saves. A fresh
        # Tailor starts a new lineage, whose first save is full.
        self._parent: int | None = None
        self._save_index = 0
        self._composite: dict[str, int] = {}

    def latest_step(self) -> int | None:
        """Step of the newest committed composite in the run directory, or None."""
        return self.run.latest_step()

    def save(self, step: int, extra: Any = None) -> SaveReport:
        """Write the units the policy picks, plus global state, as the snapshot of ``step``.

        ``extra`` is any tree of dicts, lists, tuples, numbers, strings, tensors and numpy
        arrays (data position, epoch, ...); ``restore`` returns it."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        if self._parent is not None and step <= self._parent:
            raise ConfigError(f"step {step} is not after the previous snapshot's step {self._parent}")
        start = time.perf_counter()
        self._lock.acquire()
        tensors = self.state.tensors()
        units = self.policy.choose(
            SaveContext(
                save_index=self._save_index,
                step=step,
                units=tuple(self.layout.units),
                last_saved=self._composite,
            )
        )
        composite = {**self._composite, **{unit: step for unit in units}}
        doc, global_tensors = tree.encode(self.state.capture_global(step, extra, tensors), where="global state")
        staged = StagedSnapshot(
            step=step,
            parent=self._parent,
            save_index=self._save_index,
            policy=self.policy.describe(),
            layout=self.layout.to_record(),
            units=[self.state.stage_unit(unit, tensors) for unit in units],
            composite=composite,
            global_doc=doc,
            global_tensors=global_tensors,
        )
        result = persist(self.run, staged)
        self._parent, self._save_index, self._composite = step, self._save_index + 1, composite
        if result.pointer_error:
            raise TailorError(result.pointer_error)
        if self.keep is not None:
            apply_retention(self.run, plan_retention(self.run, self.keep))
        return SaveReport(
            step=step,
            units=units,
            bytes=result.bytes,
            seconds=time.perf_counter() - start,
            path=result.path,
            unit_bytes=result.unit_bytes,
        )

    def restore(self, step: int | None = None, *, fallback: bool = False) -> RestoreReport:
        """Load the newest committed composite (or the one as of ``step``) in place.

        Compatibility (layout, names, shapes, dtypes, optimizer groups) is checked from the
        manifests before any tensor byte is read; every file is checked against its checksum
        as it is read. With ``fallback=True`` (and no ``step``), a composite any of whose files
        fails verification is passed over for the newest older one that verifies whole; the
        report's ``skipped`` says what was passed over and why."""
        if not fallback or step is not None:
            try:
                return self._restore(step, {})
            except IntegrityError as err:
                raise IntegrityError(
                    f"{err}. Nothing was written to disk; the live model may be partly restored. "
                    "restore(fallback=True) loads the newest composite that verifies"
                ) from None
        skipped: dict[int, str] = {}
        for candidate in self._lineage_newest_first():
            problems = self._problems_of(candidate)
            if not problems:
                return self._restore(candidate, skipped)
            skipped[candidate] = "; ".join(problems[:3])
        raise IntegrityError(
            f"{self.run.root}: no composite verifies: "
            + " | ".join(f"step {s}: {why}" for s, why in skipped.items())
        )

    def continue_from(self, step: int) -> None:
        """Make the next save extend the composite of ``step`` without loading anything: for a
        caller that has already loaded that composite by other means (the HF integration, which
        resumes through Trainer's own loader). ``restore`` does this itself."""
        self._extend(self.run.resolve(step))

    def _extend(self, composite: Composite) -> None:
        self._parent = composite.step
        self._save_index = composite.manifest.save_index + 1
        self._composite = dict(composite.sources)

    def close(self) -> None:
        """Release the run's writer lock (also released when the process exits)."""
        self._lock.release()

    def __enter__(self) -> Tailor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _restore(self, step: int | None, skipped: dict[int, str]) -> RestoreReport:
        start = time.perf_counter()
        composite = self.run.resolve(step)
        sources = {unit: self.run.manifest(source) for unit, source in composite.sources.items()}
        self.state.check_compatible(composite.manifest, sources)
        missing = set(self.layout.units) - set(sources)
        if missing:
            raise IntegrityError(f"composite of step {composite.step} names no version of units {sorted(missing)}")
        global_state = self.run.read_global(composite.step)
        live = self.state.tensors()
        optimizer_state: dict[str, dict[str, Any]] = {}
        for unit, source in sources.items():
            loaded, values = self.run.read_unit(source.step, unit)
            self.state.apply_unit(unit, loaded, values, live, optimizer_state)
        extra = self.state.apply_global(global_state, optimizer_state, live)
        self._extend(composite)
        return RestoreReport(
            step=composite.step,
            extra=extra,
            sources=dict(composite.sources),
            seconds=time.perf_counter() - start,
            skipped=skipped,
        )

    def _problems_of(self, step: int) -> list[str]:
        try:
            return self.run.verify(step)
        except TailorError as err:
            return [str(err)]

    def _lineage_newest_first(self) -> list[int]:
        """The newest composite and its ancestors; where a manifest is unreadable (so its
        parent is unknown), the next older committed snapshot stands in."""
        steps = self.run.steps()
        if not steps:
            raise IntegrityError(f"{self.run.root}: no committed snapshot in this run directory")
        try:
            current: int | None = self.run.latest_step()
        except TailorError:
            current = steps[-1]
        lineage = []
        while current is not None:
            lineage.append(current)
            try:
                current = self.run.manifest(current).parent
            except TailorError:
                current = max((s for s in steps if s < current), default=None)
        return lineage

