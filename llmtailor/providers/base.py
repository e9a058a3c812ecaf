"""The state-provider interface: one rank's live training state, seen by unit and name.

One store, many providers. Each training backend is a provider: ``LocalProvider`` (one
process, and DDP's replicated state), ``FSDPProvider`` (FSDP2 / DTensor shards) and
``DeepSpeedProvider`` (ZeRO-1/2/3 fragments). A provider

- stages a unit as pieces keyed by canonical parameter name (``weight/<name>``,
  ``optim/<name>/<state key>``, ``master/<name>``) with their offsets in the global tensor:
  only the pieces this rank writes;
- captures the global state: what all ranks share (optimizer hyperparameters by group,
  scheduler, model config) and what is each rank's own (RNG states);
- checks a composite against the live state from manifests alone, then loads it in place,
  reading only what this rank holds.

Names are canonical: no ``module.`` (DDP), ``_orig_mod.`` (torch.compile) or FSDP wrapper
prefixes, so a run saved by one provider at one world size restores through another.
"""

from __future__ import annotations

import copy
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmtailor.constants import KIND_MASTER, KIND_OPTIM, KIND_WEIGHT
from llmtailor.distributed.coordinator import Coordinator
from llmtailor.distributed.read_plan import balance_over
from llmtailor.errors import IncompatibleModelError, IntegrityError, TailorError
from llmtailor.layouts import Layout
from llmtailor.providers import rng
from llmtailor.store.catalog import Composite
from llmtailor.store.keys import lacking_weights, split_key
from llmtailor.store.manifest import Manifest, UnitEntry, dtype_name
from llmtailor.store import codec
from llmtailor.store.run import Run
from llmtailor.store.staged import Piece, StagedUnit

if TYPE_CHECKING:
    from llmtailor.providers.stateful import StatefulObjects


@dataclass(frozen=True)
class Stages:
    """Which ranks hold which units, the same on every rank (``agreement.agree_layout``): the
    run's ``layout``, the union of what the ranks hold, and its stages: ``(ranks, units)`` per
    group of ranks holding the same units, in rank order; each unit in one stage. One stage of
    every rank unless ranks hold different layers (pipeline-parallel stages)."""

    layout: Layout
    stages: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]

    @classmethod
    def single(cls, layout: Layout, world: int) -> Stages:
        return cls(layout, ((tuple(range(world)), tuple(layout.units)),))

    @property
    def pipelined(self) -> bool:
        return len(self.stages) > 1

    def ranks_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s stage (``rank`` among them)."""
        return next(ranks for ranks, _ in self.stages if rank in ranks)

    def record(self) -> list[dict[str, Any]]:
        """The stages as the global state records them (JSON): each stage's ranks and units."""
        return [{"ranks": list(ranks), "units": list(units)} for ranks, units in self.stages]


