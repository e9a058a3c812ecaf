"""Hugging Face accelerate custom loops with ``TailorAccelerator``, with the real library and real
processes: ``save_state(step=...)`` in the loop, a SIGKILL after a save, ``load_state()`` in a
fresh process (one process and 2 CPU processes under ``accelerate launch --multi_gpu``, each
with Full and Parity; a DeepSpeed ZeRO-2 engine under ``accelerate launch --use_deepspeed``),
then the same losses, batches and final weights bit for bit as an uninterrupted run (Full; with 2
processes and dropout, resumed mid-epoch and at an epoch boundary), or each unit at the version
the composite names (Parity); a registered object's state comes back
too; a second accelerator on a run being written fails when it is built."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
import torch
from forked_jobs import launched, run_in_turn, run_jobs, served_launch
from forked_nodes import ForkServers
from helpers import assert_composite_loaded, assert_same_training_state, free_port, tree_digest

accelerate = pytest.importorskip("accelerate")

from llmtailor.errors import ConfigError, TailorError  # noqa: E402
from llmtailor.integrations.accelerate import TailorAccelerator  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402

JOB = Path(__file__).with_name("accelerate_job.py")
LAST = 10


SERVER = ForkServers(preload=("torch", "torch.distributed", "transformers.models.llama.modeling_llama", "accelerate",
                             "accelerate.utils", "llmtailor", "llmtailor.integrations.accelerate"),
                     env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
"""The fork server the ranks of this module's launches are forked from (forked_nodes.py): the
imports of torch, transformers' Llama, accelerate and llmtailor paid once for the module, not in
each rank of each launch; ended after the module's last test (``fork_server``)."""


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    yield
    SERVER.stop()


def launcher(kind: str) -> tuple[list[str], dict[str, str]] | None:
    """``accelerate launch`` for 2 CPU processes (DDP) or a DeepSpeed engine on each, and its
    environment; None: one plain process. accelerate's own launch command runs here (its parser,
    its checks of the flags, the environment it prepares for the ranks: ``ACCELERATE_*``) up to
    the agent it hands the ranks to, ``torch.distributed.run.run`` (torchrun's, which would start
    each rank as a fresh interpreter): what it was handed (the port, the number of ranks, that
    environment) starts a one-node launch whose ranks are forked from ``SERVER``
    (forked_jobs.served_launch)."""
    if kind == "single":
        return None
    from accelerate.commands.launch import launch_command, launch_command_parser

    flags = {"ddp": ["--multi_gpu"], "deepspeed": ["--use_deepspeed"]}[kind]
    # A port of its own: two launches at once (another test run) must not meet on the default one.
    args = launch_command_parser().parse_args(
        [*flags, "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port()),
         "--mixed_precision", "no", "--dynamo_backend", "no", str(JOB)])
    handed = []
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}), \
            mock.patch("torch.distributed.run.run", lambda agent_args: handed.append((agent_args, dict(os.environ)))):
        launch_command(args)
    [(agent_args, env)] = handed
    assert (agent_args.nproc_per_node, str(agent_args.nnodes), agent_args.training_script) == ("2", "1:1", str(JOB))
    return served_launch(SERVER, 2, int(agent_args.master_port)), env


def continues(reference: dict, resumed: dict, after: int) -> None:
    steps = [str(s) for s in range(after + 1, LAST + 1)]
    assert sorted(resumed["losses"], key=int) == steps
    assert resumed["losses"] == {s: reference["losses"][s] for s in steps}  # float.hex: bit for bit
    assert resumed["batches"] == {s: reference["batches"][s] for s in steps}  # skip_first_batches from the step
    assert resumed["params"] == reference["params"] and resumed["tokens"] == reference["tokens"]


