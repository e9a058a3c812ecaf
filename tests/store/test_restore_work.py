"""No double work on the read path, counted at the storage layer (``storage_calls``): a restore
lists each tier's snapshots once and leases each snapshot it reads once, reads the global state
once, and with ``fallback=True`` reads each file of the composite it loads once (verifying it on
the way, not in a pass before); a save does not read back the manifest it just wrote."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from helpers import flip_unit_byte, tiny, train
from storage_calls import StorageCalls

from llmtailor import Parity, Run, Tailor, Tier
from llmtailor.constants import GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, LATEST_FILE, MANIFEST_FILE, SNAPSHOTS_DIR
from llmtailor.errors import IntegrityError
from llmtailor.store.keys import KIND_WEIGHT, split_key
from llmtailor.store.manifest import parse_manifest
from llmtailor.store.shared_reads import small_files


def saved(path, tokens, steps=(1, 2, 3), tiers=()):
    model, opt, sched = tiny()
    with Tailor(path, model, opt, sched, policy=Parity(), keep=None, tiers=list(tiers)) as tailor:
        for step in steps:
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
            tailor.wait(promoted=True)
    return path


def assert_weights_of(run, step, model):
    """Every weight of ``model`` is, bit for bit, the one the composite of ``step`` names."""
    live, seen = dict(model.named_parameters()), 0
    for unit, source in run.resolve(step).sources.items():
        for key, tensor in run.read_unit(source, unit)[0].items():
            kind, name, _ = split_key(key)
            if kind == KIND_WEIGHT:
                assert torch.equal(live[name].detach(), tensor), f"{name} (from step {source})"
                seen += 1
    assert seen == len(live)


def header_bytes(path) -> int:
    """Bytes of a safetensors file's header (read alone before its tensors); 0 for another file."""
    if path.suffix != ".safetensors":
        return 0
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


@pytest.fixture
def calls(monkeypatch) -> StorageCalls:
    return StorageCalls.install(monkeypatch)


def test_a_restore_lists_once_and_leases_each_snapshot_once(tmp_path, tokens, calls):
    home, memory = tmp_path / "home", tmp_path / "memory"
    saved(home, tokens, tiers=[Tier(memory, keep=None, promote_every=1)])
    tailor = Tailor(home, *tiny(seed=3), policy=Parity(), tiers=[Tier(memory)], read_only=True)
    calls.clear()
    report = tailor.restore()
    assert report.step == 3
    assert calls.count("list_dir", SNAPSHOTS_DIR) == 2  # each tier's snapshots, once
    leased = calls.leases()
    assert set(leased) == {Run.snapshot_key(2), Run.snapshot_key(3)}  # what the Parity composite of 3 reads
    assert max(leased.values()) == 1, leased
    assert calls.count("read", MANIFEST_FILE) <= 3  # each tier's newest, and the one older source


def test_a_restore_reads_the_global_state_once(tmp_path, tokens, calls):
    saved(tmp_path, tokens)
    model, opt, sched = tiny(seed=3)
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), read_only=True)
    calls.clear()
    tailor.restore()
    assert calls.count("read", GLOBAL_JSON) == 1 and calls.count("read", GLOBAL_TENSORS) == 1
    assert_weights_of(Run(tmp_path), 3, model)


def test_the_small_files_a_distributed_restore_shares_are_those_a_restore_reads(tmp_path, tokens, calls):
    """What the ranks of a job read once and send to one another (``shared_reads``): every unit
    index and global state file a restore reads (``small_files``: so no rank reads one itself),
    and manifests that come back equal from the JSON rank 0 sends."""
    saved(tmp_path, tokens)
    tailor = Tailor(tmp_path, *tiny(seed=3), policy=Parity(), read_only=True)
    calls.clear()
    tailor.restore()
    small = {key for op, key, _ in calls.calls
             if op == "read" and ("/index/" in key or key.endswith((INDEXES_FILE, GLOBAL_JSON, GLOBAL_TENSORS)))}
    run = Run(tmp_path)
    composite = run.resolve()
    assert {run.storage.where(key) for key, _ in small_files(run, composite).values()} == {run.storage.where(k) for k in small}
    assert sorted(run.needs(composite)) == [2, 3]  # the Parity composite of 3 reads units of 2 and 3
    for step in run.needs(composite):
        assert parse_manifest(run.manifest(step).model_dump_json().encode(), "sent", step) == run.manifest(step)


