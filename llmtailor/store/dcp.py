"""A torch.distributed.checkpoint (DCP) storage reader over llmtailor snapshots.

DCP's load planner does the resharding: given the tensors a rank holds (DTensor shards at any
world size, or whole tensors) and the chunks a snapshot stored, it works out which box of
which stored chunk lands where. ``SnapshotReader`` answers its two questions from our own
files, so DCP's pickled ``.metadata`` is never involved and nothing is unpickled:

- ``read_metadata``: the chunks of every requested tensor key, built from the manifests
  (JSON) of the snapshots the composite names;
- ``read_data``: each planned box, read by byte range from the safetensors file that holds
  the chunk (``ChunkReader``), copied into the destination shard in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import (
    ChunkStorageMetadata,
    DefaultLoadPlanner,
    LoadPlan,
    LoadPlanner,
    Metadata,
    StorageReader,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import ReadItem
from torch.futures import Future

from llmtailor.store.manifest import Chunk, TensorEntry, UnitEntry
from llmtailor.store.reader import ChunkReader, Span


class SnapshotReader(StorageReader):
    """DCP reads of the tensors of one unit index saved at ``step``; ``targets`` names the
    tensor keys being loaded."""

    def __init__(self, reader: ChunkReader, step: int, unit: UnitEntry, keys: set[str]):
        super().__init__()
        self.reader, self.step, self.unit = reader, step, unit
        self.entries = {t.key: t for t in unit.tensors if t.key in keys}
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[TensorEntry, Chunk]] = {
            (key, tuple(chunk.offsets)): (entry, chunk) for key, entry in self.entries.items() for chunk in entry.chunks
        }

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return Metadata(
            state_dict_metadata={
                key: TensorStorageMetadata(
                    properties=TensorProperties(dtype=entry.torch_dtype),
                    size=torch.Size(entry.shape),
                    chunks=[ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.shape)) for c in entry.chunks],
                )
                for key, entry in self.entries.items()
            }
        )

    def spans(self, items: list[ReadItem]) -> list[Span]:
        """The byte ranges the boxes of ``items`` (of a load plan of this reader's tensors, made
        as ``dcp.load`` makes it: ``PlannedLoad``) read, one per box; nothing is read but the
        headers of the files (``ChunkReader.span``)."""
        found = []
        for item in items:
            tensor, chunk = self._chunks[(item.storage_index.fqn, tuple(item.storage_index.offset))]
            span = self.reader.span(self.step, self.unit, tensor, chunk, tuple(item.storage_offsets), tuple(item.lengths))
            if span is not None:
                found.append(span)
        return found

    def landings(self, items: list[ReadItem], planner: LoadPlanner) -> list[tuple[Span, tuple[int, int], torch.Tensor]]:
        """``(span, box, memory)`` for each box of ``items`` whose bytes may be fetched straight
        into its target (``ChunkReader.landing``): ``box`` the ``(start, length)`` of the file
        that are its elements, ``memory`` the target's, as contiguous uint8 on the CPU, where the
        target is that (a non-contiguous shard, one on a GPU: none)."""
        found = []
        for item in items:
            tensor, chunk = self._chunks[(item.storage_index.fqn, tuple(item.storage_index.offset))]
            landing = self.reader.landing(self.step, self.unit, tensor, chunk, tuple(item.storage_offsets), tuple(item.lengths))
            if landing is None:
                continue
            target = planner.resolve_tensor(item).detach()
            span, box = landing
            if (target.device.type == "cpu" and target.is_contiguous() and target.dtype == tensor.torch_dtype
                    and target.numel() * target.element_size() == box[1]):
                found.append((span, box, target.reshape(-1).view(torch.uint8)))
        return found

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            tensor, chunk = self._chunks[(item.storage_index.fqn, tuple(item.storage_index.offset))]
            data = self.reader.read_box(self.step, self.unit, tensor, chunk, tuple(item.storage_offsets), tuple(item.lengths))
            target = planner.resolve_tensor(item).detach()
            if not _same_memory(data, target):  # a box received straight into its target: there already
                target.copy_(data)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class PlannedLoad:
    """One DCP load plan for the tensors of several units of a rank (``units``: unit -> its
    ``SnapshotReader`` and targets), made once by DCP's default planner as ``dcp.load`` makes
    it, then read unit by unit: ``spans(unit)`` says which byte ranges a unit's boxes read
    (nothing is read), ``load(unit)`` copies them into the targets in place. Where a unit's
    ranges are fetched before it is loaded (``store.shared_ranges``), the plan is made once,
    not once for the ranges and again for the load of each unit.

    Invariant: the targets' tensor keys are unique across the units (a unit's keys are its
    own tensors')."""

    def __init__(self, units: dict[str, tuple[SnapshotReader, dict[str, torch.Tensor]]]):
        self.readers = {unit: reader for unit, (reader, _) in units.items()}
        metadata = {key: entry for reader, _ in units.values() for key, entry in reader.read_metadata().state_dict_metadata.items()}
        self.planner = DefaultLoadPlanner()
        self.planner.set_up_planner({key: t for _, targets in units.values() for key, t in targets.items()},
                                    Metadata(state_dict_metadata=metadata), True)
        plan = self.planner.finish_plan(self.planner.create_global_plan([self.planner.create_local_plan()])[0])
        owner = {key: unit for unit, (_, targets) in units.items() for key in targets}
        self.items: dict[str, list[ReadItem]] = {unit: [] for unit in units}
        for item in plan.items:
            self.items[owner[item.dest_index.fqn]].append(item)

    def spans(self, unit: str) -> list[Span]:
        """The byte ranges the boxes of ``unit`` read (``SnapshotReader.spans``)."""
        return self.readers[unit].spans(self.items[unit])

    def landings(self, unit: str) -> list[tuple[Span, tuple[int, int], torch.Tensor]]:
        """Where the boxes of ``unit`` may be fetched straight into their targets (``SnapshotReader.landings``)."""
        return self.readers[unit].landings(self.items[unit], self.planner)

    def load(self, unit: str) -> None:
        """Each box of ``unit``'s plan read (``SnapshotReader.read_data``: checked as there) into its target."""
        self.readers[unit].read_data(LoadPlan(self.items[unit]), self.planner).wait()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (same place, dtype, shape and strides)."""
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())
