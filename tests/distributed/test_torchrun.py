"""Distributed saves and restores with real processes: gloo, CPU (``torch_job.py``), each launch one
node as ``torchrun`` starts it, its ranks forked from fork servers (``helpers.node_launches``;
tests/integrations run torchrun itself).

Launches are few and batched (each costs 10-20 s, most of it the start of its processes): one
2-rank launch runs, in turn, the 2-rank scenarios of several tests, each in a directory of its
own (an FSDP2 job that trains, saves, resumes and restores; a DDP job; per-rank stateful
objects; partly frozen units; a forged run refused; a fallback past damage; pipeline stages; a
memory tier); one 4-rank launch the 4-rank ones (dp x tp, pipeline stages x FSDP2, pipeline x
tp, and the 2-rank pipeline run restored into 4 stages); a 3-rank launch restores the FSDP2 run
and the dp x tp run in turn; a 2-rank launch restores the 4-rank pipeline run into 2 stages; two
ranks for the SIGKILL case, each run to its end (``statuses_of``), where torchrun would kill the
surviving rank itself."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

import pytest
import torch
from helpers import MOMENTS_BOUND, WEIGHT_BOUND, exact_drift, file_rank, node_launches, tiny, train, wait_launches

from llmtailor import Parity, Tailor
from llmtailor.store.run import Run

JOB = Path(__file__).with_name("torch_job.py")
pytestmark = pytest.mark.slow


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def read_results(out: Path, scenario: str, nproc: int) -> list[dict]:
    return [json.loads((out / f"result-{scenario}-{r}.json").read_text()) for r in range(nproc)]


def torchrun_jobs(nproc: int, jobs: list[tuple[str, Path]], timeout: float = 600, **more_env: str) -> None:
    """One launch at ``nproc`` ranks running the ``(scenario, dir)`` jobs in turn; past ``timeout``
    (a hang) every rank is killed. The launch is one node as ``torchrun --nnodes 1`` starts it,
    each rank forked from a fork server of its own (``helpers.node_launches``: torchrun's
    environment and agent store, a hash seed per rank; the imports paid once for the directory)."""
    [node] = node_launches(JOB, lambda _: [arg for job in jobs for arg in job], lambda _: {**env(), **more_env},
                           nodes=1, per_node=nproc, own_session=True)
    [(stdout, stderr)] = wait_launches([node], timeout)  # past it, the node and its ranks are ended
    assert node.returncode == 0, f"launch of {[scenario for scenario, _ in jobs]}: " + stdout[-4000:] + stderr[-6000:]


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


SHARED_2_RANKS = ("fsdp-train", "ddp", "stateful", "fsdp-frozen", "fsdp-lacking", "fsdp-fallback", "pipeline-freeze",
                  "fsdp-tiers", "pipeline")
SHARED_4_RANKS = ("mesh", "pipeline-tp", "pipeline")
"""Each launch's scenarios, in turn; ``pipeline`` last, as it ends with a refused ``Tailor``."""


@pytest.fixture(scope="module")
def memory_tier():
    """A fresh directory in host memory (/dev/shm) for ``fsdp-tiers``'s tier, removed afterwards."""
    memory = Path("/dev/shm") / f"llmtailor-test-{uuid.uuid4().hex[:12]}"
    yield memory
    shutil.rmtree(memory, ignore_errors=True)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, memory_tier) -> dict[str, Path]:
    """The directory of each scenario of ``SHARED_2_RANKS``, all run in one 2-rank launch (the
    tests share the ranks' start-up, not their files)."""
    dirs = {scenario: tmp_path_factory.mktemp(scenario) for scenario in SHARED_2_RANKS}
    torchrun_jobs(2, list(dirs.items()), timeout=1800, TIER_DIR=str(memory_tier))  # a hang guard for nine jobs on a busy machine
    return dirs


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, two_ranks) -> dict[str, Path]:
    """The directory of each scenario of ``SHARED_4_RANKS``, run in one 4-rank launch, which
    then restores the 2-rank ``pipeline`` run into 4 stages (``pipeline-restore-4``, results in
    its directory)."""
    dirs = {scenario: tmp_path_factory.mktemp(scenario) for scenario in SHARED_4_RANKS}
    jobs = list(dirs.items())
    torchrun_jobs(4, [*jobs[:-1], ("pipeline-restore-4", two_ranks["pipeline"]), jobs[-1]], timeout=1800)
    return dirs


