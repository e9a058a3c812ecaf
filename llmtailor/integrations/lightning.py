"""Tailored checkpoints for PyTorch Lightning: one callback, and the usual resume line.

    from llmtailor import Parity
    from llmtailor.integrations.lightning import TailorCheckpoint

    checkpoint = TailorCheckpoint("runs/exp", Parity(), every_n_train_steps=100, save_top_k=3)
    trainer = L.Trainer(callbacks=[checkpoint], ...)
    trainer.fit(model, ckpt_path=checkpoint.resume_path())   # None on the first run

``TailorCheckpoint`` is a Lightning ``Checkpoint`` (so Lightning adds no ``ModelCheckpoint`` of
its own) that saves on Lightning's schedule — every ``every_n_train_steps`` optimizer steps
and / or at the end of every ``every_n_epochs`` epochs (the default: every epoch, as
``ModelCheckpoint``) — one tailored snapshot at ``trainer.global_step``: the units the policy
picks with their optimizer state, the LR scheduler, each rank's RNG streams, and, as the state of
its Tailor's stateful object ``lightning`` (``integrations/resume.py``), everything else
Lightning's own checkpoint holds (epoch, global step, the loops' progress and a resumable
dataloader's position, callbacks' state, hyperparameters, a datamodule's state).
``save_top_k=K`` keeps the newest K composites (Lightning's "newest K" when no metric is
monitored); ``TailorCheckpoint.like(model_checkpoint)`` maps an existing ``ModelCheckpoint``'s
settings and refuses the ones a tailored run cannot honour.

The run directory is what ``Tailor`` takes: a local path or an object-store URL
(``TailorCheckpoint("s3://bucket/exp", storage_options={...})``; ``integrations/location.py``).

Resume is Lightning's own: ``trainer.fit(model, ckpt_path="runs/exp")``. The callback puts a
checkpoint I/O in front of the strategy's that answers a run directory with the Lightning
checkpoint dict assembled from its newest composite (``interop/lightning.py``: each unit from its
newest saved version), so Lightning restores model, optimizer, LR scheduler, loops and callbacks
with its own code; at ``on_fit_start``, ``Tailor.restore`` of that composite then loads it again
in place (the same values: it sets each rank's RNG streams, which Lightning does not keep, and
starts the next snapshots from that composite's lineage). A directory with no committed composite
is refused naming it; any other ``ckpt_path`` goes to the strategy's checkpoint I/O unchanged.
A fit from step 0 (no ``ckpt_path``, or ``"last"``, which Lightning answers from
``ModelCheckpoint`` files only) into a run holding a composite is refused at ``on_fit_start``,
before training: its first save would start a lineage of its own there, and retention then
deleted what the run held.
Which run a ``ckpt_path`` names is the storage's identity (``file:///data/exp`` is ``/data/exp``).
``llmtailor assemble RUN --format lightning`` writes the same dict as a ``.ckpt`` file plain
Lightning resumes from.

RNG order across a resume (with the ``Full`` policy training continues bit for bit, dropout
included): the streams are restored before Lightning sets up the training data, so a resume at an
epoch boundary makes the next epoch's DataLoader iterator (which draws its base seed from them)
as the uninterrupted run did after the save. A resume mid-epoch makes an iterator for the rest of
the epoch that the uninterrupted run made at the epoch's start: the streams are set again at the
first batch, after it, as HF Trainer does. Each run directory has one writer: two callbacks of one
Trainer on the same run directory or tier are refused at ``setup``.

Strategies: single device and DDP (each rank writes its share of the units). FSDP, DeepSpeed and
model-parallel strategies hold sharded state Lightning gathers its own way: refused at
``setup``; use ``Tailor`` directly in a torchrun loop there. One optimizer and at most one LR
scheduler (several are refused).
"""

from __future__ import annotations

import copy
from os import PathLike
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from llmtailor.config import TailorConfig
from llmtailor.errors import ConfigError, UnsupportedStateError
from llmtailor.integrations.location import run_location
from llmtailor.integrations.resume import Recorded, announce, refuse_a_fresh_start, restore_composite
from llmtailor.interop.lightning import LIGHTNING_KEY, TENSOR_KEYS, lightning_checkpoint
from llmtailor.policies import Policy
from llmtailor.providers.rng import capture_rng, restore_rng
from llmtailor.store.run import Run
from llmtailor.store.tiers import Tiers
from llmtailor.tailor import Tailor

# Lightning's strategies whose state is one full copy per rank: what a Tailor on the LightningModule sees.
SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")
# Kept when they encode, left out (with a warning) when they hold objects only pickle could store:
# Lightning reads them in load_from_checkpoint, never to resume.
OPTIONAL_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")


