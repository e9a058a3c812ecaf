"""Async saves: same snapshots as sync ones, the fence holds, failures are never lost."""

import errno
import threading
import time
from dataclasses import replace

import pytest
import torch
from helpers import assert_bitwise, assert_same_snapshots, snapshot_files, tiny, train, unit_versions

import llmtailor.async_stager as staging
import llmtailor.store.writer as writer
from llmtailor import Full, Parity, Tailor
from llmtailor.errors import BackgroundSaveError, ConfigError
from llmtailor.store.run import Run
from llmtailor.store.staged import Piece
from llmtailor.tailor import PendingSave


def test_async_and_sync_saves_of_the_same_run_are_identical_file_for_file(tmp_path, tokens):
    runs = {}
    for mode in ("sync", "async"):
        model, opt, sched = tiny()
        tailor = Tailor(tmp_path / mode, model, opt, sched, policy=Parity(), async_save=mode == "async")
        for step in range(1, 9):
            train(model, opt, sched, tokens, [step])
            if step % 2 == 0:
                report = tailor.save(step, extra={"next": step + 1})
                assert isinstance(report, PendingSave) == (mode == "async")
        tailor.close()
        runs[mode] = Run(tmp_path / mode)
    assert runs["sync"].steps() == runs["async"].steps() == [2, 4, 6, 8]
    assert_same_snapshots(runs["sync"], runs["async"], (2, 4, 6, 8))


def test_the_fence_keeps_the_next_optimizer_step_out_of_the_snapshot(tmp_path, tokens, monkeypatch):
    model, opt, sched = tiny()
    train(model, opt, sched, tokens, [1])
    stepping, copies_taken = threading.Event(), {}

    def step_begins(*_):  # registered before the Tailor's fence, so it runs first
        copies_taken["when the step began"] = tailor._stager.current.copied.is_set()
        stepping.set()

    opt.register_step_pre_hook(step_begins)
    opt.register_step_post_hook(lambda *_: copies_taken.update({"when it ended": tailor._stager.current.copied.is_set()}))
    tailor = Tailor(tmp_path, model, opt, sched, policy=Full(), async_save=True)
    expected = unit_versions(model, opt)
    slow_copy = staging._copied

    def once_the_step_began(piece, view):  # then slower than the step: only the fence can wait
        stepping.wait(300)
        time.sleep(0.01)
        return slow_copy(piece, view)

    monkeypatch.setattr(staging, "_copied", once_the_step_began)
    pending = tailor.save(1)
    train(model, opt, sched, tokens, [2])  # steps the optimizer at once
    assert copies_taken == {"when the step began": False, "when it ended": True}  # the step waited for them
    report = pending.result()
    assert report.step == 1 and report.bytes > 0
    tailor.close()
    fresh = tiny(seed=3)
    Tailor(tmp_path, *fresh).restore()
    assert_bitwise(unit_versions(fresh[0], fresh[1]), expected)


def test_a_background_write_error_surfaces_on_the_next_call_and_leaves_nothing(tmp_path, tokens, monkeypatch):
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), async_save=True)
    train(model, opt, sched, tokens, [1])
    tailor.save(1).result()
    real = writer.stream_tensors
    calls = []

    def failing(sink, *args, **kwargs):
        calls.append(sink)
        if len(calls) == 2:  # step 2 writes its pack file, then fails on its global tensors
            sink.abort()
            raise OSError(errno.EIO, "Input/output error")
        return real(sink, *args, **kwargs)

    monkeypatch.setattr(writer, "stream_tensors", failing)
    train(model, opt, sched, tokens, [2])
    pending = tailor.save(2)  # returns at once; the failure happens in the background
    with pytest.raises(BackgroundSaveError, match="Input/output error") as err:
        tailor.save(3)
    # Plainly: which step failed, and that this one was not saved either.
    assert str(err.value).startswith("step 3 was not saved: the async save of step 2 failed")
    assert "newest composite is still step 1" in str(err.value) and isinstance(err.value.__cause__, OSError)
    assert pending.done()
    run = Run(tmp_path)
    assert run.steps() == [1] and run.latest_step() == 1 and list(run.tmp_dir.iterdir()) == []
    monkeypatch.setattr(writer, "stream_tensors", real)
    # The lineage did not advance: the next save extends step 1's composite.
    train(model, opt, sched, tokens, [3])
    tailor.save(3)
    assert tailor.wait().step == 3
    assert run.manifest(3).parent == 1 and run.verify() == []
    tailor.close()


