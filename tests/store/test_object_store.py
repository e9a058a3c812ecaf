"""Runs at object-store URLs, each against a real server on loopback (real HTTP, the client
users run). On every protocol that takes writes (``WRITABLE``: S3 on moto's server, Azure Blob
on Azurite): save and restore bitwise (Full), verify naming a corrupted or missing object, the
commit's put-if-absent, one writer per run (the lease taken, renewed, refused to a second
writer, taken over), a crash's leftovers invisible and removed by gc, retention beside a
reader, a missing bucket named. On GCS (fake-gcs-server, which cannot take obstore's writes:
``emulators``): a run put there is read, verified, and a corrupted object named. On S3 alone:
composite-exact Parity, retries of transient errors and answers lost (moto behind a faulty
layer), refused credentials, the CLI and merges on URLs."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise, free_port, parity_run, tiny, train, unit_chunk_middle, unit_versions

pytest.importorskip("obstore")
pytest.importorskip("moto")

from emulators import running  # noqa: E402
from objectstore import (DROP, boto3_client, client, faulty_moto, keys, moto_process, new_bucket,  # noqa: E402
                         set_environment, uploads)
from typer.testing import CliRunner  # noqa: E402

from llmtailor import Full, Parity, Tailor  # noqa: E402
from llmtailor.cli import app  # noqa: E402
from llmtailor.errors import ConfigError, IntegrityError, TailorError  # noqa: E402
from llmtailor.store.commit import StagedFiles  # noqa: E402
from llmtailor.store.retention import discard_snapshots  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402
from llmtailor.store.storage.object_options import OPTIONS_ENV, load_obstore  # noqa: E402
from llmtailor.store.storage.object_lock import ObjectWriterLock, is_committed  # noqa: E402
from llmtailor.store.storage.object_store import Version  # noqa: E402
from llmtailor.store.storage.objects import ObjectStorage  # noqa: E402

runner = CliRunner()
FAST_RETRY = {"max_retries": 3, "retry_timeout": 20.0, "backoff": {"init_backoff": 0.01, "max_backoff": 0.05, "base": 2.0}}


WRITABLE = ["s3", "az"]
"""The protocols whose emulator takes obstore's writes (GCS's does not: ``emulators``)."""


@pytest.fixture(scope="module", params=WRITABLE)
def emulator(request):
    with running(request.param) as server:
        yield server


S3_ONLY = pytest.mark.parametrize("emulator", ["s3"], indirect=True)
"""A test of what only S3 has here (moto's own API, boto3, AWS's variables)."""


@pytest.fixture
def endpoint(emulator):
    return emulator.endpoint


@pytest.fixture
def url(emulator, monkeypatch):
    """A fresh bucket on the protocol's emulator; the run's URL in it. The emulator's variables
    point every client (and every job a test starts) at it."""
    for name, value in emulator.environment().items():
        monkeypatch.setenv(name, value)
    return f"{emulator.scheme}://{emulator.new_bucket()}/runs/exp"


def bucket_of(url: str) -> str:
    return url.split("/")[2]


def test_full_save_and_restore_continue_bit_for_bit(url, emulator, tokens):
    model, opt, sched = tiny()
    with Tailor(url, model, opt, sched, policy=Full()) as tailor:
        train(model, opt, sched, tokens, [1, 2])
        tailor.save(2)
        saved = unit_versions(model, opt)
        uninterrupted = train(model, opt, sched, tokens, [3, 4])
    # Every file went to the bucket over HTTP, under the run's prefix.
    stored = emulator.keys(bucket_of(url), "runs/exp/")
    assert "runs/exp/latest" in stored and "runs/exp/snapshots/step-00000002/manifest.json" in stored
    assert not any(k.startswith("runs/exp/.lock") for k in stored)  # released by close()
    fresh = tiny(seed=7)
    with Tailor(url, *fresh, read_only=True) as reader:
        assert reader.restore().step == 2
    assert_bitwise(unit_versions(fresh[0], fresh[1]), saved)
    assert train(*fresh, tokens, [3, 4]) == uninterrupted
    assert Run(url).verify() == []


@S3_ONLY
def test_parity_restores_each_unit_at_its_composites_version(url, tokens, tmp_path):
    """The same run written locally and to S3 holds the same tensors; restored from S3, every
    weight and optimizer tensor equals the version the composite names."""
    local = parity_run(tmp_path / "local", tokens, 5)
    remote = parity_run(url, tokens, 5)
    run, twin = Run(remote), Run(local)
    composite = run.resolve()
    assert composite.sources == twin.resolve().sources and sorted(set(composite.sources.values())) == [4, 5]
    for unit, step in composite.sources.items():
        got, _ = run.read_unit(step, unit)
        want, _ = twin.read_unit(step, unit)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    model, opt, sched = tiny(seed=3)
    with Tailor(remote, model, opt, sched, policy=Parity(), read_only=True) as tailor:
        tailor.restore()
    live = {f"weight/{n}": p.detach() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    live.update({f"optim/{names[id(p)]}/{k}": v for p, s in opt.state.items() for k, v in s.items()})
    for unit, step in composite.sources.items():
        tensors, _ = run.read_unit(step, unit)
        for key, tensor in tensors.items():
            assert torch.equal(live[key], tensor), f"{key} (from step {step})"


def test_a_files_size_and_first_bytes_come_in_one_read_also_past_its_end_or_when_empty_or_missing(url):
    """``read_start``: how a restore takes a remote file's header and checks its size (one GET,
    where it was a HEAD and two GETs), on each emulator's own answer to a range past the end."""
    from llmtailor.store.storage.object_store import ObjectStore

    store = ObjectStore(url)
    store.put("data", bytes(range(200)) * 5)
    store.put("empty", b"")
    size, first = store.read_start("data", 100)
    assert (size, bytes(first)) == (1000, bytes(range(100)))
    size, whole = store.read_start("data", 5000)
    assert (size, bytes(whole)) == (1000, bytes(range(200)) * 5)
    assert [(n, bytes(b)) for n, b in (store.read_start("empty", 64), store.read_start("missing", 64))] == [(0, b""), (None, b"")]


def test_verify_names_a_corrupted_and_a_missing_object(url, emulator, tokens):
    parity_run(url, tokens, 3)
    assert_verify_names_a_corrupted_and_a_missing_object(url, emulator)
    with pytest.raises(IntegrityError, match=r"\.safetensors: checksum mismatch"):
        Tailor(url, *tiny(seed=1), read_only=True).restore()


def assert_verify_names_a_corrupted_and_a_missing_object(url, emulator):
    """Corrupt a layer's file of step 3 and delete step 2's global.json (through the emulator's
    own look, not llmtailor); ``verify`` and the CLI name both."""
    bucket = bucket_of(url)
    layer = next(u for u in Run(url).manifest(3).units if u.startswith("layer."))
    held = Run(url).unit_entry(3, layer).files[0].path  # the tiny model's pack file
    unit = f"runs/exp/snapshots/step-00000003/{held}"
    data = bytearray(emulator.read(bucket, unit))
    data[-1] ^= 0xFF
    emulator.write(bucket, unit, bytes(data))
    emulator.delete(bucket, "runs/exp/snapshots/step-00000002/global.json")
    problems = Run(url).verify()
    assert f"{url}/snapshots/step-00000003/{held}: checksum mismatch (file is corrupted)" in problems
    assert f"{url}/snapshots/step-00000002/global.json: file is missing" in problems
    result = runner.invoke(app, ["verify", url])
    assert result.exit_code == 1 and "checksum mismatch" in result.output


@pytest.fixture(scope="module")
def gcs():
    with running("gs") as server:
        yield server


@pytest.fixture
def gcs_bucket(gcs, monkeypatch):
    for name, value in gcs.environment().items():
        monkeypatch.setenv(name, value)
    return gcs.new_bucket()


def test_a_run_on_gcs_is_read_and_a_corrupted_object_named(gcs, gcs_bucket, tokens, tmp_path):
    """GCS's emulator takes none of obstore's writes (``emulators``): the run is saved locally
    and its files put in the bucket through GCS's JSON API. At its gs:// URL it lists the same
    snapshots and composites, every unit's tensors equal the local run's (each checked against
    its checksum as it is read); a corrupted object is named when read. (Not here: ``verify``,
    ``inspect`` and restores, which write a reader's lease object first.)"""
    local = parity_run(tmp_path / "run", tokens, 3)
    gcs.upload_tree(gcs_bucket, "runs/exp", local)
    url = f"gs://{gcs_bucket}/runs/exp"
    run, twin = Run(url), Run(local)
    assert run.steps() == [1, 2, 3] and run.latest_step() == 3
    composite = run.resolve()
    assert composite.sources == twin.resolve().sources
    for unit, step in composite.sources.items():
        got, _ = run.read_unit(step, unit)
        want, _ = twin.read_unit(step, unit)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    layer = next(u for u in run.manifest(3).units if u.startswith("layer."))
    held = run.unit_entry(3, layer).files[0].path  # the tiny model's pack file
    key = f"runs/exp/snapshots/step-00000003/{held}"
    data = bytearray(gcs.read(gcs_bucket, key))
    data[unit_chunk_middle(run, 3, layer)[2]] ^= 0xFF  # the layer's own bytes in its pack
    gcs.write(gcs_bucket, key, bytes(data))
    with pytest.raises(IntegrityError, match=rf"^{url}/snapshots/step-00000003/{re.escape(held)}: checksum mismatch"):
        Run(url).read_unit(3, layer)


