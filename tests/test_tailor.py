"""Tailor end to end in one process: save, restore, compare bit for bit."""

import pickle
import random

import numpy as np
import pytest
import torch
from helpers import assert_bitwise, drop_from_unit_index, flip_unit_byte, tiny, train, tree_digest, unit_file, unit_versions

from llmtailor import Filter, Full, Interval, Parity, Tailor
from llmtailor.distributed.coordinator import CoordinationError, LocalCoordinator
from llmtailor.errors import ConfigError, IncompatibleModelError, IntegrityError, SnapshotNotFoundError, TailorError
from llmtailor.store.run import Run


def test_full_roundtrip_continues_bitwise(tmp_path, tokens):
    model, opt, sched = tiny()
    reference = tiny()
    train(*reference, tokens, range(1, 7))
    expected_tail = train(*reference, tokens, range(7, 11))

    train(model, opt, sched, tokens, range(1, 7))
    Tailor(tmp_path, model, opt, sched).save(6, extra={"next": 7, "note": ("a", 1)})
    random.random(), np.random.rand(), torch.rand(3)  # disturb every RNG; restore must undo it

    fresh = tiny(seed=123)
    report = Tailor(tmp_path, *fresh).restore()
    assert report.step == 6 and report.extra == {"next": 7, "note": ("a", 1)}
    assert train(*fresh, tokens, range(7, 11)) == expected_tail
    for a, b in zip(fresh[0].parameters(), reference[0].parameters()):
        assert torch.equal(a, b)


# Saves at steps 2, 4, 6, 8, 10 (save indices 0..4); the composite at step 10 the policy implies.
EXPECTED_AT_10 = {
    "parity": (Parity(), {"embed": 10, "layer.0": 10, "layer.1": 8, "layer.2": 10, "layer.3": 8, "norm": 10, "head": 10}),
    "filter": (
        Filter(always=(0, -1), every=3),
        {"embed": 10, "layer.0": 10, "layer.1": 8, "layer.2": 8, "layer.3": 10, "norm": 10, "head": 10},
    ),
    "interval": (
        Interval({"layer.1": 2, "layer.*": 4, "embed": 3}),
        {"embed": 8, "layer.0": 10, "layer.1": 10, "layer.2": 10, "layer.3": 10, "norm": 10, "head": 10},
    ),
}


@pytest.mark.parametrize("name", EXPECTED_AT_10)
def test_restore_brings_back_exactly_the_versions_the_composite_names(tmp_path, tokens, name):
    policy, expected = EXPECTED_AT_10[name]
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=policy)
    versions, lrs = {}, {}
    for step in range(1, 11):
        train(model, opt, sched, tokens, [step])
        if step % 2 == 0:
            tailor.save(step)
            versions[step] = unit_versions(model, opt)
            lrs[step] = sched.get_last_lr()

    composite = Run(tmp_path).resolve()
    assert composite.sources == expected
    for at in (10, 6):
        fresh = tiny(seed=7)
        restored = Tailor(tmp_path, *fresh, policy=policy)
        sources = restored.restore(step=at).sources
        live = unit_versions(fresh[0], fresh[1])
        for param, state in live.items():
            source = sources[restored.layout.unit_of(param)]
            assert_bitwise({param: state}, {param: versions[source][param]}, where=f"step {at}: ")
        assert fresh[2].get_last_lr() == lrs[at]


def test_parity_bytes_stay_within_two_percent_of_its_tensor_share(tmp_path, tokens):
    model, opt, sched = tiny(layers=4, hidden=256)
    train(model, opt, sched, tokens, [1])
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity())
    full = tailor.save(1)
    train(model, opt, sched, tokens, [2])
    parity = tailor.save(2)

    def tensor_bytes(unit):
        total = 0
        for name in tailor.layout.units[unit]:
            param = dict(model.named_parameters())[name]
            total += param.numel() * param.element_size()
            total += sum(v.numel() * v.element_size() for v in opt.state[param].values())
        return total

    share = sum(tensor_bytes(u) for u in parity.units) / sum(tensor_bytes(u) for u in full.units)
    assert set(parity.units) == {"embed", "layer.1", "layer.3", "norm", "head"}
    assert parity.bytes <= 1.02 * share * full.bytes, (parity.bytes / full.bytes, share)


