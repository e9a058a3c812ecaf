"""Export a composite as a Hugging Face Trainer ``checkpoint-N/`` directory.

Vanilla ``transformers.Trainer.train(resume_from_checkpoint=OUT/checkpoint-N)`` resumes from
the result with no llmtailor code: the files are the ones Trainer's own ``_save_checkpoint``
writes, in the formats its ``_load_*`` methods read::

    model.safetensors        every canonical weight under its HF name (tied aliases once, as
                             ``save_pretrained`` does), metadata {"format": "pt"}
    config.json              the model config saved with the run
    generation_config.json   ``GenerationConfig.from_model_config`` of that config
    optimizer.pt             ``Optimizer.state_dict()`` layout: indices follow the run's param
                             groups, which must be Trainer's own decay / no-decay groups
    scheduler.pt             the LR scheduler's state dict (Trainer loads it only beside optimizer.pt)
    rng_state.pth            {"python", "numpy", "cpu"[, "cuda"]} as ``Trainer._save_rng_state``
    trainer_state.json       the TrainerState saved by ``TailorTrainer`` (``TRAINER_STATE_KEY``),
                             or kept by an import of a Trainer checkpoint (else a minimal one)

Every ``.pt``/``.pth`` file loads with ``torch.load(..., weights_only=True)`` (rng_state.pth
under transformers' ``safe_globals()``, like Trainer's own). Not written: ``training_args.bin``
(a pickled TrainingArguments; resuming does not read it) and tokenizer files (the run does not
know the tokenizer).

Invariants: before any tensor byte is read, the run's optimizer groups are checked against the
groups vanilla Trainer builds for the model (same parameters, same order), so optimizer state
lands on the right parameter; the directory appears whole (written under a temporary name,
fsynced, renamed) or not at all; an existing ``checkpoint-N`` is never overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.errors import ConfigError, IntegrityError
from llmtailor.interop.hf.files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    checkpoint_dirname,
)
from llmtailor.layouts import Layout
from llmtailor.providers.stateful import saved_state
from llmtailor.store.files import ByteSource, Syncer, copy_durable, fsync_file, write_tensor_file, write_text_durable
from llmtailor.store.publish import publishing
from llmtailor.store.run import Run
from llmtailor.interop.tailored import read_composite
from llmtailor.store import Progress

if TYPE_CHECKING:
    import torch

"""Called after each unit is read: ``(unit, units done, units in all)``."""

TRAINER_STATE_KEY = "trainer_state"
"""The name under which a run keeps Trainer's TrainerState (as JSON): ``TailorTrainer``'s stateful
object (``providers/stateful.py``), and the extras' key of an imported Trainer checkpoint (and of
a ``TailorTrainer`` run written before stateful objects)."""


def export_hf(
    run: Run,
    step: int | None,
    out_dir: str | Path,
    *,
    progress: Progress | None = None,
    train_batch_size: int = 1,
    extra_files: list[Path] = (),
) -> Path:
    """Write the composite of ``step`` (default: the newest) as ``out_dir/checkpoint-<step>/``
    and return that path. ``extra_files`` (a tokenizer's, say) are copied in beside.

    Reads one unit at a time; the weights and optimizer state are gathered in memory only
    because model.safetensors and optimizer.pt are single files. Raises TailorError (nothing
    written) when the run lacks what the format needs, when its optimizer groups are not the
    ones vanilla Trainer builds, or when the target directory exists."""
    composite = run.resolve(step)
    layout = Layout.from_record(composite.manifest.layout)
    config, groups, scheduler, state = _checked_state(run, composite, layout)
    adapters = state.get("peft_config")  # a PeftModel's run: Trainer checkpoints hold the adapters only
    with publishing(out_dir, checkpoint_dirname(composite.step)) as tmp:
        weights, per_param = read_composite(run, composite.sources, layout, progress)
        if adapters:
            from llmtailor.interop.hf.peft import write_adapters

            write_adapters(run, composite, adapters, tmp)
        else:
            _write_weights(tmp / WEIGHTS_FILE, weights)
        del weights
        _write_config(tmp, config)
        if groups is not None:
            from llmtailor.providers.optimizer import positional_state_dict

            _save_torch(tmp / OPTIMIZER_FILE, positional_state_dict(groups, per_param))
            _save_torch(tmp / SCHEDULER_FILE, scheduler)
        del per_param
        if state.get("rng") is not None:  # an import from DeepSpeed holds none; Trainer then warns
            _save_torch(tmp / RNG_FILE, trainer_rng_state(state["rng"]))
        trainer_state = saved_state(state, TRAINER_STATE_KEY)
        write_text_durable(tmp / TRAINER_STATE_FILE, trainer_state_json(trainer_state, composite.step, train_batch_size))
        for path in extra_files:  # tokenizer files, say
            copy_durable(Path(path), tmp / Path(path).name)
    return Path(out_dir) / checkpoint_dirname(composite.step)


def _checked_state(run: Run, composite, layout: Layout) -> tuple[dict[str, Any], Any, Any, dict[str, Any]]:
    """The composite's model config, optimizer groups, LR scheduler and global state, after
    checking it holds what a Trainer checkpoint needs (before any tensor byte is read)."""
    from llmtailor.interop.hf.model import check_trainer_groups

    step = composite.step
    missing = [u for u in layout.units if u not in composite.sources]
    if missing:
        raise IntegrityError(f"composite of step {step} names no version of units {missing}")
    state = run.read_global(step)
    config = state.get("model_config")
    if not isinstance(config, dict):
        raise ConfigError(
            f"{run.root}: the snapshot of step {step} holds no Hugging Face model config; "
            "an HF export needs a transformers model (one with .config)"
        )
    groups, scheduler = state.get("optimizer_groups"), state.get("lr_scheduler")
    if (groups is None) != (scheduler is None):
        have, lack = ("optimizer", "LR scheduler") if scheduler is None else ("LR scheduler", "optimizer")
        raise ConfigError(
            f"{run.root}: the snapshot of step {step} holds {have} state but no {lack}; "
            "Trainer loads optimizer.pt and scheduler.pt only as a pair"
        )
    if groups is not None:
        check_trainer_groups(config, layout, groups, state.get("peft_config"))
    return config, groups, scheduler, state


def write_model_dir(out: str | Path, weights: dict[str, torch.Tensor | ByteSource], config: dict[str, Any],
                    side_files: list[Path] = ()) -> Path:
    """A ``save_pretrained``-style directory ``out`` (missing or empty): ``model.safetensors``
    of ``weights`` (by name; byte ranges of source files copied as they are), ``config.json``,
    and ``side_files`` (a generation config, tokenizer files) copied in. Appears whole or not at
    all; imports no torch for byte sources."""
    out = Path(out)
    with publishing(out.parent, out.name, replace_empty=True) as tmp:
        with Syncer() as syncer:  # the file's flushes overlap its writing
            write_tensor_file(tmp / WEIGHTS_FILE, weights, tmp, metadata={"format": "pt"}, syncer=syncer)
        write_text_durable(tmp / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in side_files:
            copy_durable(Path(path), tmp / Path(path).name)
    return out


def trainer_rng_state(rng: dict[str, Any]) -> dict[str, Any]:
    """Our RNG record in ``Trainer._save_rng_state``'s non-distributed format."""
    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    cuda = rng.get("cuda")
    if cuda is not None:
        # Non-distributed Trainer saves (and loads) one device's state, not the list of all.
        out["cuda"] = cuda[0] if isinstance(cuda, (list, tuple)) else cuda
    return out


def trainer_state_json(state: Any, step: int, train_batch_size: int) -> str:
    """The run's TrainerState ``state`` (as ``TailorTrainer`` saves it: ``saved_state(global
    state, TRAINER_STATE_KEY)``), or, for None (a plain Tailor run), a minimal one. Trainer
    divides the state's ``train_batch_size`` on resume (it only warns on a mismatch), so a
    minimal state must carry an integer one."""
    if not isinstance(state, dict):
        from dataclasses import asdict

        from transformers import TrainerState

        state = asdict(TrainerState(global_step=step, train_batch_size=train_batch_size))
    elif state.get("global_step") != step:
        raise IntegrityError(f"trainer_state of step {step} says global_step {state.get('global_step')}")
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


# -- Writing -------------------------------------------------------------------------------


def _write_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    write_tensor_file(path, weights, path.parent, metadata={"format": "pt"})  # durable when it returns


def _write_config(root: Path, config: dict[str, Any]) -> None:
    write_text_durable(root / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
    try:
        import transformers

        hf_config = transformers.CONFIG_MAPPING[config["model_type"]].from_dict(config)
        generation = transformers.GenerationConfig.from_model_config(hf_config)
    except Exception:  # optional file: a config transformers cannot turn into one is left out
        return
    write_text_durable(root / GENERATION_CONFIG_FILE, generation.to_json_string(use_diff=True))


def _save_torch(path: Path, obj: Any) -> None:
    import torch

    torch.save(obj, path)
    fsync_file(path)
