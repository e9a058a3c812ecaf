"""What mergekit makes of a plan, llmtailor makes bit for bit: every plan below runs through the
real mergekit 0.1.5 (in its own venv, ``make mergekit``: ``.venv-mergekit/``) and through
``llmtailor merge --format model`` on the same inputs, and the outputs' tensors (names, dtypes,
shapes, bytes) and config (depth, vocabulary size, dtype) must be equal.

Inputs are built here from transformers configs, never downloaded: ``save_pretrained``
directories (single file and sharded, fp32 and bf16, tied, gpt2; ``pytorch_model.bin`` sharded and
tied (qwen2, llama: its head into a tied model), as transformers 4 wrote them) with a tokenizer smaller than
their embedding, and Trainer ``checkpoint-N/`` directories of a tailored run.

mergekit's python is ``$LLMTAILOR_MERGEKIT`` (``make test`` sets it, and then a missing one is an
error), else ``.venv-mergekit/bin/python`` where it exists; without either the module is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from helpers import save_bin, tiny, train
from safetensors.torch import load_file

from llmtailor import Full, Tailor
from llmtailor.interop.hf.export import export_hf
from llmtailor.merge import merge
from llmtailor.store.run import Run

REPO = Path(__file__).parents[2]
DRIVER = Path(__file__).with_name("mergekit_driver.py")
_ENV = os.environ.get("LLMTAILOR_MERGEKIT")
MERGEKIT = Path(_ENV) if _ENV else REPO / ".venv-mergekit" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _ENV and not MERGEKIT.is_file(), reason="no mergekit venv: run `make mergekit` (make test does)"),
]

VOCAB, TOKENS = 64, 12  # embedding rows; the tokenizer's tokens (fewer, as in Qwen2.5's checkpoints)


def save_model(path: Path, family: str, layers: int, seed: int, *, dtype=torch.float32, tie=False, shard=None) -> None:
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=4)
    else:
        classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
        config = classes[family](vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)


def save_tokenizer(path: Path, tokens: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokens) -> Path:
    root = tmp_path_factory.mktemp("parity-inputs")
    words = ["[UNK]", "[PAD]", *"abcdefghij"]
    assert len(words) == TOKENS
    for name, family, layers, seed, kwargs in [
        ("a", "llama", 4, 1, {}), ("b", "llama", 4, 2, {"shard": "20KB"}), ("half", "llama", 4, 3, {"dtype": torch.bfloat16}),
        ("tied", "qwen2", 4, 4, {"tie": True}), ("gpt2", "gpt2", 6, 5, {}), ("q", "qwen2", 4, 7, {}),
        ("tied-llama", "llama", 4, 8, {"tie": True}), ("tied-llama-2", "llama", 4, 9, {"tie": True}),
    ]:
        save_model(root / name, family, layers, seed, **kwargs)
        save_tokenizer(root / name, words)
    # As transformers 4 wrote safe_serialization=False: sharded with an index, and tied (both names in the file).
    for name, source, shards in (("bin-sharded", "a", 3), ("bin-tied", "tied", 1), ("bin-tied-llama", "tied-llama-2", 1)):
        save_bin(root / name, transformers.AutoModelForCausalLM.from_pretrained(root / source), shards)
    # Another tokenizer: some of a's tokens at other ids, one token a's lacks.
    save_model(root / "c", "llama", 4, 6)
    save_tokenizer(root / "c", ["[UNK]", "[PAD]", "j", "i", "x", *"abcdefgh"])
    # Trainer checkpoints (fp32, with AdamW state) of a tailored run, as LLMTailor's users have them.
    model, optimizer, scheduler = tiny(layers=6)
    with Tailor(root / "run", model, optimizer, scheduler, policy=Full()) as tailor:
        for step in (1, 2, 3):
            train(model, optimizer, scheduler, tokens, [step])
            if step > 1:
                tailor.save(step)
    for step in (2, 3):
        checkpoint = export_hf(Run(root / "run"), step, root / "hf")
        config = json.loads((checkpoint / "config.json").read_text())
        config["architectures"] = [type(model).__name__]  # as Trainer's save_pretrained writes it
        (checkpoint / "config.json").write_text(json.dumps(config))
    return root


def stack(*ranges, **slice_keys) -> list[dict]:
    return [{"sources": [{"model": model, "layer_range": list(r)}], **slice_keys} for model, r in ranges]


def llmtailor_shape(first: str, second: str, layers: int) -> list[dict]:
    """The published LLMTailor plans' slices: a zero-width first slice, one slice per layer
    alternating between two checkpoints, zero-width slices past the last layer."""
    pick = [first, second]
    return (stack((first, (0, 0))) + [s for i in range(layers) for s in stack((pick[i % 2], (i, i + 1)))]
            + stack((second, (layers + 1, layers + 1)), (first, (layers + 2, layers + 2))))


O_PROJ_HALF = {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]}
PLANS = {  # name: the plan, model labels standing for directories of `inputs`
    "stack": {"slices": stack(("a", (0, 2)), ("b", (2, 4)))},
    "overlap": {"slices": stack(("a", (0, 3)), ("b", (1, 4)))},
    "models form, filtered scale, cast": {"models": [{"model": "a", "parameters": O_PROJ_HALF}], "dtype": "bfloat16"},
    "cast then scale": {"slices": stack(("a", (0, 4))), "dtype": "bfloat16", "parameters": {"scale": 0.3}},
    "bf16 to fp16": {"slices": stack(("a", (0, 4))), "dtype": "bfloat16", "out_dtype": "float16"},
    "bf16 to fp16, scaled": {"slices": stack(("a", (0, 4))), "dtype": "bfloat16", "out_dtype": "float16",
                             "parameters": {"scale": 0.7}},
    "out_dtype only, scaled": {"slices": stack(("a", (0, 4))), "out_dtype": "bfloat16", "parameters": {"scale": 0.3}},
    "bf16 source to fp32, scaled": {"slices": stack(("half", (0, 4))), "dtype": "float32", "parameters": {"scale": 0.3}},
    "filter names the source tensor": {"slices": [{"sources": [{"model": "b", "layer_range": [2, 4], "parameters": {
        "scale": [{"filter": "layers.2.", "value": 0.5}, {"value": 2.0}]}}]}]},
    "filter star": {"slices": stack(("a", (0, 4))), "parameters": {"scale": [{"filter": "*", "value": 0.5}]}},
    "slice and source scale reach embed, norm, head": {"slices": [
        {"sources": [{"model": "a", "layer_range": [0, 2]}], "parameters": {"scale": 0.5}},
        {"sources": [{"model": "b", "layer_range": [2, 4], "parameters": {"scale": 3.0}}]},
    ]},
    "gradient scale": {"slices": [
        {"sources": [{"model": "a", "layer_range": [0, 4]}], "parameters": {"scale": [0.5, 1.0]}},
        {"sources": [{"model": "b", "layer_range": [0, 3],
                      "parameters": {"scale": [{"filter": "mlp", "value": [1.0, 0.25, 2.0]}, {"value": 0.75}]}}]},
        {"sources": [{"model": "b", "layer_range": [3, 4]}], "parameters": {"scale": [0.1, 0.2]}},
    ]},
    "gradient scale, models form": {"models": [{"model": "a", "parameters": {"scale": [0.2, 1.0, 0.6]}}]},
    "tokenizer_source base cuts the embedding": {"slices": stack(("a", (0, 2)), ("b", (2, 4))), "tokenizer_source": "base",
                                                 "base_model": "a"},
    "tokenizer block, source base": {"slices": stack(("a", (0, 2)), ("b", (2, 4))), "tokenizer": {"source": "base"},
                                     "base_model": "a"},
    "tokenizer_source a model": {"slices": stack(("b", (0, 4))), "tokenizer_source": "a", "dtype": "bfloat16",
                                 "parameters": {"scale": 0.5}},
    "tokenizer_source re-maps tokens": {"slices": stack(("a", (0, 2)), ("b", (2, 4))), "tokenizer_source": "c",
                                       "parameters": {"scale": -0.5}},
    # (same depth: mergekit 0.1.5 cannot change a qwen2's depth, its config's layer_types stay as they were)
    "qwen2 with biases, filter on bias": {"slices": stack(("q", (2, 4)), ("q", (0, 2))),
                                          "parameters": {"scale": [{"filter": "bias", "value": 0.5}, {"value": 1.25}]}},
    "sharded source, a cut": {"slices": stack(("b", (1, 3)))},
    "bf16 source, out_dtype float32": {"models": [{"model": "half"}], "out_dtype": "float32"},
    "bf16 source, dtype float16, gradient": {"slices": stack(("half", (0, 4)), parameters={"scale": [2.0, 0.5]}),
                                             "dtype": "float16"},
    "tied": {"models": [{"model": "tied", "parameters": {"scale": 0.5}}]},
    "pytorch_model.bin shards, a cut": {"slices": stack(("bin-sharded", (1, 3)), ("a", (3, 4)))},
    "pytorch_model.bin tied, scaled": {"models": [{"model": "bin-tied", "parameters": {"scale": 0.5}}]},
    # A tied llama's head from a .bin (both names in it) into a tied model, as the last slice's
    # source (named in post_weights, from another model than the embedding's, it is refused:
    # test_merge_sources; mergekit 0.1.5 ignores post_weights).
    "pytorch_model.bin tied llama, last slice of a tied model": {"slices": stack(("tied-llama", (0, 2)), ("bin-tied-llama", (2, 4)))},
    "pytorch_model.bin tied llama, first slice, scaled": {"slices": stack(("bin-tied-llama", (0, 3)), ("tied-llama", (3, 4))),
                                                          "parameters": {"scale": 0.5}},
    # mergekit's ModelReference as a mapping ({model: PATH} or {model: {path: PATH}}), as 0.1.5 reads it
    "model references as mappings": {"slices": [{"sources": [{"model": {"model": {"path": "a"}}, "layer_range": [0, 2]}]},
                                                {"sources": [{"model": {"model": "b"}, "layer_range": [2, 4]}]}],
                                     "base_model": {"model": "b"}},
    "gpt2 cut": {"slices": stack(("gpt2", (0, 3)), ("gpt2", (4, 6))), "parameters": {"scale": [1.0, 0.5]}},
    "Trainer checkpoints, LLMTailor's shape": {
        "slices": llmtailor_shape("hf/checkpoint-2", "hf/checkpoint-3", 6), "dtype": "bfloat16",
        "pre_weights": [{"name": "model.embed_tokens.weight", "model": "hf/checkpoint-2"}],  # as mergekit takes them
        "post_weights": [{"name": "model.norm.weight", "model": "hf/checkpoint-2"},
                         {"name": "lm_head.weight", "model": "hf/checkpoint-2"}],
    },
}
MODEL_KEYS = ("model", "base_model", "tokenizer_source", "path")


def resolve(node, root: Path):
    """The plan with its model labels as absolute paths (mergekit reads paths against its cwd)."""
    if isinstance(node, dict):
        return {k: str(root / v) if k in MODEL_KEYS and isinstance(v, str) and v not in ("base", "union")
                else resolve(v, root) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, root) for v in node]
    return node


@pytest.fixture(scope="module")
def mergekit_outputs(inputs, tmp_path_factory) -> tuple[Path, dict[str, str | None]]:
    """Every plan merged by mergekit in one process; (plan directory, plan file -> error or None)."""
    if not MERGEKIT.is_file():
        pytest.fail(f"LLMTAILOR_MERGEKIT={MERGEKIT} does not exist: run `make mergekit`")
    work = tmp_path_factory.mktemp("parity")
    jobs = []
    for i, (name, spec) in enumerate(PLANS.items()):
        plan = work / f"plan{i}.yaml"
        plan.write_text(yaml.safe_dump({"merge_method": "passthrough", **resolve(spec, inputs)}))
        jobs.append([str(plan), str(work / f"mergekit{i}")])
    (work / "jobs.json").write_text(json.dumps(jobs))
    # A fixed hash seed: mergekit orders referenced models through a set.
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(MERGEKIT), str(DRIVER), str(work / "jobs.json"), str(work / "results.json")],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return work, json.loads((work / "results.json").read_text())


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def config_facts(directory: Path) -> dict:
    config = transformers.AutoConfig.from_pretrained(directory)
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    return {"layers": layers, "vocab_size": config.vocab_size, "dtype": str(config.dtype).removeprefix("torch.")}


@pytest.mark.parametrize("name", PLANS)
def test_llmtailor_makes_what_mergekit_makes(name, mergekit_outputs, tmp_path):
    work, results = mergekit_outputs
    i = list(PLANS).index(name)
    plan, theirs = work / f"plan{i}.yaml", work / f"mergekit{i}"
    assert results[str(plan)] is None, f"mergekit refused the plan: {results[str(plan)]}"
    ours = merge(plan, tmp_path / "ours", format="model")
    want, got = tensors(theirs), tensors(ours)
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
              or not torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ, e.g. {differ[:4]}"
    assert config_facts(ours) == config_facts(theirs)