class Toy(torch.nn.Module):
    """Unknown family (generic layout), with a frozen parameter and one that never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(256, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 256, bias=False)
        self.unused = torch.nn.Parameter(torch.zeros(4))
        self.blocks[1].bias.requires_grad_(False)

    def forward(self, ids):
        hidden = self.embed_tokens(ids)
        for block in self.blocks:
            hidden = torch.tanh(block(hidden))
        return self.lm_head(self.norm(hidden))


def toy_loss(model, tokens, step):
    from llmtailor.training_example import batch_at

    batch = batch_at(tokens, step, 2, 17)
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))


OPTIMIZERS = {
    "adamw_hf_groups": lambda m: torch.optim.AdamW(
        [
            {"params": [p for n, p in m.named_parameters() if p.requires_grad and "norm" not in n and "bias" not in n]},
            {"params": [p for n, p in m.named_parameters() if p.requires_grad and ("norm" in n or "bias" in n)],
             "weight_decay": 0.0},
        ],
        lr=1e-2,
    ),
    "adam": lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2),
    "sgd_momentum": lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizers_frozen_and_gradless_parameters_roundtrip(tmp_path, tokens, name):
    def run(model, optimizer, steps):
        losses = []
        for step in steps:
            loss = toy_loss(model, tokens, step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    model = Toy()
    optimizer = OPTIMIZERS[name](model)
    run(model, optimizer, range(3))
    tailor = Tailor(tmp_path, model, optimizer, policy=Full())
    assert tailor.layout.family == "generic" and "other" in tailor.layout.units
    tailor.save(3)
    assert "unused" not in {n for n, p in model.named_parameters() if p in optimizer.state}

    torch.manual_seed(1)
    fresh = Toy()
    fresh_optimizer = OPTIMIZERS[name](fresh)
    Tailor(tmp_path, fresh, fresh_optimizer).restore()
    assert_bitwise(unit_versions(fresh, fresh_optimizer), unit_versions(model, optimizer))
    assert run(fresh, fresh_optimizer, range(3, 6)) == run(model, optimizer, range(3, 6))


def test_restore_never_unpickles(tmp_path, tokens, monkeypatch):
    model, opt, sched = tiny()
    train(model, opt, sched, tokens, [1])
    Tailor(tmp_path, model, opt, sched, policy=Parity()).save(1)

    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    for target, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, attr, refuse)
    fresh = tiny(seed=3)
    Tailor(tmp_path, *fresh).restore()
    assert torch.equal(fresh[0].lm_head.weight, model.lm_head.weight)


@pytest.fixture
def saved_run(tmp_path, tokens):
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity())
    for step in (1, 2, 3):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
    return tmp_path


def _damage_flip(run):
    path = flip_unit_byte(run, 3, "layer.0")  # a tiny model's units share a pack file
    return f"{path.name}: checksum mismatch in tensor 'weight/model.layers.0."


def _damage_truncate(run):
    path = unit_file(run, 2, "layer.1")
    path.write_bytes(path.read_bytes()[:100])
    return f"{path.name}: 100 bytes stored, manifest says"


def _damage_delete(run):
    path = unit_file(run, 3, "embed")
    path.unlink()
    return f"{path.name}: file is missing"


def _damage_manifest(run):
    (run / "snapshots/step-00000003/manifest.json").write_text('{"format": "llmtailor.snapshot", "step": 3')
    return "step-00000003/manifest.json: invalid manifest"


@pytest.mark.parametrize("damage", [_damage_flip, _damage_truncate, _damage_delete, _damage_manifest])
def test_damaged_files_are_refused_by_name_and_nothing_changes(saved_run, damage):
    fragment = damage(saved_run)
    before = tree_digest(saved_run)
    with pytest.raises(TailorError) as err:
        Tailor(saved_run, *tiny(seed=5)).restore(step=3)
    assert fragment in str(err.value)
    assert tree_digest(saved_run) == before


@pytest.mark.parametrize(
    "build, error, fragment",
    [
        (lambda: tiny(hidden=48), IncompatibleModelError, "model.embed_tokens.weight: model has float32 [256, 48]"),
        (lambda: tiny(layers=5), IncompatibleModelError, "layer.4"),
        (lambda: tiny(family="qwen2"), IncompatibleModelError, "q_proj.bias"),
        (lambda: (Toy(), None, None), IncompatibleModelError, "generic"),
    ],
)
def test_other_model_is_refused_before_reading_tensors(saved_run, build, error, fragment):
    before = tree_digest(saved_run)
    with pytest.raises(error) as err:
        Tailor(saved_run, *build()).restore()
    assert fragment in str(err.value)
    assert tree_digest(saved_run) == before


def test_other_optimizer_grouping_is_refused(saved_run):
    model, _, _ = tiny()
    one_group = torch.optim.AdamW(model.parameters())
    with pytest.raises(IncompatibleModelError, match="param groups differ"):
        Tailor(saved_run, model, one_group).restore()


def test_empty_run_and_unknown_step(tmp_path, saved_run):
    with pytest.raises(SnapshotNotFoundError, match="no committed snapshot in this run directory"):
        Tailor(tmp_path / "empty", *tiny()).restore()
    with pytest.raises(SnapshotNotFoundError, match=r"no committed snapshot at step 7; committed steps: 1, 2, 3"):
        Tailor(saved_run, *tiny()).restore(step=7)


def test_saves_never_overwrite_or_go_backwards(saved_run):
    tailor = Tailor(saved_run, *tiny(), fresh_start=True)
    before = tree_digest(saved_run)
    with pytest.raises(ConfigError, match="step 2 is not after step 3, the newest snapshot this run held"):
        tailor.save(2)
    tailor.restore()
    with pytest.raises(ConfigError, match="not after the previous snapshot's step 3"):
        tailor.save(3)
    assert tree_digest(saved_run) == before
    assert not list((saved_run / ".tmp").glob("*"))


def test_unstorable_extra_fails_the_save_leaving_nothing(tmp_path):
    tailor = Tailor(tmp_path, *tiny())
    with pytest.raises(TailorError, match=r"global state.extra.fn is a builtins.function"):
        tailor.save(1, extra={"fn": lambda: 0})
    assert Run(tmp_path).steps() == [] and not list(tmp_path.glob(".tmp/*"))
    assert tailor.save(1).step == 1 and Run(tmp_path).steps() == [1]


def test_a_synchronous_save_encodes_its_global_state_once_its_units_are_written(tmp_path):
    """The global state's CPU (a Lightning-sized save's dump and encoding) runs while the units'
    bytes go to the disk, not before they start: its stateful objects are captured once every
    unit file is staged whole."""
    seen: list[dict[str, int]] = []

    class Probe:
        def state_dict(self):
            seen.append({path.name: path.stat().st_size for path in tmp_path.glob(".tmp/*/packs/*")})
            return {"calls": len(seen)}

        def load_state_dict(self, state):
            pass

    tailor = Tailor(tmp_path, *tiny(), policy=Full(), stateful={"probe": Probe()}, track_drift=False)
    tailor.save(1)
    committed = {path.name: path.stat().st_size for path in Run(tmp_path).snapshot_dir(1).glob("packs/*")}
    assert committed and seen == [committed]
    assert Run(tmp_path).read_global(1)["stateful"]["probe"] == {"calls": 1}


def test_latest_follows_a_commit_whose_pointer_update_was_lost(saved_run):
    (saved_run / "latest").write_text("step-00000001\n")
    assert Run(saved_run).latest_step() == 3


@pytest.mark.parametrize("keep", [None, 2])
def test_the_first_save_of_a_tailor_that_restored_nothing_into_a_run_holding_a_composite_is_refused(
        saved_run, tokens, keep):
    """A restart that left out restore(): its save (at an older step here) would become the
    run's newest composite, and retention delete the training the run held."""
    before = tree_digest(saved_run)
    model, opt, sched = tiny(seed=7)
    tailor = Tailor(saved_run, model, opt, sched, policy=Parity(), keep=keep)
    for step in (0, 4):  # older than the run's newest (3), and newer
        with pytest.raises(ConfigError, match=rf"{saved_run} holds the composite of step 3, which this Tailor did not "
                           r"restore: restore\(\) resumes from it; .*another run directory, or fresh_start=True"):
            tailor.save(step)
    assert tree_digest(saved_run) == before and Run(saved_run).latest_step() == 3
    assert tailor.restore().step == 3  # the way out: resume, then save
    tailor.save(4)
    assert Run(saved_run).manifest(4).parent == 3


