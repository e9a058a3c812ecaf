"""Bytes and wall time of one synchronous checkpoint save, side by side in one process.

Contenders, all on the same Llama-style model (built from ``transformers.LlamaConfig``,
never downloaded; fp32 weights) and the same AdamW (HF Trainer's decay / no-decay groups),
whose moments exist after one real training step on a 1x16-token batch:

- ``torch.save``  ``{"model": state_dict, "optimizer": state_dict}`` in one file;
- ``HF Trainer``  a real ``transformers.Trainer`` given that model and optimizer, calling its
  own ``_save_checkpoint`` (model.safetensors, config, optimizer.pt, scheduler.pt,
  rng_state.pth, trainer_state.json, training_args.bin); every byte of ``checkpoint-N/``;
- ``ours Full / Parity / Filter``  ``Tailor.save``. A Tailor's first save is always full, so
  each repeat uses a fresh run directory, saves once unmeasured, and measures the second
  save (save index 1: Parity writes the odd layers, Filter layers 0, 1, -2, -1; both also
  write embed, norm and head);
- ``dd``  ``dd if=/dev/zero bs=16M conv=fdatasync`` of about one full checkpoint: the disk.

Per contender: bytes written, *blocking* seconds as the caller sees them, *durable* seconds,
which add a following ``os.sync()``, and the CPU seconds of the call. Our saves fsync every
file; torch.save and the Trainer do not, so the durable column is the fair comparison.
``os.sync()`` runs before each measurement too, so no earlier dirty page is flushed inside
it. Contenders take turns within each repeat and each output is deleted right after it is
measured; medians over ``--repeats`` are reported, then the targets of shared/PRODUCT.md
(Performance) that a synchronous save can check.

    make bench                                     # .venv/bin/python bench/bench_save.py
    .venv/bin/python bench/bench_save.py --layers 8 --hidden 512 --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from llmtailor import Filter, Full, Parity, Policy, Tailor
from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens, hf_param_groups

MB = 1e6


@dataclass
class Result:
    name: str
    bytes: list[int] = field(default_factory=list)
    blocking: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    units: list[str] = field(default_factory=list)  # ours only: the units of the measured save

    def median(self, attr: str) -> float:
        return statistics.median(getattr(self, attr))


@dataclass
class Setup:
    """What every contender saves, and where."""

    out: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    trainer: transformers.Trainer
    full_tensor_bytes: int


def build(args: argparse.Namespace):
    """Model, AdamW and LR scheduler, with optimizer state populated by one training step."""
    config = TinyConfig(
        hidden_size=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        intermediate_size=args.intermediate, seq_len=2048, vocab_size=args.vocab,
    )
    model = build_model(config, seed=0)
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=1000)
    batch = batch_at(corpus_tokens(), step=1, batch_size=1, seq_len=16)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scheduler


def dir_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its finished children (dd)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def measure(result: Result, save: Callable[[], Path]) -> Path:
    """Time ``save()`` blocking and durable; record the bytes of the path it returns."""
    os.sync()  # flush earlier dirty pages now, not inside this measurement
    cpu, start = cpu_seconds(), time.perf_counter()
    path = save()
    blocking = time.perf_counter() - start
    os.sync()
    result.durable.append(time.perf_counter() - start)
    result.blocking.append(blocking)
    result.cpu.append(cpu_seconds() - cpu)
    result.bytes.append(dir_bytes(path))
    return path


def save_torch(setup: Setup, result: Result, repeat: int) -> None:
    path = setup.out / "torch_save.pt"

    def save() -> Path:
        torch.save({"model": setup.model.state_dict(), "optimizer": setup.optimizer.state_dict()}, path)
        return path

    measure(result, save)
    path.unlink()


def save_trainer(setup: Setup, result: Result, repeat: int) -> None:
    setup.trainer.state.global_step = repeat + 1
    folder = Path(setup.trainer.args.output_dir) / f"checkpoint-{repeat + 1}"

    def save() -> Path:
        setup.trainer._save_checkpoint(setup.model, trial=None)
        return folder

    measure(result, save)
    if repeat == 0:
        print("  HF Trainer wrote:", ", ".join(f"{p.name} {p.stat().st_size / MB:.1f} MB" for p in sorted(folder.iterdir())))
    shutil.rmtree(folder)


def save_tailor(policy: Policy) -> Callable[[Setup, Result, int], None]:
    def run(setup: Setup, result: Result, repeat: int) -> None:
        run_dir = setup.out / f"tailor-{type(policy).__name__.lower()}-{repeat}"
        tailor = Tailor(run_dir, setup.model, setup.optimizer, setup.scheduler, policy=policy)
        tailor.save(1)  # the first save of a lineage is full: not measured
        reports = []

        def save() -> Path:
            reports.append(tailor.save(2))
            return reports[-1].path

        measure(result, save)
        result.units = reports[-1].units
        if result.bytes[-1] != reports[-1].bytes:
            print(f"  note: report.bytes={reports[-1].bytes}, the snapshot directory holds {result.bytes[-1]}")
        shutil.rmtree(run_dir)

    return run


def write_dd(setup: Setup, result: Result, repeat: int) -> None:
    path = setup.out / "dd.bin"
    count = math.ceil(setup.full_tensor_bytes / (16 << 20))

    def save() -> Path:
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fdatasync"],
                       check=True, capture_output=True)
        return path

    measure(result, save)
    path.unlink()


CONTENDERS = {
    "torch.save": save_torch,
    "HF Trainer": save_trainer,
    "ours Full": save_tailor(Full()),
    "ours Parity": save_tailor(Parity()),
    "ours Filter": save_tailor(Filter()),
    "ours Filter-noaux": save_tailor(Filter(aux=False)),
    "dd fdatasync": write_dd,
}


def tensor_bytes(tailor: Tailor, units: list[str]) -> int:
    """Bytes of the tensors (weights + per-parameter optimizer state) of ``units``."""
    return sum(p.tensor.nbytes for u in units for p in tailor.provider.stage_unit(u).pieces)


def report(by: dict[str, Result], share: dict[str, float], full_tensor_bytes: int) -> None:
    results = list(by.values())
    hf, ts, dd = by["HF Trainer"], by["torch.save"], by["dd fdatasync"]
    dd_rate = dd.median("bytes") / dd.median("durable") / MB
    head = (f"{'contender':<18}{'GB':>7}{'bytes/HF':>9}{'block s':>9}{'durable s':>10}{'cpu s':>7}"
            f"{'dur/HF':>8}{'dur/torch':>10}{'MB/s dur':>9}{'% of dd':>8}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        b, dur = r.median("bytes"), r.median("durable")
        print(
            f"{r.name:<18}{b / 1e9:>7.3f}{b / hf.median('bytes'):>9.3f}{r.median('blocking'):>9.2f}{dur:>10.2f}"
            f"{r.median('cpu'):>7.2f}{dur / hf.median('durable'):>8.3f}{dur / ts.median('durable'):>10.3f}"
            f"{b / dur / MB:>9.0f}{100 * b / dur / MB / dd_rate:>7.0f}%"
        )
    print("(medians; 'block s': the call alone; 'durable s': the call plus os.sync(); 'cpu s': CPU time of the"
          " call; ratios use the durable column: ours fsync inside the call, torch.save and HF Trainer do not)")
    print("blocking only (ours durable vs theirs not):", ", ".join(
        f"{r.name} {r.median('blocking') / hf.median('blocking'):.3f}x HF" for r in results if r.name.startswith("ours")))

    full, parity, filt = by["ours Full"], by["ours Parity"], by["ours Filter"]
    print("\nPRODUCT.md targets")
    parity_tensors = share["ours Parity"] * full_tensor_bytes
    overhead = parity.median("bytes") / parity_tensors - 1
    print(f"  Parity bytes / Full bytes = {parity.median('bytes') / full.median('bytes'):.4f}; tensor share "
          f"{share['ours Parity']:.4f} ({len(parity.units)} units); bytes over its tensors = {100 * overhead:+.3f}% "
          f"(target <= 2%): {'PASS' if overhead <= 0.02 else 'FAIL'}")
    for r in (filt, by["ours Filter-noaux"]):
        ratio = r.median("bytes") / full.median("bytes")
        print(f"  {r.name} bytes / Full bytes = {ratio:.4f}; tensor share {share[r.name]:.4f} "
              f"({', '.join(r.units)}) (target <= 0.23): {'PASS' if ratio <= 0.23 else 'FAIL'}")
    for r in (full, parity, filt, by["ours Filter-noaux"]):
        bytes_ratio = r.median("bytes") / hf.median("bytes")
        time_ratio = r.median("durable") / hf.median("durable")
        print(f"  {r.name} durable time / HF = {time_ratio:.3f} vs bytes / HF + 0.05 = {bytes_ratio + 0.05:.3f}: "
              f"{'PASS' if time_ratio <= bytes_ratio + 0.05 else 'FAIL'}")
    rate = full.median("bytes") / full.median("durable") / MB
    print(f"  ours Full write rate {rate:.0f} MB/s = {100 * rate / dd_rate:.0f}% of dd {dd_rate:.0f} MB/s "
          "(target >= 80% is for background writes; this is the synchronous save)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Default: Llama-3.1-8B's proportions scaled down (32 layers, MLP 3.5x hidden, embed + head
    # about 13% of the parameters), so the paper's Filter setting is comparable.
    sizes = {"layers": 32, "hidden": 1024, "intermediate": 3584, "heads": 16, "kv-heads": 8, "vocab": 32000}
    for flag, default in sizes.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"model size (default {default})")
    parser.add_argument("--repeats", type=int, default=2, help="measured saves per contender (median reported)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                        help="scratch directory, on the disk under test; removed at the end")
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()

    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs")
    model, optimizer, scheduler = build(args)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M params fp32, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}")
    out = args.out / f"bench_save.{os.getpid()}"
    out.mkdir(parents=True)
    print(f"load average at start: {os.getloadavg()}")
    try:
        trainer_args = transformers.TrainingArguments(
            output_dir=str(out / "trainer"), report_to=[], use_cpu=True, save_strategy="no"
        )
        trainer = transformers.Trainer(model=model, args=trainer_args, optimizers=(optimizer, scheduler))
        probe = Tailor(out / "probe", model, optimizer, scheduler)
        full_tensors = tensor_bytes(probe, list(probe.layout.units))
        setup = Setup(out, model, optimizer, scheduler, trainer, full_tensors)
        results = {name: Result(name) for name in CONTENDERS}
        # Contenders take turns within each repeat, so a slow spell of a shared machine is not
        # charged to one contender alone.
        for repeat in range(args.repeats):
            for name, run in CONTENDERS.items():
                r = results[name]
                run(setup, r, repeat)
                print(f"  repeat {repeat + 1} {name:<13} {r.bytes[-1] / 1e9:.3f} GB  block {r.blocking[-1]:6.2f} s"
                      f"  durable {r.durable[-1]:6.2f} s  cpu {r.cpu[-1]:6.2f} s", flush=True)
        share = {name: tensor_bytes(probe, results[name].units) / full_tensors for name in CONTENDERS if name.startswith("ours")}
    finally:
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.suppress(OSError):
            args.out.rmdir()  # only when empty: another run may be using it
    print(f"load average at end: {os.getloadavg()}")
    report(results, share, full_tensors)
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