def test_a_failed_save_kept_for_the_next_call_does_not_keep_what_its_frames_held(tmp_path, tokens, monkeypatch):
    """A failed async save's error is kept until the next save, wait or close; its traceback
    kept every frame of the failed write alive with its locals: the staged file's mappings (on a
    ``/dev/shm`` memory tier, a partner's whole part in RAM) and buffers stayed held until the
    error was collected (an unforeseen error: the store's own, e.g. an OSError's StorageError, do
    not chain the write's frames). Its frames' locals are let go once the failure is kept; the
    error itself, its message and cause are what the next call raises."""
    import gc
    import weakref

    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, async_save=True)
    train(model, opt, sched, tokens, [1])
    held: list[weakref.ref] = []

    def broken(sink, *args, **kwargs):
        staged = torch.zeros(1 << 20)  # what the write holds when it fails (a mapping, a buffer)
        held.append(weakref.ref(staged))
        sink.abort()
        raise RuntimeError("the mapping broke")

    monkeypatch.setattr(writer, "stream_tensors", broken)
    pending = tailor.save(1)
    deadline = time.monotonic() + 120
    while not pending.done() and time.monotonic() < deadline:  # the failure is kept, not collected
        time.sleep(0.01)
    assert pending.done()
    gc.collect()
    assert [ref() is None for ref in held] == [True]
    with pytest.raises(BackgroundSaveError, match="async save of step 1 failed in the background .*the mapping broke") as err:
        tailor.wait()
    assert isinstance(err.value.__cause__, RuntimeError)
    tailor.close()


@pytest.mark.parametrize("call", ["wait", "close"])
def test_wait_and_close_raise_a_background_failure(tmp_path, tokens, monkeypatch, call):
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, async_save=True)
    train(model, opt, sched, tokens, [1])

    def broken(sink, *args, **kwargs):
        sink.abort()
        raise OSError(errno.EIO, "disk gone")

    monkeypatch.setattr(writer, "stream_tensors", broken)
    tailor.save(1)
    with pytest.raises(BackgroundSaveError, match="async save of step 1 failed in the background .*disk gone"):
        getattr(tailor, call)()
    assert Run(tmp_path).steps() == []
    if call == "wait":
        assert tailor.wait() is None  # raised once, then gone
    tailor.close()  # raised once (a second close does nothing)


def test_blocking_save_and_wait_on_an_async_tailor(tmp_path, tokens):
    model, opt, sched = tiny()
    with Tailor(tmp_path, model, opt, sched, async_save=True) as tailor:
        train(model, opt, sched, tokens, [1])
        pending = tailor.save(1)
        train(model, opt, sched, tokens, [2])
        final = tailor.save(2, blocking=True)  # waits for step 1 first
        assert pending.done() and final.step == 2 and Run(tmp_path).latest_step() == 2
        assert tailor.wait() is None
    with pytest.raises(ConfigError, match="async_save=True"):
        Tailor(tmp_path / "other", model, opt, sched).save(1, blocking=False)
    for wrong in (0, 3):  # one or two saves in flight, nothing else
        with pytest.raises(ConfigError, match="async_in_flight"):
            Tailor(tmp_path / "other", model, opt, sched, async_save=True, async_in_flight=wrong)


def test_buffers_are_reused_across_saves(tmp_path, tokens):
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), async_save=True)
    sizes = []
    for step in range(1, 5):
        train(model, opt, sched, tokens, [step])
        tailor.save(step).result()
        sizes.append(tailor._stager.buffers.nbytes)
    tailor.close()
    # The first (full) save sets the size; the smaller Parity saves reuse the same buffer.
    assert sizes == [sizes[0]] * 4
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    assert sizes[0] < 1.1 * full_bytes