def test_a_fresh_start_asked_for_saves_a_lineage_of_its_own_after_the_runs_newest_step(saved_run, tokens):
    model, opt, sched = tiny(seed=7)
    tailor = Tailor(saved_run, model, opt, sched, policy=Parity(), keep=2, fresh_start=True)
    before = tree_digest(saved_run)
    with pytest.raises(ConfigError, match="step 3 is not after step 3, the newest snapshot this run held"):
        tailor.save(3)
    assert tree_digest(saved_run) == before
    train(model, opt, sched, tokens, [4])
    assert set(tailor.save(4).units) == set(tailor.layout.units)  # its first save writes every unit
    run = Run(saved_run)
    assert run.manifest(4).parent is None and run.latest_step() == 4
    assert set(run.resolve(4).sources.values()) == {4}
    assert run.steps() == [4]  # asked for: the run's older lineage is an abandoned branch to retention


def test_resuming_an_older_step_starts_a_branch(saved_run, tokens):
    model, opt, sched = tiny()
    tailor = Tailor(saved_run, model, opt, sched, policy=Parity())
    assert tailor.restore(step=2).step == 2
    train(model, opt, sched, tokens, [3])
    with pytest.raises(TailorError, match="step 3 is not after step 3, the newest snapshot of this run"):
        tailor.save(3)  # refused before anything is written (it would also have overwritten step 3)
    train(model, opt, sched, tokens, [4])
    tailor.save(4)
    run = Run(saved_run)
    assert run.manifest(4).parent == 2 and run.latest_step() == 4
    assert set(run.resolve(4).sources.values()) <= {1, 2, 4}


