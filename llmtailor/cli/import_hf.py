"""``llmtailor import-hf CHECKPOINT_DIR -o RUN_DIR``: turn a plain Hugging Face Trainer
``checkpoint-N/`` directory into a tailored run holding one Full snapshot at step N, usable
wherever a run is (inspect, verify, assemble).

Registered on the app by ``register(app)`` (called from ``llmtailor.cli``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape


def import_hf(
    checkpoint_dir: Annotated[Path, typer.Argument(help="A Trainer checkpoint-N/ directory.")],
    out: Annotated[str, typer.Option("-o", "--out", help="Run directory or URL to create (new or without snapshots).")],
) -> None:
    """Import a Trainer checkpoint-N/ directory as a tailored snapshot at step N. Everything
    is checked first (files, weights against config.json's model, optimizer.pt's groups against
    the ones Trainer builds); bad input writes nothing."""
    from llmtailor.cli.common import console
    from llmtailor.cli.render import unit_progress
    from llmtailor.interop.hf.importer import import_hf as run_import
    from llmtailor.store.run import Run

    with unit_progress(console, "writing units") as progress:
        step = run_import(checkpoint_dir, out, progress=progress)
    manifest = Run(out).manifest(step)
    size = manifest.total_bytes()
    console.print(
        f"[green]imported[/] step {step}: {len(manifest.units)} units, {size / 2**20:.1f} MiB "
        f"from {escape(str(checkpoint_dir))} into {escape(out)}"
    )


def register(app: typer.Typer) -> None:
    """Add ``import-hf`` to the ``llmtailor`` app."""
    from llmtailor.cli.common import add_command

    add_command(app, "import-hf", import_hf)
