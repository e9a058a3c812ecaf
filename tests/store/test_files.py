"""Our streaming safetensors writer: safetensors itself reads back every tensor exactly."""

import os
import time

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file

from llmtailor.errors import IntegrityError
from llmtailor.store.checked import read_tensors
from llmtailor.store.tensor_files import write_tensors
from llmtailor.store import dtypes


def varied_tensors():
    """One tensor of every dtype a snapshot may hold (safetensors reading each back with its
    dtype checks our torch-free table of codes), and awkward shapes."""
    tensors = {f"t/{name}": torch.arange(6).reshape(2, 3).to(dtypes.to_torch(name)) for name in dtypes.NAMES}
    tensors["step"] = torch.tensor(7.0)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["big"] = torch.randn(5 << 20)  # 20 MiB: written in several pieces
    tensors["strided"] = torch.randn(4, 6).t()
    return tensors


@pytest.mark.parametrize("flush_every", [None, 1 << 20], ids=["one-flush", "flushed-while-written"])
def test_safetensors_reads_our_files_exactly(tmp_path, monkeypatch, flush_every):
    if flush_every is not None:  # a large file is made durable and dropped from the cache as it goes
        monkeypatch.setattr("llmtailor.store.storage.local_durable.FLUSH_EVERY", flush_every)
    tensors = varied_tensors()
    entry = write_tensors(tmp_path / "u.safetensors", tensors, tmp_path)
    data = (tmp_path / "u.safetensors").read_bytes()
    assert entry.bytes == len(data) and entry.xxh3_64 == xxhash.xxh3_64_hexdigest(data)
    for loaded in (load_file(tmp_path / "u.safetensors"), read_tensors(tmp_path, entry)):
        assert loaded.keys() == tensors.keys()
        for key, tensor in tensors.items():
            assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape
            assert torch.equal(loaded[key], tensor), key
    with safe_open(tmp_path / "u.safetensors", "pt") as handle:
        assert set(handle.keys()) == set(tensors)


def test_the_dtype_table_agrees_with_torch():
    for name in dtypes.NAMES:
        dtype = dtypes.to_torch(name)
        assert dtypes.name_of(dtype) == name and dtypes.itemsize(dtype) == dtype.itemsize
        assert dtypes.from_code(dtypes.code_of(dtype)) == name
    assert dtypes.from_code("C64") is None


def test_a_changed_byte_is_caught(tmp_path):
    entry = write_tensors(tmp_path / "u.safetensors", {"w": torch.ones(8)}, tmp_path)
    path = tmp_path / "u.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        read_tensors(tmp_path, entry)


def test_a_failed_background_fsync_fails_the_write_and_leaks_no_descriptor(tmp_path, monkeypatch):
    import errno
    import os

    from llmtailor.store import tensor_files
    from llmtailor.store.storage import local_durable

    def failing(fd):
        raise OSError(errno.EIO, "injected fsync failure")

    def open_here() -> list[str]:
        # This process's descriptors on the files of this test (not a count of them all: other
        # tests' background threads, a connection pool's, open and close theirs at any time).
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                found.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # closed as it was listed
                pass
        return [path for path in found if path.startswith(str(tmp_path.resolve()))]

    monkeypatch.setattr(local_durable.os, "fsync", failing)
    with pytest.raises(OSError, match=r"0\.safetensors durable failed: injected fsync failure"):
        with local_durable.Syncer() as syncer:
            for i in range(4):
                tensor_files.write_tensor_file(tmp_path / f"{i}.safetensors", {"w": torch.ones(4)}, tmp_path, syncer=syncer)
    monkeypatch.undo()
    assert open_here() == []


def test_a_syncer_left_by_a_failure_while_it_holds_files_back_returns(tmp_path, monkeypatch):
    """A block over a ``Syncer`` that raises while the Syncer holds files back (more than its
    ``threads`` in flight: a commit's manifest and directories, whose ``beside`` drain of the
    copies failed) closes those and waits for the fsyncs under way only. Before, it waited for
    the held ones' cancelled futures too, which never end: the commit hung for good. The first
    fsync is held until the held file's future is cancelled (the event); the 60 s join bounds a
    hang."""
    import threading

    from llmtailor.store.storage import local_durable

    real, release = os.fsync, threading.Event()
    monkeypatch.setattr(local_durable.os, "fsync", lambda fd: (release.wait(60), real(fd)))
    paths = [tmp_path / f"{n}.bin" for n in range(2)]
    for path in paths:
        path.write_bytes(b"x")
    raised = []

    def fail_while_held():
        try:
            with local_durable.Syncer(threads=1) as syncer:
                for path in paths:
                    syncer.submit(path, os.open(path, os.O_RDONLY))
                held = syncer._pending[1][1]
                threading.Thread(target=lambda: (_once_cancelled(held), release.set())).start()
                raise RuntimeError("the drain beside it failed")
        except RuntimeError as err:
            raised.append(err)

    failing = threading.Thread(target=fail_while_held)
    failing.start()
    failing.join(60)
    release.set()
    assert not failing.is_alive() and len(raised) == 1