def test_plain_and_nested_optimizer_values(tmp_path):
    model, opt, sched = tiny()
    param = model.lm_head.weight
    opt.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(param), "count": 3, "flags": (True, None)}
    Tailor(tmp_path / "ok", model, opt, sched).save(1)
    fresh = tiny(seed=2)
    Tailor(tmp_path / "ok", *fresh).restore()
    state = fresh[1].state[fresh[0].lm_head.weight]
    assert state["count"] == 3 and state["flags"] == (True, None)

    opt.state[param]["bad"] = [torch.ones(1)]
    with pytest.raises(TailorError, match=r"optimizer state lm_head.weight.bad nests tensors"):
        Tailor(tmp_path / "bad", model, opt, sched).save(1)


def test_fallback_restores_the_newest_composite_that_verifies(saved_run):
    _damage_flip(saved_run)  # breaks step 3's layer.0, which the composite of 3 needs
    with pytest.raises(IntegrityError, match=r"restore\(fallback=True\) loads the newest composite that verifies"):
        Tailor(saved_run, *tiny(seed=5)).restore()
    before = tree_digest(saved_run)
    report = Tailor(saved_run, *tiny(seed=5)).restore(fallback=True)
    assert report.step == 2 and list(report.skipped) == [3]
    assert f"{unit_file(saved_run, 3, 'layer.0').name}: checksum mismatch" in report.skipped[3]
    assert tree_digest(saved_run) == before


