"""``FSDPProvider``: a model sharded with FSDP2 (``fully_shard``), or any model whose
parameters are DTensors, and its optimizer.

Save: each rank writes only its local shards of the chosen units — weights and every
optimizer state tensor that is a DTensor — with each shard's offsets in the global tensor as
DCP's own save planner computes them (no gather, no full tensor on any rank). A shard
replicated over a mesh dimension (HSDP) is written by the rank at coordinate 0 of that
dimension only. Plain tensors (the per-parameter ``step`` scalars, unsharded buffers) are the
same on every rank and are written once, by the unit's owner (``StateProvider.owner``: units
balanced over the ranks by bytes; over the ranks of its stage where ranks hold different layers,
pipeline stages each sharded over its own data ranks).

Restore: torch.distributed.checkpoint's load planner reshards — each rank reads, by byte
range, the boxes of the stored chunks that overlap its shards (``store.dcp.SnapshotReader``),
unit by unit, at any world size. Optimizer state is loaded by name through
``Optimizer.load_state_dict`` as in one process.

Names are the model's own canonical FQNs (FSDP2 does not rename parameters), so snapshots are
interchangeable with single-process and DDP ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.tensor import DTensor

from llmtailor.constants import KIND_MASTER, KIND_OPTIM, KIND_WEIGHT
from llmtailor.providers.base import StateProvider
from llmtailor.providers.local import LocalProvider
from llmtailor.store import codec
from llmtailor.store.keys import split_key, weight_key
from llmtailor.store.manifest import TensorEntry
from llmtailor.store.reader import ChunkReader
from llmtailor.store.dcp import SnapshotReader
from llmtailor.store.run import Run
from llmtailor.store.staged import Piece


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2, tensor parallel)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


class FSDPProvider(LocalProvider):
    """DTensor-sharded model and optimizer of one rank (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.kind = "fsdp2"

    def writes(self, units: list[str]) -> list[str]:
        return StateProvider.writes(self, units)  # every rank holds a shard of every unit of its stage

    def _memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def _tensor_pieces(self, unit: str, key: str, tensor: torch.Tensor) -> list[Piece]:
        if not isinstance(tensor, DTensor):
            return [Piece.whole(key, tensor)] if self.owner(unit) == self.coordinator.rank else []
        if not _writes_replica(tensor):
            return []
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        planner.set_up_planner({key: tensor}, None, True)
        pieces = []
        for item in planner.create_local_plan().items:
            chunk = item.tensor_data.chunk
            pieces.append(
                Piece(key, planner.resolve_data(item), tuple(chunk.offsets), tuple(item.tensor_data.size))
            )
        return pieces

    def load_units(
        self, run: Run, sources: dict[str, int], live: dict[str, torch.Tensor], verify: bool
    ) -> dict[str, dict[str, Any]]:
        """Per unit, one DCP load into this rank's shards: weights in place; optimizer state
        into the live state tensors where they exist, else into new ones sharded like their
        parameter. Returns the optimizer state by parameter name."""
        reader = ChunkReader(run, verify)
        optimizer_state: dict[str, dict[str, Any]] = {}
        try:
            for unit, step in sources.items():
                entry = run.unit_entry(step, unit)
                keys = {t.key for t in entry.tensors}
                targets: dict[str, torch.Tensor] = {}
                for tensor in entry.tensors:
                    kind, name, state_key = split_key(tensor.key)
                    if kind == KIND_WEIGHT or (kind == KIND_MASTER and weight_key(name) not in keys):
                        targets[tensor.key] = live[name].detach()
                    elif kind == KIND_OPTIM and self.optimizer is not None:
                        target = self._state_target(live[name], state_key, tensor)
                        targets[tensor.key] = target
                        optimizer_state.setdefault(name, {})[state_key] = target
                storage = SnapshotReader(reader, step, entry, set(targets))
                dcp.load(targets, storage_reader=storage, planner=DefaultLoadPlanner(), no_dist=True)
                for name, plain in entry.values.items():
                    for key, encoded in plain.items():
                        optimizer_state.setdefault(name, {})[key] = codec.decode(encoded, {}, f"{unit}.{name}.{key}")
        finally:
            reader.close()
        return optimizer_state

    def _state_target(self, param: torch.Tensor, state_key: str, saved: TensorEntry) -> torch.Tensor:
        """Where a saved optimizer state tensor is loaded: the live one if it has the saved
        global shape and dtype; else a new tensor, sharded like the parameter when it has the
        parameter's shape (moments), whole otherwise (``step`` scalars)."""
        current = self.chain.param_state(param).get(state_key) if self.chain is not None else None
        if isinstance(current, torch.Tensor) and list(current.shape) == saved.shape and current.dtype == saved.torch_dtype:
            return current.detach()
        if isinstance(param, DTensor) and list(param.shape) == saved.shape:
            return torch.empty_like(param.detach(), dtype=saved.torch_dtype)
        return torch.empty(saved.shape, dtype=saved.torch_dtype)


def _writes_replica(tensor: DTensor) -> bool:
    """Whether this rank writes its shard of ``tensor``: the rank at coordinate 0 of every
    mesh dimension over which the shard is replicated."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, tensor.placements) if p.is_replicate())
