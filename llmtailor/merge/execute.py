"""Executing a merge plan: stream one destination unit at a time into the output.

Tensors that move unchanged are copied as byte ranges from their source files (no decode, no
re-encode; hashed on the way and, from a tailored run, checked against their recorded
checksums); a cast or a scale reads the tensor and writes the result. Memory holds at most one
unit's transformed tensors.

Output formats:

- ``tailor`` (default): a run holding one Full snapshot at the state source's step (parent
  none, policy ``merge of <plan file>``), written with the snapshot commit protocol
  (``store/single.py``): nothing appears in OUT unless the whole snapshot is committed. Global state
  (step, scheduler, RNG, trainer state) comes from the state source; optimizer groups are the
  plan's (``MergePlan.optimizer_groups``) or, weights only, dropped with the LR scheduler (a
  scheduler without its optimizer cannot be resumed, and Trainer loads them only as a pair);
  the model config has the plan's depth.
- ``hf``: a Trainer ``checkpoint-<step>/`` (the snapshot written into a temporary run beside
  OUT and exported with ``export_hf``: the merged bytes are written twice), with the tokenizer.
- ``model``: a ``save_pretrained``-style directory: ``model.safetensors``, ``config.json``,
  the sources' ``generation_config.json`` and the tokenizer, weights only, written once;
  appears whole or not at all.

Tokenizer files come from ``tokenizer_source`` (a source label, or ``base`` for the base
model), else from the base model, else the first slice's model, where they have any.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.errors import ConfigError
from llmtailor.merge.plan import FORMATS
from llmtailor.merge.planner import MergePlan, open_plan
from llmtailor.store import dtypes
from llmtailor.store.tensor_files import ByteSource
from llmtailor.store.keys import split_key
from llmtailor.store.run import Run
from llmtailor.store import Progress

if TYPE_CHECKING:
    import torch

    from llmtailor.store.staged import StagedUnit

# torch is imported only where a tensor is built or transformed (a cast, a scale, optimizer
# state, a tailored-run output): a merge that moves bytes alone, into a model directory, runs
# without it (store/dtypes.py).

def merge(plan_file: str | Path, out: str | Path, *, format: str = "tailor", progress: Progress | None = None) -> Path:
    """Plan and execute ``plan_file`` into ``out``; return the snapshot (tailor),
    ``checkpoint-<step>`` (hf) or model (model) directory written. Raises TailorError, with
    nothing written, for a bad plan or an existing output."""
    with open_plan(plan_file, out, format) as plan:
        return execute(plan, out, format=format, progress=progress)


def execute(plan: MergePlan, out: str | Path, *, format: str = "tailor", progress: Progress | None = None) -> Path:
    """Write ``plan`` into ``out`` (see the module docstring); a run (``tailor``) may be at an
    object-store URL."""
    from llmtailor.store.storage import is_url

    if format not in FORMATS:
        raise ConfigError(f"unknown output format {format!r}; expected one of {FORMATS}")
    if format == "tailor":
        run = Run(out)
        if run.steps():
            raise ConfigError(f"{out} already holds snapshots (steps {run.steps()}); merge into a new or empty directory")
        return _write_snapshot(plan, run, progress).path
    if is_url(out):
        raise ConfigError(f"{out}: --format {format} writes a local directory; write it there and upload it, or "
                          "merge into a run at the URL with --format tailor")
    out = Path(out)
    if format == "model":
        return _write_model(plan, out, progress)

    from llmtailor.interop.hf.export import export_hf
    from llmtailor.interop.hf.files import checkpoint_dirname

    target = out / checkpoint_dirname(plan.step)
    if target.exists():
        raise ConfigError(f"{target} already exists; refusing to overwrite it (choose another -o)")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.merge-", dir=out.parent))
    try:
        run = Run(scratch / "run")
        _write_snapshot(plan, run, progress)
        return export_hf(run, plan.step, out, progress=progress, extra_files=tokenizer_files(plan))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def tokenizer_files(plan: MergePlan) -> list[Path]:
    """The tokenizer files an hf / model output gets (module docstring)."""
    spec = plan.spec
    label = spec.tokenizer_source
    if label in (None, "base"):
        label = spec.base_model or (spec.models[0].model if spec.models else spec.slices[0].sources[0].model)
    return plan.sources[label].tokenizer_files()


def _global_state(plan: MergePlan) -> dict[str, Any]:
    state = plan.sources[plan.state_from].global_state(plan.optimizer)
    state = dict(state) if state is not None else {"lr_scheduler": None, "rng": None, "extra": None}
    state.update(step=plan.step, model_config=plan.model_config)
    if plan.optimizer:
        state["optimizer_groups"] = plan.optimizer_groups
    else:
        state["optimizer_groups"] = state["lr_scheduler"] = None
    return state


def _write_snapshot(plan: MergePlan, run: Run, progress: Progress | None):
    from llmtailor.store.single import write_single_snapshot

    return write_single_snapshot(
        run.storage, step=plan.step, layout=plan.layout.to_record(),
        units=_stream_units(plan),  # read just before written: one unit in memory at a time
        state=_global_state(plan), origin=f"merge of {plan.plan_file}", progress=progress,
    )


def _stream_units(plan: MergePlan) -> Iterator[StagedUnit]:
    from llmtailor.store.staged import StagedUnit

    for unit, actions in plan.actions_by_unit().items():
        yield StagedUnit.whole(unit, _tensors(plan, actions), _values(plan, unit, actions))


def _tensors(plan: MergePlan, actions) -> dict[str, torch.Tensor | ByteSource]:
    out = {}
    for a in actions:
        value = plan.sources[a.source].read(a.source_unit, a.source_key)
        if not a.unchanged:  # mergekit's order: cast as read, scale, cast as written
            tensor = value.load() if isinstance(value, ByteSource) else value
            if a.read_dtype is not None:
                tensor = tensor.to(dtypes.to_torch(a.read_dtype))
            if a.rows is not None:
                tensor = _take_rows(tensor, a.rows)
            if a.scale not in (None, 1.0):
                tensor = tensor * a.scale
            value = tensor.to(dtypes.to_torch(a.dtype)) if a.dtype is not None else tensor
        out[a.dest_key] = value
    return out


def _take_rows(tensor: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """Row i of the result is ``tensor``'s row ``rows[i]``, a zero row where that is -1."""
    import torch

    index = torch.tensor(rows, dtype=torch.long)
    out = tensor.new_zeros((len(rows), *tensor.shape[1:]))
    keep = index >= 0
    out[keep] = tensor[index[keep]]
    return out