def counted_saves(location, tokens, calls: StorageCalls):
    """Two Parity saves of a tiny model to ``location``; after each, with ``calls`` holding what
    that save alone asked, yields the key of the manifest it committed."""
    model, opt, sched = tiny()
    with Tailor(location, model, opt, sched, policy=Parity()) as tailor:
        for step in (1, 2):
            train(model, opt, sched, tokens, [step])
            calls.clear()
            tailor.save(step)
            yield f"{Run.snapshot_key(step)}/{MANIFEST_FILE}"


def test_a_save_does_not_read_back_its_manifest(tmp_path, tokens, calls):
    for manifest in counted_saves(tmp_path, tokens, calls):
        assert not [c for c in calls.calls if c[1] == manifest and c[0] != "lease"], calls.calls
    assert Run(tmp_path).manifest(2).parent == 1


def test_fallback_reads_each_file_once_and_skips_a_damaged_composite(tmp_path, tokens, calls):
    saved(tmp_path, tokens)
    damaged = flip_unit_byte(tmp_path, 3, "layer.0")  # in its pack file, layer.0's own bytes
    model, opt, sched = tiny(seed=5)
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), read_only=True)
    calls.clear()
    report = tailor.restore(fallback=True)
    assert report.step == 2 and list(report.skipped) == [3]
    assert f"{damaged.name}: checksum mismatch" in report.skipped[3]
    again = {key: (n, size) for key, n in calls.bytes_by_key().items()
             if n > (size := (tmp_path / key).stat().st_size) + header_bytes(tmp_path / key)}
    assert not again, again  # each file's bytes read once (its header twice): verified while it is loaded
    assert_weights_of(Run(tmp_path), 2, model)


def test_on_an_object_store_a_restore_reads_each_file_once_and_a_save_reads_no_manifest_back(tmp_path, tokens, monkeypatch):
    """The same at an s3:// URL on moto's server: a save asks for no HEAD or GET of its manifest
    once written (only the HEAD before it writes: is that step's snapshot there already?);
    a restore of a Parity composite reads the global state once and each file's bytes once (its
    header aside), leasing each snapshot once."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from objectstore import moto_process, new_bucket, set_environment

    with moto_process() as endpoint:
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        calls = StorageCalls.install(monkeypatch)
        for manifest in counted_saves(url, tokens, calls):
            # One HEAD before anything is written (no snapshot of that step yet); none after.
            assert calls.count("read", manifest) == 0 and calls.count("size", manifest) == 1, calls.calls
        fresh = tiny(seed=3)
        reader = Tailor(url, *fresh, policy=Parity(), read_only=True)
        calls.clear()
        assert reader.restore().step == 2
        assert calls.count("read", GLOBAL_JSON) == 1 and calls.count("read", GLOBAL_TENSORS) == 1
        assert max(calls.leases().values()) == 1
        # Each manifest read by its snapshot's lease once written (its check that the snapshot is
        # committed), the newest's (``latest`` names it) and step 1's (the composite needs it):
        # not looked for (a HEAD) by the listing before, nor between the lease and the read.
        for step in (1, 2):
            manifest = f"{Run.snapshot_key(step)}/{MANIFEST_FILE}"
            assert calls.count("size", manifest) == 0 and calls.count("read", manifest) == 1, calls.calls
        run = Run(url)
        sizes = dict(run.storage.walk("snapshots"))  # the snapshots' files (the pointer aside)
        again = {key: n for key, n in calls.bytes_by_key().items() if key in sizes and n >= 2 * sizes[key]}
        assert not again, again  # a second whole read of any file (a header read alone is less)
        assert_weights_of(run, 2, fresh[0])


@contextmanager
def saved_on_moto(monkeypatch, tokens) -> Iterator[tuple[str, torch.nn.Module]]:
    """The URL of a run on a moto server of this test's (its environment set), where the tiny
    model trained one step and Parity saved it at step 1; and that model."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from objectstore import moto_process, new_bucket, set_environment

    with moto_process() as endpoint:
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Parity()) as tailor:
            train(model, opt, sched, tokens, [1])
            tailor.save(1)
        yield url, model


