"""DeepSpeed ZeRO engines with real processes (``ds_job.py``): tailored saves from the engine,
restores at another world size and ZeRO stage, into one plain process, bf16 with fp32 masters.

Launches are few (each costs 10-20 s, most of it the start of its processes), and tests that
need the same processes share one (``ds_job.py`` runs several jobs in turn, a fresh engine
each). One launch at 2 ranks: ZeRO-2 saves, resumes bitwise and restores, then writes DeepSpeed's
own checkpoint, then bf16 with fp32 masters; then ZeRO-3 likewise and its own checkpoint, and an
engine with random-LTD on; then the odd shapes that end ZeRO partitions mid-row (several chunks
of a tensor in one rank's file) with several ZeRO-3 sub-groups per param group. One launch at 3 ranks restores both ZeRO-3 runs
under ZeRO-2, then the ZeRO-2 run under ZeRO-3. The plain ZeRO-3 run is restored under ZeRO-1 in
one process, each plain run into a plain torch model. One more launch at 2 ranks, on what the
first made: a restore that fails on one rank, a universal checkpoint loaded by DeepSpeed and an
imported DeepSpeed checkpoint resumed under ZeRO-3. The ranks of ``ds_job.py``'s launches are
forked from one fork server for the module that imported it (``DS_SERVER``: DeepSpeed,
transformers' Llama, torch and the ``PRELOAD`` of ds_job.py imported once for the module, not once
a launch), each launch one node as ``torchrun --standalone`` starts one (forked_nodes.py: torchrun's
environment and agent store); the Trainer's are forked from one process that imported its job
(``forked_jobs.rank_launch`` of ``hf_job.py``, its ``launch()``: the vanilla run, then its import
resumed by a TailorTrainer): what that test checks is the checkpoint the Trainer writes and its
import, not torchrun (tests/integrations launch the Trainer under torchrun). The ranks of a launch
share Python's ``str`` hash seed (one server, or one process, forks them all), where torchrun's
draw their own."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from forked_jobs import rank_launch, served_launch
from forked_nodes import ForkServers
from helpers import flip_unit_byte, tiny

from llmtailor import Tailor
from llmtailor.store.run import Run

pytest.importorskip("deepspeed")
JOB = Path(__file__).with_name("ds_job.py")
pytestmark = pytest.mark.slow
DS_SERVER = ForkServers(preload=("ds_job",), env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
"""The fork server of this module's launches (module docstring), started on the first, ended after
the module's last test (``ds_server``)."""


@pytest.fixture(scope="module", autouse=True)
def ds_server():
    yield
    DS_SERVER.stop()


