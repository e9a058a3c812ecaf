"""Distributed training jobs for the torchrun tests: FSDP2 and DDP on gloo, CPU, real processes.

    python -m torch.distributed.run --standalone --nproc_per_node N torch_job.py SCENARIO DIR [SCENARIO DIR ...]

Several ``SCENARIO DIR`` pairs run in turn in one launch (one process group; each scenario builds
its own models), so tests that need the same ranks share their start-up.

Scenarios (each rank writes ``DIR/result-<scenario>-<rank>.json``):

``fsdp-train``  world 2, FSDP2. A tiny Llama trains steps 1..8 with a Parity ``Tailor`` saving
    every 2 steps into ``DIR/parity``; at every save rank 0 writes the full value of every
    weight and optimizer tensor (gathered from the shards) to ``DIR/versions/<step>``. A second
    model trains 1..10 with a Full save at 6 into ``DIR/full`` and logs the losses of 7..10;
    then a third model, from another seed, restores ``DIR/full`` and trains 7..10: its losses
    must equal the uninterrupted ones bit for bit. Finally ``DIR/parity`` is restored into a
    fresh model at this world size and compared with the versions its composite names.
``fsdp-restore``  (any world size) only that last part: restore ``DIR/parity`` into FSDP2 and
    compare; ``fsdp-restore-mesh`` the same for ``DIR/mesh``.
``ddp``  world 2, DDP. Parity saves at steps 2 and 4 into ``DIR/ddp`` (bytes per rank
    recorded), versions written as above, then a restore at this world size, compared.
``fsdp-url``  as the first half of ``fsdp-train`` (Parity saves every 2 steps up to 8, then a
    restore at this world size), with the run at ``$RUN_ROOT/parity`` (an ``s3://`` URL): each
    rank uploads its own parts; launched as two single-process "nodes" with no shared directory.
``fsdp-tiers``  world 2, FSDP2: Parity saves at every step up to 8 into ``DIR/tiered``, async,
    committed to a host-memory tier at ``$TIER_DIR`` (``promote_every=3``; no other scenario
    reads it) in front of it, closed (the last save promoted), then a restore at this world
    size, which reads the memory tier.
``fsdp-frozen``  world 2, FSDP2, the q and v projections of every layer frozen (as a LoRA
    freezes its base weights): Parity saves at steps 2, 4, 6 into ``DIR/sync/frozen`` and, async,
    into ``DIR/async/frozen`` (versions under each), then ``DIR/async/frozen`` restored at this
    world size and compared.
``pipeline``  (world 2: two pipeline stages; world 4: two stages x ``fully_shard`` over two data
    ranks) each rank keeps its stage's half of the layers under their original names, as
    torchtitan's pipeline split does (the first stage the embedding, the last the norm and
    head); the stages train steps 1..6 (hidden states and their gradients sent between them)
    with Parity saves at 2, 4 and 6 into ``DIR/stages`` (drift tracked), each stage's first rank
    writing its stage's versions to ``DIR/versions/<step>.stage<k>``; fresh stages restore it
    and compare every tensor, the LR scheduler and the optimizer groups; then stages that cut
    layer 2 between them build a ``Tailor`` of ``DIR/split`` (``timeout=60``): the refusal recorded.
``pipeline-freeze``  world 2, two pipeline stages: Parity saves at every step 1..6 into
    ``DIR/stages``, the second stage alone freezing one of its weights before step 3's save;
    each rank records how many saves exchanged frozen reports, then fresh stages restore and compare.
``pipeline-tp``  world 4: ``pipeline``'s two stages, each tensor parallel over two ranks (a
    ``("pp", "tp")`` mesh, docs/distributed.md's ``parallelize_stage``): saves, versions and the
    restore into fresh stages as there (no split layer).
``pipeline-restore-<K>``  K stages (over this world's ranks) restore ``DIR/stages`` and compare
    every tensor with its composite version.
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
``mesh``  world 4, dp 2 x tp 2 (the snippet of docs/distributed.md, run as written: tensor parallel
    on the attention and MLP linears, ``fully_shard`` on the data sub-mesh; the tensor-parallel
    ranks of a data rank train on the same batches). Parity saves at steps 2 and 4 into
    ``DIR/mesh`` (the full versions written as in ``fsdp-train``), then restored at 4 ranks
    into the same layout and into FSDP2 alone (tp 2 -> 1), each compared with the composite.
``ddp-read-once``  (world 3) DDP: Parity saves at steps 2 and 4 into ``$RUN_ROOT/ddp`` (an ``s3://``
    URL), versions written as above; then a restore at this world size into a fresh model, each
    rank counting the bytes and reads it asks of the object store, by key, its broadcasts and the
    items of its read plans, and compared; then
    rank 0 flips a byte of ``layer.1`` in the data file of the version the composite names, and
    every rank restores again into a fresh model and records the error it got, then restores with
    ``fallback`` into a fresh model and compares it with the composite it restored; then rank 0 also
    flips a byte of the composite's global.json, and every rank restores again, its error recorded.
``fetch-as-they-come``  (world 3) a read plan's ``fetch`` of three items, one per rank: the item
    whose turn is first (the smallest) is read by rank 2 only once rank 2 has been sent the other
    two; each rank records the items in the order it was given them, their values, whether
    rank 2's read waited for the others (rather than giving up after 30 s), and whether each item
    it received landed in the tensor it gave for it (``into``; b's a non-contiguous view, which
    cannot take the bytes as they are).
``hsdp-read-once``  (world 4) HSDP (2 replicas x 2 shards): Parity saves at steps 2 and 4 into
    ``$RUN_ROOT/hsdp``, versions written; then a restore at this layout, each rank counting the
    bytes it fetches by key, its broadcasts and the items of its read plans, and compared.
``fsdp-read-once-save`` / ``fsdp-read-once``  (world 2, then any) FSDP2: Parity saves at steps 2
    and 4 into ``$RUN_ROOT/fsdp``, versions written; then (another launch, at another world size)
    a restore into a fresh model, each rank counting the bytes and reads it asks of the object
    store by key, and compared; then rank 0 flips a byte of ``layer.1`` in its data file and
    every rank restores again into a fresh model, its error recorded; then, the byte flipped
    back, a restore in which rank 1's first fetch of a piece fails, each rank's error recorded.
``pipeline-ddp-read-once``  (world 4) two pipeline stages, each DDP over two data ranks, restore
    ``$RUN_ROOT/single`` (a one-process save the test made), each rank counting the bytes it
    fetches by key, and compare with ``DIR/versions/single.safetensors``.
``read-kill``  started without torchrun (as ``kill``), world 3, DDP: Parity saves at steps 2 and 4
    into ``DIR/readkill``, then every rank restores it into a fresh model (timeout 10 s) and rank 1
    SIGKILLs itself as it begins reading its first unit (a reader of the read plan), once it has
    told the others what it holds; ranks 0 and 2 record the error they get.
``nodes-fsdp`` / ``nodes-ddp``  launched as two "nodes" (``--nnodes 2``), each with its own
    ``$NODE_DIR``: Parity saves at every step 1..4, async, into the node-local tier ``$NODE_DIR``
    (``scope="node"``, ``replicas=2``, ``keep=2``) in front of the shared run ``$RUN_HOME``, the
    Tailor made by docs/storage-and-tiers.md's snippet as written;
    versions written by rank 0 to its ``DIR`` (node 0's own); closed (the last save promoted).
``nodes-restore-fsdp`` / ``nodes-restore-ddp``  a fresh launch of the same nodes restores it (from
    each node's own copy) and compares every tensor with its composite version (rank 0).
``nodes-single-ddp``  two "nodes", DDP, ``replicas=1`` (each node holds only its own ranks' parts;
    no promotion but the one ``close`` makes, which fails as node 0 lacks node 1's parts: the
    error recorded): Parity saves at 1..4 into the node-local tier beside ``$NODE_DIR``
    (``single``) in front of ``$RUN_HOME-single``, versions in ``DIR/single``, then a fresh model
    restores from each node's copy, each unit read by a rank whose node holds it, and rank 0
    compares every tensor.
``nodes-pipelined``  two "nodes" of DDP ranks, async Parity saves (two in flight) into the node-local tier beside
    ``$NODE_DIR`` (``pipelined``, ``replicas=2``) in front of ``$RUN_HOME-pipelined``: 1 and 2
    committed; step 3 fails on node 1 alone (its last rank's extra cannot be encoded, reported by
    the background save) and step 4 is saved behind it (the error each rank gets, the newest
    step and each rank's copy's steps recorded); then 5, 6 and 7, the last two in flight at
    ``close``; each copy's steps and lineage recorded; a fresh model restores 2, then 7,
    each compared with its composite (rank 0).
``nodes-refused``  two "nodes", DDP: a Tailor of ``unwritable`` beside ``$RUN_HOME`` whose node-local tier ``$UNWRITABLE_DIR`` node 1
    cannot create (the error each rank gets recorded); then one at ``$FULL_DIR`` (node 1's on a
    small tmpfs) saves step 1, node 1 fills its tmpfs, step 2 is saved (the error each rank gets
    recorded), the filler is removed and a fresh Tailor restores (step and mismatches recorded).
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
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

from helpers import drop_from_unit_index, flip_unit_byte, tiny, unit_chunk_middle  # noqa: E402
from storage_calls import StorageCalls  # noqa: E402

from llmtailor import Full, Parity, Tailor, Tier  # noqa: E402
from llmtailor.distributed.coordinator import StoreCoordinator  # noqa: E402
from llmtailor.errors import IntegrityError  # noqa: E402
from llmtailor.store.keys import optim_key, weight_key  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402
from llmtailor.store.storage.local import LocalStorage  # noqa: E402
from llmtailor.training_example import batch_at, corpus_tokens  # noqa: E402

TOKENS = corpus_tokens()


def rank() -> int:
    return dist.get_rank()


def shard(model: torch.nn.Module, replicas: int = 1) -> torch.nn.Module:
    """FSDP2 over every rank; with ``replicas`` > 1, HSDP: sharded over world / replicas ranks,
    each shard replicated ``replicas`` times."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tensor_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The data x tensor parallel snippet of docs/distributed.md, run as written on ``model``."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text(encoding="utf-8")
    start = text.index("## Tensor parallel and FSDP2")
    code = re.compile(r"^```python\n(.*?)^```", re.S | re.M).search(text, start).group(1)
    exec(code, {"model": model})
    return model


