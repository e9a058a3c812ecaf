"""``llmtailor import-deepspeed DIR -o RUN``: turn a DeepSpeed checkpoint (``engine.save_checkpoint``'s
``global_stepN/``, any ZeRO stage) into a tailored run holding one Full snapshot at step N.

Registered on the app by ``register(app)`` (called from ``llmtailor.cli``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape


def import_deepspeed(
    checkpoint: Annotated[Path, typer.Argument(help="A DeepSpeed save directory (with 'latest') or its global_stepN/.")],
    out: Annotated[str, typer.Option("-o", "--out", help="Run directory or URL to create (new or without snapshots).")],
    config: Annotated[
        Path | None, typer.Option("--config", help="The model's Hugging Face config.json (default: one beside the checkpoint).")
    ] = None,
    family: Annotated[str | None, typer.Option("--family", help="Model family of the layout when no config is known.")] = None,
) -> None:
    """Import a DeepSpeed checkpoint as a tailored snapshot: fp32 masters, every optimizer state
    tensor and each group's step, by parameter name, read with DeepSpeed's own converter
    (ds_to_universal). Its files are pickles: they are loaded here, on this explicit import only."""
    from llmtailor.cli.common import console
    from llmtailor.cli.render import unit_progress
    from llmtailor.interop.deepspeed.importer import import_deepspeed as run_import
    from llmtailor.store.run import Run

    with unit_progress(console, "writing units") as progress:
        step = run_import(checkpoint, out, config=config, family=family, progress=progress)
    manifest = Run(out).manifest(step)
    console.print(
        f"[green]imported[/] step {step}: {len(manifest.units)} units, {manifest.total_bytes() / 2**20:.1f} MiB "
        f"from {escape(str(checkpoint))} into {escape(out)}"
    )
    for line in manifest.notes.get("client_state_not_kept", []):
        console.print(f"[yellow]not kept[/]: {escape(line)}")


def register(app: typer.Typer) -> None:
    """Add ``import-deepspeed`` to the ``llmtailor`` app."""
    from llmtailor.cli.common import add_command

    add_command(app, "import-deepspeed", import_deepspeed)
