"""A piece's fixed sample of values: every k-th element from a start drawn from a seed and the
piece's key and offsets (``sample_slots``), the same at every call, and its checksum. The drift
tracker (``drift.py``) measures change on it; frozen tensors are fingerprinted by it at save
(``frozen.py``) and checked against it at restore (``providers/local.py``): a cache line per
sampled element instead of a pass over the tensor."""

from __future__ import annotations

import hashlib
import math

import torch

from llmtailor.store.staged import Piece
from llmtailor.store.tensor_files import checksum

SAMPLE = 1024


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


def flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


def sample_checksums(pieces: list[Piece]) -> list[str]:
    """The xxh3-64 of the bytes of each piece's sampled elements (``sampled``), read with one
    copy per device and dtype (one transfer from an accelerator)."""
    samples = [sampled(piece).detach() for piece in pieces]
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
