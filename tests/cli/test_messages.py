"""The CLI's answer to a user's mistake: one line of cause (``error: ...``), one of what to do
(indented under it), exit codes as before, no traceback; at 80 columns. The library raises the
same text. And the options that said nothing: ``merge --verbose`` without ``--dry-run``, the
flags shown as if they took a value."""

from __future__ import annotations

import shutil

import pytest
import yaml
from helpers import flip_unit_byte, tiny
from typer.testing import CliRunner

from llmtailor import Tailor
from llmtailor.cli import app
from llmtailor.errors import SnapshotNotFoundError
from llmtailor.store.catalog import not_restorable
from llmtailor.store.run import Run

INDENT = " " * len("error: ")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run saved (Full) at steps 2, 4 and 6; an empty directory; a copy of the run with one
    byte of step 4's layer.1 flipped."""
    root = tmp_path_factory.mktemp("messages")
    model, optimizer, scheduler = tiny(layers=2, hidden=16)
    tailor = Tailor(root / "run", model, optimizer, scheduler)
    for step in (2, 4, 6):
        tailor.save(step)
    (root / "empty").mkdir()
    shutil.copytree(root / "run", root / "damaged")
    flip_unit_byte(root / "damaged", 6, "layer.1")
    return root


def cause_then_what_to_do(result, code: int, cause: str, what_to_do: str) -> None:
    assert "Traceback" not in result.output
    assert (result.exit_code, result.output.splitlines()) == (code, [f"error: {cause}", INDENT + what_to_do])
    assert len(INDENT + what_to_do) <= 80


READERS = [["inspect"], ["verify"], ["drift"], ["assemble", "-o", "{root}/out"]]


@pytest.mark.parametrize("command", READERS, ids=lambda c: c[0])
def test_a_missing_run_an_empty_run_and_a_wrong_step_say_what_to_do(runs, command):
    """BEFORE: ``error: .../nope: no such run directory`` alone (likewise the empty run and the
    step before the first), nothing said of what to do."""
    name, *rest = command
    options = [r.format(root=runs) for r in rest]
    cause_then_what_to_do(invoke(name, f"{runs}/nope", *options), 2, f"{runs}/nope: no such run directory",
                          "check the path: give the directory (or URL) that a Tailor saved into")
    cause_then_what_to_do(invoke(name, f"{runs}/empty", *options), 2,
                          f"{runs}/empty: no committed snapshot in this run directory",
                          "give a run that has saved, or call Tailor.save() into this one first")
    cause_then_what_to_do(invoke(name, f"{runs}/run", "--step", "1", *options), 2,
                          f"{runs}/run: no committed snapshot at or before step 1 (committed steps: 2, 4, 6)",
                          "give --step 2 or later, or no --step for the newest")


def test_the_library_raises_the_text_the_cli_prints(runs):
    with pytest.raises(SnapshotNotFoundError) as raised:
        Tailor(runs / "empty", *tiny(layers=2, hidden=16)).restore()
    assert str(raised.value) == (f"{runs}/empty: no committed snapshot in this run directory\n"
                                 "give a run that has saved, or call Tailor.save() into this one first")


def test_a_damaged_file_says_how_to_find_every_one(runs, tmp_path):
    """BEFORE: the checksum mismatch alone (assemble), and ``1 problem(s)`` last (verify)."""
    result = invoke("assemble", f"{runs}/damaged", "-o", str(tmp_path / "out"))
    assert result.exit_code == 2 and "checksum mismatch" in result.output.splitlines()[0]
    assert result.output.splitlines()[1:] == [INDENT + "llmtailor verify RUN names every damaged file; an older "
                                              "--step may not read it"]
    checked = invoke("verify", f"{runs}/damaged")
    assert checked.exit_code == 1
    assert checked.output.splitlines()[-2:] == ["1 problem(s)", "restore what is named from a copy of the run, or "
                                                "use a --step that verifies"]


