"""Concurrent ranged reads (``store/fetch.py``): a range larger than a part is fetched as several
parts, in parallel, into one buffer, and checksummed in order; what a chunk reader and a unit
reader return is bit for bit what was saved, and a damaged chunk is still named with its file
and tensor, and refused, before any byte of it is used. (Parts are made small here, so a tiny
tensor takes the parallel path a large one takes.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future

import pytest
import torch
import xxhash
from storage_calls import StorageCalls

from llmtailor.errors import IntegrityError
from llmtailor.layouts import layout_from_names
from llmtailor.store import fetch
from llmtailor.store.reader import ChunkReader
from llmtailor.store.run import Run
from llmtailor.store.staged import Piece, StagedSnapshot, StagedUnit
from llmtailor.store.storage.local import LocalStorage
from llmtailor.store import writer
from llmtailor.store.writer import persist

SHAPE = (64, 48)
FULL = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
PART = 1024


@pytest.fixture
def run(tmp_path, monkeypatch) -> Run:
    """One snapshot of one tensor in one chunk of 12 KiB: 12 parts of ``PART`` bytes, in a file of
    its own (a unit as large as packs leave alone: small units share a pack, read by ranges)."""
    monkeypatch.setattr(fetch, "PART", PART)
    monkeypatch.setattr(writer, "PACK_UNIT_BYTES", 1)
    layout = layout_from_names(["w"])
    staged = StagedSnapshot(
        step=1, parent=None, save_index=0, policy="test", layout=layout.to_record(),
        units=iter([StagedUnit(layout.unit_of("w"), [Piece("weight/w", FULL.clone(), (0, 0), SHAPE)])]),
        composite={u: 1 for u in layout.units}, global_doc={}, global_tensors={},
    )
    persist(Run(tmp_path), staged)
    return Run(tmp_path)


def only_tensor(run: Run):
    unit = run.unit_entry(1, next(iter(run.manifest(1).units)))
    [tensor] = unit.tensors
    return unit, tensor


@pytest.mark.parametrize("verify", [True, False])
def test_a_chunk_is_fetched_in_parts_from_several_threads_and_equals_what_was_saved(run, monkeypatch, verify):
    calls = StorageCalls.install(monkeypatch)
    threads = set()
    counted = LocalStorage.read_into  # the counting wrapper: note which thread each part runs on

    def noting(storage, key, start, into):
        threads.add(threading.get_ident())
        return counted(storage, key, start, into)

    monkeypatch.setattr(LocalStorage, "read_into", noting)
    unit, tensor = only_tensor(run)
    reader = ChunkReader(run, verify=verify)
    assert torch.equal(reader.read_region(1, unit, tensor, (0, 0), SHAPE), FULL)
    parts = [c for c in calls.calls if c[0] == "read_into"]
    assert len(parts) == FULL.numel() * 4 // PART and all(size == PART for _, _, size in parts)
    assert threading.get_ident() not in threads  # fetched by the pool, checksummed by the caller


def test_each_part_fetched_is_progress_a_rank_shows_the_ranks_waiting_for_it(run):
    """A rank reading a large composite from a slow store keeps the ranks waiting for it at the
    end of the restore waiting (``Coordinator.working``) as long as its parts come in: each
    part fetched (on the pool's threads) advances the progress of the restore's block."""
    from llmtailor.distributed.progress import Scope, within

    unit, tensor = only_tensor(run)
    with within(scope := Scope()):
        ChunkReader(run, verify=True).read_region(1, unit, tensor, (0, 0), SHAPE)
    assert scope.ticks >= FULL.numel() * 4 // PART


def test_a_damaged_part_names_the_file_and_tensor_and_nothing_is_returned(run):
    unit, tensor = only_tensor(run)
    path = run.snapshot_dir(1) / unit.files[tensor.chunks[0].file].path
    data = bytearray(path.read_bytes())
    data[-PART - 5] ^= 0x10  # inside the last-but-one part
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=rf"{path.name}: checksum mismatch in tensor 'weight/w'"):
        ChunkReader(run, verify=True).read_region(1, unit, tensor, (0, 0), SHAPE)
    with pytest.raises(IntegrityError, match=rf"{path.name}: checksum mismatch \(file is corrupted\)"):
        run.read_unit(1, unit.unit)


def test_a_unit_read_whole_is_fetched_in_parts(run, monkeypatch):
    calls = StorageCalls.install(monkeypatch)
    unit, _ = only_tensor(run)
    tensors, _ = run.read_unit(1, unit.unit)
    assert torch.equal(tensors["weight/w"], FULL)
    assert calls.count("read_into") >= FULL.numel() * 4 // PART


def test_a_local_file_is_read_one_part_at_a_time_in_file_order(run, monkeypatch):
    """A disk reads a file fastest as one stream (``LocalStorage.reads_in_flight``): the next part
    is requested once the one before is in, never two side by side. The first part holds on
    until another starts (at most a second), so a fetch asking for several at once is caught."""
    counted, lock, other_started = LocalStorage.read_into, threading.Lock(), threading.Event()
    state = {"in flight": 0, "most": 0, "starts": []}

    def noting(storage, key, start, into):
        with lock:
            state["in flight"] += 1
            state["most"] = max(state["most"], state["in flight"])
            state["starts"].append(start)
        if start != state["starts"][0]:
            other_started.set()
        elif len(state["starts"]) == 1:
            other_started.wait(1.0)
        try:
            return counted(storage, key, start, into)
        finally:
            with lock:
                state["in flight"] -= 1

    monkeypatch.setattr(LocalStorage, "read_into", noting)
    unit, _ = only_tensor(run)
    tensors, _ = run.read_unit(1, unit.unit)
    assert torch.equal(tensors["weight/w"], FULL)
    assert len(state["starts"]) >= FULL.numel() * 4 // PART
    assert state["most"] == 1 and state["starts"] == sorted(state["starts"])


def test_a_local_file_is_read_on_while_the_caller_still_checksums_the_first_part(run, monkeypatch):
    """The thread reading a local file goes on to the next part as soon as one is in, without
    waiting for the caller to take it (``fetch._read_in_order``): here the checksum of the first
    part waits until every part has been read (at most 120 s, the bound on a hang: a reader that
    waits for the caller never gets there), and they all are."""
    unit, _ = only_tensor(run)
    key = f"{run.snapshot_key(1)}/{unit.files[0].path}"
    buffer = bytearray(run.storage.size(key))
    counted, parts = LocalStorage.read_into, len(fetch._parts(0, [memoryview(buffer)]))
    read, all_read = [], threading.Event()

    def noting(storage, key, start, into):
        counted(storage, key, start, into)
        read.append(start)
        if len(read) == parts:
            all_read.set()

    class Hasher:
        def __init__(self):
            self.inner, self.seen = xxhash.xxh3_64(), []

        def update(self, data):
            if not self.seen:
                self.seen.append(all_read.wait(120))
            self.inner.update(data)

    monkeypatch.setattr(LocalStorage, "read_into", noting)
    hasher = Hasher()
    fetch.fetch_into(run.storage, key, 0, [memoryview(buffer)], hasher)
    assert (hasher.seen, len(read)) == ([True], parts) and read == sorted(read) and parts > 2
    assert bytes(buffer) == run.storage.read(key) and hasher.inner.digest() == xxhash.xxh3_64(buffer).digest()


class _Remote(LocalStorage):
    """A local directory read as a remote store is: every part requested at once, and a
    ranged read from a file's start answering its size too, in one request (``starts``), as
    an object store's ranged GET does (``Storage.read_start``)."""

    remote, reads_in_flight = True, None

    def __init__(self, root):
        super().__init__(root)
        self.starts: list[str] = []

    def read_start(self, key, length):
        self.starts.append(key)
        path = self.root / key
        if not path.is_file():
            return None, b""
        data = path.read_bytes()
        return len(data), memoryview(data)[:length]


@pytest.mark.parametrize("damage", [None, "truncated", "longer", "missing"])
def test_a_remote_file_read_whole_has_its_size_checked_by_its_first_request_not_a_request_of_its_own(run, monkeypatch, damage):
    """From an object store a HEAD before a unit file's read is a round trip of its own: the
    ranged GET of its first part answers the size. A file of another size than its entry, or
    none, is still refused with the size's own message, before any other part's failure."""
    from llmtailor.store.checked import fetch_stored_tensors

    unit, tensor = only_tensor(run)
    file = unit.files[tensor.chunks[0].file]
    key = f"{run.snapshot_key(1)}/{file.path}"
    storage = _Remote(run.storage.root)
    path = run.snapshot_dir(1) / file.path
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: -3 * PART])
    elif damage == "longer":
        path.write_bytes(path.read_bytes() + b"x")
    elif damage == "missing":
        path.unlink()
    calls = StorageCalls.install(monkeypatch)
    expected = {"weight/w": (tensor.dtype, list(SHAPE))}
    if damage is None:
        assert torch.equal(fetch_stored_tensors(storage, key, file, expected)["weight/w"], FULL)
    else:
        message = "file is missing" if damage == "missing" else rf"bytes stored, manifest says {file.bytes} \(truncated or replaced\)"
        with pytest.raises(IntegrityError, match=message):
            fetch_stored_tensors(storage, key, file, expected)
    assert calls.count("size") == 0 and storage.starts == [key], calls.calls
    # The other parts, each a request (the short last one with the part before it: ``_joined``).
    assert damage or calls.count("read_into") == file.bytes // PART + (file.bytes % PART >= PART // 2) - 1


