"""import_hf / ``llmtailor import-hf``: a checkpoint written by the real, plain Trainer becomes a
tailored snapshot that inspect / verify / assemble use unchanged; exported back it is tensor for
tensor the original; bad input is refused naming the file, with nothing written."""

from __future__ import annotations

import json
import re
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
TIED = ("qwen2", "llama-tied")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Lazily made ``checkpoint-2/`` directories of plain Trainer runs, by family (``qwen2`` and
    ``llama-tied`` tie their embeddings)."""
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"trainer-{family}")
            torch.manual_seed(0)
            config = model_config(family.removesuffix("-tied"), tie=family in TIED)
            model = transformers.AutoModelForCausalLM.from_config(config)
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


def _weights_as_bin(ckpt, shards=1):
    """As Trainer wrote them with save_safetensors=False (transformers 4): ``save_pretrained(
    safe_serialization=False)``'s pytorch_model.bin (tied names both in it), or its shards and
    ``pytorch_model.bin.index.json``."""
    from helpers import save_bin

    save_bin(ckpt.parent / "bin", transformers.AutoModelForCausalLM.from_pretrained(ckpt), shards)
    for path in (ckpt.parent / "bin").glob("pytorch_model*"):
        shutil.move(path, ckpt / path.name)
    (ckpt / "model.safetensors").unlink()


def _rank_rng_files(*ranks):
    """As Trainer writes RNG states under DDP: rng_state_<rank>.pth per process (``ranks``), each
    its own (rank r's drawn r times further than the one-process file)."""
    def mutate(ckpt):
        state = load_rng(ckpt / "rng_state.pth")
        (ckpt / "rng_state.pth").unlink()
        generator = torch.Generator()
        for rank in ranks:
            generator.set_state(state["cpu"])
            torch.rand(rank + 1, generator=generator)
            torch.save({**state, "cpu": generator.get_state()}, ckpt / f"rng_state_{rank}.pth")

    return mutate


BAD = {
    "no weights": (_drop("model.safetensors"), IntegrityError,
                   r"model\.safetensors \(or model\.safetensors\.index\.json, pytorch_model\.bin, .*\) is missing"),
    "a rank's rng file missing": (_rank_rng_files(1), IntegrityError,
                                  r"holds the RNG files of ranks \[1\] but lacks \['rng_state_0\.pth'\]"),
    "missing scheduler": (_drop("scheduler.pt"), IntegrityError, r"scheduler\.pt is missing beside optimizer\.pt"),
    "missing config": (_drop("config.json"), IntegrityError, r"config\.json is missing"),
    "missing rng": (_drop("rng_state.pth"), IntegrityError, r"rng_state\.pth \(or rng_state_0\.pth, .*\) is missing"),
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


def test_a_legacy_pytorch_model_bin_is_read_as_transformers_reads_it(tmp_path):
    """A ``pytorch_model.bin`` in torch's legacy (pre-1.6, not zip) format: transformers loads it
    (it maps only zip files), so ``BinWeights`` reads it too, every tensor as saved."""
    from llmtailor.interop.hf.weights import BinWeights

    state = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    weights = BinWeights(tmp_path)
    assert sorted(weights.tensors) == sorted(state)
    for key, tensor in state.items():
        assert torch.equal(weights.read(key), tensor)


@pytest.mark.parametrize("family,shards", [("llama", 3), ("qwen2", 1), ("llama-tied", 1)])  # tied: both names in the .bin
def test_a_checkpoint_with_pytorch_model_bin_imports_and_merges_as_its_safetensors_twin(tmp_path, checkpoint, family, shards):
    """A Trainer checkpoint saved with ``save_safetensors=False`` (pytorch_model.bin, or its
    shards and index): ``import-hf`` writes, unit for unit, the run it writes from the same
    checkpoint with safetensors weights, and so does a merge of it."""
    import yaml

    from llmtailor.merge import merge

    ckpt = tmp_path / f"checkpoint-{STEP}"
    shutil.copytree(checkpoint(family), ckpt)
    _weights_as_bin(ckpt, shards)
    assert not (ckpt / "model.safetensors").exists() and (shards == 1) is (ckpt / "pytorch_model.bin").is_file()
    import_hf(checkpoint(family), tmp_path / "imported")
    result = runner.invoke(app, ["import-hf", str(ckpt), "-o", str(tmp_path / "from-bin")])
    assert result.exit_code == 0, result.output
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"models": [{"model": str(ckpt)}]}))
    merge(tmp_path / "plan.yaml", tmp_path / "merged")
    imported, merged = Run(tmp_path / "imported"), Run(tmp_path / "merged")
    # A merge means what mergekit makes of it: a tied head both names of which are in the .bin is
    # a head of its own there, the embedding's values.
    extra = merged.manifest(STEP).units.keys() - imported.manifest(STEP).units.keys()
    assert extra == ({"head"} if family in TIED else set())
    for unit in extra:
        assert torch.equal(merged.read_unit(STEP, unit)[0]["weight/lm_head.weight"],
                           imported.read_unit(STEP, "embed")[0]["weight/model.embed_tokens.weight"])
    assert Run(tmp_path / "from-bin").manifest(STEP).units.keys() == imported.manifest(STEP).units.keys()
    for other in (Run(tmp_path / "from-bin"), merged):
        assert other.steps() == [STEP]
        for unit in imported.manifest(STEP).units:
            assert_same_tree(other.read_unit(STEP, unit), imported.read_unit(STEP, unit), unit)
        for key in ("lr_scheduler", "rng", "optimizer_groups"):
            assert_same_tree(other.read_global(STEP)[key], imported.read_global(STEP)[key], key)
    assert Run(tmp_path / "from-bin").verify() == []


