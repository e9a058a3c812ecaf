"""The snapshot manifest: the one small file that makes a snapshot exist, and the unit indexes.

A snapshot directory counts only once its ``manifest.json`` is in place (it is written last).
The manifest is small whatever the model and world size: it holds what resolving a composite
needs — the composite table (for every unit of the layout, the step of the snapshot holding
its newest version at or before this step), the layout, the lineage — plus, per unit saved
here, the size and checksum of that unit's index, and the files of the global state.

A unit's index (a line of the snapshot's ``indexes.json``, read only when the unit is; before
schema 6, a file of its own, ``index/<unit>.json``) lists its tensor files
(one per rank that wrote a piece: the unit's own file, or the rank's pack file that holds its
small units together, ``constants.pack_filename``) with their sizes and xxh3-64 checksums, and every tensor
with its dtype, global shape and the chunks that hold it: one chunk in a single-process save;
one per rank and shard in a distributed save, each with its offsets in the global tensor and
the checksum of its own bytes (so a rank reading one chunk can check it alone). A chunk names
its file by position in the index's file list; its key in that file is the tensor key, with
``#<offsets>`` for a piece (``store.keys.piece_key``). From schema 6 an index is written
compactly: a chunk of the first file omits ``file``, a chunk holding its whole tensor its
``offsets`` and ``shape``; a chunk of 256 KiB or less carries no page checksums.

Everything here is validated before any tensor byte is read: paths stay inside the snapshot,
dtypes come from a fixed list, shapes and chunk extents are consistent and bounded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from llmtailor.constants import INDEXES_FILE, READABLE_SCHEMAS, SNAPSHOT_FORMAT, unit_index_path
from llmtailor.errors import IntegrityError, TailorError, describe_validation
from llmtailor.store import dtypes
from llmtailor.store.keys import piece_key

if TYPE_CHECKING:
    import torch

# No tensor in a checkpoint legitimately has more elements than this (2**48, ~281e12).
MAX_ELEMENTS = 1 << 48


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtypes.name_of(dtype)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileEntry(_Strict):
    """A file of the snapshot, relative to its directory."""

    path: str
    bytes: int = Field(ge=0)
    xxh3_64: str = Field(pattern=r"^[0-9a-f]{16}$")
    origin: int | Literal["base"] | None = Field(default=None, exclude=True)
    """In memory only (never written): where a file of a unit's merged view lies — the snapshot
    of that step, or the base model directory; None: the snapshot whose index lists it."""

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
    """Where a piece of a tensor lies: in the ``file``-th file of its unit index; its corner in
    the global tensor is ``offsets`` and its extent ``shape``; ``xxh3_64`` is the checksum of
    the piece's bytes alone."""

    file: int = Field(default=0, ge=0)
    offsets: list[int]
    shape: list[int]
    xxh3_64: str = Field(pattern=r"^[0-9a-f]{16}$")
    page_bytes: int | None = Field(default=None, gt=0)
    pages: list[Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]] | None = None
    """A large chunk's bytes also hashed in pages of ``page_bytes`` (the last one shorter): a
    reader of part of the chunk (a rank restoring at another world size) reads and checks the
    pages its range covers, not the whole chunk (``store.tensor_files.page_size``)."""
    cover_xxh3: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    """A frozen whole weight's sampled checksum (``frozen.fingerprints``: of its covering sample,
    an element of every row and column, ``store.samples.covering``; schema 7 on): a restore
    checks a live tensor it does not read against it (``xxh3_64`` with ``verify="exact"``)."""
    sample_xxh3: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    """The same, written by schemas 5 and 6: of 1024 elements spread over the tensor
    (``store.samples.sampled``); a restore still checks it so."""
    stored_as: str | None = Field(default=None, exclude=True)
    """In memory only: the tensor's name in its file when not its key (a base model's file)."""

    @model_validator(mode="after")
    def _pages_together(self) -> Chunk:
        if (self.page_bytes is None) != (self.pages is None):
            raise ValueError("page_bytes and pages go together")
        return self

    @model_serializer(mode="wrap")
    def _without_absent_pages(self, handler):
        data = handler(self)
        if self.pages is None:  # a chunk of one page: written as schema 3 wrote it
            data.pop("pages", None)
            data.pop("page_bytes", None)
        for sample in ("cover_xxh3", "sample_xxh3"):
            if data.get(sample) is None:
                data.pop(sample, None)
        if self.file == 0:  # from schema 6 the default (most indexes list one file)
            data.pop("file", None)
        return data


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
        if value not in dtypes.NAMES:
            raise ValueError(f"dtype {value!r} is not one of {sorted(dtypes.NAMES)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _whole_chunks(cls, data: Any) -> Any:
        """A chunk written without offsets and shape (schema 6) holds the whole tensor."""
        if not isinstance(data, dict) or not isinstance(data.get("shape"), list) or not isinstance(data.get("chunks"), list):
            return data  # validation names what is wrong
        shape = data["shape"]
        zeros = [0] * len(shape)  # shared by the chunks: validation makes each its own list
        chunks = [{"offsets": zeros, "shape": shape, **chunk}
                  if isinstance(chunk, dict) and "offsets" not in chunk and "shape" not in chunk else chunk
                  for chunk in data["chunks"]]
        return {**data, "chunks": chunks}

    @model_serializer(mode="wrap")
    def _whole_chunks_short(self, handler):
        data = handler(self)
        for chunk in data["chunks"]:
            if chunk["shape"] == data["shape"] and not any(chunk["offsets"]):
                del chunk["offsets"], chunk["shape"]
        return data

    @model_validator(mode="after")
    def _chunks_fit(self) -> TensorEntry:
        shape = self.shape
        if any(d < 0 for d in shape) or math.prod(shape) > MAX_ELEMENTS:
            raise ValueError(f"tensor {self.key!r} has an absurd shape {shape}")
        chunks = self.chunks
        if len(chunks) == 1 and chunks[0].shape == shape and chunks[0].offsets == [0] * len(shape):
            # The common case, met by every tensor of a single-process save: one chunk, the whole
            # tensor (it fits and covers by construction); only its pages are left to check.
            _check_pages(self, chunks[0])
            return self
        covered = 0
        for chunk in chunks:
            if len(chunk.offsets) != len(shape) or len(chunk.shape) != len(shape):
                raise ValueError(f"tensor {self.key!r}: chunk rank differs from shape {shape}")
            for off, ext, dim in zip(chunk.offsets, chunk.shape, shape):
                if off < 0 or ext < 0 or off + ext > dim:
                    raise ValueError(f"tensor {self.key!r}: chunk {chunk.offsets}+{chunk.shape} exceeds {shape}")
            covered += math.prod(chunk.shape)
            _check_pages(self, chunk)
        if covered != math.prod(shape) or _overlapping(chunks):
            raise ValueError(
                f"tensor {self.key!r}: chunks cover {covered} of {math.prod(shape)} elements"
                + (" and overlap" if _overlapping(chunks) else "")
            )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype)

    def chunk_key(self, chunk: Chunk) -> str:
        """The key ``chunk`` is stored under in its file."""
        return chunk.stored_as or piece_key(self.key, chunk.offsets, chunk.shape == self.shape)