def test_writes_the_gcs_emulator_refuses_reach_it_and_fail_in_one_line(gcs, gcs_bucket):
    """What keeps GCS out of ``WRITABLE``: fake-gcs-server answers the XML API's PUT that obstore
    writes with (a plain one, and the lease's overwrite of the generation it read) with
    "invalid uploadType". Both requests reach the server (the overwrite names the object's
    generation: obstore refuses a GCS update without one), and each fails in one line naming
    the object, the server's message and its endpoint. Should the emulator take these writes,
    this test fails, and GCS joins the protocols the write tests run on."""
    url = f"gs://{gcs_bucket}/run"
    gcs.write(gcs_bucket, "run/.lock", b"{}")
    storage = ObjectStorage(url)
    version = Version.of(load_obstore().head(storage.store, ".lock"))
    assert version.generation is not None
    refused = rf"^{url}/(latest|\.lock): invalid uploadType \(HTTP 400 from {gcs.endpoint}\)$"
    with pytest.raises(TailorError, match=refused):
        storage.put("latest", b"x")
    with pytest.raises(TailorError, match=refused):
        storage.put_if(".lock", b"{\"renewed\": 1}", version)


def test_a_second_writer_is_refused_naming_the_first_and_takes_over_after_it_dies(url, tmp_path):
    """The holder is another process (in one process the lock is shared by its Tailors). While
    it lives it renews its lease: a second writer is refused at once, naming it. Once it is
    SIGKILLed, a writer on this host sees its process gone and takes the lock over."""
    options = {"lock_ttl": 3}
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parents[1])!r})
            from helpers import tiny
            from llmtailor import Tailor
            tailor = Tailor({url!r}, *tiny(), storage_options={options!r})
            print("held", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TailorError, match=rf"being written by another writer \(pid {holder.pid} on "):
            Tailor(url, *tiny(), storage_options=options)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with Tailor(url, *tiny(), storage_options=options) as tailor:
            tailor.save(1)
        assert Run(url).steps() == [1]
    finally:
        holder.kill()


@S3_ONLY
def test_a_writer_paused_past_its_lease_commits_nothing_once_another_took_the_run_over(url, tokens, monkeypatch):
    """Writer A's lease goes unrenewed past its ttl (a paused process: SIGSTOP, a long GC, a
    suspended VM; here its renewal thread held, so A has not noticed yet). Writer B, another
    process, takes the run over, restores step 1, saves steps 2 and 3 and closes. A then goes on
    and saves step 4: its commit must confirm its lease (renewed once more, conditionally on its
    own version) before the manifest's write, and refuse. Before: A's ``check_held`` only read
    what its renewal thread had noticed: step 4 was committed over B's branch (its parent step 1)
    and ``latest`` named it, B's steps 2 and 3 silently left behind by every restore."""
    options = {"lock_ttl": 2}
    model, opt, sched = tiny()
    _renewals_held(monkeypatch)
    with Tailor(url, model, opt, sched, storage_options=options) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1)
        _take_over_and_save(url, options, [2, 3])
        train(model, opt, sched, tokens, [2])
        with pytest.raises(TailorError, match=r"no longer holds the run's lock \(another writer took the run's lock over\)"):
            tailor.save(4)
        run = Run(url)
        assert run.steps() == [1, 2, 3] and run.latest_step() == 3 and run.verify() == []


@S3_ONLY
def test_a_writer_paused_past_its_lease_in_a_save_writes_no_file_into_its_successors_snapshot(url, tokens, monkeypatch):
    """Writer A is paused past its lease as its save of step 2 begins (before its first file);
    writer B takes the run over and saves step 2 (the same file names: same model, same policy,
    other weights), and closes. A then goes on: it must write no file more (each file it stages
    confirms its lease first), so B's step 2 stays whole. Before: A wrote all its files over
    B's committed step 2, then its manifest was refused (B's there): ``verify`` named every
    file's checksum mismatch, and a restore of step 2 failed."""
    options = {"lock_ttl": 2}
    model, opt, sched = tiny()
    create = StagedFiles.__call__
    paused = []

    def pause_at_step_2(files, relpath):
        if files.snapshot.step == 2 and not paused:
            paused.append(relpath)
            _take_over_and_save(url, options, [2])
        return create(files, relpath)

    monkeypatch.setattr(StagedFiles, "__call__", pause_at_step_2)
    _renewals_held(monkeypatch)
    with Tailor(url, model, opt, sched, storage_options=options) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1)
        train(model, opt, sched, tokens, [2])
        with pytest.raises(TailorError) as refused:
            tailor.save(2)
        run = Run(url)
        assert paused and run.steps() == [1, 2] and run.verify() == []
        assert "no longer holds the run's lock" in str(refused.value)


@S3_ONLY
def test_a_writer_whose_lease_was_taken_over_removes_nothing_of_the_run(url, monkeypatch):
    """Writer A's lease, unrenewed (a paused process), is taken over (here written over by
    another host's writer, as a takeover's conditional write does); A's retention then goes on:
    it must remove nothing, the run being its successor's. Before: step 1 was removed."""
    _renewals_held(monkeypatch)
    with Tailor(url, *tiny(), storage_options={"lock_ttl": 2}) as tailor:
        tailor.save(1)
        tailor.save(2)
        ObjectStorage(url).put(".lock", _lease_of("pid 1 on another-host", None))
        time.sleep(1.0)  # past half the ttl since A's lease was last renewed: its commit or removal asks the store
        outcome = discard_snapshots(Run(url), [1])
        assert outcome.deleted == [] and "no longer holds the run's lock" in outcome.problems[0]
        assert Run(url).steps() == [1, 2]


def _renewals_held(monkeypatch) -> None:
    """Writer leases taken from now on are never renewed until released (a process paused past
    its lease whose renewal thread has not woken yet)."""
    monkeypatch.setattr(ObjectWriterLock, "_renew", lambda self: self._stop.wait())


