"""Every rank of a job must hold the same layout (``providers/agreement.py``): the ranks exchange
a digest of their units, tensor names, global shapes and dtypes, and only on a mismatch their
layouts, to name what differs. In one process here, rank 1's answers given by a second model;
the real job with two pipeline stages is in tests/distributed/test_torchrun.py."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from llmtailor.distributed.coordinator import LocalCoordinator
from llmtailor.errors import UnsupportedLayoutError
from llmtailor.providers import make_provider
from llmtailor.providers.agreement import check_same_layout, held_layout, layout_digest


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


def check(mine, theirs) -> RankZeroOfTwo:
    coordinator = RankZeroOfTwo(provider_of(theirs))
    provider = provider_of(mine)
    provider.coordinator = coordinator
    check_same_layout(provider, "r1/layout")
    return coordinator


def test_ranks_holding_the_same_model_agree_with_one_digest_each():
    assert check(tiny(seed=1)[0], tiny(seed=2)[0]).tags == ["digest"]


def test_a_pipeline_stage_is_refused_naming_the_units_each_rank_holds():
    with pytest.raises(UnsupportedLayoutError, match=r"^the ranks of this job hold different units of the model: "
                       r"rank 1 lacks units \[embed, layer.0, layer.1\] that rank 0 holds\. Ranks holding different "
                       r"layers \(pipeline-parallel stages\) are not supported yet"):
        check(tiny()[0], second_stage(tiny()[0]))


def test_ranks_whose_models_differ_in_shape_are_refused_naming_the_tensors():
    with pytest.raises(UnsupportedLayoutError, match=r"^the ranks of this job hold different models: rank 1: "
                       r"model.embed_tokens.weight is float32 \[\d+, 64\], rank 0's float32 \[\d+, 32\]; .*"
                       r"every rank must build the same model$"):
        check(tiny()[0], tiny(hidden=64)[0])
