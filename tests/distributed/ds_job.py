"""DeepSpeed jobs for the tests: ZeRO-1/2/3 engines on gloo, CPU, real processes.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node N ds_job.py SCENARIO DIR [STAGE [SHAPE]]
    DS_ACCELERATOR=cpu python -m torch.distributed.run ... ds_job.py SCENARIO DIR STAGE SHAPE [SCENARIO DIR STAGE SHAPE ...]

One launch runs several jobs in turn (each a fresh engine, as within ``save``), so tests that need
the same processes share a launch: SCENARIO may name several scenarios joined by ``+`` (run in
that order on the same DIR, STAGE and SHAPE), and further ``SCENARIO DIR STAGE SHAPE`` groups
follow the first.

SHAPE ``plain`` (default) is a tiny Llama of even sizes; ``odd`` has sizes that make ZeRO
partitions end mid-row (hidden 33, 3 heads of 8, vocab 129, MLP 65, attention biases) and, under
ZeRO-3, a ``sub_group_size`` that splits every param group into several sub-groups.

Scenarios (each rank writes ``DIR/result-<scenario>-<rank>.json``):

``save``  ZeRO-STAGE. A tiny Llama with a client ``torch.optim.AdamW`` in HF Trainer's decay /
    no-decay groups trains steps 1..6, a Parity ``Tailor(DIR/parity, engine)`` saving every 2
    steps; at every save, rank 0 writes every master and optimizer state, whole (DeepSpeed's own
    accessors), to ``DIR/versions/<step>``. Then a Full run: saved at 4, continued to 8, and a
    fresh engine from another seed restored from it and trained 5..8: losses compared bitwise
    (and the engines' global_steps).
    Then ``DIR/parity`` is restored into a fresh engine and compared.
``restore``  ZeRO-STAGE at this world size: restore ``DIR/parity`` and compare.
``bf16``  ZeRO-STAGE with bf16 weights and fp32 masters: Parity saves into ``DIR/bf16``, a
    restore into a fresh engine; masters compared with the versions, and the bf16 weights with
    the masters cast.
``checkpoint``  ZeRO-STAGE with DeepSpeed's curriculum sampler (3 batches drawn, its state in
    the result): 3 steps, then DeepSpeed's own ``engine.save_checkpoint(DIR/ds)``
    (with the model's ``config.json`` beside it, as HF Trainer writes one) and the versions;
    then steps 4..6 go on (their losses, and the versions after them in ``DIR/ds/versions-6``).
``resume_imported``  ZeRO-STAGE with the curriculum sampler: restore ``DIR/run`` (``DIR/ds`` imported with import-deepspeed)
    into a fresh engine, train 4..6: losses, and every master and state compared with
    ``DIR/ds/versions-6``; the sampler's state after the restore; then 2 more batches drawn, a
    Full ``Tailor(DIR/again)`` save at 6 restored into a fresh engine: the sampler's states.
``universal``  ZeRO-STAGE with the curriculum sampler: ``engine.load_checkpoint(DIR/universal)`` with DeepSpeed's
    ``load_universal``; every master and state compared with ``DIR/ds/versions``; the sampler's state.
``frozen``  ZeRO-STAGE, partly frozen: 2 steps, then DeepSpeed's own
    ``engine.save_checkpoint(DIR/frozen)`` with config.json, and every weight in
    ``DIR/frozen/weights.safetensors``.
``ltd``  ZeRO-STAGE with random-LTD on (layers wrapped by ``convert_to_random_ltd``, its scheduler
    keeping all 32 tokens, so the layers compute what they would without it): 3 steps, a Full
    ``Tailor(DIR/ltd)`` save and DeepSpeed's own ``engine.save_checkpoint(DIR/ltd-ds)`` (with
    config.json), imported by rank 0 into ``DIR/ltd-imported``; steps 4..5 go on. Then fresh engines
    restore: ``DIR/ltd`` without random-LTD and with it, ``DIR/ltd-imported`` with it, each trained
    4..5: each restore's error, losses and random-LTD state after the restore.
``omitted``  ZeRO-STAGE, an optimizer whose groups leave out the embedding, which still requires
    grad (``engine(omitted=True)``: DeepSpeed trains the rest and never changes it): 3 steps, a Full
    ``Tailor(DIR/omitted)`` save, steps 4..5 go on; a fresh engine of another seed restores and
    trains 4..5: the error if any, the weights that differ after the restore, the losses.
``held``  ZeRO-STAGE, the embedding frozen and held by the optimizer all the same
    (``AdamW(model.parameters())``; DeepSpeed leaves it out of its groups): a plain model of the
    same optimizer trained 1..3 (the same batches on every rank) and saved Full by a Tailor
    (``DIR/held-plain``), restored into an engine; an engine trained 1..3, saved
    (``DIR/held-engine``), restored into a plain model: each restore's error and the weights
    that differ from the saved ones.
``restore_fail``  ZeRO-STAGE: restore ``DIR/parity``, one of whose files only rank 1 reads is
    damaged: every rank must raise within the timeout (none blocked in a collective), and a
    save afterwards must be refused.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# The shared-memory collective DeepSpeed compiles at start-up (~90 s) serves inference only.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

from llmtailor import Full, Parity, Tailor  # noqa: E402
from llmtailor.layouts import build_layout  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402
from llmtailor.training_example import batch_at, corpus_tokens, hf_param_groups  # noqa: E402

TOKENS = corpus_tokens()
SHAPE = "plain"
PRELOAD = ("transformers.models.llama.modeling_llama", "deepspeed.runtime.zero.muon.muon_optimizer",
           "deepspeed.module_inject.auto_ep_layer", "llmtailor.providers.deepspeed.zero12",
           "llmtailor.providers.deepspeed.zero3", "llmtailor.store.reader", "boto3")
"""What the fork server of test_deepspeed.py (forked_nodes.py, which imports this module first)
imports once before it forks the ranks: what each rank imported on first use otherwise (the
model's code, what ``deepspeed.initialize`` and the restore import: 1864 modules, about 5.5 of a
ZeRO-2 ``save`` rank's 7.5 s of CPU on the project's VM; 3 modules after)."""
SUB_GROUP_SIZE = 500  # elements: under ZeRO-3 with the odd shape, one or two parameters per sub-group


def rank() -> int:
    return torch.distributed.get_rank()


def model_config():
    if SHAPE == "odd":
        return transformers.LlamaConfig(vocab_size=129, hidden_size=33, intermediate_size=65, num_hidden_layers=4,
                                        num_attention_heads=3, num_key_value_heads=3, head_dim=8, attention_bias=True,
                                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                                    eos_token_id=None, pad_token_id=None)


def zero_config(stage: int) -> dict:
    if SHAPE == "odd" and stage == 3:
        return {"stage": 3, "sub_group_size": SUB_GROUP_SIZE}
    return {"stage": stage}


FROZEN = ("model.embed_tokens.", "model.layers.0.mlp.")
"""The parameters a partly frozen fine-tuning keeps frozen (``engine(frozen=True)``)."""


def engine(stage: int, seed: int, bf16: bool = False, curriculum: Path | None = None, frozen: bool = False,
           ltd: bool = False, omitted: bool = False):
    """A ZeRO-``stage`` engine of the tiny Llama; with ``curriculum`` (a directory for its
    clusters), DeepSpeed's data-efficiency curriculum sampler over ``Samples`` too
    (``engine.training_dataloader``: ``draw`` takes its batches); ``frozen``: the ``FROZEN``
    parameters do not train; ``ltd``: random-LTD on (``LTD``), its decoder layers wrapped;
    ``omitted``: the optimizer's groups leave out the embedding (it requires grad all the same)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config())
    for name, param in model.named_parameters():
        param.requires_grad_(not (frozen and name.startswith(FROZEN)))
    groups = hf_param_groups(model)
    if omitted:
        embedding = model.get_input_embeddings().weight
        groups = [{**group, "params": [p for p in group["params"] if p is not embedding]} for group in groups]
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": zero_config(stage), "bf16": {"enabled": bf16}, "steps_per_print": 10**9}
    if curriculum is not None:
        config["data_efficiency"] = curriculum_config(curriculum)
    if ltd:
        config["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": LTD}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
                                      training_data=Samples() if curriculum is not None else None)
    if ltd:
        from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

        convert_to_random_ltd(engine, transformers.models.llama.modeling_llama.LlamaDecoderLayer)
    return engine


