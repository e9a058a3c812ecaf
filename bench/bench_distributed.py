"""A 2-rank FSDP2 save, side by side in one job: ours (Full, Parity) vs ``dcp.save`` of the full state.

    .venv/bin/python bench/bench_distributed.py                       # launches itself with torchrun
    .venv/bin/python bench/bench_distributed.py --nproc 2 --layers 16 --hidden 1024 --repeats 3

The model is a Llama-style one built from ``transformers.LlamaConfig`` (fp32, never
downloaded), sharded with ``fully_shard`` per decoder layer and at the root on a gloo CPU mesh;
AdamW (HF Trainer's decay / no-decay groups) has moments from one real training step.
Contenders, taking turns within each repeat, every output deleted after it is measured:

- ``dcp.save``    ``torch.distributed.checkpoint.save`` of ``{"model": get_model_state_dict,
                  "optim": get_optimizer_state_dict}`` (every rank writes its shards);
- ``ours Full``   ``Tailor.save`` with the Full policy;
- ``ours Parity`` the second save of a Parity run (save index 1: the odd layers + aux units).

Wall time per save runs from a barrier before the call to a barrier after ``os.sync()`` on
every rank (our saves fsync every file, DCP's do not, so the synced time is the fair one).
Bytes: the files each rank wrote. Medians over ``--repeats``; ratios against ``dcp.save``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def launch(args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           "--worker", "--layers", str(args.layers), "--hidden", str(args.hidden), "--repeats", str(args.repeats),
           "--out", str(args.out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc))}
    raise SystemExit(subprocess.call(cmd, env=env))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llmtailor import Full, Parity, Tailor
    from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens, hf_param_groups

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TinyConfig(hidden_size=args.hidden, layers=args.layers, heads=16, kv_heads=8,
                        intermediate_size=int(3.5 * args.hidden), seq_len=64, vocab_size=32000)
    model = build_model(config, seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-4)
    batch = batch_at(corpus_tokens(), rank, 1, 16)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = Path(args.out)

    def timed(save) -> tuple[float, int]:
        dist.barrier()
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        written = save()
        os.sync()
        dist.barrier()
        return time.perf_counter() - start, written

    def dcp_save(repeat: int) -> int:
        target = out / f"dcp-{repeat}"
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=str(target))
        return sum(p.stat().st_size for p in target.glob(f"__{rank}_*.distcp"))

    def ours(policy, repeat: int, name: str):
        run = out / f"{name}-{repeat}"
        tailor = Tailor(run, model, optimizer, policy=policy, timeout=600)
        if name == "parity":
            tailor.save(1)  # the first save of a run is full; the measured one is the second

        def save() -> int:
            return tailor.save(2).rank_bytes

        return tailor, save

    results: dict[str, dict[str, list]] = {n: {"seconds": [], "bytes": []} for n in ("dcp.save", "ours Full", "ours Parity")}
    for repeat in range(args.repeats):
        seconds, written = timed(lambda: dcp_save(repeat))
        results["dcp.save"]["seconds"].append(seconds)
        results["dcp.save"]["bytes"].append(written)
        for name, policy in (("ours Full", Full()), ("ours Parity", Parity())):
            tailor, save = ours(policy, repeat, name.split()[1].lower())
            seconds, written = timed(save)
            tailor.close()
            results[name]["seconds"].append(seconds)
            results[name]["bytes"].append(written)
        dist.barrier()
        if rank == 0:
            for child in out.iterdir():
                shutil.rmtree(child, ignore_errors=True)
        dist.barrier()

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print(f"FSDP2, {world} ranks (gloo, CPU), Llama hidden {args.hidden} x {args.layers} layers, fp32 + AdamW; "
              f"median of {args.repeats}, synced")
        base = statistics.median(gathered[0]["dcp.save"]["seconds"])
        base_bytes = sum(statistics.median(g["dcp.save"]["bytes"]) for g in gathered)
        header = f"{'contender':<12} {'seconds':>8} {'vs dcp':>7} {'GB total':>9} {'vs dcp':>7} " + " ".join(
            f"{'GB r' + str(r):>7}" for r in range(world)) + f" {'max/mean':>8}"
        print(header)
        print("-" * len(header))
        for name in results:
            seconds = statistics.median(gathered[0][name]["seconds"])
            per_rank = [statistics.median(g[name]["bytes"]) for g in gathered]
            total = sum(per_rank)
            print(f"{name:<12} {seconds:>8.2f} {seconds / base:>7.3f} {total / 1e9:>9.3f} {total / base_bytes:>7.3f} "
                  + " ".join(f"{b / 1e9:>7.3f}" for b in per_rank) + f" {max(per_rank) / (total / world):>8.3f}")
        Path(args.out).joinpath("..", "bench_distributed.json").resolve().write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out/distributed"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = args.out.resolve()
    if args.worker:
        worker(args)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        launch(args)


if __name__ == "__main__":
    main()
