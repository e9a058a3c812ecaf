"""Capture and restore the random number generators that training consumes.

The states are plain Python / numpy / tensor values, encoded by ``llmtailor.store.codec``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """The states of python's ``random``, numpy's global generator, torch CPU and every CUDA device."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``. CUDA states are restored only where CUDA is available."""
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(value: Any) -> tuple:
    # random.setstate wants (version, tuple_of_ints, gauss_next); the codec keeps tuples,
    # but be lenient with lists written by hand.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