def test_the_damaged_file_hint_follows_the_error_type_not_its_text(runs, tmp_path):
    """A truncated file is damage too, though its message does not say "corrupted"; a path that
    holds those words is not. BEFORE: ``error: .../global.safetensors: 7670 bytes stored, manifest
    says 7680 (truncated or replaced)`` alone; and a missing run named ``(file is corrupted)``
    told to run verify (a third line)."""
    shutil.copytree(runs / "run", tmp_path / "truncated")
    data = tmp_path / "truncated" / "snapshots" / "step-00000006" / "global.safetensors"
    data.write_bytes(data.read_bytes()[:-10])
    result = invoke("assemble", str(tmp_path / "truncated"), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2 and "(truncated or replaced)" in result.output.splitlines()[0], result.output
    assert result.output.splitlines()[1:] == [INDENT + "llmtailor verify RUN names every damaged file; an older "
                                              "--step may not read it"]
    cause_then_what_to_do(invoke("inspect", f"{tmp_path}/(file is corrupted)"), 2,
                          f"{tmp_path}/(file is corrupted): no such run directory",
                          "check the path: give the directory (or URL) that a Tailor saved into")


@pytest.mark.parametrize("name", ["indexes.json", "global.json", "global.safetensors"])
def test_a_missing_snapshot_file_read_through_the_storage_says_how_to_find_every_one(runs, tmp_path, name):
    """A file the manifest records, gone: the storage's "file is missing" is the run's damage
    (DamagedFileError), so the hint follows, as for a missing unit file. BEFORE: ``error:
    .../step-00000006/indexes.json: file is missing`` alone (a plain IntegrityError)."""
    shutil.copytree(runs / "run", tmp_path / "run")
    missing = tmp_path / "run" / "snapshots" / "step-00000006" / name
    missing.unlink()
    result = invoke("assemble", str(tmp_path / "run"), "-o", str(tmp_path / "out"))
    assert (result.exit_code, result.output.splitlines()) == (2, [f"error: {missing}: file is missing", INDENT +
                                                                  "llmtailor verify RUN names every damaged file; an "
                                                                  "older --step may not read it"]), result.output
    checked = invoke("verify", str(tmp_path / "run"))
    assert checked.exit_code == 1 and f"bad: {missing}: file is missing" in checked.output, checked.output


def test_a_bad_plan_says_to_fix_it_and_that_nothing_was_written(runs, tmp_path):
    """BEFORE: the plan's fault alone."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"slices": [{"sources": [{"model": f"{runs}/run", "layer_range": [0, 9]}]}]}))
    cause_then_what_to_do(invoke("merge", str(plan), "-o", str(tmp_path / "out")), 2,
                          f"{plan}: slices[0]: source '{runs}/run' has 2 layers; layer_range [0, 9] names its layer 2",
                          "fix the plan and run again (nothing was written); --dry-run checks a plan")
    assert not (tmp_path / "out").exists()
    cause_then_what_to_do(invoke("merge", str(tmp_path / "none.yaml"), "-o", str(tmp_path / "out")), 2,
                          f"{tmp_path}/none.yaml: no such plan file",
                          "check the path: a YAML file, mergekit's form or LLMTailor's")


def test_merge_verbose_without_dry_run_shows_each_tensor_then_merges(runs, tmp_path):
    """BEFORE: --verbose without --dry-run was ignored: only the ``wrote`` line."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"slices": [{"sources": [{"model": f"{runs}/run", "layer_range": [0, 2]}]}]}))
    # Wide: the table folds tensor names at 80 columns.
    result = CliRunner().invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out"), "--verbose"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "model.layers.1.self_attn.q_proj.weight" in result.output and " tensors " not in result.output
    assert result.output.rstrip().splitlines()[-1].startswith(f"wrote {tmp_path}/out")
    assert Run(tmp_path / "out").steps() == [6]


@pytest.mark.parametrize("command, format, what", [("import-hf", "hf", "a Trainer checkpoint"),
                                                    ("import-deepspeed", "deepspeed", "a DeepSpeed checkpoint")])
def test_an_import_of_an_llmtailor_run_says_it_is_one_and_how_to_export_it(runs, tmp_path, command, format, what):
    """BEFORE (import-hf): ``not an importable Trainer checkpoint: config.json is missing;
    trainer_state.json is missing; ...`` (five files); (import-deepspeed) ``.../latest names
    'step-00000006', which is not a directory in ...``."""
    result = invoke(command, f"{runs}/run", "-o", str(tmp_path / "out"))
    assert (result.exit_code, result.output.splitlines()) == (2, [
        f"error: {runs}/run is already an llmtailor run: inspect, verify, assemble and merge read it as it is",
        f"{INDENT}`llmtailor assemble {runs}/run --format {format} -o OUT` writes {what} of it"])
    assert not (tmp_path / "out").exists()


def test_a_note_of_several_missing_steps_reads_in_the_plural():
    """BEFORE: ``needs step 7 (units layer.0); step 8 (units layer.1), which is not in the run``."""
    assert not_restorable(9, {7: ["layer.0"]}).endswith("needs step 7 (units layer.0), which is not in the run")
    assert not_restorable(9, {7: ["layer.0"], 8: ["layer.1"]}).endswith(
        "needs step 7 (units layer.0); step 8 (units layer.1), which are not in the run")


@pytest.mark.parametrize("args", [["--help"], ["merge", "--help"], ["gc", "--help"]])
def test_a_flag_is_not_shown_as_taking_a_value(args):
    """BEFORE: ``--dry-run  <bool>``, ``--help  <bool>`` (typer 0.29 shows every flag's type)."""
    result = invoke(*args)
    assert result.exit_code == 0 and "--help" in result.output
    assert "<bool>" not in result.output
    assert invoke("merge", "plan.yaml", "-o", "out", "--dry-run=yes").exit_code == 2  # still a flag


def test_a_path_with_brackets_is_printed_as_it_is(runs, tmp_path):
    """Paths are text, never rich markup: ``sweep[lr=1e-4]`` keeps its brackets, and ``a[/b]``
    (a directory ``a[`` holding ``b]``) is no closing tag. BEFORE: inspect printed the run as
    ``sweep``; assemble said ``wrote .../out/checkpoint-6`` of what it wrote into ``out[lr=1]``;
    inspect of ``a[/b]`` ended in a traceback (``MarkupError: closing tag '[/b]' ...``)."""
    for name in ("sweep[lr=1e-4]", "a[/b]"):
        shutil.copytree(runs / "run", tmp_path / name)
        shown = CliRunner().invoke(app, ["inspect", str(tmp_path / name)], env={"COLUMNS": "300"})
        assert shown.exit_code == 0 and "Traceback" not in shown.output, shown.output
        assert shown.output.startswith(f"{tmp_path / name}: 3 snapshot(s)"), shown.output
    wrote = invoke("assemble", str(tmp_path / "sweep[lr=1e-4]"), "-o", str(tmp_path / "out[lr=1]"))
    assert wrote.exit_code == 0 and wrote.output.splitlines()[-1] == f"wrote {tmp_path}/out[lr=1]/checkpoint-6"
    plan = tmp_path / "plan[v2].yaml"
    source = str(tmp_path / "a[/b]")
    plan.write_text(yaml.safe_dump({"slices": [{"sources": [{"model": source, "layer_range": [0, 2]}]},
                                               {"sources": [{"model": source, "layer_range": [1, 1]}]}]}))
    planned = CliRunner().invoke(app, ["merge", str(plan), "-o", str(tmp_path / "m"), "--dry-run"], env={"COLUMNS": "300"})
    assert planned.exit_code == 0 and "Traceback" not in planned.output, planned.output
    assert f"{plan}: " in planned.output and f"{source}@6" in planned.output, planned.output
    assert f"warning: slices[1]: zero-width layer_range [1, 1] of '{source}' ignored" in planned.output


def test_drift_writes_its_plot_where_it_says(runs, tmp_path):
    """BEFORE: ``--plot DIR/plot`` wrote ``DIR/plot.png`` (matplotlib added the suffix) and said
    ``wrote DIR/plot``."""
    result = invoke("drift", f"{runs}/run", "--plot", str(tmp_path / "plot"))
    assert result.exit_code == 0 and result.output.splitlines()[-1] == f"wrote {tmp_path}/plot", result.output
    assert (tmp_path / "plot").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plot.png").exists()
