"""Optimizers users bring: wrappers with state of their own (pytorch_optimizer's Lookahead over
AdamW), accelerate's stateless wrapper, optimizers llmtailor cannot capture (refused when the
Tailor is built), and a restore into another kind of optimizer (refused before any byte, by its
class or, for an imported run that records none, by its group and state keys)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny, train

from llmtailor import Full, Parity, Tailor
from llmtailor.errors import IncompatibleModelError, UnsupportedStateError
from llmtailor.store.run import Run
from llmtailor.training_example import hf_param_groups


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
    Tailor(tmp_path, fresh, torch.optim.Adam(hf_param_groups(fresh))).restore()


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory):
    """A run imported (``import_hf``) from the checkpoint of a real, plain Trainer (AdamW, two
    steps): it records no optimizer class. Returns a function making a model to restore into."""
    import transformers
    from integrations.hf_job import Windows, model_config

    from llmtailor.interop.hf.importer import import_hf

    out = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=2, save_steps=2, report_to=[], use_cpu=True,
        seed=0, learning_rate=3e-3, weight_decay=0.01, disable_tqdm=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=Windows()).train()
    import_hf(out / "checkpoint-2", out / "run")
    assert Run(out / "run").read_global(2).get("optimizer_class") is None
    return out / "run", lambda: transformers.AutoModelForCausalLM.from_config(model_config("llama", tie=False))


def one_step(model, optimizer, tokens):
    train(model, optimizer, None, tokens, [0])


@pytest.mark.parametrize(
    "build, stepped, why",
    [
        # SGD's step reads group["momentum"], which AdamW's groups lack: KeyError at the next step.
        (lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9), False,
         r"lacks \['dampening', 'momentum'\], which the live SGD reads"),
        # Adamax's groups hold nothing AdamW's lack; its state (once it has stepped) does.
        (lambda groups: torch.optim.Adamax(groups), True, r"the live Adamax keeps \['exp_inf'\] too"),
    ],
    ids=["sgd-groups", "adamax-state"],
)
def test_an_imported_run_recording_no_optimizer_class_is_refused_by_its_keys_before_any_byte(
    imported_run, tokens, build, stepped, why
):
    run_dir, make_model = imported_run
    model = make_model()
    optimizer = build(hf_param_groups(model))
    if stepped:
        one_step(model, optimizer, tokens)
    before = [p.detach().clone() for p in model.parameters()]
    state_keys = {id(p): set(s) for p, s in optimizer.state.items()}
    with pytest.raises(IncompatibleModelError, match=why):
        Tailor(run_dir, model, optimizer, read_only=True).restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert {id(p): set(s) for p, s in optimizer.state.items()} == state_keys


def test_an_imported_run_restores_into_the_optimizer_it_was_saved_with(imported_run, tokens):
    run_dir, make_model = imported_run
    model = make_model()
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=3e-3)
    one_step(model, optimizer, tokens)  # a live state with the same keys passes too
    Tailor(run_dir, model, optimizer, read_only=True).restore()
    one_step(model, optimizer, tokens)


def test_the_groups_of_pipeline_stages_are_cut_along_the_live_groups_by_name():
    """Two stages' optimizers saved two groups each (decay, no decay); one process's optimizer
    holds both stages' parameters in two groups: each live group takes the names of its own and
    the hyperparameters of the saved groups holding them, which must agree."""
    from llmtailor.providers.optimizer import regroup

    saved = [{"lr": 0.1, "weight_decay": 0.01, "params": ["a.w", "b.w"]}, {"lr": 0.1, "weight_decay": 0.0, "params": ["a.n"]},
             {"lr": 0.1, "weight_decay": 0.01, "params": ["c.w"]}, {"lr": 0.1, "weight_decay": 0.0, "params": ["c.n"]}]
    live = [["a.w", "b.w", "c.w"], ["a.n", "c.n"]]
    assert regroup(saved, live, {"a.w", "b.w", "c.w", "a.n", "c.n"}) == [
        {"lr": 0.1, "weight_decay": 0.01, "params": ["a.w", "b.w", "c.w"]},
        {"lr": 0.1, "weight_decay": 0.0, "params": ["a.n", "c.n"]}]
    # A stage restoring a run saved in one process: each live group a share of a saved one.
    whole = regroup(saved, live, {"a.w"})
    assert regroup(whole, [["a.w", "b.w"], ["a.n"]], {"a.w", "b.w", "a.n"}) == saved[:2]
    with pytest.raises(IncompatibleModelError, match=r"live optimizer group 0 holds parameters of saved groups \[0, 1, 2, 3\] "
                       r"whose \['weight_decay'\] differ"):
        regroup(saved, [["a.w", "a.n", "b.w", "c.w", "c.n"]], {"a.w"})
    with pytest.raises(IncompatibleModelError, match=r"the snapshot's param groups hold \['c.n'\], which no live"):
        regroup(saved, live[:1], {"a.w", "b.w", "c.w", "c.n"})


def frozen_embedding_optimizer(model, with_frozen: bool) -> torch.optim.AdamW:
    """AdamW over ``model`` with its embedding frozen: decay and no-decay groups, and a group of
    its own for the embedding (lr 0.5) holding it (``with_frozen``, as ``AdamW(model.parameters())``
    holds frozen parameters) or not (as HF Trainer and DeepSpeed's records of their groups leave
    them out), the rest the same."""
    embedding = model.get_input_embeddings().weight
    embedding.requires_grad_(False)
    groups = [{**g, "params": [p for p in g["params"] if p is not embedding]} for g in hf_param_groups(model)]
    return torch.optim.AdamW([groups[0], {"params": [embedding] if with_frozen else [], "lr": 0.5}, groups[1]], lr=3e-3)


@pytest.mark.parametrize("saved_with", [True, False])
def test_groups_holding_frozen_parameters_or_not_restore_into_each_other(tmp_path, tokens, saved_with):
    """Frozen parameters (no grad: no step changes them) in an optimizer's groups or not is how it
    was built, not state: a run saved with them restores into an optimizer without them and back,
    every group's hyperparameters (the embedding's own group included, empty or not) and the
    trained state by name, and training goes on bit for bit. The case met: a ZeRO-3 engine whose
    optimizer had a group of frozen parameters records it empty, as DeepSpeed keeps it, and its
    run restored into the plain model built the same way was refused ('live group 1 (1 params)
    matches no saved group'), as a run whose groups held the embedding was into HF Trainer's."""
    model, _, _ = tiny()
    opt = frozen_embedding_optimizer(model, saved_with)
    train(model, opt, None, tokens, range(1, 4))
    Tailor(tmp_path, model, opt, policy=Full()).save(3)
    expected = train(model, opt, None, tokens, range(4, 7))

    fresh, _, _ = tiny(seed=9)
    fresh_opt = frozen_embedding_optimizer(fresh, not saved_with)
    for group in fresh_opt.param_groups:
        group["lr"] = 1.0  # every one must come from the run
    Tailor(tmp_path, fresh, fresh_opt).restore()
    assert [g["lr"] for g in fresh_opt.param_groups] == [3e-3, 0.5, 3e-3]
    assert train(fresh, fresh_opt, None, tokens, range(4, 7)) == expected