class StateProvider(ABC):
    """The live state of one rank (module docstring). ``layout`` holds the units this rank
    holds; ``stages.layout`` the run's (every rank's, as ``make_provider`` agreed it)."""

    kind: str = "local"
    """Recorded in the manifest as ``provider``."""

    def __init__(self, layout: Layout, coordinator: Coordinator):
        self.layout = layout
        self.coordinator = coordinator
        self.stages = Stages.single(layout, coordinator.world_size)
        self._owners: dict[str, int] | None = None

    def refresh(self) -> None:
        """A save or restore begins: forget what was looked up of the live objects (a model may
        have been moved, re-wrapped or had modules replaced since the last)."""

    # -- who writes what -----------------------------------------------------------------------

    def unit_sizes(self) -> dict[str, int]:
        """Each unit's bytes of weights in the global model (the same on every rank)."""
        specs = self.live_specs()
        return {unit: sum(math.prod(specs[n][0]) * specs[n][1].itemsize for n in names if n in specs)
                for unit, names in self.layout.units.items()}

    def owner(self, unit: str) -> int:
        """The rank that writes what the ranks of its stage hold alike of ``unit`` (step
        counters, buffers, frozen weights that are not sharded), for a unit this rank holds:
        fixed for the run, the stage's units balanced over its ranks by bytes (``balance_over``)."""
        if self._owners is None:
            self._owners = balance_over(self.unit_sizes(), self.stages.ranks_of(self.coordinator.rank))
        return self._owners[unit]

    # -- save side ----------------------------------------------------------------------------

    def writes(self, units: list[str]) -> list[str]:
        """Of the units chosen for a save, those this rank writes pieces of (by default those it
        holds: each rank writes its own shards of every unit of its stage)."""
        return [u for u in units if u in self.layout.units]

    @abstractmethod
    def stage_unit(self, unit: str) -> StagedUnit:
        """This rank's pieces of ``unit``: live references, valid until the next optimizer step."""

    def pieces_by_unit(self, units: list[str]) -> dict[str, list[Piece]]:
        """This rank's pieces of each of ``units`` (live references), in one pass."""
        return {unit: self.stage_unit(unit).pieces for unit in units}

    def live_tensors(self, units: list[str]) -> list[torch.Tensor]:
        """The live tensors behind ``pieces_by_unit(units)``, in a fixed order: while their data
        pointers stay the same, so do the pieces' memory (what ``DriftTracker`` keeps views
        of). Override with something cheaper than listing the pieces where there is."""
        return [p.tensor for pieces in self.pieces_by_unit(units).values() for p in pieces]

    @abstractmethod
    def capture_shared(self) -> dict[str, Any]:
        """State all ranks share: ``optimizer_groups``, ``lr_scheduler``, ``model_config`` (and
        what else the provider needs back). Called on the leader only (and on each pipeline
        stage's leader, for its stage's optimizer and scheduler)."""

    def capture_rank(self) -> dict[str, Any]:
        """This rank's own state (its RNG streams); user extras are added by ``Tailor``."""
        return {"rng": rng.capture_rng()}

    def notes(self) -> dict[str, Any]:
        """What a reader of the manifest must know about this provider's state."""
        return {}

    def frozen_names(self) -> set[str]:
        """Parameters that do not train: they require no grad, or no optimizer group holds them
        (nothing in a training step changes them)."""
        trained = self.trained_names()
        return {n for n, p in self.named_parameters() if not p.requires_grad or (trained is not None and n not in trained)}

    def trained_names(self) -> set[str] | None:
        """The parameters the optimizer updates, by name (None: no optimizer, or not known)."""
        return None

    def frozen_units(self, frozen: set[str] | None = None) -> list[str]:
        """Units whose tensors are all parameters that do not train (``frozen``: ``frozen_names()``,
        when the caller has it already)."""
        frozen = self.frozen_names() if frozen is None else frozen
        return [unit for unit, names in self.layout.units.items() if all(n in frozen for n in names)]

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters by canonical name."""
        return iter(())

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose ``step`` changes the staged tensors: an async save fences
        their steps until its copies are taken."""
        return []

    # -- restore side -------------------------------------------------------------------------

    @abstractmethod
    def live_specs(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Canonical name -> (global shape, dtype) of every live tensor of the layout."""

    def check_compatible(self, manifest: Manifest, index_of: Callable[[str], UnitEntry]) -> None:
        """Refuse, before any tensor byte is read, a composite whose layout, names, shapes or
        dtypes differ from the live state. ``index_of(unit)`` is the unit's index in the
        snapshot the composite names (read only once the layouts agree).
        A parameter saved only as an fp32 master may load into a model of another float dtype
        (mixed precision keeps the master); any other dtype must match."""
        saved = Layout.from_record(manifest.layout)
        problems = self.stages.layout.diff(saved)  # the run's layout: every rank's units
        if not problems:
            live = self.live_specs()
            for unit in self.held(manifest.composite):
                source = index_of(unit)
                weights = {split_key(e.key)[1]: e for e in source.tensors if split_key(e.key)[0] == KIND_WEIGHT}
                masters = {split_key(e.key)[1]: e for e in source.tensors if split_key(e.key)[0] == KIND_MASTER}
                for name, entry in {**masters, **weights}.items():
                    spec = live.get(name)
                    if spec is None:
                        problems.append(f"snapshot {source.step} holds {name!r}, which the model lacks")
                        continue
                    shape, dtype = spec
                    dtype_ok = dtype_name(dtype) == entry.dtype or (
                        name not in weights and dtype.is_floating_point and entry.torch_dtype.is_floating_point
                    )
                    if list(shape) != entry.shape or not dtype_ok:
                        problems.append(
                            f"{name}: model has {dtype_name(dtype)} {list(shape)}, "
                            f"snapshot {source.step} has {entry.dtype} {entry.shape}"
                        )
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} in all)" if len(problems) > 8 else "")
            raise IncompatibleModelError(
                f"the snapshot at step {manifest.step} does not fit this model "
                f"(snapshot layout {saved.family!r}, model layout {self.layout.family!r}): {shown}"
            )

    def check_composite(self, run: Run, composite: Composite) -> dict[str, Any]:
        """Everything a restore checks before it touches the live state, from manifests, unit
        indexes and the global state alone: layout, names, shapes and dtypes
        (``check_compatible``), every unit present with every weight (``check_held``), the base
        model directory there (``Run.check_base``), optimizer class, groups and state keys,
        scheduler (``check_global``). Returns the composite step's global state."""
        self.check_compatible(composite.manifest, lambda unit: run.unit_entry(composite.sources[unit], unit))
        missing = set(self.stages.layout.units) - set(composite.sources)
        if missing:
            raise IntegrityError(f"composite of step {composite.step} names no version of units {sorted(missing)}")
        self.check_held(run, composite)
        run.check_base(composite)
        shared = self.stage_shared(run, composite.step, run.read_global(composite.step))
        self.check_global(shared, saved_state_keys(run, composite))
        return shared

    def held(self, sources: Mapping[str, int]) -> dict[str, int]:
        """Of a composite's ``sources`` (unit -> snapshot), the units this rank holds: all it reads."""
        return {unit: step for unit, step in sources.items() if unit in self.layout.units}

    def stage_shared(self, run: Run, step: int, shared: dict[str, Any]) -> dict[str, Any]:
        """The global state of step ``step`` (``shared``: rank 0's) as this rank's stage loads it.
        Saved by pipeline stages, or restored into them, the optimizer groups are every saved
        stage's, cut along the live optimizer's groups (``regroup``: each parameter keeps its
        saved hyperparameters); the LR scheduler and optimizer class are the saved stage's
        that held the first unit this rank holds (a stage's leader keeps them in its rank state)."""
        if shared.get("stages") is None and not self.stages.pipelined:
            return shared
        with loading("pipeline stages' global state", step):
            states = run.stage_states(step, shared) or [(list(self.stages.layout.units), shared)]
        first = next(iter(self.layout.units))
        mine = next((state for units, state in states if first in units), states[0][1])
        groups = [g for _, state in states for g in state.get("optimizer_groups") or []]
        return {**shared, "lr_scheduler": mine.get("lr_scheduler"), "optimizer_class": mine.get("optimizer_class"),
                "optimizer_groups": self.regroup(groups) if mine.get("optimizer_groups") is not None else None}

    def regroup(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Saved optimizer groups (every stage's) cut along this rank's live groups."""
        return groups

    def check_held(self, run: Run, composite: Composite) -> None:
        """Refuse a composite a unit version of which lacks a weight of the unit, written or
        kept (from an older snapshot or the base directory): every provider loads a unit by
        the keys its index lists, so a weight it lacks would keep its live value unseen."""
        for unit, source in self.held(composite.sources).items():
            keys = {tensor.key for tensor in run.unit_entry(source, unit).tensors}
            lacking = lacking_weights(self.layout.units[unit], keys)
            if lacking:
                shown = ", ".join(map(repr, lacking[:3])) + (f", ... ({len(lacking)} in all)" if len(lacking) > 3 else "")
                raise IntegrityError(f"the composite of step {composite.step} takes unit {unit!r} from snapshot {source}, "
                                     f"which lacks (neither writes nor keeps) the weights of {shown}")

    def check_global(self, shared: dict[str, Any], saved_state: dict[str, set[str]]) -> None:
        """Refuse, from the composite's global state and the optimizer state keys its units hold
        by parameter name (``saved_state``), before any live tensor is touched, what cannot be
        restored into the live objects (another optimizer class, say)."""

    @abstractmethod
    def load(self, run: Run, sources: dict[str, int], shared: dict[str, Any], verify: bool | str) -> None:
        """Load the composite in place: each unit from the snapshot ``sources[unit]`` (weights
        and per-parameter optimizer state), then optimizer groups and LR scheduler from
        ``shared`` (the composite step's global state). Reads one unit at a time."""

    def finish_load(self) -> None:
        """What completes a ``load`` with collectives (DeepSpeed refreshes its low-precision
        weights with an all-gather). ``Tailor.restore`` calls it only once every rank's
        ``load`` succeeded, so ``load`` itself must not enter a collective: a rank whose read
        failed would leave the others blocked in it."""

    def encode_global(self, step: int, extra: Any, stateful: StatefulObjects | None = None) -> tuple[Any, Any, Any, Any]:
        """The global state of a save, encoded now (a copy, ``codec.encode``): ``(global_doc,
        global_tensors, rank_doc, rank_tensors)``. The leader's global files hold the shared
        state (``capture_shared``) with its own RNG, extras and stateful objects' states
        (``providers/stateful.py``); another rank's files its own. Raises a TailorError for state
        that would need pickle."""
        own = {**self.capture_rank(), "extra": extra, **(stateful.captured() if stateful is not None else {})}
        rank, pipelined = self.coordinator.rank, self.stages.pipelined
        if self.coordinator.is_leader:
            stages = {"stages": self.stages.record()} if pipelined else {}
            return (*codec.encode({"step": step, **self.capture_shared(), **stages, **own}, where="global state"), None, None)
        if pipelined and self.stages.ranks_of(rank)[0] == rank:  # the leader of a stage: its optimizer and scheduler
            own["stage"] = self.capture_shared()
        return (None, None, *codec.encode(own, where=f"global state of rank {rank}"))

    def read_rank_state(self, run: Run, composite: Composite,
                        shared: dict[str, Any] | None = None) -> tuple[dict[str, Any], bool, list[str]]:
        """What ``restore_rank_state`` loads on this rank from ``composite``, read (no live state
        changed): ``(the saved state, whether it is this rank's own, what could not be mapped)``.
        At the saved world size, its own; at another, rank r takes saved rank r's where there is
        one; a rank beyond the saved world keeps its RNG streams and gets rank 0's extras and
        stateful objects' states; saved ranks beyond the current world are not used. ``shared``:
        the composite step's global state as ``check_composite`` returned it (saved rank 0's own
        state is taken from it, not read and decoded a second time). A restore reads it with the
        units, before the ranks agree that every read succeeded (``Tailor.restore``): every read of
        a restore is then under rank 0's lease on the composite (``share_manifests``), and a
        failed read of it fails every rank."""
        saved, world, rank = composite.manifest.world_size, self.coordinator.world_size, self.coordinator.rank
        unmapped: list[str] = []
        if world > saved:
            who = f"rank {saved} kept its" if world - saved == 1 else f"ranks {saved}..{world - 1} kept their"
            unmapped.append(f"{who} RNG streams and got rank 0's extras (saved at world size {saved})")
        elif world < saved:
            who = f"rank {world}" if saved - world == 1 else f"ranks {world}..{saved - 1}"
            unmapped.append(f"the RNG states and extras of saved {who} were not used (saved at world size {saved})")
        own = run.read_rank_state(composite.step, rank, shared) if rank < saved else None
        if own is None:  # its extras and stateful objects' states, not its RNG
            return run.read_rank_state(composite.step, 0, shared), False, unmapped
        return own, True, unmapped

    def restore_rank_state(self, read: tuple[dict[str, Any], bool, list[str]],
                           stateful: StatefulObjects | None = None) -> tuple[Any, tuple[str, ...]]:
        """This rank's RNG states, extras and stateful objects' states as ``read_rank_state`` read
        them (``read``): loads the RNG streams (its own state's only) and ``stateful``; returns the
        extras and what could not be mapped."""
        own, mine, unmapped = read
        unmapped = list(unmapped)
        if mine and not self.load_rank(own):
            unmapped.append("the snapshot holds no RNG state (imported from a checkpoint that keeps none): "
                            "RNG streams left as they were")
        if stateful is not None:
            unmapped += stateful.load(own)
        return own.get("extra"), tuple(unmapped)

    def load_rank(self, state: dict[str, Any]) -> bool:
        """Set this rank's own state (RNG streams) from what ``capture_rank`` saved; False when
        the snapshot holds none (an import from a format that keeps no RNG state)."""
        if state.get("rng", ...) is None:
            return False
        with loading("RNG state", None):
            rng.restore_rng(state["rng"])
        return True


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameter names are canonical: inside DDP (``module.``), torch.compile
    (``_orig_mod.``) and peft (``base_model.model.``) wrappers. Under peft the names are the
    base model's with the adapters' modules in place (``...q_proj.base_layer.weight``,
    ``...q_proj.lora_A.default.weight``), so the layout is the base model family's."""
    while True:
        inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
        inner = inner or getattr(model, "_orig_mod", None)
        if inner is None and is_peft(model):
            inner = model.get_base_model()
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def is_peft(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (adapters over a base model)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def peft_config(model: Any) -> dict[str, Any] | None:
    """The adapters' configs of a peft model as plain JSON, by adapter name (an export to
    peft's adapter format needs them), or None for another model."""
    while not is_peft(model):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return None
        model = inner
    return {name: json.loads(config.to_json_string()) if hasattr(config, "to_json_string")
            else json.loads(json.dumps(config.to_dict(), default=sorted))
            for name, config in model.peft_config.items()}


def hf_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The Hugging Face config of ``model`` as plain JSON (exports need it), or None."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return json.loads(to_json(use_diff=False)) if callable(to_json) else None


class ConfigRecord:
    """``hf_config`` of a model at every save, its JSON made again only when the config's
    attributes differ from those it was made from (a deep copy, compared): a transformers
    config's ``to_json_string`` cost ~1.7 ms of the training thread per save on the project's
    VM (issue 32, a save at every step). An attribute that does not compare (an array) makes it
    every time."""

    def __init__(self) -> None:
        self._made: tuple[Any, dict[str, Any], str] | None = None
        """The config, a deep copy of its attributes and the JSON made from them."""

    def __call__(self, model: torch.nn.Module) -> dict[str, Any] | None:
        config = getattr(model, "config", None)
        to_json = getattr(config, "to_json_string", None)
        if not callable(to_json):
            return None
        made = self._made
        try:
            same = made is not None and made[0] is config and bool(made[1] == vars(config))
        except Exception:  # noqa: BLE001 - an attribute that does not compare: made again
            same = False
        if not same:
            text = to_json(use_diff=False)
            try:
                self._made = (config, copy.deepcopy(vars(config)), text)
            except Exception:  # noqa: BLE001 - an attribute that does not copy: made again next time
                self._made = None
            return json.loads(text)
        return json.loads(made[2])


def saved_state_keys(run: Run, composite: Composite) -> dict[str, set[str]]:
    """The per-parameter optimizer state keys the units of ``composite`` hold (tensors and plain
    values), by parameter name, from their indexes alone."""
    keys: dict[str, set[str]] = {}
    for unit, step in composite.sources.items():
        entry = run.unit_entry(step, unit)
        for tensor in entry.tensors:
            kind, name, state_key = split_key(tensor.key)
            if kind == KIND_OPTIM and state_key is not None:
                keys.setdefault(name, set()).add(state_key)
        for name, values in entry.values.items():
            keys.setdefault(name, set()).update(values)
    return keys


def copy_into(live: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` into the live tensor in place, recording nothing for autograd. An
    inference-mode tensor (a module made under ``torch.inference_mode()``) takes an in-place
    change only in inference mode."""
    with torch.no_grad(), torch.inference_mode() if live.is_inference() else nullcontext():
        live.copy_(value)


@contextmanager
def loading(what: str, step: Any) -> Iterator[None]:
    """Turn torch's or Python's complaint about malformed saved state into an IntegrityError.

    The saved state passed its checksum, so a malformed value means a crafted or buggy
    snapshot; the live object's own loader is the judge of its shape."""
    try:
        yield
    except TailorError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError, RuntimeError) as err:
        where = f" in the snapshot of step {step}" if step is not None else ""
        raise IntegrityError(f"the {what}{where} is malformed ({type(err).__name__}: {err})") from None