def _take_over_and_save(url: str, options: dict, steps: list[int]) -> None:
    """Another process takes the run over (its holder's lease refused while renewed lately, then
    watched for ``lock_ttl`` and taken over), restores step 1, saves ``steps`` and closes."""
    successor = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(Path(__file__).parents[1])!r})
            from helpers import tiny
            from llmtailor import Tailor
            from llmtailor.errors import TailorError
            deadline = time.monotonic() + 120  # a bound for a busy machine, not a timing assertion
            while True:
                try:
                    tailor = Tailor({url!r}, *tiny(), storage_options={options!r})
                    break
                except TailorError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert tailor.restore().step == 1
            for step in {steps!r}:
                tailor.save(step)
            tailor.close()
        """)],
        capture_output=True, text=True, timeout=300,
    )
    assert successor.returncode == 0, successor.stderr


def test_a_lease_naming_a_live_process_here_that_no_longer_renews_it_is_watched_then_taken_over(url):
    """A writer SIGKILLed on this host leaves its lease naming its pid; once that pid is another
    live process's (pids are reused: a small pid space on a busy host, a container restarted with
    the same hostname), the lease, unrenewed past its ttl, is watched as one written elsewhere and
    taken over once unchanged for lock_ttl. Before: refused at once ("being written by another
    writer"), for as long as that other process lives."""
    import socket

    storage = ObjectStorage(url, {"lock_ttl": 2})
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        storage.put(".lock", json.dumps({"holder": f"pid {other.pid} on {socket.gethostname()}",
                                         "renewed": time.time() - 3600, "ttl": 2}).encode())
        lock = storage.locks.writer()
        lock.take()
        try:
            assert json.loads(bytes(storage.read(".lock")))["holder"] == f"pid {os.getpid()} on {socket.gethostname()}"
        finally:
            lock.release()
    finally:
        other.kill()
        other.wait()


def _lease_of(holder: str, namespace: str) -> bytes:
    """A writer's lease record naming ``holder`` in the pid namespace ``namespace``, just renewed,
    for a long ttl (lapsed only after the test)."""
    return json.dumps({"holder": holder, "ns": namespace, "renewed": time.time(), "ttl": 600}).encode()


def _this_namespace() -> str:
    """This process's pid namespace as a lease records it (``ns``: the boot id, the inode)."""
    return f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"


def test_a_lease_naming_this_processs_own_pid_that_none_of_its_writers_holds_is_taken_over_at_once(url):
    """A writer died and left its lease, just renewed; this process has its pid now, in the same
    pid namespace (a container restarted: its first process has the same low pid each time).
    Its pid being alive says nothing: none of this process's writers holds that lease, so its
    holder is dead, and the lease is taken over at once (not refused, nor watched for its ttl);
    once it is, a look from this process sees its own live lease. Before: refused at once,
    naming this very process ("being written by another writer (pid <own pid> on HOST)"), and
    ``holder_if_other`` called that dead holder live."""
    import socket

    storage = ObjectStorage(url, {"lock_ttl": 600})
    mine = f"pid {os.getpid()} on {socket.gethostname()}"
    storage.put(".lock", _lease_of(mine, _this_namespace()))
    assert storage.locks.writer().holder_if_other() is None
    lock = storage.locks.writer()
    lock.take()
    try:
        assert storage.locks.writer().holder_if_other() == mine  # its own now: held, alive
    finally:
        lock.release()
    assert not storage.is_file(".lock")


def test_a_lease_of_another_pid_namespace_under_this_hostname_is_not_judged_by_its_pid(url):
    """A writer in another container under this hostname (another pid namespace) holds the
    lease; its pid names no process here. That says nothing of it: it is a holder elsewhere, live
    while its lease is renewed. Before: taken for a dead process of this host (``holder_if_other``
    None: a read-only Tailor not refused; ``take`` took its lease over at once: two writers)."""
    import socket

    storage = ObjectStorage(url, {"lock_ttl": 600})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = f"pid {gone.pid} on {socket.gethostname()}"
    storage.put(".lock", _lease_of(holder, "another-boot:4026531836"))
    assert storage.locks.writer().holder_if_other() == holder


def test_a_lease_abandoned_elsewhere_is_taken_over_only_once_it_stops_being_renewed(url):
    """A lease written by a writer on another host (not renewed, process not checkable here):
    taken over after it stayed unchanged for lock_ttl seconds, never before."""
    storage = ObjectStorage(url, {"lock_ttl": 2})
    storage.put(".lock", json.dumps({"holder": "pid 1 on another-host", "renewed": time.time(), "ttl": 2}).encode())
    start = time.monotonic()
    with Tailor(url, *tiny(), storage_options={"lock_ttl": 2}) as tailor:
        waited = time.monotonic() - start
        tailor.save(1)
    assert waited >= 2.0  # never before lock_ttl; how long after depends on how busy the machine is


def test_a_put_if_absent_refuses_other_bytes_and_an_update_only_the_version_it_names(url):
    """The conditional writes the commit and the lock are made of, on the server: a create
    where the object is absent; a second create refused unless it holds the same bytes (its own
    write, its answer lost); an overwrite of the version read, and none of a version since
    replaced."""
    storage, key = ObjectStorage(url), "snapshots/step-00000001/manifest.json"
    first = storage.put_if(key, b"one", None)
    assert first is not None and storage.put_if(key, b"one", None) is not None
    assert storage.put_if(key, b"two", None) is None
    with pytest.raises(TailorError, match="step-00000001/manifest.json already exists; refusing to overwrite"):
        storage.put(key, b"two", exclusive=True)
    second = storage.put_if(key, b"two", first)
    assert second is not None and second != first and bytes(storage.read(key)) == b"two"
    assert storage.put_if(key, b"three", first) is None and bytes(storage.read(key)) == b"two"


def test_a_held_lease_is_renewed_on_the_server_and_a_contender_refused(url, tokens, monkeypatch):
    """The writer's lease object changes version at each renewal (a conditional overwrite of
    its own version); a contender on another host that watches it sees it renewed and is
    refused; the lease is gone after close."""
    options = {"lock_ttl": 1.5}
    model, opt, sched = tiny()
    storage = ObjectStorage(url, options)
    with Tailor(url, model, opt, sched, storage_options=options) as tailor:
        seen = {storage.locks.writer()._current()[1]}
        deadline = time.monotonic() + 120  # a bound for a hung renewal, not a timing assertion
        while len(seen) < 3 and time.monotonic() < deadline:
            seen.add(storage.locks.writer()._current()[1])
            time.sleep(0.1)
        assert len(seen) >= 3, f"the lease was renewed {len(seen) - 1} time(s)"
        holder, _ = storage.locks.writer()._current()
        monkeypatch.setattr(ObjectWriterLock, "_on_this_host", staticmethod(lambda holder, version: None))  # as if elsewhere: watched
        # The contender watches for its own lock_ttl: a long one, so that a renewal late on a busy
        # machine (the holder's period is 0.5 s) is still seen; it is refused at the first one.
        contender = ObjectStorage(url, {"lock_ttl": 120}).locks.writer()
        with pytest.raises(TailorError, match=rf"being written by another writer \({holder['holder']}\)"):
            contender.take()
        train(model, opt, sched, tokens, [1])
        tailor.save(1)
    assert Run(url).steps() == [1] and not storage.is_file(".lock")


@S3_ONLY
def test_a_forked_child_that_drops_its_copy_of_the_writer_leaves_the_parents_lease_alone(url, tokens):
    """A process forked while a Tailor lives (a DataLoader worker, a multiprocessing pool) holds a
    copy of it; the child drops that copy (its garbage collection of a Tailor the parent had
    dropped, or a function of the child returning). The run's lock is the parent's: its lease
    stays as the parent holds it, the child asks the server nothing, and the parent saves on.
    (Before: the child's copy released the lock, deleting the parent's lease: another writer could
    take the run, and the parent's next renewal found it gone, "another writer took the run's
    lock over", its saves refused.)"""
    options = {"lock_ttl": 3600}  # no renewal (every 20 min) while the child runs, however busy the machine: the lease stays the version copied
    model, opt, sched = tiny()
    held = {"tailor": Tailor(url, model, opt, sched, storage_options=options)}
    storage = ObjectStorage(url, options)
    lease = storage.locks.writer()._current()
    pid = os.fork()
    if pid == 0:
        signal.alarm(120)  # a child that hangs asking the store (before) is killed instead
        code = 1
        try:
            held.clear()  # the child's copy of the Tailor, dropped
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child hung or failed as it dropped its copy"
    assert storage.locks.writer()._current() == lease
    train(model, opt, sched, tokens, [1])
    with held["tailor"] as tailor:
        tailor.save(1)
    assert Run(url).steps() == [1] and not storage.is_file(".lock")

def test_transient_errors_are_retried_and_a_persistent_one_fails_cleanly(tokens, monkeypatch):
    """503s on some uploads (as S3 throttles) are retried with backoff and the save commits;
    a unit file that always fails makes the save fail naming the object, with the previous
    composite intact and nothing of the failed save readable."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        options = {"retry_config": FAST_RETRY}
        failed = set()

        def throttle_first(method, key):
            if method == "PUT" and "/packs/" in key and key not in failed:
                failed.add(key)
                return 503
            return None

        faults.rule = throttle_first
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, storage_options=options) as tailor:
            train(model, opt, sched, tokens, [1])
            tailor.save(1)
            assert failed and any(status == 503 for _, _, status in faults.seen)
            faults.rule = lambda method, key: 503 if method == "PUT" and key.endswith("packs/rank-00000.0.safetensors") else None
            train(model, opt, sched, tokens, [2])
            with pytest.raises(TailorError, match=r"snapshots/step-00000002/packs/rank-00000\.0\.safetensors"):
                tailor.save(2)
        faults.rule = lambda method, key: None
        run = Run(url, options)
        assert run.steps() == [1] and run.latest_step() == 1 and run.verify() == []
        assert not any("step-00000002" in k for k in keys(endpoint, url.split("/")[2]))


def lose_once(faults, method: str, suffix: str, how: int | str) -> list[str]:
    """Make the server act on the first ``method`` request for a key ending in ``suffix`` and
    lose its answer ``how``; returns the list the lost request's key is appended to."""
    lost: list[str] = []

    def lose(m, key):
        if m == method and key.endswith(suffix) and not lost:
            lost.append(key)
            return how
        return None

    faults.lose = lose
    return lost


@pytest.mark.parametrize("how", [503, DROP])
def test_a_commit_whose_answer_is_lost_after_the_server_stored_it_succeeds(tokens, monkeypatch, how):
    """The manifest's conditional PUT of step 2 reaches the server, which stores it; its answer
    is lost (a 503 in its place, or the connection dropped), so the client retries and meets
    "already exists": its own bytes. save(2) succeeds, step 3's parent is 2; a conditional put
    that meets other bytes is still refused."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        manifest = "snapshots/step-00000002/manifest.json"
        lost = lose_once(faults, "PUT", manifest, how)
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Parity(), storage_options={"retry_config": FAST_RETRY}) as tailor:
            for step in (1, 2, 3):
                train(model, opt, sched, tokens, [step])
                tailor.save(step)
        assert lost and ("PUT", lost[0], how) in faults.seen  # the answer was lost, the server had acted
        run = Run(url)
        assert run.steps() == [1, 2, 3] and run.latest_step() == 3 and run.verify() == []
        assert {step: run.manifest(step).parent for step in (2, 3)} == {2: 1, 3: 2}
        storage = ObjectStorage(url)
        stored = bytes(storage.read(manifest))
        storage.put(manifest, stored, exclusive=True)  # its own bytes: written already, a success
        with pytest.raises(TailorError, match="step-00000002/manifest.json already exists; refusing to overwrite"):
            storage.put(manifest, stored + b" ", exclusive=True)
        assert bytes(storage.read(manifest)) == stored


@pytest.mark.parametrize("read_back", ["later", "never"])
def test_a_commit_whose_answer_is_lost_and_not_read_back_at_once_says_what_it_knows(tokens, monkeypatch, read_back):
    """The manifest's conditional PUT of step 2 is stored and its answer lost; the retry meets
    "already exists", and reading the manifest back fails too (503s: every try of ``put_if``'s
    read-back). ``later``: the commit looks once more and finds its own manifest: the save is
    committed (step 3's parent is 2). ``never``: it cannot tell, and says so: step 2 may be
    committed or not; the writer goes on from step 1 (step 3's parent is 1), sound either way.
    Before: "manifest.json already exists; refusing to overwrite it" in both, the save failed
    though its manifest was its own, stored."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        manifest = "snapshots/step-00000002/manifest.json"
        lost = lose_once(faults, "PUT", manifest, 503)
        reads = 1 + FAST_RETRY["max_retries"]  # put_if's read-back, each of its tries
        failed_reads: list[str] = []

        def unreadable(method, key):
            if method == "GET" and key.endswith(manifest) and lost and (read_back == "never" or len(failed_reads) < reads):
                failed_reads.append(key)
                return 503
            return None

        faults.rule = unreadable
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Parity(), storage_options={"retry_config": FAST_RETRY}) as tailor:
            for step in (1, 2, 3):
                train(model, opt, sched, tokens, [step])
                if step == 2 and read_back == "never":
                    with pytest.raises(TailorError, match=r"step-00000002/manifest.json: the write of the manifest failed "
                                                          r"\(.*\) and it could not be read back: the storage may have "
                                                          r"stored it, so step 2 may be committed or not"):
                        tailor.save(step)
                    faults.rule = lambda method, key: None
                    continue
                tailor.save(step)
        assert lost and len(failed_reads) >= reads
        run = Run(url)
        assert run.steps() == [1, 2, 3] and run.latest_step() == 3 and run.verify() == []
        assert run.manifest(3).parent == (2 if read_back == "later" else 1)


def hold_manifest_put(faults, manifest: str) -> None:
    """The first PUT of ``manifest`` kept from the server (answered 503, acted on at ``faults.land()``),
    every later one answered 503 until ``faults.rule`` is reset."""
    faults.hold = lambda method, key: 503 if method == "PUT" and key.endswith(manifest) and not faults.held else None
    faults.rule = lambda method, key: 503 if method == "PUT" and key.endswith(manifest) and faults.held else None


@pytest.mark.parametrize("first", ["landed", "saved again", "closed"])
def test_a_manifest_put_that_lands_after_its_writer_gave_up_finds_its_snapshot_whole(tokens, monkeypatch, first):
    """The first conditional PUT of step 2's manifest is kept from the server (answered 503 now,
    acted on later: a request still on its way, or queued at the server, when its client gave
    up), and every later try of it fails too: the save cannot tell whether step 2 will be
    committed. It says so and keeps step 2's files; the writer goes on from step 1. Then the
    store answers again, and ``landed``: the kept PUT is stored; ``saved again``: save(2) first
    writes the same manifest once more, stored, and the kept PUT, landing after, is refused;
    ``closed``: the writer's close does so before it lets the lock go, and the kept PUT lands
    once the next writer has opened the run (cleared what writers left). Every way, step 2 is
    committed whole (``verify`` passes), a second save of it is refused, and a later save
    (step 3, parent 1) is the newest composite. Before: the save removed step 2's files once
    the read-back found no manifest, and the late manifest then made step 2 a committed
    snapshot with no files: ``verify`` said 'snapshots/step-00000002/global.safetensors: file
    is missing' (with the save's files kept but nothing written at close: the same, the next
    writer having removed them)."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        hold_manifest_put(faults, "snapshots/step-00000002/manifest.json")
        options = {"retry_config": FAST_RETRY}

        def step_2_whole_then_step_3(tailor, model, opt, sched):
            if first != "landed":
                assert [status.split()[0] for status in faults.land()] == ["412"]
            run = Run(url)
            assert run.steps() == [1, 2] and run.verify() == []
            if first == "closed":
                assert tailor.restore(1).step == 1
            train(model, opt, sched, tokens, [3])
            tailor.save(3)

        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Parity(), storage_options=options) as tailor:
            train(model, opt, sched, tokens, [1])
            tailor.save(1)
            train(model, opt, sched, tokens, [2])
            with pytest.raises(TailorError, match=r"step-00000002/manifest.json: the write of the manifest failed .*and so "
                                                  r"did a second .*step 2 may be committed or not"):
                tailor.save(2)
            assert len(faults.held) == 1
            faults.rule = lambda method, key: None
            if first == "landed":
                assert [status.split()[0] for status in faults.land()] == ["200"]
            if first != "closed":
                refused = "already exists" if first == "landed" else "could not settle is stored now"
                with pytest.raises(TailorError, match=rf"step-00000002.*{refused}.*refusing to overwrite"):
                    tailor.save(2)
                step_2_whole_then_step_3(tailor, model, opt, sched)
        if first == "closed":
            model, opt, sched = tiny()
            with Tailor(url, model, opt, sched, policy=Parity(), storage_options=options) as tailor:
                step_2_whole_then_step_3(tailor, model, opt, sched)
        run = Run(url)
        assert run.steps() == [1, 2, 3] and run.latest_step() == 3 and run.verify() == []
        assert {step: run.manifest(step).parent for step in (2, 3)} == {2: 1, 3: 1}


@pytest.mark.parametrize("how", [503, DROP])
def test_a_lock_whose_answers_are_lost_stays_held_by_its_writer(monkeypatch, how):
    """The answers to the lease's first PUT (taking it) and to a renewal are lost after the
    server stored them: the retry meets the writer's own lease, which it still holds (not
    "another writer", not "lost"); the saves commit; the lease's release, its answer lost too,
    leaves no lease behind."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        puts: list[str] = []
        seen_put = threading.Condition()

        def lose(method, key):
            if method == "POST":  # a delete (obstore deletes in bulk, even one object)
                return how
            if not key.endswith("/.lock") or method != "PUT":
                return None
            with seen_put:
                puts.append(key)
                seen_put.notify_all()
                # 1: taking the lease (2: its retry, meeting it); 3: the first renewal (4: its retry)
                return how if len(puts) in (1, 3) else None

        faults.lose = lose
        model, opt, sched = tiny()
        options = {"retry_config": FAST_RETRY, "lock_ttl": 3}
        with Tailor(url, model, opt, sched, storage_options=options) as tailor:
            tailor.save(1)
            with seen_put:  # the renewal after the one whose answer was lost
                assert seen_put.wait_for(lambda: len(puts) >= 5, timeout=120), f"renewals stopped after {len(puts)} PUTs"
            tailor.save(2)
        assert ("POST", f"/{bucket_of(url)}", how) in faults.seen
        assert Run(url).steps() == [1, 2]
        assert not any(k.endswith("/.lock") for k in keys(endpoint, bucket_of(url)))


def test_a_lock_whose_clearing_of_leftovers_fails_is_not_kept_and_the_next_acquire_clears_them(tokens, monkeypatch):
    """A writer lock taken where a crashed save left step 2 without manifest, and the claim of
    step 2's manifest key (its tombstone, written before the files go) failing every try: the
    acquire raises, and lets the lock go again (nothing else would: its caller saw a failure).
    The store answering again, the next acquire takes it and clears step 2. BEFORE: the failed
    acquire kept the lease (held, recorded in this process, renewed at the server); the next
    acquire returned at once, holding it already, and step 2's files stayed."""
    from llmtailor.store.lock import WriterLock

    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url, options = f"s3://{new_bucket(endpoint)}/run", {"retry_config": FAST_RETRY}
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Full(), storage_options=options) as tailor:
            train(model, opt, sched, tokens, [1])
            tailor.save(1)
        Run(url).storage.put("snapshots/step-00000002/global.safetensors", b"a crashed save's file")
        claim = "/run/snapshots/step-00000002/manifest.json"
        faults.rule = lambda method, key: 503 if method == "PUT" and key.endswith(claim) else None
        lock = WriterLock(url, storage_options=options)
        with pytest.raises(TailorError, match="step-00000002/manifest.json"):
            lock.acquire()
        assert not lock.held
        assert not any(k.endswith("/.lock") for k in keys(endpoint, bucket_of(url)))
        faults.rule = lambda method, key: None
        lock.acquire()
        try:
            assert lock.cleared.files == 1
            assert [k.rsplit("/", 1)[1] for k in keys(endpoint, bucket_of(url), "run/snapshots/step-00000002/")] == [
                "manifest.json"]  # the tombstone alone
        finally:
            lock.release()
        assert Run(url).steps() == [1] and not any(k.endswith("/.lock") for k in keys(endpoint, bucket_of(url)))


