"""Training time with a checkpoint at every step, to a memory tier promoted to disk every N steps.

    .venv/bin/python bench/bench_tiers.py            # both settings below, about 7 minutes
    .venv/bin/python bench/bench_tiers.py --quick    # smoke run on a small model, under a minute

A Llama-style model (``transformers.LlamaConfig``, fp32, never downloaded; by default 8 layers
of hidden 512 and a 4096-token vocabulary, so embeddings and head are 13% of the parameters as
in Llama-3.1-8B) trains with AdamW (HF Trainer's decay / no-decay groups) on real text
(``pydoc_data.topics``), one sequence of ``--seq`` tokens per step. Every contender starts from
the same weights, optimizer state and step (reset between contenders), makes its set-up save,
trains one step to settle, then trains ``--steps`` measured steps, each timed with the save
call that follows it; a save still in flight at the end is drained (``wait``) and the
checkpointer closed (ours: the last save promoted to every tier), timed apart. ``--rounds``
repeats the whole line-up, every other round in reverse order, so a machine whose speed drifts
during the run does not favour the contenders measured first. The figure of merit is the total
time of the measured steps against the ``none`` contender's (ratio and percent slowdown;
target for ours: < 5%); each contender's final weights are also checked against ``none``'s
(a checkpointer must not change training).

Contenders: ``none`` (no checkpointing); ``ours tiers Parity``, ``ours tiers Par nodrift``
and ``ours tiers Adaptive`` (``Tailor(async_save=True, tiers=[Tier(/dev/shm/..., keep=2,
promote_every=N)])`` with ``Parity()`` (drift measured at each save, the default, or not:
``track_drift=False``, which Parity does not need) or ``Adaptive(budget=0.5)``, ``save`` after every step; the run directory on disk
is the durable tier; the first save, always full, is made and waited for before the measured
steps, as in ``bench_async.py``, and reaches disk by promotion like the later ones);
``dcp.async_save disk`` and ``shm`` (torch.distributed.checkpoint on a 1-rank gloo group after
every step, to disk or to /dev/shm; at most one save in flight; the newest two kept, older ones
removed in the background; also a set-up save); ``HF Trainer every N`` (a real
``transformers.Trainer`` given the model and optimizer, its own ``_save_checkpoint`` every N
steps, to disk).

Settings, both in one run: ``threads=1`` (``torch.set_num_threads(1)``: training holds one
core, the other stands in for the idle host CPU of a GPU machine, the setting of the target)
and ``threads=all`` (unpinned: training uses every core, the background work competes).

Restore after a process crash: once the last ``ours tiers Parity`` contender has closed (its
newest composite is then in both tiers), a fresh Tailor with the memory tier restores it
(the report must name the memory tier) and a disk-only Tailor restores the same step, each
into the reset model, unpinned, ``--restores`` times alternately; every file of the disk run
is evicted from the page cache before each (``posix_fadvise(DONTNEED)``; residency checked with
``fincore`` when it is installed), and its ``O_DIRECT`` read rate is printed. The two restored
states must be equal, tensor for tensor. Target: from memory >= 5x faster.

SIGKILL: ``--kills`` times, a child process (this script, ``--child``) trains at one thread
and saves after every step to the memory tier, printing each step once its save call has
returned; it is SIGKILLed at a random moment after a random number of steps, then a fresh
Tailor restores the run. Lost steps = the last step printed - the step restored (target <= 1).
"""

from __future__ import annotations

import argparse
import copy
import gc
import mmap
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from bench_async import Contender, DCPSave, Job, NoCheckpoint, TrainerSave
from common import MB, scratch

from llmtailor import Adaptive, Parity, Tailor, Tier
from llmtailor.training_example import params_digest

QUICK = {"layers": 4, "hidden": 256, "seq": 128, "vocab": 1024, "steps": 8, "rounds": 1, "every": 4, "restores": 2,
         "kills": 1}
"""``--quick``: a smoke run (flags given explicitly still win)."""


class TiersJob(Job):
    """``bench_async.Job`` with a vocabulary of its own size (the corpus is bytes: any size from
    256 up fits), remembering its initial state so every contender starts from it."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args, vocab=args.vocab)
        self.initial = (self.step, copy.deepcopy(self.state()))

    def state(self) -> dict:
        """The live model, optimizer and scheduler state (references, not copies)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def reset(self) -> None:
        self.step, state = self.initial
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])


