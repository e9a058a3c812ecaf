"""DeepSpeed engines under ZeRO stage 1, 2 or 3 as state providers (``deepspeed_provider``).

What a unit holds (per parameter, by canonical name):

- ``master/<name>``: the fp32 master weight. The low-precision (bf16 / fp16) weights the model
  computes with are not stored: they are the masters cast, and a restore refreshes them from
  the restored masters (a frozen parameter, which has no master, is stored as ``weight/``);
- ``optim/<name>/<key>``: every optimizer state tensor of the parameter (``exp_avg``,
  ``exp_avg_sq``, ...);
- ``optim/<name>/step``: the step of the parameter's optimizer group (see below).

Names are the model's own: random-LTD's wrapper (``...layers.1.random_ltd_layer.self_attn...``)
is left out, as DeepSpeed's own checkpoints leave it out (``base.canonical_name``), so a run of an
engine with random-LTD on restores into one without it, or into a plain model.

Each rank writes only the fragments it owns, straight from DeepSpeed's own partitions (no
gather): under ZeRO-1/2 the fragment a parameter's ``_hp_mapping`` names (a contiguous range of
the flattened parameter, possibly empty, possibly split between ranks), under ZeRO-3 the
parameter's partition (``ceil(numel / world)`` elements at ``rank x that``, the padded tail
cut). A flat range is stored as the few boxes that tile it (``store.reader.flat_range_boxes``),
so the manifest's chunks stay boxes of the global tensor and any provider can read them.

Optimizer steps: DeepSpeed keeps one ``step`` per flat partition (per param group; per
sub-group under ZeRO-3), not per parameter. Each unit records its parameters' group step at
save time, so a restore into a plain torch optimizer gives every parameter the step of the
moments it gets. A restore into DeepSpeed sets each group's step from the composite's own step
(the global state of step T), the one value a group can hold; moments of units taken from an
older snapshot are then bias-corrected with T's step (the published LLMTailor overwrites every
step with the failure step; this is the same choice, made explicit). The manifest's ``notes``
say so.

The engine's own counters (``global_steps``, ``global_samples``, ``skipped_steps``: what
DeepSpeed names its checkpoints by and logs with) are kept in the global state
(``deepspeed.counters``) and set back on restore, as DeepSpeed's own ``load_checkpoint`` does; a
snapshot without them (saved from a plain torch model) leaves the engine's as they are.

Restore (any stage, any world size): for every parameter, this rank's fragment range is read
from the composite's chunks by byte range and copied into the masters and optimizer state in
place; the low-precision weights are then refreshed (ZeRO-1/2: ``update_lp_params``; ZeRO-3:
DeepSpeed's own fp32-to-fp16 partition refresh and the re-gather of persistent parameters).
"""

from __future__ import annotations

from typing import Any

from llmtailor.distributed.coordinator import Coordinator
from llmtailor.errors import IncompatibleModelError
from llmtailor.layouts import Layout
from llmtailor.providers.deepspeed.base import DeepSpeedProvider, is_engine, module_tensors


def deepspeed_provider(engine: Any, layout: Layout, coordinator: Coordinator, lr_scheduler: Any = None) -> DeepSpeedProvider:
    """The provider for ``engine``'s ZeRO stage (``zero12.py`` or ``zero3.py``)."""
    from llmtailor.providers.deepspeed.zero3 import Zero3Provider
    from llmtailor.providers.deepspeed.zero12 import Zero12Provider

    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2, 3) or not hasattr(engine.optimizer, "optimizer"):
        raise IncompatibleModelError(
            f"the DeepSpeed engine runs ZeRO stage {stage} with {type(engine.optimizer).__name__}; llmtailor "
            "reads DeepSpeed's ZeRO-1/2/3 optimizers"
        )
    kind = Zero3Provider if stage == 3 else Zero12Provider
    return kind(engine, layout, coordinator, lr_scheduler)


__all__ = ["DeepSpeedProvider", "deepspeed_provider", "is_engine", "module_tensors"]
