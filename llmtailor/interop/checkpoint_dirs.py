"""Recognising the checkpoint directories users bring, from their JSON files and names alone.

A Trainer ``checkpoint-N/`` (``trainer_state.json`` beside the weights) and a DeepSpeed save
directory (``global_stepN/``, perhaps named by ``latest``) are told apart here without
importing torch or DeepSpeed: a merge that only moves bytes needs neither (store/dtypes.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError, IntegrityError, TailorError

TRAINER_STATE_FILE = "trainer_state.json"
STEP_DIR = re.compile(r"global_step(\d+)")


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


def find_step_dir(path: Path) -> Path:
    """``global_stepN/`` itself, or the one a DeepSpeed save directory's ``latest`` names."""
    if STEP_DIR.fullmatch(path.name) and path.is_dir():
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8").strip()
        if (path / tag).is_dir():
            return path / tag
        raise IntegrityError(f"{latest} names {tag!r}, which is not a directory in {path}")
    tags = sorted((p for p in path.glob("global_step*") if STEP_DIR.fullmatch(p.name)), key=lambda p: int(p.name[11:]))
    if tags:
        return tags[-1]
    raise ConfigError(f"{path}: not a DeepSpeed checkpoint (no global_stepN/ directory, no 'latest' file)")


def is_deepspeed_checkpoint(path: Path) -> bool:
    try:
        step_dir = find_step_dir(path)
    except TailorError:
        return False
    return any(step_dir.glob("*optim_states.pt"))
