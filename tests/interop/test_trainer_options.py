"""Trainer checkpoints written with the options users set (``gradient_accumulation_steps``,
``bf16``, ``optim="adafactor"``, ``save_only_model``), by the real, plain Trainer: ``import-hf``
reads them, and a ``TailorTrainer`` resumed from the imported run trains on as the vanilla
Trainer resumed from the same ``checkpoint-N/`` does, bit for bit (losses, LRs, batches, the
RNG state each step begins with, final weights). Each Trainer runs in this process, one at a
time (Trainer's own resume sets the process's RNGs from the checkpoint)."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
import transformers
from helpers import assert_same_tree
from integrations.hf_job import Recorder, Windows, model_config, recording
from typer.testing import CliRunner

from llmtailor.cli import app
from llmtailor.cli.import_deepspeed import register as register_deepspeed
from llmtailor.cli.import_hf import register
from llmtailor.errors import IntegrityError
from llmtailor.interop.hf.export import export_hf
from llmtailor.interop.hf.importer import import_hf
from llmtailor.store.run import Run

register(app)
register_deepspeed(app)
runner = CliRunner()
SAVED, LAST = 2, 4
OPTIONS = {  # what users set on TrainingArguments
    "gradient accumulation, bf16 autocast": {"gradient_accumulation_steps": 2, "bf16": True},
    "adafactor": {"optim": "adafactor"},
    "schedule free": {"optim": "schedule_free_adamw", "lr_scheduler_type": "constant"},
    "bf16 weights": {"model_dtype": torch.bfloat16},  # the model loaded in bf16: weights and moments bf16
}


def trainer_run(out, options: dict, *, resume=None, tailor: bool = False, adapters=None) -> dict:
    """A Trainer run of ``LAST`` steps saving every ``SAVED``: what it logged, the batch and the RNG
    state of each step, the LR after each step and a digest of its final weights. ``adapters``: a
    peft config, the model a PeftModel of it (its adapters made with the same seed every time,
    its base too: a peft checkpoint holds the adapters only)."""
    torch.manual_seed(0 if adapters or not resume else 99)  # a resumed run must get every weight from the checkpoint
    options = dict(options)
    model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    model = model.to(options.pop("model_dtype", torch.float32))
    if adapters is not None:
        import peft

        model = peft.get_peft_model(model, adapters)
        torch.manual_seed(99 if resume else 0)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=LAST, save_steps=SAVED, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, learning_rate=3e-3, weight_decay=0.01, warmup_steps=1, disable_tqdm=True,
        **options,
    )
    recorder = Recorder(argparse.Namespace(dump=None, crash_at=None))
    common = dict(model=model, args=args, train_dataset=Windows(), callbacks=[recorder])
    if tailor:
        from llmtailor.integrations.hf import TailorTrainer

        trainer = recording(TailorTrainer)(**common)
    else:
        trainer = recording(transformers.Trainer)(**common)
    trainer.train(resume_from_checkpoint=resume if resume in (None, True) else str(resume))
    return {"losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
            "lrs": recorder.lrs, "batches": dict(trainer.batches), "rngs": dict(trainer.rngs),
            "params": weights_digest(model), "step": trainer.state.global_step}


def weights_digest(model) -> str:
    """Every parameter's name and bytes, whatever its dtype."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode() + param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("options", list(OPTIONS))
def test_an_imported_checkpoint_resumes_in_tailor_trainer_as_in_vanilla_trainer(tmp_path, options):
    """The peer is Trainer's own resume from the same ``checkpoint-N/``: the imported run resumed
    by TailorTrainer logs what it logs, bit for bit, and so does the uninterrupted run."""
    kwargs = OPTIONS[options]
    whole = trainer_run(tmp_path / "vanilla", kwargs)
    checkpoint = tmp_path / "vanilla" / f"checkpoint-{SAVED}"
    vanilla = trainer_run(tmp_path / "vanilla-resumed", kwargs, resume=checkpoint)
    import_hf(checkpoint, tmp_path / "run")
    # The round trip first: exported back, the optimizer state is Trainer's own, bit for bit.
    exported = export_hf(Run(tmp_path / "run"), None, tmp_path / "exported")
    assert_same_tree(torch.load(exported / "optimizer.pt", weights_only=True),
                     torch.load(checkpoint / "optimizer.pt", weights_only=True), "optimizer.pt")
    tailored = trainer_run(tmp_path / "tailored", kwargs, resume=tmp_path / "run", tailor=True)
    resumed = [str(s) for s in range(SAVED + 1, LAST + 1)]
    for key in ("batches", "rngs"):
        assert {s: tailored[key][int(s)] for s in resumed} == {s: vanilla[key][int(s)] for s in resumed}, key
    assert tailored["losses"] == vanilla["losses"] == whole["losses"]
    assert [tailored["lrs"][s] for s in range(SAVED + 1, LAST + 1)] == [vanilla["lrs"][s] for s in range(SAVED + 1, LAST + 1)]
    assert tailored["params"] == vanilla["params"] == whole["params"]
    assert tailored["step"] == vanilla["step"] == LAST
    assert Run(tmp_path / "tailored" / "tailored").steps() == [LAST]