def test_a_ddp_checkpoint_keeps_every_ranks_rng_and_exports_each_back(tmp_path, checkpoint):
    """Under DDP Trainer writes ``rng_state_<rank>.pth`` per process, no ``rng_state.pth``: the
    import is a snapshot of that world size, each rank's RNG state its own (what a restore of
    that rank reads: ``Tailor.restore``, ``TailorTrainer``), and the HF export writes each rank's
    file back, bit for bit, as Trainer's DDP resume reads them."""
    ckpt = tmp_path / f"checkpoint-{STEP}"
    shutil.copytree(checkpoint("llama"), ckpt)
    _rank_rng_files(0, 1, 2)(ckpt)
    import_hf(ckpt, tmp_path / "run")
    run = Run(tmp_path / "run")
    assert run.manifest(STEP).world_size == 3 and run.verify() == []
    for rank in range(3):
        saved = load_rng(ckpt / f"rng_state_{rank}.pth")
        own = run.read_rank_state(STEP, rank)
        assert_same_tree(own["rng"]["torch"], saved["cpu"], f"rank {rank}")
        assert own["extra"]["trainer_state"] == json.loads((ckpt / "trainer_state.json").read_text())
    assert run.read_rank_state(STEP, 3) is None
    target = export_hf(run, None, tmp_path / "out")
    assert sorted(p.name for p in target.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"]
    for rank in range(3):
        name = f"rng_state_{rank}.pth"
        assert_same_tree(load_rng(target / name), load_rng(ckpt / name), name)


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


def _accelerate_state(path):
    """What accelerate's own ``save_state`` writes: model.safetensors, optimizer.bin,
    random_states_0.pkl (pickles of its own)."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = Windows()[0]["input_ids"][None]
    accelerator.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    accelerator.save_state(str(path))
    return path


def _lightning_checkpoint(path):
    """What Lightning's own ``ModelCheckpoint`` writes: one ``.ckpt`` file."""
    import lightning as L

    class TinyLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=path, every_n_train_steps=1)
    L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
              callbacks=[saver]).fit(TinyLM(), torch.utils.data.DataLoader(Windows(), batch_size=2))
    return next(path.glob("*.ckpt"))


def _peft_checkpoint(path):
    """What Trainer writes for a peft model: the adapters (adapter_model.safetensors), optimizer.pt
    and the rest, no config.json."""
    import peft

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = transformers.TrainingArguments(output_dir=str(path), per_device_train_batch_size=2, max_steps=1, save_steps=1,
                                          report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Windows()).train()
    return path / "checkpoint-1"