def test_the_host_views_are_reused_for_the_same_pieces_and_carved_again_for_others():
    buffers = staging.HostBuffers()
    first = [Piece.whole("a", torch.zeros(4, 3)), Piece.whole("b", torch.zeros(5, dtype=torch.float16))]
    views = buffers.views(first)
    again = buffers.views([Piece.whole("c", torch.ones(4, 3)), Piece.whole("d", torch.ones(5, dtype=torch.float16))])
    assert [v.data_ptr() for v in again] == [v.data_ptr() for v in views]
    other = buffers.views([Piece.whole("a", torch.zeros(3, 4)), Piece.whole("b", torch.zeros(5))])
    assert [(v.dtype, tuple(v.shape)) for v in other] == [(torch.float32, (3, 4)), (torch.float32, (5,))]
    grown = buffers.views([Piece.whole("a", torch.zeros(1000))])
    assert [(v.dtype, tuple(v.shape)) for v in grown] == [(torch.float32, (1000,))] and buffers.nbytes >= 4000


def test_each_save_records_the_model_config_as_it_is_then(tmp_path, tokens):
    """Its JSON is made again only when the config changed (``ConfigRecord``): a change between
    two saves, an attribute's nested value changed in place too, is in the later save."""
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), async_save=True)
    tailor.save(1).result()
    model.config.note = {"tags": ["a"]}
    tailor.save(2).result()
    model.config.note["tags"].append("b")
    tailor.save(3).result()
    tailor.save(4).result()
    tailor.close()
    run = Run(tmp_path)
    saved = [run.read_global(step)["model_config"].get("note") for step in (1, 2, 3, 4)]
    assert saved == [None, {"tags": ["a"]}, {"tags": ["a", "b"]}, {"tags": ["a", "b"]}]


def test_the_config_record_follows_a_sub_config_and_a_property_changed_in_place():
    """``ConfigRecord`` against ``hf_config`` made afresh, after changes a composite model's
    config takes in place: an attribute of its text sub-config, a nested dict of it, a property
    whose setter changes other attributes (``num_labels``: ``id2label``). No stale JSON
    (risk51's review of 47ae8f5: refuted)."""
    transformers = pytest.importorskip("transformers")
    from llmtailor.providers.base import ConfigRecord, hf_config

    model = torch.nn.Module()
    model.config = transformers.LlavaConfig()
    record = ConfigRecord()
    changes = [lambda c: setattr(c.text_config, "vocab_size", 77),
               lambda c: c.text_config.rope_parameters.update(rope_theta=5.0),
               lambda c: setattr(c, "num_labels", 5)]
    assert record(model) == hf_config(model)
    for change in changes:
        change(model.config)
        assert record(model) == hf_config(model)


def test_buffers_updated_in_forward_are_copied_before_save_returns(tmp_path, tokens):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    tailor = Tailor(tmp_path, model, opt, async_save=True)
    expected = model[1].running_mean.clone()
    pending = tailor.save(1)
    model(torch.randn(8, 4))  # forward updates the running statistics
    pending.result()
    tailor.close()
    loaded, _ = Run(tmp_path).read_unit(1, "other")  # no family pattern matches a Sequential
    assert torch.equal(loaded["weight/1.running_mean"], expected)


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from helpers import tiny, train
import llmtailor.store.writer as writer
from llmtailor import Full, Tailor
from llmtailor.training_example import corpus_tokens

model, opt, sched = tiny()
train(model, opt, sched, corpus_tokens(), range(1, 3))
tailor = Tailor({run!r}, model, opt, sched, policy=Full(), async_save=True)
if {fail!r}:
    def broken(sink, *args, **kwargs):
        sink.abort()
        raise OSError(5, "disk gone")
    writer.stream_tensors = broken
tailor.save(2)
if {end!r} == "raise":
    raise RuntimeError("the script fails right after save")
# the script ends here without tailor.close() or wait()
"""


@pytest.fixture(scope="module")
def scripts_ended(tmp_path_factory):
    """``SCRIPT`` to its end in three fresh interpreters started at once (nothing shared but the
    machine: each its own run): the save in flight as the script returns (``return``), as it raises
    (``raise``), and the save failing in the background (``fail``). By case, the finished process
    and its run's directory."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers import wait_launches

    cases = {"return": (False, "return"), "raise": (False, "raise"), "fail": (True, "return")}
    started, runs = [], {}
    for name, (fail, end) in cases.items():
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        script = SCRIPT.format(tests=str(Path(__file__).parent), run=str(runs[name]), fail=fail, end=end)
        started.append(subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    outputs = wait_launches(started, timeout=600)  # a bound on a hang, for the three at once
    return {name: (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), runs[name])
            for name, proc, (out, err) in zip(cases, started, outputs)}


