"""A piece's fixed samples of values, the same at every call, and their checksums.

``sampled``: up to ``SAMPLE`` elements, every k-th from a start drawn from a seed and the piece's
key and offsets (``sample_slots``). The drift tracker (``drift.py``) measures change on it; runs
before schema 7 fingerprinted frozen tensors by it (``Chunk.sample_xxh3``), and a restore still
checks their records against it.

``covering``: every k-th element, k no larger than a row's length, so that it holds an element of
every row (a row: the elements sharing all indexes but the last) and, k sharing no factor with
the row length and no larger than the number of rows, of every column too (``covering_slots``).
Frozen tensors are fingerprinted by it at save (``frozen.py``) and checked against it at restore
(``providers/local.py``, ``Chunk.cover_xxh3``): a tensor that differs in whole rows or columns
(new token rows initialised otherwise, a slice drawn from another seed) is told apart, at a
cache line per sampled element: about as many as the larger of rows and row length (32008 of
the 131 million elements of a 32000 x 4096 embedding), instead of a pass over it."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

from llmtailor.store.staged import Piece
from llmtailor.store.tensor_files import checksum

SAMPLE = 1024
FEW_ROWS = 64
"""In a tensor of fewer rows than this (a 1-D tensor is one row) ``covering`` still spaces its
elements up to this far apart: it holds an element of every row, not of every column (that
would be every element of a one-row tensor: a pass over it)."""


def sample_slots(piece: Piece, size: int = SAMPLE, seed: int = 0) -> tuple[int, int]:
    """A piece's sampled elements, the same at every call: every ``spacing``-th element of it
    (flat) from ``start``, ``size`` of them (all of a piece no larger). The spacing has no factor
    in common with the row length, so the sample walks through every column as well as down the
    rows; the start is drawn from ``seed`` and the piece's key and offsets."""
    numel = piece.tensor.numel()
    if numel <= size:
        return 0, 1
    spacing = numel // size
    row = piece.tensor.shape[-1]
    while spacing > 1 and math.gcd(spacing, row) != 1:
        spacing -= 1
    digest = hashlib.sha256(f"{seed}/{piece.key}/{piece.offsets}".encode()).digest()
    start = int.from_bytes(digest[:8], "little") % (numel - (size - 1) * spacing)
    return start, spacing


def sampled(piece: Piece, size: int = SAMPLE, seed: int = 0) -> torch.Tensor:
    """The piece's sampled elements (``sample_slots``), flat: a view of its memory where it is
    contiguous, else a copy."""
    start, spacing = sample_slots(piece, size, seed)
    return flat(piece.tensor)[start::spacing][:size]


def covering_slots(piece: Piece) -> tuple[int, int]:
    """``covering``'s elements of a piece, the same at every call: every ``spacing``-th element
    of it (flat, in row-major order) from ``start`` to its end; all of a piece of at most
    ``SAMPLE`` elements. The spacing is the largest no larger than the row length, than the
    number of rows (or ``FEW_ROWS``, if larger) and than the elements over ``SAMPLE``, with no
    factor in common with the row length; the start, below the spacing, is drawn from the
    piece's key and offsets. So the first sampled element lies in the first row and the last
    in the last row, and two consecutive ones are at most a row apart: every row holds one.
    The spacing being prime to the row length, any row-length consecutive ones lie in distinct
    columns, and a spacing no larger than the number of rows leaves at least that many: every
    column holds one too."""
    numel = piece.tensor.numel()
    if numel <= SAMPLE:
        return 0, 1
    row = piece.tensor.shape[-1] if piece.tensor.dim() else 1
    rows = numel // row
    spacing = min(row, max(rows, FEW_ROWS), numel // SAMPLE)
    while spacing > 1 and math.gcd(spacing, row) != 1:
        spacing -= 1
    digest = hashlib.sha256(f"cover/{piece.key}/{piece.offsets}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % spacing, spacing


def covering(piece: Piece) -> torch.Tensor:
    """The piece's covering elements (``covering_slots``), flat: a strided view of its memory
    where it is contiguous, else a copy of those elements alone (a transposed view is not
    copied whole)."""
    start, spacing = covering_slots(piece)
    tensor = piece.tensor
    if tensor.is_contiguous() or tensor.dim() <= 1:
        return tensor.reshape(-1)[start::spacing]
    positions = torch.arange(start, tensor.numel(), spacing, device=tensor.device)
    return tensor[torch.unravel_index(positions, tensor.shape)]


def flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


def sample_checksums(pieces: list[Piece], take: Callable[[Piece], torch.Tensor]) -> list[str]:
    """The xxh3-64 of the bytes of each piece's sample (``take``: ``covering``, or ``sampled``
    for a record written before schema 7), read with one copy per device and dtype (one
    transfer from an accelerator)."""
    samples = [take(piece).detach() for piece in pieces]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, sample in enumerate(samples):
        groups.setdefault((sample.device, sample.dtype), []).append(index)
    sums = [""] * len(samples)
    for indexes in groups.values():
        raw = memoryview(torch.cat([samples[i] for i in indexes]).cpu().view(torch.uint8).numpy())
        start = 0
        for index in indexes:
            end = start + samples[index].numel() * samples[index].element_size()
            sums[index] = checksum(raw[start:end])
            start = end
    return sums