class BaseRef(_Strict):
    """A frozen tensor kept from the base model directory: tensor ``name`` of its ``file`` (a
    path relative to the directory), whose bytes have checksum ``xxh3_64``."""

    file: str
    name: str
    dtype: str
    shape: list[int]
    xxh3_64: str = Field(pattern=r"^[0-9a-f]{16}$")
    cover_xxh3: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    """The tensor's sampled checksum (``Chunk.cover_xxh3``); None in runs before schema 7."""
    sample_xxh3: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    """Its sampled checksum as schemas 5 and 6 wrote it (``Chunk.sample_xxh3``)."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        return TensorEntry._known_dtype(value)

    @field_validator("file")
    @classmethod
    def _inside_base(cls, path: str) -> str:
        return FileEntry._inside_snapshot(path)


class UnitEntry(_Strict):
    """A unit's index (``index/<unit>.json``): its tensor files, its tensors, and the optimizer
    state values that are not tensors (plain numbers), by parameter name.

    Frozen tensors unchanged since an older version are not written again: ``kept`` names, by
    tensor key, the step of the snapshot whose index holds each (the one that wrote it);
    ``base``, those kept from the run's base model directory. ``Run.unit_entry`` merges them
    into one view, their files tagged with their ``origin``."""

    unit: str
    step: int = Field(ge=0)
    files: list[FileEntry]
    tensors: list[TensorEntry]
    values: dict[str, dict[str, Any]] = {}
    kept: dict[str, int] = {}
    base: dict[str, BaseRef] = {}

    @model_validator(mode="after")
    def _chunks_name_files(self) -> UnitEntry:
        if not self.files and not self.kept and not self.base:
            raise ValueError("no files listed and no tensor kept: an empty unit index")
        for tensor in self.tensors:
            for chunk in tensor.chunks:
                if chunk.file >= len(self.files):
                    raise ValueError(f"tensor {tensor.key!r} names file {chunk.file} of {len(self.files)}")
        own = {t.key for t in self.tensors}
        for key, holder in self.kept.items():
            if key in own or key in self.base:
                raise ValueError(f"tensor {key!r} is both held here and kept from elsewhere")
            if holder >= self.step:
                raise ValueError(f"tensor {key!r} is kept from step {holder}, not before step {self.step}")
        return self

    def chunk_file(self, chunk: Chunk) -> FileEntry:
        return self.files[chunk.file]

    def tensor(self, key: str) -> TensorEntry | None:
        for entry in self.tensors:
            if entry.key == key:
                return entry
        return None

    def dumps(self) -> str:
        return json.dumps(self.model_dump(mode="json"), separators=(",", ":"))


class UnitRef(_Strict):
    """The manifest's line for a unit saved in this snapshot: where its index lies, and the bytes
    of its tensor files (all ranks; of a pack file, its share), so the units' bytes add up to the
    snapshot's."""

    index: FileEntry
    """Its index's bytes: from schema 6, its line of ``INDEXES_FILE`` (``bytes`` and ``xxh3_64``
    those of the line, which starts at byte ``index_at``); before, a file of its own."""
    index_at: int | None = Field(default=None, ge=0)
    bytes: int = Field(ge=0)
    kept: list[int] = []
    """Steps of the older snapshots whose files hold the frozen tensors the index keeps: the
    unit's version needs them too (retention keeps them; ``verify`` checks them)."""

    @model_serializer(mode="wrap")
    def _without_absent_line(self, handler):
        data = handler(self)
        if self.index_at is None:  # an index file of its own: written as schema 5 wrote it
            data.pop("index_at", None)
        return data


