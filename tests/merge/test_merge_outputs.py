"""A merge writes through its output's sink (issue 31): ``--format hf`` and ``--format model``
write nothing but the output (no scratch run: peak disk is the output), and weights over
``--max-shard-size`` as shards with an index that transformers loads bit for bit; ``assemble
--format hf`` shards alike."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from helpers import tiny, train
from safetensors import safe_open
from typer.testing import CliRunner

from llmtailor import Full, Tailor
from llmtailor.cli import app
from llmtailor.merge import merge
from llmtailor.store.run import Run

runner = CliRunner()
SHARD = 100_000  # bytes: the run's weights (about 0.6 MB) take several shards


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokens) -> Path:
    """A tailored run (Full, saved at step 2) of a 4-layer Llama of hidden size 64, with AdamW state."""
    root = tmp_path_factory.mktemp("trained")
    model, optimizer, scheduler = tiny(hidden=64)
    with Tailor(root / "run", model, optimizer, scheduler, policy=Full()) as tailor:
        train(model, optimizer, scheduler, tokens, [1, 2])
        tailor.save(2)
    return root / "run"


def stack_plan(path: Path, run: Path) -> Path:
    """Layers 0-2 then 1-3 of ``run``: a 6-layer model, layers 1 and 2 twice, with their moments."""
    spec = {"slices": [{"sources": [{"model": f"{run}@2", "layer_range": r}]} for r in ([0, 3], [1, 4])]}
    path.write_text(yaml.safe_dump(spec))
    return path


def stacked_weights(run: Path) -> dict[str, torch.Tensor]:
    """The weights the stack plan's output holds, read from the run independently of the merge."""
    source = Run(run)
    out = {}
    for unit in source.resolve(2).sources:
        for key, tensor in source.read_unit(2, unit)[0].items():
            if key.startswith("weight/"):
                out[key.removeprefix("weight/")] = tensor
    layer = re.compile(r"model\.layers\.(\d+)\.")
    stacked = {k: t for k, t in out.items() if not layer.match(k)}
    for i, j in enumerate([0, 1, 2, 1, 2, 3]):
        stacked.update({layer.sub(f"model.layers.{i}.", k): t for k, t in out.items() if layer.match(k) and
                        int(layer.match(k).group(1)) == j})
    return stacked


@pytest.fixture
def made_directories(monkeypatch):
    """Every directory created while the test runs (``os.mkdir`` is what ``mkdir`` and
    ``mkdtemp`` call)."""
    made: list[Path] = []
    real = os.mkdir

    def recording(path, *args, **kwargs):
        made.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", recording)
    return made


@pytest.fixture
def no_run_written(monkeypatch):
    """A merge into a model directory or a Trainer checkpoint writes no run on the way."""
    from llmtailor.outputs.run import RunSink

    def refuse(*args, **kwargs):
        raise AssertionError("a run was written")

    monkeypatch.setattr(RunSink, "write", refuse)


def only_the_output_and_its_temporary_directory(made: list[Path], target: Path, where: Path) -> list[Path]:
    """The directories of ``made`` in ``where`` that are neither the output's own temporary
    directory (and what is in it) nor the output's parents."""
    own = f".{target.name}.tmp-"
    return [p for p in made if p.is_relative_to(where) and not any(part.startswith(own) for part in p.parts)
            and not target.is_relative_to(p)]


@pytest.mark.parametrize("form", ["hf", "model"])
def test_an_hf_or_model_merge_writes_nothing_but_its_output(trained, tmp_path, made_directories, no_run_written, form):
    """Peak disk is the output: no directory but the output's own temporary one appears (the
    merge once wrote the whole merge into a scratch run beside it and read it back)."""
    target = merge(stack_plan(tmp_path / "p.yaml", trained), tmp_path / "out" / form, format=form)
    assert target == (tmp_path / "out" / "hf" / "checkpoint-2" if form == "hf" else tmp_path / "out" / "model")
    assert made_directories and not only_the_output_and_its_temporary_directory(made_directories, target, tmp_path)
    assert not [p for p in made_directories if p.name == "snapshots"]
    assert (target / "model.safetensors").is_file() and not (target / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def assert_sharded_and_loaded_bit_for_bit(directory: Path, expected: dict[str, torch.Tensor], max_size: int) -> None:
    """``directory`` holds its weights as shards named as save_pretrained names them, each at
    most ``max_size`` bytes of tensor data (a larger tensor alone), an index naming every one,
    and from_pretrained loads exactly ``expected``."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (directory / "model.safetensors").exists()
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert files == sorted(p.name for p in directory.glob("model-*.safetensors"))
    total = 0
    for file in files:
        with safe_open(str(directory / file), "pt") as handle:
            sizes = [handle.get_slice(k).get_shape() for k in handle.keys()]
            nbytes = sum(torch.Size(s).numel() * 4 for s in sizes)  # float32 weights
            assert sorted(handle.keys()) == sorted(k for k, f in index["weight_map"].items() if f == file)
        assert nbytes <= max_size or len(sizes) == 1, (file, nbytes)
        total += nbytes
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(expected)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("form", ["hf", "model"])
def test_weights_over_max_shard_size_are_shards_from_pretrained_loads(trained, tmp_path, made_directories, no_run_written,
                                                                       form):
    target = merge(stack_plan(tmp_path / "p.yaml", trained), tmp_path / form, format=form, max_shard_size="100KB")
    assert not only_the_output_and_its_temporary_directory(made_directories, target, tmp_path)
    assert_sharded_and_loaded_bit_for_bit(target, stacked_weights(trained), SHARD)
    if form == "hf":  # Trainer's own loader of a sharded checkpoint takes it, and its optimizer.pt is there
        from transformers.trainer_utils import load_sharded_checkpoint

        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(target))
        load_sharded_checkpoint(model, str(target))
        assert (target / "optimizer.pt").is_file() and (target / "scheduler.pt").is_file()


def test_the_cli_takes_max_shard_size_and_refuses_a_bad_one(trained, tmp_path):
    plan = stack_plan(tmp_path / "p.yaml", trained)
    result = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "m"), "--format", "model", "--max-shard-size", "100KB"])
    assert result.exit_code == 0, result.output
    assert_sharded_and_loaded_bit_for_bit(tmp_path / "m", stacked_weights(trained), SHARD)
    bad = runner.invoke(app, ["merge", str(plan), "-o", str(tmp_path / "n"), "--format", "model", "--max-shard-size", "5XB"])
    assert bad.exit_code == 2 and "--max-shard-size: '5XB' is not a size" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "n").exists()


def test_assemble_hf_shards_a_composite_over_max_shard_size(trained, tmp_path):
    result = runner.invoke(app, ["assemble", str(trained), "--format", "hf", "-o", str(tmp_path / "hf"),
                                 "--max-shard-size", "100KB"])
    assert result.exit_code == 0, result.output
    source = Run(trained)
    expected = {k.removeprefix("weight/"): t for u in source.resolve(2).sources for k, t in source.read_unit(2, u)[0].items()
                if k.startswith("weight/")}
    assert_sharded_and_loaded_bit_for_bit(tmp_path / "hf" / "checkpoint-2", expected, SHARD)
