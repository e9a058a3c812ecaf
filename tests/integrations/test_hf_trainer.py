"""TailorTrainer with the real Hugging Face Trainer, each run a fresh process (hf_job.py):
crash by SIGKILL after a save, resume with ``train(resume_from_checkpoint=True)``, and a
vanilla Trainer process (no llmtailor code) resuming from ``llmtailor assemble --format hf``."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from forked_jobs import run_in_turn, run_jobs, served_launch
from forked_nodes import ForkServers
from helpers import standalone_launch, tree_digest
from typer.testing import CliRunner

from llmtailor import Parity
from llmtailor.cli import app
from llmtailor.cli.assemble import register
from llmtailor.errors import ConfigError
from llmtailor.integrations.hf import TailorTrainer
from llmtailor.store.run import Run

JOB = Path(__file__).with_name("hf_job.py")
MODELS = {"llama": [], "qwen2": ["--tie"]}  # untied Llama, Qwen2 with tied embeddings
CRASH_AT, LAST = 8, 12
SERVER = ForkServers(preload=("torch", "torch.distributed", "transformers.trainer", "transformers.models.llama.modeling_llama",
                              "deepspeed", "llmtailor", "llmtailor.integrations.hf"),
                     env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
"""The fork server of the DeepSpeed test's ranks (forked_nodes.py), ended after the module's
last test (``fork_server``)."""


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    yield
    SERVER.stop()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process jobs of this module's tests, in two launches of forked jobs
    (forked_jobs.py: torch and transformers imported once for all; each job a process of its
    own, the jobs of a launch at once: none touches another's run). First the uninterrupted runs
    and the runs SIGKILLed after their save at step 8: "reference-<family>" (sync saves) and
    "crashed-<family>-<policy>" (llama full, qwen2 parity and full). What each killed run held
    then is recorded in "after-crash" (its steps, its composite, the checkpoint-N/ directories
    beside it). Then ``assemble --format hf`` of each full run's step 8 (CliRunner results in
    "assembled", checkpoints under "hf-<family>"), and the resumes, each from another process
    than the one killed: "resumed-llama-full", "resumed-qwen2-parity" (dumping what it loaded)
    and "vanilla-<family>" (a vanilla Trainer from the assembled checkpoint); with them "async"
    (the llama reference's job with async saves: another interpreter than the reference's, as
    a run of its own would be)."""
    root = tmp_path_factory.mktemp("hf")

    def spec(name: str, out: str, *flags: str) -> tuple[list[str], Path]:
        return ["--out", str(root / out), "--result", str(root / f"{name}.json"), *flags], root / f"{name}.json"

    crashed = {(family, policy): f"crashed-{family}-{policy}" for family, policy in
               [("llama", "full"), ("qwen2", "parity"), ("qwen2", "full")]}
    done = run_jobs(JOB, {
        **{f"reference-{family}": spec(f"reference-{family}", f"reference-{family}", "--family", family, *flags)
           for family, flags in MODELS.items()},
        **{name: spec(name, name, "--family", family, *MODELS[family], "--policy", policy, "--crash-at", str(CRASH_AT))
           for (family, policy), name in crashed.items()},
    }, root / "first", together=True)
    after_crash = {name: (Run(root / name / "tailored").steps(), Run(root / name / "tailored").resolve(),
                          list((root / name).glob("checkpoint-*")))
                   for name in crashed.values()
                   if (root / name / "tailored").is_dir() and Run(root / name / "tailored").steps()}
    register(app)
    assembled = {family: CliRunner().invoke(app, ["assemble", str(root / f"crashed-{family}-full" / "tailored"), "--step",
                                                  str(CRASH_AT), "--format", "hf", "-o", str(root / f"hf-{family}")])
                 for family in MODELS}
    done |= run_jobs(JOB, {
        "resumed-llama-full": spec("resumed-llama-full", "crashed-llama-full", "--family", "llama", "--resume", "true"),
        "resumed-qwen2-parity": spec("resumed-qwen2-parity", "crashed-qwen2-parity", "--family", "qwen2", "--tie",
                                     "--policy", "parity", "--resume", "true", "--dump", str(root / "dump.pt")),
        **{f"vanilla-{family}": spec(f"vanilla-{family}", f"vanilla-{family}", "--trainer", "vanilla", "--resume",
                                     str(root / f"hf-{family}" / f"checkpoint-{CRASH_AT}")) for family in MODELS},
        "async": spec("async", "async", "--async"),
    }, root / "second", together=True)
    return {"root": root, "jobs": done, "after-crash": after_crash, "assembled": assembled}


