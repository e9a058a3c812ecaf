"""Storage tiers in one process: promotion makes composites whole in the slower tier, each tier
keeps its own retention, restore takes the newest composite of any tier (the faster on a tie)
and says which, a failed promotion is reported and damages nothing (never dropped without a
word), what it left never blocks a later lineage, a full memory tier fails the save clearly and
loses no composite, and a tier that cannot be written fails the writer at its start, leaving
every tier as it was. (Real crashes: tests/e2e/test_tier_crashes.py.)"""

from __future__ import annotations

import errno
import gc
import logging
import re
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise, flip_unit_byte, tiny, train, tree_digest, unit_versions

from llmtailor import Full, Parity, PromotionError, Run, Tailor, TailorConfig, Tier
from llmtailor.constants import CARRIED_FOR, TIERS_FILE
from llmtailor.distributed.coordinator import LocalCoordinator
from llmtailor.errors import ConfigError, TailorError
from llmtailor.store import commit as commit_module
from llmtailor.store.tiers import promote
from llmtailor.store.tiers import runtime as tiers_module
from llmtailor.store.tiers import TierState, read_record, tier_states


def tiered(home, memory, policy=None, seed=0, home_keep=None, **tier):
    model, opt, sched = tiny(seed=seed)
    tailor = Tailor(home, model, opt, sched, policy=policy or Parity(), keep=home_keep, tiers=[Tier(memory, **tier)])
    return tailor, model, opt, sched


def save_steps(tailor, model, opt, sched, tokens, steps, settle=True):
    for step in steps:
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
        if settle:
            tailor.wait(promoted=True)  # a known cadence: each promotion done before the next save


def test_promoted_composites_are_whole_in_the_slower_tier(tmp_path, tokens):
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, keep=None, promote_every=3)  # every snapshot kept in both
    save_steps(tailor, model, opt, sched, tokens, range(1, 9))
    on_disk, in_memory = Run(home), Run(memory)
    # 1 (the first), 4 (3 steps on) and 7; each Parity composite needs the step before it too.
    assert on_disk.steps() == [1, 3, 4, 6, 7] and on_disk.latest_step() == 7
    assert [on_disk.manifest(s).parent for s in on_disk.steps()] == [None, None, 1, None, 4]
    assert on_disk.manifest(6).notes[CARRIED_FOR] == 7 and CARRIED_FOR not in on_disk.manifest(7).notes
    for step in on_disk.steps():  # the same snapshots: every file equal, manifests but for the links
        assert on_disk.stored_files(step) == in_memory.stored_files(step)
        assert on_disk.manifest(step).composite == in_memory.manifest(step).composite
    check = on_disk.check()
    assert check.problems == [] and check.notes == []  # a carrier's own composite is not missed
    tailor.close()  # promotes the last save whatever the cadence
    assert Run(home).latest_step() == 8
    assert read_record(Run(home)) == read_record(Run(memory)) == [
        {"location": str(memory), "keep": None, "promote_every": 3, "max_lag": 30},  # the default: 10 intervals
        {"location": str(home), "keep": None, "promote_every": None, "max_lag": None},
    ]

    restored = {}
    for where in ("memory", "disk"):
        if where == "disk":
            shutil.rmtree(memory)  # the node is lost
        other, model2, opt2, _ = tiered(home, memory, seed=7, promote_every=3)
        report = other.restore()
        assert report.step == 8 and report.tier == str(memory if where == "memory" else home)
        restored[where] = unit_versions(model2, opt2)
        other.close()
    assert_bitwise(restored["disk"], restored["memory"])


def test_each_tier_keeps_its_own_composites_and_what_they_need(tmp_path, tokens):
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, home_keep=2, keep=2, promote_every=3)
    save_steps(tailor, model, opt, sched, tokens, range(1, 12))
    assert Run(memory).steps() == [9, 10, 11]  # its 2 newest composites need 9, 10, 11
    assert Run(home).steps() == [6, 7, 9, 10]  # composites 10 and 7, with their carriers
    tailor.close()
    assert Run(home).steps() == [9, 10, 11] and Run(home).verify() == []


def test_restore_prefers_the_faster_tier_and_passes_over_an_incomplete_composite(tmp_path, tokens):
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, promote_every=1)
    save_steps(tailor, model, opt, sched, tokens, range(1, 5))
    tailor.close()
    assert Run(home).latest_step() == Run(memory).latest_step() == 4
    other, *_ = tiered(home, memory, seed=3)
    assert other.restore().tier == str(memory)  # a tie: the faster tier
    other.close()

    shutil.rmtree(Run(memory).snapshot_dir(3))  # the memory tier's composite of 4 lost what it needs
    other, model2, opt2, sched2 = tiered(home, memory, seed=3)
    report = other.restore()
    assert (report.step, report.tier) == (4, str(home))
    train(model2, opt2, sched2, tokens, [5])
    assert len(other.save(5).units) == len(other.layout.units)  # the memory tier lacks step 3: a full save
    other.close()
    assert Run(memory).verify() == [] and Run(home).latest_step() == 5


def test_restore_of_a_step_reads_the_fastest_tier_holding_it(tmp_path, tokens):
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, keep=1, promote_every=2)
    save_steps(tailor, model, opt, sched, tokens, range(1, 7))
    tailor.close()
    assert Run(memory).steps() == [5, 6] and Run(home).steps() == [1, 2, 3, 4, 5, 6]
    other, *_ = tiered(home, memory, seed=3)
    # the composite of 5 needs 4 too, which only the run directory holds
    assert (other.restore(5).tier, other.restore(1).tier, other.restore(6).tier) == (str(home), str(home), str(memory))
    with pytest.raises(TailorError, match="no tier holds the composite of step 7"):
        other.restore(7)
    other.close()


