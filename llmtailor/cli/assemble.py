"""``llmtailor assemble RUN [--step N] --format hf|deepspeed|peft|lightning -o OUT [--max-shard-size 5GB]``: write a
composite in another checkpoint format: Hugging Face Trainer's ``checkpoint-N/``, a DeepSpeed
universal checkpoint, a peft adapter directory, or a Lightning ``.ckpt`` file.

Registered on the app by ``register(app)`` (called from ``llmtailor.cli``)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from llmtailor.cli.common import STEP_HELP


class ExportFormat(str, Enum):
    hf = "hf"
    deepspeed = "deepspeed"
    peft = "peft"
    lightning = "lightning"


def assemble(
    run_dir: Annotated[str, typer.Argument(help="Run directory or URL (the one given to Tailor).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Directory to write checkpoint-<step>/ into.")],
    format: Annotated[
        ExportFormat,
        # The formats are described in the docstring: at full width, their long names stay whole.
        typer.Option("--format", metavar="FORMAT", help="hf, deepspeed, peft or lightning (each described above)."),
    ] = ExportFormat.hf,
    step: Annotated[int | None, typer.Option("--step", help=STEP_HELP)] = None,
    train_batch_size: Annotated[
        int, typer.Option(min=1, help="Recorded in trainer_state.json when the run holds no TrainerState (plain Tailor runs).")
    ] = 1,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="hf: the largest weights file (5GB, 500MB, 100KB or bytes); larger "
                          "weights are split into shards with an index, as save_pretrained does.")
    ] = "5GB",
) -> None:
    """Write the composite of a step (each unit from its newest saved version) as a standard
    checkpoint directory; `transformers.Trainer.train(resume_from_checkpoint=...)` resumes
    from it with no llmtailor code. Written under a temporary name and renamed when whole;
    an existing checkpoint directory is never overwritten.

    The formats: hf, a Trainer checkpoint-N/ directory vanilla Trainer resumes from; deepspeed,
    a universal checkpoint engine.load_checkpoint loads (ZeRO-1/2, any world size,
    'load_universal': true); peft, the adapters as a directory PeftModel.from_pretrained(base,
    OUT) loads (OUT itself); lightning, OUT/epoch=E-step=S.ckpt, which Trainer.fit(model,
    ckpt_path=...) resumes from (runs saved by TailorCheckpoint)."""
    from llmtailor.cli.common import as_of, console, existing_run
    from llmtailor.cli.render import unit_progress
    from llmtailor.interop.hf.export import export_hf

    from llmtailor.outputs.sink import parse_size

    shard_bytes = parse_size(max_shard_size)  # refused before the run is read
    run = existing_run(run_dir)
    step = as_of(run, step)
    # Leased: retention running meanwhile (gc, a writer's keep=) leaves the composite whole.
    with run.reading(step) as composite, unit_progress(console, "reading units") as progress:
        if format is ExportFormat.deepspeed:
            from llmtailor.interop.deepspeed.export import export_deepspeed

            target = export_deepspeed(run, composite.step, out, progress=progress)
        elif format is ExportFormat.peft:
            from llmtailor.interop.hf.peft import export_peft

            target = export_peft(run, composite.step, out, progress=progress)
        elif format is ExportFormat.lightning:
            from llmtailor.interop.lightning import export_lightning

            target = export_lightning(run, composite.step, out, progress=progress)
        else:
            target = export_hf(run, composite.step, out, progress=progress, train_batch_size=train_batch_size,
                               max_shard_size=shard_bytes)
    console.print(f"[green]wrote[/] {escape(str(target))}")


def register(app: typer.Typer) -> None:
    """Add ``assemble`` to the ``llmtailor`` app."""
    from llmtailor.cli.common import add_command

    add_command(app, "assemble", assemble)
