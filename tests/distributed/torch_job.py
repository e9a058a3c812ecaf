"""Distributed training jobs for the torchrun tests: FSDP2 and DDP on gloo, CPU, real processes.

    python -m torch.distributed.run --standalone --nproc_per_node N torch_job.py SCENARIO DIR

Scenarios (each rank writes ``DIR/result-<scenario>-<rank>.json``):

``fsdp-train``  world 2, FSDP2. A tiny Llama trains steps 1..8 with a Parity ``Tailor`` saving
    every 2 steps into ``DIR/parity``; at every save rank 0 writes the full value of every
    weight and optimizer tensor (gathered from the shards) to ``DIR/versions/<step>``. A second
    model trains 1..10 with a Full save at 6 into ``DIR/full`` and logs the losses of 7..10;
    then a third model, from another seed, restores ``DIR/full`` and trains 7..10: its losses
    must equal the uninterrupted ones bit for bit. Finally ``DIR/parity`` is restored into a
    fresh model at this world size and compared with the versions its composite names.
``fsdp-restore``  (any world size) only that last part: restore ``DIR/parity`` and compare.
``ddp``  world 2, DDP. Parity saves at steps 2 and 4 into ``DIR/ddp`` (bytes per rank
    recorded), versions written as above, then a restore at this world size, compared.
``fsdp-url``  as the first half of ``fsdp-train`` (Parity saves every 2 steps up to 8, then a
    restore at this world size), with the run at ``$RUN_ROOT/parity`` (an ``s3://`` URL): each
    rank uploads its own parts; launched as two single-process "nodes" with no shared directory.
``fsdp-tiers``  world 2, FSDP2: Parity saves at every step up to 8 into ``DIR/tiered``, async,
    committed to a host-memory tier at ``$TIER_DIR`` (``promote_every=3``) in front of it, closed
    (the last save promoted), then a restore at this world size, which reads the memory tier.
``fsdp-frozen``  world 2, FSDP2, the q and v projections of every layer frozen (as a LoRA
    freezes its base weights): Parity saves at steps 2, 4, 6 into ``DIR/sync/frozen`` and, async,
    into ``DIR/async/frozen`` (versions under each), then ``DIR/async/frozen`` restored at this
    world size and compared.
``pipeline``  (world 2: two pipeline stages; world 4: two stages x ``fully_shard`` over two data
    ranks) each rank keeps its stage's half of the layers under their original names, as
    torchtitan's pipeline split does (the first stage the embedding, the last the norm and
    head), and builds a ``Tailor`` of ``DIR/stages`` (``timeout=20``), first with
    ``track_drift=False``, then with ``track_drift=True``; each is refused (the error recorded)
    or, not refused, saves step 1 (the outcome recorded).
``fsdp-lacking``  world 2, FSDP2: Parity saves at steps 2 and 4 into ``DIR/lacking``; rank 0 then
    forges the run (``helpers.drop_from_unit_index``): the version of layer.1 the composite names
    lacks the weight ``model.layers.1.mlp.up_proj.weight``; every rank restores it into a fresh
    model and records the error it got and which live tensors changed.
``fsdp-fallback``  world 2, FSDP2: Parity saves at 2, 4, 6 into ``DIR/fallback``; rank 0 flips a
    byte of rank 1's part of layer.0 at step 6; every rank restores with ``fallback=True`` and
    records the step restored, what was skipped and the mismatches against that composite.
``stateful``  world 2, DDP: each rank's stateful object (its own data position, a number and a
    tensor) saved at steps 1 and 2 into ``DIR/stateful``, then restored at this world size into
    fresh objects (each rank records what its object got).
``kill``  started without torchrun (``RANK``/``WORLD_SIZE``/``MASTER_*`` set by the test):
    FSDP2, a save at step 2, then a save at step 4 during which rank 1 SIGKILLs itself after
    writing its first unit file; rank 0 (its timeout 5 s in that save) records the error it gets
    and how long it took.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

from helpers import drop_from_unit_index, tiny  # noqa: E402

from llmtailor import Full, Parity, Tailor, Tier  # noqa: E402
from llmtailor.store.keys import optim_key, weight_key  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402
from llmtailor.training_example import batch_at, corpus_tokens  # noqa: E402

TOKENS = corpus_tokens()


def rank() -> int:
    return dist.get_rank()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(kind: str, seed: int, freeze: bool = False):
    """Model, AdamW (HF-style groups) and scheduler, sharded or wrapped after building;
    ``freeze``: the q and v projections of every layer do not train."""
    from llmtailor.training_example import build_optimizer

    model, _, _ = tiny(seed=seed)
    for layer in model.model.layers if freeze else []:
        layer.self_attn.q_proj.weight.requires_grad_(False)
        layer.self_attn.v_proj.weight.requires_grad_(False)
    if kind == "fsdp":
        model = shard(model)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer, scheduler = build_optimizer(model, total_steps=50)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps) -> list[str]:
    """Each rank trains on its own batches (rank-dependent data, as a data-parallel job)."""
    losses = []
    for step in steps:
        batch = batch_at(TOKENS, step * 100 + rank(), 2, 32)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item().hex())
    return losses


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def versions(model, optimizer) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor, whole, by unit tensor key (collective for DTensors)."""
    inner = getattr(model, "module", model)
    out = {}
    for name, param in inner.named_parameters():
        out[weight_key(name)] = full(param.detach()).clone()
        for key, value in optimizer.state.get(param, {}).items():
            out[optim_key(name, key)] = full(value).clone()
    return out


