"""Export a composite's adapters as a peft adapter directory.

``PeftModel.from_pretrained(base_model, OUT)`` loads the result with no llmtailor code, the
adapters equal bit for bit to the composite's: the files are peft's own ``save_pretrained``
ones::

    OUT/adapter_config.json          the adapter's config as the run saved it (``peft_config``)
    OUT/adapter_model.safetensors    every adapter tensor, under peft's names (the adapter's
                                     own name left out: ``...q_proj.lora_A.weight``)
    OUT/<name>/...                   the same for each further adapter, as peft nests them

The run must have been saved from a ``PeftModel`` (its global state holds ``peft_config``).
Reads one unit at a time; the directory appears whole or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError
from llmtailor.layouts import Layout
from llmtailor.store.catalog import Composite
from llmtailor.store.files import write_text_durable
from llmtailor.store.tensor_files import write_tensor_file
from llmtailor.store.publish import publishing
from llmtailor.store.keys import split_unit
from llmtailor.store.run import Run

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


DORA_MAGNITUDE = "lora_magnitude_vector"
"""DoRA's magnitude module: its parameter ``X.lora_magnitude_vector.<adapter>.weight`` is saved
as ``X.lora_magnitude_vector`` (peft's LoRA tuner keeps the key of the days it was a parameter)."""


def peft_name(name: str, adapter: str, config: dict[str, Any]) -> str | None:
    """peft's file name of the model's parameter ``name`` if it belongs to ``adapter`` (whose
    saved ``config``: ``peft_config[adapter]``), else None; the names
    ``get_peft_model_state_dict`` gives and ``set_peft_model_state_dict`` reads:

    - a module trained whole (``modules_to_save``) is held as ``X.original_module.*`` (the
      base's, frozen: not the adapter's) and ``X.modules_to_save.<adapter>.*`` (the trained
      copy), saved as ``X.*``, the module's own names;
    - an adapter's own tensor holds the adapter's name as its last or next to last part
      (``q_proj.lora_A.<adapter>.weight``, ``k_proj.ia3_l.<adapter>``) and is saved without it;
    - under DoRA (a LoRA config with ``use_dora``), ``X.lora_magnitude_vector.<adapter>.weight``
      is saved without its ``.weight`` too: ``X.lora_magnitude_vector``.
    """
    trained_copy = f".modules_to_save.{adapter}."
    if trained_copy in name:
        return PEFT_PREFIX + name.replace(trained_copy, ".", 1)
    if config.get("use_dora") and name.endswith(f".{DORA_MAGNITUDE}.{adapter}.weight"):
        name = name.removesuffix(".weight")
    parts = name.split(".")
    if len(parts) > 1 and parts[-1] == adapter:
        return PEFT_PREFIX + ".".join(parts[:-1])
    if len(parts) > 2 and parts[-2] == adapter:
        return PEFT_PREFIX + ".".join(parts[:-2] + parts[-1:])
    return None


def export_peft(run: Run, step: int | None, out_dir: str | Path) -> Path:
    """Write the adapters of the composite of ``step`` (default: the newest) as a peft adapter
    directory ``out_dir`` (which must not exist, or be empty) and return it."""
    out_dir = Path(out_dir)
    composite = run.resolve(step)
    state = run.read_global(composite.step)
    configs: dict[str, Any] | None = state.get("peft_config")
    if not configs:
        raise ConfigError(f"{run.root}: the snapshot of step {composite.step} was not saved from a peft model "
                          "(no adapter config): nothing to export as adapters")
    with publishing(out_dir.parent, out_dir.name, replace_empty=True) as tmp:
        write_adapters(run, composite, configs, tmp)
    return out_dir


def write_adapters(run: Run, composite: Composite, configs: dict[str, Any], where: Path) -> None:
    """The adapter files of ``composite`` into the directory ``where``, as peft's
    ``save_pretrained`` lays them out (the default adapter at the top, others in subdirectories).
    A tied tensor is written under each of its names the adapter holds, as peft does (with
    ``ensure_weight_tying`` the embedding's and the head's trained copies are one tensor, and
    peft's load looks up both)."""
    layout = Layout.from_record(composite.manifest.layout)
    names_of: dict[str, list[str]] = {}
    for alias, canonical in layout.aliases.items():
        names_of.setdefault(canonical, [canonical]).append(alias)
    adapters: dict[str, dict[str, Any]] = {name: {} for name in configs}
    for unit in layout.units:
        weights, _ = split_unit(unit, layout.units[unit], *run.read_unit(composite.sources[unit], unit))
        for canonical, tensor in weights.items():
            for name in names_of.get(canonical, [canonical]):
                for adapter, found in adapters.items():
                    key = peft_name(name, adapter, configs[adapter])
                    if key is not None:
                        found[key] = tensor.contiguous()
    empty = [name for name, found in adapters.items() if not found]
    if empty:
        raise ConfigError(f"{run.root}: the composite of step {composite.step} holds no tensor of adapter(s) {empty}")
    for adapter, tensors in adapters.items():
        target = where if adapter == "default" else where / adapter
        target.mkdir(exist_ok=True)
        config = {**configs[adapter], "inference_mode": True}  # as peft's save_pretrained writes it
        write_text_durable(target / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_tensor_file(target / ADAPTER_WEIGHTS, tensors, target, metadata={"format": "pt"})
