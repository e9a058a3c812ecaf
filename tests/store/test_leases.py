"""Readers racing retention: a read that has started never fails, and never reads a composite
in part, because retention removed its files (reader leases, ``store.lock``)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from helpers import tiny, train
from typer.testing import CliRunner

from llmtailor import Parity, Tailor
from llmtailor.cli import app
from llmtailor.errors import SnapshotNotFoundError
from llmtailor.store.retention import apply_retention, plan_retention
from llmtailor.store.run import Run
from llmtailor.store.storage import local_lock as lock
from llmtailor.store.storage.local_lock import LEASE_FILE, lease_for_reading, lease_for_removal

runner = CliRunner()

MODEL = textwrap.dedent(
    """
    import torch

    class Model(torch.nn.Module):
        # Units by name: embed, layer.0..3, norm (the fallback layout).
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            self.norm = torch.nn.LayerNorm(8)
    """
)

WRITER = MODEL + textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from llmtailor import Parity, Tailor

    model = Model()
    tailor = Tailor(sys.argv[1], model, torch.optim.AdamW(model.parameters()), policy=Parity(), keep=1,
                    track_drift=False)
    stop, step = Path(sys.argv[2]), 0
    while not stop.exists():  # saves until the test has read enough
        step += 1
        with torch.no_grad():  # every tensor of the save of step S holds S: a restore shows its sources
            for p in model.parameters():
                p.fill_(float(step))
        tailor.save(step)
        if step == 1:
            print("ready", flush=True)
    tailor.close()
    """
)


def _model():
    scope: dict = {}
    exec(MODEL, scope)
    return scope["Model"]()


def test_readers_racing_a_keep_1_writer_never_fail_and_restore_whole_composites(tmp_path):
    """The shape that found it: ``verify`` and ``Tailor.restore()`` over and over while another
    process saves with Parity and keep=1 (so every save removes what the previous composite
    needed). Before leases, about one read in twenty failed ("file is missing"). The reads go on
    until there were 20 and they met 10 composites (the writer saving all along), however fast
    either side runs."""
    run, stop = tmp_path / "run", tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run), str(stop)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        reads, composites = 0, set()
        while reads < 20 or len(composites) < 10:
            assert writer.poll() is None, writer.stderr.read()
            result = runner.invoke(app, ["verify", str(run)])
            assert result.exit_code == 0, result.output
            model = _model()
            reader = Tailor(run, model, torch.optim.AdamW(model.parameters()), track_drift=False, read_only=True)
            report = reader.restore()
            # Each unit equals its version in the snapshot the composite names: nothing from a
            # snapshot removed under the read, nothing mixed.
            for name, param in model.named_parameters():
                assert torch.all(param == float(report.sources[reader.layout.unit_of(name)])), (name, report.sources)
            # Step 1's save is full; from then on each composite takes half its layers from the save before.
            expected = {1} if report.step == 1 else {report.step - 1, report.step}
            assert report.sources["norm"] == report.step and set(report.sources.values()) == expected
            reads += 1
            composites.add(report.step)
        stop.touch()
        _, err = writer.communicate(timeout=300)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.communicate()
    assert writer.returncode == 0, err
    # Whatever readers held back was left for the next retention, which the last saves ran.
    assert len(Run(run).steps()) <= 4


@pytest.fixture
def parity_run(tmp_path, tokens):
    """Parity saves at steps 1..4: each composite needs its own snapshot and the previous one."""
    model, opt, sched = tiny()
    with Tailor(tmp_path / "run", model, opt, sched, policy=Parity()) as tailor:
        for step in range(1, 5):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    return tmp_path / "run"


def test_retention_leaves_a_snapshot_being_read_for_the_next_one(parity_run):
    run = Run(parity_run)
    with Run(parity_run).reading(3) as composite:  # needs steps 2 and 3
        assert composite.step == 3
        outcome = apply_retention(run, plan_retention(run, 1))  # the newest needs 3 and 4
        assert outcome.deleted == [1] and outcome.in_use == [2]
        assert Run(parity_run).verify(3) == []  # the composite being read is whole
    outcome = apply_retention(run, plan_retention(run, 1))
    assert outcome.deleted == [2] and Run(parity_run).steps() == [3, 4]


