"""Drift measurement and the Adaptive policy: the estimate's error, frozen vs training layers,
the staleness bound under any drift, decisions reproducible from the manifest."""

import gc
import weakref

import pytest
import torch
from helpers import MOMENTS_BOUND, WEIGHT_BOUND, exact_drift, tiny, train
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtailor import Adaptive, Full, Parity, Tailor
from llmtailor.distributed.coordinator import LocalCoordinator
from llmtailor.drift import DriftTracker, drift_figures
from llmtailor.errors import ConfigError
from llmtailor.policies import SaveContext, make_policy
from llmtailor.providers import make_provider
from llmtailor.store.run import Run
from llmtailor.store.staged import Piece


def test_the_sampled_estimate_is_within_the_documented_bound(tokens):
    model, optimizer, scheduler = tiny(layers=2, hidden=256)  # tensors of 64k elements: sampled
    train(model, optimizer, scheduler, tokens, range(1, 3))
    provider = make_provider(model, optimizer, scheduler, LocalCoordinator())
    units = list(provider.layout.units)
    tracker = DriftTracker()
    tracker.adopt(tracker.gather(units, provider))
    before = {u: {p.key: p.tensor.clone() for p in provider.stage_unit(u).pieces} for u in units}
    train(model, optimizer, scheduler, tokens, range(3, 8))
    figures = drift_figures(units, tracker.partial_sums(units, tracker.gather(units, provider)), tracker.known())
    checked = 0
    for unit in units:
        now = {p.key: p.tensor for p in provider.stage_unit(unit).pieces}
        for kind, bound in (("weight", WEIGHT_BOUND), ("moments", MOMENTS_BOUND)):
            exact = exact_drift(before[unit], now, kind)
            assert exact > 0
            assert abs(figures[unit][kind] - exact) <= bound * exact, (unit, kind, figures[unit][kind], exact)
            checked += 1
    assert checked == 2 * len(units)


def test_the_sample_views_are_kept_while_the_tensors_keep_their_memory_and_rebuilt_when_not(tokens):
    model, optimizer, scheduler = tiny(layers=2, hidden=64)
    train(model, optimizer, scheduler, tokens, range(1, 3))
    provider = make_provider(model, optimizer, scheduler, LocalCoordinator())
    units = list(provider.layout.units)
    tracker = DriftTracker()
    for step in range(3, 6):  # training updates in place: the same views serve every gather
        tracker.adopt(tracker.gather(units, provider))
        train(model, optimizer, scheduler, tokens, [step])
    assert tracker.plans_built == 1
    # load_state_dict replaces the optimizer's state tensors: the views must follow them.
    state = optimizer.state_dict()
    for entry in state["state"].values():
        entry["exp_avg"] = torch.full_like(entry["exp_avg"], 0.5)
    optimizer.load_state_dict(state)
    seen = tracker.gather(units, provider)
    assert tracker.plans_built == 2
    fresh = DriftTracker().gather(units, provider)
    for kind in ("weight", "moments"):
        assert torch.equal(seen.values[kind], fresh.values[kind])
    assert (seen.values["moments"] == 0.5).sum() > 0


def test_an_optimizer_loading_new_state_releases_the_old_state_at_once(tmp_path, tokens):
    model, optimizer, scheduler = tiny(layers=2, hidden=64)
    tailor = Tailor(tmp_path, model, optimizer, scheduler, policy=Parity())
    train(model, optimizer, scheduler, tokens, [1])
    tailor.save(1)
    old = weakref.ref(next(iter(optimizer.state.values()))["exp_avg"])
    state = optimizer.state_dict()
    fresh = {**state, "state": {i: {k: v.clone() for k, v in entry.items()} for i, entry in state["state"].items()}}
    del state
    optimizer.load_state_dict(fresh)
    gc.collect()
    assert old() is None  # the drift views no longer hold it
    train(model, optimizer, scheduler, tokens, [2])
    tailor.save(2)  # measured on the new state's tensors
    assert all(f["weight"] > 0 and f["moments"] > 0 for f in Run(tmp_path).manifest(2).decision["drift"].values())
    tailor.close()


class _Source:
    """A sample source of one unit whose tensors are whatever the test sets."""

    def __init__(self, **tensors):
        self.tensors = tensors

    def pieces_by_unit(self, units):
        return {"layer.0": [Piece.whole(key.replace("__", "/"), t) for key, t in self.tensors.items()]}

    def live_tensors(self, units):
        return list(self.tensors.values())


