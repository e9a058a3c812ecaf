"""Hugging Face directories as sinks (``outputs/sink.py``): a Trainer ``checkpoint-N/``
(``TrainerCheckpointSink``; ``export_hf`` writes a composite through it, ``merge --format hf`` a
merge) and a ``save_pretrained`` model directory (``ModelDirSink``, ``merge --format model``).

Vanilla ``transformers.Trainer.train(resume_from_checkpoint=OUT/checkpoint-N)`` resumes from
the checkpoint with no llmtailor code: the files are the ones Trainer's own ``_save_checkpoint``
writes, in the formats its ``_load_*`` methods read::

    model.safetensors        every canonical weight under its HF name (tied aliases once, as
                             ``save_pretrained`` does), metadata {"format": "pt"}; over
                             ``max_shard_size`` bytes (default 5 GB, mergekit's), shards
                             ``model-00001-of-0000N.safetensors`` and their index
                             ``model.safetensors.index.json``, as ``save_pretrained`` writes them
    config.json              the model config saved with the run
    generation_config.json   ``GenerationConfig.from_model_config`` of that config
    optimizer.pt             ``Optimizer.state_dict()`` layout: indices follow the run's param
                             groups, which must be Trainer's own decay / no-decay groups
    scheduler.pt             the LR scheduler's state dict (Trainer loads it only beside optimizer.pt)
    rng_state.pth            {"python", "numpy", "cpu"[, "cuda"]} as ``Trainer._save_rng_state``;
                             for a run saved by N processes, rng_state_<rank>.pth of each, as
                             Trainer writes them under DDP (each rank's ``cuda``: all devices')
    trainer_state.json       the TrainerState saved by ``TailorTrainer`` (``TRAINER_STATE_KEY``),
                             or kept by an import of a Trainer checkpoint (else a minimal one)

Every ``.pt``/``.pth`` file loads with ``torch.load(..., weights_only=True)`` (rng_state.pth
under transformers' ``safe_globals()``, like Trainer's own). Not written: ``training_args.bin``
(a pickled TrainingArguments; resuming does not read it) and tokenizer files (the run does not
know the tokenizer; ``extra_files`` copies a merge's in). A peft model's checkpoint holds its
adapters (``interop/hf/peft.py``) instead of the weights, as Trainer writes it.

A model directory holds the weights as above (sharded alike), ``config.json`` and side files
copied in (a generation config, tokenizer files): weights only, and no torch imported for
weights copied as bytes.

Invariants: everything a checkpoint needs is checked when its sink is built, before any tensor
byte is read, with the run's optimizer groups against the groups vanilla Trainer builds for the
model (same parameters, same order), so optimizer state lands on the right parameter; weights
are written shard by shard as the units come (memory: one shard), optimizer state is gathered
(optimizer.pt is one file); the directory appears whole (written under a temporary name,
fsynced, renamed) or not at all; an existing ``checkpoint-N`` is never overwritten.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError, IntegrityError
from llmtailor.interop.hf.files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    checkpoint_dirname,
    rank_rng_file,
    weights_shard_name,
)
from llmtailor.interop.tailored import composite_units, composite_weight_sizes
from llmtailor.layouts import Layout
from llmtailor.outputs.directory import copy_durable, publishing, write_text_durable
from llmtailor.outputs.shards import ShardPlan, ShardWriter
from llmtailor.outputs.sink import DEFAULT_MAX_SHARD_SIZE, OutputUnit, Sink, counted, parse_size
from llmtailor.store import Progress
from llmtailor.store.storage.local_durable import Syncer, fsync_file
from llmtailor.store.tensor_files import ByteSource
from llmtailor.store.keys import split_unit, unit_weights
from llmtailor.store.run import Run

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
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write the composite of ``step`` (default: the newest) as ``out_dir/checkpoint-<step>/``
    and return that path. ``extra_files`` (a tokenizer's, say) are copied in beside.

    Reads one unit at a time. Raises TailorError (nothing written) when the run lacks what the
    format needs, when its optimizer groups are not the ones vanilla Trainer builds, or when
    the target directory exists."""
    composite = run.resolve(step)
    layout = Layout.from_record(composite.manifest.layout)
    missing = [u for u in layout.units if u not in composite.sources]
    if missing:
        raise IntegrityError(f"composite of step {composite.step} names no version of units {missing}")
    ranks = [run.read_rank_state(composite.step, rank) for rank in range(1, composite.manifest.world_size)]
    sink = TrainerCheckpointSink(
        out_dir, composite.step, run.whole_global(composite.step), layout,
        composite_weight_sizes(run, composite.sources, layout), origin=f"{run.root}: the snapshot of step {composite.step}",
        train_batch_size=train_batch_size, extra_files=extra_files, max_shard_size=max_shard_size,
        rank_rngs=[(own or {}).get("rng") for own in ranks],
    )
    return sink.write(composite_units(run, composite.sources, layout), len(layout.units), progress)


