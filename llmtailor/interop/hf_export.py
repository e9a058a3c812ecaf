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
    trainer_state.json       the TrainerState saved by ``TailorTrainer`` (else a minimal one)

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
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmtailor.errors import ConfigError, IncompatibleModelError, IntegrityError
from llmtailor.interop.checkpoint_dirs import TRAINER_STATE_FILE
from llmtailor.layouts import Layout
from llmtailor.providers.optimizer import positional_state_dict
from llmtailor.store.keys import split_unit
from llmtailor.store.files import abandon_output, copy_durable, fsync_dir, fsync_file, open_output, write_text_durable
from llmtailor.store.run import Run

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pth"

Progress = Callable[[str, int, int], None]
"""Called after each unit is read: ``(unit, units done, units in all)``."""


def checkpoint_dirname(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}-{step}"


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
    out_dir = Path(out_dir)
    composite = run.resolve(step)
    step = composite.step
    layout = Layout.from_record(composite.manifest.layout)
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
    adapters = state.get("peft_config")  # a PeftModel's run: Trainer checkpoints hold the adapters only
    if groups is not None:
        check_trainer_groups(config, layout, groups, adapters)

    target = out_dir / checkpoint_dirname(step)
    if target.exists():
        raise ConfigError(f"{target} already exists; refusing to overwrite it (choose another -o)")
    tmp, created = open_output(out_dir, f".{checkpoint_dirname(step)}.tmp-")  # a failure removes what it created
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
        weights, per_param = _read_units(run, composite.sources, layout, progress)
        if adapters:
            from llmtailor.interop.peft_export import write_adapters

            write_adapters(run, composite, adapters, tmp)
        else:
            _write_weights(tmp / WEIGHTS_FILE, weights)
        del weights
        _write_config(tmp, config)
        if groups is not None:
            _save_torch(tmp / OPTIMIZER_FILE, positional_state_dict(groups, per_param))
            _save_torch(tmp / SCHEDULER_FILE, scheduler)
        del per_param
        if state.get("rng") is not None:  # an import from DeepSpeed holds none; Trainer then warns
            _save_torch(tmp / RNG_FILE, trainer_rng_state(state["rng"]))
        write_text_durable(tmp / TRAINER_STATE_FILE, trainer_state_json(state.get("extra"), step, train_batch_size))
        for path in extra_files:  # tokenizer files, say
            copy_durable(Path(path), tmp / Path(path).name)
        fsync_dir(tmp)
        if target.exists():  # os.rename would replace an empty directory created meanwhile
            raise ConfigError(f"{target} already exists; refusing to overwrite it (choose another -o)")
        os.rename(tmp, target)
        fsync_dir(out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = abandon_output(err, created, out_dir)
        if failure is err:
            raise
        raise failure from None
    return target


# -- Trainer's parameter groups ------------------------------------------------------------


def trainer_param_groups(config: dict[str, Any], adapters: dict[str, Any] | None = None) -> list[list[str]]:
    """Parameter names of the two groups vanilla Trainer's ``create_optimizer`` builds for the
    model of ``config`` (decay, then no-decay; each in ``named_parameters`` order), under the
    canonical names; with ``adapters`` (peft configs), for that ``PeftModel``: its trainable
    parameters only. The model is built on the meta device: no memory, no weights."""
    import transformers

    model = meta_model(config)
    if adapters:
        import peft

        (first, settings), *others = adapters.items()
        with torch.device("meta"):
            model = peft.get_peft_model(model, peft.get_peft_config(settings), adapter_name=first)
            for name, more in others:
                model.add_adapter(name, peft.get_peft_config(more))
    # Trainer.get_decay_parameter_names does not use `self`; calling it keeps us on exactly the
    # rule of the installed transformers (layer types and name patterns).
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    canonical = (lambda n: n.removeprefix("base_model.model.")) if adapters else (lambda n: n)
    return [[canonical(n) for n, _ in named if n in decay], [canonical(n) for n, _ in named if n not in decay]]


def check_trainer_groups(config: dict[str, Any], layout: Layout, groups: list[dict[str, Any]],
                         adapters: dict[str, Any] | None = None) -> None:
    """Raise IncompatibleModelError naming the first parameter whose group or position differs
    between the run's optimizer and the one vanilla Trainer would build; optimizer.pt is
    matched by position, so anything else would load state onto the wrong parameters."""
    expected = trainer_param_groups(config, adapters)
    held = set(layout.tensor_names()) | set(layout.aliases)
    unknown = [n for names in expected for n in names if n not in held]
    if unknown:
        raise IncompatibleModelError(
            f"the run's model config builds parameters the run does not hold, e.g. {sorted(unknown)[:3]}"
        )
    saved = [list(g.get("params", [])) for g in groups]
    flat_saved = [(i, n) for i, names in enumerate(saved) for n in names]
    flat_expected = [(i, n) for i, names in enumerate(expected) for n in names]
    rule = (
        "vanilla Trainer builds 2 groups: weight decay for every trainable parameter except biases "
        "and norm weights, then the rest (Trainer.create_optimizer); a run must use those groups to "
        "export to HF"
    )
    for position, (have, want) in enumerate(zip(flat_saved, flat_expected)):
        if have != want:
            raise IncompatibleModelError(
                f"optimizer parameter {position}: the run has {have[1]!r} in group {have[0]}, "
                f"vanilla Trainer would put {want[1]!r} in group {want[0]} there; {rule}"
            )
    if len(flat_saved) != len(flat_expected) or len(saved) != len(expected):
        extra = flat_saved[len(flat_expected):] or flat_expected[len(flat_saved):]
        first = f"; first differing parameter: {extra[0][1]!r}" if extra else ""
        raise IncompatibleModelError(
            f"the run's optimizer has {len(saved)} group(s) of {[len(s) for s in saved]} parameters, "
            f"vanilla Trainer would build {len(expected)} of {[len(e) for e in expected]}{first}; {rule}"
        )


def meta_model(config: dict[str, Any]) -> torch.nn.Module:
    import transformers

    model_type = config.get("model_type")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ConfigError(f"model config: unknown model_type {model_type!r} for this transformers") from None
    hf_config = config_class.from_dict(config)
    architectures = config.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        if model_class is not None:
            return model_class._from_config(hf_config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)


# -- Reading the composite -----------------------------------------------------------------


def _read_units(
    run: Run, sources: dict[str, int], layout: Layout, progress: Progress | None
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    weights: dict[str, torch.Tensor] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for done, unit in enumerate(layout.units, start=1):
        unit_weights, unit_state = split_unit(unit, layout.units[unit], *run.read_unit(sources[unit], unit))
        weights.update(unit_weights)
        per_param.update(unit_state)
        if progress is not None:
            progress(unit, done, len(layout.units))
    return weights, per_param


def trainer_rng_state(rng: dict[str, Any]) -> dict[str, Any]:
    """Our RNG record in ``Trainer._save_rng_state``'s non-distributed format."""
    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    cuda = rng.get("cuda")
    if cuda is not None:
        # Non-distributed Trainer saves (and loads) one device's state, not the list of all.
        out["cuda"] = cuda[0] if isinstance(cuda, (list, tuple)) else cuda
    return out


def trainer_state_json(extra: Any, step: int, train_batch_size: int) -> str:
    """The run's TrainerState (TailorTrainer saves it), or a minimal one for a plain Tailor run.
    Trainer divides the state's ``train_batch_size`` on resume (it only warns on a mismatch),
    so a minimal state must carry an integer one."""
    state = extra.get("trainer_state") if isinstance(extra, dict) else None
    if state is None:
        from dataclasses import asdict

        from transformers import TrainerState

        state = asdict(TrainerState(global_step=step, train_batch_size=train_batch_size))
    elif state.get("global_step") != step:
        raise IntegrityError(f"trainer_state of step {step} says global_step {state.get('global_step')}")
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


# -- Writing -------------------------------------------------------------------------------


def _write_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in weights.items()}, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())
    fsync_file(path)


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
    torch.save(obj, path)
    fsync_file(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