def tiered(job: Job, run: Path, mem: Path, every: int, policy, **options) -> Tailor:
    """The Tailor of the benchmark: the run on disk behind a memory tier at ``mem``."""
    return Tailor(run, job.model, job.optimizer, job.scheduler, policy=policy,
                  tiers=[Tier(location=str(mem), keep=2, promote_every=every)], **options)


class OursTiers(Contender):
    """An async ``Tailor`` saving to the memory tier; its first save (always full) is made and
    waited for at set-up, which also allocates the reused host buffers, as in a long run."""

    def __init__(self, job: Job, out: Path, mem: Path, every: int, policy, **options):
        super().__init__(job, out)
        self.tailor = tiered(job, out / "run", mem, every, policy, async_save=True, **options)
        self.tailor.save(job.step)
        self.tailor.wait()

    def save(self, step: int) -> None:
        self.tailor.save(step)  # waits for the save in flight, if any: at most one

    def drain(self) -> None:
        self.tailor.wait()

    def close(self) -> None:
        self.tailor.close()


class DCPEveryStep(DCPSave):
    """``bench_async``'s ``dcp.async_save`` keeping the newest two checkpoints (the one in flight
    and the last committed): an older one is removed in the background, as torchtitan's
    ``keep_latest_k`` does, so saving at every step does not fill the disk. One set-up save."""

    def __init__(self, job: Job, out: Path):
        super().__init__(job, out, asynchronous=True)
        self.remover = ThreadPoolExecutor(1)
        self.written: list[Path] = []
        self.save(job.step)
        self.drain()

    def save(self, step: int) -> None:
        super().save(step)  # the previous save is committed before this one starts
        self.written.append(self.out / f"dcp-{step}")
        while len(self.written) > 2:
            self.remover.submit(shutil.rmtree, self.written.pop(0), ignore_errors=True)

    def close(self) -> None:
        self.remover.shutdown(wait=True)


@dataclass(frozen=True)
class Entry:
    name: str
    make: Callable[[Job, Path, Path, int], Contender]
    """(job, its disk directory, its /dev/shm directory, N) -> the contender, set up."""
    every_step: bool = True
    """Saves after every step; else every N steps."""


ENTRIES = [
    Entry("none", lambda job, out, shm, n: NoCheckpoint(job, out)),
    Entry("ours tiers Parity", lambda job, out, shm, n: OursTiers(job, out, shm / "mem", n, Parity())),
    Entry("ours tiers Par nodrift",
          lambda job, out, shm, n: OursTiers(job, out, shm / "mem", n, Parity(), track_drift=False)),
    Entry("ours tiers Adaptive", lambda job, out, shm, n: OursTiers(job, out, shm / "mem", n, Adaptive(budget=0.5))),
    Entry("dcp.async_save disk", lambda job, out, shm, n: DCPEveryStep(job, out)),
    Entry("dcp.async_save shm", lambda job, out, shm, n: DCPEveryStep(job, shm)),
    Entry("HF Trainer every N", lambda job, out, shm, n: TrainerSave(job, out), every_step=False),
]
RESTORED = "ours tiers Parity"
"""The contender whose last run is kept for the restore measurement."""


@dataclass
class Outcome:
    name: str
    steps: list[float] = field(default_factory=list)
    """Seconds of each measured step with the save call after it, every round."""
    drain: list[float] = field(default_factory=list)
    close: list[float] = field(default_factory=list)
    same_weights: list[bool] = field(default_factory=list)
    """Per round: the final weights equal ``none``'s."""


def run_entry(job: TiersJob, entry: Entry, out: Path, shm: Path,
              args: argparse.Namespace) -> tuple[list[float], float, float, str]:
    """One contender from the initial state: set-up, one settling step, ``args.steps`` measured
    steps (each with its save call, if one is due), drain, close. Returns the step seconds, the
    drain and close seconds and the digest of the final weights."""
    job.reset()
    contender = entry.make(job, out, shm, args.every)
    every = 1 if entry.every_step else args.every
    os.sync()
    gc.collect()
    job.train_steps(1)
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        job.train_steps(1)
        if job.step % every == 0:
            contender.save(job.step)
        steps.append(time.perf_counter() - start)
    start = time.perf_counter()
    contender.drain()
    drained = time.perf_counter()
    contender.close()
    return steps, drained - start, time.perf_counter() - drained, params_digest(job.model)