def test_a_reader_lease_whose_manifest_read_fails_is_released_and_fails_the_read(tokens, monkeypatch):
    """The reader lease's checks, asked side by side (``Storage.together``: the HEAD of the removal
    mark, the GET of the manifest its reader reads), one of them failing every try: the read
    fails naming the manifest, and the lease written first is removed, its DELETE's answer lost
    after the server acted too; the next read, the fault gone, reads the composite whole."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        options = {"retry_config": FAST_RETRY}
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, storage_options=options) as tailor:
            train(model, opt, sched, tokens, [1])
            tailor.save(1)
        manifest = "snapshots/step-00000001/manifest.json"
        faults.rule = lambda method, key: 503 if method == "GET" and key.endswith(manifest) else None
        faults.lose = lambda method, key: DROP if method == "POST" else None  # obstore deletes in bulk
        with pytest.raises(TailorError, match="step-00000001/manifest.json"):
            with Run(url, options).reading(1):
                pass
        assert any(method == "PUT" and "/.readers/" in key for method, key, _ in faults.seen)  # the lease was written
        assert ("POST", f"/{bucket_of(url)}", DROP) in faults.seen
        assert [k for k in keys(endpoint, bucket_of(url)) if "/.readers/" in k] == []
        faults.rule, faults.lose = (lambda method, key: None), (lambda method, key: None)
        with Run(url, options).reading(1) as composite:
            assert composite.step == 1
        assert Run(url, options).verify() == []


@pytest.mark.slow
@S3_ONLY
def test_a_script_that_ends_without_close_commits_retains_and_promotes_to_the_object_store(url, tmp_path):
    """A script that ends without ``close()``, saving async to S3 (``keep=2``) and to a local tier
    in front of another S3 run: at exit its last save commits and is not reported lost, each
    retention runs and the promotions due reach the bucket. The small requests a store asks side
    by side (``Storage.together``: listing, pointer, lease checks) run on threads of a pool, which
    takes no new work once the interpreter exits: they are asked one after another then, not
    failed (before: "the async save of step 5 ... was NOT saved", step 5 committed all the same;
    the promotions to the second run failed, which stayed at step 2)."""
    direct, tiered, memory = url, f"{url}-tiered", tmp_path / "memory"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from helpers import tiny, train
        from llmtailor import Parity, Tailor, Tier
        from llmtailor.training_example import corpus_tokens

        tokens, jobs = corpus_tokens(), []
        for url, tiers in (({direct!r}, []), ({tiered!r}, [Tier({str(memory)!r}, promote_every=1)])):
            model, opt, sched = tiny()
            jobs.append((model, opt, sched, Tailor(url, model, opt, sched, policy=Parity(), async_save=True, keep=2,
                                                   tiers=tiers)))
        for step in range(1, 6):
            for model, opt, sched, tailor in jobs:
                train(model, opt, sched, tokens, [step])
                tailor.save(step)
        # no close(): the saves in flight commit at exit, their retention and promotions run
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    for where in (direct, tiered):
        run = Run(where)
        assert run.latest_step() == 5 and run.verify() == []
    assert Run(direct).steps() == [3, 4, 5]  # retention ran at exit: Parity's composites of 5 and 4 need these
    assert Run(memory).latest_step() == 5 and Run(memory).verify() == []


def test_a_crash_before_the_manifest_leaves_nothing_readable_and_the_next_writer_clears_it(url, emulator, tmp_path):
    """A process killed after uploading a snapshot's files (one large enough to go as a
    multipart upload left unfinished: on Azure, blocks never committed) but before its
    manifest: readers see the previous composite only; gc removes the objects and aborts the
    upload (S3; Azure discards uncommitted blocks itself)."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        import obstore
        from helpers import tiny
        from llmtailor import Tailor
        from llmtailor.store.storage import objects

        model, opt, sched = tiny(hidden=256)  # an embedding of 256 x 256 floats, with Adam's moments
        tailor = Tailor({url!r}, model, opt, sched)
        tailor.save(1)
        real_put = objects.ObjectStorage.put
        def crash_at_manifest(self, key, data, **kwargs):
            if key.endswith("manifest.json"):
                # Leave an upload unfinished too, as a kill in the middle of a large file does.
                writer = obstore.open_writer(self.store, "snapshots/step-00000002/units/big.safetensors", buffer_size=5 << 20)
                writer.write(b"x" * (12 << 20))
                writer.flush()
                os.kill(os.getpid(), 9)
            return real_put(self, key, data, **kwargs)
        objects.ObjectStorage.put = crash_at_manifest
        tailor.save(2)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    bucket, s3 = bucket_of(url), emulator.scheme == "s3"
    left = [k for k in emulator.keys(bucket) if "step-00000002" in k]
    assert left and (not s3 or uploads(emulator.endpoint, bucket))  # the crash's leftovers are there ...
    run = Run(url)
    assert run.steps() == [1] and run.latest_step() == 1 and run.verify() == []  # ... and not seen
    result = runner.invoke(app, ["gc", url, "--keep", "1"])
    assert result.exit_code == 0, result.output
    assert tombstone_only(emulator, bucket, "step-00000002")
    assert not s3 or not uploads(emulator.endpoint, bucket)
    # inspect and verify show the tombstone, say it is no snapshot and why it stays (gc removes none)
    for command in (["inspect", url], ["verify", url], ["gc", url, "--keep", "1"], ["verify", url]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "step(s) 2: a tombstone each (a manifest of a few bytes of its own: no snapshot)" in said and "kept for good" in said, said
    assert "step(s) 2: a tombstone" in " ".join(runner.invoke(app, ["inspect", url]).output.split())
    assert tombstone_only(emulator, bucket, "step-00000002")
    model, opt, sched = tiny(hidden=256)
    with Tailor(url, model, opt, sched) as tailor:
        assert tailor.restore().step == 1
        tailor.save(2)
    assert Run(url).steps() == [1, 2] and Run(url).verify() == []


def tombstone_only(emulator, bucket: str, snapshot: str) -> bool:
    """Whether all that is left of ``snapshot`` is its manifest key's tombstone (``object_commit.tombstone``,
    a few bytes of its own), which the next writer claimed before it removed the files, so that a
    manifest write still on its way is refused."""
    left = [k for k in emulator.keys(bucket) if f"/{snapshot}/" in k]
    return (len(left) == 1 and left[0].endswith(f"/{snapshot}/manifest.json")
            and not is_committed(len(emulator.read(bucket, left[0]))))


def test_retention_keeps_what_composites_need_and_never_what_a_reader_holds(url, tokens):
    parity_run(url, tokens, 4)
    run = Run(url)
    from llmtailor.store.retention import apply_retention, plan_retention

    with run.reading(3):  # a reader holds the composite of step 3 (snapshots 2 and 3)
        outcome = apply_retention(run, plan_retention(run, 1))
    assert set(outcome.in_use) == {2} and outcome.deleted == [1]
    assert Run(url).steps() == [2, 3, 4]
    outcome = apply_retention(Run(url), plan_retention(Run(url), 1))
    assert outcome.deleted == [2] and Run(url).steps() == [3, 4] and Run(url).verify() == []


@S3_ONLY
def test_the_cli_takes_urls(url, tokens, tmp_path):
    parity_run(url, tokens, 3)
    inspect = runner.invoke(app, ["inspect", url])
    assert inspect.exit_code == 0 and "3 snapshot(s)" in inspect.output
    assert runner.invoke(app, ["verify", url]).exit_code == 0
    drift = runner.invoke(app, ["drift", url])
    assert drift.exit_code == 0, drift.output
    out = tmp_path / "export"
    assemble = runner.invoke(app, ["assemble", url, "--format", "hf", "-o", str(out)])
    assert assemble.exit_code == 0, assemble.output
    missing = runner.invoke(app, ["inspect", url + "-nothing-here"])
    assert missing.exit_code == 2 and "no such run" in missing.output
    options = runner.invoke(app, ["--storage-option", "region", "inspect", url])
    assert options.exit_code == 2 and "expected KEY=VALUE" in options.output


@S3_ONLY
def test_a_merge_reads_runs_at_urls_and_writes_a_run_at_a_url(url, tokens, tmp_path):
    parity_run(url, tokens, 3)
    plan = tmp_path / "plan.yaml"
    plan.write_text(textwrap.dedent(f"""
        merge_method: passthrough
        slices:
          - sources: [{{model: "{url}@3", layer_range: [0, 2]}}]
          - sources: [{{model: "{url}@2", layer_range: [2, 4]}}]
    """))
    merged = url + "-merged"
    result = runner.invoke(app, ["merge", str(plan), "-o", merged])
    assert result.exit_code == 0, result.output
    out = Run(merged)
    assert out.steps() and out.verify() == []
    tensors, _ = out.read_unit(out.latest_step(), "layer.3")
    want, _ = Run(url).read_unit(Run(url).resolve(2).sources["layer.3"], "layer.3")
    assert all(torch.equal(tensors[k], want[k]) for k in tensors if k.startswith("weight/"))


def test_local_options_are_refused_and_a_dead_endpoint_is_named(monkeypatch, tmp_path):
    """Nothing listens at the endpoint: the error says the connection was refused, naming the
    run's URL and the endpoint, in one line."""
    with pytest.raises(TailorError, match="apply to object-store URLs"):
        Run(tmp_path, {"endpoint": "http://x"})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    dead = f"http://127.0.0.1:{free_port()}"
    run = Run("s3://nowhere/run", {"endpoint": dead, "retry_config": FAST_RETRY})
    with pytest.raises(TailorError, match=rf"^s3://nowhere/run\S*: connection refused by {dead} \(") as failed:
        run.steps()
    assert "\n" not in str(failed.value)


def test_runs_opened_again_at_one_url_share_obstores_store_and_a_changed_environment_or_option_does_not(monkeypatch):
    """Making obstore's store costs ~11 ms of CPU (its HTTP client), on every rank of every
    restore: a process opening the same URL with the same options and environment again reuses
    it; another endpoint in the environment, another option or URL, or a forked child makes its own."""
    from llmtailor.store.storage.object_store import ObjectStore

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    first = ObjectStore("s3://shared/run")
    assert ObjectStore("s3://shared/run/").store is first.store
    assert ObjectStore("s3://shared/other").store is not first.store
    assert ObjectStore("s3://shared/run", {"retry_config": FAST_RETRY}).store is not first.store
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    moved = ObjectStore("s3://shared/run")
    assert moved.store is not first.store and ObjectStore("s3://shared/run").store is moved.store
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child's store is its own: a parent's HTTP client is not used across fork
        os.write(write, b"1" if ObjectStore("s3://shared/run").store is not moved.store else b"0")
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 1) == b"1"


