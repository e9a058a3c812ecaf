"""State providers: each training backend's live state, seen by unit and canonical name
(``base.py`` states the interface). ``make_provider`` picks one for the objects a user has."""

from __future__ import annotations

from typing import Any

import torch

from llmtailor.distributed.coordinator import Coordinator
from llmtailor.errors import ConfigError, UnsupportedLayoutError
from llmtailor.layouts import build_layout
from llmtailor.providers.agreement import agree_layout
from llmtailor.providers.base import StateProvider, unwrap
from llmtailor.providers.local import LocalProvider


def make_provider(
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    coordinator: Coordinator,
    family: str | None = None,
) -> StateProvider:
    """The provider serving ``model``: a DeepSpeed engine, an FSDP2 (``fully_shard``) model,
    or a plain / DDP-wrapped module. Collective in a distributed job, and the first collective
    a ``Tailor`` makes: the ranks agree on the run's layout and its pipeline stages
    (``agreement.agree_layout``), and a layout that cannot be saved is refused on every rank
    before any other collective could hang or commit part of the model."""
    provider = _provider(model, optimizer, lr_scheduler, coordinator, family)
    stages = agree_layout(provider, f"{coordinator.new_round()}/layout")
    if stages.pipelined and provider.kind.startswith("deepspeed"):
        raise UnsupportedLayoutError(
            f"the ranks of this job hold different units of the model ({len(stages.stages)} pipeline stages) under "
            "DeepSpeed: pipeline stages are supported with plain, DDP or FSDP2 models, not DeepSpeed engines")
    return provider


def _provider(model: Any, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any | None, coordinator: Coordinator,
              family: str | None) -> StateProvider:
    from llmtailor.providers.deepspeed import deepspeed_provider, is_engine, module_tensors

    if is_engine(model):
        if optimizer is not None or (lr_scheduler is not None and model.lr_scheduler not in (None, lr_scheduler)):
            raise ConfigError(
                "a DeepSpeed engine brings its own optimizer and LR scheduler: pass Tailor(run_dir, engine, policy=...) "
                "(an LR scheduler only when the engine has none)"
            )
        module = unwrap(model.module)
        return deepspeed_provider(model, build_layout(module, family, module_tensors(module)), coordinator, lr_scheduler)
    module = unwrap(model)
    layout = build_layout(module, family)
    if coordinator.world_size > 1 or torch.distributed.is_initialized():
        from llmtailor.providers.fsdp import FSDPProvider, is_sharded

        if is_sharded(module):
            return FSDPProvider(model, optimizer, lr_scheduler, layout, coordinator)
    return LocalProvider(model, optimizer, lr_scheduler, layout, coordinator)  # it sees through the wrappers


__all__ = ["LocalProvider", "StateProvider", "make_provider"]
