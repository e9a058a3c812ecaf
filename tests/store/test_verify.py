"""``verify`` passes only a run that restores: the composite it checks (the newest, or --step's)
must resolve completely; older composites that retention left unrestorable are notes."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import parity_run, tiny
from typer.testing import CliRunner

from llmtailor import Tailor
from llmtailor.cli import app
from llmtailor.constants import MANIFEST_FILE
from llmtailor.errors import SnapshotNotFoundError
from llmtailor.store.retention import apply_retention, plan_retention
from llmtailor.store.run import Run

runner = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokens):
    """Parity saves at steps 1..5: step 1 is full, then odd layers at 2 and 4, even ones at 3
    and 5; each composite needs its own snapshot and the previous one."""
    return parity_run(tmp_path_factory.mktemp("parity") / "run", tokens, 5)


@pytest.fixture
def run_dir(saved, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def test_a_run_missing_a_snapshot_the_newest_composite_needs_fails_as_restore_does(run_dir):
    """The shape that found it: a Parity run with one snapshot directory removed verified OK
    (3 snapshots) while restore() raised."""
    shutil.rmtree(Run(run_dir).snapshot_dir(4))
    result = runner.invoke(app, ["verify", str(run_dir)])
    assert result.exit_code == 1, result.output
    assert "the composite of step 5 needs step 4 (units layer.1, layer.3), which is not in the run" in result.output
    with pytest.raises(SnapshotNotFoundError, match="composite of step 5 needs step 4"):
        Tailor(run_dir, *tiny(seed=3)).restore()
    # --step of a composite that is whole still passes.
    assert runner.invoke(app, ["verify", str(run_dir), "--step", "2"]).exit_code == 0


def test_a_composite_naming_a_step_that_never_was_fails(run_dir):
    path = Run(run_dir).snapshot_dir(5) / MANIFEST_FILE
    doc = json.loads(path.read_text())
    doc["composite"]["layer.1"] = 0  # no snapshot of step 0 was ever written
    path.write_text(json.dumps(doc))
    result = runner.invoke(app, ["verify", str(run_dir)])
    assert result.exit_code == 1 and "composite of step 5 needs step 0 (units layer.1)" in result.output
    assert runner.invoke(app, ["verify", str(run_dir), "--step", "5"]).exit_code == 1


@pytest.mark.parametrize("step, unit, source", [(5, "layer.1", 3), (4, "layer.0", 2)])  # the newest, an older one
def test_a_composite_naming_a_snapshot_without_the_unit_fails(run_dir, step, unit, source):
    path = Run(run_dir).snapshot_dir(step) / MANIFEST_FILE
    doc = json.loads(path.read_text())
    doc["composite"][unit] = source  # a snapshot that saved the other half of the layers
    path.write_text(json.dumps(doc))
    result = runner.invoke(app, ["verify", str(run_dir)])
    assert result.exit_code == 1
    assert f"snapshot {source} holds no unit ['{unit}'] although the composite of step {step} names it" in result.output


def test_older_composites_retention_left_unrestorable_are_notes(run_dir):
    run = Run(run_dir)
    apply_retention(run, plan_retention(run, 1))  # keeps 4 and 5: the composite of 4 needs 3
    result = runner.invoke(app, ["verify", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "note: the composite of step 4 needs step 3 (units layer.0, layer.2), which is not in the run" in result.output
    assert "every checksum matches (2 snapshot(s))" in result.output
    check = Run(run_dir).check()
    assert check.problems == [] and check.checked == [4, 5] and len(check.notes) == 1
    # Asked for by step, that composite is a problem: it cannot be restored.
    result = runner.invoke(app, ["verify", str(run_dir), "--step", "4"])
    assert result.exit_code == 1 and "cannot be restored" in result.output


def test_a_run_with_nothing_committed_yet_has_no_problems(tmp_path):
    """As after a kill during the first save: the library's verify finds nothing wrong (the
    CLI says there is no committed snapshot)."""
    from llmtailor.store.run import Run

    (tmp_path / "run" / ".tmp" / "step-00000002.123.abcd").mkdir(parents=True)
    assert Run(tmp_path / "run").verify() == []
