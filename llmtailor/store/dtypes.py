"""The tensor dtypes a snapshot may hold, by name, without importing torch.

A manifest names dtypes as torch does without its prefix (``float32``, ``bfloat16``); a
safetensors header by its code (``F32``, ``BF16``). The store, the merge planner and a merge
that only moves bytes work with these names alone, so ``llmtailor merge`` of a weights-only
plan never imports torch (its import is most of the command's time: bench/RESULTS.md).
``to_torch`` gives the torch dtype where a tensor is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# name -> (safetensors code, bytes per element)
_TABLE: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1),
    "uint8": ("U8", 1), "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8), "bool": ("BOOL", 1),
}
NAMES = frozenset(_TABLE)
_BY_CODE = {code: name for name, (code, _) in _TABLE.items()}


def name_of(dtype: Any) -> str:
    """The manifest name of a torch dtype (``torch.float32`` -> ``float32``); a name is returned
    as it is."""
    return str(dtype).removeprefix("torch.")


def code_of(dtype: Any) -> str:
    """The safetensors code of a torch dtype or a dtype name; KeyError for another dtype."""
    return _TABLE[name_of(dtype)][0]


def from_code(code: str) -> str | None:
    """The name of a safetensors dtype code, or None for a code a snapshot may not hold."""
    return _BY_CODE.get(code)


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a dtype name."""
    return _TABLE[name_of(dtype)][1]


def to_torch(name: str) -> torch.dtype:
    """The torch dtype of a manifest name."""
    import torch

    if name not in _TABLE:
        raise KeyError(name)
    return getattr(torch, name)