def write_versions(out: Path, step: int, model, optimizer) -> None:
    values = versions(model, optimizer)
    if rank() == 0:
        (out / "versions").mkdir(parents=True, exist_ok=True)
        save_file(values, str(out / "versions" / f"{step}.safetensors"))


def location(out: Path, name: str) -> Path | str:
    """Where the run ``name`` lives: under ``$RUN_ROOT`` (a URL) when it is set, else in ``out``."""
    root = os.environ.get("RUN_ROOT")
    return f"{root}/{name}" if root else out / name


def compare_with_composite(out: Path, run_dir: Path | str, model, optimizer, step: int | None = None) -> list[str] | None:
    """Keys whose restored value differs from the version the composite (of ``step``; default the
    newest) names (None on a node whose ``out`` holds no versions: they are written on rank 0's)."""
    from llmtailor.layouts import build_layout

    composite = Run(run_dir).resolve(step)
    layout = build_layout(getattr(model, "module", model))
    restored = versions(model, optimizer)  # collective: every rank takes part
    if not (out / "versions").is_dir():
        return None  # another node's rank: the versions lie on node 0's own disk
    saved = {step: load_file(str(out / "versions" / f"{step}.safetensors")) for step in set(composite.sources.values())}
    bad = []
    for key, value in restored.items():
        name = key.split("/")[1]
        expected = saved[composite.sources[layout.unit_of(name)]][key]
        if value.dtype != expected.dtype or not torch.equal(value, expected):
            bad.append(key)
    return bad


def save_loop(kind: str, out: Path, run_name: str, policy, last: int, every: int, freeze: bool = False,
              async_save: bool = False) -> dict:
    model, optimizer, scheduler = build(kind, seed=0, freeze=freeze)
    tiers = [Tier(os.environ["TIER_DIR"], keep=2, promote_every=3)] if os.environ.get("TIER_DIR") else []
    tailor = Tailor(location(out, run_name), model, optimizer, scheduler, policy=policy, timeout=60, tiers=tiers,
                    async_save=async_save or bool(tiers))
    saves = []
    for step in range(1, last + 1):
        train(model, optimizer, scheduler, [step])
        if step % every == 0:
            report = tailor.save(step, extra={"rank": rank(), "next": step + 1})
            write_versions(out, step, model, optimizer)  # collective: an async save's copies are taken by then
            if tiers or async_save:
                report = tailor.wait()
            saves.append({"step": step, "units": report.units, "bytes": report.bytes, "rank_bytes": report.rank_bytes})
    tailor.close()  # waits for every promotion: how far they got before is the background's business
    return {"saves": saves, "promoted": [p.step for p in tailor.tiers.promotions]}


