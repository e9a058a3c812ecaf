"""Optimizers users bring: wrappers with state of their own (pytorch_optimizer's Lookahead over
AdamW), accelerate's stateless wrapper, optimizers llmtailor cannot capture (refused when the
Tailor is built), and a restore into another optimizer class (refused before any byte)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny, train

from llmtailor import Full, Parity, Tailor
from llmtailor.errors import IncompatibleModelError, UnsupportedStateError
from llmtailor.store.run import Run


def lookahead(model):
    from pytorch_optimizer import Lookahead

    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return Lookahead(inner, k=3, alpha=0.5)


def test_a_lookahead_run_resumes_bitwise_with_every_levels_state(tmp_path, tokens):
    """Lookahead keeps slow weights; the AdamW inside it keeps moments and steps. Resumed at step
    4 (one inner step past a slow-weight sync at 3), training continues bitwise through the next
    syncs."""
    pytest.importorskip("pytorch_optimizer")
    reference, _, _ = tiny()
    ref_opt = lookahead(reference)
    train(reference, ref_opt, None, tokens, range(1, 5))
    expected = train(reference, ref_opt, None, tokens, range(5, 11))

    model, _, _ = tiny()
    opt = lookahead(model)
    train(model, opt, None, tokens, range(1, 5))
    Tailor(tmp_path, model, opt, policy=Full()).save(4)
    keys = {t.key.rsplit("/", 1)[1] for t in Run(tmp_path).unit_entry(4, "layer.0").tensors if t.key.startswith("optim/")}
    assert {"exp_avg", "exp_avg_sq", "step", "Lookahead.slow_params"} <= keys

    fresh, _, _ = tiny(seed=9)
    fresh_opt = lookahead(fresh)
    Tailor(tmp_path, fresh, fresh_opt).restore()
    assert train(fresh, fresh_opt, None, tokens, range(5, 11)) == expected


def test_accelerates_wrapper_saves_the_inner_state_and_restores_into_the_plain_optimizer(tmp_path, tokens):
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    model, opt, sched = tiny()
    train(model, opt, sched, tokens, range(1, 3))
    Tailor(tmp_path, model, AcceleratedOptimizer(opt, device_placement=False), sched).save(2)
    fresh, fresh_opt, fresh_sched = tiny(seed=4)
    Tailor(tmp_path, fresh, fresh_opt, fresh_sched).restore()
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


class TwoOptimizers(torch.optim.Optimizer):
    def __init__(self, model):
        params = list(model.parameters())
        self.first = torch.optim.AdamW(params[:2])
        self.second = torch.optim.SGD(params[2:], lr=0.1)
        self.param_groups = self.first.param_groups + self.second.param_groups
        self.state = {}


class OwnGroups(torch.optim.Optimizer):
    def __init__(self, model):
        self.optimizer = torch.optim.AdamW(model.parameters())
        super().__init__(model.parameters(), {"lr": 1.0})


class GlobalCounter(torch.optim.AdamW):
    def __init__(self, params):
        super().__init__(params)
        self.state["global_step"] = 0


@pytest.mark.parametrize(
    "build, why",
    [
        (TwoOptimizers, "holds several optimizers (AdamW, SGD)"),
        (OwnGroups, "keeps param groups of its own"),
        (lambda model: GlobalCounter(model.parameters()), "keeps state under ['global_step']"),
    ],
)
def test_optimizers_whose_state_cannot_be_captured_are_refused_when_the_tailor_is_built(tmp_path, build, why):
    model, _, _ = tiny()
    with pytest.raises(UnsupportedStateError, match=__import__("re").escape(why)):
        Tailor(tmp_path, model, build(model))
    assert not tmp_path.joinpath("snapshots").exists()


def test_restoring_into_another_optimizer_class_is_refused_before_any_byte(tmp_path, tokens):
    model, opt, sched = tiny()
    train(model, opt, sched, tokens, range(1, 3))
    Tailor(tmp_path, model, opt, policy=Parity()).save(2)
    fresh, _, _ = tiny(seed=5)
    before = [p.detach().clone() for p in fresh.parameters()]
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(IncompatibleModelError, match="torch.optim.adamw.AdamW, the live one torch.optim.sgd.SGD"):
        Tailor(tmp_path, fresh, sgd).restore()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    assert sgd.state == {} and sgd.param_groups[0]["momentum"] == 0.9
    # Adam and AdamW keep the same per-parameter state: accepted.
    from llmtailor.training_example import hf_param_groups

    Tailor(tmp_path, fresh, torch.optim.Adam(hf_param_groups(fresh))).restore()
