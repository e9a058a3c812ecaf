"""The live training state seen unit by unit: what a save stages, and where a restore writes.

``TrainingState`` is the single-process state provider. It stages a unit as a dict of tensor
keys (``weight/<param>``, ``optim/<param>/<state key>``) to live tensors, and applies loaded
units back in place. Distributed providers (FSDP2, DeepSpeed) stage their local shards with
the same keys and chunk offsets.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from llmtailor.constants import KIND_OPTIM, KIND_WEIGHT
from llmtailor.errors import IncompatibleModelError, IntegrityError, TailorError, UnsupportedStateError
from llmtailor.layouts import Layout
from llmtailor.state import optimizer as optim_state
from llmtailor.state import rng, tree
from llmtailor.store.manifest import Manifest, dtype_name
from llmtailor.store.writer import StagedUnit


def join_key(kind: str, name: str, state_key: str | None = None) -> str:
    """A unit tensor key: ``<kind>/<parameter name>[/<state key>]`` (inverse of ``split_key``)."""
    return f"{kind}/{name}" if state_key is None else f"{kind}/{name}/{state_key}"


def weight_key(name: str) -> str:
    return join_key(KIND_WEIGHT, name)


def optim_key(name: str, state_key: str) -> str:
    return join_key(KIND_OPTIM, name, state_key)


def split_key(key: str) -> tuple[str, str, str | None]:
    """``(kind, parameter name, state key or None)`` of a unit tensor key."""
    kind, _, rest = key.partition("/")
    if kind == KIND_OPTIM:
        name, _, state_key = rest.rpartition("/")
        return kind, name, state_key
    return kind, rest, None


def split_unit(
    unit: str, names: tuple[str, ...], loaded: dict[str, torch.Tensor], values: dict[str, dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """A unit as read (``Run.read_unit``): its weights by parameter name, and its optimizer
    state by parameter name (tensors, and plain values decoded). Refuses a unit lacking the
    weight of any of ``names``. Other kinds (fp32 master copies) are left out."""
    missing = [name for name in names if weight_key(name) not in loaded]
    if missing:
        raise IntegrityError(f"unit {unit!r}: snapshot lacks the weights of {missing[:3]}")
    weights: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for key, tensor in loaded.items():
        kind, name, state_key = split_key(key)
        if kind == KIND_WEIGHT:
            weights[name] = tensor
        elif kind == KIND_OPTIM:
            state.setdefault(name, {})[state_key] = tensor
    for name, plain in values.items():
        for key, encoded in plain.items():
            state.setdefault(name, {})[key] = tree.decode(encoded, {}, f"{unit}.{name}.{key}")
    return weights, state


def _hf_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The Hugging Face config of ``model`` as plain JSON (exports need it), or None."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return json.loads(to_json(use_diff=False)) if callable(to_json) else None


def plain_value(value: Any, where: str) -> Any:
    """A non-tensor optimizer state value as JSON (it is stored in the manifest)."""
    doc, nested = tree.encode(value, where)
    if nested:
        raise UnsupportedStateError(f"{where} nests tensors inside a {type(value).__name__}; store them directly")
    return doc


class TrainingState:
    """Model, optimizer and LR scheduler of one process, addressed by unit and parameter name."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any | None,
        layout: Layout,
    ):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.layout = layout

    def tensors(self) -> dict[str, torch.Tensor]:
        """Canonical name -> live parameter or persistent buffer (refreshed on each call, so a
        model moved or re-wrapped after construction is still seen correctly)."""
        live = self.model.state_dict(keep_vars=True)
        return {name: live[name] for name in self.layout.tensor_names()}

    def name_of(self, tensors: dict[str, torch.Tensor]) -> dict[int, str]:
        return {id(t): name for name, t in tensors.items()}

    # -- save side --------------------------------------------------------------------------

    def stage_unit(self, unit: str, tensors: dict[str, torch.Tensor], copy: bool = False) -> StagedUnit:
        """The unit's weights and per-parameter optimizer state. With ``copy=False`` the staged
        tensors are the live ones (a synchronous save writes them before training resumes)."""
        staged: dict[str, torch.Tensor] = {}
        values: dict[str, dict[str, Any]] = {}
        for name in self.layout.units[unit]:
            param = tensors[name]
            staged[weight_key(name)] = param.detach()
            if self.optimizer is None:
                continue
            for key, value in optim_state.param_state(self.optimizer, param).items():
                if isinstance(value, torch.Tensor):
                    staged[optim_key(name, key)] = value.detach()
                else:
                    values.setdefault(name, {})[key] = plain_value(value, f"optimizer state {name}.{key}")
        if copy:
            staged = {k: t.to("cpu", copy=True) for k, t in staged.items()}
        return StagedUnit(unit=unit, tensors=staged, values=values)

    def capture_global(self, step: int, extra: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Everything saved every time: step, optimizer groups, scheduler, RNG, user extras."""
        return {
            "step": step,
            "optimizer_groups": (
                optim_state.group_records(self.optimizer, self.name_of(tensors)) if self.optimizer else None
            ),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": rng.capture_rng(),
            "model_config": _hf_config(self.model),
            "extra": extra,
        }

    # -- restore side -----------------------------------------------------------------------

    def check_compatible(self, manifest: Manifest, units: dict[str, Manifest]) -> None:
        """Refuse, before any tensor byte is read, a snapshot whose layout, names, shapes or
        dtypes differ from the live model. ``units`` maps each unit to its source manifest."""
        saved = Layout.from_record(manifest.layout)
        problems = self.layout.diff(saved)
        if not problems:
            live = self.tensors()
            for unit, source in units.items():
                if unit not in source.units:
                    problems.append(f"the composite names snapshot {source.step} for unit {unit!r}, which it does not hold")
                    continue
                for entry in source.units[unit].tensors:
                    kind, name, _ = split_key(entry.key)
                    if kind != KIND_WEIGHT:
                        continue
                    tensor = live.get(name)
                    if tensor is None:
                        problems.append(f"snapshot {source.step} holds {name!r}, which the model lacks")
                    elif list(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
                        problems.append(
                            f"{name}: model has {dtype_name(tensor.dtype)} {list(tensor.shape)}, "
                            f"snapshot {source.step} has {entry.dtype} {entry.shape}"
                        )
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} in all)" if len(problems) > 8 else "")
            raise IncompatibleModelError(
                f"the snapshot at step {manifest.step} does not fit this model "
                f"(snapshot layout {saved.family!r}, model layout {self.layout.family!r}): {shown}"
            )

    def apply_unit(
        self,
        unit: str,
        loaded: dict[str, torch.Tensor],
        values: dict[str, dict[str, Any]],
        live: dict[str, torch.Tensor],
        optimizer_state: dict[str, dict[str, Any]],
    ) -> None:
        """Copy the unit's weights into the live tensors in place; collect its optimizer state
        into ``optimizer_state`` (loaded by ``apply_global`` once every unit is in)."""
        weights, state = split_unit(unit, self.layout.units[unit], loaded, values)
        with torch.no_grad():
            for name, tensor in weights.items():
                live[name].copy_(tensor)
        for name, entries in state.items():
            optimizer_state.setdefault(name, {}).update(entries)

    def apply_global(
        self, state: dict[str, Any], optimizer_state: dict[str, dict[str, Any]], live: dict[str, torch.Tensor]
    ) -> Any:
        """Load optimizer (groups from the composite's step, per-parameter state from each unit's
        source), scheduler and RNG; return the user extras."""
        step = state.get("step")
        if self.optimizer is not None:
            groups = state.get("optimizer_groups")
            if groups is None:
                raise IncompatibleModelError("the snapshot was saved without an optimizer, but one was given")
            with _loading("optimizer state", step):
                optim_state.load_by_name(self.optimizer, groups, optimizer_state, self.name_of(live))
        if self.lr_scheduler is not None:
            if state.get("lr_scheduler") is None:
                raise IncompatibleModelError("the snapshot was saved without an LR scheduler, but one was given")
            with _loading("LR scheduler state", step):
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        with _loading("RNG state", step):
            rng.restore_rng(state["rng"])
        return state.get("extra")


@contextmanager
def _loading(what: str, step: Any) -> Iterator[None]:
    """Turn torch's or Python's complaint about malformed saved state into an IntegrityError.

    The saved state passed its checksum, so a malformed value means a crafted or buggy
    snapshot; the live object's own loader is the judge of its shape."""
    try:
        yield
    except TailorError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError, RuntimeError) as err:
        raise IntegrityError(
            f"the {what} in the snapshot of step {step} is malformed ({type(err).__name__}: {err})"
        ) from None
