"""Export a composite as a DeepSpeed *universal* checkpoint, which ``engine.load_checkpoint``
loads into ZeRO-1/2 engines of any world size (DeepSpeed config ``"checkpoint":
{"load_universal": true}``).

Written (DeepSpeed's own universal layout, as ``deepspeed.checkpoint.ds_to_universal`` makes
it; ``.pt`` files written with ``torch.save``, as DeepSpeed reads them)::

    OUT/latest_universal                            the tag, ``global_step<N>``
    OUT/global_step<N>/mp_rank_00_model_states.pt   module weights (the fp32 masters), parameter
                                                    names and shapes by optimizer group, tied
                                                    names, LR scheduler, global step,
                                                    the snapshot's extras as the client_state
                                                    load_checkpoint returns
    OUT/global_step<N>/zero/<name>/fp32.pt          {"param": master, "cat_dim": 0}
    OUT/global_step<N>/zero/<name>/<key>.pt         each optimizer state tensor, likewise
    OUT/global_step<N>/zero/<name>/step.pt          the optimizer step of the parameter's group
    OUT/global_step<N>/zero/optimizer_state.pt      the groups' hyperparameters

DeepSpeed keeps one step per group: each group gets the composite's own step (the step of its
parameters saved at the composite's step), as a restore into an engine does. Every
parameter's optimizer state must be in the composite (one optimizer group per saved
group, matched by names), and every tensor must be a trained parameter: a universal checkpoint's
load sets those alone (a composite holding frozen parameters or buffers is refused). ZeRO-3
engines load universal checkpoints through per-rank optimizer files this layout does not have:
restore those with ``Tailor(run, engine).restore()`` (any stage, any world size) instead. The
directory appears whole (written under a temporary name, renamed) or not at all.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmtailor.errors import ConfigError, IncompatibleModelError
from llmtailor.layouts import Layout
from llmtailor.store.catalog import Composite
from llmtailor.store.storage.local_durable import fsync_dir, replace_text_atomically
from llmtailor.store.keys import split_unit
from llmtailor.outputs.directory import publishing
from llmtailor.store.run import Run
from llmtailor.store import Progress

LATEST = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"


@dataclass
class _Module:
    """What ``mp_rank_00_model_states.pt`` gathers while the units are written."""

    weights: dict[str, torch.Tensor] = field(default_factory=OrderedDict)
    steps: dict[str, float] = field(default_factory=dict)  # optimizer step of each parameter


def export_deepspeed(run: Run, step: int | None, out_dir: str | Path, *, progress: Progress | None = None) -> Path:
    """Write the composite of ``step`` (default: the newest) as a universal checkpoint in
    ``out_dir`` and return its ``global_step<N>`` directory. Reads one unit at a time."""
    out_dir = Path(out_dir)
    composite = run.resolve(step)
    step = composite.step
    layout = Layout.from_record(composite.manifest.layout)
    state = run.whole_global(step)  # a pipelined run: every stage's groups
    groups = state.get("optimizer_groups")
    if not groups:
        raise ConfigError(f"{run.root}: the snapshot of step {step} holds no optimizer state; a DeepSpeed checkpoint needs it")
    trainable = {name for group in groups for name in group["params"]}
    _refuse_untrained(layout, trainable, step)
    tag = f"global_step{step}"
    with publishing(out_dir, tag) as tmp:
        module = _Module()
        for done, unit in enumerate(layout.units, start=1):
            weights, per_param = split_unit(unit, layout.units[unit], *run.read_unit(composite.sources[unit], unit))
            for name, weight in weights.items():  # every one trained (_refuse_untrained)
                module.weights[name] = weight
                _write_parameter(tmp / "zero" / name, weight, per_param.get(name), module, step)
            if progress is not None:
                progress(unit, done, len(layout.units))
        _write_steps(tmp, groups, module.steps, composite, layout)
        _save(tmp / "zero" / "optimizer_state.pt", {
            "ds_version": _ds_version(),
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]} for i, g in enumerate(groups)],
        })
        _save(tmp / MODEL_STATES, _model_states(module, groups, layout, state, step))
    replace_text_atomically(out_dir / LATEST, tag)
    fsync_dir(out_dir)
    return out_dir / tag


def _refuse_untrained(layout: Layout, trainable: set[str], step: int) -> None:
    """Refuse a composite holding tensors no optimizer group holds (frozen parameters, persistent
    buffers): DeepSpeed's ``load_checkpoint`` of a universal checkpoint sets the trained
    parameters alone, from ``zero/`` (it never loads the module's state dict), so it would report
    the checkpoint loaded and leave those tensors as the engine had them."""
    untrained = [name for name in layout.tensor_names() if name not in trainable]
    if untrained:
        shown = ", ".join(map(repr, untrained[:3])) + (f", ... ({len(untrained)} in all)" if len(untrained) > 3 else "")
        raise IncompatibleModelError(
            f"the composite of step {step} holds tensors no optimizer group holds ({shown}: frozen parameters or "
            "buffers), which DeepSpeed's load_checkpoint of a universal checkpoint does not load (it sets only the "
            "trained parameters) and would leave as the engine has them: restore the run into the engine with "
            "Tailor(run, engine).restore() (any ZeRO stage, frozen parameters included), or assemble --format hf"
        )


def _write_parameter(folder: Path, weight: torch.Tensor, entries: dict[str, Any] | None, module: _Module, step: int) -> None:
    """``zero/<name>/``: the fp32 master and each optimizer state tensor of one parameter."""
    name = folder.name
    if not entries:
        raise IncompatibleModelError(f"composite of step {step}: {name!r} has no optimizer state to export")
    folder.mkdir(parents=True)
    _save(folder / "fp32.pt", {"param": weight.float(), "cat_dim": 0})
    for key, value in entries.items():
        if key == "step":
            module.steps[name] = float(value)
        elif isinstance(value, torch.Tensor) and value.shape == weight.shape:
            _save(folder / f"{key}.pt", {"param": value.float(), "cat_dim": 0})


def _write_steps(tmp: Path, groups: list[dict[str, Any]], steps: dict[str, float], composite: Composite, layout: Layout) -> None:
    """DeepSpeed holds one step per group: the composite's own (see providers.deepspeed), the
    step of the group's parameters saved at the composite's step."""
    for group in groups:
        own = [steps[n] for n in group["params"] if n in steps and composite.sources[layout.unit_of(n)] == composite.step]
        value = max(own or [steps[n] for n in group["params"] if n in steps] or [0.0])
        for name in group["params"]:
            _save(tmp / "zero" / name / "step.pt", torch.tensor(value))


def _ds_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _model_states(module: _Module, groups, layout: Layout, state: dict[str, Any], step: int) -> dict[str, Any]:
    shapes = {name: weight.shape for name, weight in module.weights.items()}
    return {
        "module": module.weights,
        "buffer_names": [],  # none: a composite holding any is refused (_refuse_untrained)
        "optimizer": None,
        "param_shapes": [OrderedDict((name, shapes[name]) for name in group["params"]) for group in groups],
        "frozen_param_shapes": None,
        "shared_params": dict(layout.aliases),
        "frozen_param_fragments": None,
        "lr_scheduler": state.get("lr_scheduler"),
        "data_sampler": (state.get("deepspeed") or {}).get("data_sampler"),  # an engine's own, where a run kept it
        "random_ltd": (state.get("deepspeed") or {}).get("random_ltd"),
        "skipped_steps": 0,
        "global_steps": step,
        "global_samples": 0,
        **(state.get("deepspeed") or {}).get("counters", {}),  # the engine's own, where a DeepSpeed run kept them
        "dp_world_size": 1,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {},
        "ds_version": _ds_version(),
        **_client_state(state.get("extra")),
    }


def _client_state(extra: Any) -> dict[str, Any]:
    """The snapshot's extras (a dict of them) as ``save_checkpoint``'s ``client_state``, which
    ``engine.load_checkpoint`` gives back (an import keeps it so: ``importer._client_state``);
    without the keys the engine writes itself, and the note of where an import came from."""
    from llmtailor.interop.deepspeed.importer import DEEPSPEED_KEYS, IMPORT_NOTES

    if not isinstance(extra, dict):
        return {}
    return {k: v for k, v in extra.items() if isinstance(k, str) and k not in DEEPSPEED_KEYS and k not in IMPORT_NOTES}


def _save(path: Path, obj: Any) -> None:
    torch.save(obj, path)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
