"""Distributed saves side by side in one job: ours vs the framework's own checkpoint.

    .venv/bin/python bench/bench_distributed.py                          # FSDP2, 2 ranks: ours vs dcp.save
    .venv/bin/python bench/bench_distributed.py --deepspeed 3            # ZeRO-3, 2 ranks: ours vs engine.save_checkpoint
    .venv/bin/python bench/bench_distributed.py --nproc 2 --layers 16 --hidden 1024 --repeats 3
    .venv/bin/python bench/bench_distributed.py --nproc 4 --tp 2                 # dp 2 x tp 2: TP + FSDP2

The model is a Llama-style one built from ``transformers.LlamaConfig`` (fp32, vocab 32000, MLP
3.5x hidden: Llama-3.1-8B's proportions scaled down, never downloaded); AdamW in HF Trainer's
decay / no-decay groups has moments from one real training step; gloo, CPU.

- FSDP2 (``fully_shard`` per decoder layer and at the root): ``dcp.save`` of
  ``{"model": get_model_state_dict, "optim": get_optimizer_state_dict}`` vs ``Tailor.save``
  with Full and Parity.
- ``--tp N``: a ``dp`` x ``tp`` mesh (``nproc / N`` x ``N``), tensor parallel on the attention
  and MLP linears over ``tp``, then ``fully_shard`` over ``dp`` (the layout of
  docs/distributed.md: the embedding, norms and head live on the ``dp`` sub-mesh only); the
  same contenders. "one copy" is the bytes of the whole state once (every weight and optimizer
  tensor at its global shape), the floor a save that writes each byte once reaches.
- DeepSpeed (``--deepspeed STAGE``, the client AdamW, ``DS_ACCELERATOR=cpu``):
  ``engine.save_checkpoint`` vs ``Tailor(run, engine).save`` with Full, Parity and Filter (the
  paper's 4.3x / 2.8x comparison).

Ours is measured on the second save of a run (its first is always full), so Parity writes the
odd layers and Filter layers 0, 1, -2, -1, both with embed, norm and head. Contenders take
turns within each repeat; every output is deleted after it is measured. Wall time per save runs
from a barrier before the call to a barrier after ``os.sync()`` on every rank (our saves fsync
every file, the others do not, so the synced time is the fair one). Bytes: the files each rank
wrote. Medians over ``--repeats``; ratios against the framework's own save.
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
           "--out", str(args.out), "--deepspeed", str(args.deepspeed), "--tp", str(args.tp)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc)), "DS_ACCELERATOR": "cpu"}
    raise SystemExit(subprocess.call(cmd, env=env))


def build(args: argparse.Namespace):
    """(what Tailor takes, the framework's own save(target) -> this rank's bytes, a description)."""
    import torch
    import torch.distributed as dist

    from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens, hf_param_groups

    config = TinyConfig(hidden_size=args.hidden, layers=args.layers, heads=16, kv_heads=8,
                        intermediate_size=int(3.5 * args.hidden), seq_len=64, vocab_size=32000)
    model = build_model(config, seed=0)
    rank = dist.get_rank()
    batch = batch_at(corpus_tokens(), rank, 1, 16)
    if args.deepspeed:
        import deepspeed

        ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                     "zero_optimization": {"stage": args.deepspeed}, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(hf_param_groups(model), lr=1e-4),
                                          config=ds_config)
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()

        def own_save(target: Path) -> int:
            engine.save_checkpoint(str(target), tag="bench")
            return sum(p.stat().st_size for p in (target / "bench").glob(f"*rank_{rank}_*"))

        return (engine,), own_save, f"DeepSpeed ZeRO-{args.deepspeed}", "engine.save_checkpoint"

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if args.tp > 1:
        mesh = init_device_mesh("cpu", (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        batch = batch_at(corpus_tokens(), mesh.get_coordinate()[0], 1, 16)  # one batch per tp group
        tensor_parallel_linears(model, mesh)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-4)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    def own_save(target: Path) -> int:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=str(target))
        return sum(p.stat().st_size for p in target.glob(f"__{rank}_*.distcp"))

    setting = f"dp {dist.get_world_size() // args.tp} x tp {args.tp} (TP on the linears, FSDP2)" if args.tp > 1 else "FSDP2"
    return (model, optimizer), own_save, setting, "dcp.save"


def tensor_parallel_linears(model, mesh) -> None:
    """Tensor parallel on the attention and MLP linears over ``mesh["tp"]``, then ``fully_shard``
    over ``mesh["dp"]`` (docs/distributed.md's layout)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {f"self_attn.{name}_proj": ColwiseParallel() for name in "qkv"}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def one_copy_bytes(model, optimizer) -> int:
    """The bytes of the whole state once: every parameter and optimizer tensor at its global shape."""
    import torch

    tensors = [p for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from llmtailor import Filter, Full, Parity, Tailor

    if args.deepspeed:
        import importlib

        import deepspeed

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # an inference-only op
        deepspeed.init_distributed("gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    objects, own_save, setting, own_name = build(args)
    copy = None if args.deepspeed else one_copy_bytes(*objects)
    out = Path(args.out)
    policies = {"ours Full": Full(), "ours Parity": Parity()}
    if args.deepspeed:
        policies["ours Filter"] = Filter()

    def timed(save) -> tuple[float, int]:
        dist.barrier()
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        written = save()
        os.sync()
        dist.barrier()
        return time.perf_counter() - start, written

    results: dict[str, dict[str, list]] = {n: {"seconds": [], "bytes": []} for n in (own_name, *policies)}
    for repeat in range(args.repeats):
        seconds, written = timed(lambda: own_save(out / f"own-{repeat}"))
        results[own_name]["seconds"].append(seconds)
        results[own_name]["bytes"].append(written)
        for name, policy in policies.items():
            tailor = Tailor(out / f"{name.split()[1].lower()}-{repeat}", *objects, policy=policy, timeout=600)
            tailor.save(1)  # the first save of a run is full; the measured one is the second
            seconds, written = timed(lambda: tailor.save(2).rank_bytes)
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
        report(gathered, world, setting, own_name, args, copy)
    dist.barrier()
    dist.destroy_process_group()


def report(gathered: list[dict], world: int, setting: str, own_name: str, args: argparse.Namespace,
           copy: int | None) -> None:
    print(f"{setting}, {world} ranks (gloo, CPU), Llama hidden {args.hidden} x {args.layers} layers, fp32 + AdamW; "
          f"median of {args.repeats}, synced")
    base = statistics.median(gathered[0][own_name]["seconds"])
    base_bytes = sum(statistics.median(g[own_name]["bytes"]) for g in gathered)
    header = f"{'contender':<22} {'seconds':>8} {'time ratio':>10} {'GB total':>9} {'bytes ratio':>11} " + " ".join(
        f"{'GB r' + str(r):>7}" for r in range(world)) + f" {'max/mean':>8}"
    print(header)
    print("-" * len(header))
    for name in gathered[0]:
        seconds = statistics.median(gathered[0][name]["seconds"])
        per_rank = [statistics.median(g[name]["bytes"]) for g in gathered]
        total = sum(per_rank)
        print(f"{name:<22} {seconds:>8.2f} {seconds / base:>10.3f} {total / 1e9:>9.3f} {total / base_bytes:>11.3f} "
              + " ".join(f"{b / 1e9:>7.3f}" for b in per_rank) + f" {max(per_rank) / (total / world):>8.3f}")
    print(f"(ratios against {own_name}; PRODUCT.md target: Parity <= 0.6x their time, each rank ~1/world of the bytes)")
    if copy is not None:
        full = sum(statistics.median(g["ours Full"]["bytes"]) for g in gathered)
        print(f"one copy of the state: {copy / 1e9:.3f} GB; ours Full wrote {full / copy:.4f}x of it, "
              f"{own_name} {base_bytes / copy:.4f}x")
    (Path(args.out).parent / "bench_distributed.json").write_text(json.dumps(gathered))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deepspeed", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (0: FSDP2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP2 over nproc / tp data ranks)")
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