def _one_step():
    """A tiny Llama and its AdamW after one step, as a custom loop holds them."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = Windows()[0]["input_ids"][None]
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    return model, optimizer


def _peft_adapter(path):
    """What ``save_pretrained`` of a peft model writes: adapter_config.json and adapter_model.safetensors."""
    import peft

    base = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(path)
    return path


def _fsdp_sharded_checkpoint(path, checkpoint):
    """What Trainer writes under FSDP with ``fsdp_config`` ``state_dict_type: SHARDED_STATE_DICT``
    (accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer``): ``pytorch_model_fsdp_0/`` and
    ``optimizer_0/``, each a directory of torch's distributed checkpoint (``{"model": ...}``,
    ``{"optimizer": ...}``), beside scheduler.pt, trainer_state.json and each process's RNG file;
    no config.json, no model.safetensors, no optimizer.pt. Trainer refuses FSDP on CPU, so the
    directories are written here with the real ``torch.distributed.checkpoint.save`` (one
    process), the rest copied from a real Trainer checkpoint."""
    import torch.distributed.checkpoint as dcp

    source = checkpoint("llama")
    path = path / f"checkpoint-{STEP}"
    path.mkdir(parents=True)
    model, optimizer = _one_step()
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(path / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": optimizer.state_dict()}, storage_writer=dcp.FileSystemWriter(path / "optimizer_0"))
    for name in ("scheduler.pt", "trainer_state.json", "training_args.bin"):
        shutil.copy(source / name, path / name)
    for rank in range(2):
        shutil.copy(source / "rng_state.pth", path / f"rng_state_{rank}.pth")
    return path


def _dcp_checkpoint(path):
    """What ``torch.distributed.checkpoint.save`` writes (torchtitan's checkpoints, a custom FSDP2
    loop's): ``.metadata`` (a pickle) and ``__<rank>_0.distcp`` files, model and optimizer state
    by name."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _one_step()
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(path / "step-1"))
    return path / "step-1"


FOREIGN = {  # how the real peer writes it; what import-hf says; what a merge says
    "accelerate save_state": (_accelerate_state, r"is an accelerate save_state directory .*TailorAccelerator.*load_state",
                              r"is an accelerate save_state directory .*TailorAccelerator"),
    "Lightning .ckpt": (_lightning_checkpoint, r"is a Lightning checkpoint file.*ckpt_path=.*TailorCheckpoint",
                        r"is a Lightning checkpoint file.*TailorCheckpoint"),
    "peft Trainer checkpoint": (_peft_checkpoint, r"a Trainer checkpoint of a peft model.*TailorTrainer.*resume_from_checkpoint",
                                r"is a peft adapter .*merge_and_unload"),
    "dcp.save directory": (_dcp_checkpoint, r"is a torch\.distributed\.checkpoint directory \(\.metadata.*dcp\.load.*Tailor",
                           r"is a torch\.distributed\.checkpoint directory \(\.metadata.*dcp\.load.*Tailor"),
    "peft adapter": (_peft_adapter, r"is a peft adapter \(adapter_config.json\), not a model: .*merge_and_unload",
                     r"is a peft adapter .*merge_and_unload"),
    "FSDP sharded Trainer checkpoint": (_fsdp_sharded_checkpoint,
                                        r"is a Trainer checkpoint saved under FSDP \(pytorch_model_fsdp_0/.*TailorTrainer.*resume_from_checkpoint",
                                        r"is a Trainer checkpoint saved under FSDP .*TailorTrainer"),
}


INSPECTED = {"peft Trainer checkpoint": r"is a Trainer checkpoint of a peft model .*TailorTrainer.*resume_from_checkpoint"}
"""What ``inspect`` says where it is not what a merge says: a peft model's Trainer checkpoint is
named with the way in, as import-hf names it (a merge names the adapter it would read)."""


@pytest.mark.parametrize("shape", list(FOREIGN))
def test_what_llmtailor_does_not_read_is_refused_by_name_with_the_way_in(tmp_path, shape, checkpoint):
    """Formats users bring that import-hf and merges do not read, as their own framework writes
    them: each is named, with the way to bring it in, and nothing is written."""
    import yaml

    from llmtailor.errors import ConfigError
    from llmtailor.merge import merge

    make, imported, merged = FOREIGN[shape]
    source = make(tmp_path / "source", checkpoint) if make is _fsdp_sharded_checkpoint else make(tmp_path / "source")
    refused = runner.invoke(app, ["import-hf", str(source), "-o", str(tmp_path / "run")])
    said = " ".join(refused.output.split())
    assert refused.exit_code == 2 and re.search(imported, said) and "Traceback" not in said, said
    inspected = runner.invoke(app, ["inspect", str(source)])  # a command that takes a run names it too
    said = " ".join(inspected.output.split())
    assert inspected.exit_code == 2 and re.search(INSPECTED.get(shape, merged), said) and "Traceback" not in said, said
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"models": [{"model": str(source)}]}))
    with pytest.raises(ConfigError, match=merged):
        merge(tmp_path / "plan.yaml", tmp_path / "merged")
    assert not (tmp_path / "run").exists() and not (tmp_path / "merged").exists()
