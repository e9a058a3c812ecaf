"""Quality study: does resuming from a tailored composite cost anything? One command.

    .venv/bin/python bench/quality_study.py                  # ~20 minutes on 2 cores; writes bench/out/quality/
    .venv/bin/python bench/quality_study.py --steps 120 --crash 70 --save-every 10   # quick look
    .venv/bin/python bench/quality_study.py --seed 1 --out /tmp/q1   # another initialisation and batch order

A Llama-style model of a few million parameters (hidden 192, 8 layers, built from a config,
never downloaded) trains on ``pydoc_data.topics`` (byte tokens; the last 10% of the text is
held out) with AdamW and a warm-up + linear-decay schedule until its loss flattens. Every arm
sees the same seeds and the same batches (a batch is a function of the step).

1. One run trains to the crash step with four ``Tailor`` objects saving it every
   ``--save-every`` steps, one per arm: Full, Parity, Filter (layers 0, 1, -2, -1 and the
   auxiliary units every save, the rest every 4th) and Adaptive with a byte budget equal to
   Parity's share of a full save (by the bytes the first, full save wrote per unit; it joins at
   that save). Saving does not change training, so the four runs record the very same training.
2. The crash: every live object is thrown away. The same run also goes on uninterrupted to
   the end (the reference).
3. Each arm restores its newest composite into a model built from another seed, replays the
   steps lost since that save, and trains to the end.

Reported per arm: final training loss (mean of the last 20 steps) and held-out loss vs the
uninterrupted run and vs the resume from Full; total checkpoint bytes written. PNG plots: the
loss curves after the crash, and bytes per snapshot per arm. Targets (PRODUCT.md): every arm
within 1% of resume-from-Full; Adaptive at least as close as Parity at the same bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmtailor import Adaptive, Filter, Full, Parity, Policy, Tailor
from llmtailor.training_example import TinyConfig, build_model, build_optimizer, corpus_tokens

CONFIG = TinyConfig(hidden_size=192, layers=8, heads=4, kv_heads=2, intermediate_size=768, seq_len=128)
BATCH, EVAL_BATCHES = 8, 16


@dataclass
class Data:
    train: torch.Tensor
    held_out: torch.Tensor
    seed: int

    @classmethod
    def split(cls, seed: int) -> Data:
        tokens = corpus_tokens()
        cut = int(0.9 * tokens.numel())
        return cls(tokens[:cut], tokens[cut:], seed)

    def batch(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1_000_003 * self.seed + index)
        starts = torch.randint(0, tokens.numel() - CONFIG.seq_len - 1, (BATCH,), generator=generator)
        return torch.stack([tokens[s : s + CONFIG.seq_len] for s in starts.tolist()])


@dataclass
class Arm:
    name: str
    losses: dict[int, float] = field(default_factory=dict)
    held_out: dict[int, float] = field(default_factory=dict)
    save_bytes: dict[int, int] = field(default_factory=dict)
    restored_from: int | None = None


def fresh(seed: int, steps: int):
    model = build_model(CONFIG, seed)
    optimizer, scheduler = build_optimizer(model, lr=3e-3, total_steps=steps)
    return model, optimizer, scheduler


def train_step(objects, data: Data, step: int) -> float:
    model, optimizer, scheduler = objects
    model.train()
    batch = data.batch(data.train, step)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def held_out_loss(model, data: Data) -> float:
    model.eval()
    losses = [model(input_ids=(b := data.batch(data.held_out, -1 - i)), labels=b).loss.item() for i in range(EVAL_BATCHES)]
    model.train()
    return statistics.mean(losses)


def parity_fraction(unit_bytes: dict[str, int]) -> float:
    """Parity's share of a full save: the auxiliary units and half the layers, by the bytes a
    full save wrote per unit."""
    layers = [u for u in unit_bytes if u.startswith("layer.")]
    saved = sum(b for u, b in unit_bytes.items() if u not in layers) + sum(unit_bytes[u] for u in layers[: (len(layers) + 1) // 2])
    return saved / sum(unit_bytes.values())


def run(args: argparse.Namespace) -> dict[str, Arm]:
    data = Data.split(args.seed)
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    objects = fresh(args.seed, args.steps)
    policies: dict[str, Policy] = {"full": Full(), "parity": Parity(), "filter": Filter()}
    print(f"model: {sum(p.numel() for p in objects[0].parameters()) / 1e6:.2f}M params; {args.steps} steps, a save every "
          f"{args.save_every}, crash at {args.crash}", flush=True)
    tailors = {name: Tailor(out / name, *objects, policy=policy) for name, policy in policies.items()}
    arms = {name: Arm(name) for name in ["uninterrupted", *policies, "adaptive"]}
    reference = arms["uninterrupted"]
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        reference.losses[step] = train_step(objects, data, step)
        if step % args.eval_every == 0:
            reference.held_out[step] = held_out_loss(objects[0], data)
        if step < args.crash and step % args.save_every == 0:
            for name, tailor in list(tailors.items()):
                report = tailor.save(step)
                arms[name].save_bytes[step] = report.bytes
                if name == "full" and "adaptive" not in tailors:
                    # Adaptive's budget: Parity's share of a full save, by the files' bytes.
                    policies["adaptive"] = Adaptive(budget=parity_fraction(report.unit_bytes), max_staleness=args.max_staleness)
                    print(f"  Adaptive budget = Parity's share = {policies['adaptive'].budget:.3f} of a full save", flush=True)
                    tailors["adaptive"] = Tailor(out / "adaptive", *objects, policy=policies["adaptive"])
                    arms["adaptive"].save_bytes[step] = tailors["adaptive"].save(step).bytes
        if step % 100 == 0:
            print(f"  uninterrupted step {step}: loss {reference.losses[step]:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    for tailor in tailors.values():
        tailor.close()
    # The crash happened at args.crash; each arm resumes from its newest composite.
    for name, policy in policies.items():  # full, parity, filter, adaptive
        arm = arms[name]
        resumed = fresh(args.seed + 1, args.steps)  # another initialisation: the restore must overwrite it
        tailor = Tailor(out / name, *resumed, policy=policy)
        arm.restored_from = tailor.restore().step
        for step in range(arm.restored_from + 1, args.steps + 1):
            arm.losses[step] = train_step(resumed, data, step)
            if step % args.eval_every == 0:
                arm.held_out[step] = held_out_loss(resumed[0], data)
            if step % args.save_every == 0:
                arm.save_bytes[step] = tailor.save(step).bytes
        tailor.close()
        print(f"  {name}: resumed from {arm.restored_from}, final loss {arm.losses[args.steps]:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    (out / "results.json").write_text(json.dumps({n: a.__dict__ for n, a in arms.items()}))
    return arms


def report(arms: dict[str, Arm], args: argparse.Namespace) -> None:
    def final(arm: Arm) -> float:
        return statistics.mean(arm.losses[s] for s in range(args.steps - 19, args.steps + 1))

    reference, full = arms["uninterrupted"], arms["full"]
    last_eval = max(reference.held_out)
    print(f"\nfinal training loss = mean of steps {args.steps - 19}..{args.steps}; held-out loss at step {last_eval}")
    header = (f"{'arm':<14} {'resumed':>8} {'train loss':>11} {'vs uninterr.':>13} {'vs Full':>9} {'held-out':>9} "
              f"{'vs Full':>9} {'ckpt MB':>9} {'vs Full':>8} {'MB/save':>8}")
    print(header)
    print("-" * len(header))
    for name, arm in arms.items():
        t, h = final(arm), arm.held_out[last_eval]
        total = sum(arm.save_bytes.values())
        full_total = sum(full.save_bytes.values())
        later = [b for s, b in sorted(arm.save_bytes.items())[1:]]  # after the first, always full, save
        per_save = statistics.mean(later) / 1e6 if later else 0.0
        print(f"{name:<14} {str(arm.restored_from or '-'):>8} {t:>11.4f} {100 * (t / final(reference) - 1):>+12.2f}% "
              f"{100 * (t / final(full) - 1):>+8.2f}% {h:>9.4f} {100 * (h / full.held_out[last_eval] - 1):>+8.2f}% "
              f"{total / 1e6:>9.1f} {total / full_total if name != 'uninterrupted' else 0:>7.2f}x {per_save:>8.2f}")
    print("(targets: every arm within 1% of resume-from-Full; Adaptive at least as close as Parity at Parity's bytes)")


def plot(arms: dict[str, Arm], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, held, sizes) = plt.subplots(3, 1, figsize=(9, 11), constrained_layout=True)
    window = 20
    colors = dict(zip(arms, ["black", "tab:blue", "tab:orange", "tab:green", "tab:red"]))
    for name, arm in arms.items():
        steps = sorted(arm.losses)
        smooth = [statistics.mean(arm.losses[s] for s in steps[max(0, i - window + 1) : i + 1]) for i in range(len(steps))]
        keep = [(s, v) for s, v in zip(steps, smooth) if s >= args.crash - 60]
        curves.plot([s for s, _ in keep], [v for _, v in keep], label=name, color=colors[name],
                    linewidth=1.2 if name != "uninterrupted" else 2.2)
        held.plot(sorted(arm.held_out), [arm.held_out[s] for s in sorted(arm.held_out)], marker="o", markersize=3,
                  label=name, color=colors[name])
        if arm.save_bytes:
            sizes.plot(sorted(arm.save_bytes), [arm.save_bytes[s] / 1e6 for s in sorted(arm.save_bytes)], marker=".",
                       label=name, color=colors[name])
    for axis in (curves, held):
        axis.axvline(args.crash, color="grey", linestyle=":", linewidth=1)
    curves.set_title(f"training loss ({window}-step mean) around and after the crash at step {args.crash}")
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    held.set_title("held-out loss (last 10% of the corpus)")
    held.set_xlabel("step")
    held.set_ylabel("held-out loss")
    sizes.set_title("bytes per snapshot")
    sizes.set_xlabel("step of the save")
    sizes.set_ylabel("MB written")
    sizes.set_ylim(bottom=0)
    for axis in (curves, held, sizes):
        axis.legend(fontsize=8)
    fig.savefig(args.out / "quality.png", dpi=110)
    plt.close(fig)
    print(f"plots: {args.out / 'quality.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--crash", type=int, default=570)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--max-staleness", type=int, default=4, help="Adaptive's staleness bound (saves)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and batch order (the resumed model: seed + 1)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/quality"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    arms = run(args)
    report(arms, args)
    plot(arms, args)
    print(f"took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