# A crash and a resume: the jobs run before the killed run is looked at, then those after (each
# job's flags; "{dump}" is the scenario's dump file). A job's run directory is the scenario's
# "reference" or, for the others, its "crashed" one.
SCENARIOS = {
    "full": ({"reference": ["--every", "3"], "crashed": ["--every", "3", "--crash-at", "3"]},
             {"resumed": ["--every", "3", "--resume"]}),
    "parity": ({"crashed": ["--policy", "parity", "--crash-at", "8"]},
               {"resumed": ["--policy", "parity", "--resume", "--dump", "{dump}", "--max-steps", "12"]}),
}


def run_scenarios(kind: str, root: Path, scenarios: list[str]) -> dict:
    """The jobs of ``scenarios`` under ``kind``: "jobs" (``<scenario>-<job>`` -> ``Finished``),
    "after-crash" (each killed run's steps, composite and world size then) and "root". One
    process: each stage's jobs in one launch of forked jobs (forked_jobs.py); else each job a
    launch of its own, a stage's launches at once."""
    done, after_crash = {}, {}
    for stage in (0, 1):
        jobs = {}
        for scenario in scenarios:
            for name, flags in SCENARIOS[scenario][stage].items():
                run = root / f"{scenario}-{'reference' if name == 'reference' else 'crashed'}"
                result = root / f"{scenario}-{name}.json"
                more = ["--deepspeed", "2"] if kind == "deepspeed" else []
                flags = [f.format(dump=root / f"{scenario}-dump.pt") for f in flags]
                jobs[f"{scenario}-{name}"] = (["--run-dir", str(run), "--result", str(result), *more, *flags], result)
        if kind == "single":
            done |= run_jobs(JOB, jobs, root / f"stage-{stage}", together=True)  # each job a run directory of its own
        else:
            with ThreadPoolExecutor(len(jobs)) as pool:  # at once: each its own processes, port and run
                launches = {}
                for name, (args, result) in jobs.items():
                    command, env = launcher(kind)
                    launches[name] = pool.submit(launched, [*command, JOB, *args], name, result, env)
                done |= {name: launch.result() for name, launch in launches.items()}
        for scenario in scenarios if stage == 0 else ():
            run = Run(root / f"{scenario}-crashed")
            if (root / f"{scenario}-crashed").is_dir() and run.steps():
                after_crash[scenario] = (run.steps(), run.resolve(), run.manifest(run.latest_step()).world_size)
    return {"jobs": done, "after-crash": after_crash, "root": root}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process jobs of every scenario, made once for this module's ``single`` tests: two
    launches (before and after the crash is looked at, each launch's jobs at once) instead of one a job."""
    made = []

    def get() -> dict:
        if not made:
            made.append(run_scenarios("single", tmp_path_factory.mktemp("accelerate"), list(SCENARIOS)))
        return made[0]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["single", "deepspeed"])
def test_full_crash_and_resume_continues_bit_for_bit(tmp_path, kind, one_process):
    """A crash after step 3 is mid-epoch (8 batches an epoch in one process, 4 per rank in two)."""
    made = one_process() if kind == "single" else run_scenarios(kind, tmp_path, ["full"])
    jobs, run_dir = made["jobs"], made["root"] / "full-crashed"
    reference = jobs["full-reference"].result()
    jobs["full-crashed"].result(crash=True)
    steps, _, world_size = made["after-crash"]["full"]
    assert steps == [3] and world_size == (1 if kind == "single" else 2)
    resumed = jobs["full-resumed"].result()
    continues(reference, resumed, 3)
    assert Run(run_dir).steps() == [3, 6, 9]