def test_non_contiguous_pieces_are_sampled_from_their_current_values():
    base = torch.randn(300, 200)
    source = _Source(weight__w=base.t())  # a transposed view: no strided view of it is kept
    tracker = DriftTracker(sample_size=64)
    tracker.adopt(tracker.gather(["layer.0"], source))
    base.mul_(1.5)  # in place: the same memory, 50% larger values
    sums = tracker.partial_sums(["layer.0"], tracker.gather(["layer.0"], source))
    figures = drift_figures(["layer.0"], sums, tracker.known())
    assert figures["layer.0"]["weight"] == pytest.approx(0.5, rel=1e-5)
    assert tracker.plans_built == 1


def test_pieces_that_are_copies_are_listed_again_at_every_gather():
    live = torch.randn(400, 300)

    class Copies(_Source):
        def pieces_by_unit(self, units):
            return {"layer.0": [Piece.whole("weight/w", live.clone())]}

    source = Copies(weight__w=live)
    tracker = DriftTracker()
    tracker.adopt(tracker.gather(["layer.0"], source))
    live.mul_(2.0)
    sums = tracker.partial_sums(["layer.0"], tracker.gather(["layer.0"], source))
    assert drift_figures(["layer.0"], sums, tracker.known())["layer.0"]["weight"] == pytest.approx(1.0, rel=1e-5)
    assert tracker.plans_built == 2


def test_every_save_records_the_drift_of_every_unit(tmp_path, tokens):
    model, optimizer, scheduler = tiny()
    tailor = Tailor(tmp_path, model, optimizer, scheduler, policy=Parity())
    for step in range(1, 5):
        train(model, optimizer, scheduler, tokens, [step])
        tailor.save(step)
    run = Run(tmp_path)
    assert all(v is None for v in run.manifest(1).decision["drift"]["layer.0"].values())  # nothing saved before
    later = run.manifest(3).decision["drift"]
    assert set(later) == set(tailor.layout.units)
    assert all(f["weight"] > 0 and f["moments"] > 0 for f in later.values())


def test_a_full_saves_bytes_count_every_unit_also_where_retention_removed_its_older_versions(tmp_path, tokens):
    """``llmtailor drift``'s "x Full" row (``drift_history``): a Full save's bytes at each step
    of the lineage count every unit, also at the oldest step retention kept, whose composite
    names versions that are gone (their sizes come from the unit's nearest save in the lineage).
    Before: that step's Full bytes were its own bytes ("x Full 1.00" for a Parity save)."""
    from llmtailor.drift import drift_history

    model, optimizer, scheduler = tiny()
    with Tailor(tmp_path, model, optimizer, scheduler, policy=Parity(), keep=2) as tailor:
        for step in range(1, 6):
            train(model, optimizer, scheduler, tokens, [step])
            tailor.save(step)
    history = drift_history(Run(tmp_path))
    assert history.steps == [3, 4, 5]
    fulls = list(history.full_bytes.values())
    assert max(fulls) < 1.01 * min(fulls)  # every unit at its one size at every step (the global state's may differ)
    assert all(history.bytes[s] / history.full_bytes[s] < 0.8 for s in history.steps), history


def frozen_half(model) -> set[str]:
    frozen = set()
    for name, param in model.named_parameters():
        if ".layers.1." in name or ".layers.3." in name:
            param.requires_grad_(False)
            frozen.add(name)
    return frozen


def test_adaptive_never_saves_frozen_layers_after_the_baseline_and_always_saves_training_ones(tmp_path, tokens):
    model, optimizer, scheduler = tiny(layers=4)
    frozen_half(model)  # before the optimizer's first step: they never get optimizer state
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tailor = Tailor(tmp_path, model, optimizer, scheduler, policy=Adaptive(threshold=1e-6, max_staleness=2))
    saved = []
    for step in range(1, 9):
        train(model, optimizer, scheduler, tokens, [step])
        saved.append(tailor.save(step).units)
    assert "layer.1" in saved[0] and "layer.3" in saved[0]  # the first, full baseline
    for units in saved[1:]:
        assert "layer.1" not in units and "layer.3" not in units
        assert {"layer.0", "layer.2", "embed", "norm", "head"} <= set(units)
    record = Run(tmp_path).manifest(8).decision
    assert record["frozen"] == ["layer.1", "layer.3"] and record["score"]["layer.1"] == 0.0