def restored_recording(url: str, monkeypatch) -> tuple[tuple, StorageCalls]:
    """A fresh tiny model restored from ``url`` (its step 1), and the storage calls it made."""
    fresh = tiny(seed=3)
    reader = Tailor(url, *fresh, policy=Parity(), read_only=True)
    calls = StorageCalls.install(monkeypatch)
    assert reader.restore().step == 1
    return fresh, calls


@pytest.mark.parametrize("into", [True, False], ids=["into-live-tensors", "fresh-buffers"])
def test_on_an_object_store_a_restore_asks_no_size_of_a_unit_file_before_reading_it(tmp_path, tokens, monkeypatch, into):
    """Each unit file in a file of its own on moto's server: the restore asks its size of no
    unit file in a request of its own (a HEAD, a round trip each): the ranged GET that reads
    its first bytes answers it, checked there (read straight into the live tensors, or into
    new buffers as a rank of a read plan does: ``into`` off), and every weight is the saved one."""
    from llmtailor.store import units, writer

    monkeypatch.setattr(writer, "PACK_UNIT_BYTES", 1)
    if not into:  # as ``_read_once``'s readers read: nothing to read into
        real = units.UnitReader.read
        monkeypatch.setattr(units.UnitReader, "read", lambda self, step, unit, skip=frozenset(), into=None:
                            real(self, step, unit, skip))
    with saved_on_moto(monkeypatch, tokens) as (url, _):
        fresh, calls = restored_recording(url, monkeypatch)
        unit_files = {key for _, key, _ in calls.calls if "/units/" in key}
        assert unit_files and not [c for c in calls.calls if c[0] == "size" and "/units/" in c[1]], calls.calls
        assert_weights_of(Run(url), 1, fresh[0])


def test_on_an_object_store_a_pack_file_s_header_comes_in_one_request_with_its_size(tmp_path, tokens, monkeypatch):
    """The tiny model's units in pack files on moto's server: a restore reads each pack's header
    in one ranged GET (its first 8 + header bytes, no data byte: the indexes at hand say how many
    data bytes the pack holds), with no HEAD of the pack, where it read the length word first,
    then the header: two requests, each a round trip."""
    with saved_on_moto(monkeypatch, tokens) as (url, _):
        run = Run(url)
        headers = {key: 8 + int.from_bytes(run.storage.read_range(key, 0, 8), "little")
                   for key, _ in run.storage.walk("snapshots") if "/packs/" in key}
        fresh, calls = restored_recording(url, monkeypatch)
        assert headers
        for key, header in headers.items():
            assert [c for c in calls.calls if c[1] == key and c[0] in ("read_start", "size")] == [("read_start", key, header)], calls.calls
        assert_weights_of(run, 1, fresh[0])


def test_a_manifest_is_read_in_one_request_not_looked_for_first(tmp_path, tokens, calls):
    """On an object store a look (a HEAD) is a round trip of its own, and a restore reads the
    manifests of its composite on rank 0 while every other rank waits: a manifest is read, and
    looked for only when the read finds nothing (to say the snapshot is not there)."""
    from llmtailor.errors import SnapshotNotFoundError

    saved(tmp_path, tokens, steps=(1, 2))
    calls.clear()
    assert Run(tmp_path).manifest(2).step == 2
    assert [op for op, key, _ in calls.calls if key.endswith(MANIFEST_FILE)] == ["read"], calls.calls
    with pytest.raises(SnapshotNotFoundError):
        Run(tmp_path).manifest(7)


class Meetings:
    """Pairs of requests (``(operation, key ending)``), each of which, the first time it is
    asked, waits for the other to have been asked too (up to ``patience`` seconds): asked side
    by side they meet at once; asked one after the other, the first waits in vain (``missed``)."""

    def __init__(self, *pairs: tuple[tuple[str, str], tuple[str, str]], patience: float = 10.0):
        self.asked = {tag: threading.Event() for pair in pairs for tag in pair}
        self.partner = {a: b for a, b in pairs} | {b: a for a, b in pairs}
        self.patience, self.missed = patience, []

    def install(self, monkeypatch, storage: type) -> None:
        for name in {operation for operation, _ in self.asked}:
            monkeypatch.setattr(storage, name, self._waiting(name, vars(storage)[name]))

    def _waiting(self, name, method):
        def asked(storage, key, *args, **kwargs):
            tag = next((t for t in self.asked if t[0] == name and key.endswith(t[1])), None)
            if tag is not None and not self.asked[tag].is_set():
                self.asked[tag].set()
                if not self.asked[self.partner[tag]].wait(self.patience):
                    self.missed.append(tag)
            return method(storage, key, *args, **kwargs)
        return asked