LTD = {"enabled": True, "model_mask_name": "attention_mask", "model_type": "decoder",
       "hidden_state_order": "batch_seq_dim", "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
       "layer_token_lr_schedule": {"enabled": False},
       "random_ltd_schedule": {"min_value": 32, "max_value": 32, "schedule_type": "fixed_linear",
                               "schedule_config": {"require_steps": 4, "seq_per_step": 8}}}
"""DeepSpeed's random-LTD over layers 1 and 2, keeping all of ``train``'s 32 tokens (a Llama layer
given fewer tokens than its rotary embeddings fails): its scheduler's state moves on each step."""


class Samples(torch.utils.data.Dataset):
    """What the curriculum sampler draws from: 64 token rows of the corpus."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return batch_at(TOKENS, index, 1, 16)[0] % model_config().vocab_size


def curriculum_config(clusters: Path) -> dict:
    """DeepSpeed's data-efficiency curriculum (one cluster per difficulty: no analysed index files
    needed), its difficulty rising each step."""
    metric = {"index_to_sample_path": "", "index_to_metric_path": "", "difficulty_type": "value",
              "clustering_type": "single_cluster", "min_difficulty": 2, "max_difficulty": 16,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}}
    return {"enabled": True, "seed": 1234, "data_sampling": {"enabled": True, "num_workers": 0, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(clusters), "curriculum_metrics": {"seqlen": metric}}}}


def draw(engine, count: int) -> None:
    """``count`` batches from the engine's curriculum loader (the sampler's position moves on)."""
    batches = iter(engine.training_dataloader)
    for _ in range(count):
        next(batches)


def sampler_state(engine) -> dict:
    """The curriculum sampler's state as DeepSpeed saves it (``state_dict``), its numpy RNG state
    as a digest: what a restore must give back."""
    import hashlib

    state = engine.training_dataloader.data_sampler.state_dict()
    kind, keys, pos, *rest = state.pop("np_rng_state")
    return {**json.loads(json.dumps(state, default=int)),
            "np_rng_state": [kind, hashlib.sha256(keys.tobytes()).hexdigest(), int(pos), *rest]}


def train(engine, steps) -> list[str]:
    losses = []
    for step in steps:
        batch = batch_at(TOKENS, step * 100 + rank(), 2, 32) % model_config().vocab_size
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item().hex())
    return losses


def versions(engine) -> dict[str, torch.Tensor]:
    """Every master and optimizer state tensor, whole, through DeepSpeed's accessors (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = engine.optimizer
    if hasattr(zero, "_hp_optimizer_states_linked"):  # (re)link its per-parameter state views
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, param in engine.module.named_parameters():
        out[f"master/{name}"] = safe_get_full_fp32_param(param).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"optim/{name}/{key}"] = safe_get_full_optimizer_state(param, key).detach().clone()
    return out


