"""What the three integrations share to save their framework's own state and to resume.

Each hands its framework's own state to its ``Tailor`` as stateful objects
(``providers/stateful.py``), never as keys in ``extra`` (which stays the user's): accelerate's
counters and registered objects load back through ``Tailor.restore``; Trainer's
``TrainerState`` and Lightning's loop state are ``Recorded``: Trainer and Lightning restore them
with their own code, from what the integration hands them (a ``trainer_state.json``, a
checkpoint dict) before the Tailor restores. Each resumes with ``restore_composite``: from its
own run (the run directory or one of its tiers) or from another tailored run; training that
restored nothing is refused, before its first save, in a run holding a composite
(``refuse_a_fresh_start``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmtailor.reports import RestoreReport, describe_sources
from llmtailor.store.lineage import refuse_a_fresh_start as refuse_fresh
from llmtailor.store.run import Run
from llmtailor.store.tiers import Tiers
from llmtailor.tailor import Tailor


class Recorded:
    """A stateful object for state its framework restores itself: ``state_dict`` records it at
    each save (``capture()``); ``load_state_dict`` leaves it to the framework, which was handed
    it (read from the snapshot with ``providers.stateful.saved_state``) before the Tailor
    restores."""

    def __init__(self, capture: Callable[[], Any]):
        self._capture = capture

    def state_dict(self) -> Any:
        return self._capture()

    def load_state_dict(self, state: Any) -> None:
        """Restored by the framework already (class docstring)."""


def restore_composite(own: Tailor, run: Run, step: int | None, live: tuple[Any, Any, Any]) -> RestoreReport:
    """Restore the composite of ``step`` (None: the newest) of ``run`` into ``live`` (the model,
    optimizer and LR scheduler ``own`` was built on) and ``own``'s stateful objects.

    ``run`` is ``own``'s run directory or one of its tiers (by the storage's identity): restored
    by ``own``, whose next saves extend that composite's lineage (the newest of any tier when
    ``step`` is None). Another run: read from there by a read-only ``Tailor`` on the same objects
    (no writer lock: another trainer may be writing it); ``own``'s run is untouched and its own
    snapshots start a lineage of their own (the first save writes every unit)."""
    if own.tiers.index_of(run) is not None:
        return own.restore(step)
    with Tailor(run.root, *live, stateful=own.stateful.objects, family=own.config.family,
                timeout=own.config.timeout, read_only=True) as source:
        return source.restore(step)


def announce(report: RestoreReport, run: Run) -> None:
    """Print, for the log, which composite a resume loaded and where each unit came from."""
    print(f"llmtailor: resumed from the composite of step {report.step} in {run.root} "
          f"({describe_sources(report.sources)})", flush=True)


def refuse_a_fresh_start(tiers: Tiers, run_dir: Any, resume: str, instead: str) -> None:
    """Refuse training that restored nothing from ``tiers`` once they hold a composite, before
    its first save (``store.lineage.refuse_a_fresh_start``, the rule a ``Tailor`` applies at its
    own first save). ``resume``: how the framework resumes from it; ``instead``: how to train
    from scratch."""
    refuse_fresh(run_dir, tiers.latest_step(), resume, instead)
