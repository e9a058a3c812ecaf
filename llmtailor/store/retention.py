"""Retention: keep what the newest K composites need, delete the rest, safely.

The newest K composites are the newest one (``Run.latest_step``) and its K-1 nearest
ancestors along the ``parent`` links, so snapshots of an abandoned branch (written after a
restore of an older step) are never counted as kept. A snapshot survives when it is one of
those composites or a composite table of one names it, or when a composite the caller spares
needs it (a writer's: the composites its promotion reads or may read next, ``Promoter.may_read``),
or when it is the newest composite that needs none of the snapshots whose names this process
could not confirm durable (``SnapshotCommits.doubtful``: a crash may lose those, and every
composite that needs one with them).

Deleting is crash-safe: each doomed snapshot is first made not a snapshot, at once and
durably (``SnapshotCommits.discard``: locally, its directory renamed into ``.trash/``; on an
object store, its manifest deleted first), and only then are its files removed. A crash at any
point leaves every kept composite whole; leftovers are removed by the next writer.

Deleting never pulls files from under a reader: a snapshot is discarded only while retention
holds its removal lease (``RunLocks.lease_for_removal``); one a reader holds is left in place
for the next retention (logged). A reader that comes after finds the snapshot gone, never half.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import islice
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BeforeValidator

from llmtailor.errors import ConfigError, TailorError, describe_os_error
from llmtailor.store.run import Run
from llmtailor.store.storage import Lease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPlan:
    composites: list[int]
    """The newest K composites, newest first."""
    keep: list[int]
    """Snapshots those composites need, ascending."""
    delete: list[int]
    """Every other committed snapshot, ascending."""
    spared: list[int] = field(default_factory=list)
    """Snapshots kept only because a spared composite needs them, ascending."""


@dataclass(frozen=True)
class RetentionOutcome:
    """What ``apply_retention`` did."""

    deleted: list[int] = field(default_factory=list)
    """Snapshots discarded (their files removed, or left for the next writer)."""
    in_use: list[int] = field(default_factory=list)
    """Doomed snapshots a reader held: left in place for the next retention."""
    problems: list[str] = field(default_factory=list)
    """Failures met (logged, not raised)."""


def check_keep(keep: object) -> int:
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ConfigError(f"keep={keep!r} must be a positive integer (the number of newest composites to keep)")
    return keep


def _keep_field(value: object) -> object:
    """``check_keep`` for a pydantic field (None allowed; a ValueError, which pydantic collects
    with the other problems)."""
    try:
        return value if value is None else check_keep(value)
    except ConfigError as err:
        raise ValueError(str(err)) from None


Keep = Annotated[int | None, BeforeValidator(_keep_field)]
"""The type of a ``keep`` option of a pydantic model (``TailorConfig.keep``, ``Tier.keep``)."""


def plan_retention(run: Run, keep: int, spare: Iterable[int] = ()) -> RetentionPlan:
    """What ``keep`` newest composites need, and the composites of ``spare`` (steps; one not
    committed in ``run`` spares nothing). Reads manifests only; deletes nothing. One decision,
    one listing of the run (``Run.listed``), not one per question asked of it."""
    check_keep(keep)
    with run.listed():
        steps = run.steps()
        # An ancestor already removed ends the lineage: nothing older can be needed through it.
        composites = list(islice(run.lineage(), keep))
        needed = _needed(run, composites)
        spare = {*spare, *_undoubted(run, steps)}
        spared = _needed(run, [step for step in sorted(spare) if step in steps]) - needed
    return RetentionPlan(
        composites=composites,
        keep=sorted(s for s in steps if s in needed or s in spared),
        delete=[s for s in steps if s not in needed and s not in spared],
        spared=sorted(s for s in steps if s in spared),
    )


def _undoubted(run: Run, steps: list[int]) -> list[int]:
    """Where ``steps`` hold snapshots whose names this process could not confirm durable
    (``SnapshotCommits.doubtful``: the fsync after a commit's rename failed), the newest composite
    of the lineage that needs none of them, which retention spares: a crash of the machine may
    lose those names, and with them every composite that needs one; what a restore with
    ``fallback=True`` finds then must still be there. Nothing when no name is doubtful, or when
    every composite of the lineage needs one."""
    doubtful = run.storage.commits.doubtful()
    doubtful = {step for step in steps if run.snapshot_key(step) in doubtful} if doubtful else set()
    if not doubtful:
        return []
    for step in run.lineage():
        if not doubtful.intersection(run.needs(run.resolve(step))):
            return [step]
    return []


def _needed(run: Run, composites: list[int]) -> set[int]:
    """The snapshots ``composites`` read: their own, their units' versions and the frozen
    tensors those keep."""
    needed = set(composites)
    for step in composites:
        needed.update(run.needs(run.resolve(step)))
    return needed


def apply_retention(run: Run, plan: RetentionPlan, background: bool = False) -> RetentionOutcome:
    """Delete ``plan.delete``, except the snapshots a reader holds (``discard_snapshots``)."""
    return discard_snapshots(run, plan.delete, background)


def discard_snapshots(run: Run, steps: list[int], background: bool = False) -> RetentionOutcome:
    """Delete the committed snapshots of ``steps``, crash-safely, except those a reader holds
    (module docstring). Failures are logged, not raised: a snapshot that could not be moved
    stays committed and whole; one moved but not removed stays in the trash for the next
    writer. The caller holds the run's writer lock. ``background``: the files of those
    discarded are removed after this returns, where the storage can (``purge_later``; the
    writer lock waits for it before it is let go)."""
    if not steps:
        return RetentionOutcome()
    storage = run.storage
    moved: list[tuple[int, str]] = []
    in_use: list[int] = []
    problems: list[str] = []
    claims: list[Lease] = []
    try:
        for step in steps:
            source = run.snapshot_key(step)
            try:
                claim = storage.locks.lease_for_removal(source)
            except TailorError as err:
                problems.append(f"could not remove snapshot {step}: {err}")
                continue
            if claim is None:
                in_use.append(step)
                continue
            claims.append(claim)
            try:
                moved.append((step, storage.commits.discard(source)))
            except TailorError as err:
                problems.append(f"could not remove snapshot {step}: {err}")
            except OSError as err:
                problems.append(f"could not remove snapshot {step}: {describe_os_error(err, storage.where(source))}")
    finally:
        for claim in claims:  # a reader waiting on one now finds its snapshot gone
            claim.release()
    purge = storage.commits.purge_later if background else storage.commits.purge
    for _, token in moved:
        try:
            purge(token)
        except (TailorError, OSError) as err:
            problems.append(str(err))
    if in_use:
        log.info("llmtailor retention: snapshot(s) %s are being read; left for the next retention", in_use)
    for problem in problems:
        log.warning("llmtailor retention: %s", problem)
    run.forget([step for step, _ in moved])
    return RetentionOutcome(deleted=[step for step, _ in moved], in_use=in_use, problems=problems)


def retain_after_commit(run: Run, keep: int, committed: str, spare: Iterable[int] = ()) -> bool:
    """Retention after a writer's commit (``Tailor(keep=K)``), sparing the composites of
    ``spare`` (``plan_retention``): a failure is logged, never fatal to the save that was just
    committed (``committed`` names it). The discarded snapshots' files are removed in the
    background: the save does not wait for it. Returns whether it passed over snapshots a
    reader held (``RetentionOutcome.in_use``) or that only ``spare`` needs: the writer runs it
    once more when it closes (``Tiers.close``, sparing nothing: its promotions are done), so
    what a run keeps does not depend on a reader's or the promoter's pace."""
    try:
        plan = plan_retention(run, keep, spare)
        return bool(apply_retention(run, plan, background=True).in_use or plan.spared)
    except (TailorError, OSError) as err:
        log.warning("llmtailor retention after %s: %s", committed, err)
        return False
