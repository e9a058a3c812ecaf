"""``LocalProvider``: a model, optimizer and LR scheduler held whole by each process.

One process, or DDP (every rank holds the same replicated state). A single process writes
every chosen unit. Under DDP the chosen units are spread over the ranks so that each writes a
disjoint, byte-balanced subset (the same deterministic assignment on every rank, so no
message is needed): a snapshot's bytes equal a single-process one's, split between ranks.
Pipeline stages (ranks holding different layers) spread the units of each stage over its own
ranks alike.
Restoring verifies each file read. One process reads every unit whole; DDP ranks (each needs all
of it) read each unit once in the job between them, balanced by bytes, and send it to the others
over torch.distributed (``distributed.read_plan``): each byte leaves the store once. So do the
data ranks of a pipeline stage among themselves, over the process group DDP wraps the stage in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from typing import Any

import torch

from llmtailor.distributed.coordinator import Coordinator
from llmtailor.distributed.read_plan import ReadPlan, balance_over, nbytes
from llmtailor.errors import IncompatibleModelError
from llmtailor.layouts import Layout
from llmtailor.providers import optimizer as optim_state
from llmtailor.providers.base import ConfigRecord, StateProvider, copy_into, loading, peft_config, unwrap
from llmtailor.store.codec import plain_value
from llmtailor.constants import KIND_WEIGHT, is_pack
from llmtailor.store.tensor_files import tensor_checksum
from llmtailor.store.keys import optim_key, split_key, split_unit, weight_key
from llmtailor.store.manifest import UnitEntry, dtype_name
from llmtailor.store.node_parts import copy_node, reading_ranks
from llmtailor.store.run import Run
from llmtailor.store.samples import covering, sample_checksums, sampled
from llmtailor.store.staged import Piece, StagedUnit

Loaded = tuple[str, dict[str, torch.Tensor], dict[str, dict[str, Any]]]
"""``(unit, tensors by key, optimizer values by parameter name)`` of one unit read."""


class LocalProvider(StateProvider):
    """Model, optimizer and LR scheduler of one process (or one DDP rank), by unit and name."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any | None,
        layout: Layout,
        coordinator: Coordinator,
    ):
        super().__init__(layout, coordinator)
        self.model = unwrap(model)
        self._ddp_group = getattr(model, "process_group", None) if type(model).__name__ == "DistributedDataParallel" else None
        """The process group DDP averages gradients over (a pipeline stage's data ranks), if wrapped."""
        self._tensors: dict[str, torch.Tensor] | None = None
        self.adapters = peft_config(model)
        """The peft adapters' configs (a ``PeftModel``), saved with the global state; else None."""
        self.optimizer = optimizer
        self.chain = optim_state.OptimizerChain(optimizer) if optimizer is not None else None
        self.lr_scheduler = lr_scheduler
        self._config = ConfigRecord()
        self.kind = "local" if coordinator.world_size == 1 else "ddp"

    def tensors(self) -> dict[str, torch.Tensor]:
        """Canonical name -> live parameter or persistent buffer, looked up once per save or
        restore (``refresh``): ``state_dict`` walks every module, which a peft model has many of."""
        if self._tensors is None:
            live = self.model.state_dict(keep_vars=True)
            self._tensors = {name: live[name] for name in self.layout.tensor_names()}
        return self._tensors

    def refresh(self) -> None:
        self._tensors = None

    def named_parameters(self):
        return ((name, t) for name, t in self.tensors().items() if isinstance(t, torch.nn.Parameter))

    def trained_names(self) -> set[str] | None:
        if self.chain is None:
            return None
        name_of = {id(t): name for name, t in self.tensors().items()}
        return {name_of[id(p)] for g in self.chain.innermost.param_groups for p in g["params"] if id(p) in name_of}

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.chain.hookable() if self.chain is not None else []

    def _requiring_no_grad(self) -> set[str]:
        """The parameters that require no grad, by name: an optimizer's groups may hold them or
        not (``optimizer.match_groups``)."""
        return {name for name, p in self.named_parameters() if not p.requires_grad}

    def live_specs(self) -> dict[str, tuple[list[int], torch.dtype]]:
        return {name: (list(t.shape), t.dtype) for name, t in self.tensors().items()}

    # -- save side ----------------------------------------------------------------------------

    def writes(self, units: list[str]) -> list[str]:
        """Every unit it holds in one process or a stage of one; under DDP (every rank of a stage
        holds its units whole) this rank's share of the chosen units of its stage, balanced by
        bytes over the stage's ranks (``balance_over``)."""
        held, rank = super().writes(units), self.coordinator.rank
        ranks = self.stages.ranks_of(rank)
        if len(ranks) == 1:
            return held
        sizes = self.unit_sizes()
        owners = balance_over({unit: sizes[unit] for unit in held}, ranks)
        return [u for u in held if owners[u] == rank]

    def pieces_by_unit(self, units: list[str]) -> dict[str, list[Piece]]:
        tensors = self.tensors()
        return {unit: self._pieces(unit, tensors) for unit in units}

    def stage_unit(self, unit: str) -> StagedUnit:
        tensors = self.tensors()
        values: dict[str, dict[str, Any]] = {}
        if self.chain is not None:
            for name in self.layout.units[unit]:
                for key, value in self.chain.param_state(tensors[name]).items():
                    if not isinstance(value, torch.Tensor):
                        values.setdefault(name, {})[key] = plain_value(value, f"optimizer state {name}.{key}")
        return StagedUnit(unit, self._pieces(unit, tensors), values)

    def live_tensors(self, units: list[str]) -> list[torch.Tensor]:
        """Each unit's parameters, buffers and optimizer state tensors, without building pieces
        (their pieces are views of these, or these themselves)."""
        tensors = self.tensors()
        return [self._memory(tensor) for unit in units for _, tensor, _ in self._unit_tensors(unit, tensors)]

    def _memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """What holds ``tensor``'s values on this rank."""
        return tensor

    def _unit_tensors(self, unit: str, tensors: dict[str, torch.Tensor]):
        """``(key, live tensor, is_buffer)`` of a unit's weights and optimizer state tensors (none
        for a unit another pipeline stage holds)."""
        for name in self.layout.units.get(unit, ()):
            param = tensors[name]
            yield weight_key(name), param, not isinstance(param, torch.nn.Parameter)
            if self.chain is None:
                continue
            for key, value in self.chain.param_state(param).items():
                if isinstance(value, torch.Tensor):
                    yield optim_key(name, key), value, False

    def _pieces(self, unit: str, tensors: dict[str, torch.Tensor]) -> list[Piece]:
        pieces = []
        for key, tensor, is_buffer in self._unit_tensors(unit, tensors):
            found = self._tensor_pieces(unit, key, tensor.detach())
            if is_buffer:  # forward may update it
                found = [replace(p, stable=False) for p in found]
            pieces += found
        return pieces

    def _tensor_pieces(self, unit: str, key: str, tensor: torch.Tensor) -> list[Piece]:
        """What this rank writes of one tensor: all of it (a process holds it whole)."""
        return [Piece.whole(key, tensor)]

    def capture_shared(self) -> dict[str, Any]:
        name_of = {id(t): name for name, t in self.tensors().items()}
        if self.chain is not None:
            self.chain.check_keys()
        return {
            "optimizer_groups": self.chain.group_records(name_of) if self.chain is not None else None,
            "optimizer_class": self.chain.classes() if self.chain is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "model_config": self._config(self.model),
            **({"peft_config": self.adapters} if self.adapters is not None else {}),
        }

    # -- restore side -------------------------------------------------------------------------

    def regroup(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.chain is None:
            return groups
        name_of = {id(t): name for name, t in self.tensors().items()}
        live = self.chain.group_records(name_of)
        return optim_state.regroup(groups, [g["params"] for g in live], set(self.layout.tensor_names()))

    def check_global(self, shared: dict[str, Any], saved_state: dict[str, set[str]]) -> None:
        """Refuse, before the live state is touched, a snapshot saved without an optimizer or
        LR scheduler when one is given, or from another kind of optimizer (its class, else its
        group and state keys: ``OptimizerChain.check_restorable``)."""
        if self.chain is not None:
            if shared.get("optimizer_groups") is None:
                raise IncompatibleModelError("the snapshot was saved without an optimizer, but one was given")
            with loading("optimizer groups", shared.get("step")):
                self.chain.check_restorable(shared, saved_state, self.tensors())
                self.chain.check_groups(shared["optimizer_groups"], {id(t): name for name, t in self.tensors().items()},
                                        self._requiring_no_grad())
        if self.lr_scheduler is not None and shared.get("lr_scheduler") is None:
            raise IncompatibleModelError("the snapshot was saved without an LR scheduler, but one was given")

    def load(self, run: Run, sources: dict[str, int], shared: dict[str, Any], verify: bool | str) -> None:
        """Every unit's weights into the live tensors in place (``load_units``); optimizer
        state collected by name and loaded once every unit is in, through
        ``Optimizer.load_state_dict`` (torch's own dtype and device rules apply)."""
        live = self.tensors()
        optimizer_state = self.load_units(run, sources, live, verify)
        self._load_optimizer_and_scheduler(shared, live, optimizer_state)

    def load_units(
        self, run: Run, sources: dict[str, int], live: dict[str, torch.Tensor], verify: bool | str
    ) -> dict[str, dict[str, Any]]:
        """Read each unit whole (file checksums always verified: a process needs all of it),
        its weights in place (read straight into the live tensors' memory where it takes them,
        ``_live_by_key``, else copied in); return its optimizer state by parameter name. A frozen
        tensor the version keeps (from an older snapshot or the base model) that the live
        model already holds (a model loaded with ``from_pretrained`` of the base, say) is not
        read again (``_already_held``)."""
        optimizer_state: dict[str, dict[str, Any]] = {}
        for unit, loaded, values in self._read_units(run, sources, live, exact=verify == "exact"):
            weights, state = split_unit(unit, self.layout.units[unit], loaded, values)
            for name, tensor in weights.items():
                if tensor is not live[name]:
                    copy_into(live[name], tensor)
            for name, entries in state.items():
                optimizer_state.setdefault(name, {}).update(entries)
        return optimizer_state

    def _read_units(self, run: Run, sources: dict[str, int], live: dict[str, torch.Tensor],
                    exact: bool = False) -> Iterator[Loaded]:
        """``(unit, tensors by key, optimizer values)`` of each unit, checked, the frozen tensors
        the live model holds already (``_already_held``) being the live ones. One process reads
        every unit; ranks that each need the same units whole (DDP's, or the data ranks of a
        pipeline stage: ``_replicas``) read each once between them (``_read_once``), unless each
        rank's node's copy of a node-local tier holds them all (``_own_copy_holds``). The ranks
        first exchange what they hold, which also bounds by the timeout the wait of the others
        on a rank that failed before loading."""
        held = self._already_held({unit: run.unit_entry(source, unit) for unit, source in sources.items()}, live, exact)
        if self.coordinator.world_size > 1:
            exchange = functools.partial(self.coordinator.exchange, f"{self.coordinator.round}/held",
                                         {u: sorted(h) for u, h in held.items()})
            replicas = self._replicas()
            if replicas is not None and not self._own_copy_holds(run, sources):
                ranks, group = replicas
                if not any(held.values()):  # what the others hold changes nothing here: read beside the exchange
                    yield from self._read_once(run, sources, live, held, None, ranks, group, meanwhile=exchange)
                else:
                    everyone = exchange()
                    yield from self._read_once(run, sources, live, held, [everyone[r] for r in ranks], ranks, group)
                return
            exchange()
        for unit, source in sources.items():
            loaded, values = run.read_unit(source, unit, skip=set(held[unit]), into=self._live_by_key(unit, live))
            yield unit, {**loaded, **held[unit]}, values

    def _own_copy_holds(self, run: Run, sources: dict[str, int]) -> bool:
        """Whether ``run`` is a node's copy of a node-local tier in which every rank's node holds
        every unit's files (after a healing, with replicas on every node): each rank then reads
        them from its own node's memory, which is faster than one reader sending them over the
        network (``_read_once``). The same answer on every rank (from the manifests alone)."""
        everyone = list(range(self.coordinator.world_size))
        for unit, source in sources.items():
            paths = [f.path for f in run.unit_entry(source, unit).files if f.origin != "base"]
            if reading_ranks(run.manifest(source).notes, paths, self.coordinator.world_size) != everyone:
                return False
        return copy_node(run.storage) is not None  # last: a read (of tiers.json) only for node placements

    def _live_by_key(self, unit: str, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A unit's live weights and existing optimizer state tensors by key, for the read to
        land straight in their memory where it can (``UnitReader.read``'s ``into``): a restore
        touches the live state anyway (``Tailor.restore`` marks it so before loading), and the
        optimizer keeps a state tensor given to ``load_state_dict`` of its dtype and device."""
        return {key: tensor for key, tensor, _ in self._unit_tensors(unit, live)}

    def _replicas(self) -> tuple[list[int], Any] | None:
        """The ranks holding this rank's units whole (its stage's: every rank of the job unless
        pipelined) and their process group, where several do: the job's (default) group, or for
        a pipeline stage the group DDP wraps its model over when that is the stage's ranks (none
        is known otherwise: each rank of such a stage reads its units itself). The same answer on
        every rank of a stage."""
        ranks = list(self.stages.ranks_of(self.coordinator.rank))
        if len(ranks) == 1:
            return None
        if not self.stages.pipelined:
            return ranks, None
        import torch.distributed as dist

        if self._ddp_group is not None and dist.get_process_group_ranks(self._ddp_group) == ranks:
            return ranks, self._ddp_group
        return None

    def _read_once(self, run: Run, sources: dict[str, int], live: dict[str, torch.Tensor],
                   held: dict[str, dict[str, torch.Tensor]], everyone: list[dict[str, list[str]]] | None,
                   ranks: list[int], group: Any, meanwhile: Callable[[], Any] | None = None) -> Iterator[Loaded]:
        """The units read by one of ``ranks`` each (``group``: their process group), balanced by
        bytes, and sent to the others (``distributed.read_plan``): each byte leaves the store once
        per job, and lands in the live tensors' memory where it takes it (``_live_by_key``; no
        staging copy, no new memory), else in new tensors. A tensor is sent unless every one of
        ``ranks`` holds it already (``everyone``:
        what each holds; None where this rank holds none, so that no tensor is held by all:
        the plan is then known before the ranks' exchange of what they hold, ``meanwhile``,
        which runs once this rank's reads have started, before the first broadcast)."""
        entries = {unit: run.unit_entry(source, unit) for unit, source in sources.items()}
        wanted = {unit: [t for t in entries[unit].tensors
                         if everyone is None or not all(t.key in other.get(unit, ()) for other in everyone)]
                  for unit in sources}
        specs = {unit: [(t.torch_dtype, t.shape) for t in wanted[unit]] for unit in sources}
        units = {f"unit {unit!r} of step {source}": unit for unit, source in sources.items()}
        plan = ReadPlan(self.coordinator, {item: nbytes(specs[unit]) for item, unit in units.items()}, ranks, group,
                        candidates=self._readable(run, sources, entries, units), together=self._packs(run, sources, entries, units))

        skipped = {unit: {t.key for t in entries[unit].tensors} - {t.key for t in wanted[unit]} for unit in sources}

        def read(item: str) -> list[torch.Tensor]:  # this rank's own: straight into the live tensors where they take it
            unit = units[item]
            loaded, _ = run.read_unit(sources[unit], unit, skip=skipped[unit], into=self._live_by_key(unit, live))
            return [loaded[t.key] for t in wanted[unit]]

        def into(item: str) -> list[torch.Tensor | None]:
            targets = self._live_by_key(units[item], live)
            return [targets.get(t.key) for t in wanted[units[item]]]

        # This rank's units, read from a pack they share in one fetch, not a request per unit.
        with run.reading_together([(sources[units[item]], units[item], skipped[units[item]]) for item in plan.mine()],
                                  {(sources[units[item]], units[item]): self._live_by_key(units[item], live) for item in plan.mine()}):
            for item, tensors in plan.fetch(read, lambda item: specs[units[item]], meanwhile, into):
                unit = units[item]
                values = {name: dict(plain) for name, plain in entries[unit].values.items()}
                yield unit, {**dict(zip((t.key for t in wanted[unit]), tensors)), **held[unit]}, values

    @staticmethod
    def _packs(run: Run, sources: dict[str, int], entries: dict[str, UnitEntry], units: dict[str, str]) -> dict[str, tuple[int, str]]:
        """Item -> the pack file its unit's tensors lie in (``(step, path)``), for a unit in one
        pack of a remote store: a reader reads the units of a pack it has together, in one
        request (``Run.reading_together``), so the plan keeps a pack's units on as few readers
        as the byte balance allows (``balance``'s ``together``)."""
        if not run.storage.remote:
            return {}
        packs = {}
        for item, unit in units.items():
            held = {(f.origin if f.origin is not None else sources[unit], f.path) for f in entries[unit].files if f.origin != "base"}
            if len(held) == 1 and is_pack(next(iter(held))[1]):
                packs[item] = next(iter(held))
        return packs

    def _readable(self, run: Run, sources: dict[str, int], entries: dict[str, UnitEntry],
                  units: dict[str, str], keys: dict[str, Collection[str]] | None = None) -> dict[str, list[int]]:
        """Item -> the ranks that can read it where not every rank can: in a node-local tier, those
        whose node's copy holds the unit's files (``node_parts.reading_ranks``); with ``keys``,
        the files the chunks of the unit's tensors of those keys lie in."""
        readable = {}
        for item, unit in units.items():
            files = entries[unit].files
            used = (range(len(files)) if keys is None
                    else {c.file for t in entries[unit].tensors if t.key in keys[unit] for c in t.chunks})
            paths = [files[at].path for at in sorted(used) if files[at].origin != "base"]
            ranks = reading_ranks(run.manifest(sources[unit]).notes, paths, self.coordinator.world_size)
            if ranks is not None:
                readable[item] = ranks
        return readable

    @staticmethod
    def _already_held(entries: dict[str, UnitEntry], live: dict[str, torch.Tensor],
                      exact: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """Per unit, the frozen tensors of its entry the live model holds already, by key: of
        the saved dtype and shape, and the checksum of its sample the one recorded at save
        (``Chunk.cover_xxh3``: an element of every row and column, ``samples.covering``, a
        cache line per sampled element, not a pass over a base model's weights; a tensor that
        differs in whole rows or columns is read, one differing only in scattered unsampled
        elements passes; every unit's samples read with one copy, ``sample_checksums``). A
        record of schema 5 or 6 (``Chunk.sample_xxh3``) is checked by the 1024 elements it was
        taken over (``samples.sampled``), as then. ``exact``, or a run saved before samples
        were recorded: the checksum of all its bytes instead. Frozen: kept from an older
        snapshot or the base directory (``origin``), or written by this version with a sample
        (recorded for frozen whole weights only, ``frozen._with_sample``): a LoRA's frozen
        embedding and head, written by the save that first held them, are not read either."""
        held: dict[str, dict[str, torch.Tensor]] = {unit: {} for unit in entries}
        # Per sample, (unit, key, recorded checksum, live tensor) of the tensors checked by it.
        checked: dict[Callable, list[tuple[str, str, str, torch.Tensor]]] = {covering: [], sampled: []}
        for unit, entry in entries.items():
            for tensor in entry.tensors:
                kind, name, _ = split_key(tensor.key)
                target, chunk = live.get(name), tensor.chunks[0]
                recorded = chunk.cover_xxh3 or chunk.sample_xxh3
                if kind != KIND_WEIGHT or (entry.files[chunk.file].origin is None and recorded is None) or target is None:
                    continue
                target = target.detach()
                if len(tensor.chunks) != 1 or list(target.shape) != tensor.shape or dtype_name(target.dtype) != tensor.dtype:
                    continue
                if not exact and recorded is not None:
                    checked[covering if chunk.cover_xxh3 else sampled].append((unit, tensor.key, recorded, live[name]))
                elif tensor_checksum(target) == chunk.xxh3_64:
                    held[unit][tensor.key] = live[name]
        for take, tensors in checked.items():
            sums = sample_checksums([Piece.whole(key, tensor.detach()) for _, key, _, tensor in tensors], take)
            for (unit, key, recorded, tensor), now in zip(tensors, sums):
                if now == recorded:
                    held[unit][key] = tensor
        return held

    def _load_optimizer_and_scheduler(
        self, shared: dict[str, Any], live: dict[str, torch.Tensor], optimizer_state: dict[str, dict[str, Any]]
    ) -> None:
        step = shared.get("step")
        if self.chain is not None:
            groups = shared.get("optimizer_groups")
            with loading("optimizer state", step):
                name_of = {id(t): name for name, t in live.items()}
                self.chain.load_by_name(groups, optimizer_state, name_of, self._requiring_no_grad())
        if self.lr_scheduler is not None:
            with loading("LR scheduler state", step):
                self.lr_scheduler.load_state_dict(shared["lr_scheduler"])
