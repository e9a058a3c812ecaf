"""Files a node-local tier's healing received and checked as they arrived are handed to the
restore that follows (``UnitReader.arrived``): a read takes those bytes, not the file, exactly
when the size and checksum they were checked against are the ones its entry records; otherwise
it reads the file and checks it as always. A restore empties what was handed over.
Unit files and packs, tensors read straight into live memory and through buffers alike."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import parity_run, tiny

from llmtailor import Parity, Run, Tailor
from llmtailor.store import checked, writer
from llmtailor.store.storage.local import LocalStorage
from llmtailor.store.tensor_files import checksum


@pytest.fixture(params=["own files", "packs"])
def run(request, monkeypatch, tmp_path, tokens) -> Run:
    """A Parity run of steps 1 and 2, each unit in a file of its own or the tiny units in packs."""
    if request.param == "own files":
        monkeypatch.setattr(writer, "PACK_UNIT_BYTES", 1)
    return Run(parity_run(tmp_path / "run", tokens, 2))


def unit_files(run: Run, step: int) -> dict[str, tuple[int, str]]:
    """Key -> (size, xxh3) of every tensor file the composite of ``step`` reads."""
    files = {}
    for unit, source in run.resolve(step).sources.items():
        for file in run.unit_entry(source, unit).files:
            files[run.file_location(source, file)[1]] = (file.bytes, file.xxh3_64)
    return files


def read_all(run: Run, step: int) -> dict[str, torch.Tensor]:
    out = {}
    for unit, source in run.resolve(step).sources.items():
        out.update({f"{unit}/{key}": tensor.clone() for key, tensor in run.read_unit(source, unit)[0].items()})
    return out


def refusing_reads(monkeypatch, keys) -> None:
    """Any read of the bytes of a file of ``keys`` from a LocalStorage fails the test."""
    for method in ("read", "pieces", "read_range", "read_into"):
        real = getattr(LocalStorage, method)

        def refused(self, key, *args, real=real, **kwargs):
            assert key not in keys, f"{key} read from the store although its checked bytes were handed over"
            return real(self, key, *args, **kwargs)

        monkeypatch.setattr(LocalStorage, method, refused)


def test_a_file_handed_over_as_it_arrived_is_read_from_those_bytes(run, monkeypatch):
    expected = read_all(Run(run.root), 2)
    files = unit_files(run, 2)
    for key, (size, xxh3) in files.items():
        run.units.arrived[key] = (size, xxh3, memoryview(bytearray((run.root / key).read_bytes())))
    refusing_reads(monkeypatch, set(files))
    got = read_all(run, 2)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_a_file_handed_over_is_copied_into_the_live_tensors_by_the_copiers_bit_exact(run, monkeypatch):
    """A handed-over file's tensors read into live tensors (``into``) are copied there in pieces
    by the copiers' pool (``checked.copy_bytes``; pieces of 64 bytes here: many per tensor, and
    small tensors together): the very live tensors come back, bit-exact."""
    expected = read_all(Run(run.root), 2)
    for key, (size, xxh3) in unit_files(run, 2).items():
        run.units.arrived[key] = (size, xxh3, memoryview(bytearray((run.root / key).read_bytes())))
    monkeypatch.setattr(checked, "COPY_PIECE", 64)
    copied = []
    real = checked._copy
    monkeypatch.setattr(checked, "_copy", lambda pieces: (copied.append(threading.current_thread().name), real(pieces)))
    for unit, source in run.resolve(2).sources.items():
        entry = run.unit_entry(source, unit)
        into = {t.key: torch.full(t.shape, 7, dtype=t.torch_dtype) for t in entry.tensors if len(t.chunks) == 1}
        got = run.read_unit(source, unit, into=into)[0]
        assert into and all(got[key] is into[key] for key in into)
        assert all(torch.equal(got[key], expected[f"{unit}/{key}"]) for key in got)
    assert any(name.startswith("llmtailor-copy") for name in copied)


def test_a_failed_copier_fails_the_copy_only_once_every_other_copier_ended(monkeypatch):
    """A copier's task that fails while another still copies into a live tensor: ``copy_bytes``
    raises that failure once the other has ended, never with a copy still landing in the live
    state behind it (the restore's next composite, loaded after the failure, would be overwritten
    in part by the failed one's bytes). The other task is released a second after it started."""
    monkeypatch.setattr(checked, "COPY_PIECE", 16)
    pairs = [(torch.zeros(4), torch.full((4,), float(i))) for i in range(3)]  # 16 bytes each: one task each
    failing, slow = pairs[1][0].data_ptr(), pairs[2][0].data_ptr()
    slow_started, ended = threading.Event(), threading.Event()
    real = checked._copy

    def copy(pieces):
        if pieces[0][0].data_ptr() == failing:
            slow_started.wait(60)
            raise RuntimeError("injected copy failure")
        if pieces[0][0].data_ptr() == slow:
            slow_started.set()
            threading.Event().wait(1.0)
        real(pieces)
        if pieces[0][0].data_ptr() == slow:
            ended.set()

    monkeypatch.setattr(checked, "_copy", copy)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        checked.copy_bytes(pairs)
    assert ended.is_set()
    assert torch.equal(pairs[2][0], pairs[2][1]) and torch.equal(pairs[0][0], pairs[0][1])


@pytest.mark.parametrize("verify", [False, True])
def test_a_box_read_of_a_file_handed_over_but_not_yet_written_takes_its_header_and_bytes_from_what_arrived(run, verify):
    """FSDP2's reads (``ChunkReader``) of a healed file whose write runs in the background
    (``healing.Receiving``): the file's header too comes from the arrived bytes."""
    from llmtailor.store.reader import ChunkReader

    expected = read_all(Run(run.root), 2)
    for key, (size, xxh3) in unit_files(run, 2).items():
        run.units.arrived[key] = (size, xxh3, memoryview(bytearray((run.root / key).read_bytes())))
        (run.root / key).unlink()  # not written yet
    reader = ChunkReader(run, verify=verify)
    for unit, source in run.resolve(2).sources.items():
        entry = run.unit_entry(source, unit)
        for tensor in entry.tensors:
            got = reader.read_region(source, entry, tensor, (0,) * len(tensor.shape), tuple(tensor.shape))
            assert torch.equal(got, expected[f"{unit}/{tensor.key}"]), tensor.key


def test_bytes_checked_against_another_record_than_the_entry_are_not_taken(run):
    expected = read_all(Run(run.root), 2)
    for key, (size, xxh3) in unit_files(run, 2).items():
        damaged = bytearray((run.root / key).read_bytes())
        damaged[-1] ^= 0xFF  # other bytes, checked against their own checksum: not the entry's
        run.units.arrived[key] = (size, checksum(damaged), memoryview(damaged))
    got = read_all(run, 2)
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_a_restore_empties_what_was_handed_over(tmp_path, tokens):
    """Checked (a receiver's) or not yet (a sender's own files, ``unchecked``): a mapping of the
    node's copy is not held past the restore it served."""
    path = parity_run(tmp_path / "run", tokens, 2)
    model, opt, sched = tiny()
    with Tailor(path, model, opt, sched, policy=Parity()) as tailor:
        units = tailor.tiers.levels[0].run.units
        arrived, unchecked = units.arrived, units.unchecked
        arrived["snapshots/step-00000002/not-read"] = (1, "0", memoryview(b"x"))
        unchecked["snapshots/step-00000002/not-read-either"] = (1, "0", memoryview(b"x"))
        assert tailor.restore().step == 2
        assert arrived == {} and unchecked == {}


def test_a_restore_empties_what_a_healing_handed_over_after_forgetting_its_snapshot(tmp_path, tokens, monkeypatch):
    """A healing hands its files over after it forgot the cached state of the snapshot it
    committed (``Receiving.finish``: ``Run.forget``, then ``_hand_over``); the restore that
    follows still empties them when it ends (the received bytes, up to ``HAND_OVER_BYTES``, are
    not held in memory until retention removes the snapshot), and opens the gate the healed
    copy's writes wait on (``Catalog.hold_back``)."""
    path = parity_run(tmp_path / "run", tokens, 2)
    model, opt, sched = tiny()
    with Tailor(path, model, opt, sched, policy=Parity()) as tailor:
        run, gates = tailor.tiers.levels[0].run, []

        def healed(coordinator, step):  # what a healing does before the restore reads: forget, then hand over
            run.forget([2])
            run.units.arrived["snapshots/step-00000002/not-read"] = (1, "0", memoryview(b"x"))
            gates.append(run.hold_back())
            return None, {}

        monkeypatch.setattr(tailor.tiers, "recover", healed)
        assert tailor.restore().step == 2
        assert run.units.arrived == {}
        assert gates and gates[0].is_set()


def test_a_local_file_mapped_reads_its_bytes_and_writes_to_the_mapping_stay_private(tmp_path):
    """``LocalStorage.mapped`` (what a healing sends a file from, no copy): the file's bytes; a
    write to the mapping leaves the file as it was; an empty file is not mapped (None)."""
    storage = LocalStorage(tmp_path)
    storage.put("file", b"0123456789")
    storage.put("empty", b"")
    mapped = storage.mapped("file")
    assert bytes(mapped) == b"0123456789"
    mapped[0:1] = b"X"
    assert (tmp_path / "file").read_bytes() == b"0123456789"
    assert storage.mapped("empty") is None


@pytest.mark.parametrize("ended_by", ["the restore's end", "its snapshot forgotten"])
def test_bytes_whose_check_ends_after_the_restore_they_served_are_not_kept_for_the_next(tmp_path, monkeypatch, ended_by):
    """A sender's own file handed to its restore unchecked (``UnitReader.unchecked``) is checked
    by its first reader; where that check was still under way as the restore ended
    (``clear_arrivals``) or the snapshot was forgotten (``forget``), its end put the bytes into
    ``arrived``, held past the restore they served: the next restore took them for the file
    without hashing them again, though the first may have handed them on as live tensors that
    training then wrote into. Now that check keeps nothing, and the next read reads the file.
    (The check's lock of that file, ``_checking``, went with neither; it is dropped with them.)"""
    from llmtailor.store import units as units_module
    from llmtailor.store.manifest import FileEntry

    run = Run(tmp_path / "run")
    content = bytearray(b"\x07" * 64)
    key, entry = "snapshots/step-00000002/units/u.safetensors", FileEntry(path="units/u.safetensors", bytes=64,
                                                                          xxh3_64=checksum(content))
    run.units.unchecked[key] = (64, entry.xxh3_64, memoryview(content))
    hashing, go, real = threading.Event(), threading.Event(), units_module.checksum

    def held_checksum(data):
        hashing.set()
        go.wait(60)
        return real(data)

    monkeypatch.setattr(units_module, "checksum", held_checksum)
    reading = threading.Thread(target=run.units.arrival, args=(run.storage, key, entry))
    reading.start()
    assert hashing.wait(60)
    if ended_by == "the restore's end":
        run.units.clear_arrivals()
    else:
        run.forget([2])
    go.set()
    reading.join(60)
    assert run.units.arrival(run.storage, key, entry) is None, "bytes of a restore that ended taken for the file"
    assert run.units._checking == {}
