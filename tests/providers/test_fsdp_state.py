"""An FSDP2 restore into an optimizer that holds state already (a restore within a job, or after a
warm-up step) loads the saved moments into the live state tensors themselves: the optimizer
keeps the very tensors it had, holding the saved values. One process (gloo, world size 1): a
``detach`` of each of a rank's DTensor state tensors, ~0.1 ms of CPU each through DTensor's
Python dispatch on every restore, is not needed for a tensor that takes no gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import tiny, train

from llmtailor import Full, Tailor
from llmtailor.training_example import corpus_tokens


def test_an_fsdp2_restore_loads_the_saved_moments_into_the_live_state_tensors_themselves(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _, _ = tiny()
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        from llmtailor.training_example import build_optimizer

        optimizer, scheduler = build_optimizer(model, total_steps=50)
        tokens = corpus_tokens()
        train(model, optimizer, scheduler, tokens, range(2))
        with Tailor(tmp_path / "run", model, optimizer, scheduler, policy=Full()) as tailor:
            tailor.save(2)
        saved = {(id(p), k): v.full_tensor().clone() if isinstance(v, DTensor) else v.clone()
                 for p, state in optimizer.state.items() for k, v in state.items()}
        train(model, optimizer, scheduler, tokens, range(2, 3))  # the live moments move on
        live = {(id(p), k): v for p, state in optimizer.state.items() for k, v in state.items()}
        moments = [key for key, v in live.items() if isinstance(v, DTensor)]
        assert moments and all(not live[key].requires_grad for key in moments)

        Tailor(tmp_path / "run", model, optimizer, scheduler, read_only=True).restore()
        after = {(id(p), k): v for p, state in optimizer.state.items() for k, v in state.items()}
        assert after.keys() == live.keys()
        assert [key for key in moments if after[key] is not live[key]] == []
        assert [key for key in moments if not torch.equal(after[key].full_tensor(), saved[key])] == []
    finally:
        dist.destroy_process_group()