def _values(plan: MergePlan, unit: str, actions) -> dict[str, dict[str, Any]]:
    if not plan.optimizer or not actions:
        return {}
    first = actions[0]
    names = plan.renames[unit]
    return {names[name]: v for name, v in plan.sources[first.source].values(first.source_unit).items() if name in names}


def _write_model(plan: MergePlan, out: Path, progress: Progress | None) -> Path:
    """A ``save_pretrained``-style directory of the merged weights (module docstring)."""
    from llmtailor.interop.hf.export import write_model_dir

    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; refusing to overwrite it (choose another -o)")
    if plan.model_config is None:
        raise ConfigError(f"{plan.plan_file}: no source holds a model config; --format model needs one")
    weights: dict[str, torch.Tensor | ByteSource] = {}
    units = plan.actions_by_unit()
    for done, (unit, actions) in enumerate(units.items(), start=1):
        weights.update({split_key(key)[1]: value for key, value in _tensors(
            plan, [a for a in actions if split_key(a.dest_key)[0] == "weight"]).items()})
        if progress is not None:
            progress(unit, done, len(units))
    return write_model_dir(out, weights, plan.model_config, [*_generation_config(plan), *tokenizer_files(plan)])


def _generation_config(plan: MergePlan) -> list[Path]:
    """The state source's (or first slice's) ``generation_config.json``, where it has one."""
    for label in (plan.state_from, *plan.sources):
        found = getattr(plan.sources[label], "generation_config", lambda: None)()
        if found is not None:
            return [found]
    return []