def weight_shards(sizes: dict[str, int], max_shard_size: int | str) -> ShardPlan:
    """The split of a model's weights (name -> bytes, in the order they come) into
    ``model.safetensors`` or its shards, as ``save_pretrained`` names them."""
    return ShardPlan.split(sizes, parse_size(max_shard_size), WEIGHTS_FILE, weights_shard_name)


class TrainerCheckpointSink(Sink):
    """``out_dir/checkpoint-<step>/`` of the units and the global ``state`` (module docstring).
    ``layout`` is the units' layout; ``sizes`` the bytes of every weight (``keys.unit_weights``)
    in the order they come; ``origin`` names what is written in messages; ``rank_rngs``: the RNG
    states of ranks 1, 2, ... of a run saved by several processes (rank 0's is ``state``'s)."""

    def __init__(self, out_dir: str | Path, step: int, state: dict[str, Any], layout: Layout, sizes: dict[str, int], *,
                 origin: str, train_batch_size: int = 1, extra_files: Iterable[Path] = (),
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, rank_rngs: list[dict[str, Any] | None] = ()):
        self.config, self.groups, self.scheduler = _checked_state(state, layout, origin)
        self.out_dir, self.step, self.state, self.layout, self.origin = Path(out_dir), step, state, layout, origin
        self.adapters = state.get("peft_config")  # a PeftModel's run: Trainer checkpoints hold the adapters only
        self.shards = None if self.adapters else weight_shards(sizes, max_shard_size)
        self.train_batch_size, self.extra_files = train_batch_size, [Path(p) for p in extra_files]
        self.rngs = [state.get("rng"), *rank_rngs]

    def write(self, units: Iterable[OutputUnit], count: int, progress: Progress | None = None) -> Path:
        with publishing(self.out_dir, checkpoint_dirname(self.step)) as tmp:
            per_param = self._write_weights(tmp, counted(units, count, progress))
            _write_config(tmp, self.config)
            if self.groups is not None:
                from llmtailor.providers.optimizer import positional_state_dict

                _save_torch(tmp / OPTIMIZER_FILE, positional_state_dict(self.groups, per_param))
                _save_torch(tmp / SCHEDULER_FILE, self.scheduler)
            del per_param
            ranked = len(self.rngs) > 1  # Trainer's file names and cuda states under DDP
            for rank, rng in enumerate(self.rngs):
                if rng is not None:  # an import from DeepSpeed alone holds none; Trainer then warns
                    _save_torch(tmp / (rank_rng_file(rank) if ranked else RNG_FILE), trainer_rng_state(rng, ranked))
            from llmtailor.providers.stateful import saved_state  # providers/ imports torch: not on a merge's byte path

            write_text_durable(tmp / TRAINER_STATE_FILE,
                               trainer_state_json(saved_state(self.state, TRAINER_STATE_KEY), self.step, self.train_batch_size))
            for path in self.extra_files:  # tokenizer files, say
                copy_durable(path, tmp / path.name)
        return self.out_dir / checkpoint_dirname(self.step)

    def _write_weights(self, tmp: Path, units: Iterator[OutputUnit]) -> dict[str, dict[str, Any]]:
        """The weights (a peft model's: its adapters) into ``tmp`` as the units come; their
        optimizer state by parameter name, gathered."""
        from llmtailor.interop.hf.peft import AdapterFiles

        per_param: dict[str, dict[str, Any]] = {}
        with Syncer() as syncer:  # a shard's flushes overlap the writing of the next
            files = (AdapterFiles(tmp, self.adapters, self.layout, self.origin) if self.adapters
                     else ShardWriter(tmp, self.shards, WEIGHTS_INDEX_FILE, syncer))
            for unit in units:
                weights, state = split_unit(unit.name, self.layout.units[unit.name], unit.tensors, unit.values)
                files.add(weights)
                per_param.update({name: {k: _loaded(v) for k, v in entries.items()} for name, entries in state.items()})
            files.finish()
        return per_param


