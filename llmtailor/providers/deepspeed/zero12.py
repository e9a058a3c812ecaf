"""``Zero12Provider``: a DeepSpeed engine under ZeRO stage 1 or 2.

The masters live in one fp32 flat partition per param group (``single_partition_of_fp32_groups``);
a parameter's fragment on this rank is the contiguous range its ``_hp_mapping`` names (possibly
empty, possibly split between ranks). Frozen parameters are whole on every rank, written once by
the unit's owner. A restore refreshes the low-precision weights with ``update_lp_params`` (an
all-gather)."""

from __future__ import annotations

from typing import Any

import torch

from llmtailor.providers.deepspeed.base import DeepSpeedProvider, Fragment, read_flat
from llmtailor.store.keys import weight_key
from llmtailor.store.manifest import TensorEntry, UnitEntry
from llmtailor.store.reader import ChunkReader
from llmtailor.store.staged import Piece


class Zero12Provider(DeepSpeedProvider):
    """ZeRO-1/2 (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._group_index = {id(p): i for i, group in enumerate(self._groups()) for p in group}

    def _groups(self) -> list[list[torch.nn.Parameter]]:
        return self.zero.bit16_groups

    def _flat_partitions(self) -> list[torch.Tensor]:
        return self.zero.single_partition_of_fp32_groups

    def _partition_of(self, param: torch.nn.Parameter) -> int:
        return self._group_index[id(param)]

    def _group_of_partition(self, index: int) -> int:
        return index

    def _fragment(self, param: torch.nn.Parameter) -> Fragment | None:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None or mapping.lp_fragment_address.numel == 0:
            return None
        # The group's flat partition and its optimizer state, narrowed to this fragment. (Not
        # the mapping's own optim_fragment: DeepSpeed links it after the first step, and with
        # several param groups it was found linked for the first group only.)
        flat = self.zero.single_partition_of_fp32_groups[mapping.param_group_index]
        start, numel = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        return self._narrowed(flat, mapping.hp_fragment_address.start, start, numel)

    def _global_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        return tuple(param.shape)

    def _frozen_pieces(self, name: str, param: torch.nn.Parameter, shape: tuple[int, ...], owner: bool) -> list[Piece]:
        return [Piece.whole(weight_key(name), param.detach())] if owner else []

    def _load_frozen(self, reader: ChunkReader, step: int, entry: UnitEntry, saved: TensorEntry, param) -> None:
        with torch.no_grad():
            param.copy_(read_flat(reader, step, entry, saved, 0, param.numel()).view(param.shape))

    def finish_load(self) -> None:
        """The low-precision weights from the restored masters, as DeepSpeed's own checkpoint
        loading refreshes them (an all-gather: only once every rank has loaded)."""
        # Re-link DeepSpeed's own per-parameter state accessors to the (possibly new) state.
        self.zero._hp_optimizer_states_linked = False
        self.zero._lazy_init_hp_params_optimizer_state()
        self.zero.update_lp_params()
