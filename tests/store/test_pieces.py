"""A unit read in pieces by several readers (``store.pieces``, as a DDP restore's read plan cuts
a unit larger than a reader's share: ``read_plan.spread``), on moto's S3 server, one process
standing for the readers: each reads about its share of the composite and each byte once
(counted at the storage layer), the pieces put together equal the saved tensors, and a flipped
byte is refused by the one reader whose pages hold it, naming the tensor and the bytes."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny, unit_chunk_middle
from storage_calls import StorageCalls

from llmtailor import Full, Tailor
from llmtailor.distributed.read_plan import spread
from llmtailor.errors import IntegrityError
from llmtailor.store import pieces, writer
from llmtailor.store.pieces import PieceReader, cut_points, segments
from llmtailor.store.run import Run

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import moto_process, new_bucket, set_environment  # noqa: E402

READERS = 3


def _bytes(tensors) -> int:
    return sum(t.numel() * t.dtype.itemsize for t in tensors)


def test_units_read_in_pieces_give_each_reader_its_share_each_byte_once_and_a_flipped_byte_is_refused(monkeypatch):
    with moto_process() as endpoint:
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        model, _, _ = tiny(layers=1, hidden=512)  # embed and head 256 x 512 fp32: 512 KiB, paged
        monkeypatch.setattr(writer, "PACK_UNIT_BYTES", 0)  # each unit in a file of its own, as a large one
        with Tailor(url, model, policy=Full()) as tailor:
            tailor.save(1)
        run = Run(url)
        sources = run.resolve().sources
        entries = {unit: run.unit_entry(step, unit) for unit, step in sources.items()}
        monkeypatch.setattr(pieces, "CUT_FROM", 0)  # the tiny units cut as a large one would be
        sizes = {unit: sum(_size(t) for t in entry.tensors) for unit, entry in entries.items()}
        cuts = {unit: cut_points(run, sources[unit], entry, entry.tensors) for unit, entry in entries.items()}
        assert cuts["embed"] and cuts["head"]
        share = -(-sum(sizes.values()) // READERS)
        spread_over = spread(sizes, READERS, cuts, least=64 << 10)
        calls = StorageCalls.install(monkeypatch)
        got: dict[str, dict[str, torch.Tensor]] = {unit: {} for unit in entries}
        fetched = []
        for reader in range(READERS):
            calls.clear()
            read = PieceReader(run)
            for unit, cut in spread_over.items():
                for start, end, owner in cut:
                    if owner != reader:
                        continue
                    piece = segments(entries[unit].tensors, start, end)
                    for (tensor, first, last), value in zip(piece, read.read(sources[unit], entries[unit], piece)):
                        got[unit].setdefault(tensor.key, torch.empty(tensor.shape, dtype=tensor.torch_dtype))
                        got[unit][tensor.key][first:last] = value
            fetched.append(calls.bytes_by_key())
        headers = 4 << 10  # a header read per file a reader reads part of
        data = [sum(n for key, n in f.items() if "/units/" in key or key.endswith(".safetensors")) for f in fetched]
        assert max(data) <= share + (64 << 10) + 2 * headers, (data, share)
        keys = {key for f in fetched for key in f}
        assert sum(data) <= sum(sizes.values()) + len(keys) * READERS * headers  # each byte once
        for unit, entry in entries.items():
            expected, _ = run.read_unit(sources[unit], unit)
            assert all(torch.equal(got[unit][key], value) for key, value in expected.items()), unit

        # A flipped byte in the middle of the head's first tensor: of the readers of its pieces, the
        # one whose pages hold it refuses it, naming the tensor and the bytes.
        storage, key, at = unit_chunk_middle(run, sources["head"], "head")
        raw = bytearray(storage.read(key))
        raw[at] ^= 0xFF
        storage.replace(key, bytes(raw))
        refused = []
        for start, end, _ in spread_over["head"]:
            piece = segments(entries["head"].tensors, start, end)
            try:
                PieceReader(run).read(sources["head"], entries["head"], piece)
            except IntegrityError as err:
                refused.append(str(err))
        assert len(refused) == 1 and "checksum mismatch" in refused[0] and ", bytes " in refused[0], refused


def _size(tensor) -> int:
    return int(torch.Size(tensor.shape).numel()) * tensor.torch_dtype.itemsize
