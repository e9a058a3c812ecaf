"""The demo end to end, at a small size: Full resumes bitwise, Parity, Filter and Adaptive write
less, and the drift plot is written."""

import io

import pytest
from rich.console import Console

from llmtailor import Run
from llmtailor.demo import run_demo
from llmtailor.errors import ConfigError, TailorError
from llmtailor.training_example import TinyConfig

# 16 layers as in the demo (Filter must skip layers), but narrow and short so it runs quickly.
SMALL = TinyConfig(hidden_size=32, layers=16, heads=4, kv_heads=2, intermediate_size=64, seq_len=32)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    console = Console(file=io.StringIO(), width=200)
    result = run_demo(out, steps=40, save_every=10, crash_at=25, console=console, config=SMALL, batch_size=4)
    return out, result, console.file.getvalue()


@pytest.mark.slow
def test_full_resumes_bitwise(demo):
    _, result, printed = demo
    full = result.runs["full"]
    assert full.restored_step == 20
    assert set(full.sources.values()) == {20}
    assert full.final_loss == result.reference_final_loss
    assert "bitwise identical" in printed


@pytest.mark.slow
def test_tailored_policies_write_less(demo):
    _, result, _ = demo
    full, parity, filter_ = (result.runs[n] for n in ("full", "parity", "filter"))
    for run in result.runs.values():
        assert run.save_steps == [10, 20, 30, 40]
        assert run.save_units[0] == full.save_units[0]  # every run's first save is full
    assert parity.mean_bytes_after_first < 0.75 * full.mean_bytes_after_first
    assert filter_.mean_bytes_after_first < parity.mean_bytes_after_first
    # The composite of step 20 takes the layers skipped at 20 from the save at 10.
    assert set(parity.sources.values()) == {10, 20}
    assert set(filter_.sources.values()) == {10, 20}
    # Resuming from a composite changes training a little, not a lot.
    adaptive = result.runs["adaptive"]
    assert adaptive.mean_bytes_after_first < 0.75 * full.mean_bytes_after_first
    for run in (parity, filter_, adaptive):
        assert abs(run.final_loss - result.reference_final_loss) < 0.05 * result.reference_final_loss


@pytest.mark.slow
def test_every_run_verifies(demo):
    out, _, printed = demo
    for name in ("full", "parity", "filter", "adaptive"):
        assert Run(out / name).verify() == []
        assert Run(out / name).steps() == [10, 20, 30, 40]
    assert (out / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "drift.png" in printed
    # The picture comparing the four policies, named at the end.
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "demo.png" in "".join(printed.splitlines(keepends=True)[-4:])


@pytest.mark.slow
def test_the_report_reads_plainly(demo):
    _, _, printed = demo
    assert "bytes vs Full" in printed and "time vs Full" in printed
    # Each bar counts training steps: resumed arms end at 40/40 too (no replayed steps added).
    assert printed.count("40/40") == 5 and "45/4" not in printed


def test_every_step_count_the_help_allows_has_a_schedule():
    from llmtailor.demo import schedule

    for steps in range(10, 1001):
        save_every, crash_at = schedule(steps)
        assert 1 <= save_every <= crash_at < steps, steps
        assert steps // save_every >= 2, steps  # a save before the crash and one after


def test_a_short_demo_runs(tmp_path):
    result = run_demo(tmp_path, steps=10, console=Console(file=io.StringIO(), width=120), config=SMALL, batch_size=2)
    assert result.runs["full"].final_loss == result.reference_final_loss


def test_the_demo_help_names_the_four_policies():
    from typer.testing import CliRunner

    from llmtailor.cli import app

    output = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"}).output
    assert "Full, Parity, Filter and Adaptive" in output


def test_bad_settings_are_reported_together(tmp_path):
    with pytest.raises(ConfigError, match=r"steps=0 .*save_every=-1"):
        run_demo(tmp_path, steps=0, save_every=-1, console=Console(file=io.StringIO()))
    with pytest.raises(ConfigError, match="crash_at=5"):
        run_demo(tmp_path, steps=40, save_every=10, crash_at=5, console=Console(file=io.StringIO()))
    assert not any(tmp_path.iterdir())


def test_refuses_to_replace_what_is_not_a_run(tmp_path):
    notes = tmp_path / "parity" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    with pytest.raises(TailorError, match="parity: exists and is not an llmtailor run"):
        run_demo(tmp_path, steps=40, save_every=10, crash_at=25, console=Console(file=io.StringIO()))
    assert notes.read_text() == "mine"
