"""The end-to-end demo behind ``make demo`` / ``llmtailor demo``.

A tiny Llama-style model is trained on real text five times: once without checkpoints (the
reference), then once per policy (Full, Parity, Filter, Adaptive) with a ``Tailor`` saving
every few steps. Each checkpointed run "crashes" part-way — its model, optimizer and scheduler are
thrown away — and resumes from the newest composite into objects built from another seed,
then trains to the end. Two tables compare what each policy wrote and how close its final
loss lands to the reference; ``demo.png`` beside the runs draws both for the four policies
(bytes per save over the run; loss after the resume against the uninterrupted run), and
``drift.png`` the Adaptive run's measured drift per unit and save (``llmtailor drift``).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmtailor.constants import LAYER_PREFIX
from llmtailor.errors import ConfigError, TailorError
from llmtailor.policies import Adaptive, Filter, Full, Parity, Policy
from llmtailor.store.run import Run
from llmtailor.tailor import SaveReport, Tailor
from llmtailor.training_example import TinyConfig, build_model, build_optimizer, corpus_tokens, train_steps

# 16 layers, so that Filter's "first two and last two layers" really skips most of them
# (with 8 it would write as many layers per save as Parity). About 0.15 s a step on one core.
DEMO_CONFIG = TinyConfig(hidden_size=64, layers=16, heads=4, kv_heads=2, intermediate_size=128, seq_len=128)
DEMO_BATCH_SIZE = 8
SEED = 0
CRASH_SEED = 1  # fresh objects after the crash start from other weights, so nothing can leak
POLICIES: dict[str, Policy] = {
    "full": Full(), "parity": Parity(), "filter": Filter(), "adaptive": Adaptive(budget=0.5, max_staleness=4),
}


@dataclass(frozen=True)
class PolicyRun:
    """One checkpointed, crashed and resumed run."""

    name: str
    policy: str
    run_dir: Path
    save_steps: list[int]
    save_bytes: list[int]
    save_seconds: list[float]
    save_units: list[int]
    restored_step: int
    sources: dict[str, int]
    """Unit -> step its restored version came from."""
    final_loss: float
    resumed_losses: list[float]
    """Loss of each step after the restore (``restored_step + 1`` .. the last step)."""

    @property
    def mean_bytes(self) -> float:
        return mean(self.save_bytes)

    @property
    def mean_bytes_after_first(self) -> float:
        """Mean bytes of the saves after the first (which is always full)."""
        return mean(self.save_bytes[1:] or self.save_bytes)

    @property
    def median_seconds(self) -> float:
        """Median, not mean: one fsync stalled by other I/O on the disk would swamp a mean."""
        return median(self.save_seconds)


@dataclass(frozen=True)
class DemoResult:
    """Everything the demo measured."""

    steps: int
    save_every: int
    crash_at: int
    reference_losses: list[float]
    runs: dict[str, PolicyRun]
    seconds: float

    @property
    def reference_final_loss(self) -> float:
        return self.reference_losses[-1]


def run_demo(
    out_dir: Path,
    steps: int = 120,
    save_every: int | None = None,
    crash_at: int | None = None,
    console: Console | None = None,
    *,
    config: TinyConfig = DEMO_CONFIG,
    batch_size: int = DEMO_BATCH_SIZE,
) -> DemoResult:
    """Train, checkpoint with each policy into ``out_dir/<policy>``, crash, resume, compare.

    By default a save every ``steps // 12`` steps (10 of 120) and the crash five eighths of the
    way (75 of 120), between two saves so that steps are replayed. Earlier demo runs in
    ``out_dir/<policy>`` are replaced. Prints progress bars, two comparison tables and an
    explanation on ``console``, writes ``demo.png`` and ``drift.png``; returns the figures."""
    save_every, crash_at = schedule(steps, save_every, crash_at)
    problems = [f"{k}={v!r} must be a positive integer" for k, v in
                {"steps": steps, "save_every": save_every, "crash_at": crash_at, "batch_size": batch_size}.items()
                if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if not problems and not save_every <= crash_at < steps:
        problems.append(f"crash_at={crash_at!r} must be at least save_every ({save_every}), so a save precedes "
                        f"the crash, and below steps ({steps})")
    if problems:
        raise ConfigError("demo: " + "; ".join(problems))
    assert isinstance(save_every, int) and isinstance(crash_at, int)
    # Checked before any training, so a wrong directory fails fast and is left untouched.
    run_dirs = {name: Path(out_dir) / name for name in POLICIES}
    _clear_previous_runs(list(run_dirs.values()))
    console = console or Console()
    start = time.perf_counter()
    job = _Job(corpus_tokens(), config, batch_size, steps, save_every,
               Progress(*_COLUMNS, console=console))
    # One thread: the model is too small to gain from more, and extra threads spinning on a
    # busy machine slowed training several-fold. It also leaves a core free for the saves' I/O.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with job.progress:
            task = job.progress.add_task("uninterrupted (reference)", total=steps, loss=float("nan"))
            reference, _ = job.train(job.fresh(SEED), 1, steps, task)
            runs = {name: _run_with_crash(job, name, policy, run_dirs[name], crash_at)
                    for name, policy in POLICIES.items()}
    finally:
        torch.set_num_threads(threads)
    result = DemoResult(steps, save_every, crash_at, reference, runs, time.perf_counter() - start)
    _print_report(result, config, console)
    from llmtailor.drift import drift_history
    from llmtailor.plots import plot_drift

    plot_drift(drift_history(Run(run_dirs["adaptive"])), "weight", Path(out_dir) / "drift.png")
    plot_demo(result, Path(out_dir) / "demo.png")
    console.print(
        f"The four policies side by side (bytes per save; loss after the resume): [bold]{escape(str(Path(out_dir) / 'demo.png'))}[/]\n"
        f"Drift of the Adaptive run, per unit and save: {escape(str(Path(out_dir) / 'drift.png'))} "
        f"(llmtailor drift {escape(str(run_dirs['adaptive']))} --plot FILE)"
    )
    return result


def plot_demo(result: DemoResult, out: Path) -> None:
    """Write ``demo_figure`` to ``out`` (PNG)."""
    from llmtailor.plots import save_png

    save_png(demo_figure(result), out)


def demo_figure(result: DemoResult):
    """The demo's policies side by side: bytes each save wrote over the run (the crash marked),
    and, after each run's restore, its loss minus the uninterrupted run's at the same step
    (Full: exactly zero, it resumed bit for bit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for index, run in enumerate(result.runs.values()):
        color = f"C{index}"
        left.plot(run.save_steps, [b / 1e6 for b in run.save_bytes], marker="o", markersize=4, color=color,
                  label=f"{run.name} ({sum(run.save_bytes) / 1e6:.1f} MB in all)")
        steps = range(run.restored_step + 1, run.restored_step + 1 + len(run.resumed_losses))
        delta = [loss - result.reference_losses[step - 1] for step, loss in zip(steps, run.resumed_losses)]
        exact = all(d == 0 for d in delta)
        final = 100 * delta[-1] / result.reference_losses[-1]
        right.plot(list(steps), delta, color=color, linewidth=2.5 if exact else 1.2,
                   label=f"{run.name}" + (": bit for bit (0)" if exact else f": {final:+.3f}% at the end"))
    left.axvline(result.crash_at, color="grey", linestyle="--", linewidth=1)
    left.annotate("crash", (result.crash_at, 0), textcoords="offset points", xytext=(3, 3), fontsize=8, color="grey")
    left.set_xlabel("step of the save")
    left.set_ylabel("MB written by the save")
    left.set_ylim(bottom=0)
    left.set_title(f"Bytes per save (one every {result.save_every} steps; the first is always full)", fontsize=10)
    left.legend(fontsize=8)
    right.axhline(0, color="black", linewidth=0.6)
    right.set_xlabel("training step after the restore")
    right.set_ylabel("loss - uninterrupted run's loss")
    right.set_title(f"After the crash at step {result.crash_at}: resumed vs uninterrupted", fontsize=10)
    right.legend(fontsize=8)
    return fig


def schedule(steps: int, save_every: int | None = None, crash_at: int | None = None) -> tuple:
    """``(save_every, crash_at)`` for a demo of ``steps`` steps, each derived where not given:
    a save every ``steps // 12`` steps (at least 2), the crash five eighths of the way, moved
    off a save's step so that the resumed run replays some steps. Unchecked (``run_demo`` checks)."""
    if save_every is None and isinstance(steps, int):
        save_every = max(2, steps // 12)
    if crash_at is None and isinstance(steps, int) and isinstance(save_every, int) and save_every > 0:
        crash_at = max(save_every, steps * 5 // 8)
        if crash_at % save_every == 0 and crash_at + 1 < steps:
            crash_at += 1
    return save_every, crash_at


_COLUMNS = (TextColumn("{task.description:<31}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn())


@dataclass
class _Job:
    """What every run of the demo shares: the data, the model shape, the schedule."""

    tokens: torch.Tensor
    config: TinyConfig
    batch_size: int
    steps: int
    save_every: int
    progress: Progress

    def fresh(self, seed: int) -> tuple:
        model = build_model(self.config, seed)
        return (model, *build_optimizer(model, total_steps=self.steps))

    def train(self, objects: tuple, first: int, last: int, task,
              tailor: Tailor | None = None) -> tuple[list[float], list[SaveReport]]:
        """Steps ``first..last``; with a ``tailor``, a save every ``save_every`` steps."""
        losses, saves = [], []
        for step, loss in train_steps(*objects, self.tokens, range(first, last + 1),
                                      self.batch_size, self.config.seq_len):
            losses.append(loss)
            self.progress.update(task, advance=1, loss=loss)
            if tailor is not None and step % self.save_every == 0:
                saves.append(tailor.save(step, extra={"step": step}))
        return losses, saves


def _run_with_crash(job: _Job, name: str, policy: Policy, run_dir: Path, crash_at: int) -> PolicyRun:
    """Train with checkpoints to ``crash_at``, lose every live object, restore, finish."""
    # The bar counts training steps: after the restore it steps back to the restored step, and
    # the steps between it and the crash are trained again.
    task = job.progress.add_task(f"{name}: crash at {crash_at}", total=job.steps, loss=float("nan"))
    objects = job.fresh(SEED)
    _, saves = job.train(objects, 1, crash_at, task, Tailor(run_dir, *objects, policy=policy))
    # The crash: only what the Tailor committed survives. Building from another seed makes
    # sure every restored value comes from disk, not from a lucky identical initialisation.
    del objects
    objects = job.fresh(CRASH_SEED)
    tailor = Tailor(run_dir, *objects, policy=policy)
    restored = tailor.restore()
    job.progress.update(task, completed=restored.step, description=f"{name}: crashed {crash_at}, resumed {restored.step}")
    losses, later_saves = job.train(objects, restored.step + 1, job.steps, task, tailor)
    saves += later_saves
    return PolicyRun(
        name=name, policy=policy.describe(), run_dir=run_dir,
        save_steps=[s.step for s in saves], save_bytes=[s.bytes for s in saves],
        save_seconds=[s.seconds for s in saves], save_units=[len(s.units) for s in saves],
        restored_step=restored.step, sources=restored.sources, final_loss=losses[-1], resumed_losses=losses,
    )


def _clear_previous_runs(paths: list[Path]) -> None:
    """Remove an earlier demo's runs; delete nothing unless each path is a run or empty."""
    foreign = [p for p in paths if p.is_file() or (p.is_dir() and any(p.iterdir()) and not Run(p).steps())]
    if foreign:
        raise TailorError(f"{', '.join(map(str, foreign))}: exists and is not an llmtailor run; "
                          "choose another demo output directory")
    for path in paths:
        if path.exists():
            shutil.rmtree(path)


def _print_report(result: DemoResult, config: TinyConfig, console: Console) -> None:
    full = result.runs["full"]
    saves = Table(title=f"Saves, one every {result.save_every} steps",
                  caption="; ".join(f"{run.name} = {run.policy}" for run in result.runs.values()))
    for header in ("policy", "saves", "total", "mean/save", "bytes vs Full", "median save s", "time vs Full"):
        saves.add_column(header, justify="left" if header == "policy" else "right")
    for run in result.runs.values():
        saves.add_row(run.name, str(len(run.save_bytes)), f"{sum(run.save_bytes) / 1e6:.1f} MB",
                      f"{run.mean_bytes / 1e6:.2f} MB",
                      f"{run.mean_bytes / full.mean_bytes:.2f}x", f"{run.median_seconds:.3f}",
                      f"{run.median_seconds / full.median_seconds:.2f}x")
    resume = Table(title=f"Crash at step {result.crash_at}, restore, train to step {result.steps}\n"
                         f"(uninterrupted run's final loss: {result.reference_final_loss:.6f})")
    for header in ("policy", "restored", "units from", "final loss", "vs uninterrupted"):
        resume.add_column(header, justify="left" if header in ("policy", "units from") else "right")
    for run in result.runs.values():
        delta = run.final_loss - result.reference_final_loss
        resume.add_row(run.name, f"step {run.restored_step}", _summarize_sources(run.sources),
                       f"{run.final_loss:.6f}", "bitwise identical" if delta == 0 else
                       f"{delta:+.4f} ({100 * delta / result.reference_final_loss:+.2f}%)")
    console.print(saves, "", resume, "")
    exact = full.final_loss == result.reference_final_loss
    parity, filter_, adaptive = (result.runs[n].mean_bytes_after_first / full.mean_bytes
                                 for n in ("parity", "filter", "adaptive"))
    console.print(
        f"Each run trained the same {config.layers}-layer Llama-style model on the same batches of pydoc text. "
        f"At step {result.crash_at} its model, optimizer and scheduler were discarded; fresh ones built from "
        f"another seed were filled by [bold]Tailor.restore()[/] with the composite of step {full.restored_step} "
        "(each unit, with its optimizer state, from the newest snapshot holding it); training replayed the "
        f"lost steps and went on to step {result.steps}. Full wrote every unit at every save and "
        + ("resumed bit for bit: its final loss equals the uninterrupted run's. " if exact else
           "[bold red]did not reproduce the uninterrupted run's loss: a bug.[/] ")
        + f"Parity wrote half the layers per save ({parity:.2f}x Full's bytes after its first, full save); "
        f"Filter the first and last two layers every save and the rest every {POLICIES['filter'].every}th "
        f"({filter_:.2f}x); Adaptive the units that drifted most since their last save, within half a Full "
        f"save and none staler than {POLICIES['adaptive'].max_staleness} saves ({adaptive:.2f}x). "
        "Their composites mix layers from older steps, so they resumed from a slightly "
        f"different state; the last column shows what that cost. Runs: {full.run_dir.parent}/; "
        f"took {result.seconds:.0f} s."
    )


def _summarize_sources(sources: dict[str, int]) -> str:
    """Which saves the restored units came from, one line per save: ``@70: 3 aux, 8 layers``."""
    lines = []
    for step in sorted(set(sources.values()), reverse=True):
        units = [unit for unit, source in sources.items() if source == step]
        layers = sum(unit.startswith(LAYER_PREFIX) for unit in units)
        aux = len(units) - layers
        kinds = ([f"{aux} aux"] if aux else []) + ([f"{layers} layers"] if layers else [])
        lines.append(f"@{step}: " + ", ".join(kinds))
    return "\n".join(lines)
