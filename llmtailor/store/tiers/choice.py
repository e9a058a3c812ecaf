"""What a restore reads across the tiers: the newest composite any tier holds whole, from the
fastest tier on a tie (``choose``), so losing the faster tiers loses only the saves since the
last promotion."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from llmtailor.constants import CARRIED_FOR
from llmtailor.errors import SnapshotNotFoundError, TailorError
from llmtailor.store.lineage import choose_composite
from llmtailor.store.run import Run
from llmtailor.store.tiers.levels import Level


class Choice(NamedTuple):
    """What a restore reads: the tier (its index, fastest 0) and the composite's step, and the
    newer composites passed over, and why (a tuple: it travels to every rank as JSON).
    ``newest``: the newest step any tier holds (of any lineage), which the writer's next save
    must come after when it is newer than ``step`` (``Lineage.check_next``)."""

    level: int
    step: int
    skipped: dict[int, str]
    newest: int | None = None


def choose(levels: list[Level], step: int | None, fallback: bool) -> Choice:
    """The composite a restore reads (module docstring): of ``step`` (default: the newest),
    from the fastest tier holding it whole; with ``fallback``, the newest that verifies in
    any tier. ``skipped``: the newer (or equal) composites passed over, in any tier, each
    with its tier and why. Raises SnapshotNotFoundError naming what each tier lacked; a tier
    that cannot be read raises its error, but with ``fallback`` (the restore then takes what
    the others hold, and ``skipped`` names the tier)."""
    if len(levels) == 1:  # one tier: its own choice and errors, as they are
        chosen, skipped = choose_composite(levels[-1].run, step, fallback)
        return Choice(0, chosen, skipped, newest_held(levels))
    why: list[str] = []
    passed: dict[int, str] = {}  # newer composites passed over, in any tier: step -> "tier: why"
    unread: list[str] = []

    def unreadable(level: int, err: TailorError) -> None:
        if not fallback:
            raise err
        unread.append(f"{levels[level].name} could not be read: {err}")

    best: Choice | None = None
    candidates = sorted(newest_steps(levels, unreadable), key=lambda found: (-found[0], found[1])) if step is None else \
        [(step, i) for i in range(len(levels))]
    for newest, i in candidates:
        if best is not None and best.step >= newest:
            break  # no slower tier can do better
        run, name = levels[i].run, levels[i].name
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
                         newest=newest_held(levels))


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