@pytest.fixture(scope="module")
def pipelines(two_ranks, four_ranks) -> dict[int, Path]:
    """The directory of the ``pipeline`` run at 2 and at 4 ranks, each restored into other stages
    (the 4-rank run into 2 stages here, in a launch of its own; the 2-rank one by ``four_ranks``)."""
    torchrun_jobs(2, [("pipeline-restore-2", four_ranks["pipeline"])])
    return {2: two_ranks["pipeline"], 4: four_ranks["pipeline"]}


@pytest.fixture(scope="module")
def fsdp(two_ranks):
    out = two_ranks["fsdp-train"]
    return out, read_results(out, "fsdp-train", 2)


@pytest.fixture(scope="module")
def mesh(four_ranks):
    """dp 2 x tp 2 at 4 ranks: saves into DIR/mesh, restored in the same job (``mesh``)."""
    out = four_ranks["mesh"]
    return out, read_results(out, "mesh", 4)


@pytest.fixture(scope="module")
def three_ranks(fsdp, mesh) -> dict[str, list[dict]]:
    """The FSDP2 run and the dp x tp run, each restored into FSDP2 at 3 ranks, in turn, in one launch."""
    torchrun_jobs(3, [("fsdp-restore", fsdp[0]), ("fsdp-restore-mesh", mesh[0])])
    return {"parity": read_results(fsdp[0], "fsdp-restore", 3), "mesh": read_results(mesh[0], "fsdp-restore-mesh", 3)}


def test_fsdp2_parity_restores_exact_versions_at_world_sizes_2_3_and_1(fsdp, three_ranks):
    out, results = fsdp
    for rank, result in enumerate(results):  # restored at 2, in the same job
        assert result["restored"] == 8 and result["mismatches"] == []
        assert result["extra"] == {"rank": rank, "next": 9} and result["unmapped"] == []
    sources = Run(out / "parity").resolve().sources
    assert sources["layer.1"] == 8 and sources["layer.0"] == 6  # a real composite
    for rank, result in enumerate(three_ranks["parity"]):
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


def test_ddp_snapshot_has_single_process_bytes_split_between_ranks(two_ranks, tokens):
    tmp_path = two_ranks["ddp"]  # this test's alone
    results = read_results(tmp_path, "ddp", 2)
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


def test_each_rank_saves_and_restores_its_own_stateful_objects(two_ranks):
    """Stateful objects are per rank, as the extras: at the saved world size each rank gets its
    own; in one process (a smaller world), rank 0's, and the report says the others were not used."""
    tmp_path = two_ranks["stateful"]
    results = read_results(tmp_path, "stateful", 2)
    for rank, result in enumerate(results):
        assert result["restored"] == 2 and result["unmapped"] == []
        assert result["position"] == {"seen": 20 + rank, "order": [20 + rank] * 3}
    position = job_module().Position()
    report = Tailor(tmp_path / "stateful", *tiny(seed=11), stateful={"position": position}).restore()
    assert position.record() == {"seen": 20, "order": [20] * 3}
    assert "were not used (saved at world size 2)" in " ".join(report.unmapped)