def test_a_snapshot_removed_right_after_its_manifest_was_seen_is_listed_or_not_never_an_error(parity_run, monkeypatch):
    """The listing of a run's steps while retention removes a snapshot: its manifest is there at
    the first look at it (whichever call looks), and gone right after (the race the keep-1 writer
    test above met once in a fresh-clone run: 'step-00000125/manifest.json: no such file or
    directory' from ``verify``). The snapshot is then listed (it was there) or not, never an
    error. Before: the size's second look (a stat after ``is_file``) raised StorageError."""
    import pathlib
    import shutil

    gone = parity_run / "snapshots" / "step-00000001"
    manifest, looked = gone / "manifest.json", []

    def removed_after_the_first_look(real):
        def look(path, *args, **kwargs):
            answer = real(path, *args, **kwargs)
            if path == manifest and not looked:
                looked.append(real.__name__)
                shutil.rmtree(gone)  # removed right after the look found it
            return answer
        return look

    for name in ("is_file", "stat"):
        monkeypatch.setattr(pathlib.Path, name, removed_after_the_first_look(getattr(pathlib.Path, name)))
    steps = Run(parity_run).steps()
    monkeypatch.undo()
    assert looked and steps in ([1, 2, 3, 4], [2, 3, 4]) and not gone.exists(), (looked, steps)


def test_a_listing_that_met_only_a_snapshot_removed_meanwhile_is_taken_again_not_an_empty_run(parity_run, monkeypatch):
    """A local listing is not one request: the directories, then each one's manifest. Between
    the two a keep-1 writer can commit a newer snapshot and remove the one listed, so the run
    looks empty (the racing test above met it: 'no committed snapshot in this run directory'
    from ``Tailor.restore``). A reader then lists again before it calls the run empty. Here the
    first listing names step 2 alone, which retention removed (3 and 4 are the run's)."""
    from llmtailor.store.catalog import Catalog

    run = Run(parity_run)
    apply_retention(run, plan_retention(run, 1))
    assert run.steps() == [3, 4]
    real, stale = Catalog._snapshot_names, []

    def listed_before_the_commit(self):
        if not stale:
            stale.append(True)
            return [(2, "step-00000002")]
        return real(self)

    monkeypatch.setattr(Catalog, "_snapshot_names", listed_before_the_commit)
    with Run(parity_run).reading() as composite:
        assert composite.step == 4
    stale.clear()
    assert Run(parity_run).resolve().step == 4


def test_a_composite_that_lost_a_snapshot_before_its_lease_gives_way_to_the_newest(parity_run):
    run = Run(parity_run)
    apply_retention(run, plan_retention(run, 1))  # removes 1 and 2: the composite of 3 needs 2
    with pytest.raises(SnapshotNotFoundError, match=r"composite of step 3 needs step 2 \(units .*\), which is not in the run; nothing was read"):
        with Run(parity_run).reading(3):
            pass
    with Run(parity_run).reading(3, newest_if_removed=True) as composite:
        assert composite.step == 4
    with pytest.raises(SnapshotNotFoundError, match="no committed snapshot at step 2"):
        with Run(parity_run).reading(2, newest_if_removed=False):
            pass


def test_a_reader_waiting_while_retention_removes_the_snapshot_finds_it_gone(parity_run, monkeypatch):
    """The inode check: a reader that opened the lease file before retention moved the snapshot
    (and waited for its shared lock meanwhile) must not read what is now in the trash."""
    directory = Run(parity_run).snapshot_dir(1)
    claim = lease_for_removal(directory)
    assert claim is not None and claim.held
    opened = threading.Event()
    real_flock = fcntl.flock

    def flock(fd, operation):
        if operation == fcntl.LOCK_SH:
            opened.set()  # the reader holds the lease file open and is about to wait
        return real_flock(fd, operation)

    monkeypatch.setattr(lock.fcntl, "flock", flock)
    found = []
    reader = threading.Thread(target=lambda: found.append(lease_for_reading(directory)))
    reader.start()
    assert opened.wait(300)
    os.rename(directory, parity_run / "moved")
    claim.release()
    reader.join(300)
    assert found == [None]
    # And a reader arriving after the move finds nothing to lease, creating nothing.
    assert lease_for_reading(directory) is None and not directory.exists()


def test_snapshots_written_before_leases_get_one_on_first_use_or_are_read_unprotected(parity_run, monkeypatch):
    for step in range(1, 5):
        (Run(parity_run).snapshot_dir(step) / LEASE_FILE).unlink()
    assert Run(parity_run).verify() == []
    assert all((Run(parity_run).snapshot_dir(s) / LEASE_FILE).is_file() for s in range(1, 5))
    for step in range(1, 5):
        (Run(parity_run).snapshot_dir(step) / LEASE_FILE).unlink()
    real_open = os.open

    def read_only(path, flags, *args):  # a run on storage this reader may not write
        if flags & os.O_CREAT:
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(lock.os, "open", read_only)
    with Run(parity_run).reading() as composite:
        assert composite.step == 4
    assert Tailor(parity_run, *tiny(seed=5)).restore().step == 4
