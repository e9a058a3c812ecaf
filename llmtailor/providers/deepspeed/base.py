"""The stage-independent part of the DeepSpeed providers (the package docstring says what a
unit holds and how steps are kept)."""

from __future__ import annotations

import copy
import functools
import re
from abc import ABC, abstractmethod
from typing import Any

import torch

from llmtailor.distributed.coordinator import Coordinator
from llmtailor.errors import IncompatibleModelError, IntegrityError
from llmtailor.layouts import Layout
from llmtailor.providers.base import StateProvider, hf_config, loading, unwrap
from llmtailor.providers.optimizer import check_classes, check_state_keys, class_name, match_groups
from llmtailor.store import codec
from llmtailor.store.keys import master_key, optim_key, weight_key
from llmtailor.store.manifest import TensorEntry, UnitEntry
from llmtailor.store.reader import ChunkReader, flat_range_boxes
from llmtailor.store.run import Run
from llmtailor.store.staged import Piece, StagedUnit

STEP = "step"
NOTES = {
    "optimizer_step": (
        "DeepSpeed keeps one optimizer step per param group (flat partition); each unit records its "
        "group's step at save time as optim/<name>/step. Restoring into DeepSpeed sets every group's "
        "step from the composite's own step (global state deepspeed.steps); restoring into a plain "
        "torch optimizer uses each unit's own."
    ),
    "weights": "master/<name> holds the fp32 master; the low-precision weights are the masters cast.",
}


ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
"""The engine's counters a snapshot keeps and a restore sets back (as DeepSpeed's own checkpoints do)."""


DATA_STATES = {
    "data_sampler": lambda engine: engine.training_dataloader.data_sampler
    if engine.training_dataloader is not None and engine.curriculum_learning_enabled() else None,
    "random_ltd": lambda engine: engine.random_ltd_scheduler if engine.random_ltd_enabled() else None,
}
"""The engine's data-efficiency states, by the key of DeepSpeed's model states, and what holds
each in an engine where it is enabled (``DeepSpeedEngine._common_checkpoint_state``): the
curriculum sampler (its position, difficulties and numpy RNG) and random-LTD's scheduler. Kept
in the global state (``deepspeed.<key>``) and set back on restore, as DeepSpeed's own checkpoints do."""


def _data_holders(engine: Any) -> dict[str, Any]:
    """``DATA_STATES``' holders this engine has (an engine of another DeepSpeed, or a plain
    stand-in, may lack the accessors: none)."""
    try:
        found = {key: holder(engine) for key, holder in DATA_STATES.items()}
    except AttributeError:
        return {}
    return {key: holder for key, holder in found.items() if holder is not None}


RANDOM_LTD_WRAPPER = re.compile(r"(\.random_ltd_layer)+(?=\.)")
"""Where random-LTD puts its wrapper in a layer's names (``convert_to_random_ltd`` replaces each
layer by a ``RandomLayerTokenDrop`` holding it as ``random_ltd_layer``)."""


def canonical_name(name: str) -> str:
    """A tensor's name without random-LTD's wrapper, as DeepSpeed's own checkpoints name it
    (``DeepSpeedEngine.module_state_dict``): the model's own name, the same with random-LTD on
    or off, and in a Hugging Face or plain model."""
    return RANDOM_LTD_WRAPPER.sub("", name)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and persistent buffers (``state_dict(keep_vars=True)``) by
    canonical name (``canonical_name``)."""
    return {canonical_name(name): tensor for name, tensor in module.state_dict(keep_vars=True).items()}


def is_engine(model: Any) -> bool:
    return type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine") and hasattr(model, "zero_optimization_stage")


class Fragment:
    """This rank's part of one parameter: elements ``[start, start + numel)`` of the flattened
    parameter; ``master`` and ``states`` are 1-D views into DeepSpeed's partitions."""

    def __init__(self, start: int, numel: int, master: torch.Tensor, states: dict[str, torch.Tensor]):
        self.start, self.numel, self.master, self.states = start, numel, master, states


