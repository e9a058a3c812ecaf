"""Distributed saves and restores with real processes: torchrun, gloo, CPU (``torch_job.py``).

Launches are few and batched (each costs 10-20 s): one 2-rank FSDP2 job trains, saves, resumes
and restores; a 3-rank job restores the same run; a 2-rank DDP job; two processes started by
hand for the SIGKILL case (torchrun would kill the surviving rank itself)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MOMENTS_BOUND, WEIGHT_BOUND, exact_drift, free_port, tiny, train

from llmtailor import Parity, Tailor
from llmtailor.store.run import Run

JOB = Path(__file__).with_name("torch_job.py")
pytestmark = pytest.mark.slow


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(nproc: int, scenario: str, out: Path, timeout: float = 600, **more_env: str) -> list[dict]:
    """Launch ``scenario`` at ``nproc`` ranks; past ``timeout`` (a hang) every rank is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(JOB), scenario, str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env(), **more_env}, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks, not the launcher alone
        proc.communicate()
        raise
    assert proc.returncode == 0, stdout[-4000:] + stderr[-6000:]
    return [json.loads((out / f"result-{scenario}-{r}.json").read_text()) for r in range(nproc)]


def job_module():
    import importlib.util

    if "torch_job" not in sys.modules:
        spec = importlib.util.spec_from_file_location("torch_job", JOB)
        module = importlib.util.module_from_spec(spec)
        sys.modules["torch_job"] = module
        spec.loader.exec_module(module)
    return sys.modules["torch_job"]


def restore_in_one_process(out: Path, run_name: str) -> tuple[list[str], object]:
    """Restore a distributed run into a plain model and optimizer (no process group)."""
    model, optimizer, scheduler = tiny(seed=11)
    report = Tailor(out / run_name, model, optimizer, scheduler).restore()
    return job_module().compare_with_composite(out, out / run_name, model, optimizer), report


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, torchrun(2, "fsdp-train", out)


def test_fsdp2_parity_restores_exact_versions_at_world_sizes_2_3_and_1(fsdp):
    out, results = fsdp
    for rank, result in enumerate(results):  # restored at 2, in the same job
        assert result["restored"] == 8 and result["mismatches"] == []
        assert result["extra"] == {"rank": rank, "next": 9} and result["unmapped"] == []
    sources = Run(out / "parity").resolve().sources
    assert sources["layer.1"] == 8 and sources["layer.0"] == 6  # a real composite
    three = torchrun(3, "fsdp-restore", out)
    for rank, result in enumerate(three):
        assert result["restored"] == 8 and result["mismatches"] == []
        assert result["extra"] == {"rank": rank if rank < 2 else 0, "next": 9}
        assert "rank 2 kept its RNG streams and got rank 0's extras" in " ".join(result["unmapped"])
    mismatches, report = restore_in_one_process(out, "parity")
    assert mismatches == [] and report.saved_world_size == 2 and report.extra == {"rank": 0, "next": 9}
    assert Run(out / "parity").verify() == []


def test_fsdp2_drift_is_measured_over_the_shards_of_every_rank(fsdp):
    """Each rank samples its own shards; one all-reduce gives the figures the manifest records,
    which match the exact drift of the whole tensors since each unit's last saved version."""
    from safetensors.torch import load_file

    from llmtailor.layouts import build_layout

    out, _ = fsdp
    run = Run(out / "parity")
    unit_of = build_layout(tiny()[0]).unit_of  # the job's model
    last_saved = run.resolve(6).sources
    versions = {s: load_file(str(out / "versions" / f"{s}.safetensors")) for s in {*last_saved.values(), 8}}
    drift = run.manifest(8).decision["drift"]
    checked = 0
    for unit, figures in drift.items():
        before = {k: v for k, v in versions[last_saved[unit]].items() if unit_of(k.split("/")[1]) == unit}
        for kind, bound in (("weight", WEIGHT_BOUND), ("moments", MOMENTS_BOUND)):
            exact = exact_drift(before, versions[8], kind)
            assert exact > 0 and abs(figures[kind] - exact) <= bound * exact, (unit, kind, figures[kind], exact)
            checked += 1
    assert checked == 2 * len(run.manifest(8).composite)


def test_fsdp2_full_resume_continues_bitwise(fsdp):
    _, results = fsdp
    for result in results:
        assert result["resumed"] == result["uninterrupted"]