class BaseDir(_Strict):
    """The base model directory a run keeps frozen tensors from (``Tailor(..., base=...)``):
    its absolute path and the safetensors files used, with their sizes and checksums."""

    path: str
    files: list[FileEntry]


class Manifest(_Strict):
    """The manifest (module docstring). Schema 2; earlier schemas are refused by name."""

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
    units: dict[str, UnitRef]
    composite: dict[str, int]
    files: list[FileEntry]
    """The global state's files (and each rank's own) and, from schema 6, ``INDEXES_FILE``; unit
    files are listed in unit indexes."""
    base: BaseDir | None = None
    """The base model directory frozen tensors of this snapshot's units are kept from."""

    @field_validator("schema_version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value not in READABLE_SCHEMAS:
            raise ValueError(f"schema_version {value} is not supported (this llmtailor reads {list(READABLE_SCHEMAS)})")
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
        for unit, ref in self.units.items():
            if any(step >= self.step for step in ref.kept):
                raise ValueError(f"unit {unit!r} keeps tensors of step {max(ref.kept)}, not before step {self.step}")
            self._check_index_ref(unit, ref)
        return self

    def _check_index_ref(self, unit: str, ref: UnitRef) -> None:
        """A unit's index lies where its schema puts it: from schema 6 a line inside the listed
        ``INDEXES_FILE``; before, in ``unit_index_path(unit)``."""
        if self.schema_version < 6:
            if ref.index.path != unit_index_path(unit) or ref.index_at is not None:
                raise ValueError(f"unit {unit!r}: index file {ref.index.path!r}, expected {unit_index_path(unit)!r}")
            return
        whole = next((f for f in self.files if f.path == INDEXES_FILE), None)
        if ref.index.path != INDEXES_FILE or ref.index_at is None or whole is None:
            raise ValueError(f"unit {unit!r}: index in {ref.index.path!r} at {ref.index_at}, expected a line of "
                             f"{INDEXES_FILE!r}, listed in the manifest's files")
        if ref.index_at + ref.index.bytes > whole.bytes:
            raise ValueError(f"unit {unit!r}: index at bytes {ref.index_at}+{ref.index.bytes}, past the end of "
                             f"{INDEXES_FILE!r} ({whole.bytes} bytes)")

    def file_entry(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        for ref in self.units.values():
            if ref.index.path == path:
                return ref.index
        raise IntegrityError(f"manifest of step {self.step} lists no file {path!r}")

    def unit_bytes(self, unit: str) -> int:
        """Bytes on disk of the tensor files holding ``unit`` in this snapshot."""
        return self.units[unit].bytes

    def total_bytes(self) -> int:
        """Bytes of every file of the snapshot but the manifest itself."""
        own_indexes = sum(r.index.bytes for r in self.units.values() if r.index_at is None)  # INDEXES_FILE is in files
        return sum(f.bytes for f in self.files) + own_indexes + sum(r.bytes for r in self.units.values())

    def dumps(self) -> str:
        """Compact JSON (``llmtailor inspect`` shows it readably): its bytes are part of every save."""
        return json.dumps(self.model_dump(mode="json"), separators=(",", ":"))


def _check_pages(tensor: TensorEntry, chunk: Chunk) -> None:
    """A chunk's page checksums, if it has them, cover its bytes exactly (ValueError otherwise)."""
    if chunk.pages is not None:
        size = math.prod(chunk.shape) * dtypes.itemsize(tensor.dtype)
        if len(chunk.pages) != -(-size // chunk.page_bytes):
            raise ValueError(f"tensor {tensor.key!r}: chunk {chunk.offsets} lists {len(chunk.pages)} pages "
                             f"of {chunk.page_bytes} bytes for {size} bytes")


def _overlapping(chunks: list[Chunk]) -> bool:
    """Whether two chunks share an element (``first_overlap``)."""
    return first_overlap([(c.offsets, c.shape) for c in chunks]) is not None


def first_overlap(boxes: list[tuple[list[int], list[int]]]) -> tuple[int, int] | None:
    """The positions of two ``(offsets, shape)`` boxes of one tensor that share an element, or
    None: a sweep over the first dimension, comparing only boxes whose first-dimension extents
    meet (shards along it are checked in n log n)."""
    if len(boxes) < 2:  # the common case (a tensor in one chunk), met for every tensor of every index read
        return None
    order = sorted((i for i, (_, shape) in enumerate(boxes) if shape and math.prod(shape)), key=lambda i: boxes[i])
    active: list[int] = []
    for i in order:
        offsets, shape = boxes[i]
        active = [j for j in active if boxes[j][0][0] + boxes[j][1][0] > offsets[0]]
        for j in active:
            other, extent = boxes[j]
            if all(o < p + n and p < o + m for o, m, p, n in zip(offsets, shape, other, extent)):
                return j, i
        active.append(i)
    return None


def load_manifest(path: Path, step: int | None = None) -> Manifest:
    """Read and validate the manifest file ``path`` (``parse_manifest``)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: manifest is missing") from None
    except OSError as err:
        raise IntegrityError(f"{path}: cannot read manifest ({err})") from None
    return parse_manifest(raw, str(path), step)


def parse_manifest(raw: bytes, where: str, step: int | None = None) -> Manifest:
    """Validate a manifest's bytes (strictly: a step written as ``"200"`` is refused); every
    problem becomes a TailorError naming ``where``. With ``step`` (the step its directory
    names), a manifest of another step is refused as that, before its other fields are judged
    (a moved or copied manifest would otherwise fail on a field that depends on the step)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise IntegrityError(f"{where}: cannot read manifest ({err})") from None
    if step is not None:
        try:
            said = json.loads(text).get("step")
        except (ValueError, AttributeError, RecursionError):
            said = step  # not a JSON object: validation below names the problem
        if said != step and isinstance(said, int) and not isinstance(said, bool):
            raise IntegrityError(f"{where}: manifest says step {said}, its directory says step {step}")
    try:
        return Manifest.model_validate_json(text)
    except ValidationError as err:
        raise TailorError(f"{where}: invalid manifest: {describe_validation(err)}") from None


def load_unit_entry(raw: bytes, path: Path | str, unit: str, step: int) -> UnitEntry:
    """Validate a unit index's (checksummed) bytes; every problem becomes a TailorError naming
    the file."""
    try:
        entry = UnitEntry.model_validate_json(raw)
    except ValidationError as err:
        raise TailorError(f"{path}: invalid unit index: {describe_validation(err)}") from None
    if (entry.unit, entry.step) != (unit, step):
        raise IntegrityError(f"{path}: index of unit {entry.unit!r} at step {entry.step}, expected {unit!r} at {step}")
    return entry


def tensor_bytes(entry: TensorEntry) -> int:
    """Bytes of the whole tensor ``entry`` describes."""
    return math.prod(entry.shape) * dtypes.itemsize(entry.dtype)
