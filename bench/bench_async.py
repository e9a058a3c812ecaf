"""Training stall per checkpoint, side by side in one run: async and sync savers vs HF Trainer.

    .venv/bin/python bench/bench_async.py                    # both settings below, ~25 minutes
    .venv/bin/python bench/bench_async.py --layers 4 --hidden 256 --steps-between 2 --saves 1   # quick look
    python3 bench/bench_async.py --device cuda --threads all ...  # on a GPU machine (bench/gpu_check.sh)

A Llama-style model of a few hundred million parameters (``transformers.LlamaConfig``, fp32,
never downloaded) trains with AdamW (HF Trainer's decay / no-decay groups) on real text
(``pydoc_data.topics``), one sequence of ``--seq`` tokens per step. Each contender trains
``--steps-between`` steps, then saves and trains ``--steps-between`` steps again, ``--saves``
times; a save still in flight at the end is drained (``wait``), reported apart. Every step and
every save call is timed. The **stall per save** is the time the save call blocked plus the
extra time of the steps that follow it (fence waits, contention with the background write),
each step against the median of the same contender's steps before its first save; the ``none``
row (no checkpointing, same run) measured the same way gives the noise floor of this estimate.

Contenders: ``HF Trainer`` (a real ``transformers.Trainer`` given the model and optimizer,
its own ``_save_checkpoint``), ``torch.save`` (model and optimizer state dicts), ``dcp.save``
and ``dcp.async_save`` (torch.distributed.checkpoint on a 1-rank gloo group; at most one
async save in flight, as for ours), ours sync (Full, Parity) and ours async (Full, Parity;
``Tailor(async_save=True)``, whose fence is an optimizer step pre-hook).

Settings, both in one run: ``threads=1`` (``torch.set_num_threads(1)``: training holds one
core, the other stands in for the idle host CPU of a GPU machine, the setting of the 50x
target) and ``threads=all`` (unpinned: training uses every core, the background write
competes with it).

Background write throughput: the bytes of each async save of ours divided by the seconds its
background thread spent persisting them (fsync included), vs ``dd if=/dev/zero bs=16M
conv=fdatasync`` of the same size in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from llmtailor import Full, Parity, SaveReport, Tailor
from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens, hf_param_groups

MB = 1e6


@dataclass
class Outcome:
    name: str
    threads: str
    before: list[float] = field(default_factory=list)
    """Seconds of the steps before the first save: this contender's own baseline."""
    save_calls: list[float] = field(default_factory=list)
    """Seconds each ``save`` call blocked."""
    after: list[list[float]] = field(default_factory=list)
    """Seconds of the steps between each save and the next one (or the end)."""
    drain: float = 0.0
    """Seconds spent waiting for a save still in flight after the last step."""
    saves: int = 0
    bytes: int = 0
    fence: float = 0.0
    persist: list[tuple[int, float]] = field(default_factory=list)
    """(bytes, seconds) of each background persist (ours async)."""


class Job:
    """The model, its optimizer and data; each contender trains it for a while."""

    def __init__(self, args: argparse.Namespace, vocab: int = 32000):
        config = TinyConfig(hidden_size=args.hidden, layers=args.layers, heads=16, kv_heads=8,
                            intermediate_size=int(3.5 * args.hidden), seq_len=args.seq, vocab_size=vocab)
        self.device = torch.device(args.device)
        self.model = build_model(config, seed=0).to(self.device)
        self.optimizer = torch.optim.AdamW(hf_param_groups(self.model), lr=1e-5)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.tokens = corpus_tokens()
        self.seq = args.seq
        self.step = 0
        self.train_steps(1)  # optimizer state exists from here on

    def train_steps(self, count: int) -> list[float]:
        """Train ``count`` steps; return each one's wall seconds."""
        durations = []
        for _ in range(count):
            start = time.perf_counter()
            self.step += 1
            batch = batch_at(self.tokens, self.step, 1, self.seq).to(self.device)
            self.model(input_ids=batch, labels=batch).loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # a step ends when the GPU has done it
            durations.append(time.perf_counter() - start)
        return durations

    def full_bytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        return total


