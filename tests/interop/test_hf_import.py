"""import_hf / ``llmtailor import-hf``: a checkpoint written by the real, plain Trainer becomes a
tailored snapshot that inspect / verify / assemble use unchanged; exported back it is tensor for
tensor the original; bad input is refused naming the file, with nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from helpers import assert_same_tree
from integrations.hf_job import Windows, model_config
from safetensors.torch import load_file
from transformers.trainer_pt_utils import safe_globals
from typer.testing import CliRunner

from llmtailor.cli import app
from llmtailor.cli.assemble import register as register_assemble
from llmtailor.cli.import_hf import register
from llmtailor.errors import IncompatibleModelError, IntegrityError, TailorError
from llmtailor.interop.hf.export import export_hf
from llmtailor.interop.hf.importer import import_hf
from llmtailor.store.run import Run

register_assemble(app)
register(app)
register(app)  # harmless twice
runner = CliRunner()
STEP = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Lazily made ``checkpoint-2/`` directories of plain Trainer runs, by family."""
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"trainer-{family}")
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(model_config(family, tie=family == "qwen2"))
            args = transformers.TrainingArguments(
                output_dir=str(out), per_device_train_batch_size=2, max_steps=STEP, save_steps=STEP, report_to=[],
                use_cpu=True, seed=0, learning_rate=3e-3, weight_decay=0.01, warmup_steps=1, disable_tqdm=True,
            )
            transformers.Trainer(model=model, args=args, train_dataset=Windows()).train()
            made[family] = out / f"checkpoint-{STEP}"
        return made[family]

    return get


def load_rng(path):
    with safe_globals():
        return torch.load(path, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied; tied embeddings
def test_imported_then_exported_is_tensor_for_tensor_the_original(tmp_path, checkpoint, family):
    source = checkpoint(family)
    seen = []
    assert import_hf(source, tmp_path / "run", progress=lambda unit, done, total: seen.append((done, total))) == STEP
    run = Run(tmp_path / "run")
    assert run.steps() == [STEP] and seen[-1] == (len(run.resolve().sources),) * 2
    assert run.verify() == []

    target = export_hf(run, None, tmp_path / "out")
    assert target.name == f"checkpoint-{STEP}"
    original, exported = load_file(source / "model.safetensors"), load_file(target / "model.safetensors")
    assert ("lm_head.weight" in original) is (family == "llama")
    assert_same_tree(exported, original, "model.safetensors")
    # optimizer.pt: the same indices in the same groups, every state tensor bit for bit.
    assert_same_tree(
        torch.load(target / "optimizer.pt", weights_only=True),
        torch.load(source / "optimizer.pt", weights_only=True),
        "optimizer.pt",
    )
    assert_same_tree(
        torch.load(target / "scheduler.pt", weights_only=True),
        torch.load(source / "scheduler.pt", weights_only=True),
        "scheduler.pt",
    )
    assert_same_tree(load_rng(target / "rng_state.pth"), load_rng(source / "rng_state.pth"), "rng_state.pth")
    for name in ("trainer_state.json", "config.json"):
        assert json.loads((target / name).read_text()) == json.loads((source / name).read_text()), name


@pytest.mark.slow
def test_cli_import_then_inspect_verify_and_assemble(tmp_path, checkpoint):
    run_dir = tmp_path / "run"
    imported = runner.invoke(app, ["import-hf", str(checkpoint("llama")), "-o", str(run_dir)])
    assert imported.exit_code == 0, imported.output
    assert f"imported step {STEP}: 7 units" in imported.output  # embed, layer.0-3, norm, head
    inspected = runner.invoke(app, ["inspect", str(run_dir)])
    assert inspected.exit_code == 0 and "layer.3" in inspected.output, inspected.output
    verified = runner.invoke(app, ["verify", str(run_dir)])
    assert verified.exit_code == 0 and "every checksum matches" in verified.output, verified.output
    assembled = runner.invoke(app, ["assemble", str(run_dir), "--format", "hf", "-o", str(tmp_path / "out")])
    assert assembled.exit_code == 0 and (tmp_path / "out" / f"checkpoint-{STEP}" / "optimizer.pt").is_file()
    again = runner.invoke(app, ["import-hf", str(checkpoint("llama")), "-o", str(run_dir)])
    assert again.exit_code == 2 and "already holds snapshots" in again.output and "Traceback" not in again.output
    assert Run(run_dir).steps() == [STEP]


def _drop(name):
    return lambda ckpt: (ckpt / name).unlink()


def _bigger_model(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "intermediate_size": 128}))


def _rewrite_optimizer(change):
    def mutate(ckpt):
        saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
        change(saved)
        torch.save(saved, ckpt / "optimizer.pt")

    return mutate


def _one_group(saved):
    first, second = saved["param_groups"]
    saved["param_groups"] = [{**first, "params": first["params"] + second["params"]}]


def _reversed_decay_group(saved):
    saved["param_groups"][0]["params"].reverse()  # same sizes, indices on the wrong parameters


def _weights_as_bin(ckpt):
    """As Trainer wrote them with save_safetensors=False (transformers 4)."""
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()


