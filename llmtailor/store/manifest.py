"""The snapshot manifest: the one small file that makes a snapshot exist.

A snapshot directory counts only once its ``manifest.json`` is in place (it is written last).
The manifest lists every file with its size and xxh3-64 checksum, every tensor of every unit
saved in this snapshot with its global shape and the chunks that hold it (one chunk in a
single-process save; one per rank and shard in a distributed save, each with its offsets in
the global tensor), and the composite table: for every unit of the layout, the step of the
snapshot that holds its newest version at or before this step. Resolving a composite
therefore reads one manifest, whatever the model size.

Everything here is validated before any tensor byte is read: paths stay inside the snapshot,
dtypes come from a fixed list, shapes and chunk extents are consistent and bounded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmtailor.constants import READABLE_SCHEMA_VERSIONS, SNAPSHOT_FORMAT
from llmtailor.errors import IntegrityError, TailorError, describe_validation

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    )
}
# No tensor in a checkpoint legitimately has more elements than this (2**48, ~281e12).
MAX_ELEMENTS = 1 << 48


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    """A file of the snapshot, relative to its directory."""

    path: str
    bytes: int = Field(ge=0)
    xxh3_64: str = Field(pattern=r"^[0-9a-f]{16}$")

    @field_validator("path")
    @classmethod
    def _inside_snapshot(cls, path: str) -> str:
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts or "\\" in path or not pure.parts:
            raise ValueError(f"file path {path!r} leaves the snapshot directory")
        if "\x00" in path:  # the OS refuses such a name with a ValueError, not an OSError
            raise ValueError(f"file path {path!r} holds a NUL character")
        return path


class Chunk(_Strict):
    """Where a piece of a tensor lies: ``file`` holds it under ``key``; its corner in the global
    tensor is ``offsets`` and its extent ``shape``. ``xxh3_64`` is the checksum of the piece's
    bytes alone, so a reader that needs one piece of a file can check it without reading the
    rest (absent in schema 1)."""

    file: str
    key: str
    offsets: list[int]
    shape: list[int]
    xxh3_64: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")


class TensorEntry(_Strict):
    """One tensor of a unit. ``key`` is ``weight/<param>``, ``optim/<param>/<state key>`` or
    ``master/<param>``."""

    key: str
    dtype: str
    shape: list[int]
    chunks: list[Chunk] = Field(min_length=1)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"dtype {value!r} is not one of {sorted(DTYPES)}")
        return value

    @model_validator(mode="after")
    def _chunks_fit(self) -> TensorEntry:
        if any(d < 0 for d in self.shape) or math.prod(self.shape) > MAX_ELEMENTS:
            raise ValueError(f"tensor {self.key!r} has an absurd shape {self.shape}")
        covered = 0
        for chunk in self.chunks:
            if len(chunk.offsets) != len(self.shape) or len(chunk.shape) != len(self.shape):
                raise ValueError(f"tensor {self.key!r}: chunk rank differs from shape {self.shape}")
            for off, ext, dim in zip(chunk.offsets, chunk.shape, self.shape):
                if off < 0 or ext < 0 or off + ext > dim:
                    raise ValueError(f"tensor {self.key!r}: chunk {chunk.offsets}+{chunk.shape} exceeds {self.shape}")
            covered += math.prod(chunk.shape)
        if covered != math.prod(self.shape):
            raise ValueError(f"tensor {self.key!r}: chunks cover {covered} of {math.prod(self.shape)} elements")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class UnitEntry(_Strict):
    """What a snapshot holds of one unit: its tensors, and the optimizer state values that are
    not tensors (plain numbers), by parameter name."""

    tensors: list[TensorEntry]
    values: dict[str, dict[str, Any]] = {}


class Manifest(_Strict):
    """Schema 2 adds ``provider``, ``notes``, ``decision`` and per-chunk checksums to schema 1;
    both are read."""

    format: Literal["llmtailor.snapshot"] = SNAPSHOT_FORMAT
    schema_version: int
    step: int = Field(ge=0)
    parent: int | None = None
    save_index: int = Field(ge=0)
    created: str
    world_size: int = Field(default=1, ge=1)
    provider: str = "local"
    """The state provider that saved it: ``local`` (one process), ``ddp``, ``fsdp2``, ``deepspeed``."""
    notes: dict[str, Any] = {}
    """What a reader must know about the provider's state, e.g. how DeepSpeed's optimizer steps
    are kept (``llmtailor.providers``)."""
    policy: str
    decision: dict[str, Any] = {}
    """The policy's record of why it chose these units (Adaptive: the measured drift)."""
    layout: dict[str, Any]
    units: dict[str, UnitEntry]
    composite: dict[str, int]
    files: list[FileEntry]

    @field_validator("schema_version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"schema_version {value} is not supported (this llmtailor reads {list(READABLE_SCHEMA_VERSIONS)})"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.parent is not None and self.parent >= self.step:
            raise ValueError(f"parent step {self.parent} is not before step {self.step}")
        for unit, source in self.composite.items():
            if source > self.step:
                raise ValueError(f"composite names step {source} for unit {unit!r}, after the snapshot's own step")
            if (source == self.step) != (unit in self.units):
                raise ValueError(f"composite entry of unit {unit!r} disagrees with the units this snapshot holds")
        unknown = set(self.units) - set(self.composite)
        if unknown:
            raise ValueError(f"units {sorted(unknown)} are missing from the composite table")
        listed = {f.path for f in self.files}
        for unit, entry in self.units.items():
            for tensor in entry.tensors:
                for chunk in tensor.chunks:
                    if chunk.file not in listed:
                        raise ValueError(f"tensor {tensor.key!r} of unit {unit!r} names unlisted file {chunk.file!r}")
        return self

    def file_entry(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise IntegrityError(f"manifest of step {self.step} lists no file {path!r}")

    def unit_files(self, unit: str) -> set[str]:
        """Paths of the files holding ``unit`` in this snapshot (one per rank that wrote a piece)."""
        return {c.file for t in self.units[unit].tensors for c in t.chunks}

    def unit_bytes(self, unit: str) -> int:
        """Bytes on disk of the files holding ``unit`` in this snapshot."""
        paths = self.unit_files(unit)
        return sum(f.bytes for f in self.files if f.path in paths)

    def tensor_entry(self, unit: str, key: str) -> TensorEntry | None:
        for entry in self.units[unit].tensors:
            if entry.key == key:
                return entry
        return None

    def dumps(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=False)


def load_manifest(path: Path) -> Manifest:
    """Read and validate ``path``; every problem becomes a TailorError naming the file."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise IntegrityError(f"{path}: manifest is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise IntegrityError(f"{path}: cannot read manifest ({err})") from None
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as err:
        raise TailorError(f"{path}: invalid manifest: {describe_validation(err)}") from None
