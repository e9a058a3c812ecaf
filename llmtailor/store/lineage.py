"""The lineage a writer extends (the composite a restore takes: ``tiers/choice.py``).

A run's snapshots form lineages: each manifest names its ``parent``, the composite the save
extended (``Run.lineage`` walks them). A ``Tailor`` extends one: after a restore, the restored
composite's; after its own save, that save's. ``Lineage`` is what it must know of it to choose
and record the next save: the parent step, the next save index, the composite table, and per
unit the save index and bytes of its newest version.

A writer that restored nothing starts a lineage of its own; where the run already holds a
composite, that start is refused unless asked for (``refuse_a_fresh_start``,
``Lineage.starts_after``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmtailor.errors import ConfigError
from llmtailor.store.catalog import Composite
from llmtailor.store.run import Run


@dataclass
class Lineage:
    """The lineage one writer extends (module docstring). A fresh one starts a new lineage,
    whose first save is full (no unit has a saved version)."""

    parent: int | None = None
    """Step of the composite the next save extends."""
    save_index: int = 0
    """Index of the next save (0 for a run's first; continues across restores)."""
    composite: dict[str, int] = field(default_factory=dict)
    """Unit -> step of its newest version."""
    saved_index: dict[str, int] = field(default_factory=dict)
    """Unit -> save index of its newest version."""
    unit_bytes: dict[str, int] = field(default_factory=dict)
    """Unit -> bytes of its newest version (all ranks)."""
    floor: int | None = None
    """After a restore of an older composite: the newest step the run's tiers held then, of the
    lineage left behind. The next save must come after it, so a step number names one snapshot
    in every tier and a parent link (a step) is never taken for another snapshot's; saving a
    step that a newer snapshot names as its parent would have made that snapshot the run's
    newest, and retention then removed the save."""

    def starts_after(self, newest: int | None) -> None:
        """A fresh lineage started, as asked (``fresh_start``), in a run whose newest composite is
        of step ``newest``: its first save must come after it (``floor``), so the run's newest
        composite never goes back to an older step and no later save's step is one the run holds."""
        self.floor = newest

    def check_next(self, step: int) -> None:
        """ConfigError unless ``step`` can be the next save's: a non-negative integer after the
        parent's step."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        if self.parent is not None and step <= self.parent:
            raise ConfigError(f"step {step} is not after the previous snapshot's step {self.parent}")
        if self.floor is not None and step <= self.floor and self.parent is None:
            raise ConfigError(
                f"step {step} is not after step {self.floor}, the newest snapshot this run held when this "
                f"fresh start began: save steps after {self.floor}, so each step names one snapshot and "
                "the run's newest state is this training's"
            )
        if self.floor is not None and step <= self.floor:
            raise ConfigError(
                f"step {step} is not after step {self.floor}, the newest snapshot of this run (of the lineage "
                f"left when step {self.parent} was restored): save steps after {self.floor}, so each step "
                "names one snapshot (the newer ones stay until retention or gc removes them)"
            )

    _pending: list[tuple[int, int | None, int, dict[str, int], dict[str, int]]] = field(default_factory=list, repr=False)
    """The saves staged and not yet committed, oldest first, each with the lineage before it
    (step, parent, save index, composite, saved indexes)."""

    def staged(self, step: int, composite: dict[str, int]) -> None:
        """This writer's save of ``step`` is staged, writing the units ``composite`` names at
        ``step``: the next save extends it (an async save in flight), its units' bytes still the
        previous versions' until it commits (``committed``); ``failed`` goes back."""
        self._pending.append((step, self.parent, self.save_index, dict(self.composite), dict(self.saved_index)))
        for unit, source in composite.items():
            if source == step:
                self.saved_index[unit] = self.save_index
        self.parent, self.save_index, self.composite = step, self.save_index + 1, dict(composite)

    def committed(self, run: Run, step: int, composite: dict[str, int]) -> None:
        """The oldest save staged, of ``step``, committed: its units' bytes, from its manifest."""
        manifest = run.manifest(step)
        for unit, source in composite.items():
            if source == step:
                self.unit_bytes[unit] = manifest.unit_bytes(unit)
        if self._pending and self._pending[0][0] == step:
            self._pending.pop(0)

    def failed(self) -> None:
        """Every save staged and not committed failed (a save staged behind one that failed
        fails with it): the lineage of the last committed save again."""
        if self._pending:
            _, self.parent, self.save_index, self.composite, self.saved_index = self._pending[0]
            self._pending.clear()

    def restored(self, run: Run, composite: Composite, extend: bool = True, newest: int | None = None) -> None:
        """The composite this writer restored: the next save extends it. ``extend=False`` (read
        from a slower tier, which the tier saves go to may lack parts of): the next save extends
        its step, but counts no unit's version as saved, so it is full. ``newest``: the newest
        step the run's tiers hold (``floor``)."""
        self._pending.clear()
        self.parent = composite.step
        self.floor = newest if newest is not None and newest > composite.step else None
        self.save_index = composite.manifest.save_index + 1
        if not extend:
            self.composite, self.saved_index, self.unit_bytes = {}, {}, {}
            return
        self.composite = dict(composite.sources)
        for unit, source in composite.sources.items():
            manifest = run.manifest(source)
            self.saved_index[unit] = manifest.save_index
            self.unit_bytes[unit] = manifest.unit_bytes(unit)



def refuse_a_fresh_start(run_dir: Any, newest: int | None, resume: str, instead: str) -> None:
    """Refuse the first save of a writer that restored nothing into a run holding the composite
    of step ``newest`` (a restart that left out its resume): that save would start a lineage of
    its own there and become the run's newest composite, even at an older step, so retention
    (``keep``) deleted the snapshots the run held, the newest state of the training it was;
    without retention a later save's step could be one the run holds, refused mid-training.
    ``resume``: how to resume from it; ``instead``: how to train from scratch. Nothing written."""
    if newest is not None:
        raise ConfigError(f"{run_dir} holds the composite of step {newest}{resume}; to train from scratch, {instead} "
                          "(or delete that run)")