class TailorCheckpoint(Checkpoint):
    """Lightning callback saving tailored snapshots on Lightning's schedule (module docstring).

    ``policy`` and ``**options`` are ``Tailor``'s (``TailorConfig`` fields, or ``config=``);
    ``save_top_k`` is ``keep`` under Lightning's name (-1: keep every snapshot)."""

    def __init__(self, run_dir: str | PathLike, policy: Policy | None = None, *, every_n_train_steps: int | None = None,
                 every_n_epochs: int | None = None, save_top_k: int | None = None, config: TailorConfig | None = None,
                 **options: Any):
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a positive number (or None)")
        if save_top_k is not None and (not isinstance(save_top_k, int) or save_top_k == 0 or save_top_k < -1):
            raise ConfigError(f"save_top_k={save_top_k!r}: keep the newest K >= 1 composites, or -1 for all "
                              "(0 would save nothing: leave the callback out instead)")
        if save_top_k is not None and "keep" in options:
            raise ConfigError("save_top_k is keep under Lightning's name: give one of them")
        if save_top_k not in (None, -1):
            options["keep"] = save_top_k
        self.config = TailorConfig.of(config, policy=policy, **options)
        self.run_dir = run_location(run_dir)
        self.tiers()  # a location the store cannot use (storage options for a local path) is refused now
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None or every_n_train_steps else 1
        self._tailor: Tailor | None = None
        self._resume: tuple[Run, int] | None = None  # set when Lightning loads a run through our I/O
        self._resumed_rng: dict[str, Any] | None = None  # the RNG streams restored, until the first batch
        self._last_saved: int | None = None
        self._epoch_end = False  # whether the save being made is an epoch's end (the Lightning state it records)

    @classmethod
    def like(cls, checkpoint: ModelCheckpoint, run_dir: str | PathLike | None = None, policy: Policy | None = None,
             **options: Any) -> TailorCheckpoint:
        """A ``TailorCheckpoint`` on ``checkpoint``'s schedule (``every_n_train_steps``,
        ``every_n_epochs``, ``save_top_k``), in ``run_dir`` (default: its ``dirpath``). Settings
        a tailored run cannot honour are refused, all named at once."""
        problems = []
        if checkpoint.monitor is not None:
            problems.append(f"monitor={checkpoint.monitor!r}: tailored runs keep the newest composites, not the best by "
                            "a metric (keep a ModelCheckpoint beside it for best-model files)")
        if checkpoint.save_weights_only:
            problems.append("save_weights_only=True: a tailored snapshot holds what resuming needs")
        if getattr(checkpoint, "_train_time_interval", None) is not None:
            problems.append("train_time_interval: save every N steps or epochs instead")
        if run_dir is None and checkpoint.dirpath is None:
            problems.append("no dirpath: pass run_dir")
        if problems:
            raise ConfigError("TailorCheckpoint.like(ModelCheckpoint): " + "; ".join(problems))
        return cls(run_dir if run_dir is not None else checkpoint.dirpath, policy,
                   every_n_train_steps=getattr(checkpoint, "_every_n_train_steps", 0) or None,
                   every_n_epochs=checkpoint.every_n_epochs or None, save_top_k=checkpoint.save_top_k, **options)

    @property
    def state_key(self) -> str:
        """One per run directory, so several of these callbacks can live in one Trainer."""
        return self._generate_state_key(run_dir=str(self.run_dir))

    def resume_path(self) -> str | None:
        """The run directory when it holds a committed composite (pass it as ``ckpt_path``),
        else None: one script serves the first run and every restart."""
        return str(self.run_dir) if self.tiers().latest_step() is not None else None

    def tiers(self) -> Tiers:
        """The run directory and the faster tiers in front of it (``TailorConfig.tiers``)."""
        return Tiers.of(self.run_dir, self.config)

    def run_named(self, ckpt_path: str | PathLike) -> Run | None:
        """The run ``ckpt_path`` names, by the storage's identity: this callback's run directory or
        one of its tiers gives the tier holding the newest composite (a ConfigError when none
        holds one); another run with a committed composite gives that run; anything else (a
        Lightning checkpoint file) None."""
        tiers = self.tiers()
        named = Run(ckpt_path)
        if tiers.index_of(named) is None:
            return named if named.latest_step() is not None else None
        newest = tiers.newest_run()
        if newest is None:
            raise _no_snapshot(ckpt_path)
        return newest

    # -- Lightning's hooks -----------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_strategy(trainer.strategy)
        self._check_sole_writer(trainer.callbacks)
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, _RunCheckpointIO):
            trainer.strategy.checkpoint_io = _RunCheckpointIO(io, self)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Before Lightning sets up the training data: the DataLoader iterator it makes then draws its
        # base seed from the RNG streams restored here, as the uninterrupted run's next epoch did.
        live = (pl_module, *_one_optimizer(trainer))
        if self._resume is None and not trainer.ckpt_path:  # from step 0 (module docstring)
            refuse_a_fresh_start(self.tiers(), self.run_dir,
                                 ": fit(..., ckpt_path=checkpoint.resume_path()) resumes from it (ckpt_path=\"last\" "
                                 "finds only ModelCheckpoint files)", "give TailorCheckpoint another run directory")
        stateful = {LIGHTNING_KEY: Recorded(lambda: self._lightning_state(trainer))}
        self._tailor = Tailor(self.run_dir, *live, config=self.config, fresh_start=True, stateful=stateful)
        if self._resume is None:
            return
        run, step = self._resume
        report = restore_composite(self._tailor, run, step, live)
        # That step is saved (in this run, whose lineage goes on, or in the other run): no save of it
        # again, which with accumulate_grad_batches came at the next batch's end, in the middle of an
        # accumulation whose gradients no snapshot holds.
        self._last_saved = report.step
        self._resumed_rng = capture_rng()
        if trainer.is_global_zero:
            announce(report, run)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        rng, self._resumed_rng = self._resumed_rng, None
        if rng is not None and batch_idx > 0:
            # Resumed mid-epoch: the iterator Lightning made for the rest of the epoch drew from the
            # restored streams (the uninterrupted run made it at the epoch's start); set them again,
            # so that this step draws what the uninterrupted run's did.
            restore_rng(rng)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer, epoch_end=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(raise_error=True)  # an async save in flight becomes durable, or raises

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(raise_error=False)  # the training error is the one to see

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(raise_error=False)

    def _check_sole_writer(self, callbacks: list[Any]) -> None:
        """Refuse, before training, another ``TailorCheckpoint`` of the Trainer that writes to one
        of this one's locations (run directory or tier): a run has one writer, and the run's lock
        would refuse the second only at its first save, after the first had saved."""
        mine = self.tiers()
        for other in callbacks:
            if other is self or not isinstance(other, TailorCheckpoint):
                continue
            shared = [level.name for level in other.tiers().levels if mine.index_of(level.run) is not None]
            if shared:
                raise ConfigError(f"two TailorCheckpoint callbacks of this Trainer write to {shared[0]}: a run has "
                                  "one writer; give each callback its own run directory and tiers")

    # -- saving ------------------------------------------------------------------------------

    def _save(self, trainer: pl.Trainer, epoch_end: bool = False) -> None:
        step = trainer.global_step
        if self._tailor is None or step == 0 or step == self._last_saved or trainer.fast_dev_run \
                or trainer.sanity_checking:
            return  # no optimizer step yet, this step saved already (accumulation, epoch end), or a dry run
        self._epoch_end = epoch_end
        self._tailor.save(step)  # with Lightning's own state (``_lightning_state``)
        self._last_saved = step

    def _lightning_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's own checkpoint, less what the units and the global state hold, as a save
        records it: at an epoch's end, with the loops as they are when the next epoch starts."""
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        lightning = {key: value for key, value in checkpoint.items() if key not in TENSOR_KEYS}
        if self._epoch_end and "loops" in lightning:
            lightning["loops"] = _next_epoch_loops(lightning["loops"])
        return _storable(lightning)

    def _close(self, raise_error: bool) -> None:
        tailor, self._tailor = self._tailor, None
        if tailor is None:
            return
        try:
            tailor.close()
        except Exception:
            if raise_error:
                raise


