"""``inspect`` and ``drift`` read well at 80 columns and piped: no line wider than the terminal,
no cell or header cut to ``…``, every unit and every save shown (pages of columns), saved
cells marked with a character (colour is lost in a pipe), frozen units shown as 0."""

from __future__ import annotations

import re

import pytest
from helpers import tiny, train
from typer.testing import CliRunner

from llmtailor import Parity, Tailor
from llmtailor.cli import app

LAYERS = 24


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokens):
    """24 layers (the first frozen), Parity, saves at steps 2..24: 12 saves."""
    root = tmp_path_factory.mktemp("render") / "run"
    model, opt, sched = tiny(layers=LAYERS, hidden=16)
    for param in model.model.layers[0].parameters():
        param.requires_grad_(False)
    with Tailor(root, model, opt, sched, policy=Parity()) as tailor:
        for step in range(1, 25):
            train(model, opt, sched, tokens, [step])
            if step % 2 == 0:
                tailor.save(step)
    return root


def invoke(*args: str, columns: int = 80) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def check_fits(output: str, columns: int) -> None:
    lines = output.splitlines()
    assert max(len(line) for line in lines) <= columns, max(lines, key=len)
    assert "…" not in output


@pytest.mark.parametrize("columns", [80, 200])
def test_inspect_fits_the_width_and_shows_every_unit_and_snapshot(run_dir, columns):
    output = invoke("inspect", str(run_dir), columns=columns)
    check_fits(output, columns)
    headers = [line.split() for line in output.splitlines() if line.lstrip().startswith("step ")]
    labels = [label for header in headers for label in header[1:-1]]
    assert labels == ["E", *map(str, range(LAYERS)), "N", "H"]
    assert (len(headers) > 1) == (columns == 80)  # paged only where it must be
    for step in range(2, 25, 2):
        assert re.search(rf"^\s*{step}( \*)?\s+[●0-9]", output, re.M), step
    assert "policy Parity(): steps 2-24" in output


@pytest.mark.parametrize("columns", [80, 200])
def test_drift_fits_the_width_marks_saved_cells_and_shows_frozen_as_zero(run_dir, columns):
    output = invoke("drift", str(run_dir), columns=columns)
    check_fits(output, columns)
    steps = [int(s) for line in output.splitlines() if line.startswith("unit ") for s in line.split()[1:]]
    assert steps == list(range(2, 25, 2))
    layer0 = [cell for line in output.splitlines() if line.startswith("0 ") for cell in line.split()[1:]]
    # Frozen: exactly zero, and written once (the first save; then kept, never rewritten).
    assert layer0 == ["-*"] + ["0"] * 11
    layer1 = [cell for line in output.splitlines() if line.startswith("1 ") for cell in line.split()[1:]]
    assert any(cell.endswith("*") for cell in layer1) and any(not cell.endswith("*") for cell in layer1)


def test_the_heatmap_shows_zero_drift_apart_from_not_measured(run_dir):
    import math

    import matplotlib.pyplot as plt
    import numpy as np

    from llmtailor.plots import drift_figure
    from llmtailor.drift import drift_history
    from llmtailor.store.run import Run

    history = drift_history(Run(run_dir))
    fig = drift_figure(history, "weight")
    scale, zeros = (np.ma.filled(image.get_array().astype(float), math.nan) for image in fig.axes[0].images)
    row = history.units.index("layer.0")
    for column, step in enumerate(history.steps):
        value = history.drift[step].get("layer.0", {}).get("weight")
        assert (zeros[row][column] == 1) == (value == 0), step  # grey exactly where zero
        assert math.isnan(scale[row][column]) == (value in (None, 0)), step
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["0: unchanged (frozen)", "blank: not measured"]
    plt.close(fig)


def test_gc_fits_80_columns(tmp_path, tokens):
    """gc on a run at a long path, with a snapshot a reader holds and a crashed save's
    leftovers: every line (heading, table, notes) within 80 columns, the path unbroken."""
    root = tmp_path / ("run" + "-" * max(0, 72 - len(str(tmp_path))))  # 76 characters: a line of its own
    model, opt, sched = tiny()
    with Tailor(root, model, opt, sched, policy=Parity()) as tailor:
        for step in range(1, 5):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    crashed = root / ".tmp" / "step-00000005.123.abcdef01" / "units"
    crashed.mkdir(parents=True)
    (crashed / "embed.safetensors").write_bytes(b"x")
    from llmtailor.store.run import Run

    assert len(str(root) + ": keep the composites of steps 4") > 80  # the heading does not fit one line
    check_fits(invoke("gc", str(root), "--keep", "1", "--dry-run"), 80)
    with Run(root).reading(2):
        output = invoke("gc", str(root), "--keep", "1")
    check_fits(output, 80)
    assert str(root) in output.splitlines()[0]
    assert "in use by a reader, left for the next gc: 1, 2" in output and "deleted 0 snapshot(s); kept 2" in output
    assert "leftovers of interrupted saves: removed 1 file(s)" in output