DROPOUT = ["--every", "2", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The DDP jobs (2 processes under ``accelerate launch --multi_gpu``) of this module's tests,
    in four launches, each running its jobs in turn in one process group (forked_jobs.run_in_turn;
    a job SIGKILLed last in its launch): ["reference" (dropout, uninterrupted), "parity-crashed"
    (Parity, killed after 8)], ["crashed" (dropout, killed after 6)], ["parity-resumed" (to 12,
    dumping what it loaded), "again" (resumed, killed after 8)], ["resumed" (to 10)]. What each
    killed run held then (steps, composite, world size) is in "after-crash"."""
    root = tmp_path_factory.mktemp("ddp")

    def job(name: str, run: str, *flags: str) -> tuple[list[str], Path]:
        return ["--run-dir", str(root / run), "--result", str(root / f"{name}.json"), *flags], root / f"{name}.json"

    def held(run: str) -> tuple | None:
        steps = Run(root / run).steps() if (root / run).is_dir() else []
        return (steps, Run(root / run).resolve(), Run(root / run).manifest(steps[-1]).world_size) if steps else None

    def launch(jobs: dict) -> dict:
        command, env = launcher("ddp")
        return run_in_turn(command, JOB, jobs, ranks=2, env=env)

    done = launch({"reference": job("reference", "reference", *DROPOUT),
                   "parity-crashed": job("parity-crashed", "parity-crashed", "--policy", "parity", "--crash-at", "8")})
    after_crash = {"parity": held("parity-crashed")}
    done |= launch({"crashed": job("crashed", "crashed", *DROPOUT, "--crash-at", "6")})
    after_crash["crashed"] = held("crashed")
    done |= launch({"parity-resumed": job("parity-resumed", "parity-crashed", "--policy", "parity", "--resume", "--dump",
                                          str(root / "parity-dump.pt"), "--max-steps", "12"),
                    "again": job("again", "crashed", *DROPOUT, "--crash-at", "8", "--resume")})
    done |= launch({"resumed": job("resumed", "crashed", *DROPOUT, "--resume")})
    return {"jobs": done, "after-crash": after_crash, "root": root}


@pytest.mark.slow
def test_ddp_with_dropout_resumes_bit_for_bit_mid_epoch_and_at_an_epoch_boundary(two_processes):
    """Two CPU processes under ``accelerate launch --multi_gpu``, attention dropout 0.1 (each step
    draws from each process's RNG), a save every 2 steps, 4 batches an epoch per process. One run
    is SIGKILLed after its save of 6 (mid-epoch: the resume skips 2 batches with
    ``skip_first_batches``, whose new DataLoader iterator draws its base seed from the RNG), resumed
    in a fresh launch and SIGKILLed after its save of 8 (the last batch of the second epoch), then
    resumed to 10: its snapshots of 8 and 10 (weights, optimizer state, each process's RNG), its
    losses, final weights and token count equal an uninterrupted run's, bit for bit."""
    jobs, root = two_processes["jobs"], two_processes["root"]
    reference = jobs["reference"].result()
    jobs["crashed"].result(crash=True)
    steps, _, world_size = two_processes["after-crash"]["crashed"]
    assert steps == [2, 4, 6] and world_size == 2
    jobs["again"].result(crash=True)
    assert_same_training_state(Run(root / "crashed"), Run(root / "reference"), 8)
    resumed = jobs["resumed"].result()
    continues(reference, resumed, 8)
    assert_same_training_state(Run(root / "crashed"), Run(root / "reference"), LAST)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["single", "ddp"])
def test_parity_resume_loads_each_unit_at_the_version_its_composite_names(request, kind, one_process):
    """Under DDP (2 processes) each rank wrote its share of the units, and each rank loads them all."""
    made = one_process() if kind == "single" else request.getfixturevalue("two_processes")
    jobs, run = made["jobs"], Run(made["root"] / "parity-crashed")
    jobs["parity-crashed"].result(crash=True)
    _, composite, world_size = made["after-crash"]["parity"]
    assert composite.step == 8 and sorted(set(composite.sources.values())) == [4, 8]
    assert world_size == (1 if kind == "single" else 2)
    jobs["parity-resumed"].result()
    assert_composite_loaded(run, composite, torch.load(made["root"] / "parity-dump.pt", weights_only=True)["tensors"])
    assert run.steps() == [4, 8, 12] and len(run.manifest(12).units) < len(composite.sources)  # the lineage goes on


# -- in one process --------------------------------------------------------------------------


def _prepared(accelerator: TailorAccelerator, optimizers: int = 1):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    made = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(optimizers)]
    return accelerator.prepare(model, *made)


def _step(model, optimizer) -> None:
    model(torch.randn(2, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


class _Opaque:
    def state_dict(self):
        return {"handle": object()}

    def load_state_dict(self, state):
        pass


def test_save_and_load_state_round_trip_with_extras_and_registered_objects(tmp_path):
    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run")
    counter = torch.nn.Linear(1, 1)  # any object with state_dict / load_state_dict
    accelerator.register_for_checkpointing(counter)
    model, optimizer = _prepared(accelerator)
    _step(model, optimizer)
    assert not accelerator.tailor_resumable()
    accelerator.save_state(step=7, extra={"batch": 3})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    kept = counter.weight.detach().clone()
    _step(model, optimizer)
    with torch.no_grad():
        counter.weight.add_(1)
    report = accelerator.load_state()
    assert (report.step, report.extra) == (7, {"batch": 3}) and accelerator.tailor_resumable()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(counter.weight, kept)
    accelerator.save_state()  # no step: the run's newest + 1
    assert Run(tmp_path / "run").steps() == [7, 8]
    accelerator.end_training()


def test_a_run_written_with_the_accelerator_state_in_its_extras_loads_it(tmp_path):
    """Backward compatibility of the stored format: before stateful objects, the accelerator's own
    state and the user's extras were the snapshot's extras ``{"accelerate": ..., "user": ...}``."""
    from llmtailor import Tailor
    from llmtailor.integrations.accelerate import ACCELERATE_KEY, USER_KEY

    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run")
    counter = torch.nn.Linear(1, 1)
    accelerator.register_for_checkpointing(counter)
    model, optimizer = _prepared(accelerator)
    _step(model, optimizer)
    own = {"step": 5, "custom": [counter.state_dict()], "dataloaders": [None], "scaler": None}
    with Tailor(tmp_path / "run", model, optimizer) as tailor:  # in this process: it shares the accelerator's lock
        tailor.save(7, extra={ACCELERATE_KEY: own, USER_KEY: {"batch": 3}})
    assert "stateful" not in Run(tmp_path / "run").read_global(7)
    saved, kept = {k: v.clone() for k, v in model.state_dict().items()}, counter.weight.detach().clone()
    _step(model, optimizer)
    with torch.no_grad():
        counter.weight.add_(1)
    report = accelerator.load_state()
    assert (report.step, report.extra, report.unmapped) == (7, {"batch": 3}, ())
    assert torch.equal(counter.weight, kept) and accelerator.step == 5
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    accelerator.save_state(step=8, extra={"batch": 4})
    assert Run(tmp_path / "run").read_global(8)["extra"] == {"batch": 4}  # the extras are the user's now
    accelerator.end_training()


def test_load_state_of_another_run_loads_it_all_and_this_run_saves_a_lineage_of_its_own(tmp_path):
    source = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "a")
    counter = torch.nn.Linear(1, 1)
    source.register_for_checkpointing(counter)
    model, optimizer = _prepared(source)
    _step(model, optimizer)
    source.save_state(step=3, extra={"batch": 1})
    source.end_training()
    saved, kept = {k: v.clone() for k, v in model.state_dict().items()}, counter.weight.detach().clone()
    before = tree_digest(tmp_path / "a")

    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "b")
    other = torch.nn.Linear(1, 1)
    accelerator.register_for_checkpointing(other)
    model, optimizer = _prepared(accelerator)
    report = accelerator.load_state(str(tmp_path / "a"))
    assert (report.step, report.extra, report.unmapped) == (3, {"batch": 1}, ())
    assert torch.equal(other.weight, kept) and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    _step(model, optimizer)
    accelerator.save_state(step=4)
    run = Run(tmp_path / "b")
    assert run.steps() == [4] and run.manifest(4).parent is None  # a lineage of its own: the first save is full
    assert tree_digest(tmp_path / "a") == before  # read only
    accelerator.end_training()


def test_with_a_memory_tier_saves_land_there_and_reach_the_run_directory_at_the_end(tmp_path):
    from llmtailor import TailorConfig, Tier

    memory = tmp_path / "memory"
    config = TailorConfig(tiers=[Tier(memory, keep=1, promote_every=5)])
    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run", tailor_config=config)
    model, optimizer = _prepared(accelerator)
    for _ in range(3):
        _step(model, optimizer)
        accelerator.save_state()  # steps 1, 2, 3: the newest of any tier + 1
    assert accelerator.tailor_resumable() and Run(memory).steps() == [3]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer)
    report = accelerator.load_state()
    assert (report.step, report.tier) == (3, str(memory))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    accelerator.end_training()  # closes the Tailor: the last save promoted to the run directory
    assert Run(tmp_path / "run").latest_step() == 3


