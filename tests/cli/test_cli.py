"""The CLI over a real run: tables, exit codes, no tracebacks for user mistakes."""

import shutil

import pytest
import typer
from helpers import flip_unit_byte, tiny, train
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
    bad = flip_unit_byte(copy, 4, "layer.1")  # in the pack file the tiny model's units share
    result = runner.invoke(app, ["verify", str(copy)])
    assert result.exit_code == 1 and f"{bad.name}: checksum mismatch" in result.output
    # The composite of step 2 does not need that file.
    assert runner.invoke(app, ["verify", str(copy), "--step", "2"]).exit_code == 0


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["verify", "/nonexistent/run"], "no such run directory"),
        (["inspect", "{run}", "--step", "1"], "no committed snapshot at or before step 1"),
    ],
)
def test_user_mistakes_exit_2_without_traceback(run_dir, args, fragment):
    result = runner.invoke(app, [a.format(run=run_dir) for a in args])
    assert result.exit_code == 2
    assert fragment in result.output and "Traceback" not in result.output


def _listing(root):
    """Every path below ``root`` (hidden ones included) with its bytes: to show nothing changed."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def trainer_checkpoint(run_dir, tmp_path_factory):
    """A real Trainer ``checkpoint-6/`` (the run's composite exported), holding ``.tmp/`` and
    ``.trash/`` directories of its own."""
    out = tmp_path_factory.mktemp("exported")
    result = runner.invoke(app, ["assemble", str(run_dir), "-o", str(out)])
    assert result.exit_code == 0, result.output
    checkpoint = out / "checkpoint-6"
    for own in (".tmp", ".trash"):
        (checkpoint / own).mkdir()
        (checkpoint / own / "notes.txt").write_text("not llmtailor's")
    return checkpoint


@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_refuses_a_trainer_checkpoint_touching_nothing(trainer_checkpoint, dry_run):
    """The shape that found it: gc deleted a checkpoint-N/'s .tmp/ and .trash/ and left a .lock."""
    before = _listing(trainer_checkpoint)
    result = runner.invoke(app, ["gc", str(trainer_checkpoint), "--keep", "1", *(["--dry-run"] if dry_run else [])])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{trainer_checkpoint}: is a Hugging Face Trainer checkpoint" in result.output
    assert _listing(trainer_checkpoint) == before


def test_gc_refuses_a_directory_or_a_file_that_is_not_a_run(tmp_path):
    plain = tmp_path / "project"
    (plain / ".tmp").mkdir(parents=True)
    (plain / ".tmp" / "work.txt").write_text("mine")
    (plain / "data.txt").write_text("mine")
    before = _listing(plain)
    result = runner.invoke(app, ["gc", str(plain), "--keep", "1"])
    assert result.exit_code == 2 and "not an llmtailor run directory (no snapshots/ in it)" in result.output
    assert _listing(plain) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runner.invoke(app, ["gc", str(empty), "--keep", "1"]).exit_code == 2 and not any(empty.iterdir())
    result = runner.invoke(app, ["gc", str(plain / "data.txt"), "--keep", "1"])
    assert result.exit_code == 2 and "data.txt: is a file, not a run directory" in result.output


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("target", ["checkpoint", "file"])
def test_inspect_and_verify_of_what_is_not_a_run_say_what_it_is_in_one_line(trainer_checkpoint, tmp_path, command,
                                                                             target):
    """A Trainer checkpoint-N/ is pointed to the commands that take it: import-hf (then
    inspect, verify, assemble) and merge (it can be a merge source)."""
    file = tmp_path / "notes.txt"
    file.write_text("x")
    path, fragments = {
        "checkpoint": (trainer_checkpoint, ["is a Hugging Face Trainer checkpoint", "`llmtailor import-hf` to inspect, "
                                            "verify or assemble it", "a source of a `llmtailor merge` plan"]),
        "file": (file, ["notes.txt: is a file, not a run directory"]),
    }[target]
    result = runner.invoke(app, [command, str(path)])
    _one_line_error(result, str(path), *fragments)
    # A checkpoint's line names the commands that take it; a file's is followed by what to do.
    what_to_do = [] if target == "checkpoint" else ["       give a run, or make one of a checkpoint: llmtailor import-hf, "
                                                    "import-deepspeed"]
    assert result.output.splitlines()[1:] == what_to_do, result.output


def _one_line_error(result, *fragments):
    """Exit status 2 and one ``error:`` line holding every fragment; no traceback."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert all(fragment in lines[0] for fragment in fragments), lines[0]


def test_messages_keep_their_brackets(run_dir, trainer_checkpoint):
    """Messages are text, not rich markup: "[2, 4, 6]" used to vanish."""
    result = runner.invoke(app, ["import-hf", str(trainer_checkpoint), "-o", str(run_dir)])
    _one_line_error(result, "already holds snapshots (steps [2, 4, 6])")

    from llmtailor.cli.common import add_command
    from llmtailor.errors import ConfigError

    def bracketed() -> None:
        raise ConfigError("layer_range must be [a, b], got [5, 2]; see [bold]docs[/bold]")

    probe = typer.Typer()
    add_command(probe, "probe", bracketed)
    add_command(probe, "other", lambda: None)  # two commands: typer then wants the name
    _one_line_error(runner.invoke(probe, ["probe"]), "layer_range must be [a, b], got [5, 2]; see [bold]docs[/bold]")


@pytest.mark.parametrize(
    "out, fragments",
    [
        ("{file}", ["{file}: is a file, not a directory"]),
        ("{file}/sub", ["{file}/sub: a part of the path is a file, not a directory"]),
        ("/proc/llmtailor-out", ["cannot create the output directory: /proc/llmtailor-out"]),
    ],
)
def test_assemble_to_an_output_it_cannot_create_names_it(run_dir, tmp_path, out, fragments):
    file = tmp_path / "a-file"
    file.write_text("x")
    result = runner.invoke(app, ["assemble", str(run_dir), "-o", out.format(file=file)])
    _one_line_error(result, *(f.format(file=file) for f in fragments))
    assert file.read_text() == "x"


def test_a_failed_assemble_leaves_no_empty_output_directory(run_dir, tmp_path):
    damaged = tmp_path / "run"
    shutil.copytree(run_dir, damaged)
    unit = flip_unit_byte(damaged, 6, "layer.0")
    result = runner.invoke(app, ["assemble", str(damaged), "-o", str(tmp_path / "out" / "deeper")])
    _one_line_error(result, f"{unit.name}: checksum mismatch")
    assert not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()  # a directory that was there before stays
    runner.invoke(app, ["assemble", str(damaged), "-o", str(tmp_path / "kept")])
    assert (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())


@pytest.mark.parametrize(
    "out, fragments",
    [
        ("{file}", ["{file}: is a file, not a run directory; refusing to write into it"]),
        ("/proc/llmtailor-run", ["/proc/llmtailor-run: no such file or directory"]),
        ("{file}/run", ["{file}/run: a part of the path is a file, not a directory"]),
    ],
)
def test_import_hf_into_a_place_it_cannot_write_names_it(trainer_checkpoint, tmp_path, out, fragments):
    file = tmp_path / "a-file"
    file.write_text("x")
    result = runner.invoke(app, ["import-hf", str(trainer_checkpoint), "-o", out.format(file=file)])
    _one_line_error(result, *(f.format(file=file) for f in fragments))


def test_merge_into_a_place_it_cannot_write_names_it(run_dir, tmp_path):
    import yaml

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"slices": [{"sources": [{"model": f"{run_dir}@6", "layer_range": [0, 4]}]}]}))
    for out in ("/proc/llmtailor-merge", "/proc/llmtailor-merge/deeper"):
        result = runner.invoke(app, ["merge", str(plan), "-o", out, "--format", "model"])
        _one_line_error(result, "/proc/", "no such file or directory")


@pytest.mark.parametrize("command", ["inspect", "verify", "drift"])
def test_a_step_between_snapshots_means_the_composite_as_of_it(run_dir, command):
    between = runner.invoke(app, [command, str(run_dir), "--step", "5"])
    assert between.exit_code == 0, between.output
    assert "step 5 falls between snapshots; using the composite as of step 4" in between.output
    if command == "inspect":
        assert "composite as of step 4" in between.output
    before = runner.invoke(app, [command, str(run_dir), "--step", "1"])
    assert before.exit_code == 2 and "no committed snapshot at or before step 1 (committed steps: 2, 4, 6)" in before.output
    assert before.output.splitlines()[1:] == ["       give --step 2 or later, or no --step for the newest"]


@pytest.mark.slow
def test_the_command_says_only_what_was_asked(run_dir, tmp_path):
    """The real entry point (a fresh process, piped): no warnings of the libraries it loads
    (transformers' config warnings, DeepSpeed's accelerator line), no blank line before an
    error, one line per result. Commands that do not read each other's output run at once
    (each a process of its own): the two assembles, then the import and the refused assemble
    of the first's output."""
    import os
    import subprocess
    import sys

    from helpers import wait_launches

    def llmtailor(*commands: list[str]) -> list[subprocess.CompletedProcess]:
        """Each command a fresh process of the entry point, all started at once; each one's outcome."""
        env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "DS_ACCELERATOR")}
        started = [subprocess.Popen([sys.executable, "-c", "from llmtailor.cli import main; main()", *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                   for args in commands]
        outputs = wait_launches(started, timeout=300)
        return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(started, outputs)]

    assemble_hf = ["assemble", str(run_dir), "--format", "hf", "-o", str(tmp_path / "hf")]
    assembled = [
        (assemble_hf, f"wrote {tmp_path / 'hf' / 'checkpoint-6'}"),
        (["assemble", str(run_dir), "--format", "deepspeed", "-o", str(tmp_path / "ds")], f"wrote {tmp_path / 'ds' / 'global_step6'}"),
    ]
    imported = (["import-hf", str(tmp_path / "hf" / "checkpoint-6"), "-o", str(tmp_path / "imported")], "imported step 6")
    for done, (_, said) in zip(llmtailor(*(args for args, _ in assembled)), assembled):
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout.count("\n") == 1 and done.stdout.startswith(said), done.stdout
    done, again = llmtailor(imported[0], assemble_hf)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.count("\n") == 1 and done.stdout.startswith(imported[1]), done.stdout
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.startswith("error: ") and again.stderr.count("\n") == 1, again.stderr


@pytest.mark.parametrize("before", [None, '{"lock_ttl": 5}'])
def test_storage_options_apply_to_their_own_command_only(monkeypatch, before):
    """``--storage-option`` reaches every store the command opens through the environment: the
    environment is the caller's again once the command is over (the next command in the same
    process, a CliRunner's or a library caller's, sees none of them)."""
    import os

    from llmtailor.store.storage.object_options import OPTIONS_ENV

    if before is None:
        monkeypatch.delenv(OPTIONS_ENV, raising=False)
    else:
        monkeypatch.setenv(OPTIONS_ENV, before)
    first = runner.invoke(app, ["--storage-option", "lock_ttl=soon", "inspect", "memory:///run"])
    assert first.exit_code == 2 and "storage option lock_ttl='soon'" in first.output
    assert os.environ.get(OPTIONS_ENV) == before
    second = runner.invoke(app, ["inspect", "memory:///run"])  # the store opens: lock_ttl=soon is gone
    assert second.exit_code == 2 and "memory:///run: no such run" in second.output, second.output
