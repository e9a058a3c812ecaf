"""Rich output of the CLI: tables for ``inspect``, ``drift`` and ``gc``, progress over units.

Grids with a column per unit or per save (``inspect``, ``drift``) are laid out for the width
they have (a terminal's, or 80 columns when piped): borderless, one-letter labels where a name
is long, and paged by columns when they still do not fit, never cut to ``…``."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from llmtailor.constants import LAYER_PREFIX
from llmtailor.store.catalog import Composite
from llmtailor.store.manifest import tensor_bytes
from llmtailor.store.run import Run

T = TypeVar("T")

if TYPE_CHECKING:  # the drift module imports torch, which rendering a merge's progress does not need
    from llmtailor.drift import DriftHistory
    from llmtailor.store.tiers import TierState
    from llmtailor.store.retention import RetentionPlan
    from llmtailor.store.storage import Leftovers


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def _short(unit: str) -> str:
    return unit.removeprefix(LAYER_PREFIX)


# One-letter column labels for the auxiliary units in grids (layers are their index).
_LETTERS = {"embed": "E", "norm": "N", "head": "H", "other": "O"}


def _label(unit: str) -> str:
    return _LETTERS.get(unit, _short(unit))


def _grid() -> Table:
    """A borderless table whose columns sit one space apart: grids of many narrow columns."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1), collapse_padding=True)


def paged(build: Callable[[list[T]], Table], columns: list[T], width: int) -> list[Table]:
    """Tables of ``build(page)`` for consecutive pages of ``columns``, each page as long as
    still fits ``width`` (at least one column): a wide grid is read page after page, never
    squeezed into ``…``."""
    pages: list[list[T]] = []
    rest = list(columns)
    while rest:
        fit = 1
        low, high = 1, len(rest)
        while low <= high:  # the longest page that fits (widths grow with the page)
            middle = (low + high) // 2
            if _width(build(rest[:middle])) <= width:
                fit, low = middle, middle + 1
            else:
                high = middle - 1
        pages.append(rest[:fit])
        rest = rest[fit:]
    return [build(page) for page in pages] or [build([])]


def _width(table: Table) -> int:
    console = Console(width=10_000, file=io.StringIO())
    return Measurement.get(console, console.options, table).maximum


def snapshots_table(run: Run, current: int, width: int = 80) -> Group:
    """Snapshots x units, paged to ``width``: ● where the snapshot wrote the unit, otherwise how
    many saves old the unit's version in that snapshot's composite is (× where that version's
    snapshot is no longer in the run)."""
    steps = run.steps()
    units = list(run.manifest(current).composite)
    rows = []
    for step in steps:
        manifest = run.manifest(step)
        cells = {}
        for unit in units:
            source = manifest.composite.get(unit)
            if source is None:
                cells[unit] = "·"
            elif source == step:
                cells[unit] = "[green]●[/]"
            elif source not in steps:
                cells[unit] = "[red]×[/]"
            else:
                cells[unit] = f"[yellow]{manifest.save_index - run.manifest(source).save_index}[/]"
        rows.append((f"{step}{' *' if step == current else ''}", cells, human_bytes(manifest.total_bytes())))

    def build(page: list[str]) -> Table:
        table = _grid()
        table.add_column("step", justify="right", no_wrap=True)
        for unit in page:
            table.add_column(_label(unit), justify="center", no_wrap=True)
        table.add_column("bytes", justify="right", no_wrap=True)
        for step, cells, size in rows:
            table.add_row(step, *(cells[u] for u in page), size)
        return table

    tables = paged(build, units, width)
    aux = ", ".join(f"{_LETTERS[u]} {u}" for u in units if u in _LETTERS)
    head = Text.from_markup(
        f"[bold]{escape(str(run.root))}[/]: {len(steps)} snapshot(s); * the composite shown below\n"
        f"● saved here; N: that composite's version is N saves old; × its snapshot is gone. "
        f"Columns: layers by index; {aux}."
    )
    return Group(head, *tables, Text(_policies(run, steps), style="dim"))


def _policies(run: Run, steps: list[int]) -> str:
    """Which policy wrote which snapshots, as runs of steps: ``policy Parity(): steps 2-30``."""
    spans: list[tuple[str, int, int]] = []
    for step in steps:
        policy = run.manifest(step).policy
        if spans and spans[-1][0] == policy:
            spans[-1] = (policy, spans[-1][1], step)
        else:
            spans.append((policy, step, step))
    return "; ".join(f"policy {p}: step {a}" if a == b else f"policy {p}: steps {a}-{b}" for p, a, b in spans)