class ModelDirSink(Sink):
    """A ``save_pretrained``-style directory ``out`` (missing or empty; module docstring): the
    weights of every unit (``keys.unit_weights``; byte ranges of source files copied as they
    are) in the shards of ``sizes`` (name -> bytes, in the order they come), ``config.json``,
    and ``side_files`` (a generation config, tokenizer files) copied in. Appears whole or not
    at all; imports no torch for byte sources."""

    def __init__(self, out: str | Path, config: dict[str, Any], sizes: dict[str, int], side_files: Iterable[Path] = (),
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
        self.out, self.config, self.side_files = Path(out), config, [Path(p) for p in side_files]
        self.shards = weight_shards(sizes, max_shard_size)

    def write(self, units: Iterable[OutputUnit], count: int, progress: Progress | None = None) -> Path:
        with publishing(self.out.parent, self.out.name, replace_empty=True) as tmp:
            with Syncer() as syncer:  # a shard's flushes overlap the writing of the next
                shards = ShardWriter(tmp, self.shards, WEIGHTS_INDEX_FILE, syncer)
                for unit in counted(units, count, progress):
                    shards.add(unit_weights(unit.tensors))
                shards.finish()
            write_text_durable(tmp / CONFIG_FILE, _config_json(self.config))
            for path in self.side_files:
                copy_durable(path, tmp / path.name)
        return self.out


def _checked_state(state: dict[str, Any], layout: Layout, origin: str) -> tuple[dict[str, Any], Any, Any]:
    """The model config, optimizer groups and LR scheduler of ``state``, after checking it holds
    what a Trainer checkpoint needs (before any tensor byte is read)."""
    from llmtailor.interop.hf.model import check_trainer_groups

    config = state.get("model_config")
    if not isinstance(config, dict):
        raise ConfigError(f"{origin} holds no Hugging Face model config; an HF export needs a transformers model "
                          "(one with .config)")
    groups, scheduler = state.get("optimizer_groups"), state.get("lr_scheduler")
    if (groups is None) != (scheduler is None):
        have, lack = ("optimizer", "LR scheduler") if scheduler is None else ("LR scheduler", "optimizer")
        raise ConfigError(f"{origin} holds {have} state but no {lack}; Trainer loads optimizer.pt and scheduler.pt "
                          "only as a pair")
    if groups is not None:
        check_trainer_groups(config, layout, groups, state.get("peft_config"))
    return config, groups, scheduler


def trainer_rng_state(rng: dict[str, Any], distributed: bool = False) -> dict[str, Any]:
    """Our RNG record in ``Trainer._save_rng_state``'s format, non-distributed or (``distributed``)
    one process's of several."""
    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    cuda = rng.get("cuda")
    if cuda is not None:
        # Non-distributed Trainer saves (and loads) one device's state; under DDP, the list of all.
        out["cuda"] = cuda if distributed else cuda[0] if isinstance(cuda, (list, tuple)) else cuda
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


def _loaded(value: Any) -> Any:
    """An optimizer state value as ``optimizer.pt`` holds it: bytes from a file loaded."""
    return value.load() if isinstance(value, ByteSource) else value


def _config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _write_config(root: Path, config: dict[str, Any]) -> None:
    write_text_durable(root / CONFIG_FILE, _config_json(config))
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
