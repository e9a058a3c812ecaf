"""A run, read: at a local path or an object-store URL, every byte through its ``Storage``
(``store.storage``). ``Run`` is its catalog (``catalog.py``: committed snapshots, manifests,
``latest``, lineages, composites, read leases) with the read path of its units' tensors
(``units.py``) and its verification (``verify.py``), each in its own module; the methods
here hand over to them. This module only reads; ``writer.py`` writes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.store.catalog import Catalog, Composite
from llmtailor.store.manifest import FileEntry, UnitEntry
from llmtailor.store.storage import Storage
from llmtailor.store.units import UnitReader
from llmtailor.store.verify import RunCheck, Verification

if TYPE_CHECKING:
    import torch


class Run(Catalog):
    """Read access to a run (module docstring), at a local path or an object-store URL
    (``storage_options``: the store's options, ``store.storage.open_storage``). Manifests and
    unit indexes are cached; tensor bytes are read per unit."""

    def __init__(self, root: str | Path | Storage, storage_options: dict[str, Any] | None = None):
        super().__init__(root, storage_options)
        self.units = UnitReader(self)
        """The read path of the run's units (``units.py``)."""

    def forget(self, steps: list[int]) -> None:
        """Drop cached manifests and unit indexes of snapshots that were removed."""
        super().forget(steps)
        self.units.forget(steps)

    # -- the units' read path (units.py) --------------------------------------------------------

    def unit_entry(self, step: int, unit: str) -> UnitEntry:
        """The index of ``unit`` as saved at ``step``, what it keeps merged in (``UnitReader.entry``)."""
        return self.units.entry(step, unit)

    def _stored_entry(self, step: int, unit: str) -> UnitEntry:
        """The index file of ``unit`` at ``step`` as written (``UnitReader.stored_entry``)."""
        return self.units.stored_entry(step, unit)

    def stored_files(self, step: int) -> list[FileEntry]:
        """Every file the snapshot of ``step`` holds itself but its manifest (``UnitReader.stored_files``)."""
        return self.units.stored_files(step)

    def base_ref(self, step: int, unit: str, key: str) -> dict[str, Any]:
        """Where ``unit`` at ``step`` keeps tensor ``key`` from the base directory (``UnitReader.base_ref``)."""
        return self.units.base_ref(step, unit, key)

    def check_base(self, composite: Composite) -> None:
        """The base model directory the composite keeps tensors from is whole (``UnitReader.check_base``)."""
        self.units.check_base(composite)

    def file_location(self, step: int, file: FileEntry) -> tuple[Storage, str]:
        """The storage and key of a file of a unit's merged view (``UnitReader.file_location``)."""
        return self.units.file_location(step, file)

    def read_unit(self, step: int, unit: str, skip: set[str] = frozenset(),
                  into: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Tensors and optimizer values of ``unit`` as saved at ``step``, checked (``UnitReader.read``;
        ``into``: live tensors read straight into where their memory takes it)."""
        return self.units.read(step, unit, skip, into)

    def reading_together(self, reads: list[tuple[int, str, Collection[str]]],
                         into: Mapping[tuple[int, str], dict[str, torch.Tensor]] | None = None) -> AbstractContextManager[None]:
        """Within it, the units ``reads`` names (``(step, unit, keys skipped)``: those this process
        reads next) are read from a pack file they share together (``UnitReader.reading_together``;
        ``into``: by ``(step, unit)``, live tensors its bytes land in, as ``read_unit``'s)."""
        return self.units.reading_together(reads, into)

    def read_global(self, step: int) -> dict[str, Any]:
        """The global state saved at ``step`` (``UnitReader.read_global``)."""
        return self.units.read_global(step)

    def stage_states(self, step: int,
                     shared: dict[str, Any] | None = None) -> list[tuple[list[str], dict[str, Any]]] | None:
        """Each pipeline stage's global state saved at ``step`` (``UnitReader.stage_states``)."""
        return self.units.stage_states(step, shared)

    def whole_global(self, step: int) -> dict[str, Any]:
        """The global state of ``step`` for the whole model, stages merged (``UnitReader.whole_global``)."""
        return self.units.whole_global(step)

    def read_rank_state(self, step: int, rank: int, shared: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Rank ``rank``'s own state saved at ``step``, or None (``UnitReader.read_rank_state``;
        ``shared``: the global state of ``step``, already decoded)."""
        return self.units.read_rank_state(step, rank, shared)

    # -- verification (verify.py) ------------------------------------------------------------

    def verify(self, step: int | None = None) -> list[str]:
        """The problems ``check`` finds; an empty list means all is well."""
        return self.check(step).problems

    def check(self, step: int | None = None) -> Verification:
        """Verify the run, or the composite as of ``step`` (``RunCheck.check`` states the rule)."""
        return RunCheck(self, self.units).check(step)
