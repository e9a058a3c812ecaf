"""A run of one snapshot, written from what another format holds (an import, a merge).

``RunSink`` takes the writer lock of a new or empty run directory, encodes the global state
(refusing state that would need pickle before anything is written), and persists the units as
one committed Full snapshot with the store's own commit protocol, so ``inspect``, ``verify``,
``assemble`` and restores treat it like any snapshot a ``Tailor`` saved. The units come as an
iterable read just before each is written: one unit in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError
from llmtailor.outputs.sink import OutputUnit, Sink
from llmtailor.store import Progress, codec
from llmtailor.store.lock import WriterLock
from llmtailor.store.run import Run
from llmtailor.store.storage import Storage
from llmtailor.store.writer import counting, persist


def refuse_holding_snapshots(run: Run) -> None:
    """The one check that an output run is new or empty: ConfigError naming its steps."""
    steps = run.steps()
    if steps:
        raise ConfigError(f"{run.root} already holds snapshots (steps {steps}); write into a new or empty run directory")


class RunSink(Sink):
    """Write the units (every unit of ``layout``) and the global ``state`` as the one committed
    snapshot of step ``step`` of a new run at ``out``; ``origin`` says where it came from
    (recorded as the manifest's policy: ``imported from ...``, ``merge of ...``).
    ``rank_states``: the own states (``{"rng", "extra"}``) of ranks 1, 2, ... of a checkpoint
    written by several processes (rank 0's are ``state``'s): the snapshot is then one of that
    world size, each rank's state where a save of as many ranks puts it, so a restore at that
    world size sets each rank's own RNG streams."""

    def __init__(self, out: str | Path | Storage, *, step: int, layout: dict[str, Any], state: dict[str, Any], origin: str,
                 provider: str = "local", notes: dict[str, Any] | None = None,
                 rank_states: list[dict[str, Any]] = ()):
        self.run = Run(out)
        self.step, self.layout, self.state, self.origin = step, layout, state, origin
        self.provider, self.notes = provider, dict(notes or {})
        self.rank_states = list(rank_states)

    def write(self, units: Iterable[OutputUnit], count: int | None = None, progress: Progress | None = None) -> Path | str:
        """Commit the snapshot; return its path (its URL on an object store). ``progress``
        follows each unit as it is written."""
        from llmtailor.store.staged import StagedSnapshot, StagedUnit  # imports torch, as writing a run does

        run = self.run
        refuse_holding_snapshots(run)
        global_doc, global_tensors = codec.encode(self.state, where="global state")
        ranks = {rank: codec.encode(own, where=f"global state of rank {rank}") for rank, own in enumerate(self.rank_states, 1)}
        unit_names = list(self.layout["units"])  # a layout record: unit -> its tensor names, in order
        staged = StagedSnapshot(
            step=self.step, parent=None, save_index=0, policy=self.origin, layout=self.layout,
            units=(StagedUnit.whole(u.name, u.tensors, u.values) for u in units),
            composite={unit: self.step for unit in unit_names}, global_doc=global_doc, global_tensors=global_tensors,
            provider=self.provider, notes=self.notes, world_size=1 + len(ranks), rank_states=ranks,
        )
        lock = WriterLock(run.storage)
        lock.acquire()
        try:
            refuse_holding_snapshots(run)  # written meanwhile, before the lock was held
            return persist(run, staged, on_unit=counting(progress, len(unit_names))).path
        finally:
            lock.release()