def run_jobs(nproc: int, jobs: list[tuple[str, Path, int, str]], timeout: float = 600) -> None:
    """One launch of ``nproc`` ranks running ``(scenario[+scenario...], dir, stage, shape)`` jobs in
    turn; each scenario's results are read with ``results``."""
    for scenario, out, _, _ in jobs:
        for name in scenario.split("+"):  # a result read later is this launch's, never an earlier one's
            for stale in out.glob(f"result-{name}-*.json"):
                stale.unlink()
    proc = subprocess.run(  # every rank forked from the module's server, as rank_launch forks them from one process
        [*served_launch(DS_SERVER, nproc), str(JOB),
         *(str(arg) for job in jobs for arg in job)],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def results(out: Path, scenario: str, nproc: int) -> list[dict]:
    return [json.loads((out / f"result-{scenario}-{r}.json").read_text()) for r in range(nproc)]


def launch(nproc: int, scenario: str, out: Path, stage: int, shape: str = "plain", timeout: float = 600) -> list[dict]:
    run_jobs(nproc, [(scenario, out, stage, shape)], timeout)
    return results(out, scenario, nproc)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict[str, Path]:
    """The runs at 2 ranks, in turn in one launch (ZeRO-3 after ZeRO-2, as the universal
    checkpoint's launch has them): the ZeRO-2 run (``save``), DeepSpeed's own ZeRO-2 checkpoint
    in its DIR/ds and the bf16 run; the ZeRO-3 run (``save``), DeepSpeed's own ZeRO-3 checkpoint
    in its DIR/ds and the random-LTD runs (``ltd``); at each stage a run whose optimizer leaves
    out the embedding (``omitted``) and runs whose optimizer holds it frozen (``held``); the ZeRO-3 run of the odd shapes (``save``). By name, the
    directory of each."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("zero2", "zero3", "odd-zero3")}
    run_jobs(2, [("save+checkpoint+bf16+frozen+omitted+held", dirs["zero2"], 2, "plain"),
                 ("save+checkpoint+frozen+ltd+omitted+held", dirs["zero3"], 3, "plain"),
                 ("save", dirs["odd-zero3"], 3, "odd")])
    return dirs


@pytest.fixture(scope="module")
def zero3(two_rank_runs):
    """The ZeRO-3 run (``save``), then DeepSpeed's own ZeRO-3 checkpoint in DIR/ds."""
    out = two_rank_runs["zero3"]
    return out, results(out, "save", 2)


def test_zero3_parity_snapshot_restores_exactly_and_full_resumes_bitwise(zero3):
    out, results = zero3
    for rank, result in enumerate(results):
        assert result["restored"] == 6 and result["extra"] == {"rank": rank}
        assert result["mismatches"] == []
        assert result["resumed"] == result["uninterrupted"]
        assert result["global_steps"] == {"uninterrupted": 8, "resumed": 8}  # DeepSpeed's own counter, restored
    run = Run(out / "parity")
    manifest = run.manifest(6)
    assert manifest.provider == "deepspeed" and manifest.world_size == 2 and manifest.notes["zero_stage"] == 3
    assert "optimizer_step" in manifest.notes
    assert sorted(set(run.resolve().sources.values())) == [4, 6]
    # Masters, not low-precision copies: the weights are derived from them.
    keys = {t.key.split("/")[0] for t in run.unit_entry(6, "layer.0").tensors}
    assert keys == {"master", "optim"}


def test_each_rank_writes_about_half(zero3):
    _, results = zero3
    for save in zip(*(r["saves"] for r in results)):
        for s in save:
            assert 0.9 <= s["rank_bytes"] / (s["bytes"] / 2) <= 1.1, s


@pytest.fixture(scope="module")
def three_rank_restores(zero3, odd_zero3, zero2):
    """The restores at 3 ranks, in turn in one launch: both ZeRO-3 runs (plain, odd) under
    ZeRO-2, then the ZeRO-2 run under ZeRO-3; by run, each rank's result."""
    run_jobs(3, [("restore", zero3[0], 2, "plain"), ("restore", odd_zero3[0], 2, "odd"), ("restore", zero2[0], 3, "plain")])
    return {"plain": results(zero3[0], "restore", 3), "odd": results(odd_zero3[0], "restore", 3),
            "zero2": results(zero2[0], "restore", 3)}


def test_restore_under_zero2_at_3_ranks_and_zero1_in_one_process(zero3, three_rank_restores):
    out, _ = zero3
    for result in three_rank_restores["plain"]:
        assert result["restored"] == 6 and result["mismatches"] == []
    [single] = launch(1, "restore", out, stage=1)
    assert single["mismatches"] == [] and single["extra"] == {"rank": 0}


def assert_plain_torch_restore_matches(out: Path) -> None:
    """Restore a DeepSpeed run into a plain model + torch AdamW in this process: every weight and
    moment is its composite version, and each parameter gets its own unit's step."""
    from safetensors.torch import load_file

    from llmtailor.layouts import build_layout

    model, optimizer, scheduler = tiny(layers=4, hidden=32)
    report = Tailor(out / "parity", model, optimizer, scheduler).restore()
    assert report.saved_world_size == 2 and report.unmapped
    sources = Run(out / "parity").resolve().sources
    saved = {s: load_file(str(out / "versions" / f"{s}.safetensors")) for s in set(sources.values())}
    layout = build_layout(model)
    for name, param in model.named_parameters():
        step = sources[layout.unit_of(name)]
        assert torch.equal(param.detach(), saved[step][f"master/{name}"]), name
        assert torch.equal(optimizer.state[param]["exp_avg"], saved[step][f"optim/{name}/exp_avg"]), name
        assert optimizer.state[param]["step"].item() == step  # one optimizer step per training step here


def test_restore_into_a_plain_torch_model_uses_each_units_own_step(zero3):
    assert_plain_torch_restore_matches(zero3[0])


def test_a_random_ltd_engines_run_has_the_models_names_and_restores_with_or_without_it(zero3):
    """random-LTD wraps each decoder layer (``model.layers.1.random_ltd_layer.self_attn...``);
    DeepSpeed's own checkpoints leave the wrapper out of the names, and so does a Tailor: the run
    of a ZeRO-3 engine with random-LTD on holds the model's own names (what an HF export or a
    plain model takes), restores into an engine without random-LTD (it is turned off for the end
    of a training) and with it (its scheduler's state back), and DeepSpeed's own checkpoint of
    it, imported, restores into an engine with it; each trains on as the uninterrupted one did.
    Before, the run held the wrapper's names: refused by the engine without random-LTD, and the
    imported checkpoint refused by the one with it."""
    from llmtailor.layouts import Layout, build_layout

    out, _ = zero3
    for result in results(out, "ltd", 2):
        assert result["saved_ltd"]["consumed_layer_tokens"] > 0, result["saved_ltd"]
        for label, restored in result["restores"].items():
            assert restored["error"] is None, f"{label}: {restored['error']}"
            assert restored["losses"] == result["continued"], label
            assert restored["ltd"] in (None, result["saved_ltd"]), label
        assert result["restores"]["ltd ltd=True"]["ltd"] == result["saved_ltd"]
    model, _, _ = tiny(layers=4, hidden=32)
    assert Layout.from_record(Run(out / "ltd").manifest(3).layout).units == build_layout(model).units


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_no_optimizer_group_holds_is_saved_as_frozen_and_restored(two_rank_runs, stage):
    """An optimizer built over part of the model (here all but the embedding, which still requires
    grad): DeepSpeed trains the rest and leaves it out of its partitions, so it has no master and
    no optimizer state; a Tailor saves it as a frozen weight, restores it into a fresh engine and
    training goes on bit for bit (before: a KeyError from the provider's look-up of its partition
    at the first save, at both stages)."""
    out = two_rank_runs[f"zero{stage}"]
    for result in results(out, "omitted", 2):
        assert result["error"] is None, result["error"]
        assert result["mismatches"] == [] and result["resumed"] == result["continued"]
    assert Run(out / "omitted").unit_entry(3, "embed").tensors[0].key == "weight/model.embed_tokens.weight"


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_held_by_a_plain_optimizer_and_left_out_by_deepspeeds_restore_both_ways(two_rank_runs, stage):
    """``AdamW(model.parameters())`` over a model with a frozen embedding holds it; DeepSpeed's
    groups leave it out, and so does the record of a Tailor on the engine. A run of the plain
    model restores into the engine and one of the engine into the plain model, every weight the
    saved one (before: refused both ways, 'param groups differ')."""
    out = two_rank_runs[f"zero{stage}"]
    for result in results(out, "held", 2):
        for way in ("into_engine", "into_plain"):
            assert result[way]["error"] is None, f"{way}: {result[way]['error']}"
            assert result[way]["mismatches"] == [], way


@pytest.fixture(scope="module")
def zero2(two_rank_runs):
    """The ZeRO-2 run (``save``), then DeepSpeed's own ZeRO-2 checkpoint in DIR/ds, then the bf16
    run in DIR/bf16."""
    out = two_rank_runs["zero2"]
    return out, results(out, "save", 2)


def test_zero2_parity_restores_at_2_under_zero3_at_3_and_into_plain_torch_and_full_resumes_bitwise(zero2, three_rank_restores):
    out, results = zero2
    for rank, result in enumerate(results):
        assert result["restored"] == 6 and result["extra"] == {"rank": rank}
        assert result["mismatches"] == [] and result["resumed"] == result["uninterrupted"]
        for s in result["saves"]:
            assert 0.9 <= s["rank_bytes"] / (s["bytes"] / 2) <= 1.1, s
    assert Run(out / "parity").manifest(6).notes["zero_stage"] == 2
    for result in three_rank_restores["zero2"]:
        assert result["restored"] == 6 and result["mismatches"] == []
    assert_plain_torch_restore_matches(out)


def test_bf16_weights_are_the_restored_masters_cast(zero2):
    for result in results(zero2[0], "bf16", 2):
        assert result["mismatches"] == []
        assert result["lp_dtypes"] == ["torch.bfloat16"] and result["lp_mismatches"] == []


@pytest.fixture(scope="module")
def later_launch(zero3, zero2, tmp_path_factory) -> dict[str, Path]:
    """The 2-rank jobs on what the saves' launch made, in turn in one launch: the ZeRO-2 run's
    parity snapshots with a byte flipped in rank 1's piece of layer.3 (DIR/parity), restored
    under ZeRO-2 (``restore_fail``, first: every later job starts a fresh engine); DeepSpeed's
    own ZeRO-3 checkpoint (DIR/ds), imported (``import-deepspeed`` -> DIR/run) and assembled as a
    universal checkpoint (``assemble --format deepspeed`` -> DIR/universal), which a ZeRO-2 engine
    loads (``universal``), and the imported run restored into a ZeRO-3 engine that trains on
    (``resume_imported``). By name ("failing", "universal"), the directory of each."""
    import shutil

    from typer.testing import CliRunner

    from llmtailor.cli import app

    failing, universal = tmp_path_factory.mktemp("restore-fail"), tmp_path_factory.mktemp("universal")
    shutil.copytree(zero2[0] / "parity", failing / "parity")
    step = Run(failing / "parity").resolve().sources["layer.3"]
    flip_unit_byte(failing / "parity", step, "layer.3", rank=1)  # a byte of rank 1's piece of layer.3 (in its pack)
    shutil.copytree(zero3[0] / "ds", universal / "ds")  # made by the zero3 launch, after its run
    runner = CliRunner()
    result = runner.invoke(app, ["import-deepspeed", str(universal / "ds"), "-o", str(universal / "run")])
    assert result.exit_code == 0, result.output
    assert "not kept: client_state['args'] is a argparse.Namespace" in result.output, result.output
    result = runner.invoke(app, ["assemble", str(universal / "run"), "--format", "deepspeed", "-o",
                                 str(universal / "universal")])
    assert result.exit_code == 0, result.output
    run_jobs(2, [("restore_fail", failing, 2, "plain"), ("universal", universal, 2, "plain"),
                 ("resume_imported", universal, 3, "plain")])
    return {"failing": failing, "universal": universal}


def test_import_deepspeed_checkpoint_then_assemble_a_universal_checkpoint(zero3, later_launch, tmp_path):
    """engine.save_checkpoint (ZeRO-3, 2 ranks) -> import-deepspeed -> tensors equal DeepSpeed's
    own accessors and zero_to_fp32; -> assemble --format deepspeed -> a ZeRO-2 engine loads it;
    the imported run restored at 2 ranks trains on as the uninterrupted engine did. The engines
    draw from DeepSpeed's curriculum sampler: its state (data position, difficulty, numpy RNG)
    comes back through both (before: the import dropped it, so the assembled checkpoint held
    None, which DeepSpeed's load_checkpoint hands to the sampler: a TypeError)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    made = later_launch["universal"]  # the import and the assemble (exit status 0 each) made by the fixture
    [state] = results(zero3[0], "checkpoint", 2)[:1]
    assert state["global_steps"] == 3
    run = Run(made / "run")
    manifest = run.manifest(3)
    assert manifest.provider == "deepspeed" and run.read_global(3)["model_config"]["model_type"] == "llama"
    assert run.verify() == []
    reference = load_file(str(made / "ds" / "versions.safetensors"))
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(made / "ds"))
    checked = 0
    for unit in manifest.units:
        tensors, _ = run.read_unit(3, unit)
        for key, tensor in tensors.items():
            if key in reference:
                assert torch.equal(tensor, reference[key]), key
                checked += 1
            if key.startswith("master/"):
                assert torch.equal(tensor, fp32[key.split("/", 1)[1]]), key
    assert checked == len(reference)

    # The same checkpoint as a merge source (read through DeepSpeed's converter too).
    import yaml

    from llmtailor.merge import merge

    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"models": [{"model": str(made / "ds")}]}))
    merged = Run(merge(tmp_path / "plan.yaml", tmp_path / "merged").parent.parent)
    for key, tensor in merged.read_unit(3, "layer.1")[0].items():
        assert key not in reference or torch.equal(tensor, reference[key]), key

    # The later launch: DeepSpeed loaded the universal checkpoint (ZeRO-2); the imported run was
    # restored into a ZeRO-3 engine at 2 ranks, which trained on as the uninterrupted engine did, bit for bit.
    uninterrupted = results(zero3[0], "checkpoint", 2)
    sampler = uninterrupted[0]["sampler"]  # DeepSpeed's curriculum sampler as rank 0 saved it (what a load sets)
    assert sampler["curriculum_step"] > 0 and sampler["data_cluster_paths"], sampler
    for loaded in results(made, "universal", 2):
        assert loaded["loaded"] and loaded["global_steps"] == 3 and loaded["mismatches"] == []
        assert loaded["client_state"] == {"epoch": 1, "samples": 6}  # save_checkpoint's, through import and assemble
        assert loaded["sampler"] == sampler  # the data position, through import and assemble
    resumed_ranks = results(made, "resume_imported", 2)
    for rank, resumed in enumerate(resumed_ranks):
        assert resumed["restored"] == 3 and resumed["global_steps"] == 6, resumed
        # save_checkpoint's client_state comes back as restore()'s extra (its Namespace left out, named)
        assert {k: resumed["extra"].get(k) for k in ("epoch", "samples", "args")} == {"epoch": 1, "samples": 6, "args": None}
        assert resumed["losses"] == uninterrupted[rank]["continued"] and resumed["mismatches"] == []
        assert resumed["sampler"] == sampler  # the curriculum sampler's position, through the import
        # and through a Tailor's save (rank 0's, as DeepSpeed keeps it)
        assert resumed["restored_sampler"] == resumed_ranks[0]["saved_sampler"] != sampler


def test_a_deepspeed_merge_source_is_converted_once_never_written_as_a_run(zero2, tmp_path, monkeypatch):
    """A merge reads a DeepSpeed checkpoint from DeepSpeed's own conversion, unit by unit: the
    only runs written are the outputs (it was imported into a scratch run first, written twice
    before the output), and the output is, bit for bit, what a merge of the imported run makes."""
    import yaml
    from helpers import assert_same_tree, assert_same_training_state

    from llmtailor.interop.deepspeed.importer import import_deepspeed
    from llmtailor.merge import merge
    from llmtailor.outputs.run import RunSink

    import shutil

    shutil.copytree(zero2[0] / "ds", tmp_path / "ds")  # ZeRO-2's own checkpoint, made by the zero2 launch
    import_deepspeed(tmp_path / "ds", tmp_path / "imported")
    imported = Run(tmp_path / "imported")
    assert {k: imported.read_global(3)["extra"].get(k) for k in ("epoch", "samples")} == {"epoch": 1, "samples": 6}
    assert imported.manifest(3).notes["client_state_not_kept"] == ["client_state['args'] is a argparse.Namespace"]
    written, made = [], []
    write, mkdir = RunSink.write, os.mkdir
    monkeypatch.setattr(RunSink, "write", lambda sink, *a, **k: written.append(sink.run.root) or write(sink, *a, **k))
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: made.append(Path(path)) or mkdir(path, *a, **k))
    for name, source in (("direct", tmp_path / "ds"), ("via-run", tmp_path / "imported")):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"models": [{"model": str(source)}]}))
        merge(tmp_path / f"{name}.yaml", tmp_path / name)
    assert written == [tmp_path / "direct", tmp_path / "via-run"]
    outputs = (tmp_path / "direct", tmp_path / "via-run")
    assert not [p for p in made if p.name == "snapshots" and not any(p.is_relative_to(o) for o in outputs)]
    assert not list(tmp_path.glob(".direct.merge-*"))  # the conversion is gone
    direct, via_run = Run(tmp_path / "direct"), Run(tmp_path / "via-run")
    assert direct.steps() == via_run.steps() == [3]
    assert_same_training_state(direct, via_run, 3)
    assert_same_tree(direct.read_global(3), via_run.read_global(3), "global state")


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("config", ["config.json beside", "no config"])
def test_frozen_parameters_of_a_deepspeed_checkpoint_are_imported_as_zero_to_fp32_reads_them(two_rank_runs, tmp_path, stage, config):
    """A partly frozen model's checkpoint (engine.save_checkpoint, 2 ranks) keeps its frozen
    parameters apart (frozen_param_fragments: no master, no optimizer state): the import holds
    each, equal to the engine's weight and to DeepSpeed's zero_to_fp32, and a restore into a plain
    model gives them back (before: refused as not fitting its own config.json, "lacks
    ['model.embed_tokens.weight', ...]"; without the config, imported without them)."""
    import shutil

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from llmtailor.interop.deepspeed.importer import import_deepspeed

    out = two_rank_runs[f"zero{stage}"]
    [made] = results(out, "frozen", 2)[:1]
    assert made["frozen"] and all(name.startswith(("model.embed_tokens.", "model.layers.0.mlp.")) for name in made["frozen"])
    shutil.copytree(out / "frozen", tmp_path / "ds")
    if config == "no config":
        (tmp_path / "ds" / "config.json").unlink()
    import_deepspeed(tmp_path / "ds", tmp_path / "run")
    weights = load_file(str(tmp_path / "ds" / "weights.safetensors"))
    peer = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    run = Run(tmp_path / "run")
    imported = {key: tensor for unit in run.manifest(2).units for key, tensor in run.read_unit(2, unit)[0].items()}
    for name in made["frozen"]:
        assert torch.equal(imported[f"weight/{name}"], weights[name]) and torch.equal(imported[f"weight/{name}"], peer[name]), name
    assert {key.split("/", 1)[1] for key in imported if key.startswith(("master/", "weight/"))} == set(weights)
    if config == "config.json beside":
        import transformers

        from llmtailor.training_example import hf_param_groups

        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "ds"))
        for name, param in model.named_parameters():
            param.requires_grad_(name not in made["frozen"])
        Tailor(tmp_path / "run", model, torch.optim.AdamW(hf_param_groups(model))).restore()
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), weights[name]), name