def test_a_failed_promotion_is_retried_reported_once_and_damages_nothing(tmp_path, tokens, monkeypatch):
    home, memory = tmp_path / "home", tmp_path / "memory"
    monkeypatch.setattr(promote, "RETRY_WAIT", 0.01)
    copy_file, calls = promote.copy_file, []

    def failing(source, key, sink, entry):
        calls.append(key)
        if len(calls) > 1:  # the first promotion's first file only goes through
            raise OSError(errno.EIO, "Input/output error")
        copy_file(source, key, sink, entry)

    monkeypatch.setattr(promote, "copy_file", failing)
    tailor, model, opt, sched = tiered(home, memory, promote_every=1, policy=Full())
    save_steps(tailor, model, opt, sched, tokens, [1], settle=False)
    tailor.tiers.wait_promotions()  # waits, reports nothing (wait(promoted=True) would raise)
    assert Run(home).steps() == []
    train(model, opt, sched, tokens, [2])
    with pytest.raises(PromotionError, match=r"promoting step 1 from .*memory to .*home failed 3 times .*both tiers are intact"):
        tailor.save(2)  # reported before anything of step 2 is written
    assert Run(memory).latest_step() == 1 and Run(memory).verify() == []
    assert Run(home).steps() == [] and not any((home / ".tmp").iterdir())
    monkeypatch.setattr(promote, "copy_file", copy_file)
    tailor.save(2)  # reported once; the next promotion goes through
    expected = unit_versions(model, opt)
    tailor.close()
    assert Run(home).latest_step() == 2 and Run(home).verify() == []
    shutil.rmtree(memory)
    other, model2, opt2, _ = tiered(home, memory, seed=3, policy=Full())
    assert other.restore().tier == str(home)
    assert_bitwise(unit_versions(model2, opt2), expected)
    other.close()


def test_a_full_memory_tier_fails_the_save_clearly_and_keeps_every_composite(small_fs, tmp_path, tokens):
    home, memory = tmp_path / "home", small_fs / "memory"
    model, opt, sched = tiny()
    tailor = Tailor(home, model, opt, sched, policy=Full(), tiers=[Tier(memory, keep=None, promote_every=1)])
    saved, expected = [], None
    with pytest.raises(TailorError, match=r"no space left on the device of .*memory while saving step \d+; the partial "
                                          r"snapshot was removed and earlier snapshots are intact"):
        for step in range(1, 40):
            train(model, opt, sched, tokens, [step])
            expected = unit_versions(model, opt)
            tailor.save(step)
            saved.append(step)
    assert len(saved) >= 2 and Run(memory).latest_step() == saved[-1] and Run(memory).verify() == []
    tailor.wait(promoted=True)
    assert Run(home).latest_step() == saved[-1]
    model2, opt2, sched2 = tiny(seed=3)
    other = Tailor(home, model2, opt2, sched2, policy=Full(), tiers=[Tier(memory, keep=None)], read_only=True)
    assert other.restore().step == saved[-1]
    live = unit_versions(model2, opt2)
    assert not all(torch.equal(live[n]["weight"], expected[n]["weight"]) for n in live)  # the failed step's state is not there
    tailor.close()


def test_tiers_are_declared_and_checked(tmp_path):
    model, opt, sched = tiny()
    with pytest.raises(ConfigError, match="tiers name one location twice"):
        TailorConfig.of(tiers=[Tier(tmp_path / "a"), Tier(tmp_path / "a")])
    with pytest.raises(ConfigError, match="are one location: every tier needs its own"):
        Tailor(tmp_path / "home", model, opt, sched, tiers=[Tier(tmp_path / "home")])
    with pytest.raises(ConfigError, match="promote_every=0 must be a positive number of steps"):
        Tier(tmp_path / "a", promote_every=0)
    with pytest.raises(ConfigError, match="tiers must be a list of llmtailor.Tier"):
        TailorConfig.of(tiers=[str(tmp_path / "a")])
    tailor = Tailor(tmp_path / "home", model, opt, sched, config=TailorConfig(tiers=[Tier(tmp_path / "m", keep=None)]))
    assert (tmp_path / "m" / TIERS_FILE).is_file() and (tmp_path / "home" / TIERS_FILE).is_file()
    tailor.close()