def restore_and_compare(kind: str, out: Path, run_name: str, freeze: bool = False) -> dict:
    model, optimizer, scheduler = build(kind, seed=5, freeze=freeze)
    tiers = [Tier(os.environ["TIER_DIR"], keep=2, promote_every=3)] if os.environ.get("TIER_DIR") else []
    report = Tailor(location(out, run_name), model, optimizer, scheduler, timeout=60, tiers=tiers).restore()
    return {
        "restored": report.step,
        "tier": report.tier,
        "extra": report.extra,
        "unmapped": list(report.unmapped),
        "mismatches": compare_with_composite(out, location(out, run_name), model, optimizer),
    }


def resume_bitwise(out: Path) -> dict:
    """An uninterrupted FSDP2 run vs one restored from its Full save at step 6."""
    model, optimizer, scheduler = build("fsdp", seed=0)
    tailor = Tailor(out / "full", model, optimizer, scheduler, policy=Full(), timeout=60)
    train(model, optimizer, scheduler, range(1, 7))
    tailor.save(6, extra={"next": 7})
    uninterrupted = train(model, optimizer, scheduler, range(7, 11))
    fresh = build("fsdp", seed=9)
    Tailor(out / "full", *fresh, timeout=60).restore()
    resumed = train(*fresh, range(7, 11))
    return {"uninterrupted": uninterrupted, "resumed": resumed}


class Position:
    """A rank's data position: what a job keeps beside its model, each rank its own."""

    def __init__(self, seen: int = -1):
        self.seen, self.order = seen, torch.full((3,), seen)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.order = state["seen"], state["order"]

    def record(self) -> dict:
        return {"seen": self.seen, "order": self.order.tolist()}


def stateful_per_rank(out: Path) -> dict:
    model, optimizer, scheduler = build("ddp", seed=0)
    position = Position()
    with Tailor(out / "stateful", model, optimizer, scheduler, timeout=60, stateful={"position": position}) as tailor:
        for step in (1, 2):
            train(model, optimizer, scheduler, [step])
            position.seen, position.order = 10 * step + rank(), torch.full((3,), 10 * step + rank())
            tailor.save(step)
    fresh = Position()
    report = Tailor(out / "stateful", *build("ddp", seed=5), timeout=60, stateful={"position": fresh},
                    read_only=True).restore()
    return {"restored": report.step, "position": fresh.record(), "unmapped": list(report.unmapped)}


