"""``llmtailor merge PLAN.yaml -o OUT [--format tailor|hf|model] [--max-shard-size 5GB] [--dry-run] [--verbose]``:
assemble layers and their optimizer state from several checkpoints, as a YAML plan says.

Registered on the app by ``register(app)`` (called from ``llmtailor.cli``)."""

from __future__ import annotations

from contextlib import ExitStack
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from llmtailor.errors import TailorError


class MergeFormat(str, Enum):
    tailor = "tailor"
    hf = "hf"
    model = "model"


def merge(
    plan_file: Annotated[Path, typer.Argument(help="The merge plan (YAML, mergekit or LLMTailor form).")],
    out: Annotated[
        str, typer.Option("-o", "--out", help="Run directory or URL (tailor), directory for checkpoint-N/ (hf), model directory (model).")
    ],
    format: Annotated[
        MergeFormat,
        typer.Option("--format", help="tailor: a run with one snapshot; hf: a Trainer checkpoint-N/; model: a "
                     "save_pretrained directory (weights, config, tokenizer)."),
    ] = MergeFormat.tailor,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="hf, model: the largest weights file (5GB, 500MB, 100KB or bytes); "
                          "larger weights are split into shards with an index, as save_pretrained does.")
    ] = "5GB",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the planned actions; write nothing.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Print the planned actions one row per tensor (with "
                                          "--dry-run: instead of one per unit; without it: before merging).")] = False,
) -> None:
    """Plan the merge (every check made from headers and manifests, before any tensor byte is
    read), then stream it unit by unit into the output, committed atomically. A bad plan
    writes nothing."""
    from llmtailor.cli.common import console, errors
    from llmtailor.cli.render import unit_progress
    from llmtailor.merge.execute import execute
    from llmtailor.merge.planner import open_plan
    from llmtailor.outputs.sink import parse_size

    shard_bytes = parse_size(max_shard_size)  # refused before the plan is read
    with ExitStack() as stack:
        try:
            plan = stack.enter_context(open_plan(plan_file, out, format.value))
        except TailorError as err:
            raise TailorError(plan_advice(plan_file, err)) from err  # a damaged source's hint follows it
        for warning in plan.warnings:
            errors.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
        if dry_run or verbose:
            console.print(actions_table(plan, verbose))
        if dry_run:
            return
        with unit_progress(console, "merging units") as progress:
            target = execute(plan, out, format=format.value, progress=progress, max_shard_size=shard_bytes)
    console.print(f"[green]wrote[/] {escape(str(target))} ({len(plan.layout.units)} units, step {plan.step})")


def plan_advice(plan_file: Path, err: TailorError) -> str:
    """Why the plan was refused (``err``'s message) and, where it is the plan's fault, what to do."""
    from llmtailor.cli.common import damaged

    message = str(err)
    if "\n" in message or damaged(err) or not message.startswith(f"{plan_file}:"):
        return message  # not the plan's (the output, a damaged source), or it says what to do itself
    if message == f"{plan_file}: no such plan file":
        return f"{message}\ncheck the path: a YAML file, mergekit's form or LLMTailor's"
    return f"{message}\nfix the plan and run again (nothing was written); --dry-run checks a plan"


def actions_table(plan, verbose: bool = False):
    """One row per (destination unit, source unit) with tensor counts, or one per tensor. The
    source is the composite the plan names (label@step); the unit's bytes come from the
    snapshot that saved its version (``saved at step``)."""
    from rich.table import Table

    title = (
        f"{plan.plan_file}: {len(plan.actions)} tensor actions into {len(plan.layout.units)} units; "
        f"state (step {plan.step}) from {plan.state_from}; optimizer state {'moved' if plan.optimizer else 'dropped'}"
    )
    table = Table(title=escape(title))  # cells and title are markup: a path's [...] is text
    for column in ("destination unit", "destination tensor", "source", "source tensor"):
        # Folded, never cut to "…": two sources whose paths differ at their end must stay apart.
        table.add_column(column, overflow="fold")
    for unit, actions in plan.actions_by_unit().items():
        first = actions[0]
        step = plan.sources[first.source].step
        source = first.source if step is None or first.source.endswith(f"@{step}") else f"{first.source}@{step}"
        if verbose:
            for a in actions:
                note = a.describe()
                table.add_row(unit, escape(a.dest_key), escape(source), escape(a.source_key + (f" ({note})" if note else "")))
        else:
            saved = first.source_unit + (f", saved at step {first.step}" if first.step is not None else "")
            table.add_row(unit, f"{len(actions)} tensors", escape(source), escape(saved))
    return table


def register(app: typer.Typer) -> None:
    """Add ``merge`` to the ``llmtailor`` app."""
    from llmtailor.cli.common import add_command

    add_command(app, "merge", merge)
