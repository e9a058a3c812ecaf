"""Retention: keep what the newest K composites need, delete the rest, safely.

The newest K composites are the newest one (``Run.latest_step``) and its K-1 nearest
ancestors along the ``parent`` links, so snapshots of an abandoned branch (written after a
restore of an older step) are never counted as kept. A snapshot survives when it is one of
those composites or a composite table of one names it.

Deleting is crash-safe: each doomed snapshot directory is first renamed into ``.trash/``
(atomic; from then on it is not a committed snapshot and nothing refers to it), the rename
is made durable, and only then is the directory removed. A crash at any point leaves every
kept composite whole; leftovers in ``.trash/`` are removed by the next writer.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass

from llmtailor.constants import TRASH_DIR
from llmtailor.errors import ConfigError
from llmtailor.store.files import fsync_dir
from llmtailor.store.run import Run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPlan:
    composites: list[int]
    """The newest K composites, newest first."""
    keep: list[int]
    """Snapshots those composites need, ascending."""
    delete: list[int]
    """Every other committed snapshot, ascending."""


def check_keep(keep: object) -> int:
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ConfigError(f"keep={keep!r} must be a positive integer (the number of newest composites to keep)")
    return keep


def plan_retention(run: Run, keep: int) -> RetentionPlan:
    """What ``keep`` newest composites need. Reads manifests only; deletes nothing."""
    check_keep(keep)
    steps = run.steps()
    composites: list[int] = []
    current = run.latest_step()
    while current is not None and len(composites) < keep:
        composites.append(current)
        current = run.manifest(current).parent
        if current is not None and current not in steps:
            break  # an ancestor already removed: nothing older can be needed through it
    needed = set(composites)
    for step in composites:
        needed.update(run.manifest(step).composite.values())
    return RetentionPlan(
        composites=composites,
        keep=sorted(s for s in steps if s in needed),
        delete=[s for s in steps if s not in needed],
    )


def apply_retention(run: Run, plan: RetentionPlan) -> list[str]:
    """Delete ``plan.delete``. Returns the problems met (logged, not raised): a snapshot that
    could not be moved stays committed and whole; one moved but not removed stays in the
    trash for the next writer."""
    if not plan.delete:
        return []
    trash = run.root / TRASH_DIR
    trash.mkdir(exist_ok=True)
    moved, problems = [], []
    for step in plan.delete:
        source = run.snapshot_dir(step)
        target = trash / f"{source.name}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(source, target)
            moved.append(target)
        except OSError as err:
            problems.append(f"could not remove snapshot {step}: {err.strerror}")
    fsync_dir(run.snapshots_dir)
    for target in moved:
        try:
            shutil.rmtree(target)
        except OSError as err:
            problems.append(f"{target}: could not delete ({err.strerror}); the next writer retries")
    for problem in problems:
        log.warning("llmtailor retention: %s", problem)
    run.forget(plan.delete)
    return problems