class DeepSpeedProvider(StateProvider, ABC):
    """The model, ZeRO optimizer and scheduler of one DeepSpeed engine's rank (package
    docstring). What differs by stage, where DeepSpeed keeps a parameter's master, state and
    step, is each subclass's (``zero12.py``, ``zero3.py``); the rest reads straight through."""

    kind = "deepspeed"

    def __init__(self, engine: Any, layout: Layout, coordinator: Coordinator, lr_scheduler: Any = None):
        super().__init__(layout, coordinator)
        self.engine = engine
        self.module = unwrap(engine.module)
        self.zero = engine.optimizer
        self.stage = int(engine.zero_optimization_stage())
        # The engine's scheduler, or one the caller steps itself (HF Trainer keeps its own).
        self.lr_scheduler = engine.lr_scheduler if engine.lr_scheduler is not None else lr_scheduler
        self.params = {canonical_name(n): p for n, p in self.module.named_parameters()}
        self.names = {id(p): n for n, p in self.params.items()}
        """id(parameter) -> canonical name, made once."""

    # -- where DeepSpeed keeps things ----------------------------------------------------------

    @abstractmethod
    def _groups(self) -> list[list[torch.nn.Parameter]]:
        """The user's param groups as lists of low-precision parameters, in the order of the
        optimizer's ``param_groups``."""

    @abstractmethod
    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 flat partitions (each keyed in the optimizer's state)."""

    @abstractmethod
    def _partition_of(self, param: torch.nn.Parameter) -> int:
        """Index of the flat partition holding ``param``'s master."""

    @abstractmethod
    def _group_of_partition(self, index: int) -> int:
        """The param group a flat partition belongs to."""

    @abstractmethod
    def _fragment(self, param: torch.nn.Parameter) -> Fragment | None:
        """This rank's fragment of ``param`` (None when it holds none)."""

    @abstractmethod
    def _global_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        """The parameter's shape in the model (not its partition's)."""

    @abstractmethod
    def _frozen_pieces(self, name: str, param: torch.nn.Parameter, shape: tuple[int, ...], owner: bool) -> list[Piece]:
        """What this rank writes of a frozen parameter (no master, no optimizer state)."""

    @abstractmethod
    def _load_frozen(self, reader: ChunkReader, step: int, entry: UnitEntry, saved: TensorEntry, param) -> None:
        """Read the part of a frozen parameter this rank holds into it."""

    def _before_load(self) -> None:
        """What DeepSpeed needs before its partitions are written into (local: no collective)."""

    def _narrowed(self, flat: torch.Tensor, offset: int, start: int, numel: int) -> Fragment:
        """The fragment at ``offset`` of the flat partition ``flat`` (and of its optimizer
        state), elements ``[start, start + numel)`` of its flattened parameter."""
        states = {
            key: value.narrow(0, offset, numel)
            for key, value in self.zero.optimizer.state.get(flat, {}).items()
            if isinstance(value, torch.Tensor) and value.shape == flat.shape
        }
        return Fragment(start, numel, flat.narrow(0, offset, numel), states)

    def _step_of(self, param: torch.nn.Parameter) -> Any:
        return self.zero.optimizer.state.get(self._flat_partitions()[self._partition_of(param)], {}).get(STEP)

    # -- save side ----------------------------------------------------------------------------

    def named_parameters(self):
        return iter(self.params.items())

    @functools.cached_property
    def _trained(self) -> set[int]:
        """The ids of the parameters DeepSpeed's optimizer trains: those of the user's param groups
        that require grad. Any other parameter is frozen (no master, no optimizer state): one that
        requires grad but no group holds too, as DeepSpeed leaves it out of its partitions."""
        return {id(p) for params in self._groups() for p in params}

    def trained_names(self) -> set[str]:
        return {self.names[i] for i in self._trained}

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.zero.optimizer]  # its step changes the masters and moments

    def live_specs(self) -> dict[str, tuple[list[int], torch.dtype]]:
        specs = {}
        for name, tensor in module_tensors(self.module).items():
            if name in self.layout.tensor_names():
                shape = self._global_shape(tensor) if name in self.params else tuple(tensor.shape)
                specs[name] = (list(shape), tensor.dtype)
        return specs

    def stage_unit(self, unit: str) -> StagedUnit:
        owner = self.owner(unit) == self.coordinator.rank
        pieces: list[Piece] = []
        values: dict[str, dict[str, Any]] = {}
        buffers = None
        for name in self.layout.units[unit]:
            param = self.params.get(name)
            if param is None:  # a persistent buffer: the same on every rank, written once
                if owner:
                    buffers = buffers or module_tensors(self.module)
                    pieces.append(Piece.whole(weight_key(name), buffers[name].detach(), stable=False))
                continue
            shape = self._global_shape(param)
            if id(param) not in self._trained:  # frozen: no master, no optimizer state
                pieces += self._frozen_pieces(name, param, shape, owner)
                continue
            fragment = self._fragment(param)
            if fragment is not None:
                pieces += box_pieces(master_key(name), fragment.master, shape, fragment.start, fragment.numel)
                for key, state in fragment.states.items():
                    pieces += box_pieces(optim_key(name, key), state, shape, fragment.start, fragment.numel)
            step = self._step_of(param)
            if owner and step is not None:
                if isinstance(step, torch.Tensor):
                    pieces.append(Piece.whole(optim_key(name, STEP), step.detach()))
                else:
                    values.setdefault(name, {})[STEP] = codec.plain_value(step, f"optimizer step of {name}")
        return StagedUnit(unit, pieces, values)

    def capture_shared(self) -> dict[str, Any]:
        groups = []
        for index, params in enumerate(self._groups()):
            hyper = {k: v for k, v in self.zero.optimizer.param_groups[index].items() if k != "params"}
            groups.append({**hyper, "params": [self.names[id(p)] for p in params]})
        steps = [self.zero.optimizer.state.get(flat, {}).get(STEP) for flat in self._flat_partitions()]
        return {
            "optimizer_groups": groups,
            "optimizer_class": [class_name(self.zero.optimizer)],
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "model_config": hf_config(self.module),
            "deepspeed": {"stage": self.stage, "steps": [_plain_step(s) for s in steps],
                          "counters": {name: int(getattr(self.engine, name)) for name in ENGINE_COUNTERS},
                          # copied: a sampler's state holds its live lists
                          **{key: copy.deepcopy(holder.state_dict()) for key, holder in _data_holders(self.engine).items()}},
        }

    def notes(self) -> dict[str, Any]:
        return {**NOTES, "zero_stage": self.stage}

    # -- restore side -------------------------------------------------------------------------

    def check_global(self, shared: dict[str, Any], saved_state: dict[str, set[str]]) -> None:
        """Refuse, before the live state is touched, a snapshot without an optimizer, from another
        kind of optimizer (its class, else its state keys: a ZeRO engine holds state from the
        start; the group keys it lacks keep the engine's values, ``_load_groups``), with other
        param groups, or without the engine's LR scheduler."""
        if shared.get("optimizer_groups") is None:
            raise IncompatibleModelError("the snapshot was saved without an optimizer; a DeepSpeed engine needs one")
        check_classes(shared.get("optimizer_class"), [class_name(self.zero.optimizer)])
        check_state_keys({name: keys - {STEP} for name, keys in saved_state.items()}, self._live_state_keys(),
                         type(self.zero.optimizer).__name__)
        with loading("optimizer groups", shared.get("step")):
            self._matched_groups(shared["optimizer_groups"])
        if self.lr_scheduler is not None and shared.get("lr_scheduler") is None:
            raise IncompatibleModelError("the snapshot was saved without an LR scheduler, but the engine has one")

    def load(self, run: Run, sources: dict[str, int], shared: dict[str, Any], verify: bool | str) -> None:
        """Every parameter's fragment read by byte range into the masters and optimizer state
        in place; group hyperparameters and steps set (``finish_load`` refreshes the
        low-precision weights)."""
        groups = shared["optimizer_groups"]
        keys = sorted({k for unit, step in sources.items() for k in _state_keys(run.unit_entry(step, unit))})
        self._ensure_state(keys)
        reader = ChunkReader(run, verify)
        unit_steps: dict[str, Any] = {}
        try:
            self._before_load()
            for unit, step in sources.items():
                entry = run.unit_entry(step, unit)
                for name in self.layout.units[unit]:
                    self._load_tensor(reader, step, entry, name, unit_steps)
        finally:
            reader.close()
        self._load_groups(groups, shared, sources, unit_steps)
        counters = (shared.get("deepspeed") or {}).get("counters") or {}
        for name in ENGINE_COUNTERS:
            if isinstance(counters.get(name), int):
                setattr(self.engine, name, counters[name])
        for key, holder in _data_holders(self.engine).items():  # a snapshot without one leaves the engine's
            if (shared.get("deepspeed") or {}).get(key) is not None:
                with loading(f"DeepSpeed's {key} state", shared.get("step")):
                    holder.load_state_dict(shared["deepspeed"][key])
        if self.lr_scheduler is not None:
            with loading("LR scheduler state", shared.get("step")):
                self.lr_scheduler.load_state_dict(shared["lr_scheduler"])

    def _load_tensor(self, reader: ChunkReader, step: int, entry: UnitEntry, name: str, unit_steps: dict) -> None:
        param = self.params.get(name)
        weight = entry.tensor(weight_key(name))
        master = entry.tensor(master_key(name)) or weight
        if master is None:
            raise IntegrityError(f"snapshot {step}: unit {entry.unit!r} lacks the weights of {name!r}")
        if param is None:  # a buffer
            buffer = module_tensors(self.module)[name]
            with torch.no_grad():
                buffer.copy_(read_flat(reader, step, entry, master, 0, buffer.numel()).view(buffer.shape))
            return
        if id(param) not in self._trained:
            self._load_frozen(reader, step, entry, weight or master, param)
            return
        fragment = self._fragment(param)
        if fragment is not None:
            with torch.no_grad():
                fragment.master.copy_(read_flat(reader, step, entry, master, fragment.start, fragment.numel))
                for key, target in fragment.states.items():
                    saved = entry.tensor(optim_key(name, key))
                    if saved is None:
                        raise IntegrityError(f"snapshot {step}: {name!r} has no optimizer state {key!r}")
                    target.copy_(read_flat(reader, step, entry, saved, fragment.start, fragment.numel))
        saved_step = entry.tensor(optim_key(name, STEP))
        if saved_step is not None:
            unit_steps[name] = reader.read_region(step, entry, saved_step, (), ())
        elif STEP in entry.values.get(name, {}):
            unit_steps[name] = codec.decode(entry.values[name][STEP], {}, f"{entry.unit}.{name}.step")

    def _live_state_keys(self) -> dict[str, set[str]]:
        """The state keys of each trained parameter's flat partition (its step aside), by name."""
        state, groups = self.zero.optimizer.state, self._groups()
        keys = {}
        for index, flat in enumerate(self._flat_partitions()):
            held = set(state.get(flat, {})) - {STEP}
            keys.update({self.names[id(p)]: held for p in groups[self._group_of_partition(index)]})
        return keys

    def _matched_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The saved ``groups`` matched to the engine's by their parameters' names, those requiring
        no grad aside (``optimizer.match_groups``: DeepSpeed's groups leave them out; a plain
        optimizer's may hold them); IncompatibleModelError where they differ."""
        frozen = {name for name, p in self.params.items() if not p.requires_grad}
        return match_groups([[self.names[id(p)] for p in params] for params in self._groups()], groups, frozen)

    def _ensure_state(self, keys: list[str]) -> None:
        """Create the optimizer state of every flat partition that has none yet (a fresh
        engine), with the state keys the snapshot holds, so it can be loaded in place."""
        state = self.zero.optimizer.state
        for flat in self._flat_partitions():
            if flat not in state or not state[flat]:
                state[flat] = {STEP: torch.tensor(0.0), **{k: torch.zeros_like(flat) for k in keys}}

    def _load_groups(self, groups, shared, sources, unit_steps) -> None:
        """Hyperparameters by group (matched by parameter names); each flat partition's step
        from the composite's own step (module docstring)."""
        for index, saved in enumerate(self._matched_groups(groups)):
            with loading("optimizer groups", shared.get("step")):
                self.zero.optimizer.param_groups[index].update({k: v for k, v in saved.items() if k != "params"})
        saved_steps = (shared.get("deepspeed") or {}).get("steps")
        state = self.zero.optimizer.state
        for index, flat in enumerate(self._flat_partitions()):
            value = self._composite_step(index, saved_steps, sources, shared.get("step"), unit_steps)
            if value is None:
                continue
            current = state[flat].get(STEP)
            if isinstance(current, torch.Tensor):
                current.fill_(float(value))
            else:
                state[flat][STEP] = type(current)(value) if current is not None else value

    def _composite_step(self, index, saved_steps, sources, step, unit_steps) -> Any:
        """The step of flat partition ``index``: DeepSpeed's own record of the composite's step
        when the snapshot was saved by DeepSpeed with the same partitioning; else the step of
        the group's parameters whose unit came from the composite's step (all equal in a
        torch optimizer's snapshot), else the largest."""
        if saved_steps is not None and len(saved_steps) == len(self._flat_partitions()) and saved_steps[index] is not None:
            return saved_steps[index]
        group = self._groups()[self._group_of_partition(index)]
        own = [_plain_step(unit_steps[n]) for p in group if (n := self.names[id(p)]) in unit_steps
               and sources.get(self.layout.unit_of(n)) == step]
        every = [_plain_step(unit_steps[self.names[id(p)]]) for p in group if self.names[id(p)] in unit_steps]
        return max(own) if own else max(every) if every else None


def box_pieces(key: str, flat: torch.Tensor, shape: tuple[int, ...], start: int, numel: int) -> list[Piece]:
    """Pieces tiling elements ``[start, start + numel)`` of a tensor of ``shape``, cut from the
    1-D fragment ``flat`` (views: each box is contiguous in the flat order)."""
    pieces, position = [], 0
    for offsets, extent in flat_range_boxes(shape, start, numel):
        count = 1
        for d in extent:
            count *= d
        pieces.append(Piece(key, flat[position : position + count].view(extent), tuple(offsets), shape))
        position += count
    return pieces


def read_flat(reader: ChunkReader, step: int, entry: UnitEntry, tensor: TensorEntry, start: int, numel: int) -> torch.Tensor:
    """Elements ``[start, start + numel)`` of the flattened tensor, read box by box."""
    boxes = flat_range_boxes(tuple(tensor.shape), start, numel)
    return torch.cat([reader.read_region(step, entry, tensor, o, s).reshape(-1) for o, s in boxes]) if boxes else torch.empty(0)


def _state_keys(entry: UnitEntry) -> set[str]:
    return {t.key.rsplit("/", 1)[1] for t in entry.tensors if t.key.startswith("optim/") and t.shape} - {STEP}


def _plain_step(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value