def write_versions(out: Path, step: int, engine) -> None:
    values = versions(engine)
    if rank() == 0:
        (out / "versions").mkdir(parents=True, exist_ok=True)
        save_file(values, str(out / "versions" / f"{step}.safetensors"))


def compare_with_composite(out: Path, run_dir: Path, values: dict[str, torch.Tensor], module) -> list[str]:
    composite = Run(run_dir).resolve()
    layout = build_layout(module)
    saved = {s: load_file(str(out / "versions" / f"{s}.safetensors")) for s in set(composite.sources.values())}
    return [key for key, value in values.items()
            if not torch.equal(value, saved[composite.sources[layout.unit_of(key.split("/")[1])]][key])]


def save_scenario(out: Path, stage: int) -> dict:
    e = engine(stage, seed=0)
    tailor = Tailor(out / "parity", e, policy=Parity(), timeout=60)
    saves = []
    for step in range(1, 7):
        train(e, [step])
        if step % 2 == 0:
            report = tailor.save(step, extra={"rank": rank()})
            write_versions(out, step, e)
            saves.append({"step": step, "bytes": report.bytes, "rank_bytes": report.rank_bytes})
    tailor.close()
    result = {"saves": saves}

    full = engine(stage, seed=0)
    with Tailor(out / "full", full, policy=Full(), timeout=60) as tailor:
        train(full, range(1, 5))
        tailor.save(4)
        result["uninterrupted"] = train(full, range(5, 9))
    fresh = engine(stage, seed=7)
    Tailor(out / "full", fresh, timeout=60).restore()
    result["resumed"] = train(fresh, range(5, 9))
    result["global_steps"] = {"uninterrupted": full.global_steps, "resumed": fresh.global_steps}
    result.update(restore_scenario(out, stage))
    return result


