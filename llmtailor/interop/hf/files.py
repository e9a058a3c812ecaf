"""Hugging Face's file names, and reading a Trainer ``checkpoint-N/`` or ``save_pretrained``
directory's JSON files: torch-free, so a merge that only moves bytes never imports torch
(``store/dtypes.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmtailor.errors import IntegrityError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pth"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja",
)
CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
TAILOR_TRAINER_RUN = "tailored"
"""Where llmtailor's TailorTrainer keeps its run in Trainer's ``output_dir``."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A peft adapter's files (``save_pretrained`` of a ``PeftModel``; Trainer's checkpoint of one)."""
PEFT_ADVICE = ("merges and imports read whole models; merge the adapter into its base model first (peft's "
               "merge_and_unload, then save_pretrained) and name that directory")
"""What to do with a peft adapter where a whole model is read (a merge source, ``import-hf``)."""


RANK_RNG_PREFIX, RANK_RNG_SUFFIX = "rng_state_", ".pth"


def rank_rng_file(rank: int | str) -> str:
    """The RNG file of process ``rank`` of a Trainer run of several processes (one process's is
    ``RNG_FILE``); ``rank_rng_file("*")`` is their glob pattern."""
    return f"{RANK_RNG_PREFIX}{rank}{RANK_RNG_SUFFIX}"


def rank_of_rng_file(name: str) -> int | None:
    """The rank whose RNG file (``rank_rng_file``) ``name`` is; None for any other name."""
    number = name.removeprefix(RANK_RNG_PREFIX).removesuffix(RANK_RNG_SUFFIX)
    return int(number) if rank_rng_file(number) == name and number.isdecimal() and number.isascii() else None


def checkpoint_dirname(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}-{step}"


def trainer_checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-N/`` directories Trainer saved in ``output_dir``, oldest step first."""
    steps = {}
    for path in output_dir.glob(f"{CHECKPOINT_PREFIX}-*"):
        number = path.name.removeprefix(f"{CHECKPOINT_PREFIX}-")
        if number.isdecimal() and number.isascii() and path.is_dir():
            steps[int(number)] = path
    return [steps[step] for step in sorted(steps)]


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_id_hint(label: str, path: Path) -> str:
    """For a source ``label`` whose directory ``path`` does not exist: what to do where it reads as
    a Hugging Face Hub model id (``org/name``, as mergekit's plans name the models they download,
    and no local ``org/`` either); empty otherwise."""
    if not _HUB_ID.fullmatch(label) or path.parent.exists():
        return ""
    return (f" ({label!r} reads as a Hugging Face Hub model id, which mergekit downloads: llmtailor reads local "
            f"directories and runs; download it first, `hf download {label} --local-dir DIR`, and name DIR)")


def weights_shard_name(index: int, count: int) -> str:
    """``save_pretrained``'s name of shard ``index`` (from 1) of ``count``: ``model-00001-of-00003.safetensors``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; IntegrityError naming the file for anything else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise IntegrityError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise IntegrityError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def step_of(source: Path, trainer_state: dict[str, Any]) -> int:
    """The step of a Trainer checkpoint: ``global_step``, which must agree with the
    directory's ``checkpoint-N`` name."""
    step = trainer_state.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise IntegrityError(f"{source / TRAINER_STATE_FILE}: key 'global_step' is {step!r}, expected a step number")
    named = re.fullmatch(r"checkpoint-(\d+)", source.name)
    if named and int(named.group(1)) != step:
        raise IntegrityError(
            f"{source / TRAINER_STATE_FILE}: global_step is {step} but the directory is named {source.name}"
        )
    return step


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names (each must be there, in the directory itself)."""
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    return shard_files(path / WEIGHTS_INDEX_FILE)


def bin_files(path: Path) -> list[Path]:
    """The torch pickle files of a model directory written by an older ``save_pretrained``
    (``safe_serialization=False``): ``pytorch_model.bin``, or the shards its
    ``pytorch_model.bin.index.json`` names."""
    if (path / BIN_FILE).is_file():
        return [path / BIN_FILE]
    return shard_files(path / BIN_INDEX_FILE)


def shard_files(index: Path) -> list[Path]:
    """The shard files a ``save_pretrained`` index names in its ``weight_map`` (each must be
    there, in the index's own directory)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise IntegrityError(f"{index}: key 'weight_map' is missing or empty")
    files = [index.parent / name for name in sorted(set(map(str, weight_map.values())))]
    absent = [f.name for f in files if not f.is_file() or f.parent != index.parent]
    if absent:
        raise IntegrityError(f"{index}: names shard files that are missing: {absent[:3]}")
    return files
