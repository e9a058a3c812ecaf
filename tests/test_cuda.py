"""On a CUDA device: saves copy device tensors (async: on a side stream, into pinned host
buffers, after the training stream's queued work), restores land on the device, and a resume
continues bit for bit (dropout draws from the CUDA generator included).

Skipped where no CUDA device is present (this project's CI machine); ``bench/gpu_check.sh``
runs them on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_bitwise, assert_same_snapshots, tiny, unit_versions

from llmtailor import Full, Parity, Tailor
from llmtailor.store.keys import optim_key, weight_key
from llmtailor.store.run import Run
from llmtailor.training_example import batch_at

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def deterministic():
    """Two runs of the same steps give the same bits (cuBLAS and the kernels pinned)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def on_device(seed: int = 0, dropout: float = 0.0, layers: int = 4, hidden: int = 64):
    """``tiny()`` moved to the GPU before its optimizer holds any state; ``dropout`` set on every
    attention, so training draws from the CUDA generator."""
    model, optimizer, scheduler = tiny(layers=layers, hidden=hidden, seed=seed)
    model.cuda()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = dropout
    return model, optimizer, scheduler


def train_on_device(model, optimizer, scheduler, tokens, steps) -> list[float]:
    """The steps, each batch moved to the device; the losses stay on the device until the end,
    so no step waits for the GPU (a save right after one finds queued work)."""
    losses = []
    for step in steps:
        batch = batch_at(tokens, step, 2, 32).cuda(non_blocking=True)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(x) for x in losses]



def test_async_saves_of_a_gpu_run_are_the_sync_saves_file_for_file(tmp_path, tokens):
    """The side stream's copies hold the values after the queued optimizer step, never before it
    or after the next one: an async run's files equal a sync run's of the same steps."""
    runs = {}
    for mode in ("sync", "async"):
        model, opt, sched = on_device(dropout=0.1)
        tailor = Tailor(tmp_path / mode, model, opt, sched, policy=Parity(), async_save=mode == "async")
        for step in range(1, 9):
            train_on_device(model, opt, sched, tokens, [step])
            tailor.save(step)  # right after the step: its kernels may still be queued
        if mode == "async":
            assert tailor._stager.buffers._flat.is_pinned()
        tailor.close()
        runs[mode] = Run(tmp_path / mode)
    assert runs["sync"].steps() == runs["async"].steps() == list(range(1, 9))
    assert_same_snapshots(runs["sync"], runs["async"], range(1, 9))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("current", [1, 0])
def test_async_saves_of_a_run_on_the_second_gpu_are_the_sync_saves_file_for_file(tmp_path, tokens, current):
    """A rank on cuda:1 (its current device set to it, as DDP's ranks do, or left at 0): the
    save's thread starts on device 0 whatever the training thread's, and a copy runs on its source
    device's current stream: the copies must be waited for on cuda:1, where they run (a side
    stream of device 0 alone let the pinned buffers be read while the copies ran). Found by
    reading; never run here (one GPU at most)."""
    runs = {}
    try:
        torch.cuda.set_device(current)
        for mode in ("sync", "async"):
            model, opt, sched = tiny(layers=4, hidden=512, seed=0)
            model.to("cuda:1")
            tailor = Tailor(tmp_path / mode, model, opt, sched, policy=Full(), async_save=mode == "async")
            for step in range(1, 5):
                batch = batch_at(tokens, step, 2, 32).to("cuda:1")
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                tailor.save(step)  # right after the step: its kernels still queued on cuda:1
            tailor.close()
            runs[mode] = Run(tmp_path / mode)
    finally:
        torch.cuda.set_device(0)
    assert_same_snapshots(runs["sync"], runs["async"], range(1, 5))


def test_a_restore_puts_every_tensor_back_on_the_gpu_and_training_resumes_bit_for_bit(tmp_path, tokens):
    model, opt, sched = on_device(dropout=0.1)
    with Tailor(tmp_path / "run", model, opt, sched, policy=Full(), async_save=True) as tailor:
        train_on_device(model, opt, sched, tokens, range(1, 7))
        tailor.save(6)
        tailor.wait()
        saved = unit_versions(model, opt)
    uninterrupted = train_on_device(model, opt, sched, tokens, [7, 8])
    expected = unit_versions(model, opt)

    fresh, fresh_opt, fresh_sched = on_device(seed=5, dropout=0.1)
    torch.cuda.manual_seed_all(1234)  # the restore must put the generator back, not this
    with Tailor(tmp_path / "run", fresh, fresh_opt, fresh_sched, policy=Full()) as tailor:
        assert tailor.restore().step == 6
    restored = unit_versions(fresh, fresh_opt)
    assert {t.device.type for entry in restored.values() for t in entry.values() if isinstance(t, torch.Tensor)
            and t.dim() > 0} == {"cuda"}
    assert_bitwise(restored, saved, "restored: ")
    assert train_on_device(fresh, fresh_opt, fresh_sched, tokens, [7, 8]) == uninterrupted
    assert_bitwise(unit_versions(fresh, fresh_opt), expected, "resumed: ")