TP = 2  # the snippet's tensor-parallel degree (its mesh is dp 2 x tp 2)


def data_rank(model: torch.nn.Module) -> int:
    """Which data shard this rank trains on: its ``dp`` coordinate under tensor parallel (the
    ranks of one tensor-parallel group must see the same batches), else its rank."""
    two_d = any(getattr(p, "device_mesh", None) is not None and p.device_mesh.ndim == 2 for p in model.parameters())
    return rank() // TP if two_d else rank()


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
    elif kind == "tp":
        model = tensor_parallel(model)
    elif kind == "hsdp":
        model = shard(model, replicas=2)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer, scheduler = build_optimizer(model, total_steps=50)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps) -> list[str]:
    """Each rank trains on its own batches (rank-dependent data, as a data-parallel job)."""
    losses = []
    for step in steps:
        batch = batch_at(TOKENS, step * 100 + data_rank(model), 2, 32)
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


def write_versions(out: Path, step: int, model, optimizer, name: str | None = None, writer: bool | None = None) -> None:
    """Every tensor's full value (collective), written by rank 0 (or ``writer``) to
    ``versions/<name or step>.safetensors``; a pipeline stage's first rank writes its stage's."""
    values = versions(model, optimizer)
    if rank() == 0 if writer is None else writer:
        (out / "versions").mkdir(parents=True, exist_ok=True)
        save_file(values, str(out / "versions" / f"{name or step}.safetensors"))


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
    saved = {step: {key: value for path in sorted((out / "versions").glob(f"{step}.*safetensors"))  # every stage's
                    for key, value in load_file(str(path)).items()}
             for step in set(composite.sources.values())}
    bad = []
    for key, value in restored.items():
        name = key.split("/")[1]
        expected = saved[composite.sources[layout.unit_of(name)]][key]
        if value.dtype != expected.dtype or not torch.equal(value, expected):
            bad.append(key)
    return bad


