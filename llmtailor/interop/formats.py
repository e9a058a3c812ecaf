"""What a directory of another format is, from its file names alone (torch-free): told to the
store's run detection (``store.storage.local_detect.recognise_other_formats``; the package
wires it in, ``llmtailor/__init__.py``), so a writer refused in one, or a command given one,
names what it found and the command that takes it. The formats llmtailor does not read (an
accelerate ``save_state`` directory, a Lightning ``.ckpt`` file, a ``dcp.save`` directory) are
named with the way to bring them in: their framework's own resume (or load) under llmtailor's
integration (or a Tailor), which saves tailored snapshots from there."""

from __future__ import annotations

from pathlib import Path

from llmtailor.interop.deepspeed.files import is_deepspeed_checkpoint
from llmtailor.interop.hf.files import (
    ADAPTER_CONFIG,
    CONFIG_FILE,
    PEFT_ADVICE,
    TAILOR_TRAINER_RUN,
    TRAINER_STATE_FILE,
    trainer_checkpoints,
)

ACCELERATE_FILES = ("optimizer.bin", "random_states_0.pkl")
"""What ``Accelerator.save_state`` writes and nothing else does (its model is ``model.safetensors``)."""
FSDP_MODEL_PREFIX = "pytorch_model_fsdp"
"""accelerate's ``FSDP_MODEL_NAME``: what Trainer under FSDP saves the model as, by
``state_dict_type``: ``pytorch_model_fsdp_0/`` (SHARDED, torch's distributed checkpoint, its
optimizer in ``optimizer_0/``), ``pytorch_model_fsdp_0_rank<r>.bin``, ``pytorch_model_fsdp_rank<r>.bin``
(LOCAL) or ``pytorch_model_fsdp.bin`` (FULL, its optimizer in ``optimizer.bin``)."""
LIGHTNING_SUFFIX = ".ckpt"
DCP_METADATA = ".metadata"
"""What ``torch.distributed.checkpoint.save`` writes beside its ``*.distcp`` files (torchtitan's
checkpoints, a custom FSDP2 loop's)."""


def describe_other_format(path: Path) -> str | None:
    """What the directory or file ``path`` is (a phrase that follows "is"), or None when it is
    none of the formats interop knows."""
    if path.is_file():
        if path.suffix == LIGHTNING_SUFFIX:
            return (f"a Lightning checkpoint file, which llmtailor does not read: resume from it with Lightning's own "
                    f"`trainer.fit(model, ckpt_path=\"{path}\")` with llmtailor's TailorCheckpoint among the "
                    "callbacks, which saves tailored snapshots from there")
        return None
    fsdp = fsdp_files(path)
    if fsdp:
        return (f"a Trainer checkpoint saved under FSDP ({', '.join(fsdp[:2])}: FSDP's own state dicts, not "
                f"model.safetensors and optimizer.pt), which llmtailor does not read: resume from it with llmtailor's "
                f"TailorTrainer under the same fsdp_config, `trainer.train(resume_from_checkpoint=\"{path}\")` "
                "(Trainer's own FSDP load), which saves tailored snapshots from there")
    output_dir = describe_output_dir(path)
    if output_dir:
        return output_dir
    if (path / DCP_METADATA).is_file():
        return (f"a torch.distributed.checkpoint directory ({DCP_METADATA} and *.distcp files, dcp.save's), which "
                "llmtailor does not read: load it into your model and optimizer with dcp.load, as it was saved, and "
                "a Tailor's save(step) saves tailored snapshots from there")
    if is_peft_checkpoint(path):
        return (f"a Trainer checkpoint of a peft model ({ADAPTER_CONFIG}, no {CONFIG_FILE}), which llmtailor does not "
                f"import: to go on training it, resume from it with llmtailor's TailorTrainer, "
                f"`trainer.train(resume_from_checkpoint=\"{path}\")` (Trainer's own load), which saves tailored "
                f"snapshots from there; for its weights, {PEFT_ADVICE}")
    if (path / ADAPTER_CONFIG).is_file() and not (path / CONFIG_FILE).is_file():
        return f"a peft adapter ({ADAPTER_CONFIG}), not a model: {PEFT_ADVICE}"
    if (path / TRAINER_STATE_FILE).is_file():
        return (f"a Hugging Face Trainer checkpoint ({TRAINER_STATE_FILE}; import it with `llmtailor import-hf` to "
                f"inspect, verify or assemble it, or name it as a source of a `llmtailor merge` plan)")
    if is_deepspeed_checkpoint(path):
        return ("a DeepSpeed checkpoint (import it with `llmtailor import-deepspeed` to inspect, verify or assemble "
                "it, or name it as a source of a `llmtailor merge` plan)")
    if any((path / name).is_file() for name in ACCELERATE_FILES):
        return (f"an accelerate save_state directory ({', '.join(ACCELERATE_FILES)}), which llmtailor does not read: "
                f"load it with llmtailor's TailorAccelerator, `accelerator.load_state(\"{path}\")` (accelerate's own "
                "load), and its `save_state(step=N)` saves tailored snapshots from there")
    if (path / CONFIG_FILE).is_file() and (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))):
        return "a model directory (config.json and its weights; a source for a `llmtailor merge` plan)"
    return None


def fsdp_files(path: Path) -> list[str]:
    """The names of the FSDP model files or directories Trainer wrote in ``path`` (``FSDP_MODEL_PREFIX``),
    a directory's with a trailing ``/``; empty for a directory of any other kind."""
    return sorted(p.name + "/" * p.is_dir() for p in path.glob(f"{FSDP_MODEL_PREFIX}*"))


def describe_output_dir(path: Path) -> str | None:
    """What a Trainer ``output_dir`` holds (a phrase that follows "is"): its ``checkpoint-N/``
    directories, each a checkpoint the commands take, and TailorTrainer's run; None for a
    directory holding neither (a ``checkpoint-N/`` itself, whatever ``save_model`` wrote beside)."""
    checkpoints = [p.name for p in trainer_checkpoints(path)]
    run = path / TAILOR_TRAINER_RUN
    if not checkpoints and not run.is_dir():
        return None
    shown = checkpoints if len(checkpoints) <= 3 else [*checkpoints[:2], "...", checkpoints[-1]]
    held = [", ".join(shown)] if checkpoints else []
    held += [f"TailorTrainer's run {run}"] if run.is_dir() else []
    newest = f" (the newest checkpoint: {path / checkpoints[-1]})" if checkpoints else ""
    return f"a Trainer output_dir holding {' and '.join(held)}: name one of them{newest}"


def is_peft_checkpoint(path: Path) -> bool:
    """Whether ``path`` is what Trainer saves for a peft model: the adapter (``ADAPTER_CONFIG``
    and its weights) beside optimizer.pt and trainer_state.json, and no config.json."""
    return all((path / name).is_file() for name in (ADAPTER_CONFIG, TRAINER_STATE_FILE)) and not (path / CONFIG_FILE).is_file()
