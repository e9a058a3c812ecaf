"""Export a composite's adapters as a peft adapter directory.

``PeftModel.from_pretrained(base_model, OUT)`` loads the result with no llmtailor code, the
adapters equal bit for bit to the composite's: the files are peft's own ``save_pretrained``
ones::

    OUT/adapter_config.json          the adapter's config as the run saved it (``peft_config``)
    OUT/adapter_model.safetensors    every adapter tensor, under peft's names (the adapter's
                                     own name left out: ``...q_proj.lora_A.weight``)
    OUT/<name>/...                   the same for each further adapter, as peft nests them

The run must have been saved from a ``PeftModel`` (its global state holds ``peft_config``).
Written through a sink (``PeftSink``; ``AdapterFiles`` also serves a peft model's Trainer
checkpoint): reads one unit at a time, keeps the adapters' tensors; the directory appears whole
or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError
from llmtailor.interop.hf.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from llmtailor.interop.tailored import composite_units
from llmtailor.layouts import Layout
from llmtailor.outputs.directory import publishing, write_text_durable
from llmtailor.outputs.sink import OutputUnit, Sink, counted
from llmtailor.store import Progress
from llmtailor.store.tensor_files import write_tensor_file
from llmtailor.store.keys import split_unit
from llmtailor.store.run import Run

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


def export_peft(run: Run, step: int | None, out_dir: str | Path, *, progress: Progress | None = None) -> Path:
    """Write the adapters of the composite of ``step`` (default: the newest) as a peft adapter
    directory ``out_dir`` (which must not exist, or be empty) and return it."""
    composite = run.resolve(step)
    state = run.read_global(composite.step)
    configs: dict[str, Any] | None = state.get("peft_config")
    if not configs:
        raise ConfigError(f"{run.root}: the snapshot of step {composite.step} was not saved from a peft model "
                          "(no adapter config): nothing to export as adapters")
    layout = Layout.from_record(composite.manifest.layout)
    sink = PeftSink(out_dir, configs, layout, origin=f"{run.root}: the composite of step {composite.step}")
    return sink.write(composite_units(run, composite.sources, layout), len(layout.units), progress)


class PeftSink(Sink):
    """A peft adapter directory ``out_dir`` (missing or empty) of the adapters ``configs``
    (``peft_config``) from the units of a peft model (module docstring); appears whole or not
    at all. ``origin`` names what is written in messages."""

    def __init__(self, out_dir: str | Path, configs: dict[str, Any], layout: Layout, *, origin: str):
        self.out, self.configs, self.layout, self.origin = Path(out_dir), configs, layout, origin

    def write(self, units: Iterable[OutputUnit], count: int, progress: Progress | None = None) -> Path:
        with publishing(self.out.parent, self.out.name, replace_empty=True) as tmp:
            files = AdapterFiles(tmp, self.configs, self.layout, self.origin)
            for unit in counted(units, count, progress):
                files.add(split_unit(unit.name, self.layout.units[unit.name], unit.tensors, unit.values)[0])
            files.finish()
        return self.out


class AdapterFiles:
    """The adapter files of a peft model's weights, gathered unit by unit (``add``) and written
    into ``folder`` (``finish``) as peft's ``save_pretrained`` lays them out: the default adapter
    at the top, others in subdirectories. A tied tensor is written under each of its names the
    adapter holds, as peft does (with ``ensure_weight_tying`` the embedding's and the head's
    trained copies are one tensor, and peft's load looks up both)."""

    def __init__(self, folder: Path, configs: dict[str, Any], layout: Layout, origin: str):
        self.folder, self.configs, self.origin = folder, configs, origin
        self._names_of: dict[str, list[str]] = {}
        for alias, canonical in layout.aliases.items():
            self._names_of.setdefault(canonical, [canonical]).append(alias)
        self._found: dict[str, dict[str, Any]] = {name: {} for name in configs}

    def add(self, weights: dict[str, Any]) -> None:
        """Take a unit's weights (by parameter name); keep those of an adapter."""
        for canonical, tensor in weights.items():
            for name in self._names_of.get(canonical, [canonical]):
                for adapter, found in self._found.items():
                    key = peft_name(name, adapter, self.configs[adapter])
                    if key is not None:
                        found[key] = tensor.contiguous()

    def finish(self) -> None:
        """Write every adapter's files; ConfigError (nothing written) for an adapter no unit holds."""
        empty = [name for name, found in self._found.items() if not found]
        if empty:
            raise ConfigError(f"{self.origin} holds no tensor of adapter(s) {empty}")
        for adapter, tensors in self._found.items():
            target = self.folder if adapter == "default" else self.folder / adapter
            target.mkdir(exist_ok=True)
            config = {**self.configs[adapter], "inference_mode": True}  # as peft's save_pretrained writes it
            write_text_durable(target / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
            write_tensor_file(target / ADAPTER_WEIGHTS, tensors, target, metadata={"format": "pt"})