BAD = {
    "weights in pytorch_model.bin": (_weights_as_bin, IntegrityError,
                                     r"its weights are in pytorch_model\.bin, which import-hf does not read: a merge reads it"),
    "missing scheduler": (_drop("scheduler.pt"), IntegrityError, r"scheduler\.pt is missing beside optimizer\.pt"),
    "missing config": (_drop("config.json"), IntegrityError, r"config\.json is missing"),
    "missing rng": (_drop("rng_state.pth"), IntegrityError, r"rng_state\.pth is missing"),
    "mismatched model": (
        _bigger_model, IncompatibleModelError, r"model\.safetensors does not fit .*config\.json.*model\.embed_tokens"
    ),
    "one optimizer group": (
        _rewrite_optimizer(_one_group), IncompatibleModelError, r"optimizer\.pt: 'param_groups' has 1 group.*ambiguous"
    ),
    "groups in another order": (
        _rewrite_optimizer(_reversed_decay_group),
        IncompatibleModelError,
        r"optimizer\.pt: state\[\d+\]\['exp_avg'\] is .* but index \d+ is 'model\.",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused_naming_the_file_with_nothing_written(tmp_path, checkpoint, case):
    mutate, error, message = BAD[case]
    ckpt = tmp_path / f"checkpoint-{STEP}"
    shutil.copytree(checkpoint("llama"), ckpt)
    mutate(ckpt)
    (tmp_path / "empty-run").mkdir()
    for run_dir in (tmp_path / "new-run", tmp_path / "empty-run"):
        with pytest.raises(error, match=message):
            import_hf(ckpt, run_dir)
    assert not (tmp_path / "new-run").exists() and not list((tmp_path / "empty-run").iterdir())

    result = runner.invoke(app, ["import-hf", str(ckpt), "-o", str(tmp_path / "new-run")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "new-run").exists()


def test_a_checkpoint_with_pytorch_model_bin_merges_into_what_import_hf_makes_of_its_safetensors(tmp_path, checkpoint):
    """The way out import-hf names for ``pytorch_model.bin`` weights: a merge of the checkpoint
    (weights from the .bin, optimizer.pt, state) writes, unit for unit, the run import-hf writes
    from the same checkpoint with safetensors weights."""
    import yaml

    from llmtailor.merge import merge

    ckpt = tmp_path / f"checkpoint-{STEP}"
    shutil.copytree(checkpoint("llama"), ckpt)
    _weights_as_bin(ckpt)
    import_hf(checkpoint("llama"), tmp_path / "imported")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"models": [{"model": str(ckpt)}]}))
    merge(tmp_path / "plan.yaml", tmp_path / "merged")
    imported, merged = Run(tmp_path / "imported"), Run(tmp_path / "merged")
    assert merged.steps() == [STEP]
    for unit in imported.manifest(STEP).units:
        assert_same_tree(merged.read_unit(STEP, unit), imported.read_unit(STEP, unit), unit)
    assert_same_tree(merged.read_global(STEP)["lr_scheduler"], imported.read_global(STEP)["lr_scheduler"], "lr_scheduler")


def test_global_step_must_match_the_directory_name(tmp_path, checkpoint):
    ckpt = tmp_path / "checkpoint-7"
    shutil.copytree(checkpoint("llama"), ckpt)
    with pytest.raises(TailorError, match=r"trainer_state\.json: global_step is 2 but the directory is named"):
        import_hf(ckpt, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_sharded_weights_are_read_through_their_index(tmp_path, checkpoint):
    ckpt = tmp_path / f"checkpoint-{STEP}"
    shutil.copytree(checkpoint("llama"), ckpt)
    original = load_file(ckpt / "model.safetensors")
    transformers.AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    (ckpt / "model.safetensors").unlink()
    for shard in (tmp_path / "sharded").glob("model*"):
        shutil.copy(shard, ckpt / shard.name)
    assert (ckpt / "model.safetensors.index.json").is_file()
    import_hf(ckpt, tmp_path / "run")
    exported = export_hf(Run(tmp_path / "run"), None, tmp_path / "out")
    assert_same_tree(load_file(exported / "model.safetensors"), original)


def test_an_imported_trainer_checkpoint_goes_on_with_a_memory_tier_in_front(tmp_path, checkpoint, tokens):
    """A run made from a plain Trainer's checkpoint (no llmtailor code wrote it) gets a memory tier:
    the restore reads the run directory, the saves land in memory (the first full: memory lacks
    the imported versions), promotions make them whole in the run directory, which restores
    what the memory tier holds."""
    from llmtailor import Parity, Tailor, Tier
    from llmtailor.training_example import batch_at, hf_param_groups

    run_dir, memory = tmp_path / "run", tmp_path / "memory"
    import_hf(checkpoint("llama"), run_dir)

    def live(seed):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
        return model, torch.optim.AdamW(hf_param_groups(model), lr=3e-3)

    model, opt = live(5)
    tailor = Tailor(run_dir, model, opt, policy=Parity(), tiers=[Tier(memory, keep=2, promote_every=2)])
    assert (tailor.restore().step, tailor.restore().tier) == (STEP, str(run_dir))
    written = []
    for step in (STEP + 1, STEP + 2, STEP + 3):
        batch = batch_at(tokens, step, 2, 16)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        written.append(len(tailor.save(step).units))
    tailor.close()
    assert written[0] == 7 and written[1] < 7  # the first save after it is full, then Parity
    assert Run(run_dir).latest_step() == STEP + 3 and Run(run_dir).verify() == []
    states = []
    for tiers in ([Tier(memory)], []):
        fresh, fresh_opt = live(9)
        report = Tailor(run_dir, fresh, fresh_opt, tiers=tiers, read_only=True).restore()
        assert report.step == STEP + 3 and report.tier == str(memory if tiers else run_dir)
        states.append({**fresh.state_dict(), **{f"{i}/{k}": v for i, s in enumerate(fresh_opt.state.values())
                                                for k, v in s.items()}})
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