def test_decisions_are_reproducible_from_the_recorded_figures(tmp_path, tokens):
    model, optimizer, scheduler = tiny(layers=4)
    policy = Adaptive(budget=0.5, max_staleness=3)
    tailor = Tailor(tmp_path, model, optimizer, scheduler, policy=policy)
    for step in range(1, 11):
        train(model, optimizer, scheduler, tokens, [step])
        tailor.save(step)
    run = Run(tmp_path)
    sizes = []
    for step in run.steps()[1:]:
        manifest = run.manifest(step)
        assert policy.replay(manifest.decision) == list(manifest.units) == manifest.decision["chosen"]
        sizes.append(len(manifest.units))
    assert min(sizes) < len(tailor.layout.units)  # it did skip units


def test_budget_mode_fits_the_budget_beyond_the_forced_units():
    units = tuple(["embed", *[f"layer.{i}" for i in range(6)], "norm", "head"])
    ctx = SaveContext(
        save_index=5, step=50, units=units, last_saved={u: 40 for u in units},
        last_saved_index={u: 4 for u in units},
        drift={u: {"weight": 0.1 * i, "moments": None} for i, u in enumerate(units)},
        unit_bytes={u: 100 for u in units},
    )
    decision = Adaptive(budget=300, aux=False).decide(ctx)
    assert decision.units == ["layer.5", "norm", "head"]  # the three with the most drift
    assert Adaptive(threshold=0.55, aux=False).decide(ctx).units == ["layer.5", "norm", "head"]
    # aux=True (default): embed, norm and head every save, their bytes from the budget.
    assert Adaptive(budget=500).decide(ctx).units == ["embed", "layer.4", "layer.5", "norm", "head"]


# too_slow off: drawing the examples may take seconds on a busy machine, which says nothing of the code
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    drift=st.lists(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=6, max_size=6), min_size=1, max_size=20),
    staleness=st.integers(1, 5),
    budget=st.one_of(st.none(), st.integers(0, 600)),
    frozen=st.sets(st.sampled_from(["layer.0", "layer.1"]), max_size=1),
)
def test_the_staleness_bound_holds_under_any_drift(drift, staleness, budget, frozen):
    units = ("embed", "layer.0", "layer.1", "layer.2", "norm", "head")
    policy = Adaptive(budget=budget, max_staleness=staleness) if budget is not None else Adaptive(threshold=1.0, max_staleness=staleness)
    last = {u: 0 for u in units}
    for index, figures in enumerate(drift, start=1):
        ctx = SaveContext(
            save_index=index, step=index, units=units, last_saved=last, last_saved_index=dict(last),
            drift={u: {"weight": d, "moments": d} for u, d in zip(units, figures)}, unit_bytes={u: 100 for u in units},
            frozen=frozenset(frozen),
        )
        chosen = policy.decide(ctx).units
        for unit in units:
            if unit not in frozen:
                assert index - last[unit] <= staleness
                if index - last[unit] == staleness:
                    assert unit in chosen
        last = {**last, **{u: index for u in chosen}}


@pytest.mark.parametrize("options, fragment", [
    ({}, "exactly one of threshold"),
    ({"threshold": 0.1, "budget": 0.5}, "exactly one of threshold"),
    ({"threshold": -1}, "threshold=-1"),
    ({"budget": 1.5}, "budget=1.5"),
    ({"budget": 0.5, "max_staleness": 0}, "max_staleness=0"),
    ({"threshold": 0.1, "on": "grads"}, "on='grads'"),
])
def test_bad_adaptive_options_are_refused_by_name(options, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        Adaptive(**options)


def test_make_policy_builds_adaptive_and_tailor_refuses_it_without_drift(tmp_path):
    assert make_policy("adaptive", threshold=0.01) == Adaptive(threshold=0.01)
    model, optimizer, scheduler = tiny()
    with pytest.raises(ConfigError, match="track_drift"):
        Tailor(tmp_path, model, optimizer, scheduler, policy=Adaptive(threshold=0.1), track_drift=False)
    assert Tailor(tmp_path, model, optimizer, scheduler, policy=Full(), track_drift=False)._drift is None