@pytest.mark.slow
def test_a_vanilla_run_switched_to_tailor_trainer_resumes_its_last_checkpoint_as_vanilla_trainer_does(tmp_path):
    """A job killed after its vanilla Trainer saved ``checkpoint-N/``, restarted with TailorTrainer
    on the same ``output_dir`` and ``train(resume_from_checkpoint=True)`` (no tailored snapshot
    yet): Trainer's own resume from its last checkpoint, as the vanilla restart's, bit for bit; the
    saves from there are tailored ones."""
    whole = trainer_run(tmp_path / "vanilla", {})
    for restart in ("vanilla-restart", "tailor-restart"):
        shutil.copytree(tmp_path / "vanilla", tmp_path / restart)
        shutil.rmtree(tmp_path / restart / f"checkpoint-{LAST}")  # killed before its next save
    vanilla = trainer_run(tmp_path / "vanilla-restart", {}, resume=True)
    tailored = trainer_run(tmp_path / "tailor-restart", {}, resume=True, tailor=True)
    for key in ("batches", "rngs", "lrs"):
        assert {s: tailored[key][s] for s in range(SAVED + 1, LAST + 1)} == \
            {s: vanilla[key][s] for s in range(SAVED + 1, LAST + 1)}, key
    assert tailored["losses"] == vanilla["losses"] == whole["losses"]
    assert tailored["params"] == vanilla["params"] == whole["params"]
    assert Run(tmp_path / "tailor-restart" / "tailored").steps() == [LAST]
    assert not (tmp_path / "tailor-restart" / f"checkpoint-{LAST}").exists()


@pytest.mark.parametrize("optim", ["sgd", "adagrad", "rmsprop", "adamw_torch_fused"])
def test_the_trainers_other_optimizers_import_and_export_back_bit_for_bit(tmp_path, optim):
    """``optim`` as users set it: the checkpoint imports, and its optimizer.pt, scheduler.pt and RNG
    exported back are Trainer's own, bit for bit."""
    from transformers.trainer_pt_utils import safe_globals

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                          save_steps=2, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                          optim=optim, **({"optim_args": "momentum=0.9"} if optim == "sgd" else {}))
    transformers.Trainer(model=model, args=args, train_dataset=Windows()).train()
    checkpoint = tmp_path / f"checkpoint-{SAVED}"
    import_hf(checkpoint, tmp_path / "run")
    exported = export_hf(Run(tmp_path / "run"), None, tmp_path / "exported")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        with safe_globals():
            assert_same_tree(torch.load(exported / name, weights_only=True), torch.load(checkpoint / name, weights_only=True), name)


@pytest.mark.slow
def test_a_peft_trainer_checkpoint_with_modules_to_save_resumes_in_tailor_trainer_as_in_vanilla_trainer(tmp_path):
    """The way in import-hf names for a Trainer checkpoint of a peft model (adapters only, here with
    ``modules_to_save``): TailorTrainer's ``train(resume_from_checkpoint=DIR)`` is Trainer's own
    load, and trains on as the vanilla Trainer resumed from DIR does, bit for bit; its save at the
    end is a tailored snapshot of what trains."""
    import peft

    def adapters():
        return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])

    whole = trainer_run(tmp_path / "vanilla", {}, adapters=adapters())
    checkpoint = tmp_path / "vanilla" / f"checkpoint-{SAVED}"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    vanilla = trainer_run(tmp_path / "vanilla-resumed", {}, resume=checkpoint, adapters=adapters())
    tailored = trainer_run(tmp_path / "tailored", {}, resume=checkpoint, tailor=True, adapters=adapters())
    for key in ("batches", "rngs", "lrs"):
        assert {s: tailored[key][s] for s in range(SAVED + 1, LAST + 1)} == \
            {s: vanilla[key][s] for s in range(SAVED + 1, LAST + 1)}, key
    assert tailored["losses"] == vanilla["losses"] == whole["losses"]
    assert tailored["params"] == vanilla["params"] == whole["params"]
    run = Run(tmp_path / "tailored" / "tailored")
    assert run.steps() == [LAST] and run.verify() == []
    held = {key for unit in run.manifest(LAST).units for key in run.read_unit(LAST, unit)[0]}
    assert any("modules_to_save" in k and k.startswith("optim/") for k in held), sorted(held)[:8]