def save_loop(kind: str, out: Path, run_name: str, policy, last: int, every: int, freeze: bool = False,
              async_save: bool = False, tier: str | None = None) -> dict:
    """``tier``: a memory tier's directory in front of the run (``fsdp-tiers``)."""
    model, optimizer, scheduler = build(kind, seed=0, freeze=freeze)
    tiers = [Tier(tier, keep=2, promote_every=3)] if tier else []
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


def restore_and_compare(kind: str, out: Path, run_name: str, freeze: bool = False, tier: str | None = None) -> dict:
    model, optimizer, scheduler = build(kind, seed=5, freeze=freeze)
    tiers = [Tier(tier, keep=2, promote_every=3)] if tier else []
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


def documented_split():
    """``pipeline_stage(model, stage, stages)`` as docs/distributed.md shows it (its block run here)."""
    from test_readme import block

    namespace: dict = {}
    exec(block("docs/distributed.md", "## Pipeline stages", "python"), namespace)
    return namespace["pipeline_stage"]


def documented_stage_parallel():
    """``parallelize_stage(model, mesh)`` as docs/distributed.md shows it: tensor parallel inside a stage."""
    from test_readme import block

    namespace: dict = {}
    exec(block("docs/distributed.md", "Tensor parallel inside each stage:", "python"), namespace)
    return namespace["parallelize_stage"]


