"""Executing a merge plan: stream one destination unit at a time into the output's sink.

``execute`` is one loop: the plan's units, each read just before it is written, go into the sink
of the chosen format (``outputs/sink.py``), which writes them straight into the output. Tensors
that move unchanged are copied as byte ranges from their source files (no decode, no re-encode;
hashed on the way and, from a tailored run, checked against their recorded checksums); a cast
or a scale reads the tensor and writes the result. Memory holds at most one unit's transformed
tensors (a model directory's weights: one shard's).

Output formats:

- ``tailor`` (default): a run holding one Full snapshot at the state source's step (parent
  none, policy ``merge of <plan file>``), written with the snapshot commit protocol
  (``outputs/run.py``): nothing appears in OUT unless the whole snapshot is committed. Global state
  (step, scheduler, RNG, trainer state) comes from the state source; optimizer groups are the
  plan's (``MergePlan.optimizer_groups``) or, weights only, dropped with the LR scheduler (a
  scheduler without its optimizer cannot be resumed, and Trainer loads them only as a pair);
  the model config has the plan's depth.
- ``hf``: a Trainer ``checkpoint-<step>/`` (``interop/hf/export.py``), with the tokenizer,
  written once, as the units come.
- ``model``: a ``save_pretrained``-style directory: ``model.safetensors``, ``config.json``,
  the sources' ``generation_config.json`` and the tokenizer, weights only, written once.

In ``hf`` and ``model`` outputs, weights over ``max_shard_size`` bytes (default 5 GB, as
mergekit) are split into shards ``model-00001-of-0000N.safetensors`` with their index
``model.safetensors.index.json``, as ``save_pretrained`` writes them; each output appears whole
or not at all, and nothing but the output is written (no scratch run: peak disk is the output).

Tokenizer files come from ``tokenizer_source`` (a source label, or ``base`` for the base
model), else from the base model, else the first slice's model, where they have any.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.errors import ConfigError
from llmtailor.merge.plan import FORMATS
from llmtailor.merge.planner import MergePlan, open_plan
from llmtailor.outputs.sink import DEFAULT_MAX_SHARD_SIZE, OutputUnit, Sink
from llmtailor.store import Progress, dtypes
from llmtailor.store.tensor_files import ByteSource
from llmtailor.store.keys import unit_weights

if TYPE_CHECKING:
    import torch

# torch is imported only where a tensor is built or transformed (a cast, a scale, optimizer
# state, a tailored-run output): a merge that moves bytes alone, into a model directory, runs
# without it (store/dtypes.py).

def merge(plan_file: str | Path, out: str | Path, *, format: str = "tailor", progress: Progress | None = None,
          max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Plan and execute ``plan_file`` into ``out``; return the snapshot (tailor),
    ``checkpoint-<step>`` (hf) or model (model) directory written. Raises TailorError, with
    nothing written, for a bad plan or an existing output."""
    with open_plan(plan_file, out, format) as plan:
        return execute(plan, out, format=format, progress=progress, max_shard_size=max_shard_size)


def execute(plan: MergePlan, out: str | Path, *, format: str = "tailor", progress: Progress | None = None,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write ``plan`` into ``out`` (see the module docstring); a run (``tailor``) may be at an
    object-store URL. ``max_shard_size``: bytes (or ``5GB``, ``500MB``) per weights file of an
    ``hf`` or ``model`` output."""
    sink = output_sink(plan, out, format, max_shard_size)
    return sink.write(_stream_units(plan), len(plan.layout.units), progress)


def output_sink(plan: MergePlan, out: str | Path, format: str, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Sink:
    """The sink of ``format`` at ``out`` for ``plan``: built, and what it refuses refused,
    before any tensor byte is read."""
    from llmtailor.store.storage import is_url

    if format not in FORMATS:
        raise ConfigError(f"unknown output format {format!r}; expected one of {FORMATS}")
    if format == "tailor":
        from llmtailor.outputs.run import RunSink

        return RunSink(out, step=plan.step, layout=plan.layout.to_record(), state=_global_state(plan),
                       origin=f"merge of {plan.plan_file}")
    if is_url(out):
        raise ConfigError(f"{out}: --format {format} writes a local directory; write it there and upload it, or "
                          "merge into a run at the URL with --format tailor")
    from llmtailor.interop.hf.export import ModelDirSink, TrainerCheckpointSink

    if format == "model":
        if plan.model_config is None:
            raise ConfigError(f"{plan.plan_file}: no source holds a model config; --format model needs one")
        return ModelDirSink(out, plan.model_config, _weight_sizes(plan), [*_generation_config(plan), *tokenizer_files(plan)],
                            max_shard_size)
    return TrainerCheckpointSink(out, plan.step, _global_state(plan), plan.layout, _weight_sizes(plan),
                                 origin=f"{plan.plan_file}: the merge at step {plan.step}", extra_files=tokenizer_files(plan),
                                 max_shard_size=max_shard_size)


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


def _stream_units(plan: MergePlan) -> Iterator[OutputUnit]:
    """The output's units, each read when asked for (just before it is written)."""
    for unit, actions in plan.actions_by_unit().items():
        yield OutputUnit(unit, _tensors(plan, actions), _values(plan, unit, actions))


def _weight_sizes(plan: MergePlan) -> dict[str, int]:
    """Every weight the output holds (``keys.unit_weights``) by name, with its bytes, in the
    order the units come: from the plan, before any byte is read."""
    sizes: dict[str, int] = {}
    for actions in plan.actions_by_unit().values():
        sizes.update({name: a.written.nbytes for name, a in unit_weights({a.dest_key: a for a in actions}).items()})
    return sizes


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


def _generation_config(plan: MergePlan) -> list[Path]:
    """The state source's (or first slice's) ``generation_config.json``, where it has one."""
    for label in (plan.state_from, *plan.sources):
        found = getattr(plan.sources[label], "generation_config", lambda: None)()
        if found is not None:
            return [found]
    return []
