"""A run's storage tiers: faster stores in front of the run directory, fastest first.

Each tier is a complete run in the same format (``store.run``): host memory (``/dev/shm/...``,
outlives the training process, not the node), node-local disk, then the run directory itself,
the last and durable tier (a shared filesystem or an object store). A run without tiers is the
one-tier case: the run directory alone.

- Saves commit to the first tier (``first``), with the usual commit protocol and retention.
- Committed composites move down the tiers in the background (``store.promote``): each tier's
  ``promote_every`` sets which reach the next; a composite promoted to a tier is complete there.
- ``choose`` picks what a restore reads: the newest composite any tier holds whole (the faster
  tier on a tie), so losing the faster tiers loses only the saves since the last promotion.
- Each tier has its own writer lock (taken together by the writer) and its own retention.
- ``tiers.json`` in every tier records the tiers (``inspect`` and ``gc`` read it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.constants import TIERS_FILE
from llmtailor.errors import ConfigError, IntegrityError, SnapshotNotFoundError, TailorError
from llmtailor.store.lineage import choose_composite
from llmtailor.store.lock import WriterLock
from llmtailor.store.run import Run
from llmtailor.store.storage import open_storage

if TYPE_CHECKING:
    from llmtailor.config import Tier

TIERS_FORMAT = "llmtailor.tiers"


@dataclass
class Level:
    """One tier of a run: its store, writer lock, retention and the cadence of the next tier."""

    run: Run
    lock: WriterLock
    keep: int | None
    promote_every: int | None
    """None for the last tier (nothing after it)."""

    @property
    def name(self) -> str:
        return str(self.run.root)

    def record(self) -> dict[str, Any]:
        location = str(Path(self.run.root).resolve()) if self.run.is_local else self.run.storage.url
        return {"location": location, "keep": self.keep, "promote_every": self.promote_every}


@dataclass(frozen=True)
class Choice:
    """What a restore reads: the tier (its index, fastest 0) and the composite's step, and the
    newer composites passed over, and why."""

    level: int
    step: int
    skipped: dict[int, str]


class Tiers:
    """The tiers of a run, fastest first; the run directory ``home`` is the last."""

    def __init__(self, home: str | Path, tiers: Sequence[Tier] = (), keep: int | None = None,
                 storage_options: dict[str, Any] | None = None):
        levels = [_level(Run(t.location, t.storage_options), t.keep, t.promote_every) for t in tiers]
        levels.append(_level(Run(home, storage_options), keep, None))
        for i, level in enumerate(levels):
            for other in levels[:i]:
                if level.run.storage.same_place(other.run.storage):
                    raise ConfigError(f"tier {other.name} and {level.name} are one location: every tier needs its own")
        self.levels = levels

    @property
    def first(self) -> Level:
        """Where saves commit."""
        return self.levels[0]

    @property
    def home(self) -> Level:
        return self.levels[-1]

    def __len__(self) -> int:
        return len(self.levels)

    def index_of(self, run: Run) -> int | None:
        """The tier ``run`` is, or None."""
        for i, level in enumerate(self.levels):
            if level.run.storage.same_place(run.storage):
                return i
        return None

    # -- locks and the record -------------------------------------------------------------

    def take_locks(self) -> None:
        """Take every tier's writer lock (or, where a tier cannot be written, refuse one another
        process holds: ``WriterLock.acquire_or_look``); all or none."""
        taken = []
        try:
            for level in self.levels:
                level.lock.acquire_or_look()
                taken.append(level)
        except BaseException:
            for level in taken:
                level.lock.release()
            raise

    def release_locks(self) -> None:
        for level in self.levels:
            level.lock.release()

    def write_record(self) -> None:
        """Record the tiers in each of them (``tiers.json``), so ``inspect`` and ``gc`` of any
        tier find the others. Only with more than one tier; by the lock holder."""
        if len(self.levels) == 1:
            return
        data = json.dumps({"format": TIERS_FORMAT, "tiers": [level.record() for level in self.levels]}, indent=1)
        for level in self.levels:
            level.run.storage.replace(TIERS_FILE, data.encode())

    # -- reading ----------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest composite step of any tier (tiers that cannot be read are passed over)."""
        found = [step for step, _ in self._newest()]
        return max(found) if found else None

    def _newest(self) -> list[tuple[int, int]]:
        """(newest step, tier index) of every tier holding a committed snapshot."""
        found = []
        for i, level in enumerate(self.levels):
            try:
                step = level.run.latest_step()
            except TailorError:
                continue
            if step is not None:
                found.append((step, i))
        return found

    def choose(self, step: int | None, fallback: bool) -> Choice:
        """The composite a restore reads (module docstring): of ``step`` (default: the newest),
        from the fastest tier holding it whole; with ``fallback``, the newest that verifies in
        any tier. Raises SnapshotNotFoundError naming what each tier lacked."""
        if len(self.levels) == 1:  # one tier: its own choice and errors, as they are
            chosen, skipped = choose_composite(self.home.run, step, fallback)
            return Choice(0, chosen, skipped)
        why: list[str] = []
        best: Choice | None = None
        candidates = sorted(self._newest(), key=lambda found: (-found[0], found[1])) if step is None else \
            [(step, i) for i in range(len(self.levels))]
        for newest, i in candidates:
            if best is not None and best.step >= newest:
                break  # no slower tier can do better
            run = self.levels[i].run
            try:
                chosen, skipped = choose_composite(run, step, fallback)
                with run.reading(chosen):  # whole in this tier: every snapshot it needs is there
                    pass
            except TailorError as err:
                why.append(f"{self.levels[i].name}: {err}")
                continue
            if best is None or chosen > best.step:
                best = Choice(i, chosen, skipped)
        if best is None:
            what = f"the composite of step {step}" if step is not None else "a committed composite"
            detail = "; ".join(why) if why else "every tier is empty"
            raise SnapshotNotFoundError(f"no tier holds {what} whole ({detail})")
        return best


