"""Executing a merge plan: stream one destination unit at a time into one committed snapshot.

The output is a tailored run holding one Full snapshot at ``state_from``'s step (parent none,
policy ``merge of <plan file>``), written with the snapshot commit protocol (``persist``):
nothing appears in OUT unless the whole snapshot is committed. Memory holds one unit's tensors
at a time. Global state (step, scheduler, RNG, trainer state, model config) comes from
``state_from``; the optimizer's param groups are kept unchanged (same parameter names, same
depth) or, with ``optimizer: false``, dropped together with the LR scheduler state (a
scheduler without its optimizer cannot be resumed, and Trainer loads them only as a pair).

``--format hf`` writes the tailored snapshot into a temporary run beside OUT and exports it
with ``export_hf`` into ``OUT/checkpoint-<step>/``: the merged bytes are written twice.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from llmtailor.errors import ConfigError
from llmtailor.merge.planner import MergePlan, open_plan
from llmtailor.store import codec
from llmtailor.store.lock import WriterLock
from llmtailor.store.run import Run
from llmtailor.store.writer import StagedSnapshot, StagedUnit, counting, persist

Progress = Callable[[str, int, int], None]
"""Called after each unit is written: ``(unit, units done, units in all)``."""

FORMATS = ("tailor", "hf")


def merge(plan_file: str | Path, out: str | Path, *, format: str = "tailor", progress: Progress | None = None) -> Path:
    """Plan and execute ``plan_file`` into ``out``; return the snapshot (tailor) or
    ``checkpoint-<step>`` (hf) directory written. Raises TailorError, with nothing written,
    for a bad plan or an existing output at that step."""
    with open_plan(plan_file, out) as plan:
        return execute(plan, out, format=format, progress=progress)


def execute(plan: MergePlan, out: str | Path, *, format: str = "tailor", progress: Progress | None = None) -> Path:
    """Write ``plan`` into ``out`` (see the module docstring)."""
    out = Path(out)
    if format not in FORMATS:
        raise ConfigError(f"unknown output format {format!r}; expected one of {FORMATS}")
    if format == "tailor":
        if Run(out).snapshot_dir(plan.step).exists():
            raise ConfigError(f"{out} already holds a snapshot at step {plan.step}; refusing to overwrite it")
        return _write_snapshot(plan, Run(out), progress).path

    from llmtailor.interop.hf_export import checkpoint_dirname, export_hf

    target = out / checkpoint_dirname(plan.step)
    if target.exists():
        raise ConfigError(f"{target} already exists; refusing to overwrite it (choose another -o)")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.merge-", dir=out.parent))
    try:
        run = Run(scratch / "run")
        _write_snapshot(plan, run, progress)
        return export_hf(run, plan.step, out, progress=progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_snapshot(plan: MergePlan, run: Run, progress: Progress | None):
    state_from = plan.sources[plan.state_from]
    state = state_from.run.read_global(plan.step)
    if not plan.optimizer:
        state["optimizer_groups"] = None
        state["lr_scheduler"] = None
    config = state.get("model_config")
    if isinstance(config, dict) and config.get("num_hidden_layers") not in (None, plan.layout.num_layers):
        config["num_hidden_layers"] = plan.layout.num_layers
        if isinstance(config.get("layer_types"), list):
            kinds = set(config["layer_types"])
            if len(kinds) != 1:
                raise ConfigError("cannot change the depth of a model whose config mixes layer_types")
            config["layer_types"] = [kinds.pop()] * plan.layout.num_layers
    global_doc, global_tensors = codec.encode(state, where="global state")
    staged = StagedSnapshot(
        step=plan.step,
        parent=None,
        save_index=0,
        policy=f"merge of {plan.plan_file}",
        layout=plan.layout.to_record(),
        units=_stream_units(plan),  # read just before written: one unit in memory at a time
        composite={unit: plan.step for unit in plan.layout.units},
        global_doc=global_doc,
        global_tensors=global_tensors,
    )
    lock = WriterLock(run.root)
    lock.acquire()
    try:
        return persist(run, staged, on_unit=counting(progress, len(plan.layout.units)))
    finally:
        lock.release()


def _stream_units(plan: MergePlan) -> Iterator[StagedUnit]:
    for unit, actions in plan.actions_by_unit().items():
        first = actions[0]
        tensors, values = plan.sources[first.source].run.read_unit(first.step, first.source_unit)
        renamed = {a.dest_key: tensors[a.source_key] for a in actions}
        names = plan.renames[unit]
        kept = {names[name]: v for name, v in values.items()} if plan.optimizer else {}
        yield StagedUnit.whole(unit, renamed, kept)