@pytest.mark.parametrize("nproc, into", [(2, (4, 4)), (4, (2, 2))], ids=["2-stages", "2-stages-x-2-fsdp"])
def test_pipeline_stages_save_with_parity_and_restore_into_other_stages_and_into_one_process(pipelines, nproc, into):
    """Each rank keeps its stage's half of the layers under their original names (torchtitan's
    pipeline split), sharded over 2 data ranks at 4. Found before: with drift, gloo aborted the
    job (2 stages) or two ranks hung inside save (2 x 2); without, a snapshot committed holding
    the first stage's units only. Now: Parity saves with drift commit every unit, each written
    by its stage; fresh stages restore every tensor, the scheduler and the groups of their own
    stage; so do other stages (2 -> 4 stages; 2 x 2 -> 2 x 1) and one plain process; a layer cut
    between the stages is refused on every rank with one message (the launch's timeout stands
    for a hang); the HF and DeepSpeed exports hold every stage's groups and state."""
    tmp_path = pipelines[nproc]
    results = read_results(tmp_path, "pipeline", nproc)
    data = nproc // 2
    run = Run(tmp_path / "stages")
    units = list(run.manifest(6).layout["units"])
    assert units == ["embed", "layer.0", "layer.1", "layer.2", "layer.3", "norm", "head"]
    assert run.resolve(6).sources == {"embed": 6, "layer.0": 6, "layer.1": 4, "layer.2": 6, "layer.3": 4,
                                      "norm": 6, "head": 6}
    assert run.verify() == [] and run.manifest(6).world_size == nproc
    for step in (4, 6):  # drift of every unit, measured over both stages (one all-reduce of one size)
        assert all(figures["weight"] is not None and figures["weight"] > 0
                   for figures in run.manifest(step).decision["drift"].values()), step
    for rank, result in enumerate(results):
        assert result["restored"] == 6 and result["mismatches"] == [], result
        assert result["extra"] == {"rank": rank} and result["unmapped"] == []
        assert result["scheduler"] == [True, 6] and result["groups"] is True
    for unit in units:  # each unit's files written by the ranks of the stage holding it
        stage = 0 if unit in ("embed", "layer.0", "layer.1") else 1
        writers = {file_rank(f.path) for f in run.unit_entry(run.resolve(6).sources[unit], unit).files}
        assert writers and writers <= set(range(stage * data, (stage + 1) * data)), (unit, writers)
    refusals = {result["refused"] for result in results}
    (refusal,) = refusals  # the same on every rank
    assert refusal is not None and refusal.startswith(
        "UnsupportedLayoutError: the ranks of this job hold different units of the model: "), refusal
    assert "Units [layer.2] are held by ranks holding different units" in refusal
    assert not (tmp_path / "split").exists()  # refused before the writer lock: nothing written

    mismatches, report = restore_in_one_process(tmp_path, "stages")
    assert mismatches == [] and report.step == 6 and report.saved_world_size == nproc
    check_exports_hold_every_stage(tmp_path / "stages", tmp_path / "exports")
    world, stages = into
    for result in read_results(tmp_path, f"pipeline-restore-{stages}", world):
        assert result["restored"] == 6 and result["mismatches"] == [] and result["scheduler"][1] == 6, result


def test_frozen_reports_are_exchanged_only_when_a_stage_has_news_and_the_stages_stay_agreed(two_ranks):
    """The frozen plan's exchange rides on the save's drift all-reduce as one flag: skipped
    while no rank's frozen tensors change, made on every rank when one stage alone freezes a
    weight (a rank deciding by itself would hang the other; ``timeout=60`` stands for that).
    Found before: every save exchanged (6 of 6). The weight is written once after it froze, the
    later versions keep it, and fresh stages restore every tensor."""
    tmp_path = two_ranks["pipeline-freeze"]
    results = read_results(tmp_path, "pipeline-freeze", 2)
    # The first save; step 3 (the freeze: news on stage 1); the save after its unit wrote it.
    assert [result["exchanges"] for result in results] == [3, 3], results
    for result in results:
        assert result["restored"] == 6 and result["mismatches"] == [], result
    run = Run(tmp_path / "stages")
    key = "weight/" + job_module().FROZEN_MID_RUN
    wrote = [step for step in range(3, 7) if "layer.3" in run.manifest(step).units
             and key in {t.key for t in run._stored_entry(step, "layer.3").tensors}]
    kept = [step for step in range(3, 7) if "layer.3" in run.manifest(step).units
            and key in run._stored_entry(step, "layer.3").kept]
    assert len(wrote) == 1 and kept and min(kept) > wrote[0], (wrote, kept)
    assert run.verify() == []


