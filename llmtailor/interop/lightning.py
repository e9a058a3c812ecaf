"""Lightning checkpoints: the dict ``Trainer.fit(ckpt_path=...)`` loads, assembled from a
composite.

A Lightning checkpoint is one ``torch.save``d dict: ``state_dict`` (the LightningModule's,
tied names included), ``optimizer_states`` (each optimizer's positional ``state_dict``),
``lr_schedulers`` (each scheduler's ``state_dict``), and what Lightning keeps of its own:
``epoch``, ``global_step``, ``loops`` (progress counters and, for resumable dataloaders,
their position), ``callbacks``, hyperparameters, a datamodule's state. ``TailorCheckpoint``
(``integrations/lightning.py``) saves that last part as the state of its Tailor's stateful object
``LIGHTNING_KEY`` (a run written before stateful objects: its extras' key); the tensors are the
units'. So the assembled dict is, key for key, the one
Lightning would have written at that step, with each unit's newest saved version.

Invariant: a composite saved by ``TailorCheckpoint`` with ``Full`` assembles to a dict that
resumes exactly where the run stopped (tested: final weights bitwise equal to an uninterrupted
run). Lightning itself restores neither the RNG streams nor anything else not in the dict; the
integration restores the RNG streams from the snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError, IntegrityError
from llmtailor.interop.tailored import read_composite
from llmtailor.layouts import Layout
from llmtailor.providers.stateful import saved_state
from llmtailor.store import Progress
from llmtailor.outputs.directory import publish_file
from llmtailor.store.catalog import Composite
from llmtailor.store.run import Run

LIGHTNING_KEY = "lightning"
"""The name of the stateful object under which ``TailorCheckpoint`` keeps Lightning's own state
(``providers/stateful.py``; in a run written before stateful objects, the key of its extras)."""
TENSOR_KEYS = ("state_dict", "optimizer_states", "lr_schedulers")
"""The keys of a Lightning checkpoint the units and the global state hold, not the extras."""


def lightning_checkpoint(run: Run, composite: Composite, progress: Progress | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict of ``composite`` (module docstring). Raises ConfigError,
    before any tensor byte is read, for a run not saved through ``TailorCheckpoint``."""
    step = composite.step
    state = run.whole_global(step)
    lightning = saved_state(state, LIGHTNING_KEY)
    if not isinstance(lightning, dict):
        raise ConfigError(
            f"{run.root}: the snapshot of step {step} was not saved by TailorCheckpoint (no Lightning loop state); "
            "restore it with Tailor(...).restore(), or export it with --format hf"
        )
    layout = Layout.from_record(composite.manifest.layout)
    missing = [u for u in layout.units if u not in composite.sources]
    if missing:
        raise IntegrityError(f"composite of step {step} names no version of units {missing}")
    weights, per_param = read_composite(run, composite.sources, layout, progress)
    checkpoint = dict(lightning)
    checkpoint["state_dict"] = {**weights, **{alias: weights[name] for alias, name in layout.aliases.items()}}
    groups, scheduler = state.get("optimizer_groups"), state.get("lr_scheduler")
    if groups is not None:
        from llmtailor.providers.optimizer import positional_state_dict

        checkpoint["optimizer_states"] = [positional_state_dict(groups, per_param)]
    else:
        checkpoint["optimizer_states"] = []
    checkpoint["lr_schedulers"] = [scheduler] if scheduler is not None else []
    return checkpoint


def checkpoint_filename(checkpoint: dict[str, Any]) -> str:
    """ModelCheckpoint's default name for it: ``epoch=E-step=S.ckpt``."""
    return f"epoch={checkpoint.get('epoch', 0)}-step={checkpoint.get('global_step', 0)}.ckpt"


def export_lightning(run: Run, step: int | None, out_dir: str | Path, *, progress: Progress | None = None) -> Path:
    """Write the composite of ``step`` (default: the newest) as ``out_dir/epoch=E-step=S.ckpt``,
    the file ``Trainer.fit(model, ckpt_path=...)`` resumes from with no llmtailor code; return
    its path. The file appears whole or not at all and never replaces one."""
    import torch

    with run.reading(step) as composite:
        checkpoint = lightning_checkpoint(run, composite, progress)
    return publish_file(out_dir, checkpoint_filename(checkpoint), lambda path: torch.save(checkpoint, path))

