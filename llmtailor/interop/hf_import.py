"""Import a plain Hugging Face Trainer ``checkpoint-N/`` directory as a tailored snapshot.

The result is one committed Full snapshot at step N (``trainer_state.json``'s ``global_step``)
in a new or empty run directory, written by the store's own writer, so ``inspect``, ``verify``,
``assemble --format hf`` and restores treat it like any snapshot ``Tailor`` saved.

What is read, and how::

    config.json              the model is rebuilt from it on the meta device (no weights, no memory)
    model.safetensors        (or model.safetensors.index.json + shards) headers first; bytes one
                             unit at a time while writing
    optimizer.pt             torch.load(weights_only=True); indices mapped to parameter names by
                             position in the two groups vanilla Trainer builds (decay, no-decay)
    scheduler.pt             torch.load(weights_only=True); required beside optimizer.pt (Trainer
                             loads them only as a pair)
    rng_state.pth            required: every llmtailor snapshot carries RNG state, and restores
                             and HF exports both set it; Trainer always writes it single-process
    trainer_state.json       kept whole as ``extra["trainer_state"]``

Not read: ``training_args.bin`` (a pickled TrainingArguments; loading it would unpickle code),
tokenizer files and ``generation_config.json`` (the export recreates the latter from the config).

Invariants: everything is validated before the run directory is touched (file set, JSON, model
names / shapes / dtypes against the config's model, optimizer groups, counts and state shapes),
so bad input leaves nothing written; optimizer state lands on a parameter only when the groups
match Trainer's exactly — anything else makes the position -> name mapping ambiguous and is
refused. optimizer.pt is one pickle, so it is in memory whole; weights are read per unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llmtailor.errors import ConfigError, IncompatibleModelError, IntegrityError, TailorError
from llmtailor.interop.checkpoint_dirs import TRAINER_STATE_FILE, read_json, step_of
from llmtailor.interop.hf_export import (
    CONFIG_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    WEIGHTS_FILE,
    Progress,
    meta_model,
    trainer_param_groups,
)
from llmtailor.layouts import Layout, build_layout
from llmtailor.store import codec, dtypes
from llmtailor.store.codec import plain_value
from llmtailor.store.keys import optim_key, weight_key
from llmtailor.store.lock import WriterLock
from llmtailor.store.run import Run
from llmtailor.store.staged import StagedSnapshot, StagedUnit
from llmtailor.store.writer import counting, persist

WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

def import_hf(checkpoint_dir: str | Path, run_dir: str | Path, *, progress: Progress | None = None) -> int:
    """Write the Trainer checkpoint ``checkpoint_dir`` into ``run_dir`` as one committed Full
    snapshot and return its step.

    ``run_dir`` must hold no committed snapshot yet (it is created if missing). Raises
    TailorError naming the file, key or parameter at fault, with nothing written, when a file
    is missing or unreadable, the weights do not fit the config's model, or optimizer.pt's
    groups are not the ones vanilla Trainer builds. ``progress(unit, done, total)`` is called
    after each unit is written."""
    source = Path(checkpoint_dir)
    run = Run(run_dir)
    _require_files(source)
    config = read_json(source / CONFIG_FILE)
    trainer_state = read_json(source / TRAINER_STATE_FILE)
    step = step_of(source, trainer_state)
    if run.steps():
        raise ConfigError(
            f"{run.root} already holds snapshots (steps {run.steps()}); import into a new or empty run directory"
        )

    try:
        model = meta_model(config)
    except TailorError:
        raise
    except Exception as err:  # transformers' own config validation
        raise ConfigError(f"{source / CONFIG_FILE}: transformers cannot build a model from it ({err})") from None
    layout = build_layout(model)
    weight_files = weight_sources(source, model, layout)

    optimizer = torch_load(source / OPTIMIZER_FILE)
    groups, per_param = map_optimizer(source / OPTIMIZER_FILE, optimizer, trainer_param_groups(config), model)
    state = {
        "step": step,
        "optimizer_groups": groups,
        "lr_scheduler": torch_load(source / SCHEDULER_FILE),
        "rng": rng_state(source / RNG_FILE),
        "model_config": config,
        "extra": {"trainer_state": trainer_state},
    }
    global_doc, global_tensors = codec.encode(state, where="global state")
    # Non-tensor optimizer values go into the manifest as JSON: encode them now, so a value
    # that needs pickle is refused before anything is written.
    values = {name: plain_values(name, entries) for name, entries in per_param.items()}

    staged = StagedSnapshot(
        step=step,
        parent=None,
        save_index=0,
        policy=f"imported from {source}",
        layout=layout.to_record(),
        # persist only iterates over `units`: a generator reads each unit's bytes just before
        # writing them, so one unit of weights is in memory at a time.
        units=_stream_units(layout, weight_files, per_param, values),
        composite={unit: step for unit in layout.units},
        global_doc=global_doc,
        global_tensors=global_tensors,
    )
    lock = WriterLock(run.root)
    lock.acquire()
    try:
        if run.steps():  # written meanwhile, before we held the lock
            raise ConfigError(f"{run.root} already holds snapshots (steps {run.steps()}); import into a new one")
        persist(run, staged, on_unit=counting(progress, len(layout.units)))
    finally:
        lock.release()
    return step


# -- Validation ----------------------------------------------------------------------------


def _require_files(source: Path) -> None:
    if not source.is_dir():
        raise ConfigError(f"{source}: no such checkpoint directory")
    problems = [f"{name} is missing" for name in (CONFIG_FILE, TRAINER_STATE_FILE) if not (source / name).is_file()]
    if not (source / WEIGHTS_FILE).is_file() and not (source / WEIGHTS_INDEX_FILE).is_file():
        problems.append(f"{WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE}) is missing")
    have_optimizer, have_scheduler = (source / OPTIMIZER_FILE).is_file(), (source / SCHEDULER_FILE).is_file()
    if have_optimizer != have_scheduler:
        present, absent = (OPTIMIZER_FILE, SCHEDULER_FILE) if have_optimizer else (SCHEDULER_FILE, OPTIMIZER_FILE)
        problems.append(f"{absent} is missing beside {present} (Trainer loads them only as a pair)")
    elif not have_optimizer:
        problems.append(f"{OPTIMIZER_FILE} and {SCHEDULER_FILE} are missing (a weights-only checkpoint cannot resume)")
    if not (source / RNG_FILE).is_file():
        ranked = sorted(p.name for p in source.glob("rng_state_*.pth"))
        why = f"; found {ranked}: multi-process checkpoints are not supported yet" if ranked else ""
        problems.append(f"{RNG_FILE} is missing (llmtailor snapshots always carry RNG state){why}")
    if problems:
        raise IntegrityError(f"{source}: not an importable Trainer checkpoint: " + "; ".join(problems))


def weight_sources(source: Path, model: torch.nn.Module, layout: Layout) -> dict[str, tuple[Path, str]]:
    """Canonical tensor name -> (file, key in it), from safetensors headers only. Every tensor
    of the file must be one of the model's, with its shape and dtype; a tied alias may stand
    in for its canonical name (save_pretrained writes one of them)."""
    from safetensors import safe_open

    index = source / WEIGHTS_INDEX_FILE
    if (source / WEIGHTS_FILE).is_file():
        files = [source / WEIGHTS_FILE]
    else:
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise IntegrityError(f"{index}: key 'weight_map' is missing or empty")
        files = [source / name for name in sorted(set(map(str, weight_map.values())))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise IntegrityError(f"{index}: names shard files that are missing: {absent[:3]}")

    expected = model.state_dict(keep_vars=True)
    found: dict[str, tuple[Path, str]] = {}
    problems: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                slices = {key: handle.get_slice(key) for key in handle.keys()}  # headers only, no bytes
                header = {key: (piece.get_shape(), piece.get_dtype()) for key, piece in slices.items()}
        except Exception as err:  # safetensors raises its own error types for a damaged header
            raise IntegrityError(f"{path}: not a readable safetensors file ({err})") from None
        for key, (shape, dtype) in header.items():
            want = expected.get(key)
            if want is None:
                problems.append(f"{key!r} is not a tensor of the {layout.family!r} model config.json describes")
                continue
            if list(shape) != list(want.shape) or dtypes.from_code(dtype) != dtypes.name_of(want.dtype):
                problems.append(f"{key!r} is {dtype} {list(shape)}, the model has {want.dtype} {list(want.shape)}")
            canonical = layout.aliases.get(key, key)
            if canonical not in found or key == canonical:
                found[canonical] = (path, key)
    missing = [name for name in layout.tensor_names() if name not in found]
    problems += [f"{name!r} is missing" for name in missing[:5]]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; ... ({len(problems)} in all)" if len(problems) > 6 else "")
        where = files[0] if len(files) == 1 else index
        raise IncompatibleModelError(f"{where} does not fit the model of {source / CONFIG_FILE}: {shown}")
    return found


def torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refusals, truncation, not a torch file at all
        raise IntegrityError(f"{path}: cannot be loaded with torch.load(weights_only=True) ({err})") from None


def map_optimizer(
    path: Path, saved: Any, expected: list[list[str]], model: torch.nn.Module
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Param group records with names, and per-parameter state by name. optimizer.pt numbers
    parameters by position; only Trainer's own grouping tells which position is which, so the
    saved groups must have exactly its group count and sizes, and every state tensor the shape
    of the parameter it then lands on."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) or not isinstance(
        saved.get("state"), dict
    ):
        raise IntegrityError(f"{path}: expected an Optimizer.state_dict() with 'state' and 'param_groups'")
    ambiguous = (
        "so the mapping of its indices to parameters is ambiguous; import reads checkpoints of vanilla Trainer's "
        "AdamW-style optimizer with its 2 groups (weight decay for every trainable parameter except biases and "
        "norm weights, then the rest)"
    )
    sizes = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in saved["param_groups"]]
    if sizes != [len(names) for names in expected]:
        raise IncompatibleModelError(
            f"{path}: 'param_groups' has {len(sizes)} group(s) of {sizes} parameters, vanilla Trainer builds "
            f"{len(expected)} of {[len(n) for n in expected]} for the model of {CONFIG_FILE}; {ambiguous}"
        )
    name_of: dict[Any, str] = {}
    groups: list[dict[str, Any]] = []
    for number, (group, names) in enumerate(zip(saved["param_groups"], expected)):
        for position, (index, name) in enumerate(zip(group["params"], names)):
            if index in name_of:
                raise IntegrityError(
                    f"{path}: param_groups[{number}].params[{position}] repeats index {index!r} ({name_of[index]!r})"
                )
            name_of[index] = name
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(names)})

    params = dict(model.named_parameters())
    per_param: dict[str, dict[str, Any]] = {}
    for index, entries in saved["state"].items():
        name = name_of.get(index)
        if name is None:
            raise IntegrityError(f"{path}: 'state' has index {index!r}, which no param group lists")
        if not isinstance(entries, dict):
            raise IntegrityError(f"{path}: state[{index!r}] ({name!r}) is a {type(entries).__name__}, expected a dict")
        shape = list(params[name].shape)
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and list(value.shape) != shape:
                raise IncompatibleModelError(
                    f"{path}: state[{index}][{key!r}] is {list(value.shape)}, but index {index} is {name!r} of "
                    f"shape {shape} under Trainer's grouping; the optimizer state does not fit the model "
                    f"(state tensors must be scalars or of their parameter's shape), {ambiguous}"
                )
        per_param[name] = dict(entries)
    return groups, per_param


def plain_values(name: str, entries: dict[str, Any]) -> dict[str, Any]:
    return {
        key: plain_value(value, f"{OPTIMIZER_FILE} state of {name}.{key}")
        for key, value in entries.items()
        if not isinstance(value, torch.Tensor)
    }


def rng_state(path: Path) -> dict[str, Any]:
    """Trainer's ``_save_rng_state`` record in llmtailor's format (``llmtailor.providers.rng``)."""
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # numpy's RNG tuple, as Trainer's own _load_rng_state allows
        saved = torch_load(path)
    if not isinstance(saved, dict) or not {"python", "numpy", "cpu"} <= saved.keys():
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise IntegrityError(f"{path}: expected keys 'python', 'numpy' and 'cpu', found {keys}")
    rng = {"python": saved["python"], "numpy": saved["numpy"], "torch": saved["cpu"]}
    if saved.get("cuda") is not None:
        cuda = saved["cuda"]
        # Single-process Trainer saves one device's state; llmtailor keeps a list of all devices.
        rng["cuda"] = list(cuda) if isinstance(cuda, (list, tuple)) else [cuda]
    # Other accelerators' states (xpu, npu, mps, ...) are kept under their own keys; neither
    # restore nor the HF export sets them today.
    rng.update({k: v for k, v in saved.items() if k not in ("python", "numpy", "cpu", "cuda")})
    return rng


# -- Streaming -----------------------------------------------------------------------------


def _stream_units(
    layout: Layout,
    weight_files: dict[str, tuple[Path, str]],
    per_param: dict[str, dict[str, Any]],
    values: dict[str, dict[str, Any]],
) -> Iterator[StagedUnit]:
    from safetensors import safe_open

    handles: dict[Path, Any] = {}  # safe_open maps a file; a shard is opened once
    for unit, names in layout.units.items():
        tensors: dict[str, torch.Tensor] = {}
        unit_values: dict[str, dict[str, Any]] = {}
        for name in names:
            path, key = weight_files[name]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            tensors[weight_key(name)] = handles[path].get_tensor(key)
            for state_key, value in per_param.get(name, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[optim_key(name, state_key)] = value
            if values.get(name):
                unit_values[name] = values[name]
        yield StagedUnit.whole(unit, tensors, unit_values)
