"""Layouts of tiny real transformers models (built from configs, nothing downloaded)."""

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from llmtailor.constants import EMBED, HEAD, NORM, OTHER, layer_unit
from llmtailor.errors import ConfigError, TailorError
from llmtailor.layouts import FamilySpec, Layout, build_layout, list_families, load_family

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
LLAMA_LIKE = dict(embed=("model.embed_tokens.weight",), layer="model.layers.", norm=("model.norm.weight",))

# family -> (config, expected embed names, layer name prefix, norm names, untied head name or None)
CASES = {
    "llama": (transformers.LlamaConfig(**TINY), *LLAMA_LIKE.values(), "lm_head.weight"),
    "qwen2": (transformers.Qwen2Config(**TINY), *LLAMA_LIKE.values(), "lm_head.weight"),
    "qwen3": (transformers.Qwen3Config(**TINY, head_dim=8), *LLAMA_LIKE.values(), "lm_head.weight"),
    "mistral": (transformers.MistralConfig(**TINY), *LLAMA_LIKE.values(), "lm_head.weight"),
    "gemma": (transformers.GemmaConfig(**TINY, head_dim=8), *LLAMA_LIKE.values(), None),
    "gemma2": (transformers.Gemma2Config(**TINY, head_dim=8), *LLAMA_LIKE.values(), None),
    "phi3": (transformers.Phi3Config(**TINY, pad_token_id=0), *LLAMA_LIKE.values(), "lm_head.weight"),
    "gpt2": (transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32),
             ("transformer.wte.weight", "transformer.wpe.weight"), "transformer.h.",
             ("transformer.ln_f.weight", "transformer.ln_f.bias"), None),
    "gpt_neox": (transformers.GPTNeoXConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=2,
                                            max_position_embeddings=32),
                 ("gpt_neox.embed_in.weight",), "gpt_neox.layers.",
                 ("gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias"), "lm_head.weight"),
}


def tiny(family: str, **overrides) -> torch.nn.Module:
    config = CASES[family][0]
    config = type(config)(**{**config.to_dict(), **overrides}) if overrides else config
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


