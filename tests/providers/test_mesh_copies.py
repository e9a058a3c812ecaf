"""Which ranks hold copies of one DTensor shard (``providers.fsdp.shard_copy``), on a 2 x 2
``("dp", "tp")`` mesh, each rank in turn in one process (torch's fake process group: meshes and
DTensors without communication). The ranks holding one shard must be numbered 0..count-1, each
once, so that exactly one of them writes it whatever mesh the tensor lives on: before issue 34
a tensor on the ``dp`` sub-mesh had no copies as far as the save knew, and both ``tp`` ranks
wrote it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llmtailor.providers import fsdp


def copies_at(rank: int) -> dict[str, tuple[int, int] | None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
    fsdp._copy_across_global_mesh.cache_clear()  # a process is one rank; here each rank in turn
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        local = torch.zeros(2, 3)
        tensors = {
            "dp sub-mesh (FSDP2 only)": DTensor.from_local(local, mesh["dp"], [Shard(0)]),
            "tp sub-mesh (TP only)": DTensor.from_local(local, mesh["tp"], [Shard(0)]),
            "both (TP + FSDP2)": DTensor.from_local(local, mesh, [Shard(0), Shard(1)]),
            "HSDP": DTensor.from_local(local, mesh, [Replicate(), Shard(0)]),
            "replicated": DTensor.from_local(local, mesh, [Replicate(), Replicate()]),
        }
        copies = {name: fsdp.shard_copy(tensor) for name, tensor in tensors.items()}
        # the same mesh read as ("pp", "dp"): stage 0 = ranks 0, 1, stage 1 = ranks 2, 3, each
        # stage's layers sharded over its own "tp" (here: data) sub-mesh; no other stage holds them
        stage = (0, 1) if rank < 2 else (2, 3)
        copies["pipeline stages (dp sub-mesh of pp x dp)"] = fsdp.shard_copy(tensors["tp sub-mesh (TP only)"], stage)
        return copies
    finally:
        fsdp._copy_across_global_mesh.cache_clear()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def every_rank() -> list[dict[str, tuple[int, int] | None]]:
    return [copies_at(rank) for rank in range(4)]


@pytest.mark.parametrize("layout, expected", [
    # rank r = (dp r // 2, tp r % 2); (index, count) of each rank's copy of its shard
    ("dp sub-mesh (FSDP2 only)", [(0, 2), (1, 2), (0, 2), (1, 2)]),  # ranks 0, 1 hold one shard
    ("tp sub-mesh (TP only)", [(0, 2), (0, 2), (1, 2), (1, 2)]),     # ranks 0, 2 hold one shard
    ("both (TP + FSDP2)", [(0, 1)] * 4),                             # every shard once
    ("HSDP", [(0, 2), (0, 2), (1, 2), (1, 2)]),                      # replicated over dp
    ("replicated", [(0, 4), (1, 4), (2, 4), (3, 4)]),
    # before: (0, 2), (0, 2), (1, 2), (1, 2): stage 1 counted as copies of stage 0's shards,
    # so a stage's unit could be given to a copy on the other stage, which holds none of it
    ("pipeline stages (dp sub-mesh of pp x dp)", [(0, 1)] * 4),
])
def test_the_ranks_holding_one_shard_are_numbered_once_each(every_rank, layout, expected):
    assert [ranks[layout] for ranks in every_rank] == expected
