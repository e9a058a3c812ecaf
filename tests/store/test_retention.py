"""Retention keeps exactly what the newest K composites need, and survives a crash mid-deletion."""

import os

import pytest
from helpers import tiny, train, tree_digest
from typer.testing import CliRunner

from llmtailor import Full, Parity, Run, Tailor
from llmtailor.cli import app
from llmtailor.errors import ConfigError
from llmtailor.store.retention import RetentionOutcome, apply_retention, plan_retention


@pytest.fixture
def parity_run(tmp_path, tokens):
    """Parity saves at steps 1..6: each composite needs its own snapshot and the previous one."""
    model, opt, sched = tiny()
    with Tailor(tmp_path, model, opt, sched, policy=Parity()) as tailor:
        for step in range(1, 7):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    return tmp_path


def test_plan_keeps_what_the_newest_composites_need(parity_run):
    run = Run(parity_run)
    plan = plan_retention(run, 2)
    assert plan.composites == [6, 5] and plan.keep == [4, 5, 6] and plan.delete == [1, 2, 3]
    assert plan_retention(run, 1).keep == [5, 6]
    assert plan_retention(run, 10).delete == []


def test_plan_spares_the_composites_a_promotion_may_read_and_what_they_need(parity_run):
    """A spared composite (``Tiers.committed``: what rank 0's promoter may read) keeps its
    snapshots beside the newest K composites'; one not committed, or kept anyway, spares nothing."""
    run = Run(parity_run)
    plan = plan_retention(run, 1, spare=[3, 9])
    assert plan.keep == [2, 3, 5, 6] and plan.delete == [1, 4] and plan.spared == [2, 3]
    assert plan_retention(run, 2, spare=[5]).spared == [] and plan_retention(run, 2, spare=[5]).delete == [1, 2, 3]


def test_a_retention_plan_lists_the_run_once(parity_run, monkeypatch):
    """One plan, one listing of the snapshots (``Run.listed``): it asked for the steps three times
    (its own list, the lineage, the newest composite), each a listing of the run's directory, after
    every save of a writer with ``keep`` (bench/RESULTS.md, issue 33, session 49)."""
    run = Run(parity_run)
    listings = []
    list_steps = run._list_steps
    monkeypatch.setattr(run, "_list_steps", lambda: listings.append(1) or list_steps())
    assert plan_retention(run, 2).delete == [1, 2, 3]
    assert len(listings) == 1
    assert plan_retention(run, 2).delete == [1, 2, 3] and len(listings) == 2  # the next plan lists afresh


def test_gc_deletes_only_unneeded_snapshots_and_the_rest_restores(parity_run):
    run = Run(parity_run)
    needed = {p: h for p, h in tree_digest(parity_run).items() if p.startswith(("snapshots/step-00000005", "snapshots/step-00000006"))}
    assert apply_retention(run, plan_retention(run, 1)) == RetentionOutcome(deleted=[1, 2, 3, 4])
    assert Run(parity_run).steps() == [5, 6] and Run(parity_run).verify() == []
    assert {p: h for p, h in tree_digest(parity_run).items() if p.startswith("snapshots/")} == needed
    assert Tailor(parity_run, *tiny(seed=4)).restore().step == 6


def test_a_crash_mid_deletion_leaves_kept_composites_whole(parity_run, monkeypatch):
    import shutil

    def crash(path, *args, **kwargs):
        raise KeyboardInterrupt("killed while deleting")

    run = Run(parity_run)
    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        apply_retention(run, plan_retention(run, 1))
    monkeypatch.undo()
    after = Run(parity_run)
    assert after.steps() == [5, 6] and after.verify() == []  # doomed ones left snapshots/ first
    assert os.listdir(parity_run / ".trash")
    # The next writer clears the trash.
    model, opt, sched = tiny()
    tailor = Tailor(parity_run, model, opt, sched, policy=Parity())
    tailor.restore()
    tailor.save(7)
    assert not (parity_run / ".trash").exists()


def test_tailor_keep_applies_retention_after_each_save(tmp_path, tokens):
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), keep=2)
    for step in range(1, 6):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
    assert Run(tmp_path).steps() == [3, 4, 5]
    with pytest.raises(ConfigError, match="keep=0 must be a positive integer"):
        Tailor(tmp_path, model, keep=0)


def test_gc_cli_dry_run_lists_and_deletes_nothing(parity_run):
    runner = CliRunner()
    before = tree_digest(parity_run)
    result = runner.invoke(app, ["gc", str(parity_run), "--keep", "2", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "would delete: 3" in result.output and tree_digest(parity_run) == before
    result = runner.invoke(app, ["gc", str(parity_run), "--keep", "2"])
    assert result.exit_code == 0 and "deleted 3 snapshot(s); kept 3" in result.output
    assert Run(parity_run).steps() == [4, 5, 6]
    bad = runner.invoke(app, ["gc", str(parity_run), "--keep", "0"])
    assert bad.exit_code == 2 and "keep=0" in bad.output and "Traceback" not in bad.output


def test_a_writers_retention_removes_the_discarded_files_after_its_save_returns(tmp_path, tokens, monkeypatch):
    """``Tailor(keep=K)``: the save returns once the old snapshot is discarded (renamed into the
    trash, durably); its files are removed in the background, and ``close`` waits for that."""
    import shutil
    import threading

    real, gate = shutil.rmtree, threading.Event()

    def held_back(path, *args, **kwargs):  # the background removal waits until the test lets it go
        if threading.current_thread().name == "llmtailor-purge":
            gate.wait()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held_back)
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Full(), keep=1)
    for step in (1, 2):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
    assert Run(tmp_path).steps() == [2] and Run(tmp_path).verify() == []
    assert [name.split(".")[0] for name in os.listdir(tmp_path / ".trash")] == ["step-00000001"]
    gate.set()
    tailor.close()
    assert os.listdir(tmp_path / ".trash") == []
    assert Tailor(tmp_path, *tiny(seed=4)).restore().step == 2
