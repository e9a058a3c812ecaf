"""Crash test: SIGKILL a real training process at random instants, many times.

    .venv/bin/python bench/crash_test.py --kills 50                 # Full loop, then a shorter Parity loop
    .venv/bin/python bench/crash_test.py --kills 50 --policy full --seed 1
    .venv/bin/python bench/crash_test.py --kills 50 --policy full --async   # kills during async persists

Each loop trains ``python -m llmtailor.training_example`` (a Llama of ``--hidden`` x
``--layers``, saving every step; at 256 x 8 a save is about 60% of a step on our VM) as a real
subprocess, and over and over: starts it (with ``--resume`` once anything is committed), waits
for its first save to finish, then for a seeded 0 to 2 further steps to be logged, sleeps a
seeded random delay of up to one of its step periods (the latest it logged), then
``os.kill(pid, SIGKILL)`` — unless it has already finished. The window counts the job's own
steps, so a pace that changes with the machine's load (a busy CI machine) cannot carry a job to
its end before its kill. Right after each kill, before anything else runs, it looks at the run
directory: a new entry in ``.tmp/`` means the kill landed inside a save, while a partial
snapshot was being written; a ``latest`` pointer behind the newest commit means it landed
between the commit's rename and the pointer update. Then:

- ``Run.verify()`` finds no problem in any committed snapshot;
- every directory in ``snapshots/`` has its manifest (partial writes live only in ``.tmp/``);
- ``Run.latest_step()`` is the largest committed step;
- a ``Tailor.restore()`` in this process loads that step, and the next job resumes after it.

After the last kill one uninterrupted resume finishes the run. With the Full policy every loss
any job logged, and the final weights, must equal bitwise those of an uninterrupted reference
run, however many kills happened. Parity composites are not bitwise equal to the reference, so
that loop checks the store only. Leftover ``.tmp/`` entries (and ``.latest.*.tmp`` files) are
expected until writers clean stale ones, and are counted, not failed.

Summary columns: ``in save`` = ``mid-write`` (a partial snapshot directory was in ``.tmp/``)
+ ``pre-ptr`` (committed, pointer not yet replaced) — kills during staging or after the pointer
update are not counted; ``done 1st`` jobs that finished before their kill; ``max lost`` steps
trained but not committed at a kill; ``.tmp left`` leftovers at the end; ``save/step`` the mean
save's share of a step; ``losses eq`` logged losses bitwise equal to the reference's.

With ``--async`` the job saves with ``async_save=True``: ``save`` returns at once and the
snapshot is written by a background thread while the next steps train, so kills land during
background persists; everything above must hold the same way (a save in flight when the kill
lands is simply not committed). A SIGKILL ends the process, not the machine: the page cache survives, so this tests
the commit protocol's ordering and atomicity, not fsync against power loss.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmtailor import Run, Tailor, make_policy
from llmtailor.constants import LATEST_FILE, MANIFEST_FILE, snapshot_dirname
from llmtailor.training_example import build_model, build_optimizer, job_config

JOB_TIMEOUT_S = 600
KILL_WINDOW_STEPS = 3  # the kill lands within this many of the job's steps after its first save


@dataclass
class CrashReport:
    """What one crash loop saw. ``problems`` is empty when every check passed."""

    policy: str
    async_save: bool = False
    kills: int = 0
    kills_mid_write: int = 0  # a partial snapshot directory appeared in .tmp/
    kills_before_pointer: int = 0  # committed, ``latest`` not yet replaced
    finished_before_kill: int = 0
    max_steps_lost: int = 0  # steps trained but not committed at a kill
    leftovers: int = 0  # .tmp/ entries and .latest.*.tmp files at the end
    steps_compared: int = 0  # logged losses compared bitwise with the reference
    loss_mismatches: int = 0
    digest_match: bool | None = None  # final weights vs the reference (Full only)
    train_s: list[float] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def kills_in_save(self) -> int:
        """Kills that certainly landed inside a save's write or commit."""
        return self.kills_mid_write + self.kills_before_pointer


