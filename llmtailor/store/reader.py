"""Reading parts of tensors from committed snapshots, by byte range.

A rank restoring its own shards reads only the boxes of the stored chunks that overlap them
(safetensors slices: only those bytes are read from the file). ``verify=True`` reads each
chunk it touches whole, once, and checks it against the chunk's checksum in the manifest
before slicing it (schema-1 snapshots have no chunk checksums: the whole file is checked);
``verify=False`` reads only the byte ranges needed and leaves checking to ``llmtailor verify``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llmtailor.errors import IntegrityError
from llmtailor.store.files import DTYPE_CODES, tensor_checksum, verify_file
from llmtailor.store.manifest import Chunk, TensorEntry
from llmtailor.store.run import Run

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
        self._checked: dict[tuple[int, str, str], torch.Tensor] = {}
        self._verified_files: set[Path] = set()

    def close(self) -> None:
        self._handles.clear()
        self._checked.clear()

    def read_box(self, step: int, chunk: Chunk, dtype: torch.dtype, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box (``offsets``/``shape`` relative to the chunk) of ``chunk`` saved at ``step``."""
        index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        if self.verify:
            return self._checked_chunk(step, chunk, dtype)[index]
        return self._slice(step, chunk, dtype)[index or ...]

    def read_region(self, step: int, entry: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box ``offsets``/``shape`` of the global tensor ``entry`` (saved at ``step``),
        assembled from the chunks that overlap it."""
        out = torch.empty(shape, dtype=entry.torch_dtype)
        wanted: Box = (tuple(offsets), tuple(shape))
        covered = 0
        for chunk in entry.chunks:
            overlap = intersect(wanted, (tuple(chunk.offsets), tuple(chunk.shape)))
            if overlap is None:
                continue
            lo, extent = overlap
            inside = tuple(l - c for l, c in zip(lo, chunk.offsets))
            target = tuple(slice(l - o, l - o + n) for l, o, n in zip(lo, offsets, extent))
            out[target] = self.read_box(step, chunk, entry.torch_dtype, inside, extent)
            covered += _numel(extent)
        if covered != _numel(shape):
            raise IntegrityError(f"snapshot {step}: the chunks of {entry.key!r} do not cover {list(offsets)}+{list(shape)}")
        return out

    # -- internals -----------------------------------------------------------------------------

    def _path(self, step: int, chunk: Chunk) -> Path:
        return self.run.snapshot_dir(step) / chunk.file

    def _slice(self, step: int, chunk: Chunk, dtype: torch.dtype):
        path = self._path(step, chunk)
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = safe_open(str(path), framework="pt")
            piece = handle.get_slice(chunk.key)
        except FileNotFoundError:
            raise IntegrityError(f"{path}: file is missing") from None
        except (SafetensorError, OSError) as err:
            raise IntegrityError(f"{path}: cannot read tensor {chunk.key!r} ({err})") from None
        if list(piece.get_shape()) != chunk.shape or _dtype_code(dtype) != piece.get_dtype():
            raise IntegrityError(
                f"{path}: tensor {chunk.key!r} is {piece.get_dtype()} {piece.get_shape()}, "
                f"manifest says {dtype} {chunk.shape}"
            )
        return piece

    def _checked_chunk(self, step: int, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
        cache_key = (step, chunk.file, chunk.key)
        if cache_key in self._checked:
            return self._checked[cache_key]
        path = self._path(step, chunk)
        if chunk.xxh3_64 is None and path not in self._verified_files:
            verify_file(self.run.snapshot_dir(step), self.run.manifest(step).file_entry(chunk.file))
            self._verified_files.add(path)
        whole = self._slice(step, chunk, dtype)[...]
        if chunk.xxh3_64 is not None and tensor_checksum(whole) != chunk.xxh3_64:
            raise IntegrityError(f"{path}: checksum mismatch in tensor {chunk.key!r} (file is corrupted)")
        # One chunk is kept: consecutive boxes of a tensor come from the same chunk.
        self._checked = {cache_key: whole}
        return whole


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _dtype_code(dtype: torch.dtype) -> str:
    return DTYPE_CODES[dtype]