def test_tensor_parallel_inside_pipeline_stages_saves_with_parity_and_restores_into_stages_and_one_process(four_ranks):
    """pp 2 x tp 2 (docs/distributed.md's ``parallelize_stage``: each stage's linears tensor
    parallel over its ``tp`` sub-mesh, its embedding, norms and head whole on both of its
    ranks): Parity saves with drift commit every unit once, each written by its stage; fresh
    stages of the same layout and one plain process restore every weight and optimizer tensor
    to its composite version, and the scheduler and groups of their own stage."""
    tmp_path = four_ranks["pipeline-tp"]
    results = read_results(tmp_path, "pipeline-tp", 4)
    run = Run(tmp_path / "stages")
    assert run.verify() == [] and run.manifest(6).world_size == 4
    assert run.resolve(6).sources["layer.0"] == 6 and run.resolve(6).sources["layer.1"] == 4  # a real composite
    for rank, result in enumerate(results):
        assert result["restored"] == 6 and result["mismatches"] == [], result
        assert result["extra"] == {"rank": rank} and result["unmapped"] == []
        assert result["scheduler"] == [True, 6] and result["groups"] is True
    for unit in run.manifest(6).layout["units"]:  # written by the ranks of the stage holding it, each byte once
        stage = 0 if unit in ("embed", "layer.0", "layer.1") else 1
        entry = run.unit_entry(run.resolve(6).sources[unit], unit)
        writers = {file_rank(f.path) for f in entry.files}
        assert writers and writers <= {2 * stage, 2 * stage + 1}, (unit, writers)
    one_copy = stage_versions(tmp_path / "versions")[2]  # each byte once: the chunks hold one copy of the state
    written = {t.key: sum(math.prod(c.shape) for c in t.chunks)
               for unit in run.manifest(2).units for t in run.unit_entry(2, unit).tensors}
    assert written == {key: value.numel() for key, value in one_copy.items()}
    mismatches, report = restore_in_one_process(tmp_path, "stages")
    assert mismatches == [] and report.step == 6 and report.saved_world_size == 4
    check_exports_hold_every_stage(tmp_path / "stages", tmp_path / "exports")


