"""mergekit's meaning of a plan, with expectations derived by hand (the side-by-side run against
the real mergekit is test_mergekit_parity.py): casts before scales, filters on source names,
parameters reaching the embeddings and the head, gradients, tokenizer cuts (issue 19)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from llmtailor.merge import merge, open_plan

VOCAB = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """a, b: fp32 4-layer Llamas (save_pretrained), different weights; their state dicts."""
    root = tmp_path_factory.mktemp("semantics")
    made = {}
    for name, seed in (("a", 1), ("b", 2)):
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(root / name)
        made[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return root, made


def run(tmp_path: Path, spec: dict) -> dict[str, torch.Tensor]:
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"merge_method": "passthrough", **spec}))
    return load_file(merge(plan, tmp_path / "out", format="model") / "model.safetensors")


def one_slice(model: Path, layers=(0, 4), **source_keys) -> list[dict]:
    return [{"sources": [{"model": str(model), "layer_range": list(layers), **source_keys}]}]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_narrower_dtype_is_cast_before_the_scale(models, tmp_path):
    root, made = models
    got = run(tmp_path, {"slices": one_slice(root / "a"), "dtype": "bfloat16", "parameters": {"scale": 0.3}})
    source = made["a"]
    assert got.keys() == source.keys()
    for key, x in source.items():
        assert bits_equal(got[key], x.to(torch.bfloat16) * 0.3), key
    # The shape discriminates: scaling first, then casting, differs in some values by 1 ulp.
    assert sum(not torch.equal(x.to(torch.bfloat16) * 0.3, (x * 0.3).to(torch.bfloat16)) for x in source.values()) > 10


def test_dtype_bfloat16_with_out_dtype_float16_goes_through_bfloat16(models, tmp_path):
    root, made = models
    got = run(tmp_path, {"slices": one_slice(root / "a"), "dtype": "bfloat16", "out_dtype": "float16"})
    for key, x in made["a"].items():
        assert bits_equal(got[key], x.to(torch.bfloat16).to(torch.float16)), key
        if "norm" not in key:  # random weights (norms are all ones): the direct cast differs
            assert not torch.equal(got[key], x.to(torch.float16)), key


def test_a_slice_sources_filter_matches_the_source_tensor_name(models, tmp_path):
    """Output layers 0 and 1 are b's layers 2 and 3: ``layers.2.`` names b's layer 2."""
    root, made = models
    scale = {"scale": [{"filter": "layers.2.", "value": 0.5}, {"value": 2.0}]}
    got = run(tmp_path, {"slices": one_slice(root / "b", (2, 4), parameters=scale)})
    b = made["b"]
    for part in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
        assert bits_equal(got[f"model.layers.0.{part}"], b[f"model.layers.2.{part}"] * 0.5), part
        assert bits_equal(got[f"model.layers.1.{part}"], b[f"model.layers.3.{part}"] * 2.0), part


def test_filter_star_matches_every_tensor(models, tmp_path):
    root, made = models
    got = run(tmp_path, {"slices": one_slice(root / "a"), "parameters": {"scale": [{"filter": "*", "value": 0.5}]}})
    for key, x in made["a"].items():
        assert bits_equal(got[key], x * 0.5), key


def test_slice_and_source_scales_reach_the_embeddings_and_the_final_norm_and_head(models, tmp_path):
    """The embeddings take the first slice's parameters, the final norm and head the last
    slice's (its source's own before the slice's)."""
    root, made = models
    got = run(tmp_path, {"slices": [
        {"sources": [{"model": str(root / "a"), "layer_range": [0, 2]}], "parameters": {"scale": 0.5}},
        {"sources": [{"model": str(root / "b"), "layer_range": [2, 4], "parameters": {"scale": 3.0}}],
         "parameters": {"scale": 7.0}},
    ]})
    a, b = made["a"], made["b"]
    assert bits_equal(got["model.embed_tokens.weight"], a["model.embed_tokens.weight"] * 0.5)
    assert bits_equal(got["model.norm.weight"], b["model.norm.weight"] * 3.0)
    assert bits_equal(got["lm_head.weight"], b["lm_head.weight"] * 3.0)
    assert bits_equal(got["model.layers.1.mlp.up_proj.weight"], a["model.layers.1.mlp.up_proj.weight"] * 0.5)
    assert bits_equal(got["model.layers.3.mlp.up_proj.weight"], b["model.layers.3.mlp.up_proj.weight"] * 3.0)


def lerp(values: list[float], t: float) -> float:
    """mergekit's gradient at t: evenly spread values, linear in between."""
    x = t * (len(values) - 1)
    i = int(x)
    j = min(i + 1, len(values) - 1)
    return (1 - (x - i)) * values[i] + (x - i) * values[j]


