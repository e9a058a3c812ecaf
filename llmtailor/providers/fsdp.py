"""``FSDPProvider``: a model sharded with FSDP2 (``fully_shard``), or any model whose
parameters are DTensors, and its optimizer.

Save: each rank writes only its local shards of the chosen units — weights and every optimizer
state tensor that is a DTensor — with each shard's offsets in the global tensor as DCP's own
save planner computes them (no gather, no full tensor on any rank). Each shard is written once,
whatever mix of meshes the parameters live on, by one of the ranks holding a copy of it
(``shard_copy``): copies lie along the dimensions of the tensor's own mesh it is replicated
over (HSDP) and along the dimensions of the global mesh that mesh was cut from which it does
not span (a tensor on the ``dp`` sub-mesh of a ``dp`` x ``tp`` job has a copy on each ``tp``
rank); which copy writes is balanced by unit bytes (``copy_writer``). Plain tensors (the
per-parameter ``step`` scalars, unsharded buffers) are the same on every rank and are written
once, by the unit's owner (``StateProvider.owner``: units balanced over the ranks by bytes).
Where ranks hold different layers (pipeline stages each sharded over their own data ranks) the plain
tensors' owner is chosen over the ranks of the unit's stage.

Restore: torch.distributed.checkpoint's load planner reshards — each rank reads, by byte
range, the boxes of the stored chunks that overlap its shards (``store.dcp.SnapshotReader``),
unit by unit, at any world size. Under HSDP, the ranks holding the same shards (the replica
group) read each unit once between them and broadcast it (``distributed.read_plan``). From a
remote run (an object store) the byte ranges every rank's boxes need are fetched once in the
job, in large requests, and sent to the ranks needing them (``store.shared_ranges``): not a
request per box per rank. Optimizer state is loaded by name through
``Optimizer.load_state_dict`` as in one process.

Names are the model's own canonical FQNs (FSDP2 does not rename parameters), so snapshots are
interchangeable with single-process and DDP ones.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from llmtailor.constants import KIND_MASTER, KIND_OPTIM, KIND_WEIGHT
from llmtailor.distributed.progress import carried
from llmtailor.distributed.read_plan import ReadPlan, balance, nbytes
from llmtailor.providers.base import StateProvider
from llmtailor.providers.local import LocalProvider
from llmtailor.store import codec
from llmtailor.store.keys import split_key, weight_key
from llmtailor.store.manifest import TensorEntry, UnitEntry
from llmtailor.store.reader import ChunkReader
from llmtailor.store.dcp import PlannedLoad, SnapshotReader
from llmtailor.store.run import Run
from llmtailor.store.shared_ranges import read_once, share_headers
from llmtailor.store.staged import Piece


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2, tensor parallel)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


class FSDPProvider(LocalProvider):
    """DTensor-sharded model and optimizer of one rank (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.kind = "fsdp2"
        self._copy_writers: dict[int, dict[str, int]] = {}

    def writes(self, units: list[str]) -> list[str]:
        return StateProvider.writes(self, units)  # every rank holds a shard of every unit of its stage

    def _memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def _tensor_pieces(self, unit: str, key: str, tensor: torch.Tensor) -> list[Piece]:
        if not isinstance(tensor, DTensor):
            return [Piece.whole(key, tensor)] if self.owner(unit) == self.coordinator.rank else []
        copy = shard_copy(tensor, self.stages.ranks_of(self.coordinator.rank))
        if copy is None or copy[0] != self.copy_writer(unit, copy[1]):
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

    def copy_writer(self, unit: str, copies: int) -> int:
        """Which of ``copies`` copies of a shard of ``unit`` writes it (``shard_copy`` numbers
        them): the units balanced over the copies by bytes (``balance``), as ``owner`` balances
        them over the ranks, so that ranks holding copies share the writing."""
        if copies == 1:
            return 0
        if copies not in self._copy_writers:
            self._copy_writers[copies] = balance(self.unit_sizes(), copies)
        return self._copy_writers[copies][unit]

    def load_units(
        self, run: Run, sources: dict[str, int], live: dict[str, torch.Tensor], verify: bool
    ) -> dict[str, dict[str, Any]]:
        """Per unit, one DCP load into this rank's shards: weights in place; optimizer state
        into the live state tensors where they exist, else into new ones sharded like their
        parameter. Returns the optimizer state by parameter name. Under HSDP the replicas of a
        shard need the same bytes: each unit is loaded by one rank of the replica group and
        sent to the others (``_load_once``). The plain tensors every rank holds whole (``step``
        scalars), written by one rank, are read by one rank and sent to the others
        (``_load_plain_once``), except from a remote run of FSDP2 shards (no replicas), whose
        byte ranges, theirs with the rest, are fetched once in the job (``_load_ranges_once``):
        read apart, their bytes would also come again with the ranges joined around them."""
        optimizer_state: dict[str, dict[str, Any]] = {}
        targets = {unit: self._targets(run.unit_entry(step, unit), live, optimizer_state) for unit, step in sources.items()}
        replicas = _replica_group(targets)  # from the DTensors alone: the same before and after the plain are taken out
        ranges_once = replicas is None and self.coordinator.world_size > 1 and run.storage.remote
        plain = {} if ranges_once else self._plain_targets(targets)
        reader = ChunkReader(run, verify)

        def load(unit: str, wanted: dict[str, torch.Tensor] | None = None) -> None:
            wanted = targets[unit] if wanted is None else wanted
            if wanted:
                storage = SnapshotReader(reader, sources[unit], run.unit_entry(sources[unit], unit), set(wanted))
                dcp.load(wanted, storage_reader=storage, planner=DefaultLoadPlanner(), no_dist=True)

        try:
            if plain:  # first: a rank's own reads fail on that rank alone, leaving the others in no collective
                self._load_plain_once(run, sources, plain, load)
            if replicas is not None:
                self._load_once(sources, targets, load, *replicas)
            elif ranges_once:
                self._load_ranges_once(run, sources, targets, reader)
            else:
                for unit in sources:
                    load(unit)
        finally:
            reader.close()
        for unit, step in sources.items():
            for name, plain_values in run.unit_entry(step, unit).values.items():
                for key, encoded in plain_values.items():
                    optimizer_state.setdefault(name, {})[key] = codec.decode(encoded, {}, f"{unit}.{name}.{key}")
        return optimizer_state

    def _plain_targets(self, targets: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """The targets that are plain tensors (not DTensors), by unit, taken out of ``targets``,
        where one rank reads them for the others: in a job of several ranks not cut into
        pipeline stages (a stage's ranks have no process group of their own here; each reads
        its own then). Every rank takes out the same keys: whether a target is a DTensor follows
        from the model's layout alone."""
        if self.coordinator.world_size == 1 or self.stages.pipelined:
            return {}
        plain = {unit: {key: t for key, t in wanted.items() if not isinstance(t, DTensor)} for unit, wanted in targets.items()}
        for unit, keys in plain.items():
            for key in keys:
                del targets[unit][key]
        return {unit: keys for unit, keys in plain.items() if keys}

    def _targets(self, entry: UnitEntry, live: dict[str, torch.Tensor],
                 optimizer_state: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Tensor key -> where a unit's saved tensor is loaded on this rank (its optimizer state
        targets recorded in ``optimizer_state`` by parameter name)."""
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
        return targets

    def _load_once(self, sources: dict[str, int], targets: dict[str, dict[str, torch.Tensor]],
                   load: Callable[[str], None], ranks: list[int], group: Any) -> None:
        """Each unit loaded by one rank of this rank's replica group (``ranks``, balanced by
        bytes) and its shards broadcast to the others, which hold the same shards
        (``distributed.read_plan``). The ranks first exchange their groups (a rank that failed
        before loading then leaves none of the others in a collective)."""
        self.coordinator.exchange(f"{self.coordinator.round}/replicas", ranks)
        local = {unit: [self._memory(t) for t in targets[unit].values()] for unit in sources}
        specs = {unit: [(t.dtype, list(t.shape)) for t in local[unit]] for unit in sources}
        units = {f"unit {unit!r} of step {step}": unit for unit, step in sources.items()}
        plan = ReadPlan(self.coordinator, {item: nbytes(specs[unit]) for item, unit in units.items()}, ranks, group)

        def read(item: str) -> list[torch.Tensor]:
            load(units[item])
            return local[units[item]]

        for item, tensors in plan.fetch(read, lambda item: specs[units[item]], into=lambda item: local[units[item]]):
            for target, value in zip(local[units[item]], tensors):
                if value is not target:
                    target.copy_(value)

    def _load_plain_once(self, run: Run, sources: dict[str, int], plain: dict[str, dict[str, torch.Tensor]],
                         load: Callable[[str, dict[str, torch.Tensor]], None]) -> None:
        """Each unit's plain tensors (``_plain_targets``) read by one rank, balanced by bytes, and
        broadcast to every other (``distributed.read_plan``): they are the same on every rank
        but lie in one rank's file (the unit's owner wrote them, ``StateProvider.owner``), which
        in a node-local tier with fewer replicas than nodes only some nodes hold: the reader is
        a rank whose node's copy holds that file (``node_parts.reading_ranks``). The ranks first
        exchange a word, so that a rank that failed before leaves none of the others in a
        collective (as ``_load_once``)."""
        self.coordinator.exchange(f"{self.coordinator.round}/plain", len(plain))
        units = {f"the plain tensors of unit {unit!r} of step {sources[unit]}": unit for unit in plain}
        specs = {unit: [(t.dtype, list(t.shape)) for t in plain[unit].values()] for unit in plain}
        plan = ReadPlan(self.coordinator, {item: nbytes(specs[unit]) for item, unit in units.items()},
                        candidates=self._readable(run, sources, {u: run.unit_entry(sources[u], u) for u in plain}, units, plain))

        def read(item: str) -> list[torch.Tensor]:
            load(units[item], plain[units[item]])
            return list(plain[units[item]].values())

        for item, tensors in plan.fetch(read, lambda item: specs[units[item]], into=lambda item: list(plain[units[item]].values())):
            for target, value in zip(plain[units[item]].values(), tensors):
                if value is not target:
                    target.copy_(value)

    def _load_ranges_once(self, run: Run, sources: dict[str, int], targets: dict[str, dict[str, torch.Tensor]],
                          reader: ChunkReader) -> None:
        """Each unit's boxes read into this rank's shards, their byte ranges in the run's files
        (those every rank's boxes read) fetched once in the job in large requests and sent to
        the ranks that need them (``store.shared_ranges``): from a remote run, a request per box
        per rank costs a round trip each. The files' headers, which the ranges follow from, are
        read once in the job too, while the load plan is made. One load plan for all this rank's
        units (``PlannedLoad``) says the ranges and then loads each unit as its bytes come in.
        The checks are the reader's own, on the bytes received (``ChunkReader.received``)."""
        files, chunks = {}, {}  # chunks: (key, chunk name) -> bytes, each chunk once (the data a file is known to hold)
        for unit, step in sources.items():
            entry = run.unit_entry(step, unit)
            for tensor in entry.tensors:
                for chunk in tensor.chunks:
                    storage, key = run.file_location(step, entry.chunk_file(chunk))
                    if storage.same_place(run.storage):
                        files[key] = entry.chunk_file(chunk)
                        chunks[(key, tensor.chunk_key(chunk))] = math.prod(chunk.shape) * tensor.torch_dtype.itemsize
        known = {}
        for (key, _), size in chunks.items():
            known[key] = known.get(key, 0) + size
        # The load plan (from the index alone) is made while the headers are read and exchanged.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtailor-headers") as pool:
            headers = pool.submit(carried(share_headers), self.coordinator, run.storage, files, f"{self.coordinator.round}/headers", known)
            planned = PlannedLoad({unit: (SnapshotReader(reader, step, run.unit_entry(step, unit), set(targets[unit])),
                                          targets[unit]) for unit, step in sources.items() if targets[unit]})
            reader.take_headers(run.storage, headers.result())
        needs = {unit: [(key, start, length) for where, key, start, length in planned.spans(unit) if where.same_place(run.storage)]
                 for unit in planned.items}
        # Boxes whose bytes go straight into their live shards (no buffer, no copy after): where
        # a span is one box's alone (two boxes reading the same span are put in place from it).
        spans = Counter(r for ranges in needs.values() for r in ranges)
        landing = {(key, start, length): (box, memory) for unit in planned.items
                   for (where, key, start, length), box, memory in planned.landings(unit)
                   if where.same_place(run.storage) and spans[(key, start, length)] == 1}

        def load_received(unit: str, received: dict[tuple[str, int, int], bytearray]) -> None:
            reader.received = {(run.storage.identity(), *r): data for r, data in received.items()}
            try:
                planned.load(unit)
            finally:
                reader.received = {}

        read_once(self.coordinator, run.storage, needs, load_received, f"{self.coordinator.round}/ranges", landing=landing)

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


def _replica_group(targets: dict[str, dict[str, torch.Tensor]]) -> tuple[list[int], Any] | None:
    """The global ranks that hold the same shards as this one (HSDP's replicas: the one mesh
    dimension the DTensors are replicated over) and their process group; None where no other
    rank does (FSDP2's shards, one process) or the targets are not all alike (each rank then
    reads its own). The same answer on every rank: it follows from the model's layout alone."""
    meshes = {(t.device_mesh, tuple(d for d, p in enumerate(t.placements) if p.is_replicate()))
              for unit in targets.values() for t in unit.values() if isinstance(t, DTensor)}
    if len(meshes) != 1:
        return None
    ((mesh, dims),) = meshes
    if len(dims) != 1 or mesh.size(dims[0]) == 1:
        return None
    group = mesh.get_group(dims[0])
    return dist.get_process_group_ranks(group), group


def shard_copy(tensor: DTensor, stage: tuple[int, ...] | None = None) -> tuple[int, int] | None:
    """``(index, count)``: how many ranks of the job hold this rank's shard of ``tensor`` and
    which of them this rank is (the same numbering on every rank holding the shard); None if
    this rank holds none. The copies lie along the dimensions of the tensor's mesh it is
    replicated over and the dimensions of the global mesh that mesh was cut from which it does
    not span (the ranks there hold their own copy of the tensor's mesh), among the ranks of
    ``stage`` (the ranks holding the tensor's unit, where pipeline stages hold different layers:
    a ``pp`` x ``dp`` mesh's other stages hold no copy; None: every rank)."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    index, count = _copy_across_global_mesh(tensor.device_mesh, stage)
    for c, size, placement in zip(coordinate, tensor.device_mesh.mesh.shape, tensor.placements):
        if placement.is_replicate():
            index, count = index * size + c, count * size
    return index, count


@functools.lru_cache(maxsize=64)
def _copy_across_global_mesh(mesh: DeviceMesh, stage: tuple[int, ...] | None) -> tuple[int, int]:
    """``(index, count)`` of this rank's group of ``mesh`` among the copies of that group in the
    global mesh it was cut from (``init_device_mesh(...)["dp"]``): the ranks at this rank's
    coordinates on the global dimensions the group varies over, whatever their coordinates on
    the others, kept to those in ``stage`` (None: all), numbered in the global mesh's order.
    ``(0, 1)`` for a mesh cut from nothing (one spanning the job; or one made apart, whose
    copies cannot be known here: two ranks writing the same chunk then fail the save in one line
    naming them, see ``store.writer``)."""
    root = mesh._get_root_mesh()  # torch's only link from a sub-mesh to the mesh it was cut from
    if root.mesh.numel() == mesh.mesh.numel():
        return 0, 1
    group = torch.stack([(root.mesh == r).nonzero()[0] for r in mesh.mesh.flatten().tolist()])
    spanned = group.amax(0) != group.amin(0)
    mine = (root.mesh == dist.get_rank()).nonzero()[0]
    flat = root.mesh.flatten().tolist()
    coordinates = torch.cartesian_prod(*(torch.arange(n) for n in root.mesh.shape)).reshape(len(flat), root.mesh.ndim)
    copies = [rank for rank, at in zip(flat, coordinates)
              if bool((at[spanned] == mine[spanned]).all()) and (stage is None or rank in stage)]
    return copies.index(dist.get_rank()), len(copies)
