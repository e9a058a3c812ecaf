"""What a restore reads across the tiers: the newest composite any tier holds whole, from the
fastest tier on a tie (``choose``), so losing the faster tiers loses only the saves since the
last promotion."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import NamedTuple

from llmtailor.constants import CARRIED_FOR
from llmtailor.errors import SnapshotNotFoundError, TailorError
from llmtailor.store.catalog import LeasedComposite, empty_run
from llmtailor.store.run import Run
from llmtailor.store.tiers.levels import Level
from llmtailor.store.tiers.recovery import NodeChoice


class Choice(NamedTuple):
    """What a restore reads: the tier (its index, fastest 0) and the composite's step, and the
    newer composites passed over, and why (a tuple: it travels to every rank as JSON).
    ``newest``: the newest step any tier holds (of any lineage), which the writer's next save
    must come after when it is newer than ``step`` (``Lineage.check_next``)."""

    level: int
    step: int
    skipped: dict[int, str]
    newest: int | None = None


def choose(levels: list[Level], step: int | None, offer: NodeChoice | None = None) -> tuple[Choice, LeasedComposite]:
    """The composite a restore reads (module docstring), leased: of ``step`` (default: the
    newest), from the fastest tier holding it whole, with the lease on every snapshot it needs
    that proved it whole, for the restore to read under (one lease, one resolution).
    ``skipped``: the newer (or equal) composites passed over, in any tier, each with its tier
    and why. Raises SnapshotNotFoundError naming what each tier lacked; a tier that cannot be
    read raises its error. Each tier's snapshots are listed once. ``offer``: what a node-local
    first tier offers, decided across the nodes (``healing.recover``): that composite only (or
    none), whatever this node's own copy holds."""
    with ExitStack() as listed:
        for level in levels:
            listed.enter_context(level.run.listed())
        if len(levels) == 1:  # one tier: its own choice and errors, as they are
            held = levels[0].run.lease(step)
            return Choice(0, held.composite.step, {}, newest_held(levels)), held
        return _choose_among(levels, step, offer)


def _choose_among(levels: list[Level], step: int | None, offer: NodeChoice | None) -> tuple[Choice, LeasedComposite]:
    why: list[str] = [f"{levels[0].name}: {reason}" for reason in (offer.skipped.values() if offer else ())]
    passed: dict[int, str] = {s: f"{levels[0].name}: {reason}" for s, reason in (offer.skipped.items() if offer else ())}
    best: tuple[Choice, LeasedComposite] | None = None
    candidates = sorted(newest_steps(levels, raise_problem), key=lambda found: (-found[0], found[1])) if step is None else \
        [(step, i) for i in range(len(levels))]
    if offer is not None:  # the node-local tier: what the nodes hold whole together, not this node's copy
        candidates = sorted([c for c in candidates if c[1] != 0] + ([(offer.step, 0)] if offer.step is not None else []),
                            key=lambda found: (-found[0], found[1]))
    try:
        for newest, i in candidates:
            if best is not None and best[0].step >= newest:
                break  # no slower tier can do better
            try:  # whole in this tier: every snapshot it needs is there
                held = levels[i].run.lease(offer.step if offer is not None and i == 0 else step)
            except TailorError as err:
                why.append(f"{levels[i].name}: {tier_reason(levels[i], err)}")
                passed.setdefault(newest, why[-1])
                continue
            if best is None or held.composite.step > best[0].step:
                if best is not None:
                    best[1].close()
                best = Choice(i, held.composite.step, {}), held
            else:
                held.close()
    except BaseException:
        if best is not None:
            best[1].close()
        raise
    if best is None:
        what = f"the composite of step {step}" if step is not None else "a committed composite"
        detail = "; ".join(why) if why else "every tier is empty"
        raise SnapshotNotFoundError(f"no tier holds {what} whole ({detail})")
    chosen, held = best
    return chosen._replace(skipped={s: reason for s, reason in passed.items() if s >= chosen.step},
                           newest=newest_held(levels)), held


class Candidates(NamedTuple):
    """What ``restore(fallback=True)`` tries, in order, until one loads whole, every byte
    verified on the way: ``attempts`` (tier index, step), the newest first (the fastest tier
    on a tie), each tier's lineage through damage; ``unread``: the tiers that could not be
    read, and why; ``newest`` as in ``Choice``. A tuple: it travels to every rank as JSON."""

    attempts: list[tuple[int, int]]
    unread: list[str]
    newest: int | None


def candidates(levels: list[Level], offer: NodeChoice | None = None) -> Candidates:
    """The composites ``restore(fallback=True)`` tries (``Candidates``), from manifests alone:
    nothing is verified here, each is verified while it is loaded (one read of each byte).
    A single tier's problems raise as they are; of several, an unreadable one is noted.
    ``offer`` (a node-local first tier, as in ``choose``): of that tier, its composite only."""
    attempts: list[tuple[int, int]] = []
    unread: list[str] = []
    with ExitStack() as listed:
        for level in levels:
            listed.enter_context(level.run.listed())
        for i, level in enumerate(levels):
            if i == 0 and offer is not None:  # what it passed over, the restore reports (offer.skipped)
                attempts += [(0, offer.step)] if offer.step is not None else []
                continue
            try:
                attempts += [(i, step) for step in level.run.lineage(through_damage=True)]
            except TailorError as err:
                if len(levels) == 1:
                    raise
                unread.append(f"{level.name} could not be read: {tier_reason(level, err)}")
        if len(levels) == 1 and not attempts:  # no snapshot, as restore() says: not damage
            raise SnapshotNotFoundError(empty_run(levels[0].run.root))
        if not attempts:
            raise SnapshotNotFoundError(f"no tier holds a committed composite whole ({'; '.join(unread) or 'every tier is empty'})")
        attempts.sort(key=lambda attempt: (-attempt[1], attempt[0]))
        return Candidates(attempts, unread, newest_held(levels))


def tier_reason(level: Level, err: TailorError) -> str:
    """``err`` as one tier's part of a message about several: its cause only (its first line:
    a what-to-do line, as an empty run's, is not one tier's), without the tier's name where it
    begins with it (the message names the tier before it)."""
    return str(err).split("\n", 1)[0].removeprefix(f"{level.name}: ")


def newest_steps(levels: list[Level], on_problem: Callable[[int, TailorError], None]) -> list[tuple[int, int]]:
    """(newest step, tier index) of every tier holding a committed snapshot; a tier that
    cannot be read goes to ``on_problem``."""
    found = []
    for i, level in enumerate(levels):
        try:
            step = level.run.latest_step()
        except TailorError as err:
            on_problem(i, err)
            continue
        if step is not None:
            found.append((step, i))
    return found


def raise_problem(level: int, err: TailorError) -> None:
    """A tier that cannot be read: raise its error (``newest_steps``'s ``on_problem``)."""
    raise err


def newest_held(levels: list[Level]) -> int | None:
    """The newest step of a composite any readable tier holds, whatever its lineage (a
    restore of an older composite leaves newer ones of the lineage it left). Carriers do not
    count: one a composite needs is older than it, and a stray one is replaced when a
    promotion needs its step."""
    held = []
    for level in levels:
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
