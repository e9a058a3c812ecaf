"""Reading parts of tensors from committed snapshots, by byte range.

A rank restoring its own shards reads only the boxes of the stored chunks that overlap them
(safetensors slices: only those bytes are read from the file). ``verify=True`` reads each
chunk it touches whole, once, and checks it against the chunk's checksum in the unit index
before slicing it; ``verify=False`` reads only the byte ranges needed and leaves checking to ``llmtailor verify``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from llmtailor.errors import IntegrityError
from llmtailor.store import dtypes
from llmtailor.store.files import describe_open_error, tensor_checksum
from llmtailor.store.manifest import Chunk, TensorEntry, UnitEntry
from llmtailor.store.run import Run

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, shape)`` of a box inside a tensor."""


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of one tensor, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)) and lo:
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def flat_range_boxes(shape: tuple[int, ...], start: int, length: int) -> list[Box]:
    """The boxes (in row-major order) that make up elements ``[start, start + length)`` of a
    tensor of ``shape`` flattened: at most two partial rows at the ends and whole rows (or
    whole blocks, recursively) between them. Used for flat fragments (DeepSpeed)."""
    if length <= 0:
        return []
    if len(shape) <= 1:
        return [((start,), (length,))] if shape else [((), ())]
    inner = 1
    for d in shape[1:]:
        inner *= d
    boxes: list[Box] = []
    end = start + length
    row, col = divmod(start, inner)
    if col:
        take = min(inner - col, end - start)
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], col, take)]
        start += take
        row += 1
    rows = (end - start) // inner
    if rows:
        boxes.append(((row, *(0,) * (len(shape) - 1)), (rows, *shape[1:])))
        start += rows * inner
        row += rows
    if start < end:
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, end - start)]
    return boxes


class ChunkReader:
    """Reads boxes of chunks of one run's snapshots (module docstring). Keeps the files it has
    opened (memory maps) and the chunks it has checked until ``close``."""

    def __init__(self, run: Run, verify: bool = True):
        self.run = run
        self.verify = verify
        self._handles: dict[Path, object] = {}
        self._checked: dict[tuple, torch.Tensor] = {}

    def close(self) -> None:
        self._handles.clear()
        self._checked.clear()

    def read_box(
        self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk, offsets: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The box (``offsets``/``shape`` relative to the chunk) of ``chunk`` of ``tensor``, in
        the index ``unit`` of the snapshot at ``step``."""
        index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        if self.verify:
            return self._checked_chunk(step, unit, tensor, chunk)[index]
        return self._slice(step, unit, tensor, chunk)[index or ...]

    def read_region(
        self, step: int, unit: UnitEntry, tensor: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The box ``offsets``/``shape`` of the global tensor ``tensor`` (of the unit index
        ``unit`` at ``step``), assembled from the chunks that overlap it."""
        import torch

        out = torch.empty(shape, dtype=tensor.torch_dtype)
        wanted: Box = (tuple(offsets), tuple(shape))
        covered = 0
        for chunk in tensor.chunks:
            overlap = intersect(wanted, (tuple(chunk.offsets), tuple(chunk.shape)))
            if overlap is None:
                continue
            lo, extent = overlap
            inside = tuple(l - c for l, c in zip(lo, chunk.offsets))
            target = tuple(slice(l - o, l - o + n) for l, o, n in zip(lo, offsets, extent))
            out[target] = self.read_box(step, unit, tensor, chunk, inside, extent)
            covered += _numel(extent)
        if covered != _numel(shape):
            raise IntegrityError(f"snapshot {step}: the chunks of {tensor.key!r} do not cover {list(offsets)}+{list(shape)}")
        return out

    # -- internals -----------------------------------------------------------------------------

    def _slice(self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk):
        file = unit.chunk_file(chunk)
        path = (self.run.snapshot_dir(step if file.origin is None else file.origin) / file.path
                if file.origin != "base" else None)
        key = tensor.chunk_key(chunk)
        try:
            handle = self._handles.get(path) if path is not None else None
            if handle is None:
                path = self.run.file_path(step, file)  # checked once per file: its handle is kept
                handle = self._handles[path] = safe_open(str(path), framework="pt")
            piece = handle.get_slice(key)
        except SafetensorError as err:
            raise IntegrityError(f"{path}: cannot read tensor {key!r} ({err})") from None
        except OSError as err:
            raise IntegrityError(describe_open_error(err, path)) from None
        if list(piece.get_shape()) != chunk.shape or dtypes.code_of(tensor.dtype) != piece.get_dtype():
            raise IntegrityError(
                f"{path}: tensor {key!r} is {piece.get_dtype()} {piece.get_shape()}, index says {tensor.dtype} {chunk.shape}"
            )
        return piece

    def _checked_chunk(self, step: int, unit: UnitEntry, tensor: TensorEntry, chunk: Chunk) -> torch.Tensor:
        # A chunk is named by its offsets, not its file: one rank's file holds several chunks of
        # a tensor when a flat ZeRO fragment starts or ends mid-row.
        cache_key = (step, unit.unit, tensor.key, chunk.file, tuple(chunk.offsets))
        if cache_key not in self._checked:
            whole = self._slice(step, unit, tensor, chunk)[...]
            if tensor_checksum(whole) != chunk.xxh3_64:
                path = self.run.file_path(step, unit.chunk_file(chunk))
                raise IntegrityError(f"{path}: checksum mismatch in tensor {tensor.chunk_key(chunk)!r} (file is corrupted)")
            # One chunk is kept: consecutive boxes of a tensor come from the same chunk.
            self._checked = {cache_key: whole}
        return self._checked[cache_key]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