def test_a_save_only_model_checkpoint_is_named_with_the_way_in(tmp_path):
    """``save_only_model=True`` writes the weights, config and trainer state only: it cannot resume
    (transformers says so), so import-hf refuses it naming the option, and points to the merge
    that reads its weights; a merge takes it as a source."""
    import yaml

    from llmtailor.merge import merge

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                          save_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                          save_only_model=True)
    transformers.Trainer(model=model, args=args, train_dataset=Windows()).train()
    checkpoint = tmp_path / "checkpoint-1"
    assert not (checkpoint / "optimizer.pt").exists() and (checkpoint / "model.safetensors").is_file()
    with pytest.raises(IntegrityError, match=r"weights only, as Trainer writes with save_only_model=True.*cannot resume"
                                             r".*`llmtailor merge`") as refused:
        import_hf(checkpoint, tmp_path / "run")
    assert "is missing" not in str(refused.value)  # one reason, not a list of the files the option leaves out
    said = runner.invoke(app, ["import-hf", str(checkpoint), "-o", str(tmp_path / "run")])
    assert said.exit_code == 2 and "save_only_model" in said.output and "Traceback" not in said.output
    assert not (tmp_path / "run").exists()
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"models": [{"model": str(checkpoint)}]}))
    merge(tmp_path / "plan.yaml", tmp_path / "merged", format="model")
    shutil.rmtree(tmp_path / "merged")


def test_a_trainer_output_dir_is_named_with_its_checkpoints(tmp_path):
    """What users point at first is the ``output_dir`` they gave Trainer, which holds its
    ``checkpoint-N/`` directories (and, where the script ends with ``save_model`` and
    ``save_state`` as transformers' examples do, the final weights and trainer state): import-hf,
    inspect, verify and a merge name it with its checkpoints and the newest one's path; and
    TailorTrainer's ``output_dir`` names the run in it (``tailored/``)."""
    import re

    import yaml

    from llmtailor.errors import ConfigError
    from llmtailor.merge import merge

    out = tmp_path / "out"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, save_steps=1,
                                          report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows())
    trainer.train()
    named = rf"is a Trainer output_dir holding checkpoint-1, checkpoint-2: .*{re.escape(str(out / 'checkpoint-2'))}"
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"models": [{"model": str(out)}]}))
    with pytest.raises(ConfigError, match=named):
        merge(tmp_path / "plan.yaml", tmp_path / "merged")
    trainer.save_model()
    trainer.save_state()  # as transformers' example scripts end: output_dir looks like a checkpoint too
    assert (out / "trainer_state.json").is_file() and (out / "model.safetensors").is_file()
    for command in (["import-hf", str(out), "-o", str(tmp_path / "run")], ["inspect", str(out)], ["verify", str(out)],
                    ["import-deepspeed", str(out), "-o", str(tmp_path / "run")]):
        said = runner.invoke(app, command)
        text = " ".join(said.output.split())
        assert said.exit_code == 2 and re.search(named, text) and "Traceback" not in text, (command, text)
    said = runner.invoke(app, ["import-deepspeed", str(out / "checkpoint-2"), "-o", str(tmp_path / "run")])
    text = " ".join(said.output.split())
    assert said.exit_code == 2 and "is a Hugging Face Trainer checkpoint" in text and "import-hf" in text, text
    assert not (tmp_path / "run").exists() and not (tmp_path / "merged").exists()

    from llmtailor.integrations.hf import TailorTrainer

    tailored_out = tmp_path / "tailored-out"
    TailorTrainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tailored_out), per_device_train_batch_size=2, max_steps=1, save_steps=1, report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True), train_dataset=Windows()).train()
    said = runner.invoke(app, ["inspect", str(tailored_out)])
    text = " ".join(said.output.split())
    assert said.exit_code == 2 and f"TailorTrainer's run {tailored_out / 'tailored'}" in text, text
