"""Wall time of a weights-only merge plan: ours vs mergekit vs ``cp`` of the same bytes.

Inputs, built here (never downloaded): a Llama-style model (fp32, ``TinyConfig``) trained
with AdamW and saved by a Full Tailor at steps 1 and 2, and both steps exported as Hugging
Face ``checkpoint-N/`` directories. The plan takes the first half of the layers from step 1
and the rest (and embed, norm, head) from step 2, ``optimizer: false``.

Contenders, taking turns within each repeat (outputs deleted right after):

- ``ours (runs)``     ``llmtailor.merge.merge`` with the tailored runs as sources;
- ``ours (hf dirs)``  the same plan with the HF checkpoint dirs as sources, so the same inputs
                      as mergekit: each source is imported (a copy, optimizer.pt included)
                      before merging;
- ``mergekit``        ``mergekit-yaml`` (passthrough, same slices, fp32, no tokenizer copy) on
                      the HF dirs, as a subprocess: its time includes interpreter start and
                      imports, reported separately as ``mergekit (import only)``;
- ``cp``              ``cp`` of one source's model.safetensors: the bytes the merge writes.

Each measurement ends with ``os.sync()`` (our snapshots fsync every file; mergekit and cp
do not, so only the synced time is comparable). Medians over ``--repeats``.

mergekit must not be installed into the project's venv: pass ``--mergekit PATH`` to a
``mergekit-yaml`` in a separate venv (e.g. one made with ``python -m venv`` whose site
packages get a ``.pth`` line naming the project venv's, and ``pip install --no-deps
mergekit immutables peft scipy sentencepiece protobuf``); without it mergekit is skipped.

    .venv/bin/python bench/bench_merge.py --layers 8 --hidden 512 --repeats 3 --mergekit /tmp/mkvenv/bin/mergekit-yaml
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml


def build_inputs(root: Path, layers: int, hidden: int) -> None:
    from llmtailor import Full, Tailor
    from llmtailor.interop.hf_export import export_hf
    from llmtailor.store.run import Run
    from llmtailor.training_example import TinyConfig, batch_at, build_model, build_optimizer, corpus_tokens

    config = TinyConfig(hidden_size=hidden, layers=layers, heads=8, kv_heads=4, intermediate_size=2 * hidden, seq_len=16)
    model = build_model(config, seed=0)
    optimizer, scheduler = build_optimizer(model, total_steps=10)
    tokens = corpus_tokens()
    tailor = Tailor(root / "run", model, optimizer, scheduler, policy=Full())
    for step in (1, 2):
        batch = batch_at(tokens, step, 1, 16)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tailor.save(step)
    tailor.close()
    for step in (1, 2):
        target = export_hf(Run(root / "run"), step, root / "hf")
        config = json.loads((target / "config.json").read_text())
        config["architectures"] = config.get("architectures") or [type(model).__name__]  # mergekit needs it
        (target / "config.json").write_text(json.dumps(config))


def write_plans(root: Path, layers: int) -> dict[str, Path]:
    half = layers // 2

    def plan(first: str, second: str, extra: dict) -> dict:
        return {"merge_method": "passthrough", "dtype": "float32", **extra, "slices": [
            {"sources": [{"model": first, "layer_range": [0, half]}]},
            {"sources": [{"model": second, "layer_range": [half, layers]}]},
        ]}

    plans = {
        # mergekit's passthrough takes embed from the first slice's model, norm and head from the
        # last one's; ours defaults to base_model, so the plan names embed explicitly.
        "ours (runs)": plan("run@1", "run@2", {"optimizer": False, "base_model": "run@2", "embed": "run@1"}),
        "ours (hf dirs)": plan("hf/checkpoint-1", "hf/checkpoint-2",
                               {"optimizer": False, "base_model": "hf/checkpoint-2", "embed": "hf/checkpoint-1"}),
        "mergekit": plan(str(root / "hf/checkpoint-1"), str(root / "hf/checkpoint-2"), {"base_model": str(root / "hf/checkpoint-2")}),
    }
    paths = {}
    for name, body in plans.items():
        paths[name] = root / f"plan-{name.split()[-1].strip('()')}.yaml"
        paths[name].write_text(yaml.safe_dump(body))
    return paths


def check_same_weights(contenders: dict, root: Path) -> None:
    """Both merges must produce the same weights, bit for bit, or the timing compares nothing."""
    import torch
    from safetensors.torch import load_file

    from llmtailor.store.run import Run

    contenders["ours (runs)"](root / "check-ours")
    contenders["mergekit"](root / "check-mergekit")
    theirs = load_file(root / "check-mergekit" / "model.safetensors")
    ours = Run(root / "check-ours")
    step = ours.resolve().step
    mine = {k.removeprefix("weight/"): t for u in ours.resolve().sources for k, t in ours.read_unit(step, u)[0].items()}
    assert mine.keys() == theirs.keys(), sorted(mine.keys() ^ theirs.keys())[:5]
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "mergekit and ours wrote different weights"
    shutil.rmtree(root / "check-ours")
    shutil.rmtree(root / "check-mergekit")
    print(f"checked: ours and mergekit write the same {len(mine)} weights, bit for bit")


def timed(action) -> float:
    os.sync()
    start = time.perf_counter()
    action()
    os.sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mergekit", help="path of a mergekit-yaml outside the project venv")
    args = parser.parse_args()

    from llmtailor.merge import merge

    root = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    try:
        build_inputs(root, args.layers, args.hidden)
        plans = write_plans(root, args.layers)
        weights = root / "hf" / "checkpoint-2" / "model.safetensors"
        contenders = {
            "ours (runs)": lambda out: merge(plans["ours (runs)"], out),
            "ours (hf dirs)": lambda out: merge(plans["ours (hf dirs)"], out),
            "cp": lambda out: subprocess.run(["cp", str(weights), str(out)], check=True),
        }
        if args.mergekit:
            mergekit = [args.mergekit, str(plans["mergekit"])]
            flags = ["--no-copy-tokenizer", "--no-write-model-card", "--quiet", "--lazy-unpickle"]
            contenders["mergekit"] = lambda out: subprocess.run([*mergekit, str(out), *flags], check=True, capture_output=True)
            python = Path(args.mergekit).with_name("python")
            contenders["mergekit (import only)"] = lambda out: subprocess.run(
                [str(python), "-c", "import mergekit.merge, mergekit.config"], check=True)
        if args.mergekit:
            check_same_weights(contenders, root)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, action in contenders.items():
                out = root / "out"
                times[name].append(timed(lambda: action(out)))
                shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
        size = weights.stat().st_size
        print(f"weights-only plan, {args.layers} layers, hidden {args.hidden}: {size / 2**20:.1f} MiB of weights; "
              f"median of {args.repeats}, synced")
        ours = statistics.median(times["ours (runs)"])
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:24s} {median:8.3f} s   {median / ours:6.2f}x ours (runs)")
        if "mergekit" in times:
            print(f"  mergekit / ours (hf dirs): {statistics.median(times['mergekit']) / statistics.median(times['ours (hf dirs)']):.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