def test_inspect_shows_every_tier_and_gc_keeps_each_tiers_own_number(tmp_path, tokens):
    from typer.testing import CliRunner

    from llmtailor.cli import app

    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, keep=None, promote_every=2)
    save_steps(tailor, model, opt, sched, tokens, range(1, 7))
    tailor.close()
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(home)], env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    assert max(len(line) for line in shown.output.splitlines()) <= 80
    assert "tiers, fastest first" in shown.output and "every 2" in shown.output and "*" in shown.output
    assert "0 of 20" in shown.output  # the run directory's lag behind memory, and its bound
    assert tier_states(Run(home)) == [
        TierState(str(memory), None, 2, list(range(1, 7)), 6, max_lag=20),
        TierState(str(home), None, None, [1, 2, 3, 4, 5, 6], 6, here=True, lag=0),  # 1, 3 (+2), 5 (+4), 6 at close
    ]

    assert runner.invoke(app, ["gc", str(memory)]).exit_code == 0  # memory keeps all; home keeps all
    assert Run(memory).steps() == list(range(1, 7))
    collected = runner.invoke(app, ["gc", str(memory), "--keep", "1"])
    assert collected.exit_code == 0 and Run(memory).steps() == [5, 6] and Run(home).steps() == list(range(1, 7))
    shutil.rmtree(Run(home).snapshot_dir(6))  # as if the promotion of 6 had not happened yet
    lagging = runner.invoke(app, ["inspect", str(home)], env={"COLUMNS": "80"})
    assert "1 of 20" in lagging.output and max(len(line) for line in lagging.output.splitlines()) <= 80
    assert [state.lag for state in tier_states(Run(home))] == [None, 1]
    shutil.rmtree(memory)
    shown = runner.invoke(app, ["inspect", str(home)], env={"COLUMNS": "80"})
    assert shown.exit_code == 0 and "not here" in shown.output
    plain = tmp_path / "plain"
    Tailor(plain, *tiny()).close()
    refused = runner.invoke(app, ["gc", str(plain)])
    assert refused.exit_code == 2 and "records no tiers: give --keep" in refused.output


def test_a_tier_some_rank_cannot_see_fails_the_writer_on_every_rank(tmp_path):
    """Rank 0 records the tiers with a fresh token; a rank that does not find it (its node's
    /dev/shm is another directory) makes the Tailor fail everywhere, naming the tier."""
    from llmtailor.distributed.coordinator import LocalCoordinator
    from llmtailor.store.tiers import Tiers

    class TwoRanks(LocalCoordinator):
        world_size = 2

        def exchange(self, tag, value):
            return [value, [str(tmp_path / "memory")]]  # rank 1, on another node, saw no record there

    tiers = Tiers(tmp_path / "home", [Tier(tmp_path / "memory")])
    with pytest.raises(ConfigError, match=r"rank 1 cannot see .*memory \(node-local storage on another node\?\)"):
        tiers.open_for_writing(TwoRanks())
    tiers.close(LocalCoordinator())
    seeing = Tiers(tmp_path / "home", [Tier(tmp_path / "memory")])
    seeing.open_for_writing(type("Seeing", (LocalCoordinator,), {"world_size": 2, "exchange": lambda s, t, v: [v, v]})())
    seeing.close(LocalCoordinator())


def test_restore_with_fallback_takes_the_newest_composite_that_verifies_in_any_tier(tmp_path, tokens):
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, keep=1, promote_every=1)
    save_steps(tailor, model, opt, sched, tokens, range(1, 7))
    tailor.close()
    flip_unit_byte(memory, 6, "layer.1")  # in the pack file the tiny model's units share
    other, *_ = tiered(home, memory, seed=3)
    report = other.restore(fallback=True)
    assert (report.step, report.tier) == (6, str(home))
    assert list(report.skipped) == [6] and report.skipped[6].startswith(f"{memory}: ")  # what was passed over, where
    other.close()


def test_after_restoring_an_older_step_promotions_extend_that_lineage_in_every_tier(tmp_path, tokens):
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, keep=None, promote_every=1)
    save_steps(tailor, model, opt, sched, tokens, range(1, 7))
    tailor.close()
    other, model2, opt2, sched2 = tiered(home, memory, seed=3, keep=None, promote_every=1)
    assert other.restore(3).tier == str(memory)  # rolled back: 4..6 are a branch left behind
    save_steps(other, model2, opt2, sched2, tokens, [7, 8])
    other.close()
    for tier in (memory, home):
        assert [Run(tier).manifest(s).parent for s in (7, 8)] == [3, 7]
        assert list(Run(tier).lineage()) == [8, 7, 3, 2, 1]


def test_after_restoring_an_older_step_from_a_slower_tier_no_save_takes_a_step_the_lineage_left_holds(tmp_path, tokens):
    """The memory tier keeps one composite (4, and 3 it needs); step 1 is restored from the run
    directory, so 2 to 4 are a lineage left behind, and memory's 3 names 2 as its parent. A save
    of 2 committed there was then taken for 3's parent: 4 stayed the tier's newest, retention
    removed the new 2 at once and its promotion was skipped, with no error. A step at or below
    the newest any tier holds is refused before anything is written; one after it extends 1."""
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, keep=1, promote_every=1)
    save_steps(tailor, model, opt, sched, tokens, range(1, 5))
    assert Run(memory).steps() == [3, 4] and Run(home).steps() == [1, 2, 3, 4]
    assert tailor.restore(1).tier == str(home)
    before = {tier: tree_digest(tier) for tier in (memory, home)}
    train(model, opt, sched, tokens, [2])
    for step in (2, 4):
        with pytest.raises(ConfigError, match=f"step {step} is not after step 4, the newest snapshot of this run"):
            tailor.save(step)
    assert {tier: tree_digest(tier) for tier in (memory, home)} == before
    save_steps(tailor, model, opt, sched, tokens, [5])
    tailor.close()
    for tier in (memory, home):
        assert Run(tier).latest_step() == 5 and Run(tier).manifest(5).parent == 1
    other, *_ = tiered(home, memory, seed=3, keep=1, promote_every=1)
    assert other.restore().step == 5
    other.close()