def _no_snapshot(ckpt_path: Any) -> ConfigError:
    return ConfigError(f"ckpt_path={ckpt_path}: no committed snapshot there; expected a run directory holding one "
                       "(TailorCheckpoint.resume_path() is None until the first save commits) or a Lightning "
                       "checkpoint file")


def check_strategy(strategy: Any) -> None:
    """Refuse a strategy whose state is not one full copy per rank (module docstring)."""
    names = [cls.__name__ for cls in type(strategy).__mro__]
    if not any(name in SUPPORTED_STRATEGIES for name in names) or any("FSDP" in n or "DeepSpeed" in n for n in names):
        raise ConfigError(
            f"TailorCheckpoint supports Lightning's single-device and DDP strategies, not {type(strategy).__name__}: "
            "its state is sharded the strategy's own way. Use Tailor(run_dir, model, optimizer) in a torchrun loop "
            "(FSDP2, DeepSpeed) instead"
        )


# Lightning 2.x's fit-loop state (``_FitLoop.state_dict``): the per-epoch counters its training
# epoch loop resets when an epoch starts (``_TrainingEpochLoop.reset``, not restarting). The
# ``current`` part of each, and the validation loop's ``total`` (it counts the batches of an epoch).
_PER_EPOCH_COUNTERS = ("epoch_loop.batch_progress", "epoch_loop.scheduler_progress",
                       "epoch_loop.automatic_optimization.optim_progress")