def test_fsdp2_ranks_write_their_own_shards_about_evenly(fsdp):
    out, results = fsdp
    for save in zip(*(r["saves"] for r in results)):
        total = save[0]["bytes"]
        assert all(s["bytes"] == total for s in save)
        for s in save:
            assert 0.9 <= s["rank_bytes"] / (total / 2) <= 1.1, s
    manifest = Run(out / "parity").manifest(8)
    assert manifest.world_size == 2 and manifest.provider == "fsdp2"
    index = Run(out / "parity").unit_entry(8, "layer.1")
    assert [f.path for f in index.files] == ["packs/rank-00000.0.safetensors", "packs/rank-00001.0.safetensors"]  # small units: packed
    q = index.tensor("weight/model.layers.1.self_attn.q_proj.weight")
    assert sorted(c.offsets for c in q.chunks) == [[0, 0], [16, 0]]  # dim-0 shards, no full tensor anywhere


def test_ddp_snapshot_has_single_process_bytes_split_between_ranks(tmp_path, tokens):
    results = torchrun(2, "ddp", tmp_path)
    for result in results:
        assert result["restored"] == 4 and result["mismatches"] == []
    mismatches, _ = restore_in_one_process(tmp_path, "ddp")
    assert mismatches == []

    # The same model and policy in one process: the same tensor bytes (each rank's small units
    # share its pack file, whose header counts with its first unit: DDP splits one header in two).
    model, optimizer, scheduler = tiny()
    single = Tailor(tmp_path / "single", model, optimizer, scheduler, policy=Parity())
    for step in (1, 2, 3, 4):
        train(model, optimizer, scheduler, tokens, [step])
        if step % 2 == 0:
            single.save(step)
    ddp, one = Run(tmp_path / "ddp"), Run(tmp_path / "single")
    for step, save in zip((2, 4), zip(*(r["saves"] for r in results))):
        assert ddp.manifest(step).composite.keys() == one.manifest(step).composite.keys()
        for unit in ddp.manifest(step).units:
            assert len(ddp.unit_entry(step, unit).files) == 1  # written once, by one rank
        unit_total = sum(ddp.manifest(step).unit_bytes(u) for u in ddp.manifest(step).units)
        header = unit_total - sum(one.manifest(step).unit_bytes(u) for u in one.manifest(step).units)
        assert abs(header) <= 1024  # two headers for one: a few bytes of length and padding either way
        ranks = [s["rank_bytes"] for s in save]
        assert all(r > 0.3 * unit_total for r in ranks)  # both ranks wrote a share
        # Beyond the unit files: rank 1's own RNG state, and longer file names in the indexes.
        rank_state = sum(f.bytes for f in ddp.manifest(step).files if f.path.startswith("ranks/"))
        extra = ddp.manifest(step).total_bytes() - rank_state - header - one.manifest(step).total_bytes()
        assert 0 <= extra <= 40 * len(ddp.manifest(step).units)


def test_each_rank_saves_and_restores_its_own_stateful_objects(tmp_path):
    """Stateful objects are per rank, as the extras: at the saved world size each rank gets its
    own; in one process (a smaller world), rank 0's, and the report says the others were not used."""
    results = torchrun(2, "stateful", tmp_path)
    for rank, result in enumerate(results):
        assert result["restored"] == 2 and result["unmapped"] == []
        assert result["position"] == {"seen": 20 + rank, "order": [20 + rank] * 3}
    position = job_module().Position()
    report = Tailor(tmp_path / "stateful", *tiny(seed=11), stateful={"position": position}).restore()
    assert position.record() == {"seen": 20, "order": [20] * 3}
    assert "were not used (saved at world size 2)" in " ".join(report.unmapped)