def crash_loop(
    workdir: Path,
    *,
    kills: int,
    policy: str = "full",
    seed: int = 0,
    hidden: int = 256,
    layers: int = 8,
    steps: int | None = None,
    async_save: bool = False,
    reference: dict | None = None,
    log=print,
    launch=None,
) -> CrashReport:
    """Kill a training job ``kills`` times in ``workdir`` (emptied first), check the store after
    each kill, finish the run, and compare with a reference run when the policy is Full:
    ``reference`` (``reference_run``'s result for the same ``steps``, ``hidden`` and ``layers``;
    one reference serves loops that differ in kills, seed or async saves, which do not change
    what an uninterrupted run computes), else one run here. ``launch(command, stdout, stderr)``
    starts a job (``subprocess.Popen`` by default; the tests fork theirs from an interpreter that
    imported the job, tests/forked_nodes.py): what it returns is polled, killed and waited for."""
    start = time.perf_counter()
    steps = steps or default_steps(kills)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    run_dir = workdir / "run"
    report = CrashReport(policy, async_save)
    job = _JobCommand(policy, steps, hidden, layers, async_save)
    rng = random.Random(seed)
    launch = launch or _popen

    if policy != "full":
        reference = None  # Parity composites are not bitwise equal to an uninterrupted run
    elif reference is None:
        reference = reference_run(workdir / "reference", steps=steps, hidden=hidden, layers=layers,
                                  async_save=async_save, launch=launch)
        log(f"[{policy}] reference run: {steps} steps")

    checker_model = build_model(job_config(hidden, layers), seed=7)
    checker_optimizer, checker_scheduler = build_optimizer(checker_model, total_steps=steps)
    logs: list[Path] = []
    committed: int | None = None
    for i in range(kills):
        resume = committed is not None
        logs.append(workdir / f"job-{i:03d}.log")
        leftovers_before = _leftovers(run_dir)
        with open(logs[-1], "w") as stdout, open(logs[-1].with_suffix(".err"), "w") as stderr:
            proc = launch(job.args(run_dir, workdir / "job.json", resume), stdout, stderr)
        try:
            first = _wait_for_first_save(proc, logs[-1])
            if first is not None:
                # Whole steps counted in the log (events: the job's progress, whatever its pace),
                # then an instant within a step at the job's latest pace (the latest step and save
                # it logged; the first, a warm-up, while no later one is).
                if _wait_for_step(proc, logs[-1], first + rng.randrange(KILL_WINDOW_STEPS)):
                    time.sleep(rng.uniform(0, _step_periods(_read_log(logs[-1]))[-1]))
            if proc.poll() is not None:
                report.finished_before_kill += 1
                if proc.returncode != 0:
                    error = logs[-1].with_suffix(".err").read_text()[-2000:]
                    report.problems.append(f"job {i} exited {proc.returncode}: {error}")
                break
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        report.kills += 1
        # First thing after the kill: what the killed save left behind.
        mid_write = any(name.startswith(".tmp/") for name in _leftovers(run_dir) - leftovers_before)
        before_pointer = _pointer_behind(run_dir)
        report.kills_mid_write += mid_write
        report.kills_before_pointer += before_pointer

        records = _read_log(logs[-1])
        first = next((r["step"] for r in records if "step" in r), None)
        if resume and first is not None and first != committed + 1:
            report.problems.append(f"job {i} resumed at step {first}, the newest composite was {committed}")
        committed, problems = check_store(run_dir)
        report.problems += [f"after kill {i + 1}: {p}" for p in problems]
        restored = _restore_step(run_dir, checker_model, checker_optimizer, checker_scheduler, policy)
        if restored != committed:
            report.problems.append(f"after kill {i + 1}: restore() gave {restored}, latest committed is {committed}")
        trained = max((r["step"] for r in records if "step" in r), default=committed)
        report.max_steps_lost = max(report.max_steps_lost, (trained or 0) - (committed or 0))
        where = "mid-write" if mid_write else "before pointer" if before_pointer else "outside save"
        log(f"[{policy}] kill {i + 1:3d}/{kills}: trained to {trained}, committed {committed}, {where}")

    final = _run_to_end(job.args(run_dir, workdir / "final.json", resume=Run(run_dir).latest_step() is not None), launch)
    logs.append(workdir / "final.log")
    logs[-1].write_text(final.pop("stdout"))
    committed, problems = check_store(run_dir)
    report.problems += [f"after the final run: {p}" for p in problems]
    if committed != steps:
        report.problems.append(f"the final run ended with step {committed} committed, expected {steps}")
    for path in logs:
        for record in _read_log(path):
            if "step" in record:
                report.train_s.append(record["train_s"])
                if reference is not None:
                    report.steps_compared += 1
                    if record["loss"] != reference["losses"].get(str(record["step"])):
                        report.loss_mismatches += 1
                        report.problems.append(f"{path.name}: loss of step {record['step']} differs from the reference")
            if "saved" in record:
                report.save_s.append(record["save_s"])
    if reference is not None:
        report.digest_match = final["params"] == reference["params"]
        if not report.digest_match:
            report.problems.append("final weights differ from the uninterrupted reference")
    report.leftovers = len(_leftovers(run_dir))
    report.seconds = time.perf_counter() - start
    return report