def test_a_memory_url_opened_again_is_a_store_of_its_own_never_one_kept_for_reuse(monkeypatch):
    """obstore's ``memory://`` store holds the objects themselves, not just a client: kept for
    reuse (``_store_for``), a run written there was found again by a later open of the URL, then
    lost as soon as the store left the cache (16 other stores opened, an ``AWS_*`` variable
    changed, a forked child); and one test's run was met by another's. Each open makes its own,
    as before the cache. Before: "second open found: True"."""
    from llmtailor.store.storage import open_storage

    first = open_storage("memory:///kept")
    first.put("a-key", b"written by the first open")
    again = open_storage("memory:///kept")
    assert not again.is_file("a-key"), "second open found: True"
    monkeypatch.setenv("AWS_REGION", "elsewhere")  # a key of the cache changed: the same, never a vanishing run
    assert not open_storage("memory:///kept").is_file("a-key")


def one_line_error(result) -> str:
    """The CLI's error: exit status 2, one line, no traceback."""
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output, result.output
    return result.output


MISSING_BUCKET = {"s3": "NoSuchBucket: The specified bucket does not exist",
                  "az": "ContainerNotFound: The specified container does not exist"}


def test_a_missing_bucket_is_named_with_the_servers_code_and_message(emulator, monkeypatch):
    for name, value in emulator.environment().items():
        monkeypatch.setenv(name, value)
    url, said = f"{emulator.scheme}://no-such-{uuid.uuid4().hex[:8]}/run", MISSING_BUCKET[emulator.scheme]
    with pytest.raises(TailorError, match=rf"^{url}.*: {said} \(HTTP 404 from {emulator.endpoint}\)$") as failed:
        Run(url).steps()
    assert "\n" not in str(failed.value) and "<?xml" not in str(failed.value)
    code = said.split(":")[0]
    assert code in one_line_error(runner.invoke(app, ["inspect", url]))
    with pytest.raises(TailorError, match=code):  # a write says the same, not "file is missing"
        ObjectStorage(url).put("latest", b"x")