def test_other_directories_are_accelerates_own(tmp_path):
    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run")
    model, optimizer = _prepared(accelerator)
    accelerator.save_state(str(tmp_path / "plain"))
    assert (tmp_path / "plain" / "optimizer.bin").is_file() and Run(tmp_path / "run").steps() == []
    assert accelerator.load_state(str(tmp_path / "plain")) is None
    accelerator.end_training()


def test_what_cannot_be_saved_is_refused_naming_it(tmp_path):
    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run")
    _prepared(accelerator, optimizers=2)
    with pytest.raises(ConfigError, match="2 optimizers"):
        accelerator.save_state(step=1)
    opaque = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "opaque")
    opaque.register_for_checkpointing(_Opaque())
    _prepared(opaque)
    with pytest.raises(ConfigError, match="registered for checkpointing"):
        opaque.save_state(step=1)
    assert not Run(tmp_path / "opaque").steps()
    opaque.end_training()
    with pytest.raises(ConfigError, match="policy"):
        TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "x", tailor_policy="parity")


def _holding(run_dir: Path, how: str) -> subprocess.Popen:
    """Another process holding ``run_dir`` (``how``: Python that takes it, given the path as
    ``run``), until killed; returned once it holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys; run = sys.argv[1]; {how}; print('held', flush=True); sys.stdin.read()",
         str(run_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_accelerator_on_a_run_being_written_fails_when_it_is_built(tmp_path):
    """The lock is taken by the constructor, not at the first save_state: a second trainer on the
    run fails before it trains. In one process the Tailor built later shares it; end_training
    lets it go."""
    run_dir = tmp_path / "run"
    holder = _holding(run_dir, "from llmtailor.integrations.accelerate import TailorAccelerator; "
                               "accelerator = TailorAccelerator(cpu=True, tailor_run_dir=run)")
    try:
        with pytest.raises(TailorError, match=f"being written by another writer \\(pid {holder.pid} on"):
            TailorAccelerator(cpu=True, tailor_run_dir=run_dir)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=run_dir)
    _prepared(accelerator)
    accelerator.save_state(step=1)
    accelerator.end_training()
    holder = _holding(run_dir, "from pathlib import Path; from llmtailor.store.lock import WriterLock; "
                               "WriterLock(Path(run)).acquire()")
    holder.kill()
    holder.wait(timeout=30)


def test_a_plain_accelerate_save_state_directory_comes_in_through_load_state_bit_for_bit(tmp_path):
    """The way in for what a plain ``Accelerator.save_state(DIR)`` wrote (model.safetensors,
    optimizer.bin, random_states_0.pkl; ``import-hf`` and merges name it and point here):
    ``TailorAccelerator.load_state(DIR)`` is accelerate's own load, so the loop trains on as the
    plain Accelerator resumed from DIR does (the peer, in the same run), bit for bit (losses with
    dropout, weights, AdamW's moments), and its ``save_state(step=N)`` is a tailored snapshot that
    restores that state."""
    from accelerate import Accelerator

    def prepared(accelerator, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
        return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))

    def steps(model, optimizer, count):
        losses = []
        for _ in range(count):
            loss = model(torch.randn(2, 4)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def state(model, optimizer):
        return {**{f"w/{k}": v.clone() for k, v in model.state_dict().items()},
                **{f"o/{i}/{k}": v.clone() for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}}

    plain = Accelerator(cpu=True)
    model, optimizer = prepared(plain, 0)
    steps(model, optimizer, 2)
    plain.save_state(str(tmp_path / "plain"))
    reference = steps(model, optimizer, 2), state(model, optimizer)
    resumed = Accelerator(cpu=True)
    model, optimizer = prepared(resumed, 1)
    resumed.load_state(str(tmp_path / "plain"))
    peer = steps(model, optimizer, 2), state(model, optimizer)

    accelerator = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run")
    model, optimizer = prepared(accelerator, 2)
    assert accelerator.load_state(str(tmp_path / "plain")) is None  # accelerate's own load
    ours = steps(model, optimizer, 2), state(model, optimizer)
    accelerator.save_state(step=4)
    accelerator.end_training()
    assert ours[0] == peer[0] == reference[0]
    for other in (peer[1], reference[1]):
        assert ours[1].keys() == other.keys() and all(torch.equal(ours[1][k], other[k]) for k in other)

    again = TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run")
    model, optimizer = prepared(again, 3)
    steps(model, optimizer, 1)  # a live optimizer state to overwrite
    assert again.load_state().step == 4
    restored = state(model, optimizer)
    assert restored.keys() == ours[1].keys() and all(torch.equal(restored[k], ours[1][k]) for k in restored)
    again.end_training()


def test_the_first_save_into_a_run_holding_a_composite_this_accelerator_did_not_load_is_refused(tmp_path):
    """A restart that left out ``load_state``: its first save (step 2) would start a lineage of its
    own, become the run's newest composite, and retention (keep=1) would delete step 4, the newest
    state of the training the run held."""
    from llmtailor import TailorConfig

    def accelerator() -> TailorAccelerator:
        return TailorAccelerator(cpu=True, tailor_run_dir=tmp_path / "run", tailor_config=TailorConfig(keep=1))

    first = accelerator()
    model, optimizer = _prepared(first)
    _step(model, optimizer)
    first.save_state(step=4)
    first.end_training()
    run = Run(tmp_path / "run")
    restart = accelerator()
    model, optimizer = _prepared(restart)
    _step(model, optimizer)
    with pytest.raises(ConfigError, match=r"holds the composite of step 4, which this accelerator did not load: load_state"):
        restart.save_state(step=2)
    assert run.steps() == [4]
    assert restart.load_state().step == 4  # the resume goes on
    _step(model, optimizer)
    restart.save_state(step=5)
    assert run.steps() == [5]
    restart.end_training()


def test_a_save_in_the_middle_of_a_gradient_accumulation_is_refused(tmp_path):
    """The gradients accumulated so far are in no snapshot: a resume from a save after micro step 3
    of accumulations of 2 steps the optimizer with micro step 4's gradient alone, and its weights
    differ from the uninterrupted run's. Refused; the save after micro step 4 (an accumulation's
    last) resumes as the run went on."""
    data = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(1))

    def prepared(run: str):
        accelerator = TailorAccelerator(cpu=True, gradient_accumulation_steps=2, tailor_run_dir=tmp_path / run)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return accelerator, *accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def micro_steps(accelerator, model, optimizer, batches) -> None:
        for batch in batches:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()

    accelerator, model, optimizer = prepared("reference")
    micro_steps(accelerator, model, optimizer, data)
    reference = model.weight.detach().clone()
    accelerator.end_training()
    accelerator, model, optimizer = prepared("run")
    micro_steps(accelerator, model, optimizer, data[:3])
    with pytest.raises(ConfigError, match=r"save_state in the middle of a gradient accumulation \(micro step 3, accumulating 2\)"):
        accelerator.save_state(step=3)
    assert Run(tmp_path / "run").steps() == []
    micro_steps(accelerator, model, optimizer, data[3:4])
    accelerator.save_state(step=4)
    accelerator.end_training()
    accelerator, model, optimizer = prepared("run")
    accelerator.load_state()
    micro_steps(accelerator, model, optimizer, data[4:])
    assert torch.equal(model.weight, reference)
    accelerator.end_training()