def default_steps(kills: int) -> int:
    """Steps of a loop of ``kills`` kills: each job trains a few steps past its first save before
    its kill, and the run must not end before the last kill."""
    return 4 * kills + 10


def reference_run(workdir: Path, *, steps: int, hidden: int = 256, layers: int = 8, async_save: bool = False,
                  launch=None) -> dict:
    """An uninterrupted Full run of ``steps`` steps in ``workdir`` (emptied first), saving every
    step: its result (losses by step, final weights' digest); ``launch`` as ``crash_loop``'s."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    job = _JobCommand("full", steps, hidden, layers, async_save)
    return _run_to_end(job.args(workdir / "run", workdir / "reference.json", resume=False), launch or _popen)


def check_store(run_dir: Path) -> tuple[int | None, list[str]]:
    """The newest committed step, and what is wrong with the run directory."""
    run = Run(run_dir)
    problems = [f"verify: {p}" for p in run.verify()]
    if run.snapshots_dir.is_dir():
        problems += [
            f"{child} has no {MANIFEST_FILE}: a partial snapshot outside .tmp/"
            for child in sorted(run.snapshots_dir.iterdir())
            if not (child / MANIFEST_FILE).is_file()
        ]
    steps = run.steps()
    latest = run.latest_step()
    if latest != (steps[-1] if steps else None):
        problems.append(f"latest_step() is {latest}, the largest committed step is {steps[-1]}")
    return latest, problems


@dataclass(frozen=True)
class _JobCommand:
    policy: str
    steps: int
    hidden: int
    layers: int
    async_save: bool = False

    def args(self, run: Path, out: Path, resume: bool) -> list[str]:
        return [
            sys.executable, "-m", "llmtailor.training_example", "--run", str(run), "--out", str(out),
            "--policy", self.policy, "--steps", str(self.steps), "--save-every", "1",
            "--hidden", str(self.hidden), "--layers", str(self.layers), *(["--resume"] if resume else []),
            *(["--async"] if self.async_save else []),
        ]  # fmt: skip


def _popen(args: list[str], stdout, stderr) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=stdout, stderr=stderr)


def _run_to_end(args: list[str], launch) -> dict:
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = launch(args, stdout, stderr)
        try:
            returncode = proc.wait(timeout=JOB_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stdout.seek(0)
        stderr.seek(0)
        if returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {returncode}:\n{stderr.read()[-3000:]}")
        printed = stdout.read()
    out = json.loads(Path(args[args.index("--out") + 1]).read_text())
    return {**out, "stdout": printed}


def _wait_for_first_save(proc: subprocess.Popen, log: Path) -> int | None:
    """The step of the job's first save, once that save is done; None if the job ended first."""
    return _wait_for(proc, log, lambda records: next((r["saved"] for r in records if "saved" in r), None), "no save")


def _wait_for_step(proc: subprocess.Popen, log: Path, step: int) -> bool:
    """Whether the job logged ``step`` (trained) before it ended."""
    return _wait_for(proc, log, lambda records: any(r.get("step", 0) >= step for r in records) or None,
                     f"step {step} not logged") is not None