def test_on_an_object_store_a_lease_reads_the_manifest_it_checks_and_asks_its_requests_side_by_side(tokens, monkeypatch):
    """Rank 0 chooses and leases the composite while every other rank waits, each request a
    round trip on an object store: the ``latest`` pointer is read while the snapshots are
    listed; once the lease is written, its check that the snapshot is committed is the read of
    its manifest (kept, not read again), asked side by side with the look for retention's mark."""
    from llmtailor.store.storage.object_lock import REMOVING_MARK
    from llmtailor.store.storage.object_store import ObjectStore

    with saved_on_moto(monkeypatch, tokens) as (url, _):
        run = Run(url)
        manifest = f"{Run.snapshot_key(1)}/{MANIFEST_FILE}"
        meetings = Meetings((("list_dir", SNAPSHOTS_DIR), ("read", LATEST_FILE)),
                            (("size", REMOVING_MARK), ("read", manifest)))
        meetings.install(monkeypatch, ObjectStore)
        calls = StorageCalls.install(monkeypatch)
        with run.lease() as composite:
            assert composite.step == 1 and composite.manifest.step == 1
        assert meetings.missed == [], calls.calls
        requests = [(op, key) for op, key, _ in calls.calls if op != "is_file"]  # an is_file is its size's request
        # Read by the lease (the one ``latest`` names: not looked for by the listing), not read twice.
        assert [op for op, key in requests if key == manifest] == ["read"], requests
        assert len(requests) == 5, requests  # LIST, GET latest, the lease (its PUT), HEAD of the mark, GET manifest


def test_on_an_object_store_a_state_s_two_files_are_asked_side_by_side(tokens, monkeypatch):
    """A snapshot's state is two files (its JSON and its tensors: the global state, a rank's own
    state, which every rank but 0 reads last in a distributed restore); from an object store both
    are asked at once, one round trip, not one after the other. Each is still checked: a damaged
    tensors file is refused, naming it."""
    from llmtailor.errors import IntegrityError
    from llmtailor.store.storage.object_store import ObjectStore

    with saved_on_moto(monkeypatch, tokens) as (url, _):
        meetings = Meetings((("read", f"/{GLOBAL_JSON}"), ("read", f"/{GLOBAL_TENSORS}")))
        meetings.install(monkeypatch, ObjectStore)
        state = Run(url).read_global(1)
        assert meetings.missed == [] and state["step"] == 1
        key = f"{Run.snapshot_key(1)}/{GLOBAL_TENSORS}"
        run = Run(url)
        damaged = bytearray(run.storage.read(key))
        damaged[-1] ^= 0xFF
        run.storage.put(key, bytes(damaged))
        with pytest.raises(IntegrityError, match=rf"{GLOBAL_TENSORS}: checksum mismatch"):
            Run(url).read_global(1)


def test_on_an_object_store_a_pack_of_one_unit_is_read_by_a_reader_in_one_request(tokens, monkeypatch):
    """A rank of a read plan reads each unit it reads for the others into new buffers (nothing to
    read straight into). From moto's server, a pack holding that unit's tensors alone is read
    whole, as a unit file is: its size, header and data in one request, where its header came
    first in a request of its own; every tensor is the saved one, and a damaged byte of the pack
    is refused, naming it."""
    from llmtailor.errors import IntegrityError
    from llmtailor.store import writer

    monkeypatch.setattr(writer, "PACK_FILE_BYTES", 1)  # each unit in a pack of its own
    with saved_on_moto(monkeypatch, tokens) as (url, model):
        run = Run(url)
        units = run.resolve(1).sources
        packs = {unit: f"{Run.snapshot_key(1)}/{run.unit_entry(1, unit).files[0].path}" for unit in units}  # every index parsed
        assert len(set(packs.values())) == len(units) > 2 and all("/packs/" in key for key in packs.values())
        calls = StorageCalls.install(monkeypatch)
        for unit in units:
            run.read_unit(1, unit)
        by_pack = {key: [op for op, asked, _ in calls.calls if asked == key] for key in packs.values()}
        assert all(ops == ["read_start"] for ops in by_pack.values()), by_pack
        assert_weights_of(run, 1, model)
        unit, key = next(iter(packs.items()))
        damaged = bytearray(run.storage.read(key))
        damaged[-1] ^= 0xFF  # a data byte
        run.storage.put(key, bytes(damaged))
        fresh = Run(url)
        for other in units:
            fresh.unit_entry(1, other)
        with pytest.raises(IntegrityError, match="checksum mismatch") as raised:
            fresh.read_unit(1, unit)
        assert key in str(raised.value)


