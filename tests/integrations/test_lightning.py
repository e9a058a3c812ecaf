"""PyTorch Lightning with ``TailorCheckpoint``, with the real library and real processes: saves on
Lightning's schedule, a SIGKILL after a save, ``trainer.fit(ckpt_path=RUN)`` in a fresh process
(single device, and DDP on 2 ranks started as torchrun starts them, each with Full and Parity),
then the same losses, batches and final weights bit for bit as an uninterrupted run (Full; under
DDP with dropout, resumed mid-epoch and at an epoch boundary), or each unit at the version the
composite names (Parity).
``assemble --format lightning`` writes a ``.ckpt`` plain Lightning resumes from, bit for bit."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from forked_jobs import run_in_turn, run_jobs, served_launch
from forked_nodes import ForkServers
from helpers import assert_composite_loaded, assert_same_training_state

L = pytest.importorskip("lightning")

from typer.testing import CliRunner  # noqa: E402

from llmtailor import Parity  # noqa: E402
from llmtailor.cli import app  # noqa: E402
from llmtailor.errors import ConfigError, TailorError  # noqa: E402
from llmtailor.integrations.lightning import TailorCheckpoint, check_strategy  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402

JOB = Path(__file__).with_name("lightning_job.py")
CRASH_AT, LAST = 4, 10  # 8 batches an epoch: the crash is mid-epoch
EPOCHS = ["--every-epochs", "1", "--dropout", "0.1", "--loader", "eager", "--max-steps", "16"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The single-device jobs of this module's tests, in two launches of forked jobs
    (forked_jobs.py: Lightning and transformers imported once for all; each job a process of its
    own, the jobs of a launch at once: none touches another's run). First the uninterrupted runs
    and the runs SIGKILLed after a save: "reference" (10 steps), "crashed-full" (saves every 4,
    killed after 4), "crashed-parity" (Parity, killed after 8), "epochs-reference" /
    "epochs-crashed" (a save at every epoch's end, dropout, killed after 8). What each killed run
    held then is recorded in "after-crash" (its steps and composite). Then ``assemble --format
    lightning`` of crashed-full's save of 4 (its CliRunner result in "assembled"), and the
    resumes, each from another process than the one killed: "resumed-full", "resumed-parity"
    (dumping what it loaded, to 12), "plain" (Lightning's own ModelCheckpoint, from the assembled
    .ckpt) and "epochs-resumed"."""
    root = tmp_path_factory.mktemp("lightning")

    def job(name: str, run: str, *flags: str) -> tuple[list[str], Path]:
        return ["--run-dir", str(root / run), "--result", str(root / f"{name}.json"), *flags], root / f"{name}.json"

    done = run_jobs(JOB, {
        "reference": job("reference", "reference"),
        "crashed-full": job("crashed-full", "crashed-full", "--policy", "full", "--crash-at", str(CRASH_AT)),
        "crashed-parity": job("crashed-parity", "crashed-parity", "--policy", "parity", "--crash-at", "8"),
        "epochs-reference": job("epochs-reference", "epochs-reference", *EPOCHS),
        "epochs-crashed": job("epochs-crashed", "epochs-crashed", *EPOCHS, "--crash-at", "8"),
    }, root / "first", together=True)
    after_crash = {name: (Run(root / name).steps(), Run(root / name).resolve())
                   for name in ("crashed-full", "crashed-parity", "epochs-crashed")
                   if (root / name).is_dir() and Run(root / name).steps()}
    assembled = CliRunner().invoke(app, ["assemble", str(root / "crashed-full"), "--step", str(CRASH_AT), "--format",
                                         "lightning", "-o", str(root / "ckpt")])
    done |= run_jobs(JOB, {
        "resumed-full": job("resumed-full", "crashed-full", "--resume", str(root / "crashed-full")),
        "resumed-parity": job("resumed-parity", "crashed-parity", "--policy", "parity", "--resume",
                              str(root / "crashed-parity"), "--dump", str(root / "dump.pt"), "--max-steps", "12"),
        "plain": job("plain", "plain", "--checkpoint", "model", "--resume",
                     str(root / "ckpt" / f"epoch=0-step={CRASH_AT}.ckpt")),
        "epochs-resumed": job("epochs-resumed", "epochs-crashed", *EPOCHS, "--resume", str(root / "epochs-crashed")),
    }, root / "second", together=True)
    return {"root": root, "jobs": done, "after-crash": after_crash, "assembled": assembled}