@pytest.mark.slow
def test_full_policy_resume_in_fresh_process_logs_the_same_losses_bit_for_bit(one_process):
    jobs, out = one_process["jobs"], one_process["root"] / "crashed-llama-full"
    reference = jobs["reference-llama"].result()
    jobs["crashed-llama-full"].result(crash=True)
    steps, _, checkpoints = one_process["after-crash"]["crashed-llama-full"]
    assert steps == [4, 8]
    assert not checkpoints, "Trainer's own checkpoint dirs must not be written"

    resumed = jobs["resumed-llama-full"].result()
    assert resumed["global_step"] == LAST
    # One line says what was restored.
    said = [line for line in resumed["stdout"].splitlines() if line.startswith("llmtailor:")]
    assert said == [f"llmtailor: resumed from the composite of step {CRASH_AT} in {out / 'tailored'} (every unit from step {CRASH_AT})"]
    # log_history comes back from the snapshot's TrainerState: steps 1..8 logged before the crash.
    assert resumed["losses"] == reference["losses"]
    assert sorted(map(int, resumed["batches"])) == list(range(CRASH_AT + 1, LAST + 1))
    assert resumed["batches"] == {s: reference["batches"][s] for s in resumed["batches"]}
    assert resumed["params"] == reference["params"]
    assert Run(out / "tailored").steps() == [4, 8, 12]
    assert not [p for p in out.iterdir() if p.name.startswith(".tailor-resume-")], "temporary export left behind"


@pytest.mark.slow
def test_parity_resume_restores_composite_versions_step_lr_and_data_position(one_process):
    jobs, out = one_process["jobs"], one_process["root"] / "crashed-qwen2-parity"
    reference = jobs["reference-qwen2"].result()
    jobs["crashed-qwen2-parity"].result(crash=True)
    run = Run(out / "tailored")
    _, composite, _ = one_process["after-crash"]["crashed-qwen2-parity"]
    assert composite.step == CRASH_AT
    assert sorted(set(composite.sources.values())) == [4, 8]  # half the layers come from step 4

    resumed = jobs["resumed-qwen2-parity"].result()
    begin = torch.load(one_process["root"] / "dump.pt", weights_only=True)
    assert begin["global_step"] == CRASH_AT
    [said] = [line for line in resumed["stdout"].splitlines() if line.startswith("llmtailor:")]
    assert said.startswith(f"llmtailor: resumed from the composite of step {CRASH_AT} in ")
    assert f"units from step {CRASH_AT}, " in said and "from step 4 (layer." in said
    assert begin["lr"][0] == reference["lrs"][str(CRASH_AT)]  # the LR of every group (decay, no-decay)
    assert len(set(begin["lr"])) == 1
    # Data position: the resumed run trains on exactly the batches the uninterrupted one did.
    assert resumed["batches"] == {str(s): reference["batches"][str(s)] for s in range(CRASH_AT + 1, LAST + 1)}

    live = begin["tensors"]
    checked = 0
    for unit, source in composite.sources.items():
        tensors, _ = run.read_unit(source, unit)
        for key, tensor in tensors.items():
            assert live[key].dtype == tensor.dtype and torch.equal(live[key], tensor), f"{key} (from step {source})"
            checked += 1
    optim_keys = {k for k in live if k.startswith("optim/")}
    assert optim_keys and checked >= len(optim_keys)
    # The resumed run continues the lineage: its save at 12 is a parity save, not a full one.
    assert run.steps() == [4, 8, 12]
    assert len(Run(out / "tailored").manifest(12).units) < len(composite.sources)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MODELS))