def read_together(run: Run, units: list[str], step: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """``units`` of ``step`` read one after another as a rank of a read plan reads its items:
    told first which it reads (``Run.reading_together``; a tree without it reads each alone)."""
    together = getattr(run, "reading_together", None)
    with together([(step, unit, ()) for unit in units]) if together is not None else contextlib.nullcontext():
        return {unit: run.read_unit(step, unit)[0] for unit in units}


def pack_of(run: Run, step: int = 1) -> tuple[str, dict[str, int]]:
    """The key of the one pack file of ``step`` (every unit of the tiny model is small), and the
    bytes of tensor data each unit holds in it (every unit's index parsed, as a restore has them)."""
    units = run.resolve(step).sources
    entries = {unit: run.unit_entry(step, unit) for unit in units}
    (path,) = {file.path for entry in entries.values() for file in entry.files}
    held = {unit: sum(math.prod(c.shape) * t.torch_dtype.itemsize for t in entry.tensors for c in t.chunks)
            for unit, entry in entries.items()}
    return f"{Run.snapshot_key(step)}/{path}", held


def damaged_layer_2(run: Run, pack: str) -> str:
    """A byte of the first tensor of layer.2 in ``pack`` flipped in the store; that tensor's name."""
    damaged = bytearray(run.storage.read(pack))
    offset = 8 + int.from_bytes(damaged[:8], "little")
    header = json.loads(damaged[8:offset])
    name = next(n for n in header if n.startswith("weight/model.layers.2."))
    damaged[offset + header[name]["data_offsets"][0]] ^= 0xFF
    run.storage.put(pack, bytes(damaged))
    return name


def test_on_an_object_store_the_units_a_reader_reads_of_one_pack_come_in_one_request_each_tensor_checked(tokens, monkeypatch):
    """A rank of a read plan reading every unit of a pack (a DDP restore at the world size of
    the save): told which units it reads, it fetches the pack in one request (its size, header
    and data together) where it asked for the header, then each unit's bytes, one request after
    another; every tensor is bitwise the one a unit's own read gives, and a damaged byte is
    refused by the read of the unit it belongs to, naming the pack and the tensor, while the
    others still read."""
    with saved_on_moto(monkeypatch, tokens) as (url, model):
        run = Run(url)
        pack, held = pack_of(run)
        assert len(held) > 3
        calls = StorageCalls.install(monkeypatch)
        loaded = read_together(run, list(held))
        assert [(op, n) for op, key, n in calls.calls if key == pack] == [("read_start", run.storage.size(pack))]
        alone = Run(url)
        for unit, tensors in loaded.items():
            expected = alone.read_unit(1, unit)[0]
            assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected), unit
        assert_weights_of(run, 1, model)

        name = damaged_layer_2(run, pack)
        fresh = Run(url)
        pack_of(fresh)
        with fresh.reading_together([(1, unit, ()) for unit in held]):
            for unit in held:
                if unit != "layer.2":
                    fresh.read_unit(1, unit)
                    continue
                with pytest.raises(IntegrityError, match="checksum mismatch in tensor") as refused:
                    fresh.read_unit(1, unit)
                assert pack in str(refused.value) and name in str(refused.value)


