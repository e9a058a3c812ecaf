"""``Zero3Provider``: a DeepSpeed engine under ZeRO stage 3.

Every parameter is partitioned: this rank holds ``ceil(numel / world)`` elements at ``rank x
that`` (the last rank's padded tail cut), its master in the fp32 flat partition of its
sub-group. DeepSpeed splits each param group into sub-groups of about ``sub_group_size``
elements (one optimizer step each): they are joined back into the user's groups here. Frozen
parameters are partitioned too. A restore refreshes the low-precision partitions from the
masters and re-gathers the persistent parameters (an all-gather)."""

from __future__ import annotations

import torch

from llmtailor.providers.deepspeed.base import DeepSpeedProvider, Fragment, box_pieces, read_flat
from llmtailor.store.keys import weight_key
from llmtailor.store.manifest import TensorEntry, UnitEntry
from llmtailor.store.reader import ChunkReader
from llmtailor.store.staged import Piece


class Zero3Provider(DeepSpeedProvider):
    """ZeRO-3 (module docstring)."""

    def _groups(self) -> list[list[torch.nn.Parameter]]:
        groups: list[list[torch.nn.Parameter]] = [[] for _ in self.zero.optimizer.param_groups]
        for sub_group, params in enumerate(self.zero.fp16_groups):
            groups[self.zero.sub_group_to_group_id[sub_group]].extend(params)
        return groups

    def _flat_partitions(self) -> list[torch.Tensor]:
        return self.zero.fp32_partitioned_groups_flat

    def _partition_of(self, param: torch.nn.Parameter) -> int:
        return self.zero.grad_position[self.zero.get_param_id(param)][0]

    def _group_of_partition(self, index: int) -> int:
        return self.zero.sub_group_to_group_id[index]

    def _partition(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """``(start, numel)`` of this rank's partition in the flattened parameter."""
        part = param.ds_tensor.numel()
        start = part * self.zero._get_param_partition_rank(param)
        return start, min(part, param.ds_numel - start)

    def _fragment(self, param: torch.nn.Parameter) -> Fragment | None:
        start, numel = self._partition(param)
        if numel <= 0:
            return None
        index, offset, _ = self.zero.grad_position[self.zero.get_param_id(param)]
        return self._narrowed(self.zero.fp32_partitioned_groups_flat[index], offset, start, numel)

    def _global_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        return tuple(param.ds_shape)

    def _frozen_pieces(self, name: str, param: torch.nn.Parameter, shape: tuple[int, ...], owner: bool) -> list[Piece]:
        start, numel = self._partition(param)
        return box_pieces(weight_key(name), param.ds_tensor.detach().view(-1), shape, start, numel) if numel > 0 else []

    def _load_frozen(self, reader: ChunkReader, step: int, entry: UnitEntry, saved: TensorEntry, param) -> None:
        start, numel = self._partition(param)
        if numel > 0:
            with torch.no_grad():
                param.ds_tensor.view(-1)[:numel].copy_(read_flat(reader, step, entry, saved, start, numel))

    def _before_load(self) -> None:
        self.zero.checkpoint_event_prologue()  # every parameter partitioned

    def finish_load(self) -> None:
        """The low-precision partitions from the restored masters, then the persistent
        parameters re-gathered, as DeepSpeed's own checkpoint loading does (an all-gather: only
        once every rank has loaded)."""
        for sub_group in range(len(self.zero.fp32_partitioned_groups_flat)):
            self.zero._reassign_or_swap_out_partitioned_parameters(sub_group)
        self.zero.checkpoint_event_epilogue()