def test_one_tier_after_restoring_an_older_step_no_save_takes_a_step_the_lineage_left_holds(tmp_path, tokens):
    model, opt, sched = tiny()
    with Tailor(tmp_path / "run", model, opt, sched, policy=Parity(), keep=None) as tailor:
        save_steps(tailor, model, opt, sched, tokens, range(1, 5))
        tailor.restore(2)
        with pytest.raises(ConfigError, match="step 3 is not after step 4"):
            tailor.save(3)
        save_steps(tailor, model, opt, sched, tokens, [5])
    assert Run(tmp_path / "run").latest_step() == 5 and list(Run(tmp_path / "run").lineage()) == [5, 2, 1]


def test_a_lagging_promoter_skips_to_the_newest_composite_while_retention_moves_on(tmp_path, tokens, monkeypatch, caplog):
    """A promotion slower than the saves, in a memory tier keeping one composite: while the
    promotion of step 2 is held, steps 3 to 6 are saved and (but for the one being read) removed;
    the next promotion takes the newest, 6, and skipping the others is said nowhere: it is how
    promotion works. Every composite promoted is whole in the run directory. (It slowed each
    file copy and hoped that the saves outran it; on a busy machine they did not.)"""
    home, memory = tmp_path / "home", tmp_path / "memory"
    copying, go = threading.Event(), threading.Event()
    copy_file = promote.copy_file

    def held(source, key, sink, entry):
        if "step-00000002" in key:
            copying.set()
            go.wait(120)
        copy_file(source, key, sink, entry)

    monkeypatch.setattr(promote, "copy_file", held)
    tailor, model, opt, sched = tiered(home, memory, keep=1, promote_every=1)
    save_steps(tailor, model, opt, sched, tokens, [1])
    save_steps(tailor, model, opt, sched, tokens, [2], settle=False)
    assert copying.wait(120)  # the promotion of step 2 is in flight
    save_steps(tailor, model, opt, sched, tokens, range(3, 7), settle=False)
    assert Run(memory).steps() == [1, 2, 5, 6]  # the composite of 2 is being read; that of 6 needs 5 (Parity)
    go.set()
    tailor.close()  # raises a promotion failure, if any
    assert [p.step for p in tailor.tiers.promotions] == [1, 2, 6]  # skipped, never queued
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    on_disk = Run(home)
    assert on_disk.verify() == [] and on_disk.steps() == [1, 2, 5, 6]
    for step in (1, 2, 6):
        with on_disk.reading(step):  # each whole: every snapshot it needs is there
            pass


def test_close_removes_what_retention_passed_over_while_the_promoter_read_it(tmp_path, tokens, monkeypatch):
    """Retention at a save passes over the snapshots the promoter is reading (its lease); once
    close() has drained the promoter, each tier keeps exactly its newest ``keep`` composites,
    whatever the promoter's pace, and the last one is promoted first. Events only: the
    promotion of step 2 is held while steps 3 and 4 are saved."""
    home, memory = tmp_path / "home", tmp_path / "memory"
    copying, go = threading.Event(), threading.Event()
    copy_file = promote.copy_file

    def held(source, key, sink, entry):
        if "step-00000002" in key and not go.is_set():
            copying.set()
            go.wait(120)
        copy_file(source, key, sink, entry)

    monkeypatch.setattr(promote, "copy_file", held)
    tailor, model, opt, sched = tiered(home, memory, home_keep=1, keep=1, promote_every=1)
    save_steps(tailor, model, opt, sched, tokens, [1])
    save_steps(tailor, model, opt, sched, tokens, [2], settle=False)
    assert copying.wait(120)  # the promotion of step 2 holds the composite of 2 (1 and 2: Parity)
    save_steps(tailor, model, opt, sched, tokens, [3, 4], settle=False)
    assert Run(memory).steps() == [1, 2, 3, 4]  # 1 and 2 passed over: being read
    go.set()
    tailor.close()
    assert tailor.tiers.promotions[-1].step == 4
    assert Run(memory).steps() == [3, 4]  # the composite of 4 needs 3 (Parity): nothing else stays
    on_disk = Run(home)
    assert on_disk.steps() == [3, 4] and on_disk.latest_step() == 4 and on_disk.verify() == []


def test_a_tier_that_does_not_answer_is_an_error_but_fallback_restores_from_the_others(tmp_path, tokens, monkeypatch):
    """A script must not start afresh because its durable store did not answer: latest_step()
    and restore() raise; restore(fallback=True) takes what the memory tier holds and says why."""
    pytest.importorskip("obstore")
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    home, memory = tmp_path / "home", tmp_path / "memory"
    tailor, model, opt, sched = tiered(home, memory, keep=None, promote_every=1)
    save_steps(tailor, model, opt, sched, tokens, range(1, 4))
    tailor.close()
    dead = {"endpoint": "http://127.0.0.1:9", "allow_http": "true", "region": "us-east-1", "access_key_id": "k",
            "secret_access_key": "s", "retry_config": {"max_retries": 0, "retry_timeout": 1}}
    model2, opt2, sched2 = tiny(seed=3)
    reader = Tailor("s3://unreachable/run", model2, opt2, sched2, read_only=True,
                    tiers=[Tier(memory), Tier("s3://unreachable/durable", storage_options=dead)], storage_options=dead)
    with pytest.raises(TailorError, match="127.0.0.1:9"):
        reader.latest_step()
    with pytest.raises(TailorError, match="127.0.0.1:9"):
        reader.restore()
    report = reader.restore(fallback=True)
    assert (report.step, report.tier) == (3, str(memory))
    assert "s3://unreachable/durable could not be read" in report.skipped[3]
    reader.close()


