"""Weights split into safetensors shards at ``max_shard_size``, as transformers splits them, and
sizes read as transformers reads ``max_shard_size``."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file

from llmtailor.errors import ConfigError, IntegrityError
from llmtailor.interop.hf.export import weight_shards
from llmtailor.outputs.shards import ShardWriter
from llmtailor.outputs.sink import DEFAULT_MAX_SHARD_SIZE, parse_size


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("100KB", 100_000), ("2GiB", 2 * 2**30),
                                        ("64KiB", 65536), ("1.5GB", 1_500_000_000), ("1024", 1024), (4096, 4096)])
def test_sizes_read_as_transformers_reads_max_shard_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "GB", "", "-1", "0", "five", True])
def test_a_size_that_is_none_is_one_line_naming_it(text):
    with pytest.raises(ConfigError, match=r"--max-shard-size: .* is not a size; expected"):
        parse_size(text)


def test_the_default_is_mergekits_5_gb():
    assert DEFAULT_MAX_SHARD_SIZE == parse_size("5GB")


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of uneven sizes (a few hundred bytes to 4 KB), in a model's order."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (64, 16), (8,), (32, 32), (8,), (64, 16), (16, 16), (100,), (8, 8)]
    return {f"t{i}.weight": torch.randn(shape, generator=generator) for i, shape in enumerate(shapes)}


@pytest.mark.parametrize("max_size", [4096, 5000, 9000, 20000, 10**9])
def test_the_split_is_transformers_own(max_size):
    """huggingface_hub's ``split_torch_state_dict_into_shards`` (what ``save_pretrained`` uses)
    on the same tensors: the same files, each with the same tensors, and the same total size
    (no tensor above the limit, where the two orders of shards agree)."""
    tensors = state_dict()
    theirs = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                max_shard_size=max_size)
    ours = weight_shards({name: t.numel() * t.element_size() for name, t in tensors.items()}, max_size)
    assert ours.files == theirs.filename_to_tensors
    assert json.loads(ours.index())["metadata"] == theirs.metadata


def test_shards_are_written_as_they_complete_and_hold_what_was_planned(tmp_path):
    tensors = state_dict()
    plan = weight_shards({name: t.numel() * t.element_size() for name, t in tensors.items()}, 5000)
    assert plan.sharded and len(plan.files) > 2
    writer = ShardWriter(tmp_path, plan, "model.safetensors.index.json")
    first = next(iter(plan.files))
    for name in plan.files[first]:
        writer.add({name: tensors[name]})
    assert sorted(p.name for p in tmp_path.iterdir()) == [first]  # the first shard, written once whole
    writer.add({name: t for name, t in tensors.items() if name not in plan.files[first]})
    writer.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(plan.files) == {p.name for p in tmp_path.glob("model-*")}
    for file in plan.files:
        loaded = load_file(tmp_path / file)
        assert set(loaded) == set(plan.files[file])
        assert all(torch.equal(loaded[name], tensors[name]) for name in plan.files[file])


def test_a_tensor_not_as_planned_is_refused(tmp_path):
    tensors = state_dict()
    plan = weight_shards({name: t.numel() * t.element_size() for name, t in tensors.items()}, 10**9)
    writer = ShardWriter(tmp_path, plan, "model.safetensors.index.json")
    with pytest.raises(IntegrityError, match="has 4 bytes, 512 were planned"):
        writer.add({"t0.weight": torch.zeros(1)})
    with pytest.raises(IntegrityError, match="'other' was not planned"):
        writer.add({"other": torch.zeros(1)})
    with pytest.raises(IntegrityError, match="planned tensors never came"):
        writer.finish()