def test_vanilla_trainer_resumes_from_hf_export_bit_for_bit(one_process, family):
    jobs = one_process["jobs"]
    reference = jobs[f"reference-{family}"].result()
    jobs[f"crashed-{family}-full"].result(crash=True)
    result = one_process["assembled"][family]
    assert result.exit_code == 0, result.output
    checkpoint = one_process["root"] / f"hf-{family}" / f"checkpoint-{CRASH_AT}"
    assert checkpoint.is_dir()

    resumed = jobs[f"vanilla-{family}"].result()
    assert resumed["global_step"] == LAST
    assert resumed["losses"] == reference["losses"]
    assert resumed["params"] == reference["params"]


def two_ranks(tmp_path: Path, *flags: str, shared: bool = True, forked: bool = False) -> tuple[dict, list[int]]:
    """Under torchrun with 2 ranks, each with ``flags``: "reference" (uninterrupted) and "crashed"
    (SIGKILLed after its save of 8), in one launch that runs them in turn in one process group
    (forked_jobs.run_in_turn) if ``shared``, else one each, both at once; then "resumed" in a launch of its own.
    And the steps the killed run held. ``forked``: each launch's 2 ranks forked from the
    module's fork server, which imported torch, transformers and DeepSpeed once, with torchrun's
    environment and agent store (``forked_jobs.served_launch``), not a torchrun agent and two
    fresh interpreters."""

    def torchrun() -> list[str]:  # a port of its own each launch
        return served_launch(SERVER, 2) if forked else standalone_launch(2)

    def spec(name: str, out: str, *more: str) -> tuple[list[str], Path]:
        return ["--out", str(tmp_path / out), "--result", str(tmp_path / f"{name}.json"), *flags, *more], \
            tmp_path / f"{name}.json"

    first = {"reference": spec("reference", "ref"), "crashed": spec("crashed", "run", "--crash-at", str(CRASH_AT))}
    if shared:
        done = run_in_turn(torchrun(), JOB, first, ranks=2)
    else:  # the two launches at once: each its own processes, port and run
        with ThreadPoolExecutor(2) as pool:
            launches = [pool.submit(run_in_turn, torchrun(), JOB, dict([job]), ranks=2) for job in first.items()]
            done = {name: finished for launch in launches for name, finished in launch.result().items()}
    run = tmp_path / "run" / "tailored"
    held = Run(run).steps() if run.is_dir() else []
    return done | run_in_turn(torchrun(), JOB, {"resumed": spec("resumed", "run", "--resume", "true")}, ranks=2), held


@pytest.mark.slow
def test_ddp_under_torchrun_crash_and_resume_bit_for_bit(tmp_path):
    """Two processes (DDP, gloo): every rank takes part in each save, writes its share and its
    RNG; after a crash of the whole job the resumed job logs the same losses bit for bit."""
    jobs, held = two_ranks(tmp_path)
    reference = jobs["reference"].result()
    jobs["crashed"].result(crash=True)
    run = Run(tmp_path / "run" / "tailored")
    assert held == [4, CRASH_AT] and run.manifest(CRASH_AT).world_size == 2
    assert run.manifest(CRASH_AT).provider == "ddp"
    assert {f.path for f in run.manifest(CRASH_AT).files} >= {"ranks/rank-00001.json"}
    writers = {f.path.split("/")[-1].split(".")[0] for u in run.manifest(CRASH_AT).units for f in run.unit_entry(CRASH_AT, u).files}
    assert writers == {"rank-00000", "rank-00001"}  # the units are spread over both ranks (small: each rank's pack file)
    resumed = jobs["resumed"].result()
    assert resumed["global_step"] == LAST
    assert resumed["losses"] == reference["losses"] and resumed["params"] == reference["params"]
    assert resumed["batches"] == {s: reference["batches"][s] for s in resumed["batches"]}


