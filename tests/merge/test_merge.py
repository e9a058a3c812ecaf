"""``llmtailor merge``: plans resolved into per-tensor actions, bitwise outputs, Parity / Filter
composites reproduced, HF sources and output, and bad plans refused with nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny, train
from safetensors.torch import load_file
from typer.testing import CliRunner

from llmtailor import Filter, Full, Parity, Tailor
from llmtailor.cli import app
from llmtailor.cli.merge import register
from llmtailor.errors import ConfigError
from llmtailor.interop.hf.export import export_hf
from llmtailor.merge import merge, open_plan
from llmtailor.store.run import Run

register(app)
runner = CliRunner()
HF_JOB = Path(__file__).parents[1] / "integrations" / "hf_job.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokens):
    """full/parity/filter: one training (4 layers), saved at steps 2, 4, 6 by three policies;
    wide: hidden size 64; hf/checkpoint-2: full@2 exported as a Trainer checkpoint."""
    root = tmp_path_factory.mktemp("merge")
    model, opt, sched = tiny()
    policies = {"full": Full(), "parity": Parity(), "filter": Filter(always=(0,), every=3)}
    tailors = [Tailor(root / name, model, opt, sched, policy=p) for name, p in policies.items()]
    for step in range(1, 7):
        train(model, opt, sched, tokens, [step])
        if step % 2 == 0:
            for t in tailors:
                t.save(step)
    wide = tiny(hidden=64)
    train(*wide, tokens, [1, 2])
    wide_tailor = Tailor(root / "wide", *wide)
    wide_tailor.save(2)
    for t in [*tailors, wide_tailor]:
        t.close()
    export_hf(Run(root / "full"), 2, root / "hf")
    return root


def write_plan(path: Path, plan: dict | str) -> Path:
    path.write_text(plan if isinstance(plan, str) else yaml.safe_dump(plan))
    return path


def layers(*ranges) -> list[dict]:
    return [{"sources": [{"model": str(model), "layer_range": list(r)}]} for model, r in ranges]


def expected_unit(source: Path, step: int, unit: str, dest_unit: str):
    """The source unit's tensors and values as the composite of ``step`` holds them, keys moved
    from ``layers.<j>.`` to ``layers.<i>.`` (plain string renaming, independent of the planner)."""
    run = Run(source)
    tensors, values = run.read_unit(run.resolve(step).sources[unit], unit)
    if unit == dest_unit:
        return tensors, values
    j, i = f"layers.{unit.split('.')[1]}.", f"layers.{dest_unit.split('.')[1]}."
    return {k.replace(j, i): t for k, t in tensors.items()}, {k.replace(j, i): v for k, v in values.items()}


def assert_unit_equal(out: Run, unit: str, expected) -> None:
    tensors, values = out.read_unit(out.resolve().step, unit)
    want_tensors, want_values = expected
    assert tensors.keys() == want_tensors.keys(), unit
    for key, tensor in want_tensors.items():
        assert tensors[key].dtype == tensor.dtype and torch.equal(tensors[key], tensor), f"{unit}: {key}"
    assert values == want_values, unit


def test_every_output_tensor_is_the_source_tensor_the_plan_names(root, tmp_path, tokens):
    full = root / "full"
    plan = write_plan(tmp_path / "swap.yaml", {
        "merge_method": "passthrough", "dtype": "float32", "base_model": f"{full}@6", "embed": f"{full}@2",
        "slices": layers((f"{full}@4", (2, 4)), (f"{full}@6", (0, 2))),
    })
    with open_plan(plan, tmp_path / "out") as planned:
        moved = [a for a in planned.actions if a.dest_unit == "layer.0"]
        assert {a.source_unit for a in moved} == {"layer.2"} and any(a.dest_key.startswith("optim/") for a in moved)
    result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    out = Run(tmp_path / "out")
    assert out.steps() == [6] and list(out.resolve().sources) == ["embed", *(f"layer.{i}" for i in range(4)), "norm", "head"]
    sources = {"embed": (2, "embed"), "layer.0": (4, "layer.2"), "layer.1": (4, "layer.3"), "layer.2": (6, "layer.0"),
               "layer.3": (6, "layer.1"), "norm": (6, "norm"), "head": (6, "head")}
    for unit, (step, source_unit) in sources.items():
        assert_unit_equal(out, unit, expected_unit(full, step, source_unit, unit))
    assert out.read_global(6)["optimizer_groups"] == Run(full).read_global(6)["optimizer_groups"]
    fresh = tiny(seed=5)
    assert Tailor(tmp_path / "out", *fresh).restore().step == 6  # loads into a live model and optimizer
    train(*fresh, tokens, [7])

    again = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out")])
    assert again.exit_code == 2 and "already holds snapshots (steps [6])" in again.output


@pytest.mark.parametrize("policy", ["parity", "filter"])
def test_a_plan_reproduces_the_composite_a_policy_assembles(root, tmp_path, policy):
    composite = Run(root / policy).resolve(6).sources
    assert len(set(composite.values())) > 1  # the policy did mix versions
    full = root / "full"
    plan = write_plan(tmp_path / f"{policy}.yaml", {
        "slices": layers(*((f"{full}@{composite[f'layer.{i}']}", (i, i + 1)) for i in range(4))),
        **{unit: f"{full}@{composite[unit]}" for unit in ("embed", "norm", "head")}, "state_from": f"{full}@6",
    })
    merge(plan, tmp_path / "out")
    out, reference = Run(tmp_path / "out"), Run(root / policy)
    for unit, step in composite.items():
        assert_unit_equal(out, unit, reference.read_unit(step, unit))


def test_published_llmtailor_form_with_an_hf_source_and_a_zero_width_slice(root):
    plan = write_plan(root / "published.yaml", {  # relative paths: against the plan's directory
        "slices": layers(("full@4", (0, 2)), ("hf/checkpoint-2", (2, 2)), ("hf/checkpoint-2", (2, 4))),
        "pre_weights": [{"name": "model.embed_tokens.weight", "model": "hf/checkpoint-2"}],
        "post_weights": [{"name": "model.norm.weight", "model": "full@4"}, {"name": "lm_head.weight", "model": "full@4"}],
        "merge_method": "passthrough", "tokenizer_source": "base",
    })
    with open_plan(plan, root / "published") as planned:
        assert any("zero-width layer_range [2, 2]" in w for w in planned.warnings)
        assert planned.step == 4 and planned.state_from == "full@4"
    result = runner.invoke(app, ["merge", str(plan), "-o", str(root / "published")])
    assert result.exit_code == 0 and "zero-width" in result.output, result.output
    assert not list(root.glob(".published.merge-*"))  # the imported HF source was removed
    out = Run(root / "published")
    hf = load_file(root / "hf" / "checkpoint-2" / "model.safetensors")
    for unit in ("embed", "layer.2", "layer.3"):
        tensors, _ = out.read_unit(4, unit)
        for key, tensor in tensors.items():
            if key.startswith("weight/"):
                assert torch.equal(tensor, hf[key.removeprefix("weight/")]), key
        assert_unit_equal(out, unit, expected_unit(root / "full", 2, unit, unit))  # HF round trip is exact
    for unit in ("layer.0", "layer.1", "norm", "head"):
        assert_unit_equal(out, unit, expected_unit(root / "full", 4, unit, unit))


def published_plan(shape: str, a: str, b: str, layers: int) -> dict:
    """The published LLMTailor example plans (examples/Qwen_cut.yaml, Llama_cut.yaml) as they
    are written, for two checkpoints A and B of a model of ``layers`` layers: a zero-width first
    slice, zero-width slices past the last layer, auxiliary weights by name (Llama_cut lists the
    embeddings under post_weights and the norm under pre_weights), ``dtype: bfloat16``."""
    def one(model, r):
        return {"sources": [{"model": model, "layer_range": list(r)}]}
    if shape == "Qwen_cut":  # one slice per layer, alternating B, A, B, ...
        middle = [one(b if i % 2 == 0 else a, (i, i + 1)) for i in range(layers)]
        aux = {"post_weights": [{"name": "lm_head.weight", "model": b}, {"name": "model.norm.weight", "model": a}],
               "pre_weights": [{"name": "model.embed_tokens.weight", "model": a}]}
    else:  # first half of the layers from A, the rest from B
        middle = [one(a, (0, layers // 2)), one(b, (layers // 2, layers))]
        aux = {"post_weights": [{"name": "lm_head.weight", "model": b}, {"name": "model.embed_tokens.weight", "model": a}],
               "pre_weights": [{"name": "model.norm.weight", "model": a}]}
    slices = [one(a, (0, 0)), *middle, one(b, (layers + 1, layers + 1)), one(a, (layers + 2, layers + 2))]
    return {"slices": slices, **aux, "merge_method": "passthrough", "dtype": "bfloat16"}


@pytest.mark.parametrize("shape", ["Qwen_cut", "Llama_cut"])
def test_published_llmtailor_plans_verbatim_on_fp32_trainer_checkpoints(root, tmp_path, shape):
    """``--format model`` writes no optimizer state, so the plans' ``dtype`` is theirs to use
    even though the checkpoints hold some; a resumable output still refuses the cast."""
    for step in (4, 6):
        export_hf(Run(root / "full"), step, tmp_path / "hf")
    a, b = tmp_path / "hf" / "checkpoint-4", tmp_path / "hf" / "checkpoint-6"
    plan = write_plan(tmp_path / f"{shape}.yaml", published_plan(shape, str(a), str(b), 4))
    result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "model"), "--format", "model"])
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "model" / "model.safetensors")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa["model.norm.weight"].dtype == torch.float32
    odd_from_a = shape == "Qwen_cut"
    for key, tensor in got.items():
        if ".layers." in key:
            i = int(key.split(".layers.")[1].split(".")[0])
            source = (wa if i % 2 == 1 else wb) if odd_from_a else (wa if i < 2 else wb)
        else:
            source = wb if key == "lm_head.weight" else wa
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, source[key].to(torch.bfloat16)), key
    assert len(got) == len(wa)
    refused = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "run")])
    assert refused.exit_code == 2 and "allowed only with optimizer: false or --format model" in " ".join(refused.output.split())
    assert not (tmp_path / "run").exists()


def test_weights_only_plan_may_drop_layers_and_drops_optimizer_state(root, tmp_path):
    plan = write_plan(tmp_path / "short.yaml", {"slices": layers((f"{root / 'full'}@6", (0, 3))), "optimizer": False})
    merge(plan, tmp_path / "out")
    out = Run(tmp_path / "out")
    assert out.resolve().sources.keys() == {"embed", "layer.0", "layer.1", "layer.2", "norm", "head"}
    assert all(k.startswith("weight/") for u in out.resolve().sources for k in out.read_unit(6, u)[0])
    state = out.read_global(6)
    assert state["optimizer_groups"] is None and state["model_config"]["num_hidden_layers"] == 3


BAD_PLANS = {
    "missing source": ({"slices": [("nope@6", (0, 4))]}, "nope: no such directory"),
    "beyond source": ({"slices": [("full@6", (2, 6))]}, "has 4 layers; layer_range [2, 6] names its layer 4"),
    "missing step": ({"slices": [("full@3", (0, 4))]}, "no committed snapshot at step 3"),
    "shape": ({"slices": [("full@6", (0, 2)), ("wide@2", (2, 4))]}, "differ in shape or dtype, e.g."),
    "unknown key": ({"slices": [("full@6", (0, 4))], "lora_rank": 8}, "unknown key 'lora_rank'"),
    "method": ({"slices": [("full@6", (0, 4))], "merge_method": "slerp"}, "only layer assembly (passthrough) is supported"),
    "dtype": ({"slices": [("full@6", (0, 4))], "dtype": "bfloat16"}, "allowed only with optimizer: false"),
    "scale": ({"slices": [("full@6", (0, 4))], "parameters": {"scale": 0.5}}, "scale 0.5"),
    "both forms": ({"slices": [("full@6", (0, 4))], "models": [{"model": "full@6"}]}, "give either 'slices' or 'models'"),
    "yaml": ("slices:\n  - sources: [{model: full@6, layer_range: [0, 4]\nmerge_method: passthrough\n", "malformed YAML at line"),
    # mergekit's keys that llmtailor does not take are named as mergekit's, with the way out.
    "chat_template": ({"slices": [("full@6", (0, 4))], "chat_template": "chatml"},
                      "mergekit's 'chat_template' is not supported by llmtailor merge"),
    "tokenizer padding": ({"slices": [("full@6", (0, 4))], "tokenizer": {"source": "base", "pad_to_multiple_of": 16}},
                          "['pad_to_multiple_of'] (mergekit's per-token embeddings and vocabulary padding) are not supported"),
    "lora reference": ({"slices": [("full@6+lora", (0, 4))]}, "mergekit's MODEL+LORA form (an adapter applied to a model) is not"),
}


@pytest.mark.parametrize("case", BAD_PLANS)
def test_bad_plans_are_one_clear_error_and_write_nothing(root, tmp_path, case):
    spec, message = BAD_PLANS[case]
    if isinstance(spec, dict):
        spec = {**spec, "slices": layers(*((root / m, r) for m, r in spec["slices"]))}
    plan = write_plan(tmp_path / "bad.yaml", spec)
    with pytest.raises(ConfigError, match=str(plan).replace(".", r"\.")):
        merge(plan, tmp_path / "out")
    result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert message in " ".join(result.output.split()), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def refusal(tmp_path: Path, spec: dict | str) -> str:
    """The one line the CLI prints for a bad plan (exit 2, nothing written), spaces normalised."""
    plan = write_plan(tmp_path / "bad.yaml", spec)
    result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]
    lines = result.output.splitlines()
    if lines[-1].strip().startswith("fix the plan"):  # what to do, under the cause
        lines.pop()
    return " ".join(" ".join(lines).split())


def test_a_missing_source_does_not_hide_the_plans_other_problems(root, tmp_path):
    message = refusal(tmp_path, {"slices": layers((root / "full@6", (0, 2)), (root / "nope", (0, 2)), (root / "full@6", (2, 6)))})
    assert "source '" in message and "nope: no such directory" in message
    assert "has 4 layers; layer_range [2, 6] names its layer 4" in message
    # Also when the plan itself is invalid: an unknown key, a missing source, a bad layer_range.
    message = refusal(tmp_path, {"slices": layers((root / "nope", (0, 2)), (root / "full@6", (3, 1))), "lora_rank": 8})
    assert "unknown key 'lora_rank'" in message and "nope': no such directory" in message
    assert "layer_range" in message and "with 0 <= a <= b" in message


def test_a_method_other_than_passthrough_is_the_first_problem_named(root, tmp_path):
    """A slerp plan as mergekit's README writes one: its unknown parameter and its two sources
    per slice follow from the method, which comes first."""
    full = str(root / "full@6")
    message = refusal(tmp_path, {
        "slices": [{"sources": [{"model": full, "layer_range": [0, 4]}, {"model": full, "layer_range": [0, 4]}]}],
        "merge_method": "slerp", "base_model": full, "parameters": {"t": [0, 0.5, 1]}, "dtype": "bfloat16",
    })
    first = message.split("invalid plan: ")[1]
    assert first.startswith("key 'merge_method': merge method 'slerp' is not supported"), message
    assert "unknown key 'parameters.t'" in message


def test_a_width_mismatch_is_one_short_line(root, tmp_path):
    message = refusal(tmp_path, {"slices": layers((root / "full@6", (0, 2)), (root / "wide@2", (2, 4)))})
    assert "wide@2' does not fit the state source" in message and "(and 3 more units like it)" in message
    assert "differ in shape or dtype, e.g. weight/model.layers.2." in message
    assert len(message) < 500, message


def test_the_cli_shows_bracketed_values_of_a_message(root, tmp_path):
    """rich markup must not eat ``[5, 2]`` (the escaping lives in llmtailor/cli/common.py)."""
    message = refusal(tmp_path, {"slices": layers((root / "full@6", (5, 2)))})
    assert "layer_range [5, 2] must be [a, b]" in message, message


def test_dry_run_lists_the_actions_and_writes_nothing(root, tmp_path):
    plan = write_plan(tmp_path / "p.yaml", {"slices": layers((root / "full@4", (0, 2)), (root / "full@6", (2, 4)))})
    result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "layer.1" in text and "tensors" in text and "step 6" in text
    verbose = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out"), "--dry-run", "--verbose"])
    assert verbose.exit_code == 0 and "optim/" in verbose.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_dry_run_at_80_columns_names_each_units_source_whole(root, tmp_path):
    """Two sources whose paths differ only at their end (two steps of one run): at 80 columns
    each row still names its whole source, folded over lines, never cut to the common prefix."""
    plan = write_plan(tmp_path / "p.yaml", {"slices": layers((root / "full@4", (0, 2)), (root / "full@6", (2, 4)))})
    for verbose in ([], ["--verbose"]):
        result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "out"), "--dry-run", *verbose],
                               env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        table = [line for line in result.output.splitlines() if line[:1] in "┏┃┡│└"]  # the title is a result line
        assert "…" not in result.output and max(map(len, table)) <= 80, result.output
        rows: list[list[str]] = []  # [destination unit, source] of each row, its cells' lines joined
        for line in result.output.splitlines():
            cells = [c.strip() for c in line.split("│")[1:-1]]
            if len(cells) == 4 and cells[0] != "destination unit":
                if cells[0] and (not verbose or cells[1].startswith(("weight/", "optim/"))):
                    rows.append([cells[0], cells[2]])
                else:
                    rows[-1][1] += cells[2]
        sources = {unit: source for unit, source in rows}
        assert sources["layer.1"] == str(root / "full@4") and sources["layer.2"] == str(root / "full@6"), rows


def hf_job(tmp_path: Path, name: str, *flags: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HF_JOB), "--out", str(tmp_path / name), "--result", str(tmp_path / f"{name}.json"),
         "--trainer", "vanilla", *flags],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.slow
def test_hf_output_of_hf_sources_resumes_in_vanilla_trainer(tmp_path):
    """Sources: two checkpoints of a vanilla Trainer run (so trainer_state.json is Trainer's);
    output: --format hf, resumed by a vanilla Trainer process whose loaded weights and
    optimizer state must be the merged ones."""
    hf_job(tmp_path, "train", "--max-steps", "6", "--save-steps", "2")
    plan = write_plan(tmp_path / "p.yaml", {"slices": layers(("train/checkpoint-4", (0, 2)), ("train/checkpoint-6", (2, 4)))})
    result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "hf"), "--format", "hf"])
    assert result.exit_code == 0, result.output
    assert not list(tmp_path.glob(".hf.merge-*"))  # imported sources and the temporary run are gone
    resumed = hf_job(tmp_path, "resume", "--resume", str(tmp_path / "hf" / "checkpoint-6"), "--max-steps", "8",
                     "--dump", str(tmp_path / "d.pt"))
    assert resumed["global_step"] == 8
    dump = torch.load(tmp_path / "d.pt", weights_only=True)
    assert dump["global_step"] == 6
    merge(plan, tmp_path / "tailored")
    out = Run(tmp_path / "tailored")
    checked = 0
    for unit in out.resolve().sources:
        for key, tensor in out.read_unit(6, unit)[0].items():
            assert torch.equal(dump["tensors"][key], tensor), key
            checked += 1
    assert checked == len(dump["tensors"])


def test_mergekits_model_reference_mappings_and_documents_are_read_or_named(root, tmp_path):
    """mergekit 0.1.5 reads a model as ``{model: PATH}`` or ``{model: {path: PATH}}`` too (the same
    merge: test_mergekit_parity); its parts llmtailor does not take, an older mergekit's
    ``{path: PATH}`` and mergekit-multi's several documents in one file are named."""
    full = str(root / "full@6")
    assert merge(write_plan(tmp_path / "ok.yaml", {"models": [{"model": {"model": {"path": full}}}],
                                                   "base_model": {"model": full}}), tmp_path / "ok").is_dir()
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    for model, message in [
        ({"model": full, "lora": "adapter"}, "a model with a lora (an adapter applied to it) is not supported"),
        ({"model": {"path": full, "revision": "main"}}, "a model's revision names a Hugging Face Hub version"),
        ({"path": full}, "{path: ...} is an older mergekit's form"),
        ({"model": full, "override_architecture": "LlamaForCausalLM"}, "['override_architecture'] of a model reference"),
    ]:
        assert message in refusal(tmp_path, {"models": [{"model": model}]}), model
        (tmp_path / "bad.yaml").unlink()
    two = f"name: first\nmodels: [{{model: {full}}}]\n---\nname: second\nmodels: [{{model: first}}]\n"
    assert "several YAML documents (mergekit-multi's form" in refusal(tmp_path, two)


def test_a_hugging_face_hub_id_as_a_source_is_named_with_the_way_in(tmp_path):
    """Plans copied from a model card name Hub models (``org/name``), which mergekit downloads:
    llmtailor reads local directories and runs, and says so, naming the download, whether the
    plan is otherwise valid or not."""
    hub = "meta-llama/Meta-Llama-3-8B-Instruct"
    for extra in ({}, {"dtype": "bf16"}):
        message = refusal(tmp_path, {"slices": [{"sources": [{"model": hub, "layer_range": [0, 16]}]}],
                                     "merge_method": "passthrough", **extra})
        assert f"source '{hub}'" in message and "a Hugging Face Hub model id" in message
        assert f"hf download {hub} --local-dir DIR" in message, message
        (tmp_path / "bad.yaml").unlink()


def test_an_invalid_plan_naming_a_run_on_an_object_store_is_one_clear_error(tmp_path):
    """A URL source is not looked for on the local disk while the plan's own problems are listed
    (it is opened, and checked, once the plan is valid)."""
    message = refusal(tmp_path, {"slices": [{"sources": [{"model": "s3://bucket/run@4", "layer_range": [0, 2]}]}],
                                 "lora_rank": 8})
    assert "unknown key 'lora_rank'" in message and "s3://" not in message.split("invalid plan:")[1]