def test_an_unexpected_error_in_the_promoter_is_reported_and_promotion_goes_on(tmp_path, tokens, monkeypatch):
    """A bug in the background (here: retention after a promotion raising) must not leave a dead
    promoter that silently never promotes again."""
    home, memory = tmp_path / "home", tmp_path / "memory"
    retain, calls = promote.retain_after_commit, []

    def broken(run, keep, where):
        calls.append(where)
        if len(calls) == 1:
            raise RuntimeError("boom")
        retain(run, keep, where)

    monkeypatch.setattr(promote, "retain_after_commit", broken)
    tailor, model, opt, sched = tiered(home, memory, home_keep=1, keep=1, promote_every=1)
    train(model, opt, sched, tokens, [1])
    tailor.save(1)
    with pytest.raises(PromotionError, match="RuntimeError: boom"):
        tailor.wait(promoted=True)
    save_steps(tailor, model, opt, sched, tokens, [2, 3])
    tailor.close()
    assert [p.step for p in tailor.tiers.promotions] == [1, 2, 3] and Run(home).latest_step() == 3


def test_a_carrier_whose_composite_never_landed_does_not_block_a_later_lineage(tmp_path, tokens, monkeypatch, caplog):
    """The promotion of step 4 fails once its carrier (step 3) committed in the run directory;
    the node is lost (the memory tier wiped); the next writer restores step 1 from the run
    directory and trains on, and the promotion of its step 4 needs its own step 3. That failed
    3 times ("is another snapshot of step 3 ... it is not replaced"). The next writer removes
    the stray carrier when it starts; one it did not remove is replaced by the promotion."""
    home, memory = tmp_path / "home", tmp_path / "memory"
    caplog.set_level(logging.INFO, logger="llmtailor.store.tiers.promote")
    monkeypatch.setattr(promote, "RETRY_WAIT", 0.0)
    copy_snapshot = promote._copy_snapshot

    def failing_composite(source, target, step, composite, parent):
        if step == composite == 4:
            raise OSError(errno.EIO, "Input/output error")
        copy_snapshot(source, target, step, composite, parent)

    monkeypatch.setattr(promote, "_copy_snapshot", failing_composite)
    tailor, model, opt, sched = tiered(home, memory, promote_every=3)
    save_steps(tailor, model, opt, sched, tokens, [1, 2, 3])
    with pytest.raises(PromotionError, match="promoting step 4 .* failed 3 times"):
        save_steps(tailor, model, opt, sched, tokens, [4])
    with pytest.raises(PromotionError, match="promoting step 4 .* failed 3 times"):
        tailor.close()  # tries step 4 once more
    monkeypatch.setattr(promote, "_copy_snapshot", copy_snapshot)
    assert Run(home).steps() == [1, 3] and Run(home).manifest(3).notes[CARRIED_FOR] == 4
    shutil.rmtree(memory)  # the node is lost
    untouched = tmp_path / "home-copy"
    shutil.copytree(home, untouched)

    resumed = {}
    for run_dir, clears in ((home, True), (untouched, False)):
        if not clears:  # the carrier stays at the start: the promotion that needs its step replaces it
            monkeypatch.setattr(tiers_module, "clear_stray_carriers", lambda run: [])
        other, model2, opt2, sched2 = tiered(run_dir, tmp_path / f"memory-{run_dir.name}", promote_every=3)
        assert Run(run_dir).steps() == ([1] if clears else [1, 3])
        assert other.restore().tier == str(run_dir)
        save_steps(other, model2, opt2, sched2, tokens, [2, 3, 4])
        other.close()
        assert [p.step for p in other.tiers.promotions] == [4]
        on_disk = Run(run_dir)
        assert on_disk.steps() == [1, 3, 4] and on_disk.verify() == [] and list(on_disk.lineage()) == [4, 1]
        assert on_disk.manifest(3).notes[CARRIED_FOR] == 4
        resumed[clears] = {step: on_disk.stored_files(step) for step in (3, 4)}
    assert resumed[True] == resumed[False]  # the same snapshots, this lineage's
    assert "a carrier no composite there needs" in caplog.text


@pytest.mark.parametrize("newer_fails", [False, True])
def test_a_promotion_whose_composite_left_while_it_waited_to_retry_is_never_dropped_silently(
        tmp_path, tokens, monkeypatch, caplog, newer_fails):
    """Its first try fails; while it waits to try again, the memory tier (keep=1) commits a newer
    composite and removes that one. The promotion was dropped without a word; now the newer
    composite is promoted in its place at once, and the Promotion names the one it superseded
    and why (the log too); where the newer one fails as well, the PromotionError names both."""
    home, memory = tmp_path / "home", tmp_path / "memory"
    waiting, go = threading.Event(), threading.Event()

    def held(seconds):
        waiting.set()
        go.wait(120)

    monkeypatch.setattr(promote, "_pause_before_retry", held)
    copy_file, failed = promote.copy_file, []

    def failing(source, key, sink, entry):
        if "step-00000002" in key and not failed or newer_fails and "step-00000003" in key:
            failed.append(key)
            raise OSError(errno.EIO, "Input/output error")
        copy_file(source, key, sink, entry)

    monkeypatch.setattr(promote, "copy_file", failing)
    tailor, model, opt, sched = tiered(home, memory, keep=1, promote_every=1, policy=Full())
    save_steps(tailor, model, opt, sched, tokens, [1])
    save_steps(tailor, model, opt, sched, tokens, [2], settle=False)
    assert waiting.wait(120)  # its promotion failed once and waits to try again
    save_steps(tailor, model, opt, sched, tokens, [3], settle=False)
    assert Run(memory).steps() == [3]  # the memory tier's retention removed step 2
    go.set()
    try:
        tailor.wait(promoted=True)
    except PromotionError as err:
        failure = str(err)
    else:
        failure = None
    assert "promoting step 2 from" in caplog.text and "so step 3, its newest composite, is promoted in its place" in caplog.text
    if newer_fails:
        assert re.match(r"promoting step 3 from .*memory to .*home failed 3 times \(step 2: Input/output error; "
                        r"step 3: Input/output error\)", failure or "")
        assert [p.step for p in tailor.tiers.promotions] == [1]
    else:
        assert failure is None and [p.step for p in tailor.tiers.promotions] == [1, 3]
        assert tailor.tiers.promotions[-1].superseded == {2: "Input/output error"}
    monkeypatch.setattr(promote, "copy_file", copy_file)
    tailor.close()
    assert Run(home).steps() == [1, 3] and Run(home).verify() == []