@dataclass(frozen=True)
class TierState:
    """What ``inspect`` shows of one tier a run records."""

    location: str
    keep: int | None
    promote_every: int | None
    steps: list[int] | None
    """Its committed snapshots; None when it cannot be read here (``problem`` says why)."""
    newest: int | None = None
    problem: str | None = None
    here: bool = False
    """Whether it is the run asked about."""


def tier_states(run: Run) -> list[TierState] | None:
    """Every tier ``run`` records (``tiers.json``), fastest first, as found now; None when the
    run records no tiers. A tier that is not here (another node's memory, wiped) is shown so."""
    record = read_record(run)
    if record is None:
        return None
    states = []
    for entry in record:
        location = str(entry.get("location"))
        keep, every = entry.get("keep"), entry.get("promote_every")
        try:
            here = open_storage(location).same_place(run.storage)
            tier = run if here else Run(location)
            if not tier.storage.exists(TIERS_FILE):
                states.append(TierState(location, keep, every, None, problem="not here (another node's, or wiped)"))
                continue
            states.append(TierState(location, keep, every, tier.steps(), tier.latest_step(), here=here))
        except TailorError as err:
            states.append(TierState(location, keep, every, None, problem=str(err)))
    return states


def _level(run: Run, keep: int | None, promote_every: int | None) -> Level:
    return Level(run, WriterLock(run.storage), keep, promote_every)


def read_record(run: Run) -> list[dict[str, Any]] | None:
    """The tiers a run records (``tiers.json``: location, keep, promote_every, fastest
    first), or None when it has no tiers."""
    if not run.storage.is_file(TIERS_FILE):
        return None
    where = run.storage.where(TIERS_FILE)
    try:
        data = json.loads(bytes(run.storage.read(TIERS_FILE)))
    except ValueError as err:
        raise IntegrityError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != TIERS_FORMAT or not isinstance(data.get("tiers"), list):
        raise IntegrityError(f"{where}: not a record of llmtailor tiers")
    return data["tiers"]


__all__ = ["Choice", "Level", "TierState", "Tiers", "read_record", "tier_states"]
