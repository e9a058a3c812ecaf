"""Merge plans and composites, side by side in one run: ours vs mergekit vs ``cp``.

    .venv/bin/python bench/bench_merge.py --mergekit /tmp/mkvenv/bin/mergekit-yaml
    .venv/bin/python bench/bench_merge.py --layers 8 --hidden 512 --repeats 1      # quick look, no mergekit

Inputs, built here (never downloaded): a Llama-style model (fp32, ``TinyConfig``) trained with
AdamW, saved by a Full ``Tailor`` at steps 1 and 2, and both steps exported as Hugging Face
``checkpoint-N/`` directories (the inputs mergekit takes).

**Part 1: a weights-only plan** in mergekit's form (first half of the layers from step 1, the
rest from step 2; no ``base_model``, so embed from the first slice's model, norm and head from
the last's, as mergekit does). Contenders, taking turns within each repeat, each output
deleted after it is measured, every measurement ending with ``os.sync()``:

- ``ours, runs``              ``merge`` in-process from the tailored runs (output: a snapshot);
- ``ours, hf dirs``           ``merge`` in-process from the checkpoint dirs, ``--format model``
                              (the same inputs and the same kind of output as mergekit);
- ``ours, hf dirs, CLI``      the same as a fresh ``llmtailor merge`` process (end to end);
- ``mergekit``                ``mergekit-yaml`` on the checkpoint dirs (a fresh process, end to end);
- ``* import only``           each tool's interpreter start and imports, to subtract;
- ``cp``                      ``cp`` of one checkpoint's ``model.safetensors``: the bytes written.

mergekit must not be installed into the project's venv: pass ``--mergekit PATH`` to a
``mergekit-yaml`` in a separate venv (``python3.11 -m venv /tmp/mkvenv``, a ``.pth`` file in its
site-packages naming the project venv's site-packages, then ``/tmp/mkvenv/bin/pip install
--no-deps mergekit==0.1.5 immutables peft scipy sentencepiece protobuf``); without it mergekit is
skipped. Ours and mergekit's outputs are checked equal, bit for bit, before timing.

**Part 2: materialising a composite** (the paper's merge-loading table: the published tool
takes 0.8 s for a composite in 1 snapshot, 117 s for 2, 60 s for 8, 62 s one per layer, on a
17 GB checkpoint). Runs whose newest composite draws its units from 1 (Full), 2 (Parity), 8,
and one snapshot per layer, weights *and* AdamW state; each materialised into one snapshot by
``merge`` of ``models: [{model: RUN}]``, vs ``cp -r`` of that output (the same bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmtailor.policies import Policy, SaveContext


@dataclass(frozen=True)
class RoundRobin(Policy):
    """Layer i at saves whose index is i modulo ``ways``; auxiliary units every save: after
    ``ways`` saves a composite draws its layers from ``ways`` snapshots."""

    ways: int = 2

    def select(self, ctx: SaveContext) -> set[str]:
        layers = ctx.layer_units
        return {u for i, u in enumerate(layers) if i % self.ways == ctx.save_index % self.ways} | set(ctx.aux_units)


def build_inputs(root: Path, layers: int, hidden: int) -> None:
    from llmtailor import Full, Tailor
    from llmtailor.interop.hf.export import export_hf
    from llmtailor.store.run import Run

    model, optimizer, scheduler, step_once = _job(layers, hidden)
    with Tailor(root / "run", model, optimizer, scheduler, policy=Full()) as tailor:
        for step in (1, 2):
            step_once(step)
            tailor.save(step)
    for step in (1, 2):
        target = export_hf(Run(root / "run"), step, root / "hf")
        config = json.loads((target / "config.json").read_text())
        config["architectures"] = config.get("architectures") or [type(model).__name__]  # mergekit needs it
        (target / "config.json").write_text(json.dumps(config))


def _job(layers: int, hidden: int):
    from llmtailor.training_example import TinyConfig, batch_at, build_model, build_optimizer, corpus_tokens

    config = TinyConfig(hidden_size=hidden, layers=layers, heads=8, kv_heads=4, intermediate_size=2 * hidden, seq_len=16)
    model = build_model(config, seed=0)
    optimizer, scheduler = build_optimizer(model, total_steps=100)
    tokens = corpus_tokens()

    def step_once(step: int) -> None:
        batch = batch_at(tokens, step, 1, 16)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, scheduler, step_once


def write_plan(path: Path, first: str, second: str, layers: int, extra: dict) -> Path:
    half = layers // 2
    path.write_text(yaml.safe_dump({"merge_method": "passthrough", "dtype": "float32", **extra, "slices": [
        {"sources": [{"model": first, "layer_range": [0, half]}]},
        {"sources": [{"model": second, "layer_range": [half, layers]}]},
    ]}))
    return path


def timed(action) -> float:
    os.sync()
    start = time.perf_counter()
    action()
    os.sync()
    return time.perf_counter() - start


def clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def part1(root: Path, args: argparse.Namespace) -> None:
    from llmtailor.merge import merge

    hf1, hf2 = root / "hf" / "checkpoint-1", root / "hf" / "checkpoint-2"
    plans = {
        "runs": write_plan(root / "plan-runs.yaml", "run@1", "run@2", args.layers, {"optimizer": False}),
        "hf": write_plan(root / "plan-hf.yaml", str(hf1), str(hf2), args.layers, {"optimizer": False}),
        "mergekit": write_plan(root / "plan-mergekit.yaml", str(hf1), str(hf2), args.layers, {}),
    }
    cli = [str(Path(sys.executable).with_name("llmtailor")), "merge", str(plans["hf"]), "--format", "model", "-o"]
    contenders = {
        "ours, runs": lambda out: merge(plans["runs"], out),
        "ours, hf dirs": lambda out: merge(plans["hf"], out, format="model"),
        "ours, hf dirs, CLI": lambda out: subprocess.run([*cli, str(out)], check=True, capture_output=True),
        "ours import only": lambda out: subprocess.run([sys.executable, "-c", "import llmtailor.cli, llmtailor.merge"], check=True),
        "cp": lambda out: subprocess.run(["cp", str(hf2 / "model.safetensors"), str(out)], check=True),
    }
    if args.mergekit:
        flags = ["--no-copy-tokenizer", "--no-write-model-card", "--quiet", "--lazy-unpickle"]
        contenders["mergekit"] = lambda out: subprocess.run([args.mergekit, str(plans["mergekit"]), str(out), *flags],
                                                            check=True, capture_output=True)
        python = str(Path(args.mergekit).with_name("python"))
        contenders["mergekit import only"] = lambda out: subprocess.run([python, "-c", "import mergekit.merge, mergekit.config"],
                                                                        check=True)
        check_same_weights(contenders, root)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, action in contenders.items():
            out = root / "out"
            times[name].append(timed(lambda: action(out)))
            clear(out)
    size = (hf2 / "model.safetensors").stat().st_size
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"\nPart 1: weights-only plan, {args.layers} layers, hidden {args.hidden}: {size / 2**20:.1f} MiB of weights "
          f"written; median of {args.repeats}, synced")
    for name, seconds in median.items():
        print(f"  {name:24s} {seconds:8.3f} s   {size / seconds / 2**20:8.0f} MiB/s")
    cp = median["cp"]
    print(f"  ours, runs: {100 * cp / median['ours, runs']:.0f}% of cp's speed; ours, hf dirs: "
          f"{100 * cp / median['ours, hf dirs']:.0f}% of cp's speed (target >= 80%)")
    if "mergekit" in median:
        work = (median["mergekit"] - median["mergekit import only"]) / (median["ours, hf dirs, CLI"] - median["ours import only"])
        print(f"  mergekit / ours, same inputs, end to end: {median['mergekit'] / median['ours, hf dirs, CLI']:.2f}x "
              f"(target >= 3x); merge work alone (imports subtracted): {work:.2f}x; "
              f"mergekit end to end / ours in-process: {median['mergekit'] / median['ours, hf dirs']:.2f}x")


def check_same_weights(contenders: dict, root: Path) -> None:
    """Both merges must produce the same weights, bit for bit, or the timing compares nothing."""
    import torch
    from safetensors.torch import load_file

    contenders["ours, hf dirs"](root / "check-ours")
    contenders["mergekit"](root / "check-mergekit")
    mine = load_file(root / "check-ours" / "model.safetensors")
    theirs = load_file(root / "check-mergekit" / "model.safetensors")
    assert mine.keys() == theirs.keys(), sorted(mine.keys() ^ theirs.keys())[:5]
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "mergekit and ours wrote different weights"
    shutil.rmtree(root / "check-ours")
    shutil.rmtree(root / "check-mergekit")
    print(f"checked: ours and mergekit write the same {len(mine)} weights, bit for bit")


def part2(root: Path, args: argparse.Namespace) -> None:
    from llmtailor import Full, Parity, Tailor
    from llmtailor.merge import merge
    from llmtailor.store.run import Run

    kinds = {"1 (Full)": (Full(), 1), "2 (Parity)": (Parity(), 2), "8": (RoundRobin(ways=8), 8),
             f"{args.layers} (one per layer)": (RoundRobin(ways=args.layers), args.layers)}
    model, optimizer, scheduler, step_once = _job(args.layers, args.hidden)
    runs = {}
    for name, (policy, ways) in kinds.items():
        run_dir = root / f"composite-{ways}"
        with Tailor(run_dir, model, optimizer, scheduler, policy=policy) as tailor:
            for step in range(1, ways + 2):  # a full first save, then `ways` tailored ones
                step_once(step)
                tailor.save(step)
        composite = Run(run_dir).resolve()
        runs[name] = (run_dir, len(set(composite.sources.values())))
        (root / f"plan-{ways}.yaml").write_text(yaml.safe_dump({"models": [{"model": str(run_dir)}]}))
    print(f"\nPart 2: materialising a composite (weights and AdamW state, {args.layers} layers, hidden {args.hidden}); "
          f"median of {args.repeats}, synced")
    for name, (run_dir, snapshots) in runs.items():
        ways = run_dir.name.split("-")[1]
        merge_s, cp_s, size = [], [], 0
        for _ in range(args.repeats):
            out = root / "out"
            merge_s.append(timed(lambda: merge(root / f"plan-{ways}.yaml", out)))
            size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            cp_s.append(timed(lambda: subprocess.run(["cp", "-r", str(out), str(root / "out-copy")], check=True)))
            clear(out)
            clear(root / "out-copy")
        m, c = statistics.median(merge_s), statistics.median(cp_s)
        print(f"  composite from {name:20s} ({snapshots} snapshots): {m:7.3f} s, {size / 2**20:7.1f} MiB; cp of the same "
              f"bytes {c:6.3f} s: ours at {100 * c / m:.0f}% of cp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mergekit", help="path of a mergekit-yaml outside the project venv")
    parser.add_argument("--part", choices=["1", "2", "both"], default="both")
    args = parser.parse_args()
    scratch = Path(__file__).resolve().parent / "out"  # on the disk under test, like the runs
    scratch.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-merge-", dir=scratch))
    try:
        if args.part in ("1", "both"):
            build_inputs(root, args.layers, args.hidden)
            part1(root, args)
        if args.part in ("2", "both"):
            part2(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
