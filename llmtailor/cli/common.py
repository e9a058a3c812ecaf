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

from llmtailor.errors import DamagedFileError, SnapshotNotFoundError, TailorError, describe_os_error
from llmtailor.store.catalog import empty_run
from llmtailor.store.run import Run

console = Console(soft_wrap=True)  # a path in a result line is never broken in two
errors = Console(stderr=True, soft_wrap=True)

DAMAGED_ADVICE = "llmtailor verify RUN names every damaged file; an older --step may not read it"
STEP_HELP = "Composite as of this step: the newest committed snapshot at or before it (default: the newest)."


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except TailorError as err:
            fail(str(err) + (f"\n{DAMAGED_ADVICE}" if damaged(err) else ""))
        except OSError as err:  # the last line of defence: the library names paths itself
            fail(describe_os_error(err))

    return wrapper


def damaged(err: BaseException | None) -> bool:
    """Whether ``err`` is a DamagedFileError (a file of a run missing, truncated or corrupted),
    or was raised from one (a message that wraps it), as its traceback would chain them."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, DamagedFileError):
            return True
        seen.add(id(err))
        err = err.__cause__ if err.__cause__ is not None or err.__suppress_context__ else err.__context__
    return False


def fail(message: str) -> None:
    """Print ``message`` (plain text) as the CLI's error and exit with status 2: its first line
    (the cause) after ``error:``, each further line (what to do) indented under it."""
    cause, *rest = message.split("\n")
    errors.print(f"[bold red]error:[/] {escape(cause)}", highlight=False, soft_wrap=True)
    for line in rest:
        errors.print(f"       {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2) from None


def add_command(target: typer.Typer, name: str, command: Callable[..., Any]) -> None:
    """Register ``command`` as ``name`` with the CLI's user-error handling; a second call with
    the same name does nothing (the package and tests may both register a command)."""
    if not any(info.name == name for info in target.registered_commands):
        target.command(name=name)(user_errors(command))


def existing_run(location: str | Path) -> Run:
    """The run at ``location`` (a path or URL); TailorError saying what it is when it is not
    a run (a file, another kind of checkpoint; an empty directory passes: it reports no
    snapshot later), and what to do."""
    from llmtailor.interop.formats import describe_other_format

    run = Run(location)
    why = run.storage.detection.describe_non_run()
    if why is not None and not (run.is_local and Path(run.root).is_dir() and run.storage.detection.is_fresh()):
        if not run.is_local or not Path(run.root).exists():
            raise TailorError(f"{why}\ncheck the path: give the directory (or URL) that a Tailor saved into")
        if describe_other_format(Path(run.root)):
            raise TailorError(why)  # it names the command that takes it
        raise TailorError(f"{why}\ngive a run, or make one of a checkpoint: llmtailor import-hf, import-deepspeed")
    return run


def as_of(run: Run, step: int | None) -> int | None:
    """The committed step whose composite is the run's state as of ``step``: the newest at or
    before it (a note on stderr when that is not ``step`` itself); None stays None."""
    if step is None:
        return None
    steps = run.steps()
    if not steps:
        raise SnapshotNotFoundError(empty_run(run.root))
    before = [s for s in steps if s <= step]
    if not before:
        shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        raise TailorError(f"{run.root}: no committed snapshot at or before step {step} (committed steps: {shown})\n"
                          f"give --step {steps[0]} or later, or no --step for the newest")
    if before[-1] != step:
        errors.print(f"note: step {step} falls between snapshots; using the composite as of step {before[-1]}",
                     highlight=False, soft_wrap=True)
    return before[-1]
