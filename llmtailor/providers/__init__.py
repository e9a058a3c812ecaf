"""State providers: each training backend's live state, seen by unit and canonical name
(``base.py`` states the interface). ``make_provider`` picks one for the objects a user has."""

from __future__ import annotations

from typing import Any

import torch

from llmtailor.layouts import build_layout
from llmtailor.providers.base import StateProvider, unwrap
from llmtailor.providers.local import LocalProvider
from llmtailor.store.coordinator import Coordinator


def make_provider(
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    coordinator: Coordinator,
    family: str | None = None,
) -> StateProvider:
    """The provider serving ``model``: a DeepSpeed engine, an FSDP2 (``fully_shard``) model,
    or a plain / DDP-wrapped module."""
    module = unwrap(model)
    layout = build_layout(module, family)
    if coordinator.world_size > 1 or torch.distributed.is_initialized():
        from llmtailor.providers.fsdp import FSDPProvider, is_sharded

        if is_sharded(module):
            return FSDPProvider(module, optimizer, lr_scheduler, layout, coordinator)
    return LocalProvider(module, optimizer, lr_scheduler, layout, coordinator)


__all__ = ["LocalProvider", "StateProvider", "make_provider"]