def keyed(model, optimizer) -> dict[str, torch.Tensor]:
    """Every trainable weight and its optimizer state, on the host, by the run's tensor keys
    (peft's wrapper prefix dropped, as the run names them)."""
    out = {}
    for name, param in model.get_base_model().named_parameters():
        if param.requires_grad:
            out[weight_key(name)] = param.detach().cpu().clone()
            for key, value in optimizer.state.get(param, {}).items():
                out[optim_key(name, key)] = value.detach().cpu().clone()
    return out


def test_lora_with_frozen_base_and_modules_to_save_async_parity_restores_on_the_gpu(tmp_path, tokens):
    """Partly frozen units (LoRA's base weights) and peft's ``modules_to_save`` copies, saved
    async from the GPU with Parity: each unit's stored version is the live one at its step, and
    a fresh peft model restores each unit at its composite version."""
    peft = pytest.importorskip("peft")

    def lora(seed):
        model, _, _ = on_device(seed=seed)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
        model = peft.get_peft_model(model, config)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    model, opt, sched = lora(0)
    at_step = {}
    with Tailor(tmp_path / "lora", model, opt, sched, policy=Parity(), async_save=True) as tailor:
        for step in range(1, 6):
            train_on_device(model, opt, sched, tokens, [step])
            tailor.save(step)
            tailor.fence()  # the copies are taken: the live values are this step's until the next step
            at_step[step] = keyed(model, opt)
    fresh, fresh_opt, fresh_sched = lora(0)  # the same base: a LoRA resumes onto its own base model
    with Tailor(tmp_path / "lora", fresh, fresh_opt, fresh_sched, policy=Parity()) as tailor:
        report = tailor.restore()
    assert report.step == 5 and {4, 5} <= set(report.sources.values())  # odd and even layers: two steps
    live, run, checked = keyed(fresh, fresh_opt), Run(tmp_path / "lora"), set()
    for unit, source in report.sources.items():
        tensors, _ = run.read_unit(source, unit)
        for key, tensor in tensors.items():
            if key in live:
                assert torch.equal(tensor, at_step[source][key]), f"{key}: stored at step {source}"
                assert torch.equal(live[key], tensor), f"{key}: restored from step {source}"
                checked.add(key)
    assert checked == live.keys()
    assert any("lora_A" in k for k in checked) and any("modules_to_save" in k for k in checked)


def test_fsdp2_on_nccl_saves_async_and_restores_every_shard_bit_for_bit(tmp_path, tokens):
    """FSDP2 on the GPU (one rank, NCCL): the shards are DTensors on the device; an async Parity
    save and a restore into a fresh sharded model give back each composite version."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        def sharded(seed):
            model, _, _ = on_device(seed=seed)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

        def full_versions(model, optimizer):
            out = {}
            for name, p in model.named_parameters():
                out[name] = {"weight": p.full_tensor().clone()}
                for key, value in optimizer.state.get(p, {}).items():
                    out[name][key] = value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
            return out

        model, opt, sched = sharded(0)
        with Tailor(tmp_path / "fsdp", model, opt, sched, policy=Full(), async_save=True) as tailor:
            train_on_device(model, opt, sched, tokens, range(1, 4))
            tailor.save(3)
            tailor.fence()
            expected = full_versions(model, opt)
            train_on_device(model, opt, sched, tokens, [4])  # after the copies: not in the snapshot
        fresh, fresh_opt, fresh_sched = sharded(7)
        with Tailor(tmp_path / "fsdp", fresh, fresh_opt, fresh_sched, policy=Full()) as tailor:
            assert tailor.restore().step == 3
        assert_bitwise(full_versions(fresh, fresh_opt), expected)
    finally:
        dist.destroy_process_group()


def test_tailor_trainer_under_trainers_fsdp2_resumes_bit_for_bit(tmp_path):
    """TailorTrainer with ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`` (Trainer
    applies FSDP on a GPU only): a run stopped right after its step-2 save and resumed on a model
    of another seed logs the uninterrupted run's losses for steps 3-4 and ends with its weights
    and optimizer state, bit for bit (``tests/integrations/hf_fsdp_job.py``)."""
    import json
    import subprocess
    from pathlib import Path

    from helpers import standalone_launch

    job = Path(__file__).parent / "integrations" / "hf_fsdp_job.py"
    result = tmp_path / "result.json"
    root = str(Path(__file__).resolve().parents[1])  # llmtailor for the job where it is not installed
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([*standalone_launch(1), str(job), "--out", str(tmp_path), "--result", str(result)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(result.read_text())
    straight, crashed, resumed = runs["straight"], runs["crashed"], runs["resumed"]
    assert straight["fsdp2"] and resumed["fsdp2"], "Trainer did not shard the model with FSDP2"
    assert crashed["global_step"] == 2 and straight["global_step"] == resumed["global_step"] == 4
    assert {s: resumed["losses"][s] for s in ("3", "4")} == {s: straight["losses"][s] for s in ("3", "4")}
    assert resumed["state"] == straight["state"]