def test_on_an_object_store_a_pack_read_together_whole_lands_in_the_live_tensors_given_each_tensor_checked_there(
        tokens, monkeypatch):
    """A rank of a read plan reading its units of a pack together, with live tensors to land them
    in (a DDP restore's own items: its weights and optimizer state): the pack still comes in one
    request, and the bytes of each tensor that has a live one land in its memory (the tensor read
    is that live tensor, not a view of a new buffer), bitwise a unit's own read; a damaged byte is
    refused by the read of its unit, naming the pack and the tensor, checked where it landed."""
    with saved_on_moto(monkeypatch, tokens) as (url, _):
        run = Run(url)
        pack, held = pack_of(run)
        alone = Run(url)
        expected = {unit: alone.read_unit(1, unit)[0] for unit in held}
        live = {(1, unit): {key: torch.zeros_like(t) for key, t in tensors.items()} for unit, tensors in expected.items()}
        calls = StorageCalls.install(monkeypatch)
        with run.reading_together([(1, unit, ()) for unit in held], live):
            loaded = {unit: run.read_unit(1, unit, into=live[(1, unit)])[0] for unit in held}
        assert [(op, n) for op, key, n in calls.calls if key == pack] == [("read_start", run.storage.size(pack))]
        for unit, tensors in loaded.items():
            assert tensors.keys() == expected[unit].keys(), unit
            assert all(tensors[k] is live[(1, unit)][k] and torch.equal(tensors[k], expected[unit][k]) for k in tensors), unit

        name = damaged_layer_2(run, pack)
        fresh = Run(url)
        pack_of(fresh)
        with fresh.reading_together([(1, unit, ()) for unit in held], live):
            for unit in held:
                if unit != "layer.2":
                    fresh.read_unit(1, unit, into=live[(1, unit)])
                    continue
                with pytest.raises(IntegrityError, match="checksum mismatch in tensor") as refused:
                    fresh.read_unit(1, unit, into=live[(1, unit)])
                assert pack in str(refused.value) and name in str(refused.value)


@pytest.mark.parametrize("left_out", ["layer.1", "norm"])
def test_on_an_object_store_a_pack_read_together_takes_in_no_large_gap(tokens, monkeypatch, left_out):
    """A reader reading all but one unit of a pack (another rank reads that one): the ranges it
    wants are fetched in as few requests as the bytes between them allow: a large unit left out
    (a layer: a third of what it wants) is not fetched, its two sides are a request each after
    the header's; a small one (the norm: a few hundred bytes) is, the pack read whole in one
    request. Either way the bytes fetched are at most those wanted and the header, plus
    1/``TOGETHER_GAP`` (where each unit read alone asked for the header, then each unit)."""
    from llmtailor.store.units import TOGETHER_GAP

    with saved_on_moto(monkeypatch, tokens) as (url, _):
        run = Run(url)
        pack, held = pack_of(run)
        units = [unit for unit in held if unit != left_out]
        calls = StorageCalls.install(monkeypatch)
        loaded = read_together(run, units)
        asked = [(op, n) for op, key, n in calls.calls if key == pack]
        wanted, size = sum(held[unit] for unit in units), run.storage.size(pack)
        header = size - sum(held.values())
        if left_out == "norm":
            assert asked == [("read_start", size)]
        else:
            assert [op for op, _ in asked] == ["read_start", "read_range", "read_range"], asked
        assert sum(n for _, n in asked) <= header + wanted + wanted // TOGETHER_GAP
        alone = Run(url)
        for unit, tensors in loaded.items():
            assert all(torch.equal(tensor, alone.read_unit(1, unit)[0][key]) for key, tensor in tensors.items()), unit


def test_on_an_object_store_units_of_a_pack_read_together_from_several_threads_fetch_it_once(tokens, monkeypatch):
    """Threads reading units of one pack read together at once (a read plan's reader may read on
    several): the first fetches the pack, the others wait for its bytes, none fetches it again;
    each gets its own unit's tensors, bitwise those of a unit's own read."""
    from concurrent.futures import ThreadPoolExecutor

    with saved_on_moto(monkeypatch, tokens) as (url, _):
        run = Run(url)
        pack, held = pack_of(run)
        calls = StorageCalls.install(monkeypatch)
        with run.reading_together([(1, unit, ()) for unit in held]), ThreadPoolExecutor(len(held)) as pool:
            loaded = dict(zip(held, pool.map(lambda unit: run.read_unit(1, unit)[0], held)))
        assert [op for op, key, _ in calls.calls if key == pack] == ["read_start"]
        alone = Run(url)
        for unit, tensors in loaded.items():
            expected = alone.read_unit(1, unit)[0]
            assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected), unit


