import re

import pytest

from llmtailor import Filter, Full, Interval, Parity
from llmtailor.errors import ConfigError
from llmtailor.policies import SaveContext, make_policy

UNITS = ("embed", *(f"layer.{i}" for i in range(8)), "norm", "head")
AUX = {"embed", "norm", "head"}


def run_policy(policy, saves: int) -> list[list[str]]:
    """Simulate ``saves`` saves; return the units of each."""
    last: dict[str, int] = {}
    chosen = []
    for index in range(saves):
        units = policy.choose(SaveContext(save_index=index, step=10 * (index + 1), units=UNITS, last_saved=last))
        last.update({u: 10 * (index + 1) for u in units})
        chosen.append(units)
    return chosen


def layers(units):
    return {int(u.split(".")[1]) for u in units if u.startswith("layer.")}


def test_first_save_is_always_full():
    for policy in (Full(), Parity(), Filter(), Interval({"layer.*": 3})):
        assert run_policy(policy, 1)[0] == list(UNITS)


def test_parity_alternates_layers_and_keeps_aux():
    saves = run_policy(Parity(), 4)
    assert layers(saves[1]) == {1, 3, 5, 7} and layers(saves[2]) == {0, 2, 4, 6} and layers(saves[3]) == {1, 3, 5, 7}
    assert all(AUX <= set(s) for s in saves)


def test_parity_decides_by_layer_index_whichever_layers_the_units_hold():
    """A pipeline stage's layers (4..7 under their own names) alternate as the whole model's do:
    by index, not by their count (which picked layers 0..3, none of them held, before)."""
    stage = ("layer.4", "layer.5", "layer.6", "layer.7", "norm", "head")
    for index, expected in ((1, {5, 7}), (2, {4, 6})):
        chosen = Parity().choose(SaveContext(save_index=index, step=index, units=stage, last_saved={u: 0 for u in stage}))
        assert layers(chosen) == expected and {"norm", "head"} <= set(chosen)


def test_filter_default_is_first_two_and_last_two_layers_plus_aux():
    saves = run_policy(Filter(every=3), 7)
    for index in (1, 2, 4, 5):
        assert layers(saves[index]) == {0, 1, 6, 7} and AUX <= set(saves[index])
    assert saves[3] == list(UNITS) and saves[6] == list(UNITS)


def test_filter_accepts_patterns_and_no_aux():
    saves = run_policy(Filter(always=("layer.3", -1), every=10, aux=False), 2)
    assert saves[1] == ["layer.3", "layer.7"]


def test_interval_periods_by_pattern_first_match_wins():
    policy = Interval({"layer.0": 1, "layer.*": 2, "embed": 3}, default=1)
    saves = run_policy(policy, 4)
    assert layers(saves[1]) == {0} and "embed" not in saves[1] and "norm" in saves[1]
    assert layers(saves[2]) == set(range(8)) and "embed" not in saves[2]
    assert "embed" in saves[3]


def test_full_every_forces_a_baseline():
    saves = run_policy(Parity(full_every=3), 7)
    assert saves[3] == list(UNITS) and saves[6] == list(UNITS) and saves[4] != list(UNITS)


def test_composite_staleness_is_bounded_by_the_policy():
    """Parity: no unit's newest version is more than one save old."""
    last: dict[str, int] = {}
    for index in range(6):
        step = index + 1
        units = Parity().choose(SaveContext(save_index=index, step=step, units=UNITS, last_saved=last))
        last.update({u: step for u in units})
        assert all(step - s <= 1 for s in last.values())


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: Filter(every=0), "every=0"),
        (lambda: Interval({"layer.*": 0}), "'layer.*'"),
        (lambda: Parity(full_every=-1), "full_every=-1"),
        (lambda: Filter(always=(1.5,)), "1.5"),
        (lambda: make_policy("sometimes"), "unknown policy 'sometimes'"),
        (lambda: make_policy("filter", evry=2), "evry"),
    ],
)
def test_bad_policy_options_are_clear_errors(build, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        build()
    assert fragment in str(err.value)


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as err:
        Filter(every=0, full_every=0)
    assert "every=0" in str(err.value) and "full_every=0" in str(err.value)


@pytest.mark.parametrize(
    "policy, why",
    [
        (Filter(always=(99,)), "always entry 99 is not a layer index of this model (4 layers)"),
        (Filter(always=(0, -5)), "always entry -5 is not a layer index"),
        (Filter(always=("layer.9*",)), "always entry 'layer.9*' matches no unit"),
        (Interval({"nosuch.*": 2}), "pattern 'nosuch.*' matches no unit"),
    ],
)
def test_options_that_name_no_unit_of_the_model_are_refused_when_the_tailor_is_built(tmp_path, policy, why):
    from helpers import tiny

    from llmtailor import Tailor

    model, opt, sched = tiny(layers=4)
    with pytest.raises(ConfigError, match=re.escape(why)) as err:
        Tailor(tmp_path, model, opt, sched, policy=policy)
    assert "units: embed, layer.0..layer.3, norm, head" in str(err.value)
    Tailor(tmp_path, model, opt, sched, policy=Filter(always=(0, -1, "layer.3"))).close()  # every entry names a unit