def continues(reference: dict, resumed: dict, after: int, last: int = LAST) -> None:
    steps = [str(s) for s in range(after + 1, last + 1)]
    assert sorted(resumed["losses"], key=int) == steps
    assert resumed["losses"] == {s: reference["losses"][s] for s in steps}  # float.hex: bit for bit
    assert resumed["batches"] == {s: reference["batches"][s] for s in steps}  # the dataloader's position
    assert resumed["params"] == reference["params"] and resumed["global_step"] == last


@pytest.mark.slow
def test_full_resume_after_sigkill_continues_bit_for_bit(one_device):
    jobs, run_dir = one_device["jobs"], one_device["root"] / "crashed-full"
    reference = jobs["reference"].result()
    jobs["crashed-full"].result(crash=True)
    assert one_device["after-crash"]["crashed-full"][0] == [CRASH_AT]
    resumed = jobs["resumed-full"].result()
    continues(reference, resumed, CRASH_AT)
    assert f"llmtailor: resumed from the composite of step {CRASH_AT} in {run_dir} (every unit from step {CRASH_AT})" \
        in resumed["stdout"]
    assert Run(run_dir).steps() == [4, 8]


@pytest.mark.slow
def test_parity_resume_loads_each_unit_at_the_version_its_composite_names(one_device):
    jobs, run_dir = one_device["jobs"], one_device["root"] / "crashed-parity"
    jobs["crashed-parity"].result(crash=True)
    run = Run(run_dir)
    _, composite = one_device["after-crash"]["crashed-parity"]
    assert composite.step == 8 and sorted(set(composite.sources.values())) == [4, 8]
    resumed = jobs["resumed-parity"].result()
    begin = torch.load(one_device["root"] / "dump.pt", weights_only=True)
    assert begin["global_step"] == 8 and resumed["global_step"] == 12
    assert_composite_loaded(run, composite, begin["tensors"])
    assert begin["lr"] == pytest.approx([3e-3, 3e-3])  # the scheduler's state after 8 steps (warm-up over)
    # The resumed run extends the lineage: its save at 12 is a parity save, not a full one.
    assert run.steps() == [4, 8, 12] and len(run.manifest(12).units) < len(composite.sources)


@pytest.mark.slow
def test_assembled_ckpt_resumes_in_plain_lightning_bit_for_bit(one_device):
    jobs, root = one_device["jobs"], one_device["root"]
    reference = jobs["reference"].result()
    jobs["crashed-full"].result(crash=True)
    result = one_device["assembled"]
    assert result.exit_code == 0, result.output
    ckpt = root / "ckpt" / f"epoch=0-step={CRASH_AT}.ckpt"
    assert ckpt.is_file()
    # Lightning's own ModelCheckpoint in the resumed job; the job checks it imported no llmtailor.
    resumed = jobs["plain"].result()
    continues(reference, resumed, CRASH_AT)
    again = CliRunner().invoke(app, ["assemble", str(root / "crashed-full"), "--step", str(CRASH_AT), "--format",
                                     "lightning", "-o", str(root / "ckpt")])
    assert again.exit_code == 2 and "already exists" in again.output


DROPOUT = ["--every", "2", "--dropout", "0.1"]
SERVER = ForkServers(preload=("torch", "torch.distributed", "lightning", "transformers.models.llama.modeling_llama",
                              "llmtailor", "llmtailor.integrations.lightning"))