@pytest.fixture
def read_only_dir(small_fs):
    """A directory on a file system mounted read-only (root may not write there either)."""
    (small_fs / "tier").mkdir()
    result = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {result.stderr.strip()}")
    return small_fs / "tier"


def test_a_tier_that_cannot_be_written_fails_the_writer_at_once_and_leaves_every_tier_as_it_was(tmp_path, read_only_dir):
    """A run directory or memory tier that cannot be written (read-only, under /sys or /proc, under
    a file) was a raw FileNotFoundError naming `.tiers.json.PID.tmp` with a record left in the
    memory tier naming a tier that is not there, or accepted until the first save; a failed start
    left a `.lock`. Now: a ConfigError naming the path and why, and nothing written anywhere."""
    (tmp_path / "a-file").write_text("not a directory")
    home, memory = tmp_path / "home", tmp_path / "memory"
    earlier = Tailor(home, *tiny(), tiers=[Tier(memory)])  # an existing run: its record and locks stay as they are
    earlier.close()
    found = tree_digest(tmp_path)
    in_sys, in_proc = (Path(f"/{top}/llmtailor-{uuid.uuid4().hex[:8]}") for top in ("sys/kernel", "proc"))
    unwritable = {  # where -> the path the message names, and why
        read_only_dir: (read_only_dir / ".lock", "read-only file system"),
        in_sys: (in_sys, "operation not permitted"),
        in_proc / "tier": (in_proc, "no such file or directory"),
        tmp_path / "a-file" / "tier": (tmp_path / "a-file" / "tier", "a part of the path is a file, not a directory"),
    }
    for where, (named, why) in unwritable.items():
        for run_dir, tiers in ((where, [Tier(memory)]), (home, [Tier(where)]), (home, [Tier(memory), Tier(where)]),
                               (tmp_path / "new-home", [Tier(tmp_path / "new-memory"), Tier(where)])):
            with pytest.raises(ConfigError, match=rf"^cannot write to the run: {re.escape(str(named))}: {why} \(a tier "
                                                  r"of this writer, which saves to every tier"):
                Tailor(run_dir, *tiny(), tiers=tiers)
            assert tree_digest(tmp_path) == found and not (tmp_path / "new-home").exists()
            assert not (tmp_path / "new-memory").exists()
    assert read_record(Run(memory)) == read_record(Run(home)) == [
        {"location": str(memory), "keep": 2, "promote_every": 1, "max_lag": 10},
        {"location": str(home), "keep": None, "promote_every": None, "max_lag": None}]
    reader = Tailor(read_only_dir, *tiny(), tiers=[Tier(memory)], read_only=True)  # a reader writes nothing: no check
    reader.close()


def test_a_record_that_cannot_be_written_is_put_back_everywhere(tmp_path, monkeypatch):
    """Each tier's tiers.json is replaced only once every lock is taken; one that fails (here:
    the disk full at the run directory's) puts back those written before it."""
    from llmtailor.store.storage.local import LocalStorage

    home, memory = tmp_path / "home", tmp_path / "memory"
    Tailor(home, *tiny(), tiers=[Tier(memory)]).close()
    before = tree_digest(tmp_path)
    replace = LocalStorage.replace

    def full_at_home(storage, key, data):
        if key == TIERS_FILE and storage.root.name.endswith("home"):  # the last tier: every other one written first
            raise OSError(errno.ENOSPC, "No space left on device", str(storage.root / f".{TIERS_FILE}.1.tmp"))
        replace(storage, key, data)

    monkeypatch.setattr(LocalStorage, "replace", full_at_home)
    with pytest.raises(ConfigError, match=rf"^cannot record the tiers in tier {home}: {home}/{TIERS_FILE}: no space left"):
        Tailor(home, *tiny(), tiers=[Tier(memory, keep=5)])
    assert tree_digest(tmp_path) == before
    with pytest.raises(ConfigError, match="cannot record the tiers"):
        Tailor(tmp_path / "new-home", *tiny(), tiers=[Tier(tmp_path / "new-memory")])
    assert not (tmp_path / "new-home").exists() and not (tmp_path / "new-memory").exists()