def restore_scenario(out: Path, stage: int) -> dict:
    e = engine(stage, seed=5)
    report = Tailor(out / "parity", e, timeout=60).restore()
    return {"restored": report.step, "extra": report.extra,
            "mismatches": compare_with_composite(out, out / "parity", versions(e), e.module)}


def restore_fail_scenario(out: Path, stage: int) -> dict:
    import time

    e = engine(stage, seed=5)
    tailor = Tailor(out / "parity", e, timeout=60)  # a slow rank on a busy machine is not a dead one
    start = time.monotonic()
    try:
        tailor.restore()
        error = None
    except Exception as err:  # noqa: BLE001 - the test looks at what each rank raised
        error = f"{type(err).__name__}: {err}"
    elapsed = time.monotonic() - start
    try:
        tailor.save(100)
        refused = None
    except Exception as err:  # noqa: BLE001
        refused = f"{type(err).__name__}: {err}"
    tailor.close()
    return {"error": error, "elapsed": elapsed, "save_refused": refused}


def bf16_scenario(out: Path, stage: int) -> dict:
    e = engine(stage, seed=0, bf16=True)
    with Tailor(out / "bf16", e, policy=Parity(), timeout=60) as tailor:
        for step in range(1, 5):
            train(e, [step])
            if step % 2 == 0:
                tailor.save(step)
                write_versions(out / "bf16-versions", step, e)
    fresh = engine(stage, seed=5, bf16=True)
    Tailor(out / "bf16", fresh, timeout=60).restore()
    values = versions(fresh)
    mismatches = compare_with_composite(out / "bf16-versions", out / "bf16", values, fresh.module)
    lp_dtypes, lp_mismatches = set(), []
    for name, param in fresh.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
            lp = param.detach().clone()
        lp_dtypes.add(str(lp.dtype))
        if not torch.equal(lp, values[f"master/{name}"].to(lp.dtype)):
            lp_mismatches.append(name)
    return {"mismatches": mismatches, "lp_dtypes": sorted(lp_dtypes), "lp_mismatches": lp_mismatches}


def checkpoint_scenario(out: Path, stage: int) -> dict:
    e = engine(stage, seed=0, curriculum=out / "ds" / "clusters")
    train(e, [1, 2, 3])
    draw(e, 3)
    sampler = sampler_state(e)
    # What DeepSpeed users keep beside the engine's state (Megatron-DeepSpeed: its args, a Namespace).
    e.save_checkpoint(str(out / "ds"), client_state={"epoch": 1, "samples": 6, "args": argparse.Namespace(lr=3e-3)})
    values = versions(e)
    if rank() == 0:
        model_config().to_json_file(str(out / "ds" / "config.json"))
        save_file(values, str(out / "ds" / "versions.safetensors"))
    global_steps = e.global_steps
    continued = train(e, [4, 5, 6])
    values = versions(e)
    if rank() == 0:
        save_file(values, str(out / "ds" / "versions-6.safetensors"))
    return {"global_steps": global_steps, "continued": continued, "sampler": sampler}


