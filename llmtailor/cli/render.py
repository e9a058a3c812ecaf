"""Rich output of the CLI: tables for ``inspect`` and ``gc``, progress over units."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmtailor.constants import LAYER_PREFIX
from llmtailor.store.run import Composite, Run

if TYPE_CHECKING:  # the drift module imports torch, which rendering a merge's progress does not need
    from llmtailor.drift import DriftHistory
    from llmtailor.store.retention import RetentionPlan


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def _short(unit: str) -> str:
    return unit.removeprefix(LAYER_PREFIX)


def snapshots_table(run: Run, current: int) -> Table:
    """Snapshots x units: ● where the snapshot wrote the unit, otherwise how many steps old the
    unit's version in that snapshot's composite is."""
    steps = run.steps()
    units = list(run.manifest(current).composite)
    table = Table(title=f"{run.root}: {len(steps)} snapshot(s); ● saved here, N = version N steps old")
    table.add_column("step", justify="right")
    for unit in units:
        table.add_column(_short(unit), justify="center")
    table.add_column("bytes", justify="right")
    table.add_column("policy")
    for step in steps:
        manifest = run.manifest(step)
        cells = []
        for unit in units:
            source = manifest.composite.get(unit)
            cells.append("·" if source is None else "[green]●[/]" if source == step else f"[yellow]{step - source}[/]")
        marker = " *" if step == current else ""
        table.add_row(f"{step}{marker}", *cells, human_bytes(manifest.total_bytes()), manifest.policy)
    return table


def composite_table(run: Run, composite: Composite) -> Table:
    """Where each unit of the composite comes from, its bytes and staleness (in steps, and in
    saves: how many saves of the lineage since its version was written)."""
    table = Table(title=f"composite as of step {composite.step}")
    columns = (("unit", "left"), ("version (step)", "right"), ("stale by (steps)", "right"),
               ("stale by (saves)", "right"), ("bytes", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify)
    total = 0
    index = composite.manifest.save_index
    for unit, source in composite.sources.items():
        manifest = run.manifest(source)
        size = manifest.unit_bytes(unit)
        total += size
        table.add_row(unit, str(source), str(composite.step - source), str(index - manifest.save_index), human_bytes(size))
    table.add_row("[bold]total[/]", "", "", "", f"[bold]{human_bytes(total)}[/]")
    return table


def retention_table(run: Run, plan: RetentionPlan, dry_run: bool) -> Table:
    """Each committed snapshot: kept (and for which composite) or deleted, with its bytes."""
    verb = "would delete" if dry_run else "delete"
    table = Table(title=f"{run.root}: keep the composites of steps {', '.join(map(str, plan.composites)) or '-'}")
    for name, justify in (("step", "right"), ("action", "left"), ("bytes", "right")):
        table.add_column(name, justify=justify)
    freed = 0
    for step in sorted(plan.keep + plan.delete):
        size = run.manifest(step).total_bytes() if step in plan.keep else _dir_bytes(run, step)
        if step in plan.delete:
            freed += size
        action = "keep" if step in plan.keep else f"[red]{verb}[/]"
        table.add_row(str(step), action, human_bytes(size))
    table.add_row("", f"[bold]{verb}: {len(plan.delete)}[/]", f"[bold]{human_bytes(freed)}[/]")
    return table


def _dir_bytes(run: Run, step: int) -> int:
    # A doomed snapshot's manifest may be damaged: measure the directory, not the manifest.
    return sum(p.stat().st_size for p in run.snapshot_dir(step).rglob("*") if p.is_file())


@contextmanager
def unit_progress(console: Console, label: str) -> Iterator[Callable[[str, int, int], None]]:
    """A transient progress bar; yields the ``progress(unit, done, total)`` callback that the
    library's long operations (export, import, merge) accept."""
    with Progress(
        TextColumn(f"[bold]{label}[/]"),
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

        yield progress


def drift_table(history: DriftHistory, kind: str) -> Table:
    """Units x saves: each unit's drift as that save measured it; bold where the save wrote it."""
    table = Table(title=f"{kind} drift since each unit's last saved version (bold: saved at that step)")
    table.add_column("unit")
    for step in history.steps:
        table.add_column(str(step), justify="right")
    for unit in history.units:
        cells = []
        for step in history.steps:
            value = history.drift.get(step, {}).get(unit, {}).get(kind)
            text = "-" if value is None else f"{value:.2e}"
            cells.append(f"[bold green]{text}[/]" if unit in history.saved[step] else text)
        table.add_row(_short(unit), *cells)
    table.add_row("[bold]MB written[/]", *[f"{history.bytes[s] / 1e6:.2f}" for s in history.steps])
    table.add_row("[bold]vs Full[/]", *[f"{history.bytes[s] / history.full_bytes[s]:.2f}x" for s in history.steps])
    return table