def test_a_save_waits_while_the_next_tier_is_more_than_max_lag_behind(tmp_path, tokens, monkeypatch, caplog):
    """max_lag=2: while the promotion of step 2 is held, saves 3 and 4 go on (the run directory
    then 1 and 2 steps behind); save 5 (3 behind) says it waits and writes nothing until that
    promotion has committed, then goes on. Events only: the promotion is released once the save
    says it waits (or once it returned without waiting: the failure this test is for)."""
    home, memory = tmp_path / "home", tmp_path / "memory"
    copying, go, waiting, order = threading.Event(), threading.Event(), threading.Event(), []
    copy_file, promote_composite, begin = promote.copy_file, promote.promote, commit_module.SnapshotCommit.begin.__func__

    def held(source, key, sink, entry):
        if "step-00000002" in key:
            copying.set()
            go.wait(120)
        copy_file(source, key, sink, entry)

    def promoted(source, target, step, parent):
        done = promote_composite(source, target, step, parent)
        order.append(("promoted", step))
        return done

    def begun(cls, run, step, *args):
        order.append(("begun", Path(run.root).name, step))
        return begin(cls, run, step, *args)

    class Said(logging.Handler):
        def emit(self, record):
            if "max_lag" in record.getMessage():
                waiting.set()

    monkeypatch.setattr(promote, "copy_file", held)
    monkeypatch.setattr(promote, "promote", promoted)
    monkeypatch.setattr(commit_module.SnapshotCommit, "begin", classmethod(begun))
    caplog.set_level(logging.INFO, logger="llmtailor")
    logging.getLogger("llmtailor").addHandler(said := Said())
    try:
        tailor, model, opt, sched = tiered(home, memory, keep=None, promote_every=1, max_lag=2)
        save_steps(tailor, model, opt, sched, tokens, [1])
        save_steps(tailor, model, opt, sched, tokens, [2], settle=False)
        assert copying.wait(120)  # the promotion of step 2 is in flight, held
        save_steps(tailor, model, opt, sched, tokens, [3, 4], settle=False)  # 1, then 2 steps behind: no wait
        train(model, opt, sched, tokens, [5])
        saving = threading.Thread(target=tailor.save, args=(5,))
        saving.start()
        while not waiting.wait(0.05) and saving.is_alive():
            pass
        assert waiting.is_set(), "save(5) returned without waiting for the run directory, 3 steps behind"
        assert ("begun", "memory", 5) not in order and Run(memory).latest_step() == 4
        go.set()
        saving.join(120)
        assert not saving.is_alive()
    finally:
        go.set()
        logging.getLogger("llmtailor").removeHandler(said)
    assert order.index(("promoted", 2)) < order.index(("begun", "memory", 5))
    tailor.close()
    assert Run(home).latest_step() == 5 and Run(home).verify() == [] and Run(memory).verify() == []


def test_a_save_with_tiers_sends_the_messages_of_a_save_without(tmp_path, tokens, monkeypatch):
    """A promotion failure rides on the save's own first message (issue 33): a save with tiers
    sends no message a save without them does not (a failure is raised on every rank all the
    same: test_a_promotion_failure_reaches_every_rank_as_itself)."""
    sent = []
    for name in ("broadcast", "gather", "exchange"):
        def counted(self, tag, *args, _method=getattr(LocalCoordinator, name), **kwargs):
            sent.append(tag.split("/", 1)[1])  # the round's number apart
            return _method(self, tag, *args, **kwargs)
        monkeypatch.setattr(LocalCoordinator, name, counted)

    def messages_of_a_save(home, tiers):
        model, opt, sched = tiny()
        with Tailor(home, model, opt, sched, policy=Full(), tiers=tiers) as tailor:
            save_steps(tailor, model, opt, sched, tokens, [1])
            sent.clear()
            train(model, opt, sched, tokens, [2])
            tailor.save(2)
            return list(sent)

    plain = messages_of_a_save(tmp_path / "plain", [])
    assert plain and messages_of_a_save(tmp_path / "home", [Tier(tmp_path / "memory")]) == plain


def test_a_node_local_tier_is_declared_with_its_replicas_and_jump_every_problem_in_one_error(tmp_path):
    node = Tier(tmp_path / "shm", scope="node", replicas=2, jump=3)
    assert (node.scope, node.replicas, node.jump) == ("node", 2, 3)
    plain = Tier(tmp_path / "shm")
    assert (plain.scope, plain.replicas, plain.jump) == ("shared", 1, 1)
    with pytest.raises(ConfigError, match=r"key 'scope'.*'node' or 'shared'.*key 'replicas': replicas=0 must be.*"
                                          r"key 'jump': jump=-1 must be"):
        Tier(tmp_path / "shm", scope="rack", replicas=0, jump=-1)
    with pytest.raises(ConfigError, match=r"s3://b/x: a node-local tier \(scope='node'\) is a local path"):
        Tier("s3://b/x", scope="node")
    with pytest.raises(ConfigError, match=r"replicas=2 and jump=2 need scope='node'"):
        Tier(tmp_path / "shm", replicas=2, jump=2)
    with pytest.raises(ConfigError, match=r"only the first tier may be node-local \(scope='node'\), not \['.*disk'\]"):
        TailorConfig.of(tiers=[Tier(tmp_path / "shm"), Tier(tmp_path / "disk", scope="node")])


