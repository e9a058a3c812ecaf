"""export_hf / ``llmtailor assemble --format hf`` on runs saved by a plain Tailor: the files
Trainer reads, loadable with weights_only=True; Trainer's group order enforced; atomic output."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny, train, tree_digest
from safetensors.torch import load_file
from transformers.trainer_pt_utils import safe_globals
from typer.testing import CliRunner

from llmtailor import Parity, Tailor
from llmtailor.cli import app
from llmtailor.cli.assemble import register
from llmtailor.errors import IncompatibleModelError
from llmtailor.interop.hf.export import export_hf
from llmtailor.interop.hf.model import trainer_param_groups
from llmtailor.store.run import Run

register(app)
runner = CliRunner()


def saved_run(path, tokens, family="llama", tie=False, optimizer=None):
    model, opt, sched = tiny(family=family, tie=tie)
    if optimizer is not None:
        opt, sched = optimizer(model)
    tailor = Tailor(path, model, opt, sched, policy=Parity())
    for step in range(1, 5):
        train(model, opt, sched, tokens, [step])
        if step % 2 == 0:
            tailor.save(step)
    tailor.close()
    return model, opt


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", True)])
def test_export_writes_what_trainer_reads_from_the_composite(tmp_path, tokens, family, tie):
    model, opt = saved_run(tmp_path / "run", tokens, family, tie)
    run = Run(tmp_path / "run")
    seen = []
    target = export_hf(run, None, tmp_path / "out", progress=lambda unit, done, total: seen.append((done, total)))
    assert target == tmp_path / "out" / "checkpoint-4"
    assert seen[-1] == (len(run.resolve().sources),) * 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-4"]  # no temporary left
    assert {p.name for p in target.iterdir()} == {
        "model.safetensors", "config.json", "generation_config.json", "optimizer.pt", "scheduler.pt",
        "rng_state.pth", "trainer_state.json",
    }

    # Weights: the names save_pretrained writes (a tied head once), bytes of the composite's versions.
    model.save_pretrained(tmp_path / "pretrained")
    weights = load_file(target / "model.safetensors")
    assert weights.keys() == load_file(tmp_path / "pretrained" / "model.safetensors").keys()
    assert ("lm_head.weight" in weights) is not tie
    composite = run.resolve()
    for unit, source in composite.sources.items():
        tensors, _ = run.read_unit(source, unit)
        for key, tensor in tensors.items():
            if key.startswith("weight/"):
                assert torch.equal(weights[key.removeprefix("weight/")], tensor)

    # optimizer.pt: indices in Trainer's decay / no-decay order; it loads into such an optimizer.
    optim = torch.load(target / "optimizer.pt", weights_only=True)
    groups = trainer_param_groups(json.loads((target / "config.json").read_text()))
    assert [len(g["params"]) for g in optim["param_groups"]] == [len(g) for g in groups]
    params = dict(model.named_parameters())
    fresh = torch.optim.AdamW([{"params": [params[n] for n in g]} for g in groups])
    fresh.load_state_dict(optim)
    checked = 0
    for unit, source in composite.sources.items():
        tensors, _ = run.read_unit(source, unit)
        for key, tensor in tensors.items():
            if key.startswith("optim/"):
                name, _, state_key = key.removeprefix("optim/").rpartition("/")
                assert torch.equal(fresh.state[params[name]][state_key], tensor), key
                checked += 1
    assert checked == sum(len(s) for s in opt.state.values())

    assert torch.load(target / "scheduler.pt", weights_only=True)["last_epoch"] == 4
    with safe_globals():
        rng = torch.load(target / "rng_state.pth", weights_only=True)
    assert set(rng) >= {"python", "numpy", "cpu"}
    assert json.loads((target / "trainer_state.json").read_text())["global_step"] == 4


def test_groups_that_are_not_trainers_are_refused_naming_the_parameter(tmp_path, tokens):
    def one_group(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    saved_run(tmp_path / "run", tokens, optimizer=one_group)
    with pytest.raises(IncompatibleModelError, match=r"input_layernorm\.weight.*vanilla Trainer"):
        export_hf(Run(tmp_path / "run"), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    result = runner.invoke(app, ["assemble", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "vanilla Trainer" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_an_existing_checkpoint_directory_is_never_overwritten(tmp_path, tokens):
    saved_run(tmp_path / "run", tokens)
    existing = tmp_path / "out" / "checkpoint-4"
    existing.mkdir(parents=True)
    (existing / "model.safetensors").write_bytes(b"mine")
    before = tree_digest(tmp_path / "out")

    result = runner.invoke(app, ["assemble", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "already exists" in result.output
    assert tree_digest(tmp_path / "out") == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-4"]

    older = runner.invoke(app, ["assemble", str(tmp_path / "run"), "--step", "2", "-o", str(tmp_path / "out")])
    assert older.exit_code == 0, older.output
    assert (tmp_path / "out" / "checkpoint-2" / "optimizer.pt").is_file()


def test_bad_run_arguments_are_one_line_errors(tmp_path, tokens):
    missing = runner.invoke(app, ["assemble", str(tmp_path / "nope"), "-o", str(tmp_path / "out")])
    assert missing.exit_code == 2 and "no such run directory" in missing.output
    saved_run(tmp_path / "run", tokens)
    step = runner.invoke(app, ["assemble", str(tmp_path / "run"), "--step", "1", "-o", str(tmp_path / "out")])
    assert step.exit_code == 2 and "no committed snapshot at or before step 1" in step.output
    assert not (tmp_path / "out").exists()


def test_a_plain_tailor_run_exports_a_trainer_state_trainer_accepts(tmp_path, tokens):
    """A plain Tailor run holds no TrainerState: the minimal one must pass Trainer's own
    resume check (which divides its train_batch_size)."""
    from transformers import TrainerState, TrainingArguments
    from transformers.trainer_utils import compare_trainer_and_checkpoint_args

    model, opt, sched = tiny()
    train(model, opt, sched, tokens, [1])
    Tailor(tmp_path / "run", model, opt, sched).save(1)
    result = CliRunner().invoke(app, ["assemble", str(tmp_path / "run"), "-o", str(tmp_path / "out"), "--train-batch-size", "4"])
    assert result.exit_code == 0, result.output
    state = TrainerState.load_from_json(str(tmp_path / "out/checkpoint-1/trainer_state.json"))
    assert state.global_step == 1 and state.train_batch_size == 4
    compare_trainer_and_checkpoint_args(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]), state)
