"""The optimizer of the whole model from pipeline stages' own (``store.units.merged_groups``):
what an export of a run saved by stages writes (the torchrun test exports a real one)."""

from __future__ import annotations

import pytest

from llmtailor.errors import UnsupportedLayoutError
from llmtailor.store.units import merged_groups

FIRST = [{"lr": 1e-3, "weight_decay": 0.1, "params": ["embed", "l0.w"]}, {"lr": 1e-3, "weight_decay": 0.0, "params": ["l0.norm"]}]
SECOND = [{"lr": 1e-3, "weight_decay": 0.1, "params": ["l1.w", "head"]}, {"lr": 1e-3, "weight_decay": 0.0, "params": ["l1.norm"]}]


def test_like_groups_of_the_stages_merge_in_stage_order():
    assert merged_groups([FIRST, SECOND], "run") == [
        {"lr": 1e-3, "weight_decay": 0.1, "params": ["embed", "l0.w", "l1.w", "head"]},
        {"lr": 1e-3, "weight_decay": 0.0, "params": ["l0.norm", "l1.norm"]},
    ]
    assert merged_groups([None, None], "run") is None


@pytest.mark.parametrize("second", [SECOND[:1], [SECOND[0], {**SECOND[1], "lr": 5e-4}], None],
                         ids=["fewer-groups", "other-lr", "no-optimizer"])
def test_stages_whose_groups_differ_are_refused_in_one_line(second):
    with pytest.raises(UnsupportedLayoutError, match=r"^snapshot 6: stage 1's optimizer groups are not stage 0's") as err:
        merged_groups([FIRST, second], "snapshot 6")
    assert "\n" not in str(err.value)
