"""The ``llmtailor`` command line: parses arguments, calls the library, renders results.

A user's mistake (a TailorError) prints one clear line and exits with status 2; no traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from llmtailor.errors import TailorError
from llmtailor.store.run import Run

app = typer.Typer(
    help="Layer-wise tailoring of LLM training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)

RunArg = Annotated[Path, typer.Argument(help="Run directory (the one given to Tailor).")]
StepOpt = Annotated[int | None, typer.Option("--step", help="Composite as of this step (default: newest).")]


def _user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except TailorError as err:
            errors.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def add_command(target: typer.Typer, name: str, command: Callable[..., Any]) -> None:
    """Register ``command`` as ``name`` with the CLI's user-error handling; a second call with
    the same name does nothing (the package and tests may both register a command)."""
    if not any(info.name == name for info in target.registered_commands):
        target.command(name=name)(_user_errors(command))


def _existing_run(path: Path) -> Run:
    if not path.is_dir():
        raise TailorError(f"{path}: no such run directory")
    return Run(path)


@app.command()
@_user_errors
def demo(
    out: Annotated[Path, typer.Option(help="Where the demo writes its runs.")] = Path("runs/demo"),
    steps: Annotated[int, typer.Option(min=10, help="Training steps (a save every steps/12, the crash 5/8 of the way).")] = 120,
) -> None:
    """Train a tiny Llama on real text with Full, Parity, Filter and Adaptive checkpointing,
    crash, resume from each composite, print the savings and draw them (demo.png)."""
    from llmtailor.demo import run_demo

    run_demo(out, steps=steps, console=console)


@app.command()
@_user_errors
def inspect(run_dir: RunArg, step: StepOpt = None) -> None:
    """Show every snapshot (which units it saved, bytes) and the composite of a step
    (where each unit's version comes from, and how stale it is)."""
    from llmtailor.cli.render import composite_table, snapshots_table

    run = _existing_run(run_dir)
    composite = run.resolve(step)
    console.print(snapshots_table(run, composite.step, console.width))
    console.print(composite_table(run, composite))


@app.command()
@_user_errors
def verify(run_dir: RunArg, step: StepOpt = None) -> None:
    """Check every file against the manifest's checksum (all snapshots, or the files the
    composite of --step needs). Exit 0 when all match; 1 naming each bad file."""
    run = _existing_run(run_dir)
    steps = run.steps()
    if not steps:
        raise TailorError(f"{run_dir}: no committed snapshot in this run directory")
    problems = run.verify(step)
    if problems:
        for problem in problems:
            errors.print(f"[red]bad:[/] {problem}", highlight=False, soft_wrap=True)
        errors.print(f"[bold red]{len(problems)} problem(s)[/]")
        raise typer.Exit(1)
    scope = f"composite of step {step}" if step is not None else f"{len(steps)} snapshot(s)"
    console.print(f"[green]ok[/]: every checksum matches ({scope})")


@app.command()
@_user_errors
def gc(
    run_dir: RunArg,
    keep: Annotated[int, typer.Option("--keep", help="How many newest composites to keep whole.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go; delete nothing.")] = False,
) -> None:
    """Delete every snapshot that the newest K composites do not need. Crash-safe: a
    snapshot is moved out of snapshots/ atomically before its files are removed."""
    from llmtailor.cli.render import retention_table
    from llmtailor.store.lock import WriterLock
    from llmtailor.store.retention import apply_retention, plan_retention

    run = _existing_run(run_dir)
    lock = WriterLock(run.root)
    if not dry_run:
        lock.acquire()  # deleting is writing: never beside a live writer
    try:
        plan = plan_retention(run, keep)
        console.print(retention_table(run, plan, dry_run))
        if not dry_run:
            problems = apply_retention(run, plan)
            for problem in problems:
                errors.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)
            console.print(f"deleted {len(plan.delete) - len(problems)} snapshot(s); kept {len(plan.keep)}")
    finally:
        lock.release()


from llmtailor.cli.assemble import register as _register_assemble  # noqa: E402

from llmtailor.cli.drift import register as _register_drift  # noqa: E402
from llmtailor.cli.import_deepspeed import register as _register_import_deepspeed  # noqa: E402
from llmtailor.cli.import_hf import register as _register_import_hf  # noqa: E402
from llmtailor.cli.merge import register as _register_merge  # noqa: E402

_register_assemble(app)
_register_import_hf(app)
_register_import_deepspeed(app)
_register_drift(app)
_register_merge(app)


def main() -> None:
    app()