@pytest.mark.slow
def test_deepspeed_zero3_crash_and_resume_in_place_bit_for_bit(tmp_path):
    """HF Trainer + DeepSpeed ZeRO-3, two processes: TailorTrainer saves from the engine on
    Trainer's schedule; after a SIGKILL of the job it resumes in place (the composite loaded
    into the engine Trainer built, no checkpoint exported) and logs the same losses as an
    uninterrupted job, bit for bit. The ranks are forked with torchrun's environment
    (``two_ranks(forked=True)``): what is tested is the engine's saves and resume, not torchrun,
    which the DDP test above runs under."""
    pytest.importorskip("deepspeed")
    # A launch of its own each: a ZeRO-3 Trainer after another in one process logged other losses.
    jobs, held = two_ranks(tmp_path, "--deepspeed", "3", shared=False, forked=True)
    reference = jobs["reference"].result()
    jobs["crashed"].result(crash=True)
    run = Run(tmp_path / "run" / "tailored")
    assert held == [4, CRASH_AT]
    assert run.manifest(CRASH_AT).provider == "deepspeed" and run.manifest(CRASH_AT).notes["zero_stage"] == 3
    resumed = jobs["resumed"].result()
    assert resumed["global_step"] == LAST and run.steps() == [4, CRASH_AT, LAST]
    assert resumed["losses"] == reference["losses"]
    assert resumed["batches"] == {s: reference["batches"][s] for s in resumed["batches"]}


@pytest.mark.slow
def test_async_saves_write_the_same_snapshots_as_sync_ones(one_process):
    jobs, root = one_process["jobs"], one_process["root"]
    reference = jobs["reference-llama"].result()  # the same job (the defaults) with sync saves
    jobs["async"].result()
    a, b = Run(root / "async" / "tailored"), Run(root / "reference-llama" / "tailored")
    assert a.steps() == b.steps() == [4, 8, 12]
    for step in a.steps():
        for unit in a.manifest(step).units:
            assert a.unit_entry(step, unit) == b.unit_entry(step, unit)
    assert json.loads((root / "async.json").read_text())["losses"] == reference["losses"]


def _job_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_run_with_resume_true_starts_fresh_and_saves_only_tailored_snapshots(tmp_path):
    import transformers

    hf_job = _job_module()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_job.model_config("llama", False))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, save_steps=2, save_total_limit=1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = TailorTrainer(model=model, args=args, train_dataset=hf_job.Windows(), tailor_policy=Parity())
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 4
    assert [p.name for p in tmp_path.iterdir()] == ["tailored"]
    run = Run(tmp_path / "tailored")
    assert run.latest_step() == 4  # save_total_limit=1 keeps what the newest composite needs
    assert set(run.resolve().sources.values()) <= set(run.steps())
    extra = run.read_global(4)["stateful"]
    assert extra["trainer_state"]["global_step"] == 4 and extra["training_args"]["save_steps"] == 2


def test_options_trainer_cannot_honour_are_refused(tmp_path):
    import transformers

    hf_job = _job_module()
    model = transformers.AutoModelForCausalLM.from_config(hf_job.model_config("llama", False))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, save_steps=2, eval_steps=2, eval_strategy="steps",
        load_best_model_at_end=True, report_to=[], use_cpu=True,
    )
    with pytest.raises(ConfigError, match="load_best_model_at_end"):
        TailorTrainer(model=model, args=args, train_dataset=hf_job.Windows(), eval_dataset=hf_job.Windows())
    with pytest.raises(ConfigError, match="tailor_policy"):
        TailorTrainer(model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                      tailor_policy="parity")


def test_a_tailor_config_passes_through_and_shorthands_override_it(tmp_path):
    import transformers

    from llmtailor import Interval, TailorConfig

    hf_job = _job_module()
    model = transformers.AutoModelForCausalLM.from_config(hf_job.model_config("llama", False))

    def args(**more):
        return transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **more)

    config = TailorConfig(policy=Interval({"layer.*": 2}), async_save=True, timeout=30)
    trainer = TailorTrainer(model=model, args=args(save_total_limit=3), tailor_config=config)
    assert trainer.tailor_config == config.model_copy(update={"keep": 3})  # save_total_limit maps to keep
    assert trainer.tailor_policy == Interval({"layer.*": 2})
    trainer = TailorTrainer(model=model, args=args(), tailor_config=config, tailor_policy=Parity(), tailor_keep=1)
    assert (trainer.tailor_config.policy, trainer.tailor_config.keep, trainer.tailor_config.async_save) == (Parity(), 1, True)
    with pytest.raises(ConfigError, match=r"keep=0 must be a positive integer.*timeout=-1 must be a positive number"):
        TailorTrainer(model=model, args=args(), tailor_keep=0, tailor_timeout=-1)