def frozen_scenario(out: Path, stage: int) -> dict:
    """Partly frozen: 2 steps, DeepSpeed's own ``save_checkpoint(DIR/frozen)`` (its frozen
    parameters in ``frozen_param_fragments``) with config.json, and the model's every weight then,
    gathered, in ``DIR/frozen/weights.safetensors``."""
    e = engine(stage, seed=0, frozen=True)
    train(e, [1, 2])
    e.save_checkpoint(str(out / "frozen"))
    with deepspeed.zero.GatheredParameters(list(e.module.parameters()), enabled=stage == 3):
        weights = {name: param.detach().clone() for name, param in e.module.named_parameters()}
    if rank() == 0:
        model_config().to_json_file(str(out / "frozen" / "config.json"))
        save_file(weights, str(out / "frozen" / "weights.safetensors"))
    return {"frozen": sorted(name for name, param in e.module.named_parameters() if not param.requires_grad)}


def ltd_scenario(out: Path, stage: int) -> dict:
    from llmtailor.interop.deepspeed.importer import import_deepspeed

    e = engine(stage, seed=0, ltd=True)
    train(e, [1, 2, 3])
    with Tailor(out / "ltd", e, policy=Full(), timeout=60) as tailor:
        tailor.save(3)
    e.save_checkpoint(str(out / "ltd-ds"))
    saved = e.random_ltd_scheduler.state_dict()
    continued = train(e, [4, 5])
    if rank() == 0:
        model_config().to_json_file(str(out / "ltd-ds" / "config.json"))
        import_deepspeed(out / "ltd-ds", out / "ltd-imported")
    torch.distributed.barrier()
    restores = {}
    for run, ltd in (("ltd", False), ("ltd", True), ("ltd-imported", True)):
        fresh = engine(stage, seed=5, ltd=ltd)
        try:
            Tailor(out / run, fresh, timeout=60).restore()
        except Exception as err:  # noqa: BLE001 - the test looks at what each rank raised
            restores[f"{run} ltd={ltd}"] = {"error": f"{type(err).__name__}: {err}"[:600]}
            continue
        ltd_state = fresh.random_ltd_scheduler.state_dict() if ltd else None
        restores[f"{run} ltd={ltd}"] = {"error": None, "ltd": ltd_state, "losses": train(fresh, [4, 5])}
    return {"saved_ltd": saved, "continued": continued, "restores": restores}


def gathered(e, stage: int) -> dict[str, torch.Tensor]:
    """Every weight of the engine's model, whole (gathered under ZeRO-3)."""
    with deepspeed.zero.GatheredParameters(list(e.module.parameters()), enabled=stage == 3):
        return {name: param.detach().clone() for name, param in e.module.named_parameters()}


def omitted_scenario(out: Path, stage: int) -> dict:
    e = engine(stage, seed=0, omitted=True)
    train(e, [1, 2, 3])
    saved = gathered(e, stage)
    try:
        with Tailor(out / "omitted", e, policy=Full(), timeout=60) as tailor:
            tailor.save(3)
        continued = train(e, [4, 5])
        fresh = engine(stage, seed=5, omitted=True)
        Tailor(out / "omitted", fresh, timeout=60).restore()
    except Exception as err:  # noqa: BLE001 - the test looks at what each rank raised
        return {"error": f"{type(err).__name__}: {err}"[:600]}
    restored = gathered(fresh, stage)
    return {"error": None, "mismatches": [name for name in saved if not torch.equal(saved[name], restored[name])],
            "continued": continued, "resumed": train(fresh, [4, 5])}


