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
- A writer starts only where it can write every tier (taking each lock proves it), records the
  tiers in all of them only then, and a start that fails leaves every tier as it found it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from os import PathLike
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from llmtailor.constants import CARRIED_FOR, TIERS_FILE
from llmtailor.errors import (
    ConfigError,
    IntegrityError,
    PromotionError,
    SnapshotNotFoundError,
    TailorError,
    describe_validation,
)
from llmtailor.distributed.coordinator import Coordinator
from llmtailor.errors import StorageError, describe_os_error
from llmtailor.store.lineage import choose_composite
from llmtailor.store.lock import WriterLock
from llmtailor.store.promote import Promoter, Promotion, clear_stray_carriers
from llmtailor.store.retention import Keep, retain_after_commit
from llmtailor.store.run import Run
from llmtailor.store.storage import open_storage

TIERS_FORMAT = "llmtailor.tiers"

log = logging.getLogger(__name__)


class Tier(BaseModel):
    """A faster store in front of the run directory (host memory, node-local disk): a complete
    llmtailor run of its own at ``location``, in the same format. ``TailorConfig.tiers`` lists
    them fastest first; the run directory itself is the last, durable tier. Saves commit to the
    first tier; a background promoter copies committed composites down the tiers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    location: str
    """A local directory (``/dev/shm/exp1``: host memory, outlives the training process but not
    the node; ``/local/nvme/exp1``) or an object-store URL."""
    keep: Keep = 2
    """Retention in this tier: the newest ``keep`` composites (and what they need); None keeps
    everything (a memory tier then fills up)."""
    promote_every: int = 1
    """Cadence of the next tier: a composite committed here is promoted to the next slower tier
    once it is at least this many steps after the newest composite that tier holds (each
    promotion takes the newest composite here; ``close()`` promotes the last save everywhere)."""
    storage_options: dict[str, Any] | None = None
    """The store's options for an object-store URL (as ``TailorConfig.storage_options``)."""

    def __init__(self, location: str | PathLike | None = None, /, **options: Any):
        """``Tier("/dev/shm/exp1", keep=2, promote_every=50)``; every problem in one ConfigError."""
        if location is not None:
            options["location"] = location
        try:
            super().__init__(**options)
        except ValidationError as err:
            raise ConfigError(f"Tier options: {describe_validation(err)}") from None

    @field_validator("location", mode="before")
    @classmethod
    def _a_location(cls, value: Any) -> Any:
        value = str(value) if isinstance(value, PathLike) else value
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"a tier's location must be a path or URL, got {value!r}")
        return value

    @field_validator("promote_every", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"promote_every={value!r} must be a positive number of steps")
        return value


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


