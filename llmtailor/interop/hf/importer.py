"""Import a plain Hugging Face Trainer ``checkpoint-N/`` directory as a tailored snapshot.

The result is one committed Full snapshot at step N (``trainer_state.json``'s ``global_step``)
in a new or empty run directory, written by the store's own writer, so ``inspect``, ``verify``,
``assemble --format hf`` and restores treat it like any snapshot ``Tailor`` saved.

What is read, and how::

    config.json              the model is rebuilt from it on the meta device (no weights, no memory)
    model.safetensors        (or model.safetensors.index.json + shards) headers first; bytes one
                             unit at a time while writing
    pytorch_model.bin        where there are no safetensors (or pytorch_model.bin.index.json +
                             shards: Trainer's save_safetensors=False, transformers 4):
                             torch.load(weights_only=True), memory-mapped
    optimizer.pt             torch.load(weights_only=True); indices mapped to parameter names by
                             position in the two groups vanilla Trainer builds (decay, no-decay)
    scheduler.pt             torch.load(weights_only=True); required beside optimizer.pt (Trainer
                             loads them only as a pair)
    rng_state.pth            required: every llmtailor snapshot carries RNG state, and restores
                             and HF exports both set it; Trainer always writes it single-process;
                             under DDP it writes rng_state_<rank>.pth per process instead: the
                             snapshot is then one of that world size, each rank's RNG its own
                             (a restore sets each rank's, an HF export writes each rank's file)
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

from llmtailor.errors import ConfigError, TailorError
from llmtailor.interop.hf.files import CONFIG_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, TRAINER_STATE_FILE, read_json, step_of
from llmtailor.interop.hf.model import meta_model, trainer_param_groups
from llmtailor.interop.hf.reader import (
    map_optimizer, plain_values, require_importable, rng_files, rng_state, torch_load, weight_sources,
)
from llmtailor.interop.hf.weights import BinWeights, ModelWeights, model_weights
from llmtailor.layouts import Layout, build_layout
from llmtailor.outputs.run import RunSink, refuse_holding_snapshots
from llmtailor.outputs.sink import OutputUnit
from llmtailor.store import Progress
from llmtailor.store.tensor_files import ByteSource
from llmtailor.store.keys import optim_key, weight_key
from llmtailor.store.run import Run

"""Called after each unit: ``(unit, units done, units in all)``."""

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
    require_importable(source)
    config = read_json(source / CONFIG_FILE)
    trainer_state = read_json(source / TRAINER_STATE_FILE)
    step = step_of(source, trainer_state)
    refuse_holding_snapshots(run)
    try:
        model = meta_model(config)
    except TailorError:
        raise
    except Exception as err:  # transformers' own config validation
        raise ConfigError(f"{source / CONFIG_FILE}: transformers cannot build a model from it ({err})") from None
    layout = build_layout(model)
    weights = model_weights(source)
    names = weight_sources(weights, model, layout)
    optimizer = torch_load(source / OPTIMIZER_FILE)
    groups, per_param = map_optimizer(source / OPTIMIZER_FILE, optimizer, trainer_param_groups(config), model)
    rngs = [rng_state(path) for path in rng_files(source)]
    extra = {"trainer_state": trainer_state}
    state = {
        "step": step,
        "optimizer_groups": groups,
        "lr_scheduler": torch_load(source / SCHEDULER_FILE),
        "rng": rngs[0],
        "model_config": config,
        "extra": extra,
    }
    # Non-tensor optimizer values go into the indexes as JSON: encoded now, so a value that
    # needs pickle is refused before anything is written.
    values = {name: plain_values(name, entries) for name, entries in per_param.items()}
    sink = RunSink(run.storage, step=step, layout=layout.to_record(), state=state, origin=f"imported from {source}",
                   rank_states=[{"rng": rng, "extra": extra} for rng in rngs[1:]])
    sink.write(_stream_units(layout, weights, names, per_param, values), len(layout.units), progress)
    return step


# -- Streaming -----------------------------------------------------------------------------


def _stream_units(
    layout: Layout,
    weights: ModelWeights | BinWeights,
    names: dict[str, str],
    per_param: dict[str, dict[str, Any]],
    values: dict[str, dict[str, Any]],
) -> Iterator[OutputUnit]:
    """One unit at a time: its weights' bytes copied from the checkpoint's files as they are
    (``names``: canonical name -> name in the files; from pytorch_model.bin, the loaded tensors),
    its optimizer state from optimizer.pt."""
    for unit, unit_names in layout.units.items():
        tensors: dict[str, torch.Tensor | ByteSource] = {}
        unit_values: dict[str, dict[str, Any]] = {}
        for name in unit_names:
            tensors[weight_key(name)] = weights.read(names[name])
            for state_key, value in per_param.get(name, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[optim_key(name, state_key)] = value
            if values.get(name):
                unit_values[name] = values[name]
        yield OutputUnit(unit, tensors, unit_values)