def pipeline_stage(stages: int, seed: int = 0, split: bool = False, tp: int = 1, ddp: bool = False) -> torch.nn.Module:
    """This rank's stage of a tiny Llama, split as the docs show (``documented_split``): its share
    of the layers under their original names, the embedding on the first stage only, norm and
    head on the last; sharded over the stage's data ranks if it has several. Its forward is the
    stage's part of the model's (``stage_forward``). ``split``: layer ``per`` is cut between the
    first two stages (its attention on the first, its MLP on the second): it cannot be saved.
    ``tp`` > 1: tensor parallel inside each stage over ``tp`` ranks (``documented_stage_parallel``),
    on a ``("pp", "tp")`` mesh or, with data ranks too, a ``("pp", "dp", "tp")`` one. ``ddp``: the
    stage replicated over its data ranks by DDP (over the ``dp`` group) instead of sharded."""
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = dist.get_world_size() // stages // tp
    if tp > 1:
        shape, names = ((stages, data, tp), ("pp", "dp", "tp")) if data > 1 else ((stages, tp), ("pp", "tp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", (stages, data), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    model, _, _ = tiny(seed=seed)
    layers = list(model.model.layers)
    model = documented_split()(model, stage, stages)
    per = len(layers) // stages
    if split and stage == 0:
        model.model.layers[str(per)] = layers[per]
        layers[per].mlp = None
    elif split and stage == 1:
        layers[per].self_attn = None
    model.forward = partial(stage_forward, model)
    if tp > 1:
        return documented_stage_parallel()(model, mesh)
    if data > 1 and ddp:
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    if data > 1:
        for layer in model.model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def stage_forward(model, inputs: torch.Tensor) -> torch.Tensor:
    """The stage's part of the model's forward: token ids (first stage) or hidden states in,
    hidden states or logits (last stage) out."""
    inner = model.model
    hidden = inner.embed_tokens(inputs) if inner.embed_tokens is not None else inputs
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    rotary = inner.rotary_emb(hidden, position_ids=positions)
    for layer in inner.layers.values():
        hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
    return model.lm_head(inner.norm(hidden)) if model.lm_head is not None else hidden


def pipeline_step(model, optimizer, scheduler, step: int, data: int, tp: int = 1) -> None:
    """One training step of two stages (a one-micro-batch schedule) of ``data`` ranks each: the
    first sends its hidden states to the rank of the same index in the second, which computes
    the loss and sends their gradient back. Each data index trains on its own batch (the ``tp``
    tensor-parallel ranks of one data index on the same)."""
    stage, index = divmod(rank(), data)
    peer = (1 - stage) * data + index
    batch = batch_at(TOKENS, step * 100 + index // tp, 2, 32)
    if stage == 0:
        hidden = model(batch)
        dist.send(hidden.detach().contiguous(), peer)
        grad = torch.empty_like(hidden)
        dist.recv(grad, peer)
        hidden.backward(grad)
    else:
        hidden = torch.empty(batch.shape[0], batch.shape[1], model.config.hidden_size)
        dist.recv(hidden, peer)
        hidden.requires_grad_()
        logits = model(hidden)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        dist.send(hidden.grad.contiguous(), peer)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def pipeline(out: Path, stages: int = 2, tp: int = 1) -> dict:
    """Two stages (x data ranks, or x ``tp`` tensor-parallel ranks): Parity saves at 2, 4, 6 into
    ``DIR/stages`` with drift, the versions of each stage's tensors written by its first rank; a
    restore into fresh stages; then (``tp`` 1) stages that split a layer between them, refused."""
    from llmtailor.training_example import build_optimizer

    data = dist.get_world_size() // stages
    model = pipeline_stage(stages, tp=tp)
    optimizer, scheduler = build_optimizer(model, total_steps=50)
    saves = []
    with Tailor(out / "stages", model, optimizer, scheduler, policy=Parity(), timeout=60) as tailor:
        for step in range(1, 7):
            pipeline_step(model, optimizer, scheduler, step, data, tp)
            if step % 2 == 0:
                report = tailor.save(step, extra={"rank": rank()})
                write_versions(out, step, model, optimizer, name=f"{step}.stage{rank() // data}", writer=rank() % data == 0)
                saves.append({"step": step, "units": report.units, "rank_bytes": report.rank_bytes})
    result = {"saves": saves, **restore_stages(out, stages, optimizer, scheduler, tp)}
    if tp > 1:
        return result
    split = pipeline_stage(stages, split=True)
    try:
        Tailor(out / "split", split, *build_optimizer(split, total_steps=50), timeout=60)
        result["refused"] = None
    except Exception as err:  # the refusal each rank gets is the point of this part
        result["refused"] = f"{type(err).__name__}: {err}"
    return result


def pipeline_freezing(out: Path) -> dict:
    """Two stages, Parity saves at every step 1..6 into ``DIR/stages`` (drift tracked, versions
    written as ``pipeline`` does); before step 3's save the second stage alone freezes
    ``FROZEN_MID_RUN``. Records how many saves exchanged the frozen reports on this rank, then
    restores into fresh stages (``restore_stages``)."""
    from llmtailor.training_example import build_optimizer

    model = pipeline_stage(2)
    optimizer, scheduler = build_optimizer(model, total_steps=50)
    exchanged: list[str] = []
    with Tailor(out / "stages", model, optimizer, scheduler, policy=Parity(), timeout=60) as tailor:
        exchange = tailor.coordinator.exchange

        def counted(tag: str, value):
            exchanged.extend([tag] if tag.endswith("/frozen") else [])
            return exchange(tag, value)

        tailor.coordinator.exchange = counted
        for step in range(1, 7):
            pipeline_step(model, optimizer, scheduler, step, 1)
            if step == 3 and rank() == 1:
                model.get_parameter(FROZEN_MID_RUN).requires_grad_(False)
            tailor.save(step)
            write_versions(out, step, model, optimizer, name=f"{step}.stage{rank()}", writer=True)
    return {"exchanges": len(exchanged), **restore_stages(out, 2, optimizer, scheduler)}


FROZEN_MID_RUN = "model.layers.3.self_attn.q_proj.weight"
"""A weight of the second of two pipeline stages that ``pipeline_freezing`` freezes mid-run."""


def restore_stages(out: Path, stages: int, optimizer=None, scheduler=None, tp: int = 1) -> dict:
    """Fresh stages restore ``DIR/stages`` and compare every tensor with its composite version,
    and the scheduler and groups with the live ones that saved it (when given)."""
    from llmtailor.training_example import build_optimizer

    fresh = pipeline_stage(stages, seed=5, tp=tp)
    fresh_optimizer, fresh_scheduler = build_optimizer(fresh, total_steps=50)
    report = Tailor(out / "stages", fresh, fresh_optimizer, fresh_scheduler, timeout=60).restore()

    def hyper(opt):
        return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    return {
        "restored": report.step, "extra": report.extra, "unmapped": list(report.unmapped),
        "mismatches": compare_with_composite(out, out / "stages", fresh, fresh_optimizer),
        "scheduler": [scheduler is None or fresh_scheduler.state_dict() == scheduler.state_dict(), fresh_scheduler.last_epoch],
        "groups": optimizer is None or hyper(fresh_optimizer) == hyper(optimizer),
    }


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


def count_fetched() -> StorageCalls:
    """What this rank asks of the object store from now on (every ``ObjectStore``'s reads and
    sizes, by key: ``bytes_by_key``, ``by_key``), filled in as it reads."""
    from llmtailor.store.storage.object_store import ObjectStore

    return StorageCalls.in_process((ObjectStore,))


def count_sent_ranges() -> dict[str, int]:
    """Bytes of the byte ranges a distributed restore fetches once in the job
    (``store.shared_ranges.read_once``, as the FSDP2 provider calls it) that this rank needs
    (``needed``: its ranges, summed) and that it received from the other ranks over
    torch.distributed (``received``: byte tensors broadcast from or sent by another rank while
    in it, each message's head not counted), and the collectives it took part in there
    (``collectives``: broadcasts and all-reduces): filled in as this rank restores."""
    import llmtailor.providers.fsdp as fsdp_provider
    from llmtailor.distributed import read_plan

    head = getattr(read_plan, "_HEAD", 0)  # the bytes before the parts in each message

    counts = {"needed": 0, "received": 0, "collectives": 0}
    inside = []
    real_read_once, real_broadcast, real_irecv = fsdp_provider.read_once, dist.broadcast, dist.irecv
    real_all_reduce = dist.all_reduce

    def read_once(coordinator, storage, needs, *args, **kwargs):
        counts["needed"] += sum(length for ranges in needs.values() for _, _, length in ranges)
        inside.append(True)
        try:
            return real_read_once(coordinator, storage, needs, *args, **kwargs)
        finally:
            inside.pop()

    def received(tensor, source) -> None:
        if inside and tensor.dtype == torch.uint8 and source != dist.get_rank():
            counts["received"] += tensor.numel()

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        counts["collectives"] += bool(inside)
        received(tensor, src if group_src is None else dist.get_global_rank(group or dist.group.WORLD, group_src))
        return real_broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)

    def all_reduce(tensor, *args, **kwargs):
        counts["collectives"] += bool(inside)
        return real_all_reduce(tensor, *args, **kwargs)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        received(tensor[head:], src if group_src is None else dist.get_global_rank(group or dist.group.WORLD, group_src))
        return real_irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)

    fsdp_provider.read_once, dist.broadcast, dist.irecv, dist.all_reduce = read_once, broadcast, irecv, all_reduce
    return counts


def count_plan_broadcasts() -> dict[str, int]:
    """This rank's broadcasts (``torch.distributed.broadcast`` calls: ``broadcasts``), the items
    of the read plans it made (``items``, over every ``ReadPlan``), the items it read itself in
    their ``fetch`` (``own``) and the items' heads ``fetch`` posted to receive (``receipts``) from
    now on, filled in as it restores."""
    import sys

    from llmtailor.distributed import read_plan

    counts = {"broadcasts": 0, "items": 0, "own": 0, "receipts": 0}
    real_broadcast, real_plan, real_fetch, real_irecv = dist.broadcast, read_plan.ReadPlan.__init__, read_plan.ReadPlan.fetch, dist.irecv

    def broadcast(*args, **kwargs):
        counts["broadcasts"] += 1
        return real_broadcast(*args, **kwargs)

    def plan(self, coordinator, items, *args, **kwargs):
        counts["items"] += len(items)
        real_plan(self, coordinator, items, *args, **kwargs)

    def fetch(self, *args, **kwargs):
        counts["own"] += len(self.mine())
        return real_fetch(self, *args, **kwargs)

    def irecv(*args, **kwargs):  # an item's head: posted by ``fetch`` itself, through ``_receive_into``
        caller = sys._getframe(1)
        counts["receipts"] += caller.f_code.co_name == "_receive_into" and caller.f_back.f_code.co_name == "fetch"
        return real_irecv(*args, **kwargs)

    dist.broadcast, read_plan.ReadPlan.__init__, read_plan.ReadPlan.fetch, dist.irecv = broadcast, plan, fetch, irecv
    return counts


def corrupt_unit_file(url: str, unit: str) -> str:
    """Flip a byte in the middle of the first chunk of ``unit`` in its data file
    (``helpers.unit_chunk_middle``), in the version the composite of the run at ``url`` names;
    return the file's key."""
    import obstore

    run = Run(url)
    storage, key, at = unit_chunk_middle(run, run.resolve().sources[unit], unit)
    data = bytearray(storage.read(key))
    data[at] ^= 0xFF
    obstore.put(storage.store, key, bytes(data))
    return key


def read_once(kind: str, out: Path) -> dict:
    """Saves, then a restore into a fresh model, what this rank fetched from the store by key
    counted from the Tailor's making to the restore's end (the comparison after reads the run too)."""
    result = save_loop(kind, out, kind, Parity(), last=4, every=2)
    calls = count_fetched()
    model, optimizer, scheduler = build(kind, seed=5)
    plans = count_plan_broadcasts()
    report = Tailor(location(out, kind), model, optimizer, scheduler, timeout=60).restore()
    result.update(fetched=dict(calls.bytes_by_key()), reads=dict(calls.by_key()), restored=report.step,
                  broadcasts=plans["broadcasts"], plan_items=plans["items"], plan_own=plans["own"],
                  plan_receipts=plans["receipts"], leases=sum(calls.leases().values()),
                  mismatches=compare_with_composite(out, location(out, kind), model, optimizer))
    return result


def restore_counted(kind: str, out: Path) -> dict:
    """A restore of the run ``kind`` into a fresh model: what this rank fetched, the reads and the
    sizes (HEAD requests) it asked, by key, and the restored tensors compared with the composite; and how many units each
    data file of the composite holds (counted before, not among the reads)."""
    run = Run(str(location(out, kind)))
    composite, units_of_files = run.resolve(), {}
    for unit, step in composite.sources.items():
        for file in run.unit_entry(step, unit).files:
            key = run.file_location(step, file)[1]
            units_of_files[key] = units_of_files.get(key, 0) + 1
    calls, sent = count_fetched(), count_sent_ranges()
    model, optimizer, scheduler = build(kind, seed=5)
    report = Tailor(location(out, kind), model, optimizer, scheduler, timeout=60).restore()
    return {"fetched": dict(calls.bytes_by_key()), "reads": dict(calls.by_key()), "looks": dict(calls.by_key(("size",))),
            "restored": report.step,
            "units_of_files": units_of_files,
            "ranges_needed": sent["needed"], "ranges_received": sent["received"], "collectives": sent["collectives"],
            "mismatches": compare_with_composite(out, location(out, kind), model, optimizer)}


def refused_restore(out: Path, kind: str) -> str | None:
    """A restore of the run ``kind`` into a fresh model: the error it raised on this rank, or None."""
    try:
        Tailor(location(out, kind), *build(kind, seed=7), timeout=60).restore()
        return None
    except Exception as err:  # the error each rank gets is the point of the scenarios calling this
        return f"{type(err).__name__}: {err}"


def refused_read(out: Path, kind: str, failing: int) -> str | None:
    """A restore of the run ``kind`` into a fresh model in which rank ``failing``'s first fetch of
    a piece of the files (``store.shared_ranges``) fails as a read of a damaged object does: the
    error it raised on this rank, or None."""
    import llmtailor.store.shared_ranges as shared_ranges

    real = shared_ranges.fetch_into
    if rank() == failing:
        def fail_first(storage, key, *args, **kwargs):
            shared_ranges.fetch_into = real
            raise IntegrityError(f"{storage.where(key)}: injected damage")

        shared_ranges.fetch_into = fail_first
    try:
        return refused_restore(out, kind)
    finally:
        shared_ranges.fetch_into = real


def ddp_read_once(out: Path) -> dict:
    """``read_once``; then a restore after rank 0 corrupted a unit's file, then one after it also
    corrupted the composite's global.json (read before any unit): each rank's error and fetches."""
    result = read_once("ddp", out)
    calls = count_fetched()
    dist.barrier()
    result["corrupted"] = corrupt_unit_file(str(location(out, "ddp")), "layer.1") if rank() == 0 else None
    dist.barrier()
    calls.clear()
    result["refused"] = refused_restore(out, "ddp")
    result["fetched_corrupt"] = dict(calls.bytes_by_key())
    dist.barrier()
    result["fallback"] = fallen_back(out, "ddp")
    dist.barrier()
    result["corrupted_global"] = corrupt_global_json(str(location(out, "ddp"))) if rank() == 0 else None
    dist.barrier()
    calls.clear()
    result["refused_global"] = refused_restore(out, "ddp")
    result["fetched_global"] = dict(calls.bytes_by_key())
    return result


def fallen_back(out: Path, kind: str) -> dict:
    """A restore with ``fallback`` of the run ``kind`` (its newest composite damaged) into a fresh
    model: the step it restored, and the tensors that differ from that composite's versions
    (those the failed attempt received into the live tensors before its failure was known
    included)."""
    model, optimizer, scheduler = build(kind, seed=7)
    report = Tailor(location(out, kind), model, optimizer, scheduler, timeout=60).restore(fallback=True)
    return {"restored": report.step, "skipped": sorted(report.skipped),
            "mismatches": compare_with_composite(out, location(out, kind), model, optimizer, report.step)}


def corrupt_global_json(url: str) -> str:
    """Flip a byte in the middle of the global.json of the newest composite of the run at ``url``;
    return its key."""
    import obstore

    run = Run(url)
    key = f"{run.snapshot_key(run.resolve().step)}/global.json"
    data = bytearray(run.storage.read(key))
    data[len(data) // 2] ^= 0x01
    obstore.put(run.storage.store, key, bytes(data))
    return key


def pipeline_ddp_read_once(out: Path) -> dict:
    """Two pipeline stages, each DDP over two data ranks, restore ``$RUN_ROOT/single`` (saved by
    the test in one process, its tensors in ``DIR/versions/single.safetensors``): what each rank
    fetched by key, and the restored tensors compared with the saved ones."""
    from llmtailor.training_example import build_optimizer

    calls = count_fetched()
    model = pipeline_stage(2, seed=5, ddp=True)
    optimizer, scheduler = build_optimizer(model.module, total_steps=50)
    report = Tailor(f"{os.environ['RUN_ROOT']}/single", model, optimizer, scheduler, timeout=60).restore()
    result = {"restored": report.step, "fetched": dict(calls.bytes_by_key()), "reads": dict(calls.by_key())}
    saved, restored = load_file(str(out / "versions" / "single.safetensors")), versions(model, optimizer)
    result.update(compared=len(restored), mismatches=[k for k, v in restored.items() if not torch.equal(v, saved[k])])
    return result


def fetch_as_they_come() -> dict:
    """``fetch-as-they-come`` (module docstring)."""
    from llmtailor.distributed.coordinator import LocalCoordinator
    from llmtailor.distributed.read_plan import ReadPlan

    coordinator = LocalCoordinator()
    coordinator.world_size, coordinator.rank, coordinator.timeout = dist.get_world_size(), rank(), 120
    sizes = {"a": 64, "b": 64, "c": 16}
    plan = ReadPlan(coordinator, sizes)
    others_in, waited, order = threading.Event(), [], []

    def read(item: str) -> list[torch.Tensor]:
        if item == "c":
            waited.append(others_in.wait(coordinator.timeout))  # the bound on a hang: the plan's own waits'
        return [torch.full((sizes[item] // 4,), float(ord(item)))]

    values, landed = {}, {}
    given = {"a": torch.zeros(16), "b": torch.zeros(32)[::2], "c": torch.zeros(4)}
    for item, tensors in plan.fetch(read, lambda item: [(torch.float32, [sizes[item] // 4])], into=lambda item: [given[item]]):
        order.append(item)
        values[item] = sorted(set(tensors[0].tolist()))
        if plan.readers[item] != rank():
            landed[item] = tensors[0] is given[item]
        if {"a", "b"} <= set(order):
            others_in.set()
    return {"readers": plan.readers, "order": order, "values": values, "waited": waited, "landed": landed}


def kill_a_reader(out: Path) -> dict:
    save_loop("ddp", out, "readkill", Parity(), last=4, every=2)
    # The survivors wait out the timeout for rank 1: short, as the restore starts on every rank
    # together (the barrier), so a slow live rank has only the restore's own rounds to lag in;
    # the Tailor's start (its own rounds, before the barrier) waits as long as a busy machine needs.
    tailor = Tailor(out / "readkill", *build("ddp", seed=7), timeout=60)
    tailor.coordinator.timeout = 10
    if rank() == 1:
        # It dies in its first read once it has told the others what it holds (its reads start
        # beside that exchange): the others are then in the read plan's broadcasts, waiting for it.
        told, real_exchange = threading.Event(), StoreCoordinator.exchange

        def exchange(self, tag, value):
            answer = real_exchange(self, tag, value)
            if tag.endswith("/held"):
                told.set()
            return answer

        def die(*args, **kwargs):
            told.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)

        StoreCoordinator.exchange, Run.read_unit = exchange, die
    dist.barrier()
    start = time.perf_counter()
    try:
        tailor.restore()
        outcome = "restored"
    except Exception as err:  # the error a surviving rank gets is the point of this scenario
        outcome = f"{type(err).__name__}: {err}"
    return {"outcome": outcome, "seconds": time.perf_counter() - start}


def fallback_past_damage(out: Path) -> dict:
    """Saves at 2, 4, 6; rank 0 flips a byte of rank 1's part of layer.0 at step 6 (the newest
    composite takes layer.0 from there); every rank restores with ``fallback=True``: the damage
    is met while loading (by the rank reading those bytes), every rank passes over 6 and loads 4."""
    save_loop("fsdp", out, "fallback", Parity(), last=6, every=2)
    if rank() == 0:
        flip_unit_byte(out / "fallback", 6, "layer.0", rank=1)  # in rank 1's file (its pack)
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


def node_tier(location: str, keep: int | None = 2) -> list[Tier]:
    """The node-local tier of the ``nodes-*`` scenarios: each node's own directory, replicas on 2 nodes."""
    return [Tier(location, scope="node", replicas=2, keep=keep)]


def documented_node_tier(model, optimizer, lr_scheduler) -> Tailor:
    """The Tailor of docs/storage-and-tiers.md's node-local tiers snippet, run as written (its
    ``/dev/shm/exp1`` this node's ``$NODE_DIR``, its ``s3://ckpt/exp1`` the shared ``$RUN_HOME``)."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "storage-and-tiers.md").read_text(encoding="utf-8")
    start = text.index("### Node-local tiers and replicas")
    code = re.compile(r"^```python\n(.*?)^```", re.S | re.M).search(text, start).group(1)
    code = code.replace("/dev/shm/exp1", os.environ["NODE_DIR"]).replace("s3://ckpt/exp1", os.environ["RUN_HOME"])
    scope = {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler}
    exec(code, scope)
    return scope["tailor"]


def nodes_save(kind: str, out: Path) -> dict:
    model, optimizer, scheduler = build(kind, seed=0)
    tailor = documented_node_tier(model, optimizer, scheduler)
    for step in range(1, 5):
        train(model, optimizer, scheduler, [step])
        tailor.save(step, extra={"rank": rank()})
        write_versions(out, step, model, optimizer)  # collective: the async save's copies are taken by then
    tailor.close()
    return {"sent": tailor.tiers.placement.courier.sent_bytes, "promoted": [p.step for p in tailor.tiers.promotions]}


def nodes_restore(kind: str, out: Path) -> dict:
    model, optimizer, scheduler = build(kind, seed=5)
    tailor = Tailor(os.environ["RUN_HOME"], model, optimizer, scheduler, timeout=60, tiers=node_tier(os.environ["NODE_DIR"]))
    calls = StorageCalls.in_process((LocalStorage,))
    report = tailor.restore()
    result = {"restored": report.step, "tier": report.tier, "extra": report.extra, "read": sorted(calls.by_key()),
              "mismatches": compare_with_composite(out, os.environ["NODE_DIR"], model, optimizer)}
    tailor.close()
    return result


def nodes_single(out: Path) -> dict:
    """``nodes-single-ddp`` (module docstring)."""
    from llmtailor.errors import PromotionError

    where, home = Path(os.environ["NODE_DIR"]).with_name("single"), os.environ["RUN_HOME"] + "-single"
    out = out / "single"  # its versions apart from another scenario's of this launch
    tiers = [Tier(str(where), scope="node", replicas=1, keep=None, promote_every=10**6)]
    model, optimizer, scheduler = build("ddp", seed=0)
    tailor = Tailor(home, model, optimizer, scheduler, policy=Parity(), timeout=60, tiers=tiers)
    for step in range(1, 5):
        train(model, optimizer, scheduler, [step])
        tailor.save(step, extra={"rank": rank()})
        write_versions(out, step, model, optimizer)
    try:
        tailor.close()
        promotion = None
    except PromotionError as err:  # expected until each node promotes its own parts
        promotion = str(err)
    fresh, fresh_optimizer, fresh_scheduler = build("ddp", seed=5)
    report = Tailor(home, fresh, fresh_optimizer, fresh_scheduler, timeout=60, tiers=tiers, read_only=True).restore()
    return {"promotion": promotion, "restored": report.step, "tier": report.tier, "extra": report.extra,
            "mismatches": compare_with_composite(out, where, fresh, fresh_optimizer)}


def nodes_refused(out: Path) -> dict:
    """``nodes-refused`` (module docstring)."""
    result = {}
    try:
        Tailor(Path(os.environ["RUN_HOME"]).with_name("unwritable"), *build("ddp", seed=0), timeout=60, tiers=node_tier(os.environ["UNWRITABLE_DIR"]))
        result["unwritable"] = None
    except Exception as err:  # the error each rank gets is the point of this part
        result["unwritable"] = f"{type(err).__name__}: {err}"
    model, optimizer, scheduler = build("ddp", seed=0)
    home = os.environ["RUN_HOME"]
    tailor = Tailor(home, model, optimizer, scheduler, timeout=60, tiers=node_tier(os.environ["FULL_DIR"], keep=None))
    train(model, optimizer, scheduler, [1])
    tailor.save(1)
    write_versions(out, 1, model, optimizer)
    filler = Path(os.environ["FULL_DIR"]).parent / "filler"
    if os.environ.get("FILL"):
        with open(filler, "wb") as sink:
            try:
                while True:
                    sink.write(b"\0" * 65536)
                    sink.flush()
            except OSError:
                pass
    dist.barrier()
    train(model, optimizer, scheduler, [2])
    try:
        tailor.save(2)
        result["full"] = None
    except Exception as err:  # the error each rank gets is the point of this part
        result["full"] = f"{type(err).__name__}: {err}"
    tailor.close()
    filler.unlink(missing_ok=True)
    dist.barrier()
    fresh, fresh_optimizer, fresh_scheduler = build("ddp", seed=5)
    report = Tailor(home, fresh, fresh_optimizer, fresh_scheduler, timeout=60,
                    tiers=node_tier(os.environ["FULL_DIR"], keep=None)).restore()
    result.update(restored=report.step, tier=report.tier,
                  mismatches=compare_with_composite(out, os.environ["FULL_DIR"], fresh, fresh_optimizer))
    return result


def nodes_pipelined(out: Path) -> dict:
    """``nodes-pipelined`` (module docstring)."""
    from llmtailor.errors import BackgroundSaveError

    where, home = Path(os.environ["NODE_DIR"]).with_name("pipelined"), os.environ["RUN_HOME"] + "-pipelined"
    out = out / "pipelined"  # its versions apart from another scenario's of this launch
    tiers = [Tier(str(where), scope="node", replicas=2, keep=None)]
    model, optimizer, scheduler = build("ddp", seed=0)
    tailor = Tailor(home, model, optimizer, scheduler, policy=Parity(), timeout=60, tiers=tiers, async_save=True,
                    async_in_flight=2)
    last = rank() == dist.get_world_size() - 1  # on node 1

    def save(step: int, extra: dict | None = None) -> None:
        train(model, optimizer, scheduler, [step])
        tailor.save(step, extra={"rank": rank(), **(extra or {})})
        write_versions(out, step, model, optimizer)  # collective: the async save's copies are taken by then

    save(1)
    save(2)
    tailor.wait()
    save(3, {"unencodable": object()} if last else None)  # fails on node 1, in the background
    try:
        save(4)  # staged behind it
        tailor.wait()
        failure = None
    except BackgroundSaveError as err:
        failure = str(err)
    result = {"failure": failure, "latest": tailor.latest_step(), "held": Run(where).steps()}
    for step in (5, 6, 7):
        save(step)
    tailor.close()  # 6 and 7 in flight
    result.update(steps=Run(where).steps(),
                  lineage={step: [Run(where).manifest(step).parent, Run(where).manifest(step).save_index] for step in (5, 6, 7)})
    fresh, fresh_optimizer, fresh_scheduler = build("ddp", seed=5)
    reader = Tailor(home, fresh, fresh_optimizer, fresh_scheduler, timeout=60, tiers=tiers, read_only=True)
    for step in (2, 7):
        result[f"restored {step}"] = reader.restore(step).step
        result[f"mismatches {step}"] = compare_with_composite(out, where, fresh, fresh_optimizer, step)
    return result


def run_scenario(scenario: str, out: Path) -> dict:
    """What ``scenario`` records on this rank (written to ``DIR/result-<scenario>-<rank>.json``)."""
    if scenario == "fsdp-train":
        result = save_loop("fsdp", out, "parity", Parity(), last=8, every=2)
        result.update(resume_bitwise(out))
        result.update(restore_and_compare("fsdp", out, "parity"))
    elif scenario == "fsdp-url":
        result = save_loop("fsdp", out, "parity", Parity(), last=8, every=2)
        result.update(restore_and_compare("fsdp", out, "parity"))
    elif scenario == "fsdp-tiers":
        result = save_loop("fsdp", out, "tiered", Parity(), last=8, every=1, tier=os.environ["TIER_DIR"])
        result.update(restore_and_compare("fsdp", out, "tiered", tier=os.environ["TIER_DIR"]))
    elif scenario == "fsdp-frozen":
        result = {}
        for mode in ("sync", "async"):
            result[mode] = save_loop("fsdp", out / mode, "frozen", Parity(), last=6, every=2, freeze=True,
                                     async_save=mode == "async")
        result.update(restore_and_compare("fsdp", out / "async", "frozen", freeze=True))
    elif scenario in ("fsdp-restore", "fsdp-restore-mesh"):
        result = restore_and_compare("fsdp", out, "mesh" if scenario.endswith("-mesh") else "parity")
    elif scenario == "ddp":
        result = save_loop("ddp", out, "ddp", Parity(), last=4, every=2)
        result.update(restore_and_compare("ddp", out, "ddp"))
    elif scenario == "mesh":
        result = save_loop("tp", out, "mesh", Parity(), last=4, every=2)
        result["same"] = restore_and_compare("tp", out, "mesh")
        result["fsdp"] = restore_and_compare("fsdp", out, "mesh")
    elif scenario == "ddp-read-once":
        result = ddp_read_once(out)
    elif scenario == "fetch-as-they-come":
        result = fetch_as_they_come()
    elif scenario == "pipeline-ddp-read-once":
        result = pipeline_ddp_read_once(out)
    elif scenario == "hsdp-read-once":
        result = read_once("hsdp", out)
    elif scenario == "fsdp-read-once-save":
        result = save_loop("fsdp", out, "fsdp", Parity(), last=4, every=2)
    elif scenario == "fsdp-read-once":
        result = restore_counted("fsdp", out)
        dist.barrier()
        result["corrupted"] = corrupt_unit_file(str(location(out, "fsdp")), "layer.1") if rank() == 0 else None
        dist.barrier()
        result["refused"] = refused_restore(out, "fsdp")
        dist.barrier()
        if rank() == 0:
            corrupt_unit_file(str(location(out, "fsdp")), "layer.1")  # the same byte flipped back: intact again
        dist.barrier()
        result["refused_read"] = refused_read(out, "fsdp", failing=1)
    elif scenario == "pipeline":
        result = pipeline(out, stages=2)
    elif scenario == "pipeline-freeze":
        result = pipeline_freezing(out)
    elif scenario == "pipeline-tp":
        result = pipeline(out, stages=2, tp=2)
    elif scenario.startswith("pipeline-restore-"):
        result = restore_stages(out, stages=int(scenario.rsplit("-", 1)[1]))
    elif scenario == "fsdp-lacking":
        result = restore_lacking_a_weight(out)
    elif scenario == "fsdp-fallback":
        result = fallback_past_damage(out)
    elif scenario == "stateful":
        result = stateful_per_rank(out)
    elif scenario in ("nodes-fsdp", "nodes-ddp"):
        result = nodes_save(scenario.split("-")[1], out)
    elif scenario in ("nodes-restore-fsdp", "nodes-restore-ddp"):
        result = nodes_restore(scenario.split("-")[2], out)
    elif scenario == "nodes-single-ddp":
        result = nodes_single(out)
    elif scenario == "nodes-pipelined":
        result = nodes_pipelined(out)
    elif scenario == "nodes-refused":
        result = nodes_refused(out)
    elif scenario == "kill":
        result = kill_during_save(out)
    elif scenario == "read-kill":
        result = kill_a_reader(out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return result


def main() -> None:
    if len(sys.argv) < 3 or len(sys.argv) % 2 == 0:
        raise SystemExit(f"expected SCENARIO DIR [SCENARIO DIR ...], got {sys.argv[1:]}")
    jobs = list(zip(sys.argv[1::2], map(Path, sys.argv[2::2])))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for scenario, out in jobs:
        result = run_scenario(scenario, out)
        (out / f"result-{scenario}-{rank()}.json").write_text(json.dumps(result))
        if scenario == "read-kill" and rank() == 0:  # it hosts the store the other survivor may still be polling
            deadline = time.monotonic() + 300
            while not (out / "result-read-kill-2.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        if scenario in ("kill", "read-kill"):
            os._exit(0)  # rank 1 is dead: tearing the process group down would wait for it
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