def _once_cancelled(future) -> None:
    while not future.cancelled():
        time.sleep(0.001)


def test_files_handed_to_the_syncer_are_durable_and_intact_after_drain(tmp_path, monkeypatch):
    from llmtailor.store import tensor_files
    from llmtailor.store.storage import local_durable

    monkeypatch.setattr(local_durable, "FLUSH_EVERY", 1 << 20)  # large-file flushes go through the syncer too
    synced = []
    real = local_durable.make_durable
    monkeypatch.setattr(local_durable, "make_durable", lambda fd, *span: (real(fd, *span), synced.append(fd)))
    tensors = varied_tensors()
    with local_durable.Syncer() as syncer:
        entries = [tensor_files.write_tensor_file(tmp_path / f"{i}.safetensors", tensors, tmp_path, syncer=syncer)[0] for i in range(3)]
    assert len(synced) > 3  # a final fsync per file, plus the flushes while the 20 MiB tensor was written
    for entry in entries:
        loaded = read_tensors(tmp_path, entry)
        assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def test_page_checksums_are_each_pages_xxh3_however_the_bytes_arrive(tmp_path, monkeypatch):
    """``stream_tensors`` hashes whole pages of a piece at once and streams the pages pieces
    split: every page's checksum is xxh3-64 of exactly its bytes, whatever the piece size."""
    from llmtailor.store.storage.local import LocalSink
    from llmtailor.store.tensor_files import page_size, stream_tensors

    data = torch.randn(3 << 18)  # 3 MiB: pages of 12 KiB, not a divisor of the piece below
    raw = data.numpy().tobytes()
    page = page_size(len(raw))
    assert (1 << 20) % page  # pieces end mid-page
    for piece in (1 << 20, 4096 * 7 + 100, 1 << 24):
        monkeypatch.setattr("llmtailor.store.tensor_files.PIECE", piece)
        pages: dict = {}
        _, sums = stream_tensors(LocalSink(tmp_path / f"p{piece}.safetensors", None), {"w": data}, "p", pages=pages)
        assert sums["w"] == xxhash.xxh3_64_hexdigest(raw)
        assert pages["w"]["page_bytes"] == page
        assert pages["w"]["pages"] == [xxhash.xxh3_64_hexdigest(raw[i : i + page]) for i in range(0, len(raw), page)]


def test_saves_one_after_another_share_a_bounded_set_of_kept_fsync_threads(tmp_path, monkeypatch):
    """Every Syncer's fsyncs run on the process's fsync threads, kept from save to save: a save
    at every step started about eleven threads per save (issue 32: each start waiting for its
    thread to run). However many saves, the process starts at most ``FSYNC_THREADS`` (fewer
    while the fsyncs keep up: how many is the machine's business, not asserted), all daemons."""
    import threading

    from helpers import tiny
    from llmtailor import Full, Tailor
    from llmtailor.store.storage import local_durable

    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda thread: (started.append(thread.name), real_start(thread))[1])
    model, optimizer, scheduler = tiny(layers=2)
    tailor = Tailor(tmp_path / "run", model, optimizer, scheduler, policy=Full())
    for step in range(1, 6):
        tailor.save(step)
    tailor.close()
    assert started.count("llmtailor-fsync") <= local_durable.FSYNC_THREADS
    fsync = [t for t in threading.enumerate() if t.name == "llmtailor-fsync"]
    assert len(fsync) <= local_durable.FSYNC_THREADS and all(t.daemon for t in fsync)