def test_each_composite_a_fallback_tries_is_loaded_under_a_round_of_its_own(saved_run, monkeypatch):
    """The ranks' messages while a composite loads (the providers' exchanges of what each rank
    holds, needs and read) are tagged with the coordinator's round, and an exchange's messages
    stay in the job's store: a second composite loaded under the first one's round would take
    the first one's answers from ranks that have not answered yet (read plans differing between
    ranks: a good composite refused as damaged, or ranks out of step in a collective). Each
    composite tried draws a round of its own (seen here in one process)."""
    _damage_flip(saved_run)
    tailor = Tailor(saved_run, *tiny(seed=5))
    rounds, load = [], tailor.provider.load
    monkeypatch.setattr(tailor.provider, "load", lambda *args: (rounds.append(tailor.coordinator.round), load(*args))[1])
    assert tailor.restore(fallback=True).step == 2
    assert len(rounds) == 2 and rounds[0] != rounds[1], rounds


def test_fallback_when_nothing_verifies_names_every_step(saved_run):
    for step in (1, 2, 3):
        unit_file(saved_run, step, "norm").write_bytes(b"junk")
    with pytest.raises(IntegrityError, match=r"no composite verifies: step 3: .* \| step 2: .* \| step 1: "):
        Tailor(saved_run, *tiny()).restore(fallback=True)


def test_a_unit_version_lacking_a_weight_is_refused_before_any_byte_is_read(tmp_path, tokens, monkeypatch):
    """A forged snapshot (every checksum holds) whose layer.2 lacks one weight: the restore
    refuses it from the indexes alone, naming the unit, the step and the tensor, before it
    reads a unit or touches the live model (the units before layer.2 would load first)."""
    model, opt, sched = tiny()
    with Tailor(tmp_path, model, opt, sched, policy=Full()) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1)
    drop_from_unit_index(tmp_path, 1, "layer.2", "weight/model.layers.2.mlp.up_proj.weight")
    fresh = tiny(seed=3)
    before = unit_versions(fresh[0], fresh[1])
    reads = []
    real_read = Run.read_unit
    monkeypatch.setattr(Run, "read_unit", lambda run, step, unit, *args, **kwargs:
                        reads.append(unit) or real_read(run, step, unit, *args, **kwargs))
    tailor = Tailor(tmp_path, *fresh, fresh_start=True)  # the save below starts a lineage of its own
    with pytest.raises(IntegrityError, match=r"unit 'layer\.2' from snapshot 1, .*lacks .*'model\.layers\.2\.mlp\.up_proj\.weight'"):
        tailor.restore()
    assert reads == []
    assert_bitwise(unit_versions(fresh[0], fresh[1]), before)
    tailor.save(2)  # nothing was touched: saving is not refused (as a restore that failed part-way is)
    # verify reports it too (it passed the forged snapshot: every checksum holds).
    assert "unit 'layer.2' of step 1 lacks (neither writes nor keeps) the weights of [model.layers.2.mlp.up_proj.weight]" \
        in Run(tmp_path).verify(1)


class Unanswered(LocalCoordinator):
    """A coordinator whose restore agreement times out, as when another rank never answers."""

    def agree(self, tag, step, error, touched):
        raise CoordinationError(f"rank 1 did not answer {tag!r} within 1s")


def test_a_restore_whose_ranks_cannot_agree_leaves_saving_refused(saved_run):
    """The live state was loaded before the agreement failed: the other ranks' may not have been,
    so the job holds a mix of states. Saving stays refused, also after a later restore that
    fails before touching anything, until one succeeds."""
    tailor = Tailor(saved_run, *tiny(seed=5))
    tailor.coordinator = Unanswered()
    with pytest.raises(CoordinationError, match="did not answer"):
        tailor.restore()
    with pytest.raises(TailorError, match="the restore of step 3 did not complete, so the live model"):
        tailor.save(4)
    tailor.coordinator = LocalCoordinator()
    indexes, embed = saved_run / "snapshots/step-00000001/indexes.json", Run(saved_run).manifest(1).units["embed"]
    damaged = bytearray(indexes.read_bytes())
    damaged[embed.index_at + 1] ^= 0x01  # embed's line only: refused before touching
    indexes.write_bytes(bytes(damaged))
    with pytest.raises(IntegrityError, match="indexes.json: the index of unit 'embed'"):
        tailor.restore(step=1)
    with pytest.raises(TailorError, match="step 3 did not complete"):
        tailor.save(4)
    assert tailor.restore(step=2).step == 2
    tailor.save(4)


