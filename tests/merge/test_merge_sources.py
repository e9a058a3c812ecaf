"""Merge plans as people write them (issue 11): plain model directories as sources, mergekit's
own semantics, depth changes and overlapping slices, ``models:``, casts, tokenizers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from helpers import save_bin, tiny, train, wait_launches
from safetensors.torch import load_file

from llmtailor import Full, Tailor
from llmtailor.interop.hf.export import export_hf
from llmtailor.merge import merge, open_plan
from llmtailor.store.run import Run

HF_JOB = Path(__file__).parents[1] / "integrations" / "hf_job.py"


def save_model(path: Path, family: str, layers: int, seed: int, tie: bool = False, shard: str | None = None):
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "gpt2": transformers.GPT2Config}
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=layers, n_head=4)
    else:
        config = classes[family](vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return model


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["[UNK]", "[PAD]", *"abcdefghij"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    made = {
        "a": save_model(root / "a", "llama", 4, seed=1),
        "b": save_model(root / "b", "llama", 4, seed=2, shard="20KB"),  # sharded, with an index
        "tied": save_model(root / "tied", "qwen2", 4, seed=3, tie=True, shard="20KB"),
        "gpt2": save_model(root / "gpt2", "gpt2", 12, seed=4),
    }
    save_tokenizer(root / "a")
    return root, made


def plan(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def slices(*ranges) -> list[dict]:
    return [{"sources": [{"model": str(model), "layer_range": list(r)}]} for model, r in ranges]


def weights(out: Path) -> dict[str, torch.Tensor]:
    run = Run(out)
    step = run.resolve().step
    return {k.removeprefix("weight/"): t for u in run.resolve().sources for k, t in run.read_unit(step, u)[0].items()}


def test_plain_directories_single_and_sharded_tied_and_untied(models, tmp_path):
    root, made = models
    assert (root / "b" / "model.safetensors.index.json").is_file() and (root / "tied" / "model.safetensors.index.json").is_file()
    for name in ("a", "b", "tied"):
        out = tmp_path / name
        result = merge(plan(tmp_path / f"{name}.yaml", {"models": [{"model": str(root / name)}]}), out)
        assert result.is_dir()
        got = weights(out)
        expected = made[name].state_dict()
        for key, tensor in got.items():
            assert torch.equal(tensor, expected[key]), key
        assert set(got) == {k for k in expected if not (name == "tied" and k == "lm_head.weight")}
        state = Run(out).read_global(Run(out).resolve().step)
        assert state["optimizer_groups"] is None and state["model_config"]["model_type"] == made[name].config.model_type


def test_without_base_model_the_aux_units_come_as_mergekit_takes_them(models, tmp_path):
    """mergekit's passthrough: embeddings from the first slice's model, final norm and LM head
    from the last slice's."""
    root, made = models
    p = plan(tmp_path / "p.yaml", {"merge_method": "passthrough", "slices": slices((root / "a", (0, 2)), (root / "b", (2, 4)))})
    with open_plan(p, tmp_path / "out") as planned:
        sources = {a.dest_unit: a.source for a in planned.actions}
        assert sources["embed"] == str(root / "a") and sources["norm"] == sources["head"] == str(root / "b")
    merge(p, tmp_path / "out")
    got, a, b = weights(tmp_path / "out"), made["a"].state_dict(), made["b"].state_dict()
    assert torch.equal(got["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert torch.equal(got["model.norm.weight"], b["model.norm.weight"])
    assert torch.equal(got["lm_head.weight"], b["lm_head.weight"])
    assert torch.equal(got["model.layers.1.mlp.up_proj.weight"], a["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(got["model.layers.3.mlp.up_proj.weight"], b["model.layers.3.mlp.up_proj.weight"])


def test_a_gpt2_cut_from_12_to_8_layers_loads_with_no_missing_or_new_weights(models, tmp_path):
    root, made = models
    p = plan(tmp_path / "cut.yaml", {"slices": slices((root / "gpt2", (0, 6)), (root / "gpt2", (10, 12)))})
    out = merge(p, tmp_path / "cut", format="model")
    config = json.loads((out / "config.json").read_text())
    assert config["n_layer"] == 8
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    source = made["gpt2"].state_dict()
    live = model.state_dict()
    for i, j in enumerate([0, 1, 2, 3, 4, 5, 10, 11]):
        assert torch.equal(live[f"transformer.h.{i}.attn.c_attn.weight"], source[f"transformer.h.{j}.attn.c_attn.weight"])
    assert torch.equal(live["transformer.ln_f.weight"], source["transformer.ln_f.weight"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokens):
    """A tailored run (Full, saves at 2 and 4) of a 4-layer Llama with AdamW state."""
    root = tmp_path_factory.mktemp("trained")
    model, optimizer, scheduler = tiny()
    with Tailor(root / "run", model, optimizer, scheduler, policy=Full()) as tailor:
        for step in (1, 2, 3, 4):
            train(model, optimizer, scheduler, tokens, [step])
            if step % 2 == 0:
                tailor.save(step)
    return root / "run"


def test_an_overlapping_stack_takes_every_layer_from_its_named_source(trained, tmp_path):
    p = plan(tmp_path / "stack.yaml", {"slices": slices((f"{trained}@2", (0, 3)), (f"{trained}@4", (1, 4))), "optimizer": False})
    merge(p, tmp_path / "out")
    out = Run(tmp_path / "out")
    assert out.read_global(4)["model_config"]["num_hidden_layers"] == 6
    source = Run(trained)
    for i, (step, j) in enumerate([(2, 0), (2, 1), (2, 2), (4, 1), (4, 2), (4, 3)]):
        got, _ = out.read_unit(4, f"layer.{i}")
        want = {k: t for k, t in source.read_unit(step, f"layer.{j}")[0].items() if k.startswith("weight/")}
        assert {k.replace(f"layers.{i}.", f"layers.{j}.") for k in got} == want.keys()  # weights only
        for key, tensor in want.items():
            assert torch.equal(got[key.replace(f"layers.{j}.", f"layers.{i}.")], tensor), (i, key)


def test_the_stack_with_optimizer_state_keeps_each_duplicated_layers_moments(trained, tmp_path, tokens):
    p = plan(tmp_path / "stack.yaml", {"slices": slices((f"{trained}@4", (0, 3)), (f"{trained}@4", (1, 4)))})
    merge(p, tmp_path / "out")
    out, source = Run(tmp_path / "out"), Run(trained)
    groups = out.read_global(4)["optimizer_groups"]
    assert sum(len(g["params"]) for g in groups) == sum(len(n) for n in out.resolve().manifest.layout["units"].values())
    decay = set(groups[0]["params"])
    assert "model.layers.5.mlp.up_proj.weight" in decay and "model.layers.5.input_layernorm.weight" not in decay
    for i, j in enumerate([0, 1, 2, 1, 2, 3]):
        got, values = out.read_unit(4, f"layer.{i}")
        want, _ = source.read_unit(4, f"layer.{j}")
        for key, tensor in want.items():
            if key.startswith("optim/"):
                assert torch.equal(got[key.replace(f"layers.{j}.", f"layers.{i}.")], tensor)
    # A 6-layer model and optimizer take it and train on.
    model, optimizer, scheduler = tiny(layers=6, seed=8)
    Tailor(tmp_path / "out", model, optimizer, scheduler).restore()
    assert torch.isfinite(torch.tensor(train(model, optimizer, scheduler, tokens, [5, 6]))).all()


@pytest.mark.slow
def test_a_depth_up_scaled_checkpoint_resumes_in_a_vanilla_trainer(tmp_path):
    """Sources: a vanilla Trainer run's checkpoint; a 6-layer stack of its 4 layers with
    optimizer state, as --format hf; a vanilla Trainer process resumes it and its duplicated
    layers' moments are their sources'."""
    def job(name: str, *flags: str) -> dict:
        proc = subprocess.run([sys.executable, str(HF_JOB), "--out", str(tmp_path / name), "--result",
                               str(tmp_path / f"{name}.json"), "--trainer", "vanilla", *flags],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((tmp_path / f"{name}.json").read_text())

    job("train", "--max-steps", "4", "--save-steps", "4")
    source = tmp_path / "train" / "checkpoint-4"
    p = plan(tmp_path / "up.yaml", {"slices": slices((source, (0, 3)), (source, (1, 4))), "tokenizer_source": "base"})
    merge(p, tmp_path / "hf", format="hf")
    resumed = job("resume", "--resume", str(tmp_path / "hf" / "checkpoint-4"), "--max-steps", "6", "--dump", str(tmp_path / "d.pt"))
    assert resumed["global_step"] == 6
    dump = torch.load(tmp_path / "d.pt", weights_only=True)
    original = torch.load(source / "optimizer.pt", weights_only=True)
    assert len(dump["tensors"]) > len(original["state"])
    # Output layers 1 and 3 both come from source layer 1, 2 and 4 from source layer 2.
    for copy, first in ((3, 1), (4, 2)):
        for key in ("exp_avg", "exp_avg_sq"):
            a = dump["tensors"][f"optim/model.layers.{copy}.mlp.up_proj.weight/{key}"]
            b = dump["tensors"][f"optim/model.layers.{first}.mlp.up_proj.weight/{key}"]
            assert torch.equal(a, b) and a.abs().sum() > 0


@pytest.mark.parametrize("name,shards", [("a", 3), ("tied", 1), ("tied", 2)])
def test_pytorch_model_bin_directories_single_or_sharded_are_sources(models, tmp_path, name, shards):
    root, made = models
    save_bin(tmp_path / "bin", made[name], shards)
    out = merge(plan(tmp_path / "p.yaml", {"slices": slices((tmp_path / "bin", (1, 4)), (tmp_path / "bin", (0, 1)))}),
                tmp_path / "out", format="model")
    got, source = load_file(out / "model.safetensors"), made[name].state_dict()
    order = [1, 2, 3, 0]
    for key, tensor in got.items():
        parts = key.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(order[int(parts[2])])
        assert torch.equal(tensor, source[".".join(parts)]), key
    assert {k for k in got if "layers" not in k} >= {"model.embed_tokens.weight", "model.norm.weight"}


def test_models_form_copies_a_model_with_scale_and_cast(models, tmp_path):
    root, made = models
    p = plan(tmp_path / "copy.yaml", {
        "merge_method": "passthrough", "dtype": "bfloat16",
        "models": [{"model": str(root / "a"), "parameters": {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]}}],
    })
    out = merge(p, tmp_path / "copy", format="model")
    got = load_file(out / "model.safetensors")
    source = made["a"].state_dict()
    assert got["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.layers.0.self_attn.o_proj.weight"], (source["model.layers.0.self_attn.o_proj.weight"] * 0.5).bfloat16())
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], source["model.layers.0.mlp.up_proj.weight"].bfloat16())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # The tokenizer of the (base) model comes along, and loads.
    assert (out / "tokenizer.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(out)("a b")["input_ids"] == [2, 3]


def test_tokenizer_source_is_copied_into_an_hf_checkpoint(models, trained, tmp_path):
    root, _ = models
    p = plan(tmp_path / "p.yaml", {"slices": slices((f"{trained}@4", (0, 4))), "tokenizer_source": str(root / "a")})
    checkpoint = merge(p, tmp_path / "hf", format="hf")
    assert (checkpoint / "tokenizer.json").is_file() and (checkpoint / "optimizer.pt").is_file()


def test_optimizer_true_with_a_source_without_optimizer_state_is_refused_with_the_fix(models, tmp_path):
    from llmtailor.errors import ConfigError

    root, _ = models
    p = plan(tmp_path / "p.yaml", {"slices": slices((root / "a", (0, 2)), (root / "b", (2, 4))), "optimizer": True})
    with pytest.raises(ConfigError, match="holds no optimizer state; set optimizer: false"):
        merge(p, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_hf_checkpoint_source_reads_optimizer_pt_only_when_the_plan_moves_state(trained, tmp_path, monkeypatch):
    import llmtailor.interop.hf.reader as hf_reader

    export_hf(Run(trained), 4, tmp_path / "hf")
    loads = []
    real = hf_reader.torch_load
    monkeypatch.setattr(hf_reader, "torch_load", lambda path: loads.append(Path(path).name) or real(path))
    source = tmp_path / "hf" / "checkpoint-4"
    merge(plan(tmp_path / "w.yaml", {"models": [{"model": str(source)}], "optimizer": False}), tmp_path / "w")
    assert "optimizer.pt" not in loads
    merge(plan(tmp_path / "o.yaml", {"models": [{"model": str(source)}]}), tmp_path / "o")
    assert "optimizer.pt" in loads


@pytest.mark.parametrize("form", ["hf", "model"])
def test_every_file_of_a_merged_directory_is_fsynced_before_it_appears(models, trained, tmp_path, monkeypatch, form):
    """Side files too (config, generation config, tokenizer): a crash after the rename must not
    leave an empty ``config.json`` beside durable weights."""
    import os

    synced = set()
    real = os.fsync

    def recording(fd):
        synced.add(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    root, _ = models
    p = plan(tmp_path / "p.yaml", {"slices": slices((f"{trained}@4", (0, 4))), "tokenizer_source": str(root / "a")})
    out = merge(p, tmp_path / form, format=form)
    written = {f.name for f in out.rglob("*") if f.is_file()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= written
    assert written <= synced, written - synced


def test_a_weights_only_merge_of_hf_directories_runs_without_importing_torch(models, trained, tmp_path):
    """Importing torch is most of a small merge's time (bench/RESULTS.md): the command line's
    byte-moving path must not do it. A cast needs torch, and gets it."""
    root, made = models
    export_hf(Run(trained), 4, tmp_path / "hf")
    checkpoint = tmp_path / "hf" / "checkpoint-4"
    stack = {"slices": slices((root / "a", (0, 2)), (root / "b", (2, 4))), "merge_method": "passthrough"}
    script = (
        "import sys\n"
        "from llmtailor.cli import main\n"
        "sys.argv = ['llmtailor', 'merge', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit as done:\n    assert not done.code, done.code\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    cases = {  # name: plan, torch needed, {output key: expected tensor}
        "bytes": (stack, False, {"model.layers.1.mlp.up_proj.weight": made["a"].state_dict(),
                                 "model.layers.3.mlp.up_proj.weight": made["b"].state_dict(),
                                 "lm_head.weight": made["b"].state_dict()}),
        "checkpoint": ({"models": [{"model": str(checkpoint)}], "optimizer": False}, False,
                       dict.fromkeys(["model.layers.2.self_attn.q_proj.weight", "model.embed_tokens.weight"],
                                     load_file(checkpoint / "model.safetensors"))),
        "cast": ({**stack, "dtype": "bfloat16"}, True, {"model.layers.1.mlp.up_proj.weight": made["a"].state_dict()}),
    }
    # The three merges at once (each a fresh interpreter of its own, its own plan and output).
    merges = {name: subprocess.Popen([sys.executable, "-c", script, str(plan(tmp_path / f"{name}.yaml", spec)),
                                      "--format", "model", "-o", str(tmp_path / name)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for name, (spec, _, _) in cases.items()}
    outputs = dict(zip(merges, wait_launches(list(merges.values()))))
    for name, (_, torch_needed, expected) in cases.items():
        (stdout, stderr), out = outputs[name], tmp_path / name
        assert merges[name].returncode == 0, stderr
        assert f"torch imported: {torch_needed}" in stdout, stdout + stderr
        got = load_file(out / "model.safetensors")
        for key, source in expected.items():
            want = source[key].to(torch.bfloat16) if name == "cast" else source[key]
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), (name, key)


def test_a_peft_adapter_directory_is_refused_as_a_source_and_an_import_naming_the_way(models, tmp_path):
    """What peft's ``save_pretrained`` (and a vanilla Trainer's checkpoint of a PeftModel) holds is
    an adapter, not a model: merges and ``import-hf`` say so, with what to do instead."""
    import peft
    from typer.testing import CliRunner

    from llmtailor.cli import app

    root, made = models
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "a")
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    p = plan(tmp_path / "p.yaml", {"models": [{"model": str(tmp_path / "adapter")}]})
    for command in (["merge", str(p), "-o", str(tmp_path / "out")], ["import-hf", str(tmp_path / "adapter"), "-o", str(tmp_path / "out")]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "peft" in result.output and "merge_and_unload" in " ".join(result.output.split()), result.output
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("head", ["untied model", "tied pytorch_model.bin", "head key"])
def test_a_head_named_into_a_tied_model_from_another_source_is_refused_not_dropped(models, tmp_path, head):
    """The output's model ties its LM head to its embedding (tie_word_embeddings): a head named
    from another source than the embedding's (post_weights, as LLMTailor's plans name it, or
    ``head``) cannot be kept, and is refused, not silently left out; named from the embedding's
    own source (a tied .bin holds both names), it is the embedding, and merges."""
    from llmtailor.errors import ConfigError

    root, made = models
    tied = tmp_path / "tied-llama"
    save_model(tied, "llama", 4, seed=5, tie=True)
    save_bin(tmp_path / "bin", save_model(tmp_path / "other", "llama", 4, seed=6, tie=True))
    source = {"untied model": root / "a", "tied pytorch_model.bin": tmp_path / "bin", "head key": root / "a"}[head]
    named = ({"head": str(source)} if head == "head key" else
             {"post_weights": [{"name": "model.norm.weight", "model": str(tied)}, {"name": "lm_head.weight", "model": str(source)}]})
    spec = {"slices": slices((tied, (0, 4))), **named}
    with pytest.raises(ConfigError, match=r"ties lm_head.weight to model.embed_tokens.weight.*would be lost"):
        merge(plan(tmp_path / "p.yaml", spec), tmp_path / "out", format="model")
    assert not (tmp_path / "out").exists()
    # Embedding and head from the tied .bin: its head is its embedding.
    spec = {"slices": slices((tied, (0, 4))), "pre_weights": [{"name": "model.embed_tokens.weight", "model": str(tmp_path / "bin")}],
            "post_weights": [{"name": "lm_head.weight", "model": str(tmp_path / "bin")}]}
    out = merge(plan(tmp_path / "same.yaml", spec), tmp_path / "same", format="model")
    got = load_file(out / "model.safetensors")
    other = load_file(tmp_path / "other" / "model.safetensors")
    assert torch.equal(got["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


@pytest.mark.parametrize("form", ["slices with base_model", "models with state_from"])
def test_an_untied_output_whose_head_source_ties_its_head_is_refused_not_left_headless(models, tmp_path, form):
    """The output's config (base_model / state_from) has an LM head of its own, the head's source
    (the last slice's model) ties it to its embedding and holds no head: the output would load
    with a newly initialised head (mergekit 0.1.5 writes it so), so the plan is refused, naming
    the fix; with the head taken from the untied model it merges, and loads with nothing missing."""
    from llmtailor.errors import ConfigError

    root, made = models
    tied = tmp_path / "tied-llama"
    save_model(tied, "llama", 4, seed=5, tie=True)
    spec = ({"slices": slices((root / "a", (0, 2)), (tied, (2, 4))), "base_model": str(root / "a")}
            if form == "slices with base_model" else {"models": [{"model": str(tied)}], "state_from": str(root / "a")})
    with pytest.raises(ConfigError, match=r"has an LM head of its own \(lm_head.weight\), but its source .* ties its head"):
        merge(plan(tmp_path / "p.yaml", spec), tmp_path / "out", format="model")
    assert not (tmp_path / "out").exists()
    out = merge(plan(tmp_path / "fixed.yaml", {**spec, "head": str(root / "a")}), tmp_path / "fixed", format="model")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(model.state_dict()["lm_head.weight"], made["a"].state_dict()["lm_head.weight"])


@pytest.mark.parametrize("listed", [True, False])
def test_each_layer_keeps_its_attention_kind_wherever_a_plan_puts_it(tmp_path, listed):
    """A gemma2 alternates sliding-window and full attention (``layer_types`` in its config): an
    output layer is its source layer, so its kind is the source layer's, in a reordered stack of
    the same depth (where the config's own list would give it the other kind) and in a deeper one.
    ``listed=False``: a config.json without the list (as the hub's gemma-2 configs, saved before
    transformers wrote it), whose kinds transformers derives from each layer's position."""
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "g")
    saved = json.loads((tmp_path / "g" / "config.json").read_text())
    kinds = saved["layer_types"] if listed else saved.pop("layer_types")
    (tmp_path / "g" / "config.json").write_text(json.dumps(saved))
    assert len(set(kinds)) == 2, kinds
    for name, ranges, order in (("reordered", [(1, 2), (0, 1), (2, 4)], [1, 0, 2, 3]),
                                ("deeper", [(0, 4), (2, 4)], [0, 1, 2, 3, 2, 3])):
        out = merge(plan(tmp_path / f"{name}.yaml", {"slices": slices(*((tmp_path / "g", r) for r in ranges))}),
                    tmp_path / name, format="model")
        written = json.loads((out / "config.json").read_text())
        if listed or name == "reordered":  # the deeper one's kinds are those a gemma2 of 6 layers derives
            assert written["layer_types"] == [kinds[j] for j in order], name
        assert written["num_hidden_layers"] == len(order)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info.values()), info
        assert model.config.layer_types == [kinds[j] for j in order]


def test_a_cut_gemma4_keeps_its_layers_overrides_and_a_last_layer_transformers_would_change_is_refused(tmp_path):
    """A gemma4 (no family file: the name-based layout) cut to 4 of its 6 layers: its config's
    layer count and per_layer_config (a full-attention layer's wider head_dim, by layer index)
    follow the layers kept, and transformers loads it whole. Cut to 5, its last layer would be a
    sliding one, which transformers' gemma4 config makes full attention (of another shape): refused.
    BEFORE: the cut to 4 kept ``num_hidden_layers`` 6 and the entry of layer 5, and transformers
    refused to load it (``num_hidden_layers (6) must be equal to the number of layer_types (4)``);
    the cut to 5 merged as well."""
    from llmtailor.errors import ConfigError

    config = transformers.CONFIG_MAPPING["gemma4_text"](vocab_size=64, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                                          layer_types=["sliding_attention", "full_attention"] * 3,
                                                          hidden_size_per_layer_input=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "g")
    out = merge(plan(tmp_path / "cut.yaml", {"slices": slices((tmp_path / "g", (0, 4)))}), tmp_path / "cut", format="model")
    written = json.loads((out / "config.json").read_text())
    assert (written["num_hidden_layers"], sorted(written["per_layer_config"])) == (4, ["1", "3"])
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    with pytest.raises(ConfigError, match=r"the output's layer 4 is layer 4 of .*, a sliding_attention layer, which "
                                          r"transformers' 'gemma4_text' config makes a full_attention layer there"):
        merge(plan(tmp_path / "odd.yaml", {"slices": slices((tmp_path / "g", (0, 5)))}), tmp_path / "odd", format="model")
    assert not (tmp_path / "odd").exists()


def test_a_layer_in_place_keeps_its_kind_when_its_source_lists_other_kinds_than_the_state_source(tmp_path):
    """The state source's config.json has no layer_types (a gemma2 saved before transformers
    wrote it: sliding and full in turn); the other source lists its own (all sliding). No layer
    moves, yet the output's layer 1, from the other source, is a sliding one. BEFORE: the output
    config had no list, and transformers gave layer 1 the state source's kind (full attention)."""
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)
    for name, kinds in (("a", None), ("b", ["sliding_attention"] * 4)):
        torch.manual_seed(0)
        made = transformers.Gemma2Config(**config, **({"layer_types": kinds} if kinds else {}))
        transformers.AutoModelForCausalLM.from_config(made).save_pretrained(tmp_path / name)
        if kinds is None:
            saved = json.loads((tmp_path / name / "config.json").read_text())
            del saved["layer_types"]
            (tmp_path / name / "config.json").write_text(json.dumps(saved))
    out = merge(plan(tmp_path / "p.yaml", {"slices": slices((tmp_path / "b", (0, 2)), (tmp_path / "a", (2, 4)))}),
                tmp_path / "out", format="model")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.layer_types == ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def test_layers_of_another_shape_moved_within_one_model_are_named_with_their_place(tmp_path):
    """A gemma4's full-attention layers are wider than its sliding ones: one moved to a sliding
    layer's place does not fit there, and the refusal says so, naming where it was put, not that
    the model does not fit itself."""
    from llmtailor.errors import ConfigError

    config = transformers.CONFIG_MAPPING["gemma4_text"](vocab_size=64, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                          hidden_size_per_layer_input=0)  # no per-layer inputs:
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "g")  # its layers may move
    with pytest.raises(ConfigError) as refused:
        merge(plan(tmp_path / "p.yaml", {"slices": slices((tmp_path / "g", (2, 4)), (tmp_path / "g", (0, 2)))}),
              tmp_path / "out", format="model")
    message = str(refused.value)
    assert "does not fit the output's layers, as the config of that source has them" in message, message
    assert re.search(r"its layer\.\d \(put at layer\.\d\) differ in shape", message), message
    assert not (tmp_path / "out").exists()


def test_a_multimodal_models_layer_units_hold_each_towers_layer_and_stay_in_place(tmp_path):
    """A multimodal gemma4 (the name-based layout) holds text layer i and vision layer i in its
    unit layer.i: a plan names text layers, so a stack of the text's depth would drop the deeper
    vision tower's last layers, and a layer moved would move a vision layer with it. Both are
    refused, naming the stacks; the whole model merges. BEFORE: the text-depth plan merged an
    output missing vision layers 2 and 3 (transformers initialised them at random); the swap
    was refused as ``lacks 13 tensors (...vision_tower...): another architecture``."""
    from llmtailor.errors import ConfigError

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                hidden_size_per_layer_input=0)
    config = transformers.CONFIG_MAPPING["gemma4"](text_config=text, audio_config=None, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=5, num_attention_heads=2))
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "g")
    g = tmp_path / "g"
    stacks = r"has 2 stacks of layers \(model\.language_model\.layers, model\.vision_tower\.encoder\.layers\)"
    for name, ranges, change in (("text-depth", [(0, 3)], "makes a stack of 3 layers from its 5"),
                                 ("swap", [(1, 2), (0, 1), (2, 5)], "puts its layer 1 at layer 0")):
        with pytest.raises(ConfigError, match=rf"{stacks}, layer i of each in its unit layer\.i; the plan {change}:"):
            merge(plan(tmp_path / f"{name}.yaml", {"slices": slices(*((g, r) for r in ranges))}), tmp_path / name,
                  format="model")
        assert not (tmp_path / name).exists()
    out = merge(plan(tmp_path / "whole.yaml", {"models": [{"model": str(g)}]}), tmp_path / "whole", format="model")
    _, info = transformers.AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("bound,multimodal", [("per-layer inputs", False), ("KV sharing", False), ("per-layer inputs", True)])
def test_layers_bound_to_their_places_are_not_moved_but_stay_mixable_in_place(tmp_path, bound, multimodal):
    """A gemma4 with per-layer inputs holds one block per layer, by its place, in tensors outside
    the layers (embed_tokens_per_layer, per_layer_model_projection); one with KV sharing has its
    last layers reuse an earlier layer's cache, by place. Two sliding layers of the same shape
    (neither sharing another's cache) swapped would meet each other's block or cache: the plan is
    refused, naming why (before: it merged, and the output loaded with nothing missing, every
    layer given the wrong block). A multimodal gemma4's text config is its ``text_config`` (before:
    refused as a misfit of its vision layers). Each layer at its own place, taken from another
    model of the same config, merges."""
    from llmtailor.errors import ConfigError

    sizes = ({"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8} if bound == "per-layer inputs"
             else {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 2})
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, layer_types=["sliding_attention", "full_attention"] * 3, **sizes)
    config = (transformers.CONFIG_MAPPING["gemma4"](text_config=text, audio_config=None, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
        if multimodal else transformers.CONFIG_MAPPING["gemma4_text"](**text))
    auto = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    for name, seed in (("g", 0), ("h", 1)):
        torch.manual_seed(seed)
        auto.from_config(config).save_pretrained(tmp_path / name)
    g, h = tmp_path / "g", tmp_path / "h"
    with pytest.raises(ConfigError, match=rf"has {bound} .*; the plan puts its layer 2 at layer 0: llmtailor cannot move"):
        merge(plan(tmp_path / "p.yaml", {"slices": slices((g, (2, 3)), (g, (1, 2)), (g, (0, 1)), (g, (3, 6)))}),
              tmp_path / "out", format="model")
    assert not (tmp_path / "out").exists()
    out = merge(plan(tmp_path / "mix.yaml", {"slices": slices((g, (0, 2)), (h, (2, 6)))}), tmp_path / "mix", format="model")
    model, info = auto.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    other, name = load_file(h / "model.safetensors"), next(n for n in model.state_dict() if "layers.3.mlp.up_proj" in n)
    assert torch.equal(model.state_dict()[name], other[name])


def test_per_layer_inputs_a_config_json_leaves_to_its_class_default_still_bind_the_layers(tmp_path):
    """transformers 4.x wrote only the keys a config changed from its class's defaults: a gemma4
    with per-layer inputs of the default size (``hidden_size_per_layer_input`` 256) has none in its
    config.json, yet its model has them (transformers' class gives the default). Its layers are
    still bound to their places: a plan moving them is refused, as for a config that names the key.
    BEFORE: only the keys written were read, and the swap merged silently, each moved layer meeting
    another layer's per-layer input block."""
    from llmtailor.errors import ConfigError

    config = transformers.CONFIG_MAPPING["gemma4_text"](vocab_size=64, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                          layer_types=["sliding_attention", "full_attention"] * 2,
                                                          vocab_size_per_layer_input=64)
    assert config.hidden_size_per_layer_input == 256  # the class's default: per-layer inputs
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "g")
    saved = json.loads((tmp_path / "g" / "config.json").read_text())
    del saved["hidden_size_per_layer_input"]  # as transformers 4.x saved a default
    (tmp_path / "g" / "config.json").write_text(json.dumps(saved))
    g = tmp_path / "g"
    with pytest.raises(ConfigError, match=r"has per-layer inputs .*; the plan puts its layer 2 at layer 0: llmtailor "
                                          r"cannot move"):
        merge(plan(tmp_path / "p.yaml", {"slices": slices((g, (2, 3)), (g, (1, 2)), (g, (0, 1)), (g, (3, 4)))}),
              tmp_path / "out", format="model")
    assert not (tmp_path / "out").exists()
    out = merge(plan(tmp_path / "same.yaml", {"slices": slices((g, (0, 4)))}), tmp_path / "same", format="model")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
