"""The covering sample frozen tensors are fingerprinted and checked by (``store/samples.py``):
an element of every row and, in a tensor of at least ``FEW_ROWS`` rows, of every column, at a
small fraction of the tensor; the same at every call, on a copy or on a transposed view."""

from __future__ import annotations

import math

import pytest
import torch

from llmtailor.store.samples import FEW_ROWS, SAMPLE, covering, covering_slots
from llmtailor.store.staged import Piece

SHAPES = [(32000, 4096), (4096, 11008), (4096, 4096), (152064, 8192), (256, 32), (64, 32), (63, 1000), (3, 1000),
          (1, 50000), (50000, 1), (50000, 2), (8, 100, 64), (1, 1, 7), (50000,), (4096,), (100,), (), (0, 8), (8, 0), (0,)]


def positions(shape: tuple[int, ...], key: str = "weight/w", offsets: tuple[int, ...] | None = None) -> range:
    """Where ``covering`` samples a tensor of ``shape`` (shape only: a meta tensor, no memory)."""
    tensor = torch.empty(shape, device="meta")
    piece = Piece(key, tensor, offsets if offsets is not None else (0,) * len(shape), shape)
    start, spacing = covering_slots(piece)
    return range(start, tensor.numel(), spacing)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_covering_sample_holds_every_row_and_every_column_at_a_small_fraction(shape):
    numel = math.prod(shape)
    at = positions(shape)
    if numel == 0:
        assert len(at) == 0
        return
    row = shape[-1] if shape else 1
    rows = numel // row
    assert {p // row for p in at} == set(range(rows))  # every row
    if rows >= FEW_ROWS or numel <= SAMPLE:
        assert {p % row for p in at} == set(range(row))  # every column
    assert len(at) >= min(numel, SAMPLE)
    if min(rows, row) >= FEW_ROWS:  # a model's matrix: about the larger of rows and row length
        assert len(at) <= max(rows, row, SAMPLE) * 1.1
    assert positions(shape) == at  # the same at every call


def test_the_largest_shapes_sample_a_ten_thousandth_of_their_elements():
    assert len(positions((32000, 4096))) == 32008
    assert len(positions((32000, 4096))) / (32000 * 4096) < 1 / 4000


def test_the_covering_sample_starts_from_the_pieces_key_and_offsets():
    starts = {positions((4096, 4096), key=f"weight/layer.{i}").start for i in range(16)}
    assert len(starts) > 8
    assert positions((4096, 4096), offsets=(0, 0)) != positions((4096, 4096), offsets=(4096, 0))


def test_covering_reads_the_elements_it_names_from_a_copy_or_a_transposed_view():
    drawn = torch.randn(300, 70, generator=torch.Generator().manual_seed(0))
    piece = Piece.whole("weight/w", drawn)
    at = list(positions((300, 70)))
    assert torch.equal(covering(piece), drawn.reshape(-1)[at])
    transposed = drawn.t().contiguous().t()  # the same values, column-major memory
    assert not transposed.is_contiguous()
    assert torch.equal(covering(Piece.whole("weight/w", transposed)), covering(piece))
    assert covering(piece).data_ptr() == drawn.data_ptr() + at[0] * drawn.element_size()  # a view, no copy