def test_a_second_trainer_on_a_run_being_written_fails_before_it_trains(tmp_path):

    import transformers

    from llmtailor.errors import TailorError

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from llmtailor.store.lock import WriterLock; "
         "lock = WriterLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); sys.stdin.read()",
         str(tmp_path / "tailored")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        hf_job = _job_module()
        model = transformers.AutoModelForCausalLM.from_config(hf_job.model_config("llama", False))
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4,
                                              save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = TailorTrainer(model=model, args=args, train_dataset=hf_job.Windows(), tailor_policy=Parity())
        with pytest.raises(TailorError, match=f"being written by another writer \\(pid {holder.pid} on"):
            trainer.train(resume_from_checkpoint=True)
        assert trainer.state.global_step == 0
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_trainer_with_a_memory_tier_saves_there_promotes_and_resumes_from_it(tmp_path, capsys):
    import shutil

    import transformers

    from llmtailor import TailorConfig, Tier

    hf_job = _job_module()
    memory = tmp_path / "memory"

    def trainer(max_steps: int) -> TailorTrainer:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_job.model_config("llama", False))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=max_steps, save_steps=1,
            report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        )
        config = TailorConfig(policy=Parity(), tiers=[Tier(memory, keep=1, promote_every=3)])
        return TailorTrainer(model=model, args=args, train_dataset=hf_job.Windows(), tailor_config=config)

    trainer(4).train()
    home = tmp_path / "out" / "tailored"
    assert Run(memory).steps() == [3, 4] and Run(home).latest_step() == 4  # train() ends with close(): promoted
    shutil.rmtree(Run(home).snapshot_dir(4))  # the run directory is behind the memory tier (as after a crash)
    (home / "latest").unlink()
    resumed = trainer(6)
    resumed.train(resume_from_checkpoint=True)
    assert f"resumed from the composite of step 4 in {memory}" in capsys.readouterr().out
    assert resumed.state.global_step == 6 and Run(home).latest_step() == 6 and Run(home).verify() == []


def _trainer(out: Path, max_steps: int, cls: type = TailorTrainer, **kwargs) -> TailorTrainer:
    """A TailorTrainer (or ``cls``) of a tiny Llama in one process, saving every 2 steps, logging every step."""
    import transformers

    hf_job = _job_module()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_job.model_config("llama", False))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=max_steps, save_steps=2, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )
    return cls(model=model, args=args, train_dataset=hf_job.Windows(), **kwargs)


class _ExtrasLayoutTrainer(TailorTrainer):
    """Saves as TailorTrainer did before stateful objects: TrainerState and TrainingArguments as
    keys of the snapshot's extras, written through a plain Tailor."""

    def _save_checkpoint(self, model, trial):
        from dataclasses import asdict

        from llmtailor import Tailor

        if self._tailor is None:
            self._tailor = Tailor(self.tailor_run_dir, *self._live_objects(), config=self.tailor_config)
        self._tailor.save(self.state.global_step, extra={"trainer_state": json.loads(json.dumps(asdict(self.state))),
                                                         "training_args": json.loads(self.args.to_json_string())})