@pytest.mark.slow
@pytest.mark.parametrize("end", ["return", "raise"])
def test_a_save_in_flight_when_the_script_ends_is_committed(scripts_ended, end):
    """The interpreter waits for the save thread; the fsync helper must still take work then."""
    proc, run_dir = scripts_ended[end]
    assert proc.returncode == (1 if end == "raise" else 0), proc.stderr[-2000:]
    run = Run(run_dir)
    assert run.steps() == [2] and run.verify() == []


@pytest.mark.slow
def test_a_background_failure_nobody_collected_is_reported_at_exit(scripts_ended):
    proc, run_dir = scripts_ended["fail"]
    assert "llmtailor: ERROR: the async save of step 2" in proc.stderr and "NOT saved" in proc.stderr, proc.stderr
    assert "disk gone" in proc.stderr and Run(run_dir).steps() == []


def test_schedule_free_eval_save_train_gives_the_synchronous_snapshot(tmp_path, tokens, monkeypatch):
    """The documented schedule-free pattern: ``eval()`` (weights to x), save, ``train()`` (back to
    y), both in place; the async copy must see the eval weights, as a synchronous save does."""
    schedulefree = pytest.importorskip("schedulefree")
    slow_copy = staging._copied

    def slowly(piece, view):  # copies slower than the next call: only a fence can wait
        time.sleep(0.005)
        return slow_copy(piece, view)

    monkeypatch.setattr(staging, "_copied", slowly)
    snapshots = {}
    for mode in ("sync", "async"):
        model, _, _ = tiny()
        opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=3e-3, warmup_steps=2)
        opt.train()
        tailor = Tailor(tmp_path / mode, model, opt, policy=Full(), async_save=mode == "async")
        for step in range(1, 4):
            train(model, opt, None, tokens, [step])
        opt.eval()
        tailor.save(3)
        opt.train()
        train(model, opt, None, tokens, [4])
        tailor.close()
        snapshots[mode] = snapshot_files(Run(tmp_path / mode), 3)
    units = [name for name in snapshots["sync"] if name.startswith(("units/", "packs/"))]
    assert units and all(snapshots["sync"][n] == snapshots["async"][n] for n in units)


def test_an_unfenced_in_place_change_fails_that_save_and_a_fenced_one_is_kept_out(tmp_path, tokens, monkeypatch):
    model, opt, sched = tiny()
    train(model, opt, sched, tokens, [1])
    slow_copy = staging._copied
    changed = threading.Event()

    def once_changed(piece, view):  # save(1)'s copies are taken after the change; the next ones, slowly
        changed.wait(300)
        time.sleep(0.005)
        return slow_copy(piece, view)

    monkeypatch.setattr(staging, "_copied", once_changed)
    tailor = Tailor(tmp_path, model, opt, sched, policy=Full(), async_save=True)
    last = list(model.parameters())[-1]
    tailor.save(1)
    with torch.no_grad():
        last.mul_(2)  # an in-place change outside optimizer.step(), unfenced
    changed.set()
    with pytest.raises(BackgroundSaveError, match="changed in place after save"):
        tailor.wait()
    assert Run(tmp_path).steps() == []
    expected = unit_versions(model, opt)
    tailor.save(2)
    tailor.fence()  # the documented way: wait for the copies, then change
    with torch.no_grad():
        last.mul_(2)
    assert tailor.wait().step == 2
    tailor.close()
    fresh = tiny(seed=3)
    Tailor(tmp_path, *fresh).restore()
    assert_bitwise(unit_versions(fresh[0], fresh[1]), expected)


def test_a_step_already_saved_by_the_save_in_flight_is_refused_before_anything_is_written(tmp_path, tokens):
    """The order check comes after the save in flight is settled: its step is the parent then."""
    from llmtailor.errors import ConfigError

    model, opt, sched = tiny()
    with Tailor(tmp_path, model, opt, sched, policy=Full(), async_save=True) as tailor:
        train(model, opt, sched, tokens, [1])
        tailor.save(1)  # in flight
        with pytest.raises(ConfigError, match="step 1 is not after the previous snapshot's step 1"):
            tailor.save(1)
        tailor.save(2)
        assert tailor.wait().step == 2