@pytest.mark.parametrize("whole", [True, False])
def test_on_an_object_store_a_failed_fetch_of_a_pack_read_together_fails_every_thread_waiting_for_it(
        tokens, monkeypatch, whole):
    """Threads reading units of one pack together: the first one's fetch of the pack (whole, or
    its header before its spans) fails (a connection reset): every thread's read raises that
    failure, those waiting for the first one's bytes included; none waits for ever, none is
    handed a byte."""
    from concurrent.futures import ThreadPoolExecutor

    from llmtailor.store import units as units_module

    with saved_on_moto(monkeypatch, tokens) as (url, _):
        run = Run(url)
        pack, held = pack_of(run)
        started = threading.Barrier(len(held))

        def reset(*args, **kwargs):
            raise ConnectionResetError(104, "Connection reset by peer")

        if whole:
            monkeypatch.setattr(units_module, "fetch_whole", reset)
        else:
            monkeypatch.setattr(units_module, "TOGETHER_BYTES", 1)  # not read whole: its header first, then spans
            monkeypatch.setattr(units_module, "check_stored_header", reset)

        def read(unit: str):
            started.wait(60)  # every thread reads at once: the others wait for the first one's fetch
            return run.read_unit(1, unit)[0]

        with run.reading_together([(1, unit, ()) for unit in held]), ThreadPoolExecutor(len(held)) as pool:
            reads = [pool.submit(read, unit) for unit in held]
            for reading in reads:
                with pytest.raises(ConnectionResetError, match="Connection reset by peer"):
                    reading.result(timeout=120)


def test_a_readers_caches_kept_from_several_threads_at_once_drop_their_oldest_without_failing(tmp_path):
    """A reader's threads (a restore's pool, units of a pack read together) share its caches of
    unit indexes, pack headers and index files: several at once at a full cache each drop the
    oldest entry and keep theirs, none failing on an entry another dropped first (a KeyError)."""
    import sys

    from llmtailor.store import units

    reader = Run(tmp_path / "run").units
    failures, interval = [], sys.getswitchinterval()

    def keep(thread):
        try:
            for i in range(3000):
                reader._cache((thread, i), "an index")
                reader._cache((thread, i), "an index")  # again: kept still, or dropped already by another thread
        except Exception as err:  # noqa: BLE001  (what the assertion reports)
            failures.append(repr(err))

    sys.setswitchinterval(1e-6)  # threads switched as often as the interpreter can: the interleavings a busy pool meets
    try:
        threads = [threading.Thread(target=keep, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == [] and len(reader._units) <= units._UNIT_CACHE


def test_on_an_object_store_a_unit_file_of_up_to_a_large_part_and_a_half_is_read_in_one_get_counted_at_the_server(tokens, monkeypatch):
    """S3's server counts the requests: a restore reads a unit file of 18 MB (a 6000 x 256
    embedding with AdamW's two moments) in one ranged GET, into the live tensors or, as a rank
    of a read plan reads, into new buffers. It was two GETs of 8 MiB parts (three for the bench's
    24.6 MB units), and a server such as moto reads the whole object for each. Every weight is
    the saved one."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from objectstore import faulty_moto, new_bucket, set_environment

    from llmtailor.training_example import TinyConfig, build_model, hf_param_groups

    def trained(seed: int):
        model = build_model(TinyConfig(hidden_size=256, layers=1, intermediate_size=64, vocab_size=6000), seed=seed)
        optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-3)
        batch = torch.randint(0, 6000, (1, 16))
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        return model, optimizer

    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        with Tailor(url, *trained(0), policy=Parity(), track_drift=False) as tailor:
            tailor.save(1)
        run = Run(url)
        sizes = {key: n for key, n in run.storage.walk("snapshots") if "/units/" in key}
        assert sizes and all(12 << 20 < n <= 24 << 20 for n in sizes.values()), sizes  # embed and head
        for into in (True, False):
            if not into:  # as ``_read_once``'s readers read: nothing to read into
                from llmtailor.store import units
                real = units.UnitReader.read
                monkeypatch.setattr(units.UnitReader, "read", lambda self, step, unit, skip=frozenset(), into=None:
                                    real(self, step, unit, skip))
            fresh = trained(3)
            faults.ranges.clear()
            Tailor(url, *fresh, policy=Parity(), read_only=True, track_drift=False).restore()
            gets = {key: [r for method, asked, r in faults.ranges if method == "GET" and asked.endswith(f"/{key}")] for key in sizes}
            assert all(len(ranges) == 1 for ranges in gets.values()), gets
            assert_weights_of(run, 1, fresh[0])