def _wait_for(proc: subprocess.Popen, log: Path, seen, what: str):
    """``seen(records)`` of the job's log once it is not None; None if the job ended first."""
    deadline = time.monotonic() + JOB_TIMEOUT_S  # the bound on a hung job
    while proc.poll() is None:
        found = seen(_read_log(log) if log.stat().st_size else [])
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {JOB_TIMEOUT_S} s; see {log}")
        time.sleep(0.005)
    return None


def _step_periods(records: list[dict]) -> list[float]:
    """Seconds of each logged step plus its save."""
    train = {r["step"]: r["train_s"] for r in records if "step" in r}
    return [train[r["saved"]] + r["save_s"] for r in records if "saved" in r and r["saved"] in train]


def _read_log(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass  # a line cut by the kill
    return records


def _leftovers(run_dir: Path) -> set[str]:
    """Entries of ``.tmp/`` and stray temporary files of the ``latest`` pointer."""
    run = Run(run_dir)
    entries = {f".tmp/{p.name}" for p in run.tmp_dir.iterdir()} if run.tmp_dir.is_dir() else set()
    return entries | {p.name for p in run_dir.glob(f".{LATEST_FILE}.*.tmp")}


def _pointer_behind(run_dir: Path) -> bool:
    latest = Run(run_dir).latest_step()
    try:
        pointer = (run_dir / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        pointer = None
    return latest is not None and pointer != snapshot_dirname(latest)


def _restore_step(run_dir: Path, model, optimizer, scheduler, policy: str) -> int | str | None:
    """The step a fresh Tailor restores in this process (an error message if it fails)."""
    tailor = Tailor(run_dir, model, optimizer, scheduler, policy=make_policy(policy))
    if tailor.latest_step() is None:
        return None
    try:
        return tailor.restore().step
    except Exception as err:  # any failure is a finding to report, not a reason to stop the loop
        return f"{type(err).__name__}: {err}"


def summary_table(reports: list[CrashReport]) -> str:
    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    header = (
        f"{'policy':<12} {'kills':>5} {'in save':>7} {'mid-write':>9} {'pre-ptr':>7} {'done 1st':>8} {'max lost':>8} "
        f"{'.tmp left':>9} {'save/step':>9} {'losses eq':>10} {'digest eq':>9} {'problems':>8} {'time s':>7}"
    )
    rows = [header, "-" * len(header)]
    for r in reports:
        fraction = mean(r.save_s) / (mean(r.save_s) + mean(r.train_s))
        losses = f"{r.steps_compared - r.loss_mismatches}/{r.steps_compared}" if r.steps_compared else "n/a"
        digest = "n/a" if r.digest_match is None else "yes" if r.digest_match else "NO"
        name = r.policy + (" async" if r.async_save else "")
        rows.append(
            f"{name:<12} {r.kills:>5} {r.kills_in_save:>7} {r.kills_mid_write:>9} {r.kills_before_pointer:>7} "
            f"{r.finished_before_kill:>8} {r.max_steps_lost:>8} {r.leftovers:>9} {fraction:>9.2f} "
            f"{losses:>10} {digest:>9} {len(r.problems):>8} {r.seconds:>7.0f}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50, help="kills of the Full loop")
    parser.add_argument("--policy", choices=["full", "parity", "filter"], help="run only this policy's loop")
    parser.add_argument("--parity-kills", type=int, help="kills of the Parity loop (default: kills / 5, at least 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path("bench/out/crash"))
    parser.add_argument("--async", dest="async_save", action="store_true", help="the job saves asynchronously")
    args = parser.parse_args()

    torch.set_num_threads(1)
    parity_kills = args.parity_kills or max(2, args.kills // 5)
    loops = [(args.policy, args.kills)] if args.policy else [("full", args.kills), ("parity", parity_kills)]
    reports = [
        crash_loop(
            args.workdir / policy, kills=kills, policy=policy, seed=args.seed, hidden=args.hidden, layers=args.layers,
            async_save=args.async_save,
        )
        for policy, kills in loops
    ]
    print()
    print(summary_table(reports))
    for r in reports:
        for problem in r.problems:
            print(f"PROBLEM [{r.policy}] {problem}")
    if any(r.problems for r in reports):
        sys.exit(1)


if __name__ == "__main__":
    main()