class Wrapper(torch.nn.Module):
    """Stands in for DDP / DeepSpeed engines, which hold the model as ``.module``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


@pytest.mark.parametrize("family", CASES)
def test_family_maps_expected_units(family):
    _, embed, layer_prefix, norm, head = CASES[family]
    model = tiny(family)
    layout = build_layout(model)
    names = list(model.state_dict())

    assert layout.family == family
    assert list(layout.units) == [EMBED, layer_unit(0), layer_unit(1), NORM] + ([HEAD] if head else [])
    assert layout.units[EMBED] == embed and layout.units[NORM] == norm
    assert OTHER not in layout.units
    for i in range(2):
        assert layout.units[layer_unit(i)] == tuple(n for n in names if n.startswith(f"{layer_prefix}{i}."))
    if head:
        assert layout.units[HEAD] == (head,) and layout.aliases == {}
    else:  # tied by default: the head is the embedding, stored once
        assert layout.aliases == {"lm_head.weight": embed[0]}
        assert layout.unit_of("lm_head.weight") == EMBED
    assert layout.num_layers == 2 and layout.layer_units() == [layer_unit(0), layer_unit(1)]
    assert layout.aux_units() == [u for u in layout.units if not u.startswith("layer.")]
    assert sorted(layout.tensor_names()) == sorted(set(names) - set(layout.aliases))


def test_qwen2_tied_and_untied():
    tied = build_layout(tiny("qwen2", tie_word_embeddings=True))
    assert HEAD not in tied.units
    assert tied.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied.unit_of("lm_head.weight") == tied.unit_of("model.embed_tokens.weight") == EMBED

    untied = build_layout(tiny("qwen2", tie_word_embeddings=False))
    assert untied.units[HEAD] == ("lm_head.weight",) and untied.aliases == {}
    assert tied.diff(untied) == ["unit head extra (1 tensors)"]


def test_unknown_module_uses_generic_fallback():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)  # a layer's own norm stays in its layer

    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(8, 4)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.final_norm = torch.nn.LayerNorm(4)
            self.value_head = torch.nn.Linear(4, 1)  # matches no pattern
            self.register_buffer("step_scale", torch.ones(1))  # persistent buffers count too

    layout = build_layout(Custom())
    assert layout.family == "generic"
    assert list(layout.units) == [EMBED, *(layer_unit(i) for i in range(3)), NORM, OTHER]
    assert layout.units[layer_unit(1)] == tuple(f"blocks.1.{n}" for n in Block().state_dict())
    assert layout.units[OTHER] == ("step_scale", "value_head.weight", "value_head.bias")  # model order


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "base_model.model."])
def test_wrapped_model_maps_same_units(prefix):
    model = tiny("llama")
    wrapped = model
    for attr in reversed(prefix.rstrip(".").split(".")):
        wrapped = Wrapper(wrapped)
        wrapped._modules[attr] = wrapped._modules.pop("module")
    plain, outer = build_layout(model), build_layout(wrapped)
    assert outer.family == "llama"
    assert {u: tuple(n.removeprefix(prefix) for n in names) for u, names in outer.units.items()} == plain.units


def test_bare_base_model_uses_family_patterns():
    layout = build_layout(tiny("llama").model)  # LlamaModel: embed_tokens.weight, layers.0.…, norm.weight
    assert layout.family == "llama"
    assert list(layout.units) == [EMBED, layer_unit(0), layer_unit(1), NORM]
    assert layout.units[EMBED] == ("embed_tokens.weight",)


def test_record_round_trip():
    layout = build_layout(tiny("gemma"))
    record = json.loads(json.dumps(layout.to_record()))
    assert Layout.from_record(record) == layout
    assert Layout.from_record(record).diff(layout) == []
    shuffled = {**record, "units": dict(reversed(record["units"].items()))}
    assert list(Layout.from_record(shuffled).units) == list(layout.units)


@pytest.mark.parametrize("change, bad_key", [
    (lambda r: r.update(extra=1), "'extra'"),
    (lambda r: r.pop("units"), "'units'"),
    (lambda r: r["units"].update({"layer.x": ["w"]}), "'layer.x'"),
    (lambda r: r["aliases"].update({"tied.weight": "missing.weight"}), "'tied.weight'"),
])
def test_from_record_names_bad_key(change, bad_key):
    record = build_layout(tiny("llama")).to_record()
    change(record)
    with pytest.raises(ConfigError, match=bad_key):
        Layout.from_record(record)


def test_diff_reports_missing_layer():
    full = build_layout(tiny("llama"))
    record = full.to_record()
    del record["units"]["layer.1"]
    lines = full.diff(Layout.from_record(record))
    assert lines == [f"unit layer.1 missing ({len(full.units['layer.1'])} tensors)"]

    record = full.to_record()
    record["units"]["layer.0"].remove("model.layers.0.mlp.up_proj.weight")
    record["units"]["norm"].append("model.layers.0.mlp.up_proj.weight")
    assert full.diff(Layout.from_record(record)) == [
        "tensor 'model.layers.0.mlp.up_proj.weight' moved from unit layer.0 to norm"]


def test_unknown_names_and_families_raise():
    layout = build_layout(tiny("llama"))
    with pytest.raises(TailorError, match="no.such.weight") as raised:
        layout.unit_of("no.such.weight")
    assert isinstance(raised.value, KeyError)
    with pytest.raises(ConfigError, match="known families: .*llama"):
        build_layout(tiny("llama"), family="falcon9")
    assert build_layout(tiny("llama"), family="generic").units == layout.units


def test_shipped_families_are_valid_and_unambiguous():
    assert set(CASES) | {"generic"} == set(list_families())
    model_types = [t for name in list_families() for t in load_family(name).model_types]
    assert len(model_types) == len(set(model_types))
    assert load_family("gpt_neox").head == ("lm_head.", "embed_out.")  # transformers 4 name kept


def test_family_file_errors_name_file_and_key(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"family": "mine", "layer": ["blocks."], "heads": ["lm_head."]}))
    with pytest.raises(ConfigError, match=r"mine\.json.*'layer'.*\{i\}.*'heads'"):
        FamilySpec.from_json(path)
    path.write_text(json.dumps({"family": "other"}))
    with pytest.raises(ConfigError, match="'family'"):
        FamilySpec.from_json(path)