def measure(args: argparse.Namespace, job: TiersJob, entries: list[Entry], threads: str, root: Path,
            shm_root: Path) -> tuple[dict[str, Outcome], tuple[Path, Path] | None]:
    """Every round of the line-up at one setting; also the disk run and memory tier of the last
    ``RESTORED`` contender run (kept, for the restore measurement), or None."""
    torch.set_num_threads(1 if threads == "1" else os.cpu_count() or 1)
    outcomes = {entry.name: Outcome(entry.name) for entry in entries}
    kept = None
    for round_ in range(args.rounds):
        digests = {}
        for entry in entries if round_ % 2 == 0 else entries[::-1]:
            slug = f"{threads}-{round_}-{entry.name.replace(' ', '_')}"
            out, shm = root / slug, shm_root / slug
            out.mkdir()
            shm.mkdir()
            steps, drain, close, digests[entry.name] = run_entry(job, entry, out, shm, args)
            outcome = outcomes[entry.name]
            outcome.steps += steps
            outcome.drain.append(drain)
            outcome.close.append(close)
            print(f"  [threads={threads} round {round_ + 1}] {entry.name:<20} step median "
                  f"{statistics.median(steps):.3f} s, max {max(steps):.3f} s, total {sum(steps):.2f} s; "
                  f"drain {drain:.2f} s, close {close:.2f} s", flush=True)
            gc.collect()
            if entry.name == RESTORED:
                if kept is not None:
                    remove(*kept)
                kept = (out / "run", shm / "mem")
            else:
                remove(out, shm)
        if "none" in digests:
            for name, digest in digests.items():
                outcomes[name].same_weights.append(digest == digests["none"])
    return outcomes, kept


def remove(*paths: Path) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def report(outcomes: dict[str, Outcome], threads: str, args: argparse.Namespace) -> None:
    """The table of one setting (80 columns) and the < 5% target of ours."""
    print(f"\nthreads={threads}: {args.steps} measured steps x {args.rounds} round(s) per contender; "
          f"promotion and HF every {args.every} steps")
    header = (f"{'contender':<21}{'median s':>9}{'mean s':>8}{'total s':>9}{'/none':>7}{'slower':>8}"
              f"{'drain s':>8}{'close s':>8}")
    print(header)
    print("-" * len(header))
    base = sum(outcomes["none"].steps) if "none" in outcomes else None
    for o in outcomes.values():
        total = sum(o.steps)
        ratio = f"{total / base:>7.3f}{100 * (total / base - 1):>+7.1f}%" if base else f"{'-':>7}{'-':>8}"
        print(f"{o.name:<21}{statistics.median(o.steps):>9.3f}{statistics.mean(o.steps):>8.3f}{total:>9.2f}{ratio}"
              f"{statistics.mean(o.drain):>8.2f}{statistics.mean(o.close):>8.2f}")
    differ = [o.name for o in outcomes.values() if not all(o.same_weights)]
    if base:
        print("final weights equal none's in every round: " + ("all" if not differ else "NOT " + ", ".join(differ)))
        for o in outcomes.values():
            if o.name.startswith("ours"):
                slower = 100 * (sum(o.steps) / base - 1)
                print(f"  {o.name}: {slower:+.1f}% vs none (target < 5%): {'PASS' if slower < 5 else 'FAIL'}")
    print("(a step: the training step plus the save call after it; /none: total time of the measured\n"
          " steps over none's; drain: wait for the save in flight at the end; close: ours promotes the\n"
          " last save to every tier)")


# -- restore after a crash ----------------------------------------------------------------------

def evict(root: Path) -> int:
    """Drop every file under ``root`` from the page cache (after ``os.sync``: a dirty page
    cannot be dropped); the number of files."""
    os.sync()
    count = 0
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def direct_read_rate(root: Path) -> float | None:
    """Bytes per second of reading every file under ``root`` with ``O_DIRECT``, past this OS's
    page cache (a VM host's cache may still serve it); None where ``O_DIRECT`` is refused."""
    buffer = mmap.mmap(-1, 16 << 20)  # page-aligned, as O_DIRECT wants
    total, start = 0, time.perf_counter()
    for path in root.rglob("*"):
        if path.is_file():
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                return None
            try:
                while count := os.readv(fd, [buffer]):
                    total += count
            finally:
                os.close(fd)
    return total / (time.perf_counter() - start)


def resident_bytes(root: Path) -> int | None:
    """Bytes of the files under ``root`` in the page cache (``fincore``), or None without it."""
    files = [str(p) for p in root.rglob("*") if p.is_file()]
    if shutil.which("fincore") is None or not files:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                         check=True, capture_output=True, text=True).stdout
    return sum(int(line) for line in out.split())


