"""The ``llmtailor`` command line: parses arguments, calls the library, renders results.

A user's mistake (a TailorError) prints one clear line and exits with status 2; no traceback.
So does an OS error that reaches the CLI (permission denied, read-only file system, an output
path through a file): one line naming the path and the reason. Messages are printed as text,
never as rich markup (``layer_range must be [a, b]`` keeps its brackets).
"""

from __future__ import annotations

import functools
import json
import os
from inspect import cleandoc  # not `import inspect`: the name is a command's
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from llmtailor.cli.common import STEP_HELP, as_of, console, errors, existing_run, fail, user_errors
from llmtailor.errors import SnapshotNotFoundError, TailorError
from llmtailor.store.catalog import empty_run
from llmtailor.store.run import Run
from llmtailor.store.storage.object_options import OPTIONS_ENV


def reflow(text: str | None) -> str | None:
    """``text`` (a docstring) with each paragraph on one line, paragraphs still apart (a blank
    line between), so that the help renderer wraps it to the terminal; a paragraph that click's
    ``\\b`` marks as preformatted keeps its lines."""
    if text is None:
        return None
    paragraphs = cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.splitlines()) for p in paragraphs)


class ReflowingGroup(TyperGroup):
    """The ``llmtailor`` command group: its help and every command's are reflowed when it is
    built. Typer's rich help keeps a docstring's single line breaks in the command list and in
    every paragraph after the first, which printed lines ending mid-sentence at any width."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.help = reflow(self.help)
        for command in self.commands.values():
            command.help = reflow(command.help)

    # Typer 0.29's rich help shows every flag's type, so --dry-run read `<bool>` as if it took a
    # value: a flag (--help included, made when first asked for) is given an empty metavar here,
    # where the group hands out its commands, instead of one on every option.
    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _no_flag_types(command.get_params(ctx))
        return command

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        _no_flag_types([option])
        return option


def _no_flag_types(params: list[Any]) -> None:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


app = typer.Typer(
    cls=ReflowingGroup,
    help="Layer-wise tailoring of LLM training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RunArg = Annotated[str, typer.Argument(help="Run directory or URL (s3://bucket/prefix, gs://, az://): the one given to Tailor.")]
StepOpt = Annotated[int | None, typer.Option("--step", help=STEP_HELP)]


@app.callback()
def _options(
    ctx: typer.Context,
    storage_option: Annotated[
        list[str] | None,
        typer.Option("--storage-option", "-S", metavar="KEY=VALUE",
                     help="An option of the object store runs at URLs live in (endpoint=..., region=..., "
                     "allow_http=true, lock_ttl=...); repeatable. The cloud's environment variables apply too."),
    ] = None,
) -> None:
    """Layer-wise tailoring of LLM training checkpoints."""
    if storage_option:
        options = {}
        for item in storage_option:
            key, sep, value = item.partition("=")
            if not sep or not key:
                fail(f"--storage-option {item!r}: expected KEY=VALUE")
            options[key.strip()] = value
        # Through the environment: every store the command opens (its run, merge sources,
        # tiers, outputs) reads it. For this command only: the next one in the same process (a
        # test's CliRunner, a library caller's second main()) must not inherit them.
        ctx.call_on_close(functools.partial(_restore_env, OPTIONS_ENV, os.environ.get(OPTIONS_ENV)))
        os.environ[OPTIONS_ENV] = json.dumps(options)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@app.command()
@user_errors
def demo(
    out: Annotated[Path, typer.Option(help="Where the demo writes its runs.")] = Path("runs/demo"),
    steps: Annotated[int, typer.Option(min=10, help="Training steps (a save every steps/12, the crash 5/8 of the way).")] = 120,
) -> None:
    """Train a tiny Llama on real text with Full, Parity, Filter and Adaptive checkpointing,
    crash, resume from each composite, print the savings and draw them (demo.png)."""
    from llmtailor.demo import run_demo

    run_demo(out, steps=steps, console=console)


@app.command()
@user_errors
def inspect(run_dir: RunArg, step: StepOpt = None) -> None:
    """Show every snapshot (which units it saved, bytes) and the composite of a step
    (where each unit's version comes from, and how stale it is); for a run with tiers, first
    every tier (retention, cadence, what it holds)."""
    from llmtailor.cli.render import composite_table, snapshots_table

    from llmtailor.cli.render import tiers_table
    from llmtailor.store.tiers import tier_states

    run = existing_run(run_dir)
    tiers = tier_states(run)
    if tiers is not None:
        console.print(tiers_table(tiers))
        if not run.steps():
            console.print(f"{escape(str(run.root))}: no composite in this tier yet (* above); inspect a faster one")
            return
    step = as_of(run, step)
    with run.reading(step) as composite:  # its snapshots stay while they are shown
        run.load_manifests()
        console.print(snapshots_table(run, composite.step, console.width), soft_wrap=False)
        console.print(composite_table(run, composite))
    if tombstones := run.tombstones():
        from llmtailor.store.storage.object_commit import tombstones_note

        console.print(f"[yellow]note:[/] {escape(tombstones_note(tombstones))}", highlight=False, soft_wrap=True)


@app.command()
@user_errors
def verify(run_dir: RunArg, step: StepOpt = None) -> None:
    """Check every file against the manifest's checksum (all snapshots, or the files the
    composite of --step needs) and that the composite (the newest, or --step's) restores.
    Exit 0 when all is well; 1 naming each problem. Older composites that no longer restore
    because retention removed what they need are listed as notes."""
    run = existing_run(run_dir)
    steps = run.steps()
    if not steps:
        raise SnapshotNotFoundError(empty_run(run_dir))
    step = as_of(run, step)
    result = run.check(step)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    if result.problems:
        for problem in result.problems:
            errors.print(f"[red]bad:[/] {escape(problem)}", highlight=False, soft_wrap=True)
        errors.print(f"[bold red]{len(result.problems)} problem(s)[/]")
        errors.print("restore what is named from a copy of the run, or use a --step that verifies", highlight=False)
        raise typer.Exit(1)
    scope = f"composite of step {step}" if step is not None else f"{len(result.checked)} snapshot(s)"
    bases = sorted({escape(str(base)) for base, _ in result.base_checked})
    if bases:
        scope += f"; and the base model directory {', '.join(bases)} ({len(result.base_checked)} file(s))"
    console.print(f"[green]ok[/]: every checksum matches ({scope})")


@app.command()
@user_errors
def gc(
    run_dir: RunArg,
    keep: Annotated[int | None, typer.Option(
        "--keep", help="How many newest composites to keep whole. Without it: each tier the run records keeps its "
        "own number (a run without tiers needs --keep).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go; delete nothing.")] = False,
) -> None:
    """Delete every snapshot that the newest K composites do not need. Crash-safe: a
    snapshot is moved out of snapshots/ atomically before its files are removed; one being
    read is left for the next gc. Refuses a directory that is not a run, touching nothing."""
    from llmtailor.store.retention import check_keep
    from llmtailor.store.tiers import tier_states

    run = Run(run_dir)
    why = run.storage.detection.describe_non_run()
    if why is not None:
        raise TailorError(f"{why}; gc deletes only the snapshots of a run")
    if keep is not None:
        _collect(run, check_keep(keep), dry_run)
        return
    tiers = tier_states(run)
    if tiers is None:
        fail(f"{run_dir} records no tiers: give --keep K (how many newest composites to keep)")
    for tier in tiers:
        if tier.steps is None:
            _wrapped(f"{escape(tier.location)}: {escape(tier.problem)}; not collected")
        elif tier.keep is None:
            _wrapped(f"{escape(tier.location)}: keeps every snapshot (keep=None); not collected")
        else:
            _collect(Run(tier.location), tier.keep, dry_run)


def _collect(run: Run, keep: int, dry_run: bool) -> None:
    """Retention of ``keep`` composites in ``run``, under its writer lock, printed: what it
    deleted, and what crashed writers left that taking the lock cleared."""
    from llmtailor.cli.render import leftovers_line, retention_table
    from llmtailor.store.lock import WriterLock
    from llmtailor.store.retention import apply_retention, plan_retention

    lock = WriterLock(run.storage, new_run=False)
    if not dry_run:
        lock.acquire()  # deleting is writing: never beside a live writer
    try:
        plan = plan_retention(run, keep)
        _wrapped(retention_table(run, plan, dry_run))
        if not dry_run:
            outcome = apply_retention(run, plan)
            for problem in outcome.problems:
                _wrapped(f"[yellow]warning:[/] {escape(problem)}", errors)
            if outcome.in_use:
                _wrapped(f"in use by a reader, left for the next gc: {', '.join(map(str, outcome.in_use))}")
            _wrapped(f"deleted {len(outcome.deleted)} snapshot(s); kept {len(plan.keep)}")
            cleared = leftovers_line(lock.cleared)
            if cleared:
                _wrapped(cleared)
    finally:
        lock.release()


def _wrapped(renderable: Any, to: Console = console) -> None:
    """Print ``renderable`` wrapped at spaces to the terminal's width (80 columns piped), as
    gc's lines are: they may name long paths and URLs."""
    to.print(renderable, soft_wrap=False, highlight=False)


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
    """The ``llmtailor`` command. The libraries it may load for a command say only what the
    user asked for: transformers' warnings about a model config (bos / eos ids, say) are
    silenced, and DeepSpeed is told it runs on the CPU (the CLI only reads and writes its
    files), which it would otherwise announce on every start."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    app()
