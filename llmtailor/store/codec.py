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


_PLAIN = frozenset(_SCALARS)
"""The exact types a document holds as they are (a numpy scalar subclassing float is not one)."""


def _spelled(where: str | tuple) -> str:
    """The name of where a value lies, from ``_encode``'s ``where``: a root name, or ``(parent,
    form, key)``, the step from the parent being ``form.format(parent, key)``. Spelled out only
    for an error: formatting a name for every value (an RNG state is hundreds of ints) cost
    more than encoding it."""
    steps = []
    while isinstance(where, tuple):
        where, form, key = where
        steps.append((form, key))
    for form, key in reversed(steps):
        where = form.format(where, key)
    return where


def _encode(obj: Any, where: str | tuple, tensors: dict[str, torch.Tensor]) -> Any:
    if type(obj) in _PLAIN:
        return obj
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
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _PLAIN for v in obj):  # a flat list of plain values (an RNG state): as it is
            items = list(obj)
        else:
            items = [_encode(v, (where, "{}[{}]", i), tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"$tuple": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, (where, "{}.{}", k), tensors) for k, v in obj.items()}
        return {
            "$dict": [
                [_encode(k, (where, "{}<key {!r}>", k), tensors), _encode(v, (where, "{}[{!r}]", k), tensors)]
                for k, v in obj.items()
            ]
        }
    raise UnsupportedStateError(
        f"{_spelled(where)} is a {type(obj).__module__}.{type(obj).__qualname__}; llmtailor stores only "
        "dicts, lists, tuples, numbers, strings, None, tensors and numpy arrays (never pickle). "
        "Convert it to one of those before saving."
    )


def decode(doc: Any, tensors: dict[str, torch.Tensor], where: str = "state") -> Any:
    """Inverse of ``encode``. Raises TailorError on a malformed document: a tag with the wrong
    payload, a reference to a missing tensor, nesting deeper than the interpreter's stack."""
    try:
        return _decode(doc, tensors, where)
    except RecursionError:
        raise TailorError(f"{where}: nested too deeply to decode") from None


def _decode(doc: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(doc, _SCALARS):
        return doc
    if isinstance(doc, list):
        return [_decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(doc)]
    if not isinstance(doc, dict):
        raise TailorError(f"{where}: unexpected JSON value of type {type(doc).__name__}")
    if "$tensor" in doc:
        tensor = _lookup(tensors, doc["$tensor"], where)
        device = doc.get("device")
        if device and _device_available(device, where):
            tensor = tensor.to(device)
        return tensor
    if "$ndarray" in doc:
        tensor = _lookup(tensors, doc["$ndarray"], where)
        try:
            return tensor.numpy()
        except TypeError:  # bfloat16 and the float8 types have no numpy dtype
            raise TailorError(f"{where}: a numpy array cannot hold the {tensor.dtype} tensor it names") from None
    if "$npscalar" in doc:
        return _npscalar(doc["$npscalar"], doc.get("value"), where)
    if "$tuple" in doc:
        return tuple(_decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(_list(doc, "$tuple", where)))
    if "$dict" in doc:
        pairs = _list(doc, "$dict", where)
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
            raise TailorError(f"{where}: $dict must hold [key, value] pairs")
        out = {}
        for k, v in pairs:
            key = _decode(k, tensors, where)
            try:
                hash(key)
            except TypeError:  # a list, dict or array
                raise TailorError(f"{where}: $dict key {k!r} is not hashable") from None
            out[key] = _decode(v, tensors, f"{where}[{key!r}]")
        return out
    return {k: _decode(v, tensors, f"{where}.{k}") for k, v in doc.items()}


def _list(doc: dict[str, Any], tag: str, where: str) -> list:
    if not isinstance(doc[tag], list):
        raise TailorError(f"{where}: {tag} must hold a list, got {type(doc[tag]).__name__}")
    return doc[tag]


def _npscalar(code: Any, value: Any, where: str) -> np.generic:
    # Only the kinds encode can write: a numpy scalar whose item() is a JSON scalar.
    try:
        dtype = np.dtype(code) if isinstance(code, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in "biufU" or isinstance(value, (list, dict)):
        raise TailorError(f"{where}: $npscalar {code!r} with value {value!r} is not a numpy number or string")
    try:
        return dtype.type(value)
    except (TypeError, ValueError, OverflowError) as err:
        raise TailorError(f"{where}: value {value!r} is not a numpy {dtype} ({err})") from None


def _lookup(tensors: dict[str, torch.Tensor], key: Any, where: str) -> torch.Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise TailorError(f"{where}: tensor {key!r} is missing from the global tensors file")
    return tensors[key]


def _device_available(device: Any, where: str) -> bool:
    try:
        kind = torch.device(device).type
    except (TypeError, RuntimeError):
        raise TailorError(f"{where}: device {device!r} is not a torch device name") from None
    return kind == "cpu" or (kind == "cuda" and torch.cuda.is_available())


def plain_value(value: Any, where: str) -> Any:
    """A non-tensor optimizer state value (a step count, say) as JSON: the manifest stores it."""
    doc, nested = encode(value, where)
    if nested:
        raise UnsupportedStateError(f"{where} nests tensors inside a {type(value).__name__}; store them directly")
    return doc
