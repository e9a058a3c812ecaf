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
from llmtailor.errors import SnapshotNotFoundError, TailorError
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


def drop_unit(run_dir, step: int, unit: str, from_layout: bool) -> None:
    """Rewrite the manifest of ``step`` without ``unit`` in its composite (and its layout)."""
    path = Run(run_dir).snapshot_dir(step) / MANIFEST_FILE
    doc = json.loads(path.read_text())
    del doc["composite"][unit]
    if from_layout:
        del doc["layout"]["units"][unit]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("from_layout, problem", [
    (False, "the composite of step 5 names no version of units [layer.3] that its layout holds, so it cannot be restored"),
    (True, "the layout of step 5 lacks units [layer.3] of the 4 layers its model config names (num_hidden_layers): "
           "part of the model was not saved"),
], ids=["composite-lacks-a-layout-unit", "layout-lacks-a-configured-layer"])
def test_a_snapshot_lacking_part_of_the_model_fails(run_dir, from_layout, problem):
    """Issue 30 item 7: a snapshot committed by ranks holding different layers (pipeline stages)
    lacked the other stage's units, and verify passed it. Here step 5 loses layer.3 (from step
    4) from its composite; or from its layout too, as the first stage's snapshot recorded its
    own layout, where only the model config still counts every layer."""
    drop_unit(run_dir, 5, "layer.3", from_layout)
    assert problem in Run(run_dir).verify() and problem in Run(run_dir).verify(5)
    for args in ([], ["--step", "5"]):
        result = runner.invoke(app, ["verify", str(run_dir), *args])
        assert result.exit_code == 1 and problem in " ".join(result.output.split()), result.output
    assert runner.invoke(app, ["verify", str(run_dir), "--step", "4"]).exit_code == 0  # an older whole composite
    with pytest.raises(TailorError, match="layer.3"):
        Tailor(run_dir, *tiny(seed=3)).restore()


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