def tensors_equal(a: object, b: object) -> bool:
    """Two state trees hold the same keys and bitwise equal tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def read_from(report, mem: Path) -> bool:
    """The restore report names the memory tier as where its composite came from."""
    return Path(str(report.tier)).resolve() == mem.resolve()


def measure_restores(args: argparse.Namespace, job: TiersJob, run: Path, mem: Path) -> None:
    """Restore the newest composite from the memory tier and the same step from disk alone,
    alternately, the disk run evicted from the page cache before each; check both give the
    same state; print the medians and their ratio."""
    torch.set_num_threads(os.cpu_count() or 1)  # a restarted process, unpinned
    seconds: dict[str, list[float]] = {"memory": [], "disk": []}
    step, states, evicted, resident = None, {}, [], []
    for repeat in range(args.restores):
        for where in ("memory", "disk") if repeat % 2 == 0 else ("disk", "memory"):
            job.reset()  # another state: everything must come from the checkpoint
            evicted.append(evict(run))
            resident.append(resident_bytes(run))
            with ExitStack() as stack:
                if where == "memory":
                    tailor = stack.enter_context(tiered(job, run, mem, args.every, Parity()))
                    start = time.perf_counter()
                    restored = tailor.restore()
                    seconds[where].append(time.perf_counter() - start)
                    if not read_from(restored, mem):
                        raise SystemExit(f"the tiered restore read step {restored.step} from {restored.tier!r}, "
                                         f"not from the memory tier {mem}")
                    step = step if step is not None else restored.step
                else:
                    tailor = stack.enter_context(Tailor(run, job.model, job.optimizer, job.scheduler, policy=Parity()))
                    start = time.perf_counter()
                    restored = tailor.restore(step=step)
                    seconds[where].append(time.perf_counter() - start)
                if restored.step != step:
                    raise SystemExit(f"restored step {restored.step} from {where}, step {step} before")
            state = copy.deepcopy(job.state())
            if where in states and not tensors_equal(states[where], state):
                raise SystemExit(f"two restores from {where} gave different states")
            states[where] = state
    same = tensors_equal(states["memory"], states["disk"])
    memory, disk = statistics.median(seconds["memory"]), statistics.median(seconds["disk"])
    size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    checked = ("residency not checked (no fincore)" if any(r is None for r in resident) else
               f"at most {max(resident) / MB:.1f} MB still resident after it (fincore)")
    rate = direct_read_rate(run)
    print(f"\nrestore after a crash, step {step}, {args.restores} times from each tier, alternately:")
    print(f"  page cache: posix_fadvise(DONTNEED) on all {max(evicted)} files ({size / MB:.0f} MB) of the disk run\n"
          f"  before each restore; {checked}")
    print("  disk: O_DIRECT read of those files: " + (f"{rate / MB:.0f} MB/s" if rate else "refused")
          + " (a VM host's cache may serve it)")
    print(f"  from memory {memory:.3f} s (median of {[round(s, 3) for s in seconds['memory']]})")
    print(f"  from disk   {disk:.3f} s (median of {[round(s, 3) for s in seconds['disk']]})")
    print(f"  disk / memory = {disk / memory:.1f}x (target >= 5x): {'PASS' if disk / memory >= 5 else 'FAIL'}")
    print(f"  restored model, optimizer and scheduler state equal, tensor for tensor: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit("the memory and disk restores of the same step differ")


# -- SIGKILL ------------------------------------------------------------------------------------

MODEL_FLAGS = ("layers", "hidden", "seq", "vocab", "every")


def child_main(args: argparse.Namespace) -> None:
    """Train at one thread, saving after every step to the memory tier; print each step once
    its save call has returned. Runs until killed (or its parent is gone)."""
    run, mem = map(Path, args.child)
    torch.set_num_threads(1)
    job = TiersJob(args)
    parent = os.getppid()
    tailor = tiered(job, run, mem, args.every, Parity(), async_save=True)
    while os.getppid() == parent:
        job.train_steps(1)
        tailor.save(job.step)
        print(job.step, flush=True)
    tailor.close()


def kill_trial(args: argparse.Namespace, job: TiersJob, out: Path, shm: Path,
               rng: random.Random) -> tuple[int, int, str]:
    """One child SIGKILLed a random time after a random number of steps; returns the last step
    it printed, the step a fresh Tailor restores and the tier it came from."""
    run, mem = out / "run", shm / "mem"
    flags = [f"--{name}={getattr(args, name)}" for name in MODEL_FLAGS]
    target = rng.randint(3, 8)
    with open(out / "child.stderr", "w+") as stderr:
        child = subprocess.Popen([sys.executable, __file__, *flags, "--child", str(run), str(mem)],
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
        printed = (int(line) for line in child.stdout if line.strip().isdigit())
        last, clock = None, time.perf_counter()
        try:
            for last in printed:
                previous, clock = clock, time.perf_counter()
                if last >= target:
                    time.sleep(rng.uniform(0, clock - previous))  # somewhere inside a step
                    break
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        for last in printed:  # what it printed while we slept
            pass
        if last is None or last < target:
            stderr.seek(0)
            raise SystemExit(f"the SIGKILL child ended before step {target}:\n{stderr.read()[-3000:]}")
    job.reset()
    with tiered(job, run, mem, args.every, Parity()) as tailor:
        restored = tailor.restore()
    return last, restored.step, str(restored.tier)


def measure_kills(args: argparse.Namespace, job: TiersJob, root: Path, shm_root: Path) -> None:
    rng = random.Random(args.seed)
    print(f"\nSIGKILL during training, saving every step async to the memory tier ({args.kills} trials):")
    lost = []
    for trial in range(args.kills):
        out, shm = root / f"kill-{trial}", shm_root / f"kill-{trial}"
        out.mkdir()
        shm.mkdir()
        last, step, tier = kill_trial(args, job, out, shm, rng)
        lost.append(last - step)
        where = "memory tier" if Path(tier).resolve() == (shm / "mem").resolve() else tier
        print(f"  trial {trial + 1}: last step printed {last}, restored step {step} from {where}: "
              f"{last - step} step(s) lost")
        remove(out, shm)
    print(f"  most steps lost: {max(lost)} (target <= 1): {'PASS' if max(lost) <= 1 else 'FAIL'}")


# -- main ---------------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512, help="model width (a multiple of 16)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per step")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size (>= 256)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per contender and round")
    parser.add_argument("--rounds", type=int, default=2, help="line-ups per setting, every other one reversed")
    parser.add_argument("--every", type=int, default=5, help="N: promotion to disk (ours) and HF Trainer saves")
    parser.add_argument("--threads", choices=["1", "all", "both"], default="both")
    parser.add_argument("--contenders", default=",".join(e.name for e in ENTRIES),
                        help="comma-separated names to run (default: all)")
    parser.add_argument("--restores", type=int, default=3, help="restores from each tier (0: skip)")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILL trials (0: skip)")
    parser.add_argument("--seed", type=int, default=0, help="of the SIGKILL timing")
    parser.add_argument("--out", type=Path, default=Path("/tmp/llmtailor-bench"), help="scratch directory on disk")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--child", nargs=2, metavar=("RUN", "MEM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    return args


def main() -> None:
    args = parse()
    if args.child:
        child_main(args)
        return
    names = [name.strip() for name in args.contenders.split(",")]
    unknown = set(names) - {e.name for e in ENTRIES}
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; known: {[e.name for e in ENTRIES]}")
    entries = [e for e in ENTRIES if e.name in names]
    args.out = args.out.resolve()
    transformers.utils.logging.disable_progress_bar()

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # DCP's async_save wants a group
    print("command: " + shlex.join([sys.executable, *sys.argv]) + f"  (in {os.getcwd()})")
    print(f"machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; Python {platform.python_version()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}\n"
          f"threads: {args.threads} (1: torch.set_num_threads(1); all: {os.cpu_count()}); disk scratch {args.out}, "
          f"memory tier under /dev/shm")
    job = TiersJob(args)
    params = sum(p.numel() for p in job.model.parameters())
    print(f"model: {params / 1e6:.1f}M params fp32 ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.seq} tokens a step); a Full checkpoint holds {job.full_bytes() / MB:.0f} MB of tensors")
    settings = ["1", "all"] if args.threads == "both" else [args.threads]
    with scratch(args.out, "tiers") as root, scratch(Path("/dev/shm/llmtailor-bench"), "tiers") as shm_root:
        tables, kept = {}, None
        for threads in settings:
            tables[threads], kept_now = measure(args, job, entries, threads, root, shm_root)
            if kept_now is not None:
                if kept is not None:
                    remove(*kept)
                kept = kept_now
        for threads, outcomes in tables.items():
            report(outcomes, threads, args)
        if kept is not None and args.restores > 0:
            measure_restores(args, job, *kept)
        elif args.restores > 0:
            print(f"\nrestore after a crash: not measured ({RESTORED!r} did not run)")
        if args.kills > 0:
            measure_kills(args, job, root, shm_root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
