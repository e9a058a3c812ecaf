"""What every command of the ``llmtailor`` command line uses (the package and each command
module, ``assemble.py``, ``drift.py``, ...): the consoles, the one error line a user's mistake
prints (``fail``; ``user_errors`` around every command), registering a command (``add_command``),
the help of ``--step``, and the run a command reads with the composite as of a step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from llmtailor.errors import TailorError, describe_os_error
from llmtailor.store.run import Run

console = Console(soft_wrap=True)  # a path in a result line is never broken in two
errors = Console(stderr=True, soft_wrap=True)

STEP_HELP = "Composite as of this step: the newest committed snapshot at or before it (default: the newest)."


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except TailorError as err:
            fail(str(err))
        except OSError as err:  # the last line of defence: the library names paths itself
            fail(describe_os_error(err))

    return wrapper


def fail(message: str) -> None:
    """Print ``message`` (plain text) as the CLI's one error line and exit with status 2."""
    errors.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2) from None


def add_command(target: typer.Typer, name: str, command: Callable[..., Any]) -> None:
    """Register ``command`` as ``name`` with the CLI's user-error handling; a second call with
    the same name does nothing (the package and tests may both register a command)."""
    if not any(info.name == name for info in target.registered_commands):
        target.command(name=name)(user_errors(command))


def existing_run(location: str | Path) -> Run:
    """The run at ``location`` (a path or URL); TailorError saying what it is when it is not
    a run (a file, another kind of checkpoint; an empty directory passes: it reports no
    snapshot later)."""
    run = Run(location)
    why = run.storage.detection.describe_non_run()
    if why is not None and not (run.is_local and Path(run.root).is_dir() and run.storage.detection.is_fresh()):
        raise TailorError(why)
    return run


def as_of(run: Run, step: int | None) -> int | None:
    """The committed step whose composite is the run's state as of ``step``: the newest at or
    before it (a note on stderr when that is not ``step`` itself); None stays None."""
    if step is None:
        return None
    steps = run.steps()
    before = [s for s in steps if s <= step]
    if not before:
        shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        raise TailorError(f"{run.root}: no committed snapshot at or before step {step} (committed steps: {shown or 'none'})")
    if before[-1] != step:
        errors.print(f"note: step {step} falls between snapshots; using the composite as of step {before[-1]}",
                     highlight=False, soft_wrap=True)
    return before[-1]