def test_import_deepspeed_refuses_what_is_not_a_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from llmtailor.cli import app

    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["import-deepspeed", str(tmp_path / "empty"), "-o", str(tmp_path / "run")])
    assert result.exit_code == 2 and "not a DeepSpeed checkpoint" in result.output
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def odd_zero3(two_rank_runs):
    """ZeRO-3 x 2 on odd sizes (partitions end mid-row) with several sub-groups per param group
    (saved in the launch of the plain ZeRO-3 run)."""
    out = two_rank_runs["odd-zero3"]
    return out, results(out, "save", 2)


def test_odd_sizes_and_sub_groups_save_restore_and_resume_bitwise_under_zero3(odd_zero3):
    out, results = odd_zero3
    for rank, result in enumerate(results):
        assert result["restored"] == 6 and result["extra"] == {"rank": rank}
        assert result["mismatches"] == [] and result["resumed"] == result["uninterrupted"]
    # The shape that found the bug: one rank's file holds several chunks of one tensor.
    run = Run(out / "parity")
    entry = run.unit_entry(6, "layer.0")
    assert any(len(t.chunks) > len({c.file for c in t.chunks}) for t in entry.tensors)


def test_odd_zero3_run_restores_under_zero2_at_3_ranks(three_rank_restores):
    for result in three_rank_restores["odd"]:
        assert result["restored"] == 6 and result["mismatches"] == []


