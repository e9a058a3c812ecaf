"""A run of one snapshot, written from what another format holds (an import, a merge).

``write_single_snapshot`` takes the writer lock of a new or empty run directory, encodes the
global state (refusing state that would need pickle before anything is written), and persists
the units as one committed Full snapshot with the store's own commit protocol, so ``inspect``,
``verify``, ``assemble`` and restores treat it like any snapshot a ``Tailor`` saved. The units
come as an iterable read just before each is written: one unit in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError
from llmtailor.store import codec
from llmtailor.store.lock import WriterLock
from llmtailor.store.run import Run
from llmtailor.store.storage import Storage
from llmtailor.store.staged import PersistResult, StagedSnapshot, StagedUnit
from llmtailor.store import Progress
from llmtailor.store.writer import counting, persist


def write_single_snapshot(
    run_dir: str | Path | Storage,
    *,
    step: int,
    layout: dict[str, Any],
    units: Iterable[StagedUnit],
    state: dict[str, Any],
    origin: str,
    provider: str = "local",
    notes: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> PersistResult:
    """Write ``units`` (every unit of ``layout``) and the global ``state`` as the one committed
    snapshot of step ``step`` of a new run at ``run_dir``; ``origin`` says where it came from
    (recorded as the manifest's policy: ``imported from ...``, ``merge of ...``)."""
    run = Run(run_dir)
    if run.steps():
        raise ConfigError(f"{run.root} already holds snapshots (steps {run.steps()}); write into a new or empty run directory")
    global_doc, global_tensors = codec.encode(state, where="global state")
    unit_names = list(layout["units"])  # a layout record: unit -> its tensor names, in order
    staged = StagedSnapshot(
        step=step, parent=None, save_index=0, policy=origin, layout=layout, units=units,
        composite={unit: step for unit in unit_names}, global_doc=global_doc, global_tensors=global_tensors,
        provider=provider, notes=dict(notes or {}),
    )
    lock = WriterLock(run.storage)
    lock.acquire()
    try:
        if run.steps():  # written meanwhile, before the lock was held
            raise ConfigError(f"{run.root} already holds snapshots (steps {run.steps()}); write into a new one")
        return persist(run, staged, on_unit=counting(progress, len(unit_names)))
    finally:
        lock.release()
