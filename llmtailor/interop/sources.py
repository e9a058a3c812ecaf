"""Which kind of checkpoint a path is, and the lazy ``Source`` that reads it.

Kinds are tried in this order:

- a tailored run (``snapshots/`` with at least one committed step): ``RunSource``, its
  composite at a step (``interop/tailored.py``);
- a DeepSpeed checkpoint (``global_stepN/`` with ``*optim_states.pt``, perhaps named by
  ``latest``): ``DeepSpeedSource``, converted with DeepSpeed's own converter (one temporary
  copy, in ``scratch``) and read from the conversion unit by unit;
- a Hugging Face Trainer ``checkpoint-N/`` (``config.json`` and ``trainer_state.json``):
  ``CheckpointSource``;
- a ``save_pretrained`` model directory (``config.json``): ``ModelDirSource``.

Only names are looked at here; nothing heavy (torch, DeepSpeed) is imported until a source
needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmtailor.errors import ConfigError
from llmtailor.interop.deepspeed.files import is_deepspeed_checkpoint
from llmtailor.interop.formats import describe_other_format
from llmtailor.interop.hf.files import ADAPTER_CONFIG, CONFIG_FILE, PEFT_ADVICE, TRAINER_STATE_FILE, hub_id_hint
from llmtailor.interop.hf.reader import CheckpointSource, ModelDirSource
from llmtailor.interop.source import Source
from llmtailor.interop.tailored import RunSource
from llmtailor.store.run import Run

if TYPE_CHECKING:
    from llmtailor.outputs.directory import Scratch


def open_source(label: str, path: Path | str, step: int | None, scratch: Scratch) -> Source:
    """The source at ``path`` (kinds tried in the module docstring's order); ``step`` names a
    step of a tailored run (None: its newest). A URL names a tailored run on an object store.
    ``scratch`` is made only for a source that needs a copy."""
    if not isinstance(path, Path):  # a URL
        run = Run(path)
        if not run.steps():
            raise ConfigError(run.storage.detection.describe_non_run() or f"{path}: no committed snapshot in this run")
        return RunSource(label, run, step)
    if path.is_dir() and Run(path).steps():
        return RunSource(label, Run(path), step)
    if not path.is_dir():
        kind = describe_other_format(path) if path.is_file() else None
        if kind:
            raise ConfigError(f"{path} is {kind}")
        if "+" in label and not path.exists():
            raise ConfigError(f"{path}: no such directory; mergekit's MODEL+LORA form (an adapter applied to a model) is "
                              "not supported: merge the adapter into its model first (peft's merge_and_unload, then "
                              "save_pretrained) and name that directory")
        raise ConfigError(f"{path}: no such directory{hub_id_hint(label, path)}")
    if step is not None:
        raise ConfigError(f"{path} is a checkpoint directory: @STEP names a step of a tailored run only")
    if is_deepspeed_checkpoint(path):
        from llmtailor.interop.deepspeed.importer import DeepSpeedSource

        return DeepSpeedSource(label, path, scratch.get())
    if (path / CONFIG_FILE).is_file() and (path / TRAINER_STATE_FILE).is_file():
        return CheckpointSource(label, path)
    if (path / CONFIG_FILE).is_file():
        return ModelDirSource(label, path)
    if (path / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{path} is a peft adapter ({ADAPTER_CONFIG}), not a model: {PEFT_ADVICE}")
    kind = describe_other_format(path)
    if kind:
        raise ConfigError(f"{path} is {kind}")
    raise ConfigError(
        f"{path} is not a tailored run, a model directory (config.json + model.safetensors), a Trainer "
        "checkpoint-N/ or a DeepSpeed checkpoint"
    )