_VAL_BATCHES = "epoch_loop.val_loop.batch_progress"


def _next_epoch_loops(loops: dict[str, Any]) -> dict[str, Any]:
    """Lightning's loop state dumped in ``on_train_epoch_end`` as the loops hold it when the next
    epoch starts: the epoch counted complete (Lightning counts it after the hook) and the epoch
    loop's per-epoch counters reset (as it resets them at an epoch's start).

    Why: resumed from the state as dumped (epoch processed, not completed, its last batch done),
    a Trainer with ``max_steps`` always restarts its loops, finds the epoch loop at its last batch
    and trains one more batch in the finished epoch (Lightning's own ``ModelCheckpoint`` does the
    same); from this state it starts the next epoch as the uninterrupted run did, and one with
    only ``max_epochs`` (no restart) does too. A state of another shape (another Lightning
    version) is returned unchanged."""
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    needed = ("epoch_progress", _VAL_BATCHES, *_PER_EPOCH_COUNTERS)
    if not isinstance(fit, dict) or not all(isinstance(fit.get(key), dict) for key in needed):
        return loops
    fit = copy.deepcopy(fit)
    for tracker in fit["epoch_progress"].values():
        tracker["completed"] = tracker["processed"]
    for key in _PER_EPOCH_COUNTERS:
        _zero(fit[key], "current")
    fit["epoch_loop.batch_progress"]["is_last_batch"] = False
    _zero(fit[_VAL_BATCHES], "total")
    return {**loops, "fit_loop": fit}


def _zero(progress: dict[str, Any], part: str) -> None:
    """Set every counter of the trackers named ``part`` in ``progress`` (nested: an optimizer's
    ``step`` and ``zero_grad``) to 0."""
    for name, value in progress.items():
        if name == part and isinstance(value, dict):
            for counter in value:
                value[counter] = 0
        elif isinstance(value, dict):
            _zero(value, part)


def _one_optimizer(trainer: pl.Trainer) -> tuple[Any, Any]:
    optimizers, schedulers = trainer.optimizers, trainer.lr_scheduler_configs
    if len(optimizers) != 1 or len(schedulers) > 1:
        raise ConfigError(
            f"TailorCheckpoint saves one optimizer and at most one LR scheduler; configure_optimizers returned "
            f"{len(optimizers)} optimizers and {len(schedulers)} schedulers"
        )
    return optimizers[0], schedulers[0].scheduler if schedulers else None


def _storable(lightning: dict[str, Any]) -> dict[str, Any]:
    """Lightning's own state as the snapshot's extras stores it (no pickle): the optional keys
    that hold objects only pickle could store are left out, with a warning. Only those are
    encoded here, to be checked; the rest is encoded once, with the save's global state, where
    a value that cannot be stored fails the save, nothing committed (an UnsupportedStateError
    naming its key). Checking every key here encoded it all twice: 0.15 ms of a Lightning-sized
    save's CPU (bench/RESULTS.md, issue 33, session 51)."""
    from llmtailor.store import codec

    kept = dict(lightning)
    for key in OPTIONAL_KEYS:
        if key not in kept:
            continue
        try:
            codec.encode(kept[key], where=f"Lightning checkpoint key {key!r}")
        except UnsupportedStateError as err:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"llmtailor: {key} left out of the snapshot ({err}); resuming does not need it")
            del kept[key]
    return kept


class _RunCheckpointIO(CheckpointIO):
    """The strategy's checkpoint I/O, except that a run directory loads as the Lightning
    checkpoint of its newest composite (module docstring)."""

    def __init__(self, inner: CheckpointIO, callback: TailorCheckpoint):
        self.inner, self.callback = inner, callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        run = self.callback.run_named(path)
        if run is None:
            try:
                return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            except IsADirectoryError:  # Lightning's own I/O reads a file
                raise _no_snapshot(path) from None
        with run.reading(None) as composite:
            checkpoint = lightning_checkpoint(run, composite)
        self.callback._resume = (run, composite.step)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
