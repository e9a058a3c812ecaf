"""Import a DeepSpeed checkpoint (``engine.save_checkpoint``'s ``global_stepN/``) as a snapshot.

The result is one committed Full snapshot at DeepSpeed's ``global_steps``, written by the
store's own writer, with the units a ``DeepSpeedProvider`` writes: ``master/<name>`` (the fp32
master), ``optim/<name>/<key>`` (every optimizer state tensor) and ``optim/<name>/step`` (the
step of the parameter's group), plus buffers as ``weight/<name>``. So ``inspect``, ``verify``,
``assemble``, merge plans and restores (into an engine of any stage and world size, or into a
plain torch model) treat it like any snapshot.

How it is read — DeepSpeed's own readers, on an explicit import only (its files are pickles,
loaded with ``weights_only=False``; a restore never reads them):

- ``deepspeed.checkpoint.ds_to_universal`` turns the ZeRO-1/2/3 shards into one file per
  parameter and state (``zero/<name>/fp32.pt``, ``exp_avg.pt``, ...), in a scratch directory
  beside the run, removed afterwards (one temporary copy of the checkpoint, memory-mapped as it
  is read); a partly frozen model's frozen parameters (no master, no optimizer state, which the
  conversion leaves out) are read as ``zero_to_fp32`` reads them and kept as ``weight/<name>``,
  as a Tailor on that engine keeps them;
- the model-states file gives the global step, the LR scheduler's state, the parameter names by
  group in order (``param_shapes``), tied names (``shared_params``) and buffers, the engine's
  data-efficiency states (the curriculum sampler's position, random-LTD's scheduler: kept as a
  Tailor on that engine keeps them, ``providers.deepspeed.base.DATA_STATES``), and the user's
  ``client_state`` of ``save_checkpoint`` (every key the engine does not write itself), kept as
  the snapshot's extras, as ``Tailor.save(step, extra=...)`` keeps them, so ``restore()`` gives
  them back in its report's ``extra`` (a value llmtailor does not store, never pickled, is left
  out and named in the manifest's notes); the rank-0 optimizer-states file gives each group's
  hyperparameters and step.

The layout comes from a Hugging Face ``config.json`` when one is given or found beside the
checkpoint (an HF Trainer + DeepSpeed ``checkpoint-N/`` holds one); otherwise from the names
(``--family``, default: the name-based fallback). DeepSpeed saves no RNG state: the snapshot
holds none, and a restore leaves the RNG streams alone and says so. A Trainer + DeepSpeed
``checkpoint-N/`` also gives what Trainer keeps beside ``global_stepN/`` (``_trainer_files``):
``scheduler.pt`` (Trainer's LR scheduler is not DeepSpeed's, so the model states hold none),
``trainer_state.json`` and the RNG states: a one-process run's ``rng_state.pth``, or each
process's ``rng_state_<rank>.pth`` (their count must be DeepSpeed's world size): the snapshot
is then one of that world size, each rank's RNG its own, so a resume at that world size sets
each rank's streams as they were (TailorTrainer's, ``Tailor.restore``'s), and an HF export
writes each rank's file.

A merge reads a DeepSpeed checkpoint as a source (``DeepSpeedSource``) the same way, converted
once into the merge's scratch directory and read unit by unit from the conversion: the units
an import would write, never written as a run first (its state rank 0's, as a tailored run's of
several ranks is to a merge: a merge writes one process's snapshot).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtailor.constants import KIND_OPTIM
from llmtailor.errors import ConfigError, IncompatibleModelError, IntegrityError, UnsupportedStateError
from llmtailor.interop.deepspeed.files import find_step_dir
from llmtailor.interop.formats import describe_other_format
from llmtailor.interop.hf.files import CONFIG_FILE
from llmtailor.interop.hf.model import meta_model
from llmtailor.interop.source import Source, TensorInfo, refuse_a_run
from llmtailor.layouts import Layout, build_layout, layout_from_names
from llmtailor.outputs.directory import Scratch
from llmtailor.outputs.run import RunSink, refuse_holding_snapshots
from llmtailor.outputs.sink import OutputUnit
from llmtailor.store import Progress, codec, dtypes
from llmtailor.store.keys import master_key, optim_key, split_key, weight_key
from llmtailor.store.run import Run

@dataclass
class _Checkpoint:
    """What a DeepSpeed save directory holds, read from its model and optimizer files."""

    step_dir: Path
    step: int
    layout: Layout
    state: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    """The frozen parameters (no master, no optimizer state), whole (``_frozen_params``)."""
    group_of: dict[str, int]
    group_steps: list[Any]
    stage: int
    rank_states: list[dict[str, Any]]
    """The own states of ranks 1, 2, ... (a Trainer run of several processes: their RNG)."""
    not_kept: list[str]
    """The ``client_state`` values left out (``_client_state``), one line each."""


def import_deepspeed(
    checkpoint: str | Path,
    run_dir: str | Path,
    *,
    config: str | Path | None = None,
    family: str | None = None,
    progress: Progress | None = None,
) -> int:
    """Write the DeepSpeed checkpoint ``checkpoint`` into ``run_dir`` (new or without snapshots)
    as one committed snapshot and return its step (module docstring)."""
    refuse_a_run(Path(checkpoint), "deepspeed", "a DeepSpeed checkpoint")
    run = Run(run_dir)
    refuse_holding_snapshots(run)
    found = _read(Path(checkpoint), config, family)
    # Beside a local run (same filesystem); in the system's temporary directory for a URL.
    with Scratch(run.root if run.is_local else None, "deepspeed") as scratch:
        folder = _to_universal(found, scratch.get())
        sink = RunSink(run.storage, step=found.step, layout=found.layout.to_record(), state=found.state,
                       origin=f"imported from {found.step_dir}", provider="deepspeed",
                       notes={"imported_from": str(found.step_dir), "zero_stage": found.stage,
                              **({"client_state_not_kept": found.not_kept} if found.not_kept else {})},
                       rank_states=found.rank_states)
        sink.write((OutputUnit(unit, *_unit_tensors(found, folder, unit)) for unit in found.layout.units),
                   len(found.layout.units), progress)
    return found.step


class DeepSpeedSource(Source):
    """A DeepSpeed checkpoint as a merge source (module docstring): converted into ``scratch``
    when opened, each unit read from the conversion (memory-mapped) when first asked for."""

    kind = "DeepSpeed checkpoint"

    def __init__(self, label: str, path: Path, scratch: Path):
        self.label = label
        self._found = _read(path, None, None)
        self._folder = _to_universal(self._found, scratch)
        self.step, self.layout = self._found.step, self._found.layout
        self.config = self._found.state["model_config"]
        self._units: dict[str, tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]] = {}

    def _unit(self, unit: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        if unit not in self._units:
            self._units[unit] = _unit_tensors(self._found, self._folder, unit)
        return self._units[unit]

    def has_optimizer(self) -> bool:
        return True

    def tensors(self, unit: str, optimizer: bool) -> dict[str, TensorInfo]:
        return {key: TensorInfo(dtypes.name_of(t.dtype), tuple(t.shape), self.step) for key, t in self._unit(unit)[0].items()
                if optimizer or split_key(key)[0] != KIND_OPTIM}

    def read(self, unit: str, key: str) -> torch.Tensor:
        return self._unit(unit)[0][key]

    def values(self, unit: str) -> dict[str, dict[str, Any]]:
        return self._unit(unit)[1]

    def global_state(self, optimizer: bool = True) -> dict[str, Any]:
        return self._found.state


_WHAT_TO_GIVE = "give the folder engine.save_checkpoint wrote into, or its global_stepN/"


def _step_dir(checkpoint: Path) -> Path:
    """``find_step_dir``; a directory of another format named as what it is, with its way in."""
    try:
        return find_step_dir(checkpoint)
    except ConfigError as find_error:
        if not checkpoint.exists():
            raise ConfigError(f"{checkpoint}: no such checkpoint directory\n{_WHAT_TO_GIVE}") from None
        kind = describe_other_format(checkpoint) if checkpoint.is_dir() else None
        if kind is None:
            raise ConfigError(f"{find_error}\n{_WHAT_TO_GIVE}") from None
        raise ConfigError(f"{checkpoint} is {kind}; import-deepspeed reads a DeepSpeed checkpoint (global_stepN/)") from None


def _read(checkpoint: Path, config: str | Path | None, family: str | None) -> _Checkpoint:
    """The checkpoint's step, layout, global state and parameter groups, validated (nothing written)."""
    step_dir = _step_dir(checkpoint)
    model_states = _model_states(step_dir)
    step = model_states.get("global_steps")
    if not isinstance(step, int) or step < 0:
        raise IntegrityError(f"{step_dir}: the model states hold no global step ({step!r})")
    groups_shapes = model_states.get("param_shapes")
    if not isinstance(groups_shapes, list) or not groups_shapes:
        raise IntegrityError(f"{step_dir}: the model states hold no parameter names ('param_shapes')")
    names = [name for group in groups_shapes for name in group]
    shapes = {name: tuple(shape) for group in groups_shapes for name, shape in group.items()}
    aliases = {alias: target for alias, target in (model_states.get("shared_params") or {}).items() if target in shapes}
    buffers = {n: t for n, t in (model_states.get("module") or {}).items() if n in set(model_states.get("buffer_names") or [])}
    hyper, group_steps, stage = _optimizer_groups(step_dir)
    frozen = _frozen_params(step_dir, stage) if model_states.get("frozen_param_shapes") else {}
    shapes.update({name: tuple(tensor.shape) for name, tensor in frozen.items()})
    hf_config = _find_config(checkpoint, step_dir, config)
    layout = _layout(hf_config, [*names, *frozen, *buffers], aliases, family, step_dir)
    if len(hyper) != len(groups_shapes):
        raise IntegrityError(f"{step_dir}: {len(hyper)} optimizer groups but {len(groups_shapes)} groups of parameters")
    trainer = _trainer_files(step_dir, step, _world_size(model_states))
    rngs = trainer.get("rngs") or [None]
    client, not_kept = _client_state(model_states)
    data, data_not_kept = _data_states(model_states)
    extra = {**client, IMPORT_NOTES[0]: str(step_dir), **trainer.get("extra", {})}
    state = {
        "step": step,
        "optimizer_groups": [{**h, "params": list(g)} for h, g in zip(hyper, groups_shapes)],
        "lr_scheduler": model_states.get("lr_scheduler") or trainer.get("lr_scheduler"),
        "rng": rngs[0],
        "model_config": hf_config,
        "deepspeed": {"stage": stage, "steps": [None] * len(group_steps), "counters": _counters(model_states), **data},
        "extra": extra,
    }
    group_of = {name: i for i, group in enumerate(groups_shapes) for name in group}
    return _Checkpoint(step_dir, step, layout, state, shapes, buffers, frozen, group_of, group_steps, stage,
                       [{"rng": rng, "extra": extra} for rng in rngs[1:]], [*data_not_kept, *not_kept])


DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers", "autoep_layers", "folding",
})
"""The keys of a model-states file the engine writes itself (``DeepSpeedEngine._save_checkpoint``:
``_common_checkpoint_state``, the parallel and universal metadata, a MoE save's); every other key
is the ``client_state`` the user passed to ``save_checkpoint``."""


IMPORT_NOTES = ("imported_from", "trainer_state")
"""The extras an import adds beside the ``client_state``: where it came from, and a Trainer
checkpoint's ``trainer_state.json`` (``_trainer_files``)."""


def _client_state(model_states: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ``client_state`` of ``save_checkpoint`` (what ``engine.load_checkpoint`` gives back), the
    snapshot's extras as a Tailor's ``save(step, extra=...)`` keeps them, so ``restore()`` gives them
    back; and a line for each key whose value llmtailor does not store (never pickled: an
    ``argparse.Namespace``, say), left out."""
    return _storable({key: value for key, value in model_states.items() if key not in DEEPSPEED_KEYS}, "client_state[{!r}]")


def _data_states(model_states: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The engine's data-efficiency states the model states hold (``DATA_STATES``: the curriculum
    sampler's position and RNG, random-LTD's scheduler), kept in the global state as the provider
    keeps them, so a restore into an engine and ``assemble --format deepspeed`` give them back; a
    line for one llmtailor does not store, left out."""
    from llmtailor.providers.deepspeed.base import DATA_STATES

    return _storable({key: model_states[key] for key in DATA_STATES if model_states.get(key) is not None}, "{}")


def _storable(values: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """``values`` llmtailor stores (``codec``), and a line for each one it does not (never
    pickled), left out; ``where`` spells a key's name in that line."""
    kept, not_kept = {}, []
    for key, value in values.items():
        try:
            codec.encode(value, where=where.format(key))
        except UnsupportedStateError as err:
            not_kept.append(str(err).split(";")[0])
            continue
        kept[key] = value
    return kept, not_kept


def _counters(model_states: dict[str, Any]) -> dict[str, int]:
    """The engine's counters the model states hold (``ENGINE_COUNTERS``), as a restore sets them."""
    from llmtailor.providers.deepspeed.base import ENGINE_COUNTERS

    return {name: model_states[name] for name in ENGINE_COUNTERS if isinstance(model_states.get(name), int)}


# -- DeepSpeed's files ------------------------------------------------------------------------


def _load(path: Path, mmap: bool = False) -> Any:
    """A DeepSpeed pickle: the user's own file, read on an explicit import only (``mmap``: its
    tensors' bytes read when used)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as err:  # truncated, not a torch file, a class that no longer exists
        raise IntegrityError(f"{path}: cannot be loaded ({type(err).__name__}: {err})") from None


def _model_states(step_dir: Path) -> dict[str, Any]:
    files = sorted(step_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise IntegrityError(f"{step_dir}: no *model_states.pt file (not written by engine.save_checkpoint?)")
    states = _load(files[0])
    if not isinstance(states, dict):
        raise IntegrityError(f"{files[0]}: expected a dict, found {type(states).__name__}")
    return states


def _optimizer_groups(step_dir: Path) -> tuple[list[dict[str, Any]], list[Any], int]:
    """Hyperparameters of each group, its step, and the ZeRO stage (rank 0's optimizer file)."""
    files = sorted(step_dir.glob("*rank_0_*optim_states.pt")) or sorted(step_dir.glob("*optim_states.pt"))
    if not files:
        raise IntegrityError(f"{step_dir}: no *optim_states.pt file; a checkpoint without optimizer state cannot resume")
    saved = _load(files[0]).get("optimizer_state_dict", {})
    stage = int(saved.get("zero_stage", 3 if "fp32_flat_groups" in saved else 2))
    base = saved.get("base_optimizer_state") if stage < 3 else saved.get("optimizer_state_dict")
    if not isinstance(base, dict) or "param_groups" not in base:
        raise IntegrityError(f"{files[0]}: no base optimizer state with param groups")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
    states = base.get("state", {})
    steps = [states.get(i, {}).get("step") for i in range(len(hyper))]
    if isinstance(states, list):
        steps = [s.get("step") for s in states]
    return hyper, steps, stage


def _world_size(model_states: dict[str, Any]) -> int | None:
    """The number of processes that wrote the checkpoint (data x model parallel), where its model
    states say."""
    dp, mp = model_states.get("dp_world_size"), model_states.get("mp_world_size", 1)
    return dp * mp if isinstance(dp, int) and isinstance(mp, int) else None


def _trainer_files(step_dir: Path, step: int, world_size: int | None) -> dict[str, Any]:
    """What HF Trainer keeps beside ``global_stepN/`` when it saves under DeepSpeed (its
    ``checkpoint-N/``), which the DeepSpeed files lack: the LR scheduler (``scheduler.pt``, when
    DeepSpeed does not drive it), ``trainer_state.json`` (kept as ``extra["trainer_state"]``, as
    ``import-hf`` keeps it) and every process's RNG state by rank (``rngs``: ``rng_state.pth``,
    or ``rng_state_<rank>.pth`` of each of ``world_size`` processes). Empty for a plain
    ``engine.save_checkpoint`` directory."""
    from llmtailor.interop.hf.files import SCHEDULER_FILE, TRAINER_STATE_FILE, read_json, step_of
    from llmtailor.interop.hf.reader import rng_files, rng_state, torch_load

    folder = step_dir.parent
    if not (folder / TRAINER_STATE_FILE).is_file():
        return {}
    trainer_state = read_json(folder / TRAINER_STATE_FILE)
    trainer_step = step_of(folder, trainer_state)
    if trainer_step != step:
        raise IntegrityError(f"{folder / TRAINER_STATE_FILE}: global_step is {trainer_step}, but DeepSpeed's {step_dir.name} "
                             f"holds step {step}")
    found: dict[str, Any] = {"extra": {"trainer_state": trainer_state}}
    if (folder / SCHEDULER_FILE).is_file():
        found["lr_scheduler"] = torch_load(folder / SCHEDULER_FILE)
    rngs = rng_files(folder)
    if rngs and world_size is not None and len(rngs) != world_size:
        raise IntegrityError(f"{folder}: holds the RNG files of {len(rngs)} process(es) ({[p.name for p in rngs][:3]}), "
                             f"but DeepSpeed's {step_dir.name} was written by {world_size}")
    found["rngs"] = [rng_state(path) for path in rngs]
    return found


def _frozen_params(step_dir: Path, stage: int) -> dict[str, torch.Tensor]:
    """The frozen parameters (``frozen_param_shapes``: no master, no optimizer state, so
    ``ds_to_universal`` leaves them out), whole, as DeepSpeed's ``zero_to_fp32`` reads them:
    rank 0's fragments (ZeRO-1/2: whole tensors), or every rank's ZeRO-3 partitions joined."""
    from deepspeed.utils import zero_to_fp32

    merged: dict[str, torch.Tensor] = {}
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise):
            files = zero_to_fp32.get_model_state_files(str(step_dir))
            states = zero_to_fp32.parse_model_states(files)
            if stage == 3:
                zero_to_fp32._zero3_merge_frozen_params(merged, len(files), states)
            else:
                zero_to_fp32._zero2_merge_frozen_params(merged, states)
    except Exception as err:  # DeepSpeed's reader refusing the checkpoint
        raise IntegrityError(f"{step_dir}: DeepSpeed's zero_to_fp32 cannot read its frozen parameters "
                             f"({type(err).__name__}: {err})") from None
    return merged


def _to_universal(found: _Checkpoint, scratch: Path) -> Path:
    """Convert the checkpoint with DeepSpeed's ``ds_to_universal`` into ``scratch``; return the
    folder of its per-parameter files."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = Path(tempfile.mkdtemp(prefix="deepspeed-", dir=scratch)) / "universal"  # one per checkpoint
    args = argparse.Namespace(input_folder=str(found.step_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=found.stage < 3)
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
            ds_to_universal(args)
    except Exception as err:  # DeepSpeed's reader refusing the checkpoint
        raise IntegrityError(f"{found.step_dir}: DeepSpeed's ds_to_universal cannot read it ({type(err).__name__}: {err})") from None
    return out / "zero"


def _find_config(checkpoint: Path, step_dir: Path, config: str | Path | None) -> dict[str, Any] | None:
    candidates = [Path(config)] if config is not None else [step_dir.parent / CONFIG_FILE, checkpoint / CONFIG_FILE]
    for path in candidates:
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise ConfigError(f"{path}: not readable JSON ({err})") from None
    if config is not None:
        raise ConfigError(f"{config}: no such config file")
    return None


def _layout(config: dict[str, Any] | None, names: list[str], aliases: dict[str, str], family: str | None, where: Path) -> Layout:
    if config is not None:
        layout = build_layout(meta_model(config), family)
        missing = sorted(set(layout.tensor_names()) - set(names))
        extra = sorted(set(names) - set(layout.tensor_names()) - set(layout.aliases))
        if missing or extra:
            raise IncompatibleModelError(
                f"{where} does not fit its model config: lacks {missing[:3]}, has {extra[:3]} that the config's model lacks"
            )
        return layout
    return layout_from_names(names, family or "generic", aliases)


def _universal_tensor(folder: Path, name: str, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    path = folder / name / f"{key}.pt"
    if not path.is_file():
        return None
    loaded = _load(path, mmap=True)
    tensor = loaded.get("param") if isinstance(loaded, dict) else loaded
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != torch.Size(shape).numel():
        raise IntegrityError(f"{path}: expected a tensor of {list(shape)} elements")
    return tensor.reshape(shape).contiguous()


def _unit_tensors(found: _Checkpoint, folder: Path, unit: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The tensors (by unit key) and non-tensor optimizer values of ``unit``, read from the
    universal checkpoint's per-parameter files in ``folder``: the unit an import writes."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    for name in found.layout.units[unit]:
        if name in found.buffers or name in found.frozen:
            tensors[weight_key(name)] = (found.buffers.get(name, found.frozen.get(name))).detach().contiguous()
            continue
        master = _universal_tensor(folder, name, "fp32", found.shapes[name])
        if master is None:
            raise IntegrityError(f"{folder}: DeepSpeed's conversion holds no fp32 master of {name!r}")
        tensors[master_key(name)] = master
        for path in sorted((folder / name).glob("*.pt")):
            key = path.stem
            if key in ("fp32", "step"):
                continue
            state = _universal_tensor(folder, name, key, found.shapes[name])
            if state is not None:
                tensors[optim_key(name, key)] = state
        step = found.group_steps[found.group_of[name]]
        if isinstance(step, torch.Tensor):
            tensors[optim_key(name, "step")] = step.detach().clone().float().reshape(())
        elif step is not None:
            values.setdefault(name, {})["step"] = codec.plain_value(step, f"optimizer step of {name}")
    return tensors, values