def test_a_gradient_scale_is_interpolated_over_each_slices_layers(models, tmp_path):
    root, made = models
    got = run(tmp_path, {"slices": [
        {"sources": [{"model": str(root / "a"), "layer_range": [0, 3]}], "parameters": {"scale": [0.5, 1.0]}},
        {"sources": [{"model": str(root / "b"), "layer_range": [3, 4],
                      "parameters": {"scale": [{"filter": "mlp", "value": [0.25, 2.0, 1.0]}]}}]},
    ]})
    a, b = made["a"], made["b"]
    for i, t in enumerate((0.0, 0.5, 1.0)):  # layer i of a 3-layer slice sits at t = i / 2
        key = f"model.layers.{i}.self_attn.o_proj.weight"
        assert bits_equal(got[key], a[key] * lerp([0.5, 1.0], t)), key
    assert bits_equal(got["model.embed_tokens.weight"], a["model.embed_tokens.weight"] * 0.5)  # t = 0
    # A one-layer slice sits at t = 1; the filter leaves attention unscaled; the head is at t = 0.
    assert bits_equal(got["model.layers.3.mlp.up_proj.weight"], b["model.layers.3.mlp.up_proj.weight"] * 1.0)
    assert torch.equal(got["model.layers.3.self_attn.o_proj.weight"], b["model.layers.3.self_attn.o_proj.weight"])
    assert torch.equal(got["lm_head.weight"], b["lm_head.weight"])


def test_a_gradient_in_the_models_form_runs_over_the_whole_model(models, tmp_path):
    root, made = models
    got = run(tmp_path, {"models": [{"model": str(root / "a"), "parameters": {"scale": [0.2, 1.0, 0.6]}}]})
    a = made["a"]
    for i in range(4):
        key = f"model.layers.{i}.mlp.gate_proj.weight"
        assert bits_equal(got[key], a[key] * lerp([0.2, 1.0, 0.6], i / 3)), key
    assert bits_equal(got["model.norm.weight"], a["model.norm.weight"] * 0.2)


def test_the_dry_run_shows_each_tensors_cast_and_scale(models, tmp_path):
    root, _ = models
    plan = tmp_path / "p.yaml"
    plan.write_text(yaml.safe_dump({"slices": one_slice(root / "a", (0, 2)), "dtype": "bfloat16", "out_dtype": "float16",
                                    "parameters": {"scale": [0.5, 1.0]}}))
    with open_plan(plan, tmp_path / "out") as planned:
        by_key = {a.dest_key: a for a in planned.actions}
    assert by_key["weight/model.layers.0.mlp.up_proj.weight"].describe() == "as bfloat16, scale 0.5, to float16"
    assert by_key["weight/model.layers.1.mlp.up_proj.weight"].describe() == "as bfloat16, to float16"  # t = 1: scale 1.0


def save_tokenizer(path: Path, tokens: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)


WORDS = ["[UNK]", "[PAD]", *"abcdefghij"]  # 12 tokens; the models' embeddings have 64 rows


@pytest.mark.parametrize("spelling", [{"tokenizer_source": "base"}, {"tokenizer": {"source": "base"}}])
def test_a_tokenizer_smaller_than_the_embedding_cuts_its_rows_and_sets_vocab_size(models, tmp_path, spelling):
    """Qwen2.5's shape: the embedding padded past the tokenizer. mergekit keeps one row per
    token (embeddings from the first slice's model, LM head from the last's); its ``tokenizer:
    {source: ...}`` block means the same."""
    root, made = models
    for name in ("a", "b"):
        save_tokenizer(root / name, WORDS)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"slices": one_slice(root / "a", (0, 2)) + one_slice(root / "b", (2, 4)),
                                    **spelling, "dtype": "bfloat16"}))
    out = merge(plan, tmp_path / "out", format="model")
    got = load_file(out / "model.safetensors")
    assert bits_equal(got["model.embed_tokens.weight"], made["a"]["model.embed_tokens.weight"][:12].to(torch.bfloat16))
    assert bits_equal(got["lm_head.weight"], made["b"]["lm_head.weight"][:12].to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 12
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert transformers.AutoTokenizer.from_pretrained(out)("a j")["input_ids"] == [2, 11]


def test_a_cut_with_optimizer_state_is_refused(tmp_path, tokens):
    """Moments computed for 256 rows cannot follow a cut to the tokenizer's 12 silently."""
    from helpers import tiny, train

    from llmtailor import Tailor
    from llmtailor.errors import ConfigError
    from llmtailor.interop.hf.export import export_hf
    from llmtailor.store.run import Run

    model, optimizer, scheduler = tiny(layers=2)
    train(model, optimizer, scheduler, tokens, [1])
    with Tailor(tmp_path / "run", model, optimizer, scheduler) as tailor:
        tailor.save(1)
    checkpoint = export_hf(Run(tmp_path / "run"), 1, tmp_path / "hf")
    save_tokenizer(checkpoint, WORDS)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"models": [{"model": str(checkpoint)}], "tokenizer_source": "base"}))
    with pytest.raises(ConfigError, match="tokenizer_source would change weights .*12 vocabulary rows.* --format model"):
        merge(plan, tmp_path / "out", format="hf")
    assert not (tmp_path / "out").exists()
    got = load_file(merge(plan, tmp_path / "model", format="model") / "model.safetensors")  # weights only: cut
    assert got["model.embed_tokens.weight"].shape[0] == 12


@pytest.mark.parametrize("format", ["tailor", "hf", "model"])
def test_tokenizer_source_union_is_refused_while_planning_in_every_format(models, tmp_path, format):
    from llmtailor.errors import ConfigError

    root, _ = models
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"slices": one_slice(root / "a"), "tokenizer_source": "union"}))
    with pytest.raises(ConfigError, match="tokenizer_source 'union' .* is not supported"):
        with open_plan(plan, tmp_path / "out", format):
            pass
    with pytest.raises(ConfigError, match="union"):
        merge(plan, tmp_path / "out", format=format)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]
