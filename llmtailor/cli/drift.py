"""``llmtailor drift RUN [--step N] [--kind weight|moments] [--plot FILE.png]``: per-unit drift
over the saves of a run, as a table and as a heatmap, with bytes per snapshot vs Full.

Registered on the app by ``register(app)`` (called from ``llmtailor.cli``)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from llmtailor.cli.common import STEP_HELP


class Kind(str, Enum):
    weight = "weight"
    moments = "moments"


def drift(
    run_dir: Annotated[str, typer.Argument(help="Run directory or URL (the one given to Tailor).")],
    step: Annotated[int | None, typer.Option("--step", help=STEP_HELP)] = None,
    kind: Annotated[Kind, typer.Option("--kind", help="Drift of the weights or of the optimizer moments.")] = Kind.weight,
    plot: Annotated[Path | None, typer.Option("--plot", help="Also draw a heatmap and the bytes per save into this PNG.")] = None,
) -> None:
    """Each unit's drift since its last saved version, at every save of the run (as each save
    measured it; saved units marked), and the bytes each save wrote vs a Full save."""
    from llmtailor.cli.common import as_of, console, existing_run
    from llmtailor.cli.render import drift_table
    from llmtailor.drift import drift_history
    from llmtailor.errors import TailorError

    run = existing_run(run_dir)
    step = as_of(run, step)
    with run.reading(step) as composite:  # the lineage's manifests are read while it is leased
        run.load_manifests()
        history = drift_history(run, composite.step)
    if not any(history.drift[s] for s in history.steps):
        raise TailorError(f"{run_dir}: no save of this run recorded drift (saved with track_drift=False?)")
    console.print(drift_table(history, kind.value, console.width), soft_wrap=False)
    if plot is not None:
        from llmtailor.plots import plot_drift

        plot_drift(history, kind.value, plot)
        console.print(f"[green]wrote[/] {escape(str(plot))}")


def register(app: typer.Typer) -> None:
    """Add ``drift`` to the ``llmtailor`` app."""
    from llmtailor.cli.common import add_command

    add_command(app, "drift", drift)
