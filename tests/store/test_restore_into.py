"""A single process's restore reads each tensor stored whole straight into the memory of the live
weight or optimizer state tensor (``UnitReader.read``'s ``into``; issue 33: no staging buffer,
no copy), where that memory takes it: a plain CPU tensor, contiguous, of the stored dtype and
shape. Every other shape goes through a buffer as before: a non-contiguous live tensor, tied
weights, a fresh optimizer's state (made by the read). Restores stay bit-exact, over a
composite spread over two snapshots, from a unit's own file and from a pack; a damaged byte is
still refused naming its file, and the Tailor then refuses to save the half-restored state."""

from __future__ import annotations

import pytest
import torch
from helpers import flip_unit_byte, tiny, train

from llmtailor import Full, Parity, Run, Tailor
from llmtailor.errors import IncompatibleModelError, IntegrityError, TailorError
from llmtailor.store import checked, fetch, writer
from llmtailor.store.keys import KIND_OPTIM, KIND_WEIGHT, split_key


@pytest.fixture(params=["own files", "packs"])
def layout(request, monkeypatch) -> str:
    """Each unit in a file of its own (``PACK_UNIT_BYTES`` 1), or the tiny units in packs."""
    if request.param == "own files":
        monkeypatch.setattr(writer, "PACK_UNIT_BYTES", 1)
    return request.param


def parity_saves(path, tokens, tie: bool = False):
    """Saves at steps 1 and 2 by Parity: the composite of 2 takes half its units from step 1."""
    model, opt, sched = tiny(tie=tie)
    with Tailor(path, model, opt, sched, policy=Parity()) as tailor:
        for step in (1, 2):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    return Run(path)


def assert_composite_in(run: Run, step: int, model, optimizer) -> None:
    """Every weight and optimizer state tensor of the composite of ``step`` equals, bit for bit,
    the live one."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen = 0
    for unit, source in run.resolve(step).sources.items():
        for key, saved in run.read_unit(source, unit)[0].items():
            kind, name, state_key = split_key(key)
            live = params[name].detach() if kind == KIND_WEIGHT else optimizer.state[params[name]][state_key]
            assert kind in (KIND_WEIGHT, KIND_OPTIM) and live.dtype == saved.dtype and torch.equal(live, saved), key
            seen += 1
    assert seen > len(params)


@pytest.fixture
def staged(monkeypatch) -> list[int]:
    """Bytes of every new buffer the reads make for tensor data (``fetch.new_buffer``)."""
    sizes: list[int] = []
    made = fetch.new_buffer

    def noting(length: int):
        sizes.append(length)
        return made(length)

    monkeypatch.setattr(fetch, "new_buffer", noting)
    monkeypatch.setattr(checked, "new_buffer", noting, raising=False)  # (before issue 33: fetch alone made them)
    return sizes


def test_a_restore_lands_in_the_live_weights_and_optimizer_state(tmp_path, tokens, layout, staged):
    run = parity_saves(tmp_path / "run", tokens)
    model, opt, sched = tiny(seed=3)
    train(model, opt, sched, tokens, [7])  # the optimizer has state: its tensors are read into
    memory = {name: p.data_ptr() for name, p in model.named_parameters()}
    state = {name: dict(opt.state[p]) for name, p in model.named_parameters()}
    staged.clear()
    Tailor(run.root, model, opt, sched, read_only=True).restore()
    assert sum(staged) == 0  # no byte of tensor data went through a buffer of its own
    assert_composite_in(run, 2, model, opt)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == memory
    for name, p in model.named_parameters():
        for key, tensor in state[name].items():
            assert opt.state[p][key] is tensor, f"{name}/{key}: replaced, not read into"


def test_a_fresh_optimizer_gets_its_state_made_by_the_read(tmp_path, tokens, layout):
    run = parity_saves(tmp_path / "run", tokens)
    model, opt, sched = tiny(seed=3)
    memory = {name: p.data_ptr() for name, p in model.named_parameters()}
    Tailor(run.root, model, opt, sched, read_only=True).restore()
    assert_composite_in(run, 2, model, opt)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == memory


def test_a_fresh_optimizer_stages_no_byte_beyond_its_own_state(tmp_path, tokens, layout, staged):
    """A fresh optimizer has no state tensors to read into: its state is made by the read, and
    the buffers the read makes are that state (``load_state_dict`` keeps a tensor of the
    parameter's dtype and device), no byte more: the weights go straight into the live ones."""
    run = parity_saves(tmp_path / "run", tokens)
    model, opt, sched = tiny(seed=3)
    staged.clear()
    Tailor(run.root, model, opt, sched, read_only=True).restore()
    state = sum(value.nbytes for values in opt.state.values() for value in values.values() if isinstance(value, torch.Tensor))
    assert state > 0 and sum(staged) == state


def test_tied_embeddings_restore_bit_exact_and_stay_tied(tmp_path, tokens, layout):
    run = parity_saves(tmp_path / "run", tokens, tie=True)
    model, opt, sched = tiny(seed=3, tie=True)
    train(model, opt, sched, tokens, [7])
    Tailor(run.root, model, opt, sched, read_only=True).restore()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_composite_in(run, 2, model, opt)


def test_a_non_contiguous_live_weight_is_restored_through_a_buffer(tmp_path, tokens, layout):
    run = parity_saves(tmp_path / "run", tokens)
    model, _, _ = tiny(seed=3)
    proj = model.model.layers[1].self_attn.q_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().t().contiguous().t())  # same shape, column-major
    assert not proj.weight.is_contiguous()
    from llmtailor.training_example import build_optimizer

    opt, sched = build_optimizer(model, total_steps=50)
    train(model, opt, sched, tokens, [7])  # its moments are column-major too (zeros_like keeps strides)
    assert not opt.state[proj.weight]["exp_avg"].is_contiguous()
    weight = proj.weight
    Tailor(run.root, model, opt, sched, read_only=True).restore()
    assert proj.weight is weight and not weight.is_contiguous()
    assert_composite_in(run, 2, model, opt)


def test_a_live_model_of_another_dtype_is_refused_before_it_is_touched(tmp_path, tokens):
    run = parity_saves(tmp_path / "run", tokens)
    model, opt, sched = tiny(seed=3)
    model.to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(IncompatibleModelError, match="model has bfloat16"):
        Tailor(run.root, model, opt, sched, read_only=True).restore()
    assert all(torch.equal(p.detach(), before[name]) for name, p in model.named_parameters())


def test_a_damaged_byte_is_refused_and_the_half_restored_state_is_not_saved(tmp_path, tokens, layout):
    run = parity_saves(tmp_path / "run", tokens)
    unit = next(u for u, s in run.resolve(2).sources.items() if s == 2)
    damaged = flip_unit_byte(run.root, 2, unit)
    model, opt, sched = tiny(seed=3)
    train(model, opt, sched, tokens, [7])
    tailor = Tailor(run.root, model, opt, sched, policy=Full())
    with pytest.raises(IntegrityError, match=rf"{damaged.name}: checksum mismatch"):
        tailor.restore()
    with pytest.raises(TailorError, match="restore of step 2 failed part-way.*saving them is refused"):
        tailor.save(3)
    tailor.restore(step=1)  # a composite without the damaged file: saving is allowed again
    assert_composite_in(run, 1, model, opt)
    tailor.save(3)
    tailor.close()