def composite_table(run: Run, composite: Composite) -> Table:
    """Where each unit of the composite comes from, its staleness (in steps, and in saves: how
    many saves of the lineage since its version was written), the bytes its version wrote, and
    the frozen tensors it keeps (bytes, and from where: an older snapshot, or the base model)."""
    table = Table(title=f"composite as of step {composite.step}")
    columns = (("unit", "left"), ("version", "right"), ("stale: steps", "right"), ("saves", "right"),
               ("written", "right"), ("frozen kept", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    written = kept = 0
    index = composite.manifest.save_index
    for unit, source in composite.sources.items():
        manifest = run.manifest(source)
        size = manifest.unit_bytes(unit)
        entry = run.unit_entry(source, unit)
        origins: dict[str, int] = {}
        for tensor in entry.tensors:
            origin = entry.files[tensor.chunks[0].file].origin
            if origin is not None:
                where = "base" if origin == "base" else f"@{origin}"
                origins[where] = origins.get(where, 0) + tensor_bytes(tensor)
        written += size
        kept += sum(origins.values())
        held = ", ".join(f"{human_bytes(b)} {w}" for w, b in origins.items()) or "-"
        table.add_row(unit, str(source), str(composite.step - source), str(index - manifest.save_index),
                      human_bytes(size), held)
    table.add_row("[bold]total[/]", "", "", "", f"[bold]{human_bytes(written)}[/]", f"[bold]{human_bytes(kept)}[/]")
    base = composite.manifest.base
    if base is not None:
        table.caption = f"frozen tensors kept from the base model directory {escape(str(base.path))} ({len(base.files)} file(s))"
    return table


def tiers_table(states: list[TierState]) -> Table:
    """The tiers a run records, fastest first: retention, cadence, what each holds now."""
    table = Table(title="tiers, fastest first (saves commit to the first; composites move down)", title_justify="left")
    for name, justify in (("tier", "left"), ("keep", "right"), ("promote", "right"), ("snapshots", "right"),
                          ("newest", "right"), ("behind", "right")):
        table.add_column(name, justify=justify, overflow="fold")
    bound = None  # the faster tier's max_lag: how far this one may fall behind
    for state in states:
        this = " *" if state.here else ""
        every = f"every {state.promote_every}" if state.promote_every is not None else "-"
        keep = "all" if state.keep is None else str(state.keep)
        behind = "-" if state.lag is None else f"{state.lag}" + (f" of {bound}" if bound is not None else "")
        if state.steps is None:
            table.add_row(escape(state.location) + this, keep, every, f"[yellow]{escape(state.problem)}[/]", "", "")
        else:
            table.add_row(escape(state.location) + this, keep, every, str(len(state.steps)),
                          "-" if state.newest is None else str(state.newest), behind)
        bound = state.max_lag
    table.caption = "behind: steps behind the newest composite of the tier above (of N: its max_lag)"
    return table


def retention_table(run: Run, plan: RetentionPlan, dry_run: bool) -> Group:
    """Each committed snapshot: kept (and for which composite) or deleted, with its bytes;
    under a heading naming the run (a line of its own, wrapped: a run's path may be long)."""
    verb = "would delete" if dry_run else "delete"
    steps = ", ".join(map(str, plan.composites)) or "-"
    head = Text.assemble((str(run.root), "bold"), f": keep the composites of steps {steps}")
    table = Table()
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
    return Group(head, table)


def leftovers_line(cleared: Leftovers) -> str | None:
    """What clearing crashed writers' leftovers removed, in a line; None when nothing."""
    done = [f"removed {cleared.files} {cleared.noun}(s)"] if cleared.files else []
    if cleared.uploads:
        done.append(f"aborted {cleared.uploads} upload(s)")
    return f"leftovers of interrupted saves: {', '.join(done)}" if done else None


def _dir_bytes(run: Run, step: int) -> int:
    # A doomed snapshot's manifest may be damaged: measure the directory, not the manifest.
    return sum(size for _, size in run.storage.walk(run.snapshot_key(step)))


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
        disable=not console.is_terminal,  # piped: no bar, and no blank line where it was
    ) as bar:
        task = bar.add_task("", total=None)

        def progress(unit: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=unit)

        yield progress


def drift_table(history: DriftHistory, kind: str, width: int = 80) -> Group:
    """Units x saves, paged to ``width``: each unit's drift as that save measured it (``*`` where
    the save wrote it, readable piped too; 0: unchanged, e.g. frozen; -: not measured), then the
    bytes written."""

    def build(page: list[int]) -> Table:
        table = _grid()
        table.add_column("unit", no_wrap=True)
        for step in page:
            table.add_column(str(step), justify="right", no_wrap=True)
        for unit in history.units:
            cells = []
            for step in page:
                text = _sci(history.drift.get(step, {}).get(unit, {}).get(kind))
                cells.append(f"[bold green]{text}*[/]" if unit in history.saved[step] else f"{text} ")
            table.add_row(_short(unit), *cells)
        table.add_section()
        table.add_row("MB", *[f"{history.bytes[s] / 1e6:.2f} " for s in page])
        table.add_row("x Full", *[f"{history.bytes[s] / history.full_bytes[s]:.2f} " for s in page])
        return table

    head = Text.from_markup(
        f"[bold]{kind} drift[/] since each unit's last saved version, at each save (columns: steps); "
        "[bold green]*[/]: saved at that step; 0: unchanged (frozen); -: not measured. "
        "MB: bytes the save wrote; x Full: that over a Full save's."
    )
    return Group(head, *paged(build, history.steps, width))


def _sci(value: float | None) -> str:
    """Drift in 6 characters at most: ``8.1e-3``; ``0`` exactly zero; ``-`` not measured."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"