@pytest.mark.parametrize(("length", "requests"), [(PART + 5, 1), (2 * PART + 5, 2), (2 * PART + PART // 2, 3)])
def test_from_a_remote_store_a_short_last_part_is_fetched_with_the_part_before_it(run, monkeypatch, length, requests):
    """A request costs a round trip whatever its size: a range of a part and a few bytes is one
    request, not two (a Llama layer's 8.9 MB in a pack was 8 MiB and 0.9 MB); a last part of half
    a part or more keeps its own request. The same when the range fills several views (a unit
    read into live tensors), the joined request's answer then copied out to each as the store
    gave it: no request is read into a staging buffer of its own (every ``read_into`` lands in
    the caller's memory)."""
    unit, tensor = only_tensor(run)
    file = unit.files[tensor.chunks[0].file]
    key = f"{run.snapshot_key(1)}/{file.path}"
    data = (run.snapshot_dir(1) / file.path).read_bytes()[:length]
    storage = _Remote(run.storage.root)
    calls = StorageCalls.install(monkeypatch)
    assert bytes(fetch.fetch(storage, key, 0, length)) == data
    assert calls.count("read_into") == requests, calls.calls
    views = [bytearray(n) for n in (PART // 2, PART // 2, length - PART)]
    landed, read_into = [], _Remote.read_into
    monkeypatch.setattr(_Remote, "read_into", lambda self, key, start, into: (landed.append(into.obj), read_into(self, key, start, into)))
    calls.calls.clear()
    fetch.fetch_into(storage, key, 0, [memoryview(v) for v in views])
    assert b"".join(views) == data and len(calls.calls) == requests, calls.calls
    assert all(any(target is view for view in views) for target in landed), [len(t) for t in landed]


def test_a_forked_child_exits_whatever_lock_of_the_parents_pool_a_parent_thread_held():
    """The pools of the storage (``LazyPool``: fetches, side-by-side asks, a node's uploads) shut
    down at exit. A forked child starts a pool of its own; at its exit it shuts down that one,
    never the parent's copy, whose lock a parent thread may have held as the fork landed (copied
    held, with no thread to release it). Before: each pool's first use registered its own shutdown
    at exit, which the child inherited: the child hung at exit ('child hung at exit')."""
    script = textwrap.dedent("""
        import os, sys, threading, time
        from llmtailor.store.fetch import _workers as pool

        assert pool.submit(int, "7").result() == 7
        inside, done = threading.Event(), threading.Event()

        def hold():  # a parent thread inside the pool's own lock as the fork lands
            with pool()._shutdown_lock:
                inside.set()
                done.wait()

        threading.Thread(target=hold).start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            assert pool.submit(int, "8").result() == 8  # the child's pool of its own
            sys.exit(0)  # an ordinary exit: the child's at-exit work runs
        done.set()
        deadline = time.monotonic() + 120  # the bound on a hang, not a timing asserted
        while time.monotonic() < deadline:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                print("child exited", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung at exit")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip() == "child exited 0", proc.stderr[-3000:]


@pytest.mark.parametrize("damage", [None, "data", "header"])
def test_a_remote_file_read_into_live_tensors_lands_there_from_the_plain_fetchs_requests_each_byte_fetched_once(
        run, monkeypatch, damage):
    """A unit file read into live tensors from an object store costs the requests of a plain
    fetch of it (no request for its header first: the first part's answer holds it, and the
    size), each byte fetched once, and its bytes land in the live tensor's memory, not in a new
    buffer of their own. A damaged data byte is refused by the file's checksum; a header that
    does not match the index is refused before a byte lands in the live tensor."""
    from llmtailor.store.checked import fetch_stored_tensors

    unit, tensor = only_tensor(run)
    file = unit.files[tensor.chunks[0].file]
    key = f"{run.snapshot_key(1)}/{file.path}"
    path = run.snapshot_dir(1) / file.path
    data = bytearray(path.read_bytes())
    if damage == "data":
        data[-1] ^= 0xFF
    elif damage == "header":
        at = data.index(b"[64,48]")
        data[at : at + 7] = b"[48,64]"
    path.write_bytes(bytes(data))

    class Counted(_Remote):
        started = 0

        def read_start(self, key, length):
            size, head = super().read_start(key, length)
            self.started += len(head)
            return size, head

    storage = Counted(run.storage.root)
    calls = StorageCalls.install(monkeypatch)
    live = torch.zeros(SHAPE)
    expected = {"weight/w": (tensor.dtype, list(SHAPE))}
    if damage is None:
        assert fetch_stored_tensors(storage, key, file, expected, into={"weight/w": live})["weight/w"] is live
        assert torch.equal(live, FULL)
    else:
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            fetch_stored_tensors(storage, key, file, expected, into={"weight/w": live})
    if damage == "header":
        assert not live.any()
    fetched = storage.started + sum(size for op, _, size in calls.calls if op in ("read", "read_range", "read_into"))
    assert (storage.starts, fetched) == ([key], file.bytes)


def test_a_remote_files_parts_for_live_tensors_are_requested_at_most_reads_in_flight_ahead_of_the_caller(run, monkeypatch):
    """A remote file read into live tensors (``request_parts``) asks the store for at most
    ``reads_in_flight`` parts beyond the last one the reader took, as ``fetch_into`` does: a
    store configured for fewer requests at once gets no more, nor are more answers waiting at
    once. The pool here makes each request as it is submitted, so the count of requests the
    store saw as each part is taken (hashed, in file order) is exact, whatever the machine's speed."""
    from llmtailor.store import checked

    unit, tensor = only_tensor(run)
    file = unit.files[tensor.chunks[0].file]
    key = f"{run.snapshot_key(1)}/{file.path}"
    made, ahead = [], []

    class Counted(_Remote):
        reads_in_flight = 3

        def read_start(self, key, length):
            made.append(0)
            return super().read_start(key, length)

        def read_range(self, key, start, length):
            made.append(start)
            return super().read_range(key, start, length)

    class Here:
        def submit(self, fn, *args):
            done = Future()
            done.set_result(fn(*args))
            return done

    class Hasher:  # the reader takes a part: it hashes it
        def __init__(self):
            self.inner = xxhash.xxh3_64()

        def update(self, data):
            ahead.append(len(made) - len(ahead) - 1)
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    monkeypatch.setattr(fetch, "_workers", Here())
    monkeypatch.setattr(checked, "xxhash", type("Recording", (), {"xxh3_64": Hasher}))
    live = torch.zeros(SHAPE)
    expected = {"weight/w": (tensor.dtype, list(SHAPE))}
    assert checked.fetch_stored_tensors(Counted(run.storage.root), key, file, expected, into={"weight/w": live})["weight/w"] is live
    assert torch.equal(live, FULL) and len(made) == len(ahead) > 6 and made == sorted(made)
    assert max(ahead) == 3, ahead
