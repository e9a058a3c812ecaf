"""Recognising a DeepSpeed save directory (``global_stepN/``, perhaps named by ``latest``) from
its names alone: torch- and DeepSpeed-free."""

from __future__ import annotations

import re
from pathlib import Path

from llmtailor.errors import ConfigError, IntegrityError, TailorError

STEP_DIR = re.compile(r"global_step(\d+)")


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