"""The fork server the DDP ranks are forked from (forked_nodes.py, one thread a rank), ended
after the module's last test (``fork_server``)."""


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    yield
    SERVER.stop()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The DDP jobs (2 ranks) of this module's tests, in four launches, each running its jobs in
    turn in one process group (forked_jobs.run_in_turn; a job SIGKILLed last in its launch):
    ["reference" (dropout, uninterrupted), "parity-crashed" (Parity, killed after
    8)], ["crashed" (dropout, killed after 6)], ["parity-resumed" (to 12, dumping what it
    loaded), "again" (resumed, killed after 8)], ["resumed" (to 10, eager loader)]. The Parity
    run's composite after its crash is recorded in "after-crash". Each launch's ranks are forked
    from the module's fork server, which imported Lightning and transformers once
    (``forked_jobs.served_launch``: torchrun's environment, which Lightning's DDP reads, its agent
    store, and a failed or killed rank ending the others, as torchrun's agent does), not a
    torchrun agent and two fresh interpreters importing Lightning and transformers each: what is tested is the ranks' training, saves and resumes, not torchrun
    (tests/distributed/test_torchrun.py and test_hf_trainer.py's DDP test run under torchrun itself).
    The ranks of a launch share their ``str`` hash seed."""
    root = tmp_path_factory.mktemp("ddp")

    def job(name: str, run: str, *flags: str) -> tuple[list[str], Path]:
        return ["--run-dir", str(root / run), "--result", str(root / f"{name}.json"), "--devices", "2", *flags], \
            root / f"{name}.json"

    done = run_in_turn(served_launch(SERVER, 2), JOB, {
        "reference": job("reference", "reference", *DROPOUT),
        "parity-crashed": job("parity-crashed", "parity", "--policy", "parity", "--crash-at", "8"),
    }, ranks=2)
    after_crash = Run(root / "parity").resolve() if (root / "parity").is_dir() and Run(root / "parity").steps() else None
    done |= run_in_turn(served_launch(SERVER, 2), JOB, {"crashed": job("crashed", "crashed", *DROPOUT, "--crash-at", "6")}, ranks=2)
    done |= run_in_turn(served_launch(SERVER, 2), JOB, {
        "parity-resumed": job("parity-resumed", "parity", "--policy", "parity", "--resume", str(root / "parity"),
                              "--dump", str(root / "dump.pt"), "--max-steps", "12"),
        "again": job("again", "crashed", *DROPOUT, "--resume", str(root / "crashed"), "--crash-at", "8"),
    }, ranks=2)
    done |= run_in_turn(served_launch(SERVER, 2), JOB, {
        "resumed": job("resumed", "crashed", *DROPOUT, "--loader", "eager", "--resume", str(root / "crashed")),
    }, ranks=2)
    return {"root": root, "jobs": done, "after-crash": after_crash}


@pytest.mark.slow
def test_ddp_with_dropout_resumes_bit_for_bit_mid_epoch_and_at_an_epoch_boundary(two_ranks):
    """Two processes, Lightning's DDP on CPU, attention dropout 0.1 (each step draws from each
    rank's RNG), a save every 2 steps, 4 batches an epoch per rank. One run is SIGKILLed after its
    save of 6 (mid-epoch), resumed in a fresh launch and SIGKILLed after its save of 8 (the last
    batch of the second epoch), then resumed to 10: its snapshots of 8 and 10 (weights, optimizer
    state, each rank's RNG), its losses and final weights equal an uninterrupted run's, bit for
    bit. The DataLoader draws its base seed from the RNG when its iterator is made: the mid-epoch
    resume makes it at the first batch (lazy loader), the epoch-boundary one when Lightning sets
    up the data (eager loader), the shapes in which each resume was one draw off."""
    jobs, root = two_ranks["jobs"], two_ranks["root"]
    reference = jobs["reference"].result()
    run_dir = root / "crashed"
    jobs["crashed"].result(crash=True)
    assert Run(run_dir).manifest(6).world_size == 2
    written = {path.name.split(".")[0] for path in Run(run_dir).snapshot_dir(6).glob("packs/*.safetensors")}
    assert written == {"rank-00000", "rank-00001"}  # both ranks wrote units (small: each rank's in its pack file)
    jobs["again"].result(crash=True)
    assert_same_training_state(Run(run_dir), Run(root / "reference"), 8)
    resumed = jobs["resumed"].result()
    continues(reference, resumed, 8)
    assert_same_training_state(Run(run_dir), Run(root / "reference"), LAST)


@pytest.mark.slow
def test_with_dropout_a_resume_from_an_epochs_end_save_continues_bit_for_bit(one_device):
    """TailorCheckpoint's default schedule (a save at every epoch's end), attention dropout 0.1, a
    plain DataLoader's iterator (made when Lightning sets up the data), 8 batches an epoch: a run
    SIGKILLed after its save of 8 (the first epoch's end) and resumed in a fresh process trains
    steps 9 to 16 with the uninterrupted run's batches and losses, and its snapshot of 16
    (weights, optimizer state, LR scheduler, RNG) and final weights equal that run's, bit for
    bit. From the loop state Lightning dumps at an epoch's end, a resume with ``max_steps``
    trained one more batch in the finished epoch."""
    jobs, root = one_device["jobs"], one_device["root"]
    reference = jobs["epochs-reference"].result()
    run_dir = root / "epochs-crashed"
    jobs["epochs-crashed"].result(crash=True)
    assert one_device["after-crash"]["epochs-crashed"][0] == [8]
    resumed = jobs["epochs-resumed"].result()
    continues(reference, resumed, 8, last=16)
    assert Run(run_dir).steps() == [8, 16]
    assert_same_training_state(Run(run_dir), Run(root / "epochs-reference"), 16)


# -- in one process --------------------------------------------------------------------------


class _Tiny(L.LightningModule):
    def __init__(self, optimizers: int = 1, note: object = None):
        super().__init__()
        self.save_hyperparameters(ignore=["optimizers"])
        self.layer = torch.nn.Linear(4, 4)
        self.optimizer_count = optimizers
        self.automatic_optimization = optimizers == 1  # Lightning steps several optimizers manually only

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        if self.automatic_optimization:
            return loss
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(self.optimizer_count)] \
            if self.optimizer_count > 1 else torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


def _trainer(*callbacks: L.Callback, max_steps: int = 4, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", max_steps=max_steps, callbacks=list(callbacks), logger=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _fit(module: L.LightningModule, callback: TailorCheckpoint, **kwargs) -> L.Trainer:
    trainer = _trainer(callback, **kwargs)
    trainer.fit(module)
    return trainer


class _Dropout(L.LightningModule):
    """An MLP with dropout on fixed data shuffled every epoch, 4 batches an epoch, an LR stepped
    every epoch: each step draws from the RNG, and each epoch's DataLoader iterator too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
        self.losses: dict[int, tuple[int, int, str]] = {}

    def training_step(self, batch, batch_idx):
        loss = self.net(batch).pow(2).mean()
        self.losses[self.global_step + 1] = (self.current_epoch, batch_idx, loss.item().hex())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def train_dataloader(self):
        data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)


def test_options_are_checked_when_the_callback_is_made(tmp_path):
    with pytest.raises(ConfigError, match="save_top_k=0"):
        TailorCheckpoint(tmp_path, save_top_k=0)
    with pytest.raises(ConfigError, match="every_n_train_steps=0"):
        TailorCheckpoint(tmp_path, every_n_train_steps=0)
    with pytest.raises(ConfigError, match="keep"):
        TailorCheckpoint(tmp_path, keep="three")
    with pytest.raises(ConfigError, match="give one of them"):
        TailorCheckpoint(tmp_path, save_top_k=2, keep=3)
    assert TailorCheckpoint(tmp_path, save_top_k=3).config.keep == 3
    assert TailorCheckpoint(tmp_path, save_top_k=-1).config.keep is None
    assert TailorCheckpoint(tmp_path).every_n_epochs == 1  # ModelCheckpoint's default: every epoch
    # One per run directory: several can live in one Trainer (bench/bench_lightning.py has two).
    assert TailorCheckpoint(tmp_path / "a").state_key != TailorCheckpoint(tmp_path / "b").state_key


def test_like_maps_a_model_checkpoint_and_names_every_setting_it_cannot_honour(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    mapped = TailorCheckpoint.like(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=1), policy=Parity())
    assert (mapped.run_dir, mapped.every_n_train_steps, mapped.every_n_epochs, mapped.config.keep) == (tmp_path, 5, None, 1)
    assert isinstance(mapped.config.policy, Parity)
    with pytest.raises(ConfigError) as refused:
        TailorCheckpoint.like(ModelCheckpoint(monitor="val_loss", save_weights_only=True))
    assert "monitor='val_loss'" in str(refused.value) and "save_weights_only" in str(refused.value) \
        and "pass run_dir" in str(refused.value)


def test_sharded_strategies_are_refused_naming_the_alternative():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        with pytest.raises(ConfigError, match="torchrun loop"):
            check_strategy(strategy)
    check_strategy(DDPStrategy())


def test_two_optimizers_are_refused_before_anything_is_saved(tmp_path):
    with pytest.raises(ConfigError, match="2 optimizers"):
        _fit(_Tiny(optimizers=2), TailorCheckpoint(tmp_path / "run", every_n_train_steps=2))
    assert not (tmp_path / "run" / "snapshots").exists()


def test_two_callbacks_writing_to_one_run_directory_are_refused_before_training(tmp_path):
    from llmtailor import Tier

    run_dir = tmp_path / "run"
    for second in (TailorCheckpoint(run_dir, every_n_train_steps=3),
                   TailorCheckpoint(tmp_path / "other", tiers=[Tier(run_dir)])):
        trainer = _trainer(TailorCheckpoint(run_dir, every_n_train_steps=2), second)
        with pytest.raises(ConfigError, match=f"write to {re.escape(str(run_dir))}: a run has one writer"):
            trainer.fit(_Tiny())
        assert trainer.global_step == 0 and not run_dir.exists() and not (tmp_path / "other").exists()


def test_fit_from_a_run_directory_with_no_snapshot_is_refused_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    callback = TailorCheckpoint(run_dir, every_n_train_steps=2)
    assert callback.resume_path() is None
    trainer = _trainer(callback)
    with pytest.raises(ConfigError, match=f"^ckpt_path={re.escape(str(run_dir))}: no committed snapshot there; "
                                          "expected a run directory holding one") as refused:
        trainer.fit(_Tiny(), ckpt_path=str(run_dir))
    assert "\n" not in str(refused.value) and trainer.global_step == 0 and list(run_dir.iterdir()) == []


def test_hyperparameters_only_pickle_could_store_are_left_out_with_a_warning(tmp_path):
    callback = TailorCheckpoint(tmp_path / "run", every_n_train_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_Tiny(note=object()), callback)
    assert any("hyper_parameters left out" in str(w.message) for w in caught)
    run = Run(tmp_path / "run")
    assert run.steps() == [2, 4]
    lightning = run.read_global(4)["stateful"]["lightning"]
    assert "hyper_parameters" not in lightning and lightning["global_step"] == 4 and "loops" in lightning
    assert callback.resume_path() == str(tmp_path / "run")
    assert TailorCheckpoint(tmp_path / "empty").resume_path() is None


def test_lightnings_own_state_is_encoded_once_per_save(tmp_path, monkeypatch):
    # Checked key by key, then encoded again with the global state: 0.15 ms more CPU per
    # Lightning-sized save (bench/RESULTS.md, issue 33, session 51).
    from llmtailor.store import codec

    real, loops_encoded = codec.encode, []

    def holds_loops(tree) -> bool:
        if isinstance(tree, dict):
            return "fit_loop" in tree or any(holds_loops(value) for value in tree.values())
        return isinstance(tree, (list, tuple)) and any(holds_loops(value) for value in tree)

    def encode(obj, where="state"):
        if holds_loops(obj):
            loops_encoded.append(where)
        return real(obj, where)

    monkeypatch.setattr(codec, "encode", encode)
    _fit(_Tiny(), TailorCheckpoint(tmp_path / "run", every_n_train_steps=2))
    assert Run(tmp_path / "run").steps() == [2, 4]
    assert loops_encoded == ["global state", "global state"]
    assert Run(tmp_path / "run").read_global(4)["stateful"]["lightning"]["loops"]["fit_loop"]


def test_a_lightning_state_key_only_pickle_could_store_fails_the_save_naming_it(tmp_path):
    class Unstorable(L.Callback):
        def state_dict(self):
            return {"handle": object()}

    callback = TailorCheckpoint(tmp_path / "run", every_n_train_steps=2)
    with pytest.raises(TailorError, match=r"callbacks.*Unstorable.*builtins\.object.*never pickle"):
        _trainer(callback, Unstorable()).fit(_Tiny())
    assert Run(tmp_path / "run").steps() == []


def test_a_run_not_saved_through_lightning_is_refused_by_the_lightning_export(tmp_path, tokens):
    from helpers import parity_run

    run = parity_run(tmp_path / "run", tokens, steps=2)
    result = CliRunner().invoke(app, ["assemble", str(run), "--format", "lightning", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "was not saved by TailorCheckpoint" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ddp_under_torchrun_parity_resume_loads_each_unit_at_the_version_its_composite_names(two_ranks):
    """Two processes, Parity: the composite of 8 takes units from the saves of 4 and 8, each written
    in shares by both ranks; each rank loads every unit at the version the composite names."""
    jobs, root = two_ranks["jobs"], two_ranks["root"]
    jobs["parity-crashed"].result(crash=True)
    run = Run(root / "parity")
    composite = two_ranks["after-crash"]
    assert composite.step == 8 and sorted(set(composite.sources.values())) == [4, 8]
    assert run.manifest(8).world_size == 2
    resumed = jobs["parity-resumed"].result()
    begin = torch.load(root / "dump.pt", weights_only=True)
    assert begin["global_step"] == 8 and resumed["global_step"] == 12
    assert_composite_loaded(run, composite, begin["tensors"])
    assert run.steps() == [4, 8, 12] and len(run.manifest(12).units) < len(composite.sources)


def test_a_memory_tier_saves_promotes_and_the_resume_takes_the_newest_composite_of_any_tier(tmp_path, capsys):
    import shutil

    from llmtailor import Tier

    memory, home = tmp_path / "memory", tmp_path / "run"

    def callback():
        return TailorCheckpoint(home, every_n_train_steps=1, tiers=[Tier(memory, keep=1, promote_every=3)])

    _fit(_Tiny(), callback())
    assert Run(memory).steps() == [4] and Run(home).latest_step() == 4  # the last save promoted at the end
    shutil.rmtree(Run(home).snapshot_dir(4))  # the run directory behind the memory tier, as after a crash
    (home / "latest").unlink()
    assert Run(home).latest_step() == 1
    resumed = callback()
    trainer = _trainer(resumed, max_steps=6)
    trainer.fit(_Tiny(), ckpt_path=resumed.resume_path())
    assert f"resumed from the composite of step 4 in {memory}" in capsys.readouterr().out
    assert trainer.global_step == 6 and Run(home).latest_step() == 6 and Run(home).verify() == []


@pytest.mark.parametrize("limit", ["max_steps", "max_epochs"])
def test_a_save_at_an_epochs_end_resumes_at_the_next_epochs_start_bit_for_bit(tmp_path, limit):
    """TailorCheckpoint's default schedule (every epoch): fitting one epoch, then resuming from
    its save in a new Trainer with other RNG streams, trains the next two epochs as the
    uninterrupted run did (each step's epoch, batch index and loss; the snapshots of the next
    epochs' ends: weights, optimizer state, LR scheduler, RNG). With ``max_steps`` Lightning
    restarts its loops, and from the state it dumps in ``on_train_epoch_end`` it trained one more
    batch in the finished epoch."""

    def fit(run_dir: Path, epochs: int, ckpt_path: str | None = None) -> tuple[L.Trainer, _Dropout]:
        module, limits = _Dropout(), {"max_steps": 4 * epochs} if limit == "max_steps" else {"max_steps": -1,
                                                                                              "max_epochs": epochs}
        trainer = _trainer(TailorCheckpoint(run_dir), **limits)
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer, module

    L.seed_everything(0, verbose=False)
    _, reference = fit(tmp_path / "reference", 3)
    L.seed_everything(0, verbose=False)
    fit(tmp_path / "run", 1)
    assert Run(tmp_path / "run").steps() == [4]
    L.seed_everything(1, verbose=False)  # the resume sets the streams the save kept
    trainer, resumed = fit(tmp_path / "run", 3, str(tmp_path / "run"))
    assert resumed.losses == {step: reference.losses[step] for step in range(5, 13)}
    assert trainer.global_step == 12 and trainer.current_epoch == 3
    for step in (8, 12):
        assert_same_training_state(Run(tmp_path / "run"), Run(tmp_path / "reference"), step)


def test_a_run_written_with_lightnings_state_in_its_extras_resumes_bit_for_bit(tmp_path):
    """Backward compatibility of the stored format: before stateful objects, TailorCheckpoint kept
    Lightning's own state as the key ``lightning`` of the snapshot's extras. Such a run (forged
    here: the epoch's-end save of a fit, written again by a plain Tailor in that layout) resumes
    as the uninterrupted run went on, and assembles as a Lightning checkpoint."""
    from llmtailor import Tailor

    def fit(run_dir: Path, epochs: int, ckpt_path: str | None = None) -> _Dropout:
        module = _Dropout()
        _trainer(TailorCheckpoint(run_dir), max_steps=4 * epochs).fit(module, ckpt_path=ckpt_path)
        return module

    L.seed_everything(0, verbose=False)
    reference = fit(tmp_path / "reference", 2)
    L.seed_everything(0, verbose=False)
    fit(tmp_path / "new", 1)
    lightning = Run(tmp_path / "new").read_global(4)["stateful"]["lightning"]
    module = _Dropout()
    optimizers = module.configure_optimizers()
    live = (module, optimizers["optimizer"], optimizers["lr_scheduler"])
    Tailor(tmp_path / "new", *live, read_only=True).restore()  # its RNG streams too: the save keeps them
    with Tailor(tmp_path / "old", *live) as tailor:
        tailor.save(4, extra={"lightning": lightning})
    assert "stateful" not in Run(tmp_path / "old").read_global(4)

    L.seed_everything(1, verbose=False)  # the resume sets the streams the save kept
    resumed = fit(tmp_path / "old", 2, str(tmp_path / "old"))
    assert resumed.losses == {step: reference.losses[step] for step in range(5, 9)}
    assert_same_training_state(Run(tmp_path / "old"), Run(tmp_path / "reference"), 8)
    result = CliRunner().invoke(app, ["assemble", str(tmp_path / "old"), "--step", "4", "--format", "lightning",
                                      "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=True)["loops"] == lightning["loops"]


def test_fit_from_another_run_reads_it_and_saves_a_lineage_of_its_own(tmp_path, capsys):
    from helpers import tree_digest

    _fit(_Tiny(), TailorCheckpoint(tmp_path / "a", every_n_train_steps=2))
    before = tree_digest(tmp_path / "a")
    callback = TailorCheckpoint(tmp_path / "b", Parity(), every_n_train_steps=2)
    trainer = _trainer(callback, max_steps=6)
    trainer.fit(_Tiny(), ckpt_path=str(tmp_path / "a"))
    assert f"resumed from the composite of step 4 in {tmp_path / 'a'}" in capsys.readouterr().out
    run = Run(tmp_path / "b")
    assert trainer.global_step == 6 and run.steps() == [6] and run.manifest(6).parent is None  # full: its own lineage
    assert tree_digest(tmp_path / "a") == before  # read only


@pytest.mark.parametrize("ckpt_path", [None, "last"])
def test_a_fit_from_step_0_into_a_run_holding_a_composite_is_refused_before_it_trains(tmp_path, ckpt_path):
    """A restart without ``ckpt_path=checkpoint.resume_path()`` (``"last"``: Lightning asks only
    ModelCheckpoint callbacks for it, and fits from step 0): its first save (step 2) would start a
    lineage of its own, become the run's newest composite, and retention (save_top_k=1) would
    delete step 4, the newest state of the training the run held."""
    _fit(_Tiny(), TailorCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=1))
    run = Run(tmp_path)
    assert run.steps() == [4]
    trainer = _trainer(TailorCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=1), max_steps=2)
    with pytest.raises(ConfigError, match=r"holds the composite of step 4: fit\(\.\.\., ckpt_path=checkpoint\.resume_path"):
        trainer.fit(_Tiny(), ckpt_path=ckpt_path)
    assert trainer.global_step == 0 and run.steps() == [4]
    callback = TailorCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=1)  # the resume goes on
    trainer = _trainer(callback, max_steps=6)
    trainer.fit(_Tiny(), ckpt_path=callback.resume_path())
    assert trainer.global_step == 6 and run.steps() == [6]


def test_a_fit_from_another_run_with_gradient_accumulation_saves_only_at_accumulation_boundaries(tmp_path):
    """Resumed from another run's step 2 with accumulate_grad_batches=2, the global step stays 2
    for the next batch: the save of step 2 made at that batch's end held the weights of step 2 and
    the loops past a batch whose gradients it did not hold (a resume from it skipped that batch's
    contribution). Its saves are at the steps it trains to, each after an accumulation's last batch."""

    def fit(run_dir: Path, max_steps: int, ckpt_path: str | None = None) -> L.Trainer:
        trainer = _trainer(TailorCheckpoint(run_dir, every_n_train_steps=2), max_steps=max_steps,
                           accumulate_grad_batches=2)
        trainer.fit(_Tiny(), ckpt_path=ckpt_path)
        return trainer

    fit(tmp_path / "a", 2)
    fit(tmp_path / "b", 4, str(tmp_path / "a"))
    run = Run(tmp_path / "b")
    batches = {step: run.read_global(step)["stateful"]["lightning"]["loops"]["fit_loop"]["epoch_loop.batch_progress"]
               ["total"]["processed"] for step in run.steps()}
    assert batches == {4: 8}