def _held_part(monkeypatch, step: int, fail: bool) -> threading.Event:
    """Hold the background write of ``step``'s part until the returned event is set (at most
    10 s: code that runs one save at a time waits for it in the next ``save``), then write it,
    or fail it with an I/O error (``fail``)."""
    staged_behind, real = threading.Event(), writer.attempt_part

    def held(snapshot, staged, rank, on_unit, *rest):
        if staged.step == step:
            staged_behind.wait(10)
            if fail:
                staged = replace(staged, error=OSError(errno.EIO, "Input/output error"))
        return real(snapshot, staged, rank, on_unit, *rest)

    monkeypatch.setattr(writer, "attempt_part", held)
    return staged_behind


def _restored_equals(run_dir, step: int, saved: dict) -> None:
    """A fresh model restoring the composite of ``step`` holds, bit for bit, each unit's version
    (``saved``: step -> ``unit_versions`` right after that save)."""
    from llmtailor.layouts import build_layout

    fresh = tiny(seed=3)
    assert Tailor(run_dir, *fresh, read_only=True).restore(step).step == step
    sources, unit_of = Run(run_dir).resolve(step).sources, build_layout(fresh[0]).unit_of
    assert_bitwise(unit_versions(fresh[0], fresh[1]), {name: saved[sources[unit_of(name)]][name] for name in saved[step]})


def test_a_save_staged_behind_one_that_fails_is_lost_with_it_and_the_next_extends_the_last_committed(
        tmp_path, tokens, monkeypatch):
    """Two saves in flight (``async_in_flight=2``): step 3 fails in the background (its part) while step 4 is staged
    behind it. Neither is committed; the failure is raised once, naming step 3 and saying step 4
    was not saved; ``latest`` stays 2; the next save extends step 2's composite (its parent,
    save index and unit versions); a restore of 2 gives step 2's state."""
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), async_save=True, async_in_flight=2)
    saved = {}
    for step in (1, 2):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
        saved[step] = unit_versions(model, opt)
    tailor.wait()
    staged_behind = _held_part(monkeypatch, 3, fail=True)
    train(model, opt, sched, tokens, [3])
    tailor.save(3)
    train(model, opt, sched, tokens, [4])
    with pytest.raises(BackgroundSaveError, match="Input/output error") as err:
        try:
            tailor.save(4)
        finally:
            staged_behind.set()
        tailor.wait()
    message = str(err.value)
    assert "the async save of step 3 failed" in message and "step 4" in message, message
    assert "newest composite is still step 2" in message, message
    assert tailor.wait() is None  # raised once
    run = Run(tmp_path)
    assert run.steps() == [1, 2] and run.latest_step() == 2 and list(run.tmp_dir.iterdir()) == []
    monkeypatch.undo()
    train(model, opt, sched, tokens, [5])
    tailor.save(5)
    assert tailor.wait().step == 5
    assert (run.manifest(5).parent, run.manifest(5).save_index) == (2, 2)
    assert set(run.resolve(5).sources.values()) <= {1, 2, 5} and run.verify() == []
    tailor.close()
    _restored_equals(tmp_path, 2, saved)


def test_close_with_two_saves_in_flight_commits_both_in_order(tmp_path, tokens, monkeypatch):
    """Two in flight: step 2's write held until step 3 is staged behind it, then ``close()``: both committed,
    step 3 extending step 2, and a restore gives each unit's version."""
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path, model, opt, sched, policy=Parity(), async_save=True, async_in_flight=2)
    staged_behind = _held_part(monkeypatch, 2, fail=False)
    saved = {}
    for step in (1, 2, 3):
        train(model, opt, sched, tokens, [step])
        try:
            tailor.save(step)
        finally:
            if step == 3:
                staged_behind.set()
        saved[step] = unit_versions(model, opt)
    tailor.close()
    run = Run(tmp_path)
    assert run.steps() == [1, 2, 3] and run.latest_step() == 3 and run.verify() == []
    assert [(run.manifest(s).parent, run.manifest(s).save_index) for s in (1, 2, 3)] == [(None, 0), (1, 1), (2, 2)]
    _restored_equals(tmp_path, 3, saved)


