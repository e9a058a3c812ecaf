"""``llmtailor import-hf CHECKPOINT_DIR -o RUN_DIR``: turn a plain Hugging Face Trainer
``checkpoint-N/`` directory into a tailored run holding one Full snapshot at step N, usable
wherever a run is (inspect, verify, assemble).

Registered on the app by ``register(app)`` (called from ``llmtailor.cli``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def import_hf(
    checkpoint_dir: Annotated[Path, typer.Argument(help="A Trainer checkpoint-N/ directory.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Run directory to create (new or without snapshots).")],
) -> None:
    """Import a Trainer checkpoint-N/ directory as a tailored snapshot at step N. Everything
    is checked first (files, weights against config.json's model, optimizer.pt's groups against
    the ones Trainer builds); bad input writes nothing."""
    from llmtailor.cli import console
    from llmtailor.interop.hf_import import import_hf as run_import
    from llmtailor.store.run import Run

    with Progress(
        TextColumn("[bold]writing units[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def progress(unit: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=unit)

        step = run_import(checkpoint_dir, out, progress=progress)
    manifest = Run(out).manifest(step)
    size = sum(f.bytes for f in manifest.files)
    console.print(
        f"[green]imported[/] step {step}: {len(manifest.units)} units, {size / 2**20:.1f} MiB "
        f"from {checkpoint_dir} into {out}"
    )


def register(app: typer.Typer) -> None:
    """Add ``import-hf`` to the ``llmtailor`` app (once), with its user-error handling."""
    from llmtailor.cli import _user_errors

    if any(info.name == "import-hf" for info in app.registered_commands):
        return  # idempotent: llmtailor.cli and tests may both register it
    app.command(name="import-hf")(_user_errors(import_hf))