def test_a_restore_failing_on_one_rank_fails_every_rank_promptly_and_blocks_saving(later_launch):
    """A damaged file only rank 1 reads: rank 1's read fails; rank 0 must not wait in DeepSpeed's
    all-gather for it, and both must name rank 1's error; the half-restored engines refuse to save."""
    failed = results(later_launch["failing"], "restore_fail", 2)
    # Rank 0 names rank 1's error: it heard from rank 1, it did not wait out the Tailor's timeout
    # (that error would say "did not report"), however long the restore took on a busy machine.
    for result in failed:
        assert result["error"] is not None and result["error"].startswith("IntegrityError"), result
        assert "rank(s) [1]" in result["error"] and "checksum mismatch" in result["error"], result
        assert result["save_refused"] is not None and "restore() again" in result["save_refused"], result


def test_a_vanilla_trainer_deepspeed_checkpoint_imports_with_trainers_scheduler_and_state(tmp_path):
    """A plain HF Trainer run under DeepSpeed ZeRO-3 (2 processes, no llmtailor code) writes
    ``checkpoint-N/`` with ``global_stepN/`` beside Trainer's own ``scheduler.pt`` and
    ``trainer_state.json`` (its LR scheduler is not DeepSpeed's, so DeepSpeed's files hold none):
    ``import-deepspeed`` keeps both and each process's RNG (``rng_state_<rank>.pth``), with masters
    equal to DeepSpeed's own ``zero_to_fp32``, so the run assembles into a Trainer checkpoint (each
    rank's RNG file back) and merges as an HF checkpoint; ``import-hf`` names ``import-deepspeed``.
    The imported run, resumed by a TailorTrainer at 2 processes under ZeRO-3, continues exactly as
    the uninterrupted DeepSpeed run did (losses, LRs, batches, each process's RNG)."""
    import yaml
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from helpers import assert_same_tree
    from safetensors.torch import load_file
    from transformers.trainer_pt_utils import safe_globals
    from typer.testing import CliRunner

    from llmtailor.cli import app
    from llmtailor.merge import merge

    job = Path(__file__).parents[1] / "integrations" / "hf_job.py"
    checkpoint = tmp_path / "out" / "checkpoint-4"
    # One launch: the vanilla run trains to 6 (saving at 4); then, in the same process group,
    # rank 0 imports its checkpoint-4 and a TailorTrainer resumes that run at 2 processes to 6.
    proc = subprocess.run(
        [*rank_launch(2), str(job), "--out",
         str(tmp_path / "out"), "--result", str(tmp_path / "result.json"), "--trainer", "vanilla", "--deepspeed", "3",
         "--max-steps", "6", "--save-steps", "4", "--then", "--out", str(tmp_path / "resumed"), "--result",
         str(tmp_path / "resumed.json"), "--deepspeed", "3", "--max-steps", "6", "--save-steps", "100",
         "--import-deepspeed", str(checkpoint), "--resume", str(tmp_path / "imported")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # The imported run resumed at 2 processes continues as the uninterrupted DeepSpeed run did:
    # the same batches, LRs and losses (gathered from both ranks) bit for bit, and each process's
    # RNG as it was at the same step.
    uninterrupted, resumed = (json.loads((tmp_path / name).read_text()) for name in ("result.json", "resumed.json"))
    assert resumed["global_step"] == uninterrupted["global_step"] == 6
    assert resumed["losses"] == uninterrupted["losses"]  # 1..4 from the imported trainer_state.json's log
    for key in ("lrs", "batches"):
        assert resumed[key] == {step: v for step, v in uninterrupted[key].items() if int(step) > 4}, key
    assert [sorted(r) for r in resumed["rngs"]] == [["5", "6"]] * 2 and uninterrupted["rngs"][0] != uninterrupted["rngs"][1]
    assert resumed["rngs"] == [{s: v for s, v in r.items() if int(s) > 4} for r in uninterrupted["rngs"]]
    runner = CliRunner()
    refused = runner.invoke(app, ["import-hf", str(checkpoint), "-o", str(tmp_path / "hf-run")])
    assert refused.exit_code == 2 and "llmtailor import-deepspeed" in refused.output, refused.output
    assert not (tmp_path / "hf-run").exists()

    result = runner.invoke(app, ["import-deepspeed", str(checkpoint), "-o", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    run = Run(tmp_path / "run")
    state = run.read_global(4)
    assert_same_tree(state["lr_scheduler"], torch.load(checkpoint / "scheduler.pt", weights_only=True), "lr_scheduler")
    assert state["extra"]["trainer_state"] == json.loads((checkpoint / "trainer_state.json").read_text())
    # Under DDP, Trainer writes each process's RNG as rng_state_<rank>.pth: each rank's own, in a
    # snapshot of that world size (what each rank of a resume at 2 processes sets).
    assert not (checkpoint / "rng_state.pth").exists() and run.manifest(4).world_size == 2
    with safe_globals():
        saved_rngs = [torch.load(checkpoint / f"rng_state_{rank}.pth", weights_only=True) for rank in range(2)]
    for rank, saved in enumerate(saved_rngs):
        own = run.read_rank_state(4, rank)["rng"]
        assert_same_tree([own["python"], own["numpy"], own["torch"]], [saved["python"], saved["numpy"], saved["cpu"]], f"rank {rank}")
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    masters = {k[7:]: t for u in run.manifest(4).units for k, t in run.read_unit(4, u)[0].items() if k.startswith("master/")}
    assert masters.keys() == fp32.keys() and all(torch.equal(masters[k], fp32[k]) for k in fp32)

    result = runner.invoke(app, ["assemble", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    exported = tmp_path / "hf" / "checkpoint-4"
    assert_same_tree(torch.load(exported / "scheduler.pt", weights_only=True),
                     torch.load(checkpoint / "scheduler.pt", weights_only=True), "scheduler.pt")
    assert json.loads((exported / "trainer_state.json").read_text())["log_history"] == state["extra"]["trainer_state"]["log_history"]
    assert sorted(p.name for p in exported.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    with safe_globals():
        assert_same_tree([torch.load(exported / f"rng_state_{rank}.pth", weights_only=True) for rank in range(2)], saved_rngs)
    # As a merge source straight into a Trainer checkpoint (DeepSpeed holds fp32 masters, no weights): depth up-scaled.
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"slices": [
        {"sources": [{"model": str(checkpoint), "layer_range": [0, 2]}]}, {"sources": [{"model": str(checkpoint), "layer_range": [1, 4]}]}]}))
    merged = merge(tmp_path / "plan.yaml", tmp_path / "merged", format="hf")
    assert (merged / "scheduler.pt").is_file() and (merged / "optimizer.pt").is_file()
    weights = load_file(merged / "model.safetensors")
    assert torch.equal(weights["model.layers.2.mlp.up_proj.weight"], fp32["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(weights["lm_head.weight"], fp32["lm_head.weight"]) and len(weights) == len(fp32) + 9
