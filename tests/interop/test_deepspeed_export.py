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
