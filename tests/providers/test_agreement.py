"""The ranks of a job agree on one layout (``providers/agreement.py``): they exchange a digest of
their units, tensor names, global shapes and dtypes, and only on a mismatch their layouts, to
form pipeline stages or name what differs. In one process here, rank 1's answers given by a
second model; the real jobs with two pipeline stages are in tests/distributed/test_torchrun.py."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from llmtailor.distributed.coordinator import LocalCoordinator
from llmtailor.errors import UnsupportedLayoutError
from llmtailor.providers import make_provider
from llmtailor.providers.agreement import agree_layout, held_layout, layout_digest


class RankZeroOfTwo(LocalCoordinator):
    """Rank 0 of a world of two; rank 1 holds ``other`` (a provider)."""

    world_size = 2

    def __init__(self, other):
        self.other = other
        self.tags: list[str] = []

    def exchange(self, tag, value):
        self.tags.append(tag.rsplit("/", 1)[1])
        theirs = held_layout(self.other)
        return [value, layout_digest(theirs) if tag.endswith("/digest") else theirs]


def provider_of(model):
    return make_provider(model, torch.optim.AdamW(model.parameters()), None, LocalCoordinator())


def second_stage(model):
    """Layers 2 and 3 under their own names (torchtitan's pipeline split), the norm and head."""
    model.model.layers = torch.nn.ModuleDict({str(i): model.model.layers[i] for i in (2, 3)})
    model.model.embed_tokens = None
    return model


def first_stage(model):
    """The embedding and layers 0 and 1 under their own names."""
    model.model.layers = torch.nn.ModuleDict({str(i): model.model.layers[i] for i in (0, 1)})
    model.model.norm, model.lm_head = None, None
    return model


def check(mine, theirs):
    coordinator = RankZeroOfTwo(provider_of(theirs))
    provider = provider_of(mine)
    provider.coordinator = coordinator
    return agree_layout(provider, "r1/layout"), coordinator


def test_ranks_holding_the_same_model_agree_with_one_digest_each():
    stages, coordinator = check(tiny(seed=1)[0], tiny(seed=2)[0])
    assert coordinator.tags == ["digest"] and not stages.pipelined
    assert stages.stages == (((0, 1), tuple(stages.layout.units)),)


def test_pipeline_stages_agree_on_the_union_of_their_units():
    stages, coordinator = check(first_stage(tiny()[0]), second_stage(tiny()[0]))
    assert coordinator.tags == ["digest", "layouts"] and stages.pipelined
    assert stages.stages == (((0,), ("embed", "layer.0", "layer.1")), ((1,), ("layer.2", "layer.3", "norm", "head")))
    whole = provider_of(tiny()[0]).layout
    assert stages.layout == whole and stages.layout.diff(whole) == []


def test_stages_that_share_a_unit_are_refused_naming_the_units_each_rank_holds():
    with pytest.raises(UnsupportedLayoutError, match=r"^the ranks of this job hold different units of the model: "
                       r"rank 1 lacks units \[embed, layer.0, layer.1\] that rank 0 holds\. Units \[layer.2, layer.3, "
                       r"norm, head\] are held by ranks holding different units: ranks may hold different layers "
                       r"\(pipeline-parallel stages\) only as stages of one model"):
        check(tiny()[0], second_stage(tiny()[0]))


def test_ranks_whose_models_differ_in_shape_are_refused_naming_the_tensors():
    with pytest.raises(UnsupportedLayoutError, match=r"^the ranks of this job hold different models: rank 1: "
                       r"model.embed_tokens.weight is float32 \[\d+, 64\], rank 0's float32 \[\d+, 32\]; .*"
                       r"every rank must build the same model$"):
        check(tiny()[0], tiny(hidden=64)[0])
