"""The CLI over a real run: tables, exit codes, no tracebacks for user mistakes."""

import pytest
from helpers import tiny, train
from typer.testing import CliRunner

from llmtailor import Parity, Tailor
from llmtailor.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokens):
    path = tmp_path_factory.mktemp("run")
    model, opt, sched = tiny()
    tailor = Tailor(path, model, opt, sched, policy=Parity())
    for step in (2, 4, 6):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
    return path


def test_inspect_shows_snapshots_and_composite(run_dir):
    result = runner.invoke(app, ["inspect", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "3 snapshot(s)" in result.output and "composite as of step 6" in result.output
    assert "layer.1" in result.output and "Parity()" in result.output
    older = runner.invoke(app, ["inspect", str(run_dir), "--step", "4"])
    assert "composite as of step 4" in older.output


def test_verify_ok_then_names_the_bad_file(tmp_path, run_dir):
    import shutil

    assert runner.invoke(app, ["verify", str(run_dir)]).exit_code == 0
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    bad = copy / "snapshots/step-00000004/units/layer.1.safetensors"
    bad.write_bytes(bad.read_bytes()[:-1] + b"\x00")
    result = runner.invoke(app, ["verify", str(copy)])
    assert result.exit_code == 1 and "layer.1.safetensors: checksum mismatch" in result.output
    # The composite of step 2 does not need that file.
    assert runner.invoke(app, ["verify", str(copy), "--step", "2"]).exit_code == 0


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["verify", "/nonexistent/run"], "no such run directory"),
        (["inspect", "{run}", "--step", "5"], "no committed snapshot at step 5"),
    ],
)
def test_user_mistakes_exit_2_without_traceback(run_dir, args, fragment):
    result = runner.invoke(app, [a.format(run=run_dir) for a in args])
    assert result.exit_code == 2
    assert fragment in result.output and "Traceback" not in result.output