class Contender:
    """A way of checkpointing ``job`` into ``out``: no checkpoint at all, by default."""

    def __init__(self, job: Job, out: Path):
        self.job, self.out = job, out
        self.fence_seconds = 0.0
        self.persist: list[tuple[int, float]] = []

    def save(self, step: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class NoCheckpoint(Contender):
    pass


class TrainerSave(Contender):
    """A real Trainer around the same model and optimizer; its own ``_save_checkpoint``."""

    def __init__(self, job: Job, out: Path):
        super().__init__(job, out)
        args = transformers.TrainingArguments(output_dir=str(out), report_to=[], use_cpu=job.device.type == "cpu",
                                              save_strategy="no")
        self.trainer = transformers.Trainer(model=job.model, args=args, optimizers=(job.optimizer, job.scheduler))

    def save(self, step: int) -> None:
        self.trainer.state.global_step = step
        self.trainer._save_checkpoint(self.job.model, trial=None)


class TorchSave(Contender):
    def save(self, step: int) -> None:
        torch.save({"model": self.job.model.state_dict(), "optimizer": self.job.optimizer.state_dict()},
                   self.out / f"torch-{step}.pt")


class DCPSave(Contender):
    """``dcp.save`` or ``dcp.async_save`` of the full state; at most one async save in flight."""

    def __init__(self, job: Job, out: Path, asynchronous: bool):
        super().__init__(job, out)
        self.asynchronous = asynchronous
        self.pending = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.job.model, self.job.optimizer)
        state, target = {"model": model_sd, "optim": optim_sd}, str(self.out / f"dcp-{step}")
        if self.asynchronous:
            self.drain()
            self.pending = dcp.async_save(state, checkpoint_id=target)
        else:
            dcp.save(state, checkpoint_id=target)

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


class OursSave(Contender):
    """A ``Tailor``; its first save (always full) is made and waited for before the measured
    steps (for an async one this also allocates the reused host buffers, as in a long run)."""

    def __init__(self, job: Job, out: Path, policy, asynchronous: bool):
        super().__init__(job, out)
        self.tailor = Tailor(out / "run", job.model, job.optimizer, job.scheduler, policy=policy, async_save=asynchronous)
        self.tailor.save(job.step)
        self.tailor.wait()
        self.pending = None

    def save(self, step: int) -> None:
        self._collect()
        self.pending = self.tailor.save(step)

    def _collect(self) -> None:
        if self.pending is not None and not isinstance(self.pending, SaveReport):
            report = self.pending.result()
            self.persist.append((report.rank_bytes, self.pending.persist_seconds))
        self.pending = None

    def drain(self) -> None:
        self._collect()
        self.tailor.wait()

    def close(self) -> None:
        if self.tailor._stager is not None:
            self.fence_seconds = self.tailor._stager.fence_seconds
        self.tailor.close()


CONTENDERS: dict[str, Callable[[Job, Path], Contender]] = {
    "none": NoCheckpoint,
    "HF Trainer": TrainerSave,
    "torch.save": TorchSave,
    "dcp.save": lambda job, out: DCPSave(job, out, False),
    "dcp.async_save": lambda job, out: DCPSave(job, out, True),
    "ours sync Full": lambda job, out: OursSave(job, out, Full(), False),
    "ours sync Parity": lambda job, out: OursSave(job, out, Parity(), False),
    "ours async Full": lambda job, out: OursSave(job, out, Full(), True),
    "ours async Parity": lambda job, out: OursSave(job, out, Parity(), True),
}


def run_contender(job: Job, contender: Contender, outcome: Outcome, between: int, saves: int) -> None:
    """Train ``between`` steps then save, ``saves`` times, then ``between`` more steps; drain.
    Every step and every save call is timed."""
    os.sync()
    gc.collect()
    job.train_steps(1)  # settle after the contender's set-up
    outcome.before = job.train_steps(between)
    for _ in range(saves):
        start = time.perf_counter()
        contender.save(job.step)
        outcome.save_calls.append(time.perf_counter() - start)
        outcome.after.append(job.train_steps(between))
    start = time.perf_counter()
    contender.drain()
    outcome.drain = time.perf_counter() - start
    contender.close()
    outcome.fence = contender.fence_seconds
    outcome.persist = contender.persist


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def dd_rate(out: Path, size: int) -> float:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dd.bin"
    count = max(1, round(size / (16 << 20)))
    os.sync()
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fdatasync"], check=True,
                   capture_output=True)
    seconds = time.perf_counter() - start
    written = path.stat().st_size
    path.unlink()
    return written / seconds