def test_a_forked_child_makes_its_files_durable_on_fsync_threads_of_its_own(tmp_path):
    """The fsync threads are the process's: a child forked after the parent's (the tests' and
    launchers' forked jobs) has none of them, and starts its own rather than wait for them."""
    import os
    import signal

    from llmtailor.store import tensor_files
    from llmtailor.store.storage import local_durable

    with local_durable.Syncer() as syncer:  # the parent's threads started
        tensor_files.write_tensor_file(tmp_path / "parent.safetensors", {"w": torch.ones(4)}, tmp_path, syncer=syncer)
    child = os.fork()
    if child == 0:
        signal.alarm(120)  # waiting on the parent's threads would hang: killed instead
        code = 1
        try:
            for i in range(3):  # a file at a time: one the parent's idle threads would be counted on to take
                with local_durable.Syncer() as syncer:
                    tensor_files.write_tensor_file(tmp_path / f"{i}.safetensors", {"w": torch.ones(4)}, tmp_path, syncer=syncer)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(torch.equal(load_file(tmp_path / f"{i}.safetensors")["w"], torch.ones(4)) for i in range(3))


def test_a_piece_that_fails_to_be_written_behind_fails_its_file_and_leaves_nothing(tmp_path, monkeypatch):
    """A tensor's pieces are written on a writer thread while the next is checksummed
    (``LocalSink.write_stable``): a piece whose write fails there fails the file, with that
    error, and the file is removed once no write of it is left running."""
    import errno

    from llmtailor.store.storage.local import LocalSink

    written, real = [], LocalSink._write

    def failing_second(sink, data):
        written.append(len(data))
        if len(written) == 3:  # the header, a first piece, then this one
            raise OSError(errno.ENOSPC, "No space left on device")
        real(sink, data)

    monkeypatch.setattr(LocalSink, "_write", failing_second)
    with pytest.raises(OSError, match="No space left"):
        write_tensors(tmp_path / "big.safetensors", {"big": torch.randn(10 << 20)}, tmp_path)  # 40 MiB: 3 pieces
    assert written[1:3] == [16 << 20, 16 << 20] and not (tmp_path / "big.safetensors").exists()


def test_a_small_tensors_pieces_are_written_at_once_not_handed_to_a_writer_thread(tmp_path, monkeypatch):
    """Handing a piece to a writer thread costs a turn of the interpreter's lock: a small save's
    tensors (a Lightning-sized model) are written on the caller's thread, a large one's pieces
    behind (``WRITE_BEHIND_FROM``); the files are the same either way."""
    from llmtailor.store.storage import local

    handed = []
    real = local._writers.submit
    monkeypatch.setattr(local._writers, "submit", lambda fn, *args: handed.append(len(args[0])) or real(fn, *args))
    small = {f"w{i}": torch.randn(1 << 16) for i in range(8)}  # 256 KiB each
    write_tensors(tmp_path / "small.safetensors", small, tmp_path)
    assert handed == []
    write_tensors(tmp_path / "big.safetensors", {"big": torch.randn(6 << 20)}, tmp_path)  # 24 MiB: 16 + 8 MiB pieces
    assert handed == [16 << 20, 8 << 20]
    assert all(torch.equal(load_file(tmp_path / "small.safetensors")[k], v) for k, v in small.items())


def test_a_batch_of_many_small_files_holds_a_bounded_number_of_descriptors_while_the_disk_lags(tmp_path, monkeypatch):
    """Each closed file's descriptor is held until its fsync has run (``Syncer``); the bound was
    in bytes only (``depth``), so a batch of many small files (a node leader's copies of every
    other rank's files, a healing) held one per file while the disk lagged: 600 here, past a
    1024 soft limit with a few batches side by side (EMFILE fails the save). Now a writer waits
    for the oldest file's fsync once ``FILES_AHEAD`` wait. Every fsync is held until the writer
    first waits (at the bound, or the drain at the end), where the open descriptors are counted."""
    import threading

    from llmtailor.store.storage import local_durable
    from llmtailor.store.storage.local import LocalStorage

    def held() -> int:  # this process's descriptors on this test's files
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                found += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
            except OSError:  # closed as it was listed
                pass
        return found

    real, release, counted = os.fsync, threading.Event(), []
    wait_first = local_durable.Syncer._wait_first

    def first_wait(self):
        if not counted:
            counted.append(held())
            release.set()
        return wait_first(self)

    monkeypatch.setattr(local_durable.os, "fsync", lambda fd: (release.wait(60), real(fd)))
    monkeypatch.setattr(local_durable.Syncer, "_wait_first", first_wait)
    with LocalStorage(tmp_path).batch() as batch:
        for n in range(600):
            sink = batch.create(f"{n}.bin")
            sink.write(b"x" * 100)
            sink.close()
    monkeypatch.undo()
    assert counted and counted[0] <= local_durable.FILES_AHEAD + local_durable.SYNC_THREADS, counted
    assert held() == 0
