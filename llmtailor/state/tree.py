"""Nested Python state <-> a JSON document plus a flat dict of tensors, so nothing is pickled.

Global state (optimizer hyperparameters, scheduler state, RNG states, user extras) is a tree
of dicts, lists, tuples, numbers, strings, tensors and numpy arrays. ``encode`` turns it into
a JSON-able document in which every tensor is replaced by a reference into a flat tensor dict
(written as safetensors); ``decode`` inverts it exactly: tuples stay tuples, non-string dict
keys keep their type, floats round-trip bit for bit (``repr`` is the shortest exact form).

Tags are single-key dicts whose key starts with ``$``; a user dict whose keys start with
``$`` is stored in the ``$dict`` pair form, so user data can never be mistaken for a tag.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmtailor.errors import TailorError, UnsupportedStateError

_SCALARS = (type(None), bool, int, float, str)


def encode(obj: Any, where: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """Return ``(document, tensors)``; ``where`` names the tree in error messages."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(obj, where, tensors), tensors


def _encode(obj: Any, where: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, np.generic):  # before scalars: np.float64 is a float subclass
        return {"$npscalar": obj.dtype.str, "value": obj.item()}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        # A private contiguous CPU copy: safetensors refuses shared or strided storage,
        # and global state is small.
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        tag: dict[str, Any] = {"$tensor": key}
        if obj.device.type != "cpu":
            tag["device"] = str(obj.device)
        return tag
    if isinstance(obj, np.ndarray):
        key = str(len(tensors))
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"$ndarray": key}
    if isinstance(obj, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, f"{where}.{k}", tensors) for k, v in obj.items()}
        return {
            "$dict": [
                [_encode(k, f"{where}<key {k!r}>", tensors), _encode(v, f"{where}[{k!r}]", tensors)]
                for k, v in obj.items()
            ]
        }
    raise UnsupportedStateError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; llmtailor stores only "
        "dicts, lists, tuples, numbers, strings, None, tensors and numpy arrays (never pickle). "
        "Convert it to one of those before saving."
    )


def decode(doc: Any, tensors: dict[str, torch.Tensor], where: str = "state") -> Any:
    """Inverse of ``encode``. Raises TailorError on a malformed document."""
    if isinstance(doc, _SCALARS):
        return doc
    if isinstance(doc, list):
        return [decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(doc)]
    if not isinstance(doc, dict):
        raise TailorError(f"{where}: unexpected JSON value of type {type(doc).__name__}")
    if "$tensor" in doc:
        tensor = _lookup(tensors, doc["$tensor"], where)
        device = doc.get("device")
        if device and _device_available(device):
            tensor = tensor.to(device)
        return tensor
    if "$ndarray" in doc:
        return _lookup(tensors, doc["$ndarray"], where).numpy()
    if "$npscalar" in doc:
        return np.dtype(doc["$npscalar"]).type(doc["value"])
    if "$tuple" in doc:
        return tuple(decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(doc["$tuple"]))
    if "$dict" in doc:
        return {decode(k, tensors, where): decode(v, tensors, f"{where}[{k!r}]") for k, v in doc["$dict"]}
    return {k: decode(v, tensors, f"{where}.{k}") for k, v in doc.items()}


def _lookup(tensors: dict[str, torch.Tensor], key: Any, where: str) -> torch.Tensor:
    if key not in tensors:
        raise TailorError(f"{where}: tensor {key!r} is missing from the global tensors file")
    return tensors[key]


def _device_available(device: str) -> bool:
    kind = torch.device(device).type
    return kind == "cpu" or (kind == "cuda" and torch.cuda.is_available())