def measure(args: argparse.Namespace, job: Job, threads: str) -> list[Outcome]:
    torch.set_num_threads(1 if threads == "1" else os.cpu_count() or 1)
    results = []
    for name, make in CONTENDERS.items():
        if args.only and name not in ("none", "HF Trainer", *args.only):
            continue
        out = args.out / f"threads-{threads}" / name.replace(" ", "_")
        out.mkdir(parents=True, exist_ok=True)
        contender = make(job, out)
        outcome = Outcome(name, threads)
        before = _bytes(out)
        run_contender(job, contender, outcome, args.steps_between, args.saves)
        outcome.bytes = (_bytes(out) - before) // max(1, args.saves)
        results.append(outcome)
        steps = [round(d, 3) for after in outcome.after for d in after]
        print(f"  [threads={threads}] {name:<18} before {[round(d, 3) for d in outcome.before]} s, save calls {[round(c, 2) for c in outcome.save_calls]} s, steps {steps} s, "
              f"drain {outcome.drain:.2f} s, fence {outcome.fence:.2f} s", flush=True)
        del contender
        shutil.rmtree(out, ignore_errors=True)
        gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps-between", type=int, default=4, help="training steps between checkpoints")
    parser.add_argument("--saves", type=int, default=2, help="measured checkpoints per contender")
    parser.add_argument("--threads", choices=["1", "all", "both"], default="both")
    parser.add_argument("--out", type=Path, default=Path("bench/out/async"))
    parser.add_argument("--only", type=lambda text: [n.strip() for n in text.split(",")], default=[],
                        help="these contenders (comma-separated names) beside none and HF Trainer")
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu or cuda (a GPU machine; "
                        "--threads all there)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    transformers.utils.logging.disable_progress_bar()

    import torch.distributed as dist

    store = dist.HashStore()
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)  # DCP's async_save wants a group
    job = Job(args)
    params = sum(p.numel() for p in job.model.parameters())
    full = job.full_bytes()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"model {params / 1e6:.0f}M params fp32 ({args.layers} layers, hidden {args.hidden}) on {where}; a full "
          f"checkpoint holds {full / 1e9:.2f} GB of tensors; {os.cpu_count()} CPUs; load {os.getloadavg()}")
    settings = ["1", "all"] if args.threads == "both" else [args.threads]
    tables = {}
    try:
        for threads in settings:
            tables[threads] = measure(args, job, threads)
        rate_dd = dd_rate(args.out, full)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    for threads, results in tables.items():
        report(results, threads, args)
    print(f"\ndisk: dd conv=fdatasync of {full / 1e9:.2f} GB: {rate_dd / MB:.0f} MB/s")
    for threads, results in tables.items():
        for r in results:
            if r.persist:
                written = sum(b for b, _ in r.persist)
                seconds = sum(s for _, s in r.persist)
                rate = written / seconds
                print(f"  [threads={threads}] {r.name}: background persist {rate / MB:.0f} MB/s = "
                      f"{100 * rate / rate_dd:.0f}% of dd (target >= 80%)")


def report(results: list[Outcome], threads: str, args: argparse.Namespace) -> None:
    """Stall per save: the save call plus the extra time of the steps after it, each against the
    median of the same contender's steps before its first save (so a machine whose speed drifts
    during the run does not bias one contender)."""
    base = statistics.median(results[0].before + [d for after in results[0].after for d in after])
    print(f"\nthreads={threads}: {args.saves} saves, {args.steps_between} steps apart; a step without "
          f"checkpointing: {base:.2f} s (median)")
    stall = {}
    for r in results:
        own = statistics.median(r.before)
        stall[r.name] = statistics.mean(c + sum(d - own for d in after) for c, after in zip(r.save_calls, r.after))
    header = (f"{'contender':<18} {'stall/save s':>12} {'HF / this':>10} {'save call s':>11} {'fence s':>8} "
              f"{'drain s':>8} {'GB/save':>8}")
    print(header)
    print("-" * len(header))
    for r in results[1:]:
        ratio = stall["HF Trainer"] / stall[r.name] if stall[r.name] > 0 else float("inf")
        print(f"{r.name:<18} {stall[r.name]:>12.3f} {ratio:>10.1f} {statistics.mean(r.save_calls):>11.3f} "
              f"{r.fence / len(r.save_calls):>8.3f} {r.drain:>8.2f} {r.bytes / 1e9:>8.2f}")
    print(f"(none row, no checkpointing: {stall['none']:+.3f} s, the noise floor of this estimate; "
          "stall/save: the save call plus the extra time of the steps after it, vs the contender's own steps before; "
          "fence: optimizer steps' wait for the copies, per save; target for ours async: >= 50x less than HF at threads=1)")


if __name__ == "__main__":
    main()