def test_a_restore_reads_and_decodes_the_global_state_once(tmp_path, tokens, monkeypatch):
    """The global state is decoded once per restore: its checks and its rank 0 state (RNG,
    extras) share that decode, and the RNG streams and extras come back from it."""
    from llmtailor.store import codec

    model, opt, sched = tiny()
    train(model, opt, sched, tokens, [1])
    Tailor(tmp_path, model, opt, sched).save(1, extra={"epoch": 3})
    expected = torch.rand(4)  # the torch stream right after the save
    torch.manual_seed(99)
    decoded, decode = [], codec.decode
    monkeypatch.setattr(codec, "decode", lambda doc, tensors, where="": decoded.append(where) or decode(doc, tensors, where=where))
    report = Tailor(tmp_path, *tiny(seed=5)).restore()
    assert [w.rsplit("/", 1)[-1] for w in decoded] == ["global.json"]
    assert report.extra == {"epoch": 3} and torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("tiered", [False, True], ids=["run", "tiers"])
def test_a_closed_tailor_refuses_to_save_restore_or_wait_and_a_second_close_is_harmless(tmp_path, tiered):
    from llmtailor import Tier
    from llmtailor.store.lock import WriterLock

    tiers = [Tier(tmp_path / "fast", keep=1, promote_every=1)] if tiered else []
    tailor = Tailor(tmp_path / "run", *tiny(), tiers=tiers)
    tailor.save(1)
    tailor.close()
    before = [tree_digest(tmp_path / "run"), *([tree_digest(tmp_path / "fast")] if tiered else [])]
    tailor.close()  # harmless: nothing is promoted or released again
    for call in (lambda: tailor.save(2), tailor.restore, tailor.wait):
        with pytest.raises(TailorError, match=r"is closed: .*make a new Tailor"):
            call()
    after = [tree_digest(tmp_path / "run"), *([tree_digest(tmp_path / "fast")] if tiered else [])]
    assert after == before
    for where in ["run", *(["fast"] if tiered else [])]:  # no lock taken again: another writer may take the run
        assert WriterLock(tmp_path / where).storage.locks.writer().holder_if_other() is None
    with Tailor(tmp_path / "run", *tiny(), tiers=tiers) as again:
        assert again.restore().step == 1


def test_a_restore_reads_its_own_rank_state_beside_the_units_not_after_them(tmp_path, tokens):
    """This rank's own state (RNG, extras) is read while the units load, not once they are in:
    from an object store that is one round trip less at the end of every restore. The load here
    waits for that read to have started (a bounded wait: before, it started only after the load);
    the restore still brings back the extras and the RNG stream."""
    import threading

    model, opt, sched = tiny()
    train(model, opt, sched, tokens, [1])
    Tailor(tmp_path, model, opt, sched).save(1, extra={"epoch": 3})
    expected = torch.rand(4)  # the torch stream right after the save
    torch.manual_seed(99)
    tailor = Tailor(tmp_path, *tiny(seed=5))
    started, seen = threading.Event(), []
    read_rank_state, load = tailor.provider.read_rank_state, tailor.provider.load

    def reading(*args, **kwargs):
        started.set()
        return read_rank_state(*args, **kwargs)

    def loading(*args, **kwargs):
        seen.append(started.wait(timeout=20))
        return load(*args, **kwargs)

    tailor.provider.read_rank_state, tailor.provider.load = reading, loading
    report = tailor.restore()
    assert seen == [True]
    assert report.extra == {"epoch": 3} and torch.equal(torch.rand(4), expected)