def held_model(seed: int):
    """The tiny Llama with its embedding frozen, and ``AdamW(model.parameters())``, which holds it."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config())
    model.get_input_embeddings().weight.requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def held_engine(stage: int, seed: int):
    model, optimizer = held_model(seed)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": zero_config(stage), "steps_per_print": 10**9}
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def held_scenario(out: Path, stage: int) -> dict:
    def restored(run: Path, live, optimizer, saved: dict[str, torch.Tensor]) -> dict:
        try:
            Tailor(run, live, optimizer, timeout=60).restore()
        except Exception as err:  # noqa: BLE001 - the test looks at what each rank raised
            return {"error": f"{type(err).__name__}: {err}"[:600]}
        now = gathered(live, stage) if optimizer is None else {n: p.detach() for n, p in live.named_parameters()}
        return {"error": None, "mismatches": [name for name in saved if not torch.equal(saved[name], now[name])]}

    plain, optimizer = held_model(0)
    for step in (1, 2, 3):  # the same batches on every rank: the ranks' plain models stay alike, as DDP's
        batch = batch_at(TOKENS, step, 2, 32) % model_config().vocab_size
        plain(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    Tailor(out / "held-plain", plain, optimizer, policy=Full(), timeout=60).save(3)
    into_engine = restored(out / "held-plain", held_engine(stage, seed=5), None,
                           {n: p.detach() for n, p in plain.named_parameters()})
    e = held_engine(stage, seed=0)
    train(e, [1, 2, 3])
    Tailor(out / "held-engine", e, policy=Full(), timeout=60).save(3)
    into_plain = restored(out / "held-engine", *held_model(5), gathered(e, stage))
    return {"into_engine": into_engine, "into_plain": into_plain}


def resume_imported_scenario(out: Path, stage: int) -> dict:
    e = engine(stage, seed=5, curriculum=out / "ds" / "clusters")
    report = Tailor(out / "run", e, timeout=60).restore()
    sampler = sampler_state(e)
    losses = train(e, [4, 5, 6])
    reference = load_file(str(out / "ds" / "versions-6.safetensors"))
    values = versions(e)
    draw(e, 2)
    with Tailor(out / "again", e, policy=Full(), timeout=60) as tailor:  # the sampler, saved by a Tailor
        tailor.save(6)
    again = engine(stage, seed=5, curriculum=out / "ds" / "clusters")
    Tailor(out / "again", again, timeout=60).restore()
    return {"restored": report.step, "losses": losses, "global_steps": e.global_steps, "extra": report.extra,
            "sampler": sampler, "saved_sampler": sampler_state(e), "restored_sampler": sampler_state(again),
            "mismatches": [k for k in reference if not torch.equal(reference[k], values[k])]}


def universal_scenario(out: Path, stage: int) -> dict:
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(model_config())
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=3e-3)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "checkpoint": {"load_universal": True}}
    config["data_efficiency"] = curriculum_config(out / "ds" / "clusters")
    e, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, training_data=Samples())
    path, client_state = e.load_checkpoint(str(out / "universal"))
    values = versions(e)
    reference = load_file(str(out / "ds" / "versions.safetensors"))
    return {"loaded": path is not None, "global_steps": e.global_steps,
            "client_state": {k: client_state.get(k) for k in ("epoch", "samples")}, "sampler": sampler_state(e),
            "mismatches": [k for k in reference if not torch.equal(reference[k], values[k])]}


SCENARIOS = {"save": save_scenario, "restore": restore_scenario, "bf16": bf16_scenario,
             "restore_fail": restore_fail_scenario, "checkpoint": checkpoint_scenario,
             "universal": universal_scenario, "resume_imported": resume_imported_scenario, "frozen": frozen_scenario, "ltd": ltd_scenario,
             "omitted": omitted_scenario, "held": held_scenario}


def jobs(argv: list[str]) -> list[tuple[str, Path, int, str]]:
    """``(scenario, dir, stage, shape)`` in launch order, from ``SCENARIO DIR [STAGE [SHAPE]]``
    or groups of four."""
    if len(argv) <= 4:
        argv = argv + ["3", "plain"][len(argv) - 2:]
    groups = [argv[i:i + 4] for i in range(0, len(argv), 4)]
    return [(name, Path(out), int(stage), shape) for scenario, out, stage, shape in groups for name in scenario.split("+")]


def main() -> None:
    global SHAPE
    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    for scenario, out, stage, SHAPE in jobs(sys.argv[1:]):
        result = SCENARIOS[scenario](out, stage)
        (out / f"result-{scenario}-{rank()}.json").write_text(json.dumps(result))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # without it gloo can abort at exit (pytorch#190489)


if __name__ == "__main__":
    main()