def test_a_tailor_dropped_without_close_lets_its_tiers_go_and_the_next_one_of_the_process_saves(tmp_path, tokens):
    """A notebook or a sweep: a Tailor with a tier saves and is dropped without ``close()``, then
    another of the same run, in the same process, resumes and saves. The dropped one's locks went
    with it, and the exit keeps nothing of it (``runtime._UNCLOSED``: nothing to finish for another
    node). Before, the exit kept its promoter, whose tiers held the locks: the next Tailor's save
    was refused ("being written by another writer (..., another Tailor of this process)"), and each
    dropped writer stayed in memory until the interpreter exited."""
    home, memory = tmp_path / "home", tmp_path / "memory"
    kept = len(tiers_module._UNCLOSED)
    for step in (1, 2, 3):
        tailor, model, opt, sched = tiered(home, memory, keep=None)
        if step > 1:
            assert tailor.restore().step == step - 1
        save_steps(tailor, model, opt, sched, tokens, [step])
        del tailor
        gc.collect()
    assert Run(home).steps() == Run(memory).steps() == [1, 2, 3]
    assert Run(home).verify() == []
    assert len(tiers_module._UNCLOSED) == kept


def _close_interrupted(tmp_path, tokens, monkeypatch, wait):
    """A tiered Tailor saves steps 1 and 2 and closes while the promotion of step 2 is held at its
    start: Ctrl-C while ``close()`` waits for the last promotion (a KeyboardInterrupt out of
    ``Promoter.finish``), then its wait for the promotion in flight is ``wait(promoter, go,
    real_wait)`` (``go`` lets the promotion go on). Returns the Tailor once ``close`` raised."""
    tailor, model, opt, sched = tiered(tmp_path / "home", tmp_path / "memory", keep=None)
    save_steps(tailor, model, opt, sched, tokens, [1])
    started, go, real, real_wait = threading.Event(), threading.Event(), promote.promote, promote.Promoter.wait

    def held(*args, **kwargs):
        started.set()
        go.wait()
        return real(*args, **kwargs)

    def interrupted(self) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(promote, "promote", held)
    monkeypatch.setattr(promote.Promoter, "finish", interrupted)
    monkeypatch.setattr(promote.Promoter, "wait", lambda self: wait(self, go, real_wait))
    save_steps(tailor, model, opt, sched, tokens, [2], settle=False)
    try:
        assert started.wait(120)  # a bound on a hang: the promotion of step 2 is in flight
        with pytest.raises(KeyboardInterrupt):
            tailor.close()
    finally:
        go.set()  # a failed test leaves no thread waiting
    return tailor


def test_a_close_interrupted_while_a_promotion_runs_keeps_the_tiers_locked_until_it_committed(tmp_path, tokens,
                                                                                             monkeypatch):
    """The promotion in flight, whose thread goes on, commits before the tiers' locks are
    released, never into a tier this writer no longer holds (another writer's by then), and
    ``close`` raises the interrupt once it did. Before: the locks were released at once, the
    promotion still running (it then committed without the lock: a promotion's commit checked only a
    lock it held, and passed once the lock was released)."""

    def wait(promoter, go, real_wait) -> None:
        go.set()  # the promotion goes on only once something waits for it
        real_wait(promoter)

    tailor = _close_interrupted(tmp_path, tokens, monkeypatch, wait)
    assert Run(tmp_path / "home").steps() == [1, 2] and Run(tmp_path / "home").verify() == []
    assert not any(level.lock.held for level in tailor.tiers.levels)


def test_a_close_interrupted_twice_leaves_no_lock_and_its_promotion_takes_none_back(tmp_path, tokens, monkeypatch):
    """A second Ctrl-C, in ``close()``'s wait for the promotion in flight: the locks are released
    at once, and that promotion, not yet at its commit (nor at its claim of the slower tier's
    lock), commits nothing and takes no lock back; another writer may take both tiers. Before,
    the promotion's claim took the released lock again: step 2 was committed after ``close`` and
    the lock kept until the Tailor was dropped."""
    from llmtailor.store.lock import WriterLock

    def wait(promoter, go, real_wait) -> None:
        raise KeyboardInterrupt

    real_wait = promote.Promoter.wait
    monkeypatch.setattr(promote, "_pause_before_retry", lambda seconds: None)
    tailor = _close_interrupted(tmp_path, tokens, monkeypatch, wait)
    real_wait(tailor.tiers.promoter)  # the promotion's thread ended
    assert Run(tmp_path / "home").steps() == [1] and Run(tmp_path / "home").verify() == []
    assert [level.lock.held for level in tailor.tiers.levels] == [False, False]
    for where in ("home", "memory"):
        assert WriterLock(tmp_path / where).storage.locks.writer().holder_if_other() is None


def test_an_empty_run_is_named_once_per_tier_and_is_no_damage(tmp_path):
    """Restoring a step from tiers that hold nothing names each tier's cause on one line (an
    empty run's what-to-do line is the single run's message, not a tier's part of this one);
    restore(fallback=True) of an empty run says it has no snapshot, as restore() does. BEFORE:
    ``no tier holds the composite of step 4 whole (.../fast: .../fast: no committed snapshot in
    this run directory\\ngive a run that has saved, ...; .../slow: ...)``; and an IntegrityError."""
    from llmtailor.errors import SnapshotNotFoundError

    tailor = Tailor(tmp_path / "slow", *tiny(layers=2, hidden=16), tiers=[Tier(tmp_path / "fast", keep=2)])
    with pytest.raises(SnapshotNotFoundError) as raised:
        tailor.restore(4)
    assert str(raised.value) == (f"no tier holds the composite of step 4 whole ({tmp_path}/fast: no committed snapshot "
                                 f"in this run directory; {tmp_path}/slow: no committed snapshot in this run directory)")
    tailor.close()
    with pytest.raises(SnapshotNotFoundError, match="no committed snapshot in this run directory\ngive a run"):
        Tailor(tmp_path / "single", *tiny(layers=2, hidden=16)).restore(fallback=True)
