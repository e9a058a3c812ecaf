"""How a distributed snapshot's metadata scales, computed by planning only (no training).

For Llama-3.1-8B widths (hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocab 128256,
untied) at 32 to 128 layers and 8 to 1024 FSDP2 ranks (every tensor sharded on dim 0, as
``fully_shard`` does), this writes what a Full save would commit *except the tensor bytes*:
the real unit indexes (one chunk per rank per tensor, with its offsets and a checksum
field), the rank-state entries and the manifest, with the store's own models
(``llmtailor.store.manifest``). It then measures, on those files:

- ``resolve ms``: ``Run(...).resolve()`` of the snapshot in a fresh ``Run`` (reads and
  validates the manifest: what resolving a composite costs);
- ``unit index``: the size of one decoder layer's index and the time to read and validate it
  (``Run.unit_entry``), which a restoring rank pays once per unit.

Bytes per rank are the tensor bytes a Full save writes (bf16 weights, fp32 AdamW moments and
step scalars, written once) divided as the shards fall; files are the unit files (one per
rank per unit), the unit indexes (one file), the rank-state files, the global files and the manifest.

    .venv/bin/python bench/scale_table.py                  # the table in docs/distributed.md
    .venv/bin/python bench/scale_table.py --layers 32 --ranks 8 64
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

from llmtailor.constants import GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, MANIFEST_FILE, rank_state_files, unit_filename
from llmtailor.layouts import load_family
from llmtailor.constants import SCHEMA_VERSION
from llmtailor.store.manifest import FileEntry, Manifest, UnitEntry, UnitRef
from llmtailor.store.run import Run

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 128256
HEAD_DIM = HIDDEN // HEADS
FAKE_SUM = "0" * 16
OPTIM = (("exp_avg", 4), ("exp_avg_sq", 4))  # fp32 moments, bytes per element


def layer_params(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        p + "mlp.gate_proj.weight": (INTER, HIDDEN),
        p + "mlp.up_proj.weight": (INTER, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTER),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
    }


def units(layers: int) -> dict[str, dict[str, tuple[int, ...]]]:
    out = {"embed": {"model.embed_tokens.weight": (VOCAB, HIDDEN)}}
    out.update({f"layer.{i}": layer_params(i) for i in range(layers)})
    out["norm"] = {"model.norm.weight": (HIDDEN,)}
    out["head"] = {"lm_head.weight": (VOCAB, HIDDEN)}
    return out


def shards(shape: tuple[int, ...], ranks: int) -> list[tuple[int, list[int], list[int]]]:
    """(rank, offsets, shape) of each non-empty dim-0 shard, as FSDP2 splits (ceil-sized)."""
    size = -(-shape[0] // ranks)
    out = []
    for r in range(ranks):
        start = min(r * size, shape[0])
        rows = min(size, shape[0] - start)
        if rows > 0:
            out.append((r, [start, *([0] * (len(shape) - 1))], [rows, *shape[1:]]))
    return out


def plan_unit(unit: str, params: dict[str, tuple[int, ...]], ranks: int, step: int) -> tuple[UnitEntry, list[int]]:
    """The index of a Full save of ``unit`` at ``ranks`` ranks, and the bytes each rank writes."""
    per_rank = [0] * ranks
    files = [FileEntry(path=unit_filename(unit, r, ranks), bytes=0, xxh3_64=FAKE_SUM) for r in range(ranks)]
    tensors = []
    for name, shape in params.items():
        for key, itemsize, dtype in [(f"weight/{name}", 2, "bfloat16")] + [
            (f"optim/{name}/{k}", size, "float32") for k, size in OPTIM
        ]:
            chunks = []
            for r, offsets, extent in shards(shape, ranks):
                chunks.append({"file": r, "offsets": offsets, "shape": extent, "xxh3_64": FAKE_SUM})
                per_rank[r] += math.prod(extent) * itemsize
            tensors.append({"key": key, "dtype": dtype, "shape": list(shape), "chunks": chunks})
        # The step scalar: written once, by one rank.
        owner = hash(name) % ranks
        tensors.append({"key": f"optim/{name}/step", "dtype": "float32", "shape": [],
                        "chunks": [{"file": owner, "offsets": [], "shape": [], "xxh3_64": FAKE_SUM}]})
        per_rank[owner] += 4
    for r, size in enumerate(per_rank):
        files[r] = FileEntry(path=files[r].path, bytes=size, xxh3_64=FAKE_SUM)
    entry = UnitEntry(unit=unit, step=step, files=files, tensors=tensors)
    return entry, per_rank


def plan(root: Path, layers: int, ranks: int) -> dict[str, float]:
    step = 1000
    snapshot = root / "snapshots" / f"step-{step:08d}"
    snapshot.mkdir(parents=True)
    family = load_family("llama")
    layout = {"family": family.family, "units": {}, "aliases": {}}
    refs, per_rank, index_sizes, lines = {}, [0] * ranks, {}, []
    for unit, params in units(layers).items():
        layout["units"][unit] = list(params)
        entry, shares = plan_unit(unit, params, ranks, step)
        text = entry.dumps().encode() + b"\n"
        refs[unit] = UnitRef(index=FileEntry(path=INDEXES_FILE, bytes=len(text), xxh3_64=FAKE_SUM),
                             index_at=sum(len(line) for line in lines), bytes=sum(shares))
        lines.append(text)
        per_rank = [a + b for a, b in zip(per_rank, shares)]
        index_sizes[unit] = len(text)
    (snapshot / INDEXES_FILE).write_bytes(b"".join(lines))
    files = [FileEntry(path=GLOBAL_JSON, bytes=12_000, xxh3_64=FAKE_SUM), FileEntry(path=GLOBAL_TENSORS, bytes=8_000, xxh3_64=FAKE_SUM),
             FileEntry(path=INDEXES_FILE, bytes=sum(len(line) for line in lines), xxh3_64=FAKE_SUM)]
    for r in range(1, ranks):
        files += [FileEntry(path=p, bytes=8_000, xxh3_64=FAKE_SUM) for p in rank_state_files(r)]
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, step=step, parent=None, save_index=0, created="2026-11-22T00:00:00+00:00",
        world_size=ranks, provider="fsdp2", policy="Full()", layout=layout, units=refs,
        composite={u: step for u in refs}, files=files,
    )
    (snapshot / MANIFEST_FILE).write_text(manifest.dumps())
    manifest_bytes = (snapshot / MANIFEST_FILE).stat().st_size

    resolve_s = _best_of(3, lambda: Run(root).resolve(step))
    # Reading one layer's index as a restoring rank does (checksums are fake here: validate only).
    ref = refs["layer.0"]
    raw = (snapshot / INDEXES_FILE).read_bytes()[ref.index_at:ref.index_at + ref.index.bytes]
    unit_s = _best_of(3, lambda: UnitEntry.model_validate_json(raw))
    n_units = len(refs)
    return {
        "layers": layers, "ranks": ranks, "snapshot_gb": sum(per_rank) / 1e9, "per_rank_gb": max(per_rank) / 1e9,
        "balance": max(per_rank) / (sum(per_rank) / ranks),
        "files": n_units * ranks + 1 + 2 * (ranks - 1) + 3, "manifest_kb": manifest_bytes / 1e3,
        "resolve_ms": resolve_s * 1e3, "unit_index_kb": index_sizes["layer.0"] / 1e3, "unit_index_ms": unit_s * 1e3,
    }


def _best_of(n: int, fn) -> float:
    best = math.inf
    for _ in range(n):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    header = (f"{'layers':>6} {'ranks':>5} {'snapshot GB':>11} {'GB/rank':>8} {'max/mean':>8} {'files':>7} "
              f"{'manifest KB':>11} {'resolve ms':>10} {'unit index KB':>13} {'unit index ms':>13}")
    print(header)
    print("-" * len(header))
    for layers in args.layers:
        for ranks in args.ranks:
            root = Path(tempfile.mkdtemp(prefix="llmtailor-scale-"))
            try:
                row = plan(root, layers, ranks)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            rows.append(row)
            print(f"{row['layers']:>6} {row['ranks']:>5} {row['snapshot_gb']:>11.1f} {row['per_rank_gb']:>8.3f} "
                  f"{row['balance']:>8.3f} {row['files']:>7} {row['manifest_kb']:>11.1f} {row['resolve_ms']:>10.1f} "
                  f"{row['unit_index_kb']:>13.1f} {row['unit_index_ms']:>13.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