def test_a_run_written_with_the_trainer_state_in_its_extras_resumes_with_it(tmp_path):
    """Backward compatibility of the stored format: Trainer's state, kept as keys of the extras by
    TailorTrainer before stateful objects, is what the resume hands Trainer (its log history
    goes on) and what ``assemble --format hf`` writes."""
    old = _trainer(tmp_path, 2, _ExtrasLayoutTrainer)
    old.train()
    saved = Run(tmp_path / "tailored").read_global(2)
    assert "stateful" not in saved and saved["extra"]["trainer_state"]["global_step"] == 2
    logged = [entry["step"] for entry in old.state.log_history if "loss" in entry]
    assert logged == [1, 2]
    resumed = _trainer(tmp_path, 4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert resumed.state.log_history[:2] == old.state.log_history[:2]  # a minimal TrainerState would hold none
    result = CliRunner().invoke(app, ["assemble", str(tmp_path / "tailored"), "--step", "2", "--format", "hf",
                                      "-o", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    exported = json.loads((tmp_path / "hf" / "checkpoint-2" / "trainer_state.json").read_text())
    assert exported["log_history"] == old.state.log_history[:2]


def test_resuming_from_another_run_reads_it_and_saves_a_lineage_of_its_own(tmp_path, capsys):
    _trainer(tmp_path / "a", 4).train()
    source = Run(tmp_path / "a" / "tailored")
    before = tree_digest(tmp_path / "a" / "tailored")
    trainer = _trainer(tmp_path / "b", 6, tailor_policy=Parity())
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "tailored"))
    assert f"resumed from the composite of step 4 in {source.root}" in capsys.readouterr().out
    assert trainer.state.global_step == 6 and trainer.state.log_history[:4] == _logged_until(source, 4)
    run = Run(tmp_path / "b" / "tailored")
    assert run.steps() == [6] and run.manifest(6).parent is None  # its own lineage: the first save is full
    assert sorted(run.manifest(6).units) == sorted(source.manifest(4).units)
    assert tree_digest(tmp_path / "a" / "tailored") == before  # read only


def _logged_until(run: Run, step: int) -> list:
    return run.read_global(step)["stateful"]["trainer_state"]["log_history"]


def test_training_from_step_0_into_a_run_holding_a_composite_is_refused_before_it_trains(tmp_path):
    """A restart that left out ``resume_from_checkpoint``: its first save (step 2) would start a
    lineage of its own, become the run's newest composite, and retention (save_total_limit=1)
    would delete step 4, the newest state of the training the run held."""
    _trainer(tmp_path, 4, tailor_keep=1).train()
    run = Run(tmp_path / "tailored")
    assert run.steps() == [4]
    for resume in (None, False):
        restart = _trainer(tmp_path, 2, tailor_keep=1)
        with pytest.raises(ConfigError, match=r"holds the composite of step 4: train\(resume_from_checkpoint=True\)"):
            restart.train(resume_from_checkpoint=resume)
        assert restart.state.global_step == 0
        assert run.steps() == [4] and run.latest_step() == 4
    resumed = _trainer(tmp_path, 6, tailor_keep=1)  # the lock was released: the resume goes on
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6 and run.steps() == [6]


class _Scales(transformers.TrainerCallback):
    """The loss scale of the scaler after each optimizer step; training stops after ``stop_at``."""

    def __init__(self, scaler, stop_at: int | None):
        self.scaler, self.stop_at, self.scales = scaler, stop_at, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.scales[state.global_step] = (self.scaler.get_scale(), self.scaler._get_growth_tracker())
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def _fp16_trainer(out: Path, stop_at: int | None = None) -> tuple[TailorTrainer, _Scales]:
    """A TailorTrainer of 6 steps whose accelerator has the gradient scaler fp16 mixed precision
    gives it on a GPU (made by hand: accelerate makes none on CPU), growing its scale every third
    step."""
    trainer = _trainer(out, 6)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=3)
    scales = _Scales(trainer.accelerator.scaler, stop_at)
    trainer.add_callback(scales)
    return trainer, scales


def test_the_gradient_scaler_of_fp16_training_is_saved_and_restored(tmp_path):
    from integrations.hf_job import params_digest

    reference, reference_scales = _fp16_trainer(tmp_path / "reference")
    reference.train()
    first, first_scales = _fp16_trainer(tmp_path / "run", stop_at=4)
    first.train()
    assert Run(tmp_path / "run" / "tailored").latest_step() == 4
    assert first_scales.scales[4] == (2.0**5, 1)  # saved at step 4: grown once, one step towards the next growth
    resumed, resumed_scales = _fp16_trainer(tmp_path / "run")
    resumed.train(resume_from_checkpoint=True)
    assert resumed_scales.scales == {step: reference_scales.scales[step] for step in (5, 6)}
    assert params_digest(resumed.model) == params_digest(reference.model)
