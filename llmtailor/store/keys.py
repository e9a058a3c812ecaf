"""Tensor keys of the snapshot format: how a unit's tensors are named in its files and manifest.

A unit tensor key is ``<kind>/<parameter name>[/<optimizer state key>]``::

    weight/model.layers.0.mlp.up_proj.weight          the parameter (or persistent buffer)
    optim/model.layers.0.mlp.up_proj.weight/exp_avg   one per-parameter optimizer state tensor
    master/model.layers.0.mlp.up_proj.weight          an fp32 master copy (mixed precision)

A piece of a tensor (one rank's shard) is stored in a tensor file under ``<key>#<offsets>``,
e.g. ``weight/lm_head.weight#128,0``; a whole tensor under its key alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from llmtailor.constants import KIND_MASTER, KIND_OPTIM, KIND_WEIGHT
from llmtailor.errors import IntegrityError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def join_key(kind: str, name: str, state_key: str | None = None) -> str:
    """A unit tensor key: ``<kind>/<parameter name>[/<state key>]`` (inverse of ``split_key``)."""
    return f"{kind}/{name}" if state_key is None else f"{kind}/{name}/{state_key}"


def weight_key(name: str) -> str:
    return join_key(KIND_WEIGHT, name)


def optim_key(name: str, state_key: str) -> str:
    return join_key(KIND_OPTIM, name, state_key)


def master_key(name: str) -> str:
    return join_key(KIND_MASTER, name)


def split_key(key: str) -> tuple[str, str, str | None]:
    """``(kind, parameter name, state key or None)`` of a unit tensor key."""
    kind, _, rest = key.partition("/")
    if kind == KIND_OPTIM:
        name, _, state_key = rest.rpartition("/")
        return kind, name, state_key
    return kind, rest, None


def piece_key(key: str, offsets: tuple[int, ...] | list[int], whole: bool) -> str:
    """The key a tensor file stores a piece under: the tensor key for a whole tensor, else the
    key and the piece's offsets in the global tensor."""
    return key if whole else f"{key}#{','.join(map(str, offsets))}"


def lacking_weights(names: tuple[str, ...] | list[str], keys: set[str]) -> list[str]:
    """Of a unit's parameter ``names``, those a version of the unit (its tensor ``keys``, kept
    ones included) holds neither the weight nor the fp32 master of: the names it cannot restore
    (a parameter saved only as its master gets the master as its weight)."""
    return [name for name in names if weight_key(name) not in keys and master_key(name) not in keys]


def unit_weights(tensors: dict[str, T]) -> dict[str, T]:
    """A unit's weights by parameter name, from its tensors by key: each ``weight/``, and the
    fp32 master of a parameter the unit holds no weight of (mixed-precision training stores the
    master, not its low-precision copy)."""
    out = {}
    for key, tensor in tensors.items():
        kind, name, _ = split_key(key)
        if kind == KIND_WEIGHT or (kind == KIND_MASTER and weight_key(name) not in tensors):
            out[name] = tensor
    return out


def split_unit(
    unit: str, names: tuple[str, ...], loaded: dict[str, torch.Tensor], values: dict[str, dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """A unit as read (``Run.read_unit``): its weights by parameter name, and its optimizer
    state by parameter name (tensors, and plain values decoded). A parameter saved only as an
    fp32 master (mixed-precision training stores the master, not its low-precision copy) gets
    the master as its weight. Refuses a unit lacking both for any of ``names``."""
    from llmtailor.store import codec  # imports torch: not needed for keys alone (store/dtypes.py)

    missing = lacking_weights(names, set(loaded))
    if missing:
        raise IntegrityError(f"unit {unit!r}: snapshot lacks the weights of {missing[:3]}")
    weights = unit_weights(loaded)
    state: dict[str, dict[str, Any]] = {}
    for key, tensor in loaded.items():
        kind, name, state_key = split_key(key)
        if kind == KIND_OPTIM:
            state.setdefault(name, {})[state_key] = tensor
    for name, plain in values.items():
        for key, encoded in plain.items():
            state.setdefault(name, {})[key] = codec.decode(encoded, {}, f"{unit}.{name}.{key}")
    return weights, state