@pytest.mark.parametrize("nproc, others", [(2, "rank 1 holds"), (4, "ranks 2, 3 hold")], ids=["2-stages", "2-stages-x-2-fsdp"])
def test_pipeline_stages_are_refused_on_every_rank_when_the_tailor_is_built(tmp_path, nproc, others):
    """Each rank keeps its stage's half of the layers under their original names (torchtitan's
    pipeline split), sharded over 2 data ranks at 4. Found: with drift, gloo aborted the job (2
    stages) or two ranks hung inside save (2 x 2); without, step 1 committed holding the first
    stage's units only and ``verify`` passed it. Now every rank refuses both Tailors at once,
    with one message, and nothing is written (the launch's timeout stands for a hang)."""
    results = torchrun(nproc, "pipeline", tmp_path, timeout=300)
    refusals = {outcome["refused"] for result in results for outcome in result["outcomes"]}
    assert [[o["drift"] for o in result["outcomes"]] for result in results] == [[False, True]] * nproc
    (refusal,) = refusals  # the same on every rank, drift on and off
    assert refusal.startswith("UnsupportedLayoutError: the ranks of this job hold different units of the model: "
                              f"{others} units [layer.2, layer.3, norm, head] that rank 0 does not; ")
    assert "lack units [embed, layer.0, layer.1] that rank 0 holds" in refusal.replace("lacks", "lack")
    assert "(pipeline-parallel stages) are not supported yet" in refusal
    assert not (tmp_path / "stages").exists()  # refused before the writer lock: nothing written


def test_a_rank_killed_during_a_save_fails_the_others_within_the_timeout(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), "kill", str(tmp_path)],
            env={**env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 0, outputs[0][1][-3000:]
    result = json.loads((tmp_path / "result-kill-0.json").read_text())
    # Rank 0 gave up on rank 1 at the timeout (its error says so) rather than waiting for it for
    # ever; how many seconds that took on a busy machine is not asserted.
    assert "rank(s) [1] did not report" in result["outcome"] and "within 5 s" in result["outcome"]
    run = Run(tmp_path / "killed")
    assert run.latest_step() == 2 and run.verify() == []
    model, optimizer, scheduler = tiny(seed=3)
    assert Tailor(run.root, model, optimizer, scheduler).restore().step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fsdp2_with_a_memory_tier_promotes_every_ranks_parts_and_restores_from_either(tmp_path):
    import shutil
    import uuid

    memory = Path("/dev/shm") / f"llmtailor-test-{uuid.uuid4().hex[:12]}"
    try:
        results = torchrun(2, "fsdp-tiers", tmp_path, TIER_DIR=str(memory))
        for result in results:  # restored at 2 ranks from the memory tier, every tensor its composite's
            assert result["restored"] == 8 and result["tier"] == str(memory) and result["mismatches"] == []
        # Rank 0 promotes (which saves, up to the last one at close(), depends on its pace).
        assert results[0]["promoted"][-1] == 8 and results[1]["promoted"] == []
        home = Run(tmp_path / "tiered")
        assert home.latest_step() == 8 and home.verify() == [] and home.manifest(8).world_size == 2
        assert Run(memory).steps() == [6, 7, 8]
        shutil.rmtree(memory)  # the node is lost: the run directory alone restores, in one process
        mismatches, report = restore_in_one_process(tmp_path, "tiered")
        assert mismatches == [] and report.step == 8 and report.saved_world_size == 2
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def test_fsdp2_async_saves_of_partly_frozen_units_equal_sync_ones_and_restore(tmp_path):
    """Each layer unit holds frozen and trained tensors: the async snapshots record the same
    kept frozen tensors as the synchronous ones, and restore to the composite's versions."""
    results = torchrun(2, "fsdp-frozen", tmp_path)
    assert [r["mismatches"] for r in results] == [[], []] and results[0]["restored"] == 6
    sync, async_ = Run(tmp_path / "sync" / "frozen"), Run(tmp_path / "async" / "frozen")
    for step in (4, 6):
        assert any(sync._stored_entry(step, unit).kept for unit in sync.manifest(step).units)
        for unit in sync.manifest(step).units:
            assert async_._stored_entry(step, unit) == sync._stored_entry(step, unit), f"step {step}, {unit}"


def test_fsdp2_refuses_a_unit_version_lacking_a_weight_on_every_rank_before_touching_anything(tmp_path):
    """A forged run (every checksum holds) whose composite's layer.1 lacks a weight: every rank
    refuses it from the indexes, naming the unit, the snapshot and the tensor, and no rank's
    live model or optimizer changed (FSDP2 loads by the keys a unit's index lists: without the
    check the weight would silently keep its live value)."""
    results = torchrun(2, "fsdp-lacking", tmp_path)
    for result in results:
        error = result["error"]
        assert error is not None and error.startswith("IntegrityError"), error
        assert f"unit 'layer.1' from snapshot {result['source']}" in error and "'model.layers.1.mlp.up_proj.weight'" in error
        assert "no rank's live state was changed" in error
        assert result["changed"] == []