def stage_versions(folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Step -> every tensor's full value at that step, from the stages' version files (``torch_job``)."""
    from safetensors.torch import load_file

    out: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(folder.glob("*.stage*.safetensors")):
        out.setdefault(int(path.name.split(".")[0]), {}).update(load_file(str(path)))
    return out


def check_exports_hold_every_stage(run_dir: Path, out: Path) -> None:
    """A run saved by pipeline stages exports (HF Trainer checkpoint, DeepSpeed universal) with
    the optimizer of the whole model: every parameter in the groups, with its state, and each
    group's hyperparameters those every stage saved. Found before: both read rank 0's global
    state only, stage 0's groups: the DeepSpeed export wrote the other stage's parameters as
    buffers, without their optimizer state; the HF one refused, naming a parameter of stage 1."""
    from llmtailor.interop.deepspeed.export import MODEL_STATES, export_deepspeed
    from llmtailor.interop.hf.export import export_hf
    from llmtailor.interop.hf.model import trainer_param_groups
    from llmtailor.layouts import build_layout
    from llmtailor.store.keys import optim_key

    run = Run(run_dir)
    names = [name for name, _ in tiny()[0].named_parameters()]
    stages = run.stage_states(6)
    assert len(stages) == 2
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in stages[0][1]["optimizer_groups"]]
    saved = torch.load(export_hf(run, None, out / "hf") / "optimizer.pt", weights_only=True)
    numbered = sorted(i for group in saved["param_groups"] for i in group["params"])
    assert numbered == list(range(len(names))) and sorted(saved["state"]) == numbered
    versions = stage_versions(run_dir.parent / "versions")
    order = [name for group in trainer_param_groups(run.read_global(6)["model_config"]) for name in group]
    unit_of, sources = build_layout(tiny()[0]).unit_of, run.resolve(6).sources
    for index, name in enumerate(order):  # each parameter's state its composite version's
        assert torch.equal(saved["state"][index]["exp_avg"], versions[sources[unit_of(name)]][optim_key(name, "exp_avg")]), name
    assert [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]] == hyper
    states = torch.load(export_deepspeed(run, None, out / "ds") / MODEL_STATES, weights_only=False)
    assert sorted(n for shapes in states["param_shapes"] for n in shapes) == sorted(names)
    assert states["buffer_names"] == [] and all((out / "ds" / "global_step6" / "zero" / n / "exp_avg.pt").is_file() for n in names)


def test_a_rank_killed_during_a_save_fails_the_others_within_the_timeout(tmp_path):
    statuses = tmp_path / "statuses.json"  # each rank runs to its end: torchrun would kill the survivor itself
    [launch] = node_launches(JOB, lambda _: ["kill", tmp_path], lambda _: env(), nodes=1, per_node=2, own_session=True,
                             statuses_of=lambda _: statuses)
    [(_, stderr)] = wait_launches([launch])
    assert launch.returncode == 0, stderr[-3000:]
    codes = json.loads(statuses.read_text())
    assert codes[1] == -signal.SIGKILL, (codes, stderr[-3000:])
    assert codes[0] == 0, (codes, stderr[-3000:])
    result = json.loads((tmp_path / "result-kill-0.json").read_text())
    # Rank 0 gave up on rank 1 at the timeout (its error says so) rather than waiting for it for
    # ever; how many seconds that took on a busy machine is not asserted.
    assert "rank(s) [1] did not report" in result["outcome"] and "within 5 s" in result["outcome"]
    run = Run(tmp_path / "killed")
    assert run.latest_step() == 2 and run.verify() == []
    model, optimizer, scheduler = tiny(seed=3)
    assert Tailor(run.root, model, optimizer, scheduler).restore().step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fsdp2_with_a_memory_tier_promotes_every_ranks_parts_and_restores_from_either(two_ranks, memory_tier):
    tmp_path, memory = two_ranks["fsdp-tiers"], memory_tier
    results = read_results(tmp_path, "fsdp-tiers", 2)
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


def test_fsdp2_async_saves_of_partly_frozen_units_equal_sync_ones_and_restore(two_ranks):
    """Each layer unit holds frozen and trained tensors: the async snapshots record the same
    kept frozen tensors as the synchronous ones, and restore to the composite's versions."""
    tmp_path = two_ranks["fsdp-frozen"]
    results = read_results(tmp_path, "fsdp-frozen", 2)
    assert [r["mismatches"] for r in results] == [[], []] and results[0]["restored"] == 6
    sync, async_ = Run(tmp_path / "sync" / "frozen"), Run(tmp_path / "async" / "frozen")
    for step in (4, 6):
        assert any(sync._stored_entry(step, unit).kept for unit in sync.manifest(step).units)
        for unit in sync.manifest(step).units:
            assert async_._stored_entry(step, unit) == sync._stored_entry(step, unit), f"step {step}, {unit}"


def test_fsdp2_refuses_a_unit_version_lacking_a_weight_on_every_rank_before_touching_anything(two_ranks):
    """A forged run (every checksum holds) whose composite's layer.1 lacks a weight: every rank
    refuses it from the indexes, naming the unit, the snapshot and the tensor, and no rank's
    live model or optimizer changed (FSDP2 loads by the keys a unit's index lists: without the
    check the weight would silently keep its live value)."""
    tmp_path = two_ranks["fsdp-lacking"]
    results = read_results(tmp_path, "fsdp-lacking", 2)
    for result in results:
        error = result["error"]
        assert error is not None and error.startswith("IntegrityError"), error
        assert f"unit 'layer.1' from snapshot {result['source']}" in error and "'model.layers.1.mlp.up_proj.weight'" in error
        assert "no rank's live state was changed" in error
        assert result["changed"] == []


def test_tensor_parallel_linears_and_fsdp2_write_each_byte_once_and_restore_into_any_layout(mesh, three_ranks):
    """dp 2 x tp 2, tensor parallel on the attention and MLP linears only (the snippet of
    docs/distributed.md): the embedding, norms and head live on the ``dp`` sub-mesh, the linears
    on both. Found: the first save failed on every rank with a raw pydantic ValidationError
    ("chunks cover 16384 of 8192 elements and overlap"): both tensor-parallel ranks wrote the
    same chunks of every tensor on the ``dp`` mesh. Now each chunk is written by one rank and
    the run restores into the same layout, into FSDP2 alone at 4 and 3 ranks (tp 2 -> 1, dp 2
    -> 3) and into one process, every weight and optimizer tensor its composite's version."""
    from safetensors.torch import load_file

    tmp_path, results = mesh
    for result in results:
        for layout in ("same", "fsdp"):  # restored at 4 ranks: dp 2 x tp 2, and FSDP2 over 4 (tp 1)
            assert result[layout]["restored"] == 4 and result[layout]["mismatches"] == [], (layout, result[layout])
    run = Run(tmp_path / "mesh")
    assert run.verify() == [] and run.manifest(4).world_size == 4
    assert run.resolve().sources["layer.0"] == 2 and run.resolve().sources["layer.1"] == 4  # a real composite
    # Each byte once: the chunks of every tensor tile it (the index's validation) and hold as many
    # bytes as one copy of the state; the tensors on the dp mesh only have a copy on each tp rank:
    # the embedding's are written by the tp-0 ranks, the head's by the tp-1 ranks (balanced by bytes).
    one_copy = load_file(str(tmp_path / "versions" / "2.safetensors"))
    written = {t.key: sum(math.prod(c.shape) for c in t.chunks)
               for unit in run.manifest(2).units for t in run.unit_entry(2, unit).tensors}
    assert written == {key: value.numel() for key, value in one_copy.items()}
    for unit, ranks in (("embed", (0, 2)), ("head", (1, 3))):
        assert sorted(file_rank(f.path) for f in run.unit_entry(2, unit).files) == list(ranks)
    q = run.unit_entry(2, "layer.0").tensor("weight/model.layers.0.self_attn.q_proj.weight")
    assert len(q.chunks) == 4  # dp x tp shards, one per rank
    assert [(r["restored"], r["mismatches"]) for r in three_ranks["mesh"]] == [(4, [])] * 3
    mismatches, report = restore_in_one_process(tmp_path, "mesh")
    assert mismatches == [] and report.saved_world_size == 4


def test_fsdp2_fallback_passes_over_a_composite_damaged_in_one_ranks_part_on_every_rank(two_ranks):
    """restore(fallback=True) verifies while it loads: the rank that reads the damaged bytes
    fails, the ranks agree, every rank passes over that composite and loads the previous one."""
    tmp_path = two_ranks["fsdp-fallback"]
    results = read_results(tmp_path, "fsdp-fallback", 2)
    assert Run(tmp_path / "fallback").resolve().sources["layer.0"] == 6
    for result in results:
        assert result["restored"] == 4 and result["mismatches"] == []
        assert list(result["skipped"]) == ["6"] and "checksum mismatch" in result["skipped"]["6"]