@pytest.fixture(scope="module")
def guarded():
    """moto checking credentials (it lets the first 3 requests through: a bucket, a user and
    its key are made); yields the endpoint, the bucket and the user's key (no rights granted)."""
    with moto_process({"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as url:  # the first 3 S3 or IAM requests
        name = new_bucket(url)
        iam = boto3_client("iam", url)
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        yield url, name, key


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"])
def test_credentials_refused_say_permission_denied_with_the_servers_code(guarded, monkeypatch, code):
    endpoint, bucket, key = guarded
    set_environment(monkeypatch, endpoint)
    credentials = {"InvalidAccessKeyId": ("AKIANOSUCHKEY", "x"), "SignatureDoesNotMatch": (key["AccessKeyId"], "wrong"),
                   "AccessDenied": (key["AccessKeyId"], key["SecretAccessKey"])}[code]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", credentials[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", credentials[1])
    url = f"s3://{bucket}/run"
    with pytest.raises(TailorError, match=rf"^{url}.*: permission denied \({code}: .*; HTTP 403 from {endpoint}\)$"):
        Run(url, {"retry_config": FAST_RETRY}).steps()
    assert "permission denied" in one_line_error(runner.invoke(app, ["verify", url]))


@pytest.mark.parametrize("prefix", ["latest/meta-data/run", "v2/credentials/run"])
def test_a_run_whose_prefix_reads_as_a_credential_service_path_is_denied_not_said_without_credentials(guarded, monkeypatch,
                                                                                                  prefix):
    """Only a request to a credential service itself (its host) says no credentials were found;
    a run at such a prefix of the bucket keeps the server's refusal. BEFORE (session 58): ``no
    credentials (none in the environment or the options, none from the instance metadata service
    at http://127.0.0.1:...: HTTP 403)``, with the credentials set."""
    endpoint, bucket, key = guarded
    set_environment(monkeypatch, endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    url = f"s3://{bucket}/{prefix}"
    with pytest.raises(TailorError, match=rf"^{url}/manifest.json: permission denied \(AccessDenied: .*; HTTP 403 "
                                          rf"from {endpoint}\)$"):
        from llmtailor.store.storage import open_storage

        open_storage(url, {"retry_config": FAST_RETRY}).read("manifest.json")  # its path holds the prefix (a LIST's query not)


@pytest.mark.parametrize("prefix", ["latest/meta-data/run", "latest/api/token/run", "computeMetadata/run"])
def test_a_virtual_hosted_bucket_whose_run_prefix_reads_as_a_credential_service_path_is_denied(monkeypatch, prefix):
    """A virtual-hosted bucket (its name in the endpoint's host, so the request's path starts with
    the run's prefix, as AWS's own endpoints are asked) whose run is at a prefix that reads as a
    metadata service's path, the server refusing (HTTP 403; moto behind a layer that answers, as
    moto itself takes a path ``/latest/meta-data/...`` for its own metadata service): the refusal
    is the store's, said so, never "no credentials", which only a credential service's own host
    says (``object_errors._SERVICE_HOSTS``, or one the options move it to:
    ``test_newcomer``). BEFORE (session 59): ``no credentials (none in the environment or the
    options, none from the instance metadata service at http://127.0.0.1:...: HTTP 403)``."""
    from llmtailor.store.storage import open_storage

    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        faults.rule = lambda method, key: 403 if key.startswith(f"/{prefix}/") else None
        url = f"s3://{new_bucket(endpoint)}/{prefix}"
        storage = open_storage(url, {"retry_config": FAST_RETRY, "virtual_hosted_style_request": True})
        with pytest.raises(TailorError, match=rf"^{url}/manifest.json: permission denied \(SlowDown: .*; HTTP 403 "
                                              rf"from {endpoint}\)$"):
            storage.read("manifest.json")
        assert ("GET", f"/{prefix}/manifest.json", 403) in faults.seen  # asked as a virtual-hosted bucket is


@S3_ONLY
def test_an_http_endpoint_from_the_environment_needs_no_aws_allow_http(url, endpoint, monkeypatch, tokens):
    """AWS_ENDPOINT_URL=http://... alone: the run is written and read (as with the endpoint
    given as an option)."""
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    model, opt, sched = tiny()
    with Tailor(url, model, opt, sched) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1)
    assert Run(url).steps() == [1] and Run(url).verify() == []
    with pytest.raises(TailorError, match=rf"plain HTTP to {endpoint} is not allowed \(allow_http is false\)$"):
        Run(url, {"allow_http": "false"}).steps()


@S3_ONLY
@pytest.mark.parametrize("option, expected", [
    ("lock_ttl=soon", "storage option lock_ttl='soon': expected seconds, a number > 0"),
    ("lock_ttl=0", "storage option lock_ttl='0': expected seconds, a number > 0"),
    ("lock_ttl=nan", "storage option lock_ttl='nan': expected seconds, a number > 0"),
    ("retry_config=often", "storage option retry_config='often': expected a JSON object"),
    ("client_options=[1]", "storage option client_options=[1]: expected a JSON object"),
    ('retry_config={"max_retries": "many"}', "cannot use this location with storage options ['retry_config']"),
])
def test_a_bad_storage_option_is_one_line_naming_it(url, option, expected):
    # (env: the option the CLI sets for the command's process does not outlive the command here)
    assert expected in one_line_error(runner.invoke(app, ["--storage-option", option, "inspect", url], env={OPTIONS_ENV: None}))


@S3_ONLY
@pytest.mark.slow
def test_a_bad_storage_option_exits_without_a_traceback(url):
    """The shape of the report: the command itself, in a process of its own."""
    command = [sys.executable, "-c", "from llmtailor.cli import main; main()"]
    proc = subprocess.run([*command, "--storage-option", "lock_ttl=soon", "inspect", url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "error: storage option lock_ttl='soon': expected seconds, a number > 0 " \
        "(how long a writer's lease holds unrenewed; default 30)"
    with pytest.raises(ConfigError, match="lock_ttl=-1"):
        Tailor(url, *tiny(), storage_options={"lock_ttl": -1})


def test_gc_says_what_it_cleared_of_a_crashs_leftovers_in_80_columns(url, emulator, tokens):
    """A crash's leftovers: 5 objects of a snapshot without manifest and (S3) 2 unfinished
    multipart uploads. gc removes them and says so (not only "deleted 0 snapshot(s)"), every
    line within 80 columns."""
    model, opt, sched = tiny()
    with Tailor(url, model, opt, sched) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1)
    bucket, s3 = bucket_of(url), emulator.scheme == "s3"
    for name in ("global.json", "global.safetensors", "units/embed.safetensors", "units/head.safetensors", "index/embed.json"):
        emulator.write(bucket, f"runs/exp/snapshots/step-00000002/{name}", b"x" * 10)
    for name in ("layer.0", "layer.1") if s3 else ():
        client(emulator.endpoint).create_multipart_upload(Bucket=bucket, Key=f"runs/exp/snapshots/step-00000002/units/{name}.safetensors")
    result = runner.invoke(app, ["gc", url, "--keep", "1"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "deleted 0 snapshot(s); kept 1" in result.output
    cleared = "removed 5 object(s), aborted 2 upload(s)" if s3 else "removed 5 object(s)"
    assert f"leftovers of interrupted saves: {cleared}" in result.output and (s3 or "aborted" not in result.output)
    assert max(len(line) for line in result.output.splitlines()) <= 80, result.output
    assert tombstone_only(emulator, bucket, "step-00000002")
    assert not s3 or not uploads(emulator.endpoint, bucket)
    again = runner.invoke(app, ["gc", url, "--keep", "1"], env={"COLUMNS": "80"})
    assert again.exit_code == 0 and "leftovers" not in again.output




@S3_ONLY
def test_an_async_save_to_s3_goes_the_same_background_path_and_restores_bitwise(url, tokens):
    model, opt, sched = tiny()
    with Tailor(url, model, opt, sched, policy=Parity(), async_save=True) as tailor:
        for step in (1, 2, 3):
            train(model, opt, sched, tokens, [step])
            pending = tailor.save(step)  # returns at once; uploads in the background
        saved = unit_versions(model, opt)  # the fence: step 3's copies were taken before any later step
        assert pending.result().step == 3
    fresh = tiny(seed=4)
    with Tailor(url, *fresh, read_only=True) as reader:
        report = reader.restore()
    assert report.step == 3 and Run(url).verify() == []
    # Units saved at step 3 hold exactly the values the model had at save(3).
    restored = [n for n, _ in fresh[0].named_parameters() if report.sources[reader.layout.unit_of(n)] == 3]
    assert restored and all(torch.equal(dict(fresh[0].named_parameters())[n], saved[n]["weight"]) for n in restored)


@S3_ONLY
def test_a_memory_tier_in_front_of_an_s3_run_promotes_there_and_restores_from_it(url, tokens, tmp_path):
    """The durable tier is the bucket: promotions upload whole composites (Parity's carriers too),
    and with the memory tier lost, the bucket alone restores the newest promoted composite."""
    from llmtailor import Tier

    memory = tmp_path / "memory"
    model, opt, sched = tiny()
    tailor = Tailor(url, model, opt, sched, policy=Parity(), async_save=True, keep=2,
                    tiers=[Tier(memory, keep=2, promote_every=3)])
    for step in range(1, 9):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
        tailor.wait(promoted=True)
    assert [p.step for p in tailor.tiers.promotions] == [1, 4, 7]
    assert Run(url).steps() == [3, 4, 6, 7] and Run(url).verify() == []  # keep=2: composites 7 and 4
    in_memory = tiny(seed=3)
    with Tailor(url, *in_memory, tiers=[Tier(memory)], read_only=True) as reader:
        report = reader.restore(7)
        assert report.tier == str(memory)
    tailor.close()
    assert Run(url).latest_step() == 8
    import shutil

    shutil.rmtree(memory)
    from_bucket = tiny(seed=3)
    with Tailor(url, *from_bucket, tiers=[Tier(memory)], read_only=True) as reader:
        assert (reader.restore(7).tier, reader.restore().step) == (url, 8)
    again = tiny(seed=3)
    with Tailor(url, *again, read_only=True) as reader:
        reader.restore(7)
    assert_bitwise(unit_versions(again[0], again[1]), unit_versions(in_memory[0], in_memory[1]))


def test_a_promotion_of_files_read_in_many_pieces_uploads_their_bytes(url, tokens, tmp_path, monkeypatch):
    """A promotion streams each file from the memory tier in pieces read into one reused buffer
    (``Storage.pieces``); the object store's writer keeps a reference to what it is given until
    it sends the part, so each piece must be copied on the way. Pieces of 4 KiB here stand in
    for the 16 MiB pieces of a file of hundreds of MB: before the copy, every promoted file over
    one piece was stored garbled (found by bench_nodes: ``not a readable safetensors file``)."""
    from llmtailor import Tier
    from llmtailor.store.storage import local_durable

    monkeypatch.setattr(local_durable, "PIECE", 4096)
    memory = tmp_path / "memory"
    model, opt, sched = tiny()
    with Tailor(url, model, opt, sched, policy=Parity(), tiers=[Tier(memory, keep=2)]) as tailor:
        for step in (1, 2):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
        in_memory = tiny(seed=3)
        with Tailor(url, *in_memory, tiers=[Tier(memory)], read_only=True) as reader:
            reader.restore(2)
    assert Run(url).verify() == []  # every promoted file as its manifest and index record it
    from_bucket = tiny(seed=3)
    with Tailor(url, *from_bucket, read_only=True) as reader:
        assert reader.restore().step == 2
    assert_bitwise(unit_versions(from_bucket[0], from_bucket[1]), unit_versions(in_memory[0], in_memory[1]))


@pytest.mark.slow
@S3_ONLY
def test_async_lora_with_modules_to_save_under_parity_restores_from_s3_to_the_composites_versions(url, tokens):
    """Partly frozen units on an object store: LoRA with peft's ``modules_to_save`` (a trained
    head beside frozen base weights), Parity, two async saves in flight; a fresh model restores
    from the bucket every weight and optimizer state bit for bit as the composite's table names
    its version (each unit read from its pack, frozen parts from the snapshots that keep them)."""
    pytest.importorskip("peft")
    from test_frozen import lora_saving, step

    from llmtailor.layouts import build_layout
    from llmtailor.providers.base import unwrap

    model, optimizer = lora_saving("lm_head")
    versions = {}
    with Tailor(url, model, optimizer, policy=Parity(), async_save=True, async_in_flight=2) as tailor:
        for s in range(1, 6):
            step(model, optimizer, tokens, s)
            tailor.save(s)
            versions[s] = unit_versions(model, optimizer)
    run = Run(url)
    sources = run.resolve().sources
    assert len(set(sources.values())) > 1 and run.verify() == []  # a composite of several saves
    fresh, fresh_optimizer = lora_saving("lm_head", seed=1)
    with Tailor(url, fresh, fresh_optimizer, policy=Parity()) as tailor:
        assert tailor.restore().step == 5
    layout = build_layout(unwrap(fresh))
    for name, state in unit_versions(fresh, fresh_optimizer).items():
        source = sources[layout.unit_of(name.removeprefix("base_model.model."))]
        assert state.keys() == versions[source][name].keys(), name
        for key, value in state.items():
            assert torch.equal(value, versions[source][name][key]), f"{name}/{key} (from step {source})"


def test_a_manifest_put_still_held_when_its_writer_closed_with_the_store_unreachable_is_refused_later(tokens, monkeypatch):
    """Step 2's manifest PUT is kept from the server (acted on later), and every later try of it
    fails, through the writer's close (the store still unreachable for that key): the outcome of
    step 2 is unknown when the lock is let go. The next writer clears what writers left, step 2's
    files among them (it has no manifest): it first claims step 2's manifest key with a tombstone
    (an empty object, written only if absent), so the kept PUT, landing after (a conditional PUT,
    only if absent), is refused, and step 2 is no snapshot. A save of step 2 then replaces the
    tombstone. Before: the kept PUT landed (200) and made step 2 a committed snapshot whose files
    the next writer had removed (``verify``: 'file is missing')."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        options = {"retry_config": FAST_RETRY}
        _save_2_held_through_close(faults, url, options, tokens, first=True)
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Parity(), storage_options=options) as tailor:
            assert [status.split()[0] for status in faults.land()] == ["412"]
            run = Run(url)
            assert run.steps() == [1] and run.verify() == []
            assert tailor.restore().step == 1
            train(model, opt, sched, tokens, [2])
            tailor.save(2)
        run = Run(url)
        assert run.steps() == [1, 2] and run.latest_step() == 2 and run.verify() == []


def test_a_save_over_a_tombstone_whose_manifest_put_is_still_held_is_refused_once_the_next_writer_cleared_it(tokens, monkeypatch):
    """The tombstone's second round: step 2's first manifest PUT is held through its writer's
    close (the next writer claims step 2 with a tombstone, as above); a save of step 2 over that
    tombstone (its PUT conditional on the tombstone's version) then has its PUT held through its
    writer's close too. The writer after clears step 2's files again: the held PUT, landing
    after, must be refused, so step 2 is no snapshot. An empty tombstone's version on S3 is the
    ETag of no bytes, the same for every tombstone: the held PUT, matching it, landed (200) and
    made step 2 a committed snapshot whose files were gone."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        options = {"retry_config": FAST_RETRY}
        _save_2_held_through_close(faults, url, options, tokens, first=True)
        with Tailor(url, *tiny(), policy=Parity(), storage_options=options):  # claims step 2 with a tombstone
            assert [status.split()[0] for status in faults.land()] == ["412"]
        _save_2_held_through_close(faults, url, options, tokens, first=False)  # over the tombstone
        with Tailor(url, *tiny(), policy=Parity(), storage_options=options):  # clears step 2's files again
            assert [status.split()[0] for status in faults.land()] == ["412"]
        run = Run(url)
        assert run.steps() == [1] and run.verify() == []


def test_a_tombstone_alone_is_left_as_it_is_and_a_save_over_it_commits_while_a_late_put_is_refused(tokens, monkeypatch):
    """A tombstone left alone (the next writer claimed step 2 and saved nothing there) is left as it
    is by the writer after (no request writes it: one fewer PUT per tombstone at every start),
    and that is sound: a manifest PUT conditional on it comes only from a save over it, whose files
    are there before it (the next writer replaces the tombstone then: the test above). That
    writer's save of step 2 then commits over it (its PUT conditional on the tombstone as it found
    it at ``begin``), and the PUT of the first writer, landing after, is refused."""
    from llmtailor.store.lock import WriterLock

    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        options = {"retry_config": FAST_RETRY}
        _save_2_held_through_close(faults, url, options, tokens, first=True)
        claims = WriterLock(url, storage_options=options)  # the next writer, which saves nothing
        claims.acquire()
        claims.release()
        key = "/run/snapshots/step-00000002/manifest.json"
        faults.seen.clear()
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Parity(), storage_options=options) as tailor:
            assert tailor.restore().step == 1
            assert not [seen for seen in faults.seen if seen[0] == "PUT" and seen[1].endswith(key)]  # left as it is
            train(model, opt, sched, tokens, [2])
            tailor.save(2)
        assert [status.split()[0] for status in faults.land()] == ["412"]
        run = Run(url)
        assert run.steps() == [1, 2] and run.latest_step() == 2 and run.verify() == []


def test_an_empty_tombstone_alone_is_replaced_so_a_put_conditional_on_an_empty_one_is_refused(tokens, monkeypatch):
    """A run from before tombstones had bytes of their own: step 2 was claimed with an empty one;
    a save over it then had its manifest PUT (conditional on the empty tombstone's version: on S3
    the ETag of no bytes, every empty tombstone's) held through its writer's close, and the
    writer after (that llmtailor) replaced the tombstone with another empty one and removed the
    files: the tombstone is alone, and the held PUT still matches it. The next writer must
    replace an empty tombstone even alone (one with bytes of its own is left: the test above).
    BEFORE: the held PUT landed (200) and made step 2 a committed snapshot whose files were gone."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        options = {"retry_config": FAST_RETRY}
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Parity(), storage_options=options) as tailor:
            train(model, opt, sched, tokens, [1])
            tailor.save(1)
        # What that llmtailor did (it would claim an empty tombstone alone anew, as this one does):
        storage, key = Run(url).storage, "snapshots/step-00000002/manifest.json"
        assert storage.put_if(key, b"", None) is not None  # step 2 claimed
        empty = storage.version_if(key, lambda data: not data)
        storage.put("snapshots/step-00000002/global.safetensors", b"a save over it")  # its files, then its manifest
        hold_manifest_put(faults, key)
        with pytest.raises(TailorError, match="HTTP 503"):
            storage.put_if(key, bytes(storage.read("snapshots/step-00000001/manifest.json")), empty)
        faults.rule = faults.hold = lambda method, key: None
        assert storage.put_if(key, b"", empty) is not None  # the next writer's claim, over that very tombstone
        storage.remove_tree("snapshots/step-00000002", keep=key)
        with Tailor(url, *tiny(), policy=Parity(), storage_options=options):  # this llmtailor's next writer
            pass
        assert [status.split()[0] for status in faults.land()] == ["412"]
        run = Run(url)
        assert run.steps() == [1] and run.verify() == []


def _save_2_held_through_close(faults, url: str, options: dict, tokens, first: bool) -> None:
    """A writer saves step 2 (``first``: after step 1; else restored from step 1) with its
    manifest's first PUT held (``hold_manifest_put``) and every later one failing through its
    close; then the store answers again."""
    hold_manifest_put(faults, "snapshots/step-00000002/manifest.json")
    model, opt, sched = tiny()
    with Tailor(url, model, opt, sched, policy=Parity(), storage_options=options) as tailor:
        if first:
            train(model, opt, sched, tokens, [1])
            tailor.save(1)
        else:
            assert tailor.restore().step == 1
        train(model, opt, sched, tokens, [2])
        with pytest.raises(TailorError, match=r"step 2 may be committed or not"):
            tailor.save(2)
    assert len(faults.held) == 1
    faults.rule = faults.hold = lambda method, key: None


def test_inspect_and_verify_name_the_tombstones_from_their_own_listing_of_the_snapshots(tokens, monkeypatch):
    """A run of steps 1 and 2 and a tombstone at step 3 (a save of it cleared by the next writer):
    ``inspect`` and ``verify`` note the tombstone from a listing of the snapshots they made
    anyway, not from one of their own (a LIST, and a HEAD of each snapshot's manifest). Counted
    at the server: the HEADs of step 3's tombstone (only a listing asks for it) and the LISTs.
    Before, ``verify`` listed the snapshots 6 times and ``inspect`` 4 times; now one fewer each.
    A save of step 3 then replaces the tombstone: the next ``verify`` names none."""
    from llmtailor.store.storage.object_commit import tombstone

    def asked(command: list[str]) -> tuple[int, int, str]:
        faults.seen.clear()
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        listings = sum(method == "HEAD" and key.endswith("/step-00000003/manifest.json") for method, key, _ in faults.seen)
        lists = sum(method == "GET" and key.count("/") == 1 for method, key, _ in faults.seen)
        return listings, lists, " ".join(result.output.split())

    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        url = f"s3://{new_bucket(endpoint)}/run"
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, policy=Full()) as tailor:
            for step in (1, 2):
                train(model, opt, sched, tokens, [step])
                tailor.save(step)
        assert Run(url).storage.put_if("snapshots/step-00000003/manifest.json", tombstone(), None) is not None
        counted = {command: asked([command, url]) for command in ("verify", "inspect")}
        assert all("step(s) 3: a tombstone each" in said for _, _, said in counted.values()), counted
        assert {command: listings for command, (listings, _, _) in counted.items()} == {"verify": 5, "inspect": 3}, counted
        with Tailor(url, model, opt, sched, policy=Full()) as tailor:
            tailor.restore()
            train(model, opt, sched, tokens, [3])
            tailor.save(3)
        assert Run(url).steps() == [1, 2, 3] and "tombstone" not in asked(["verify", url])[2]


def test_a_writer_whose_machine_slept_past_its_lease_asks_the_store_before_it_commits(monkeypatch):
    """A suspended VM's monotonic clock does not count its sleep; its wall clock, set again once
    it wakes, does. A writer's lease renewed just before such a sleep of an hour must be asked
    about (renewed over its own version) at the commit's confirmation, not taken as fresh by the
    monotonic count alone. Before: ``confirm`` asked nothing (monotonic: renewed a moment ago)."""
    from llmtailor.store.storage import object_lock
    from llmtailor.store.storage.location import open_storage

    storage = open_storage("memory:///run")
    lock = ObjectWriterLock(storage)
    _renewals_held(monkeypatch)
    lock.take()
    try:
        asked = []
        put_if = type(storage).put_if
        monkeypatch.setattr(type(storage), "put_if", lambda self, *a, **k: asked.append(a[0]) or put_if(self, *a, **k))
        lock.confirm()
        assert asked == []  # renewed a moment ago, on both clocks
        woke = time.time() + 3600
        monkeypatch.setattr(object_lock.time, "time", lambda: woke)
        lock.confirm()
        assert asked == [".lock"]
    finally:
        monkeypatch.undo()
        lock.release()