class Choice(NamedTuple):
    """What a restore reads: the tier (its index, fastest 0) and the composite's step, and the
    newer composites passed over, and why (a tuple: it travels to every rank as JSON).
    ``newest``: the newest step any tier holds (of any lineage), which the writer's next save
    must come after when it is newer than ``step`` (``Lineage.check_next``)."""

    level: int
    step: int
    skipped: dict[int, str]
    newest: int | None = None


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
        self.promoter: Promoter | None = None
        """Set by ``open_for_writing`` (the writer's rank 0, with more than one tier)."""
        self._recorded_over: list[tuple[Level, bytes | None]] = []
        """The tiers this writer recorded itself in, with what they recorded before (``abandon``)."""

    @classmethod
    def of(cls, home: str | Path, config: Any) -> Tiers:
        """The tiers a ``TailorConfig`` declares in front of the run directory ``home`` (its
        ``tiers``, ``keep`` and ``storage_options``)."""
        return cls(home, config.tiers, config.keep, config.storage_options)

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

    def open_for_writing(self, coordinator: Coordinator, read_only: bool = False) -> None:
        """Collective: rank 0 takes every tier's writer lock (all or none), records the tiers in
        each, removes the carriers a killed promotion left (``promote.clear_stray_carriers``)
        and starts promoting; every rank raises what failed, and a failed start leaves every
        tier as it was (``abandon``). With more than one tier, a tier that cannot be written (a
        read-only or foreign path) is a ConfigError naming it, before anything is recorded; a
        run directory alone may be read-only (``WriterLock.acquire_or_look``: it restores, and
        its first save fails, saying why). Nothing for a reader (``read_only``).

        In a distributed job every tier must be one store that every rank reaches (rank 0
        commits every rank's files there, and promotes them): each rank looks for the record
        rank 0 just wrote, and a tier some rank cannot see (node-local storage on another node)
        fails the Tailor on every rank, naming it. Per-node tiers are not supported."""
        if read_only:
            return
        round_ = coordinator.new_round()
        token = coordinator.broadcast(f"{round_}/lock", self._open if coordinator.is_leader else None)
        if token is None or coordinator.world_size == 1:
            return
        blind = [level.name for level in self.levels if not self._sees(level, token)]
        unseen = {rank: names for rank, names in enumerate(coordinator.exchange(f"{round_}/seen", blind)) if names}
        if unseen:
            self.abandon()
            which = "; ".join(f"rank {rank} cannot see {', '.join(names)}" for rank, names in unseen.items())
            raise ConfigError(f"every tier must be one store all ranks reach (rank 0 commits and promotes every "
                              f"rank's files there): {which} (node-local storage on another node?). Tiers per node "
                              "are not supported: give tiers every rank reaches (a shared or object store), or none")

    @staticmethod
    def _sees(level: Level, token: str) -> bool:
        try:
            return json.loads(bytes(level.run.storage.read(TIERS_FILE))).get("writer") == token
        except (TailorError, OSError, ValueError, AttributeError):
            return False

    def _open(self) -> str | None:
        """Rank 0's part of ``open_for_writing``; the record's token (None: nothing recorded)."""
        try:
            if len(self.levels) == 1:  # one tier: nothing to record or promote, no thread
                self.home.lock.acquire_or_look()
                token = None
            else:
                for level in self.levels:
                    _take(level)
                token = self._write_record()
            for level in self.levels:
                if level.lock.held:
                    clear_stray_carriers(level.run)
            if len(self.levels) > 1:
                self.promoter = Promoter(self.levels, [level.run.latest_step() for level in self.levels])
            return token
        except BaseException:
            self.abandon()
            raise

    def committed(self, step: int, where: str) -> None:
        """Rank 0, once the save of ``step`` committed to the first tier (at ``where``): that
        tier's retention, then the promotions due (in the background)."""
        if self.first.keep is not None:
            retain_after_commit(self.first.run, self.first.keep, where)
        if self.promoter is not None:
            self.promoter.committed(step)

    def restored(self, level: int, step: int) -> None:
        if self.promoter is not None:
            self.promoter.restored(level, step)

    @property
    def promotions(self) -> list[Promotion]:
        """The promotions this writer made so far (rank 0; empty elsewhere)."""
        return list(self.promoter.done) if self.promoter is not None else []

    def wait_promotions(self) -> None:
        """Wait for the promotion in flight, if any (rank 0)."""
        if self.promoter is not None:
            self.promoter.wait()

    def raise_failure(self, coordinator: Coordinator) -> None:
        """Collective: raise on every rank the promotion failures rank 0 met since the last
        call (each once), as a PromotionError. With one tier, nothing to do and no message."""
        if len(self.levels) > 1:
            failure = (lambda: self.promoter.take_failure() if self.promoter else None) if coordinator.is_leader else None
            message = coordinator.broadcast(f"{coordinator.new_round()}/promotion", failure)
            if message is not None:
                raise PromotionError(message)

    def close(self) -> None:
        """Promote the newest composite of the first tier to every tier and wait for it; then
        release the locks (also when that fails)."""
        try:
            if self.promoter is not None:
                self.promoter.finish()
        finally:
            self.release()

    def release(self) -> None:
        """Release every tier's lock (held or not); promote nothing more."""
        for level in self.levels:
            level.lock.release()

    def abandon(self) -> None:
        """Undo a writer's start that failed: each tier's record put back as it was, every lock
        released and what taking it created removed (a new tier's directory and ``.lock``)."""
        self.promoter = None
        for level, before in reversed(self._recorded_over):
            storage = level.run.storage
            try:
                if before is None:
                    storage.remove(TIERS_FILE)
                else:
                    storage.replace(TIERS_FILE, before)
            except (TailorError, OSError) as err:
                log.warning("llmtailor: could not put back %s: %s", storage.where(TIERS_FILE), err)
        self._recorded_over = []
        for level in self.levels:
            level.lock.abandon()

    def _write_record(self) -> str:
        """Record the tiers in each of them (``tiers.json``), so ``inspect`` and ``gc`` of any
        tier find the others; returns the record's token (this writer's). Each tier's record is
        replaced atomically; a failure raises ConfigError naming the tier, and ``abandon`` puts
        back what was replaced."""
        token = uuid.uuid4().hex
        record = {"format": TIERS_FORMAT, "writer": token, "tiers": [level.record() for level in self.levels]}
        for level in self.levels:
            storage = level.run.storage
            try:
                before = bytes(storage.read(TIERS_FILE)) if storage.is_file(TIERS_FILE) else None
                storage.replace(TIERS_FILE, json.dumps(record, indent=1).encode())
            except TailorError as err:
                raise ConfigError(f"cannot record the tiers in tier {level.name}: {err}") from None
            except OSError as err:  # its cause alone: the temporary file it names is not the user's
                reason = describe_os_error(OSError(err.errno, err.strerror), storage.where(TIERS_FILE))
                raise ConfigError(f"cannot record the tiers in tier {level.name}: {reason}") from None
            self._recorded_over.append((level, before))
        return token

    # -- reading ----------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest composite step of any tier; a tier that cannot be read raises (a script
        must not start afresh because its store did not answer)."""
        found = [step for step, _ in self._newest(self._problems_raise)]
        return max(found) if found else None

    def newest_run(self) -> Run | None:
        """The run (tier) holding the newest composite whole, or None when no tier holds one."""
        if self.latest_step() is None:
            return None
        return self.levels[self.choose(None, fallback=False).level].run

    def _newest(self, on_problem: Callable[[int, TailorError], None]) -> list[tuple[int, int]]:
        """(newest step, tier index) of every tier holding a committed snapshot; a tier that
        cannot be read goes to ``on_problem``."""
        found = []
        for i, level in enumerate(self.levels):
            try:
                step = level.run.latest_step()
            except TailorError as err:
                on_problem(i, err)
                continue
            if step is not None:
                found.append((step, i))
        return found

    @staticmethod
    def _problems_raise(level: int, err: TailorError) -> None:
        raise err

    def choose(self, step: int | None, fallback: bool) -> Choice:
        """The composite a restore reads (module docstring): of ``step`` (default: the newest),
        from the fastest tier holding it whole; with ``fallback``, the newest that verifies in
        any tier. ``skipped``: the newer (or equal) composites passed over, in any tier, each
        with its tier and why. Raises SnapshotNotFoundError naming what each tier lacked; a tier
        that cannot be read raises its error, but with ``fallback`` (the restore then takes what
        the others hold, and ``skipped`` names the tier)."""
        if len(self.levels) == 1:  # one tier: its own choice and errors, as they are
            chosen, skipped = choose_composite(self.home.run, step, fallback)
            return Choice(0, chosen, skipped, self._newest_held())
        why: list[str] = []
        passed: dict[int, str] = {}  # newer composites passed over, in any tier: step -> "tier: why"
        unread: list[str] = []

        def unreadable(level: int, err: TailorError) -> None:
            if not fallback:
                raise err
            unread.append(f"{self.levels[level].name} could not be read: {err}")

        best: Choice | None = None
        candidates = sorted(self._newest(unreadable), key=lambda found: (-found[0], found[1])) if step is None else \
            [(step, i) for i in range(len(self.levels))]
        for newest, i in candidates:
            if best is not None and best.step >= newest:
                break  # no slower tier can do better
            run, name = self.levels[i].run, self.levels[i].name
            try:
                chosen, skipped = choose_composite(run, step, fallback)
                with run.reading(chosen):  # whole in this tier: every snapshot it needs is there
                    pass
            except TailorError as err:
                why.append(f"{name}: {err}")
                passed.setdefault(newest, f"{name}: {err}")
                continue
            passed.update({s: f"{name}: {reason}" for s, reason in skipped.items() if s not in passed})
            if best is None or chosen > best.step:
                best = Choice(i, chosen, {})
        if best is None:
            what = f"the composite of step {step}" if step is not None else "a committed composite"
            detail = "; ".join(why) if why else "every tier is empty"
            raise SnapshotNotFoundError(f"no tier holds {what} whole ({detail})")
        if unread:  # its newest is unknown: said with the composite chosen
            passed[best.step] = "; ".join([*unread, *([passed[best.step]] if best.step in passed else [])])
        return best._replace(skipped={s: reason for s, reason in passed.items() if s >= best.step},
                             newest=self._newest_held())

    def _newest_held(self) -> int | None:
        """The newest step of a composite any readable tier holds, whatever its lineage (a
        restore of an older composite leaves newer ones of the lineage it left). Carriers do not
        count: one a composite needs is older than it, and a stray one is replaced when a
        promotion needs its step."""
        held = []
        for level in self.levels:
            try:
                steps = level.run.steps()
            except TailorError:
                continue  # a tier that cannot be read: reported by choose, when it matters
            held += [next((s for s in reversed(steps) if not _is_carrier(level.run, s)), None)]
        return max((s for s in held if s is not None), default=None)


def _is_carrier(run: Run, step: int) -> bool:
    """Whether the snapshot of ``step`` was promoted as a carrier (one whose manifest cannot be
    read counts as a composite: it may be one)."""
    try:
        return CARRIED_FOR in run.manifest(step).notes
    except TailorError:
        return False


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


def _take(level: Level) -> None:
    """Take a tier's writer lock, which also proves that the tier can be written (the lock file
    is written there): one that cannot be is a ConfigError naming it and why."""
    try:
        level.lock.acquire()
    except StorageError as err:
        raise ConfigError(f"{err} (a tier of this writer, which saves to every tier: give tiers it can write, or "
                          "read_only=True to restore only)") from None


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


__all__ = ["Choice", "Level", "Tier", "TierState", "Tiers", "read_record", "tier_states"]
