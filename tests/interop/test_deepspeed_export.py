"""``assemble --format deepspeed`` hands a run's extras to DeepSpeed as the ``client_state`` that
``engine.load_checkpoint`` returns (an import keeps a checkpoint's client_state as the extras:
tests/distributed/test_deepspeed.py runs both ways through real engines)."""

from __future__ import annotations

import torch
from helpers import tiny, train

from llmtailor import Full, Tailor
from llmtailor.interop.deepspeed.export import MODEL_STATES, export_deepspeed
from llmtailor.store.run import Run


def test_the_extras_are_the_client_state_of_the_exported_checkpoint(tmp_path, tokens):
    model, opt, sched = tiny(layers=2, hidden=16)
    with Tailor(tmp_path / "run", model, opt, sched, policy=Full()) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1, extra={"epoch": 2, "data": {"position": 5, "seed": (1, 2)}, "global_steps": 99})
    folder = export_deepspeed(Run(tmp_path / "run"), None, tmp_path / "ds")
    states = torch.load(folder / MODEL_STATES, weights_only=False)
    assert states["epoch"] == 2 and states["data"] == {"position": 5, "seed": (1, 2)}
    assert states["global_steps"] == 1  # the engine's own counter, never an extra of that name


def test_a_composite_with_frozen_parameters_is_refused_naming_them_and_nothing_is_written(tmp_path, tokens):
    """DeepSpeed's load_checkpoint of a universal checkpoint sets only the parameters an optimizer
    group holds (from zero/; it never loads the module's state dict): seen with a ZeRO-2 engine at
    2 ranks, the frozen embedding and MLP of layer 0 kept the fresh engine's values while the load
    reported the checkpoint loaded (bench/RESULTS.md, session 59). So a composite holding tensors
    no group holds is refused, naming them and what to do; nothing is written (before: exported,
    the frozen ones listed as buffer_names, which the load ignores)."""
    import pytest

    from llmtailor.errors import IncompatibleModelError

    model, _, sched = tiny(layers=2, hidden=16)
    model.get_input_embeddings().weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with Tailor(tmp_path / "run", model, opt, policy=Full()) as tailor:
        train(model, opt, None, tokens, [1])
        tailor.save(1)
    with pytest.raises(IncompatibleModelError, match=r"'model\.embed_tokens\.weight'.*Tailor\(run, engine\)\.restore\(\)"):
        export_deepspeed(Run(tmp_path / "run"), None, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