@pytest.mark.slow
def test_async_lora_snapshots_equal_sync_ones_and_restore_in_a_fresh_process(tmp_path, tokens):
    """Partly frozen units (LoRA on q and v: each layer unit holds frozen base weights and
    adapters) under every policy that writes some layers but not others, and with a base model
    directory: each async snapshot is the synchronous one, file for file (unit indexes with
    their ``kept`` and ``base`` records included), and a fresh process restores the async run to
    the composite's versions."""
    pytest.importorskip("peft")
    from test_frozen import base_dir, lora, restored_in_a_fresh_process, step

    from llmtailor import Adaptive, Filter, Interval
    from llmtailor.layouts import build_layout
    from llmtailor.providers.base import unwrap

    cases = {
        "parity": (Parity(), None),
        "filter": (Filter(always=(1,), every=2), None),
        "interval": (Interval(periods={"layer.[02]": 2}), None),
        "adaptive": (Adaptive(budget=0.5, max_staleness=2), None),
        "parity-base": (Parity(), base_dir(tmp_path)),
    }
    versions: dict[str, dict[int, dict]] = {}
    for case, (policy, base) in cases.items():
        runs = {}
        for mode in ("sync", "async"):
            model, optimizer = lora()
            versions[case] = {}
            with Tailor(tmp_path / case / mode, model, optimizer, policy=policy, base=base,
                        async_save=mode == "async") as tailor:
                for s in range(1, 7):
                    step(model, optimizer, tokens, s)
                    if s % 2 == 0:
                        tailor.save(s)
                        versions[case][s] = unit_versions(model, optimizer)
            runs[mode] = Run(tmp_path / case / mode)
        sync, async_ = runs["sync"], runs["async"]
        assert sync.steps() == async_.steps() == [2, 4, 6], case
        held = [(s, u) for s in (4, 6) for u in sync.manifest(s).units
                if sync._stored_entry(s, u).kept or sync._stored_entry(s, u).base]
        assert held, f"{case}: no later save keeps a frozen tensor, so the test shows nothing"
        assert_same_snapshots(sync, async_, (2, 4, 6))

    everything = restored_in_a_fresh_process([tmp_path / case / "async" for case in cases])
    model, _ = lora()
    layout = build_layout(unwrap(model))
    for case, restored in zip(cases, everything):
        run = Run(tmp_path / case / "async")
        sources = run.resolve().sources
        assert any(run._stored_entry(s, u).kept or run._stored_entry(s, u).base for u, s in sources.items()), case
        for key, value in restored.items():
            name, state = key.rsplit("/", 1)
            source = sources[layout.unit_of(name.removeprefix("base_model.model."))]
            assert torch.equal(value, versions[case][source][name][state]), f"{case}: {key} (from step {source})"
        assert len(restored) == sum(len(state) for state in versions[case][6].values()), case


@pytest.mark.parametrize("newest", ["unconfirmed", "failed"])
def test_close_says_every_save_it_settles_that_may_not_be_durable(tmp_path, tokens, monkeypatch, newest):
    """Two saves in flight at ``close()``: step 2 committed but the fsync of ``snapshots/`` after
    its rename fails (EIO: it may not be durable), and step 3 the same ("unconfirmed") or failed
    in the background ("failed"). Close raises one error that says each: no call follows to say
    what it left out. Before: only the first (step 2's, or step 3's failure), the other never."""
    import os
    from pathlib import Path

    from llmtailor.errors import TailorError
    from llmtailor.constants import snapshot_dirname

    root = Path(os.path.realpath(tmp_path))
    model, opt, sched = tiny()
    tailor = Tailor(root, model, opt, sched, policy=Parity(), async_save=True, async_in_flight=2, track_drift=False)
    train(model, opt, sched, tokens, [1])
    tailor.save(1)
    tailor.wait()
    real, failed = os.fsync, []
    unsure = [2, 3] if newest == "unconfirmed" else [2]

    def fsync(fd):  # the first fsync of snapshots/ after each unsure step's rename
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        if path == str(root / "snapshots") and threading.current_thread().name != "llmtailor-purge":
            renamed = [s for s in unsure if s not in failed and (root / "snapshots" / snapshot_dirname(s)).exists()]
            if renamed:
                failed.append(renamed[0])
                raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if newest == "failed":
        _held_part(monkeypatch, 3, fail=True).set()
    for step in (2, 3):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
    with pytest.raises(TailorError) as raised:
        tailor.close()
    monkeypatch.undo()
    said = str(raised.value)
    assert failed == unsure and "step 2 was saved and committed" in said, said
    if newest == "unconfirmed":
        assert "step 3 was saved and committed" in said, said
    else:
        assert isinstance(raised.value, BackgroundSaveError) and "async save of step 3 failed" in said, said