def pipeline_stage(stages: int) -> torch.nn.Module:
    """This rank's stage of a tiny Llama: its half of the layers in a ModuleDict keyed by their
    original indices (so their names stay ``model.layers.<i>.``), the embedding on the first
    stage only, norm and head on the last; sharded over the stage's data ranks if it has several."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = dist.get_world_size() // stages
    mesh = init_device_mesh("cpu", (stages, data), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    model, _, _ = tiny(seed=0)
    layers = model.model.layers
    per = len(layers) // stages
    model.model.layers = torch.nn.ModuleDict({str(i): layers[i] for i in range(stage * per, (stage + 1) * per)})
    if stage > 0:
        model.model.embed_tokens = None
    if stage < stages - 1:
        model.model.norm, model.lm_head = None, None
    if data > 1:
        for layer in model.model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def pipeline(out: Path, stages: int = 2) -> dict:
    from llmtailor.training_example import build_optimizer

    model = pipeline_stage(stages)
    outcomes = []
    for drift in (False, True):
        optimizer, scheduler = build_optimizer(model, total_steps=50)
        try:
            tailor = Tailor(out / "stages", model, optimizer, scheduler, policy=Full(), track_drift=drift, timeout=20)
        except Exception as err:  # the refusal each rank gets is the point of this scenario
            outcomes.append({"drift": drift, "refused": f"{type(err).__name__}: {err}"})
            continue
        try:
            tailor.save(1)
            outcome = "saved"
        except Exception as err:
            outcome = f"{type(err).__name__}: {err}"
        tailor.close()
        outcomes.append({"drift": drift, "refused": None, "save": outcome})
    return {"outcomes": outcomes}


def restore_lacking_a_weight(out: Path) -> dict:
    save_loop("fsdp", out, "lacking", Parity(), last=4, every=2)
    source = Run(out / "lacking").resolve().sources["layer.1"]
    if rank() == 0:
        drop_from_unit_index(out / "lacking", source, "layer.1", weight_key(LACKING))
    dist.barrier()
    model, optimizer, scheduler = build("fsdp", seed=5)
    before = versions(model, optimizer)
    try:
        Tailor(out / "lacking", model, optimizer, scheduler, timeout=60).restore()
        error = None
    except Exception as err:  # the error every rank gets is the point of this scenario
        error = f"{type(err).__name__}: {err}"
    after = versions(model, optimizer)
    return {"source": source, "error": error, "changed": sorted(k for k in before if not torch.equal(before[k], after[k]))}


LACKING = "model.layers.1.mlp.up_proj.weight"


def fallback_past_damage(out: Path) -> dict:
    """Saves at 2, 4, 6; rank 0 flips a byte of rank 1's part of layer.0 at step 6 (the newest
    composite takes layer.0 from there); every rank restores with ``fallback=True``: the damage
    is met while loading (by the rank reading those bytes), every rank passes over 6 and loads 4."""
    save_loop("fsdp", out, "fallback", Parity(), last=6, every=2)
    if rank() == 0:
        damaged = Run(out / "fallback").snapshot_dir(6) / "units" / "layer.0.rank-00001.safetensors"
        data = bytearray(damaged.read_bytes())
        data[-3] ^= 0x01
        damaged.write_bytes(bytes(data))
    dist.barrier()
    model, optimizer, scheduler = build("fsdp", seed=5)
    report = Tailor(out / "fallback", model, optimizer, scheduler, timeout=60).restore(fallback=True)
    return {"restored": report.step, "skipped": {str(k): v for k, v in report.skipped.items()},
            "mismatches": compare_with_composite(out, out / "fallback", model, optimizer, step=report.step)}


def kill_during_save(out: Path) -> dict:
    import llmtailor.store.writer as writer

    model, optimizer, scheduler = build("fsdp", seed=0)
    tailor = Tailor(out / "killed", model, optimizer, scheduler, policy=Parity(), timeout=60)
    train(model, optimizer, scheduler, [1, 2])
    tailor.save(2)
    # Short only for the save a rank dies in: a busy machine may keep a live rank waiting longer.
    tailor.coordinator.timeout = 5
    if rank() == 1:
        real = writer.stream_tensors

        def die_after_first(sink, *args, **kwargs):
            result = real(sink, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        writer.stream_tensors = die_after_first
    train(model, optimizer, scheduler, [3, 4])
    start = time.perf_counter()
    try:
        tailor.save(4)
        outcome = "saved"
    except Exception as err:  # the error a surviving rank gets is the point of this scenario
        outcome = f"{type(err).__name__}: {err}"
    return {"outcome": outcome, "seconds": time.perf_counter() - start}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if scenario == "fsdp-train":
        result = save_loop("fsdp", out, "parity", Parity(), last=8, every=2)
        result.update(resume_bitwise(out))
        result.update(restore_and_compare("fsdp", out, "parity"))
    elif scenario == "fsdp-url":
        result = save_loop("fsdp", out, "parity", Parity(), last=8, every=2)
        result.update(restore_and_compare("fsdp", out, "parity"))
    elif scenario == "fsdp-tiers":
        result = save_loop("fsdp", out, "tiered", Parity(), last=8, every=1)
        result.update(restore_and_compare("fsdp", out, "tiered"))
    elif scenario == "fsdp-frozen":
        result = {}
        for mode in ("sync", "async"):
            result[mode] = save_loop("fsdp", out / mode, "frozen", Parity(), last=6, every=2, freeze=True,
                                     async_save=mode == "async")
        result.update(restore_and_compare("fsdp", out / "async", "frozen", freeze=True))
    elif scenario == "fsdp-restore":
        result = restore_and_compare("fsdp", out, "parity")
    elif scenario == "ddp":
        result = save_loop("ddp", out, "ddp", Parity(), last=4, every=2)
        result.update(restore_and_compare("ddp", out, "ddp"))
    elif scenario == "pipeline":
        result = pipeline(out, stages=2)
    elif scenario == "fsdp-lacking":
        result = restore_lacking_a_weight(out)
    elif scenario == "fsdp-fallback":
        result = fallback_past_damage(out)
    elif scenario == "stateful":
        result = stateful_per_rank(out)
    elif scenario == "kill":
        result = kill_during_save(out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    (out / f"result-{scenario}-{rank()}.json").write_text(json.dumps(result))
    if scenario == "kill":
        os._exit(0)  # rank 1 is dead: tearing the process group down would wait for it
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
