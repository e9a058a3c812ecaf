"""Tailored checkpoints for Hugging Face ``transformers.Trainer``: three changed lines.

    from llmtailor.integrations.hf import TailorTrainer          # 1: the import
    from llmtailor import Parity

    trainer = TailorTrainer(model=model, args=args, train_dataset=data,
                            tailor_policy=Parity())              # 2: the class (+ a policy)
    trainer.train(resume_from_checkpoint=True)                   # 3: resume after a crash

On Trainer's own save schedule (``save_strategy`` / ``save_steps``) ``TailorTrainer`` writes one
tailored snapshot (the units the policy picks, plus optimizer groups, LR scheduler, RNG, the
TrainerState and TrainingArguments as JSON, stateful objects of its Tailor named
``trainer_state`` and ``training_args``: ``integrations/resume.py``, and with fp16 mixed
precision the gradient scaler, ``grad_scaler``) to its run instead of a
``checkpoint-N/`` directory:
``args.output_dir/tailored``, or ``tailor_run_dir``, a local path or an object-store URL as
``Tailor`` takes it (``TailorConfig.storage_options`` for the store, ``TailorConfig.tiers`` in
front of it). ``args.save_total_limit`` becomes ``keep``: snapshots the newest
K composites do not need are deleted. ``tailor_async=True`` saves asynchronously (training
waits only for the copies; the last save is waited for when ``train`` returns).

Launched with ``torchrun`` (DDP on several processes), every process takes part in each save:
the units are spread over the ranks, each writes its share and its own RNG states, and one
manifest commits them (``llmtailor.providers.local``). With ``TrainingArguments(deepspeed=...)``
the Tailor is given the DeepSpeed engine (``llmtailor.providers.deepspeed``): each rank writes
its own ZeRO fragments.

Resume, in place: ``train(resume_from_checkpoint=True)`` (or the path of a tailored run
directory) hands Trainer a small directory holding only the composite's ``trainer_state.json``,
so Trainer restores global step, epoch, batches to skip, log history, best metric and
callbacks' state with its own code; where Trainer would load weights, optimizer and scheduler
from files, ``Tailor.restore`` loads the composite into the live model, optimizer and
scheduler instead (under DeepSpeed: into the engine Trainer built, in place of
``deepspeed_load_checkpoint``), and where Trainer would load its RNG file, this rank's saved RNG
states are set. No full checkpoint is exported. Without a committed snapshot, ``resume_from_checkpoint=True``
falls back to Trainer's own ``checkpoint-N/`` directories in ``output_dir`` and, if there are
none, starts from scratch (so one script serves the first run and every restart); a path to an
ordinary ``checkpoint-N/`` directory goes to Trainer unchanged. Training from step 0 (no
``resume_from_checkpoint``) into a run that holds a composite is refused before training: its
first save would start a lineage of its own there, and retention then deleted what the run held.

Limits: ``load_best_model_at_end`` is refused (it needs Trainer's checkpoint directories).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from os import PathLike
from pathlib import Path
from typing import Any

import transformers
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint

from llmtailor.errors import ConfigError
from llmtailor.integrations.location import child_location, run_location
from llmtailor.interop.hf.files import TAILOR_TRAINER_RUN as RUN_DIRNAME
from llmtailor.interop.hf.files import TRAINER_STATE_FILE as TRAINER_STATE_NAME
from llmtailor.integrations.resume import Recorded, announce, refuse_a_fresh_start, restore_composite
from llmtailor.interop.hf.export import TRAINER_STATE_KEY, trainer_state_json
from llmtailor.config import TailorConfig
from llmtailor.policies import Policy
from llmtailor.providers.rng import restore_rng
from llmtailor.providers.stateful import saved_state
from llmtailor.store.storage import is_url
from llmtailor.store.run import Run
from llmtailor.store.tiers import Tiers
from llmtailor.tailor import Tailor

TRAINING_ARGS_KEY = "training_args"
"""The stateful object of the Tailor recording the TrainingArguments (as JSON) at each save."""
GRAD_SCALER_KEY = "grad_scaler"
"""The stateful object of the Tailor holding the gradient scaler of fp16 mixed precision (what
Trainer keeps in ``scaler.pt``), where Trainer's accelerator has one."""


class TailorTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints are tailored snapshots (module docstring).

    Extra keyword arguments: ``tailor_config`` (a ``TailorConfig``: the options of the
    ``Tailor`` it saves with: tiers, storage options, ...), or the shorthands ``tailor_policy``
    (default ``Full()``), ``tailor_keep`` (default ``args.save_total_limit``), ``tailor_async``
    and ``tailor_timeout``, which override the config's; ``tailor_run_dir``: the run, a local
    path or an object-store URL as ``Tailor`` takes it (default ``args.output_dir/tailored``;
    ``self.tailor_run_dir``)."""

    def __init__(
        self,
        *args: Any,
        tailor_config: TailorConfig | None = None,
        tailor_policy: Policy | None = None,
        tailor_keep: int | None = None,
        tailor_async: bool | None = None,
        tailor_timeout: float | None = None,
        tailor_run_dir: str | PathLike | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        if tailor_policy is not None and not isinstance(tailor_policy, Policy):
            raise ConfigError(f"tailor_policy must be a llmtailor policy (Full(), Parity(), ...), got {tailor_policy!r}")
        if self.args.load_best_model_at_end:
            raise ConfigError(
                "TailorTrainer does not support load_best_model_at_end=True: it needs Trainer's own "
                "checkpoint-N directories, which TailorTrainer does not write"
            )
        if tailor_keep is None and (tailor_config is None or tailor_config.keep is None):
            tailor_keep = self.args.save_total_limit  # Trainer's own retention setting, mapped
        self.tailor_config = TailorConfig.of(tailor_config, policy=tailor_policy, keep=tailor_keep,
                                             async_save=tailor_async, timeout=tailor_timeout)
        self.tailor_run_dir = (run_location(tailor_run_dir, "tailor_run_dir") if tailor_run_dir is not None
                               else child_location(run_location(self.args.output_dir, "output_dir"), RUN_DIRNAME))
        self._tiers()  # a location the store cannot use (storage options for a local path) is refused now
        self._tailor: Tailor | None = None
        self._resume: tuple[Run, int, Path] | None = None  # run, composite step, Trainer's resume dir

    @property
    def tailor_policy(self) -> Policy:
        return self.tailor_config.policy

    # -- saving ------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """One tailored snapshot at ``state.global_step`` in place of ``checkpoint-N/``. Every
        process takes part (a collective save)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        # As Trainer does: record the stateful callbacks' state in the TrainerState first.
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        self._tailor_for_save().save(self.state.global_step)  # with the TrainerState as it is now

    def _tailor_for_save(self) -> Tailor:
        if self._tailor is None:
            # JSON round trips: only plain dicts, lists, numbers and strings go into the snapshot.
            stateful = {TRAINER_STATE_KEY: Recorded(lambda: json.loads(json.dumps(asdict(self.state)))),
                        TRAINING_ARGS_KEY: Recorded(lambda: json.loads(self.args.to_json_string()))}
            scaler = getattr(self.accelerator, "scaler", None)  # fp16 mixed precision: Trainer's scaler.pt
            if scaler is not None:
                stateful[GRAD_SCALER_KEY] = scaler  # its loss scale and growth tracker, restored in place
            self._tailor = Tailor(self.tailor_run_dir, *self._live_objects(), config=self.tailor_config, fresh_start=True,
                                  stateful=stateful)
        return self._tailor

    def _live_objects(self) -> tuple[Any, Any, Any]:
        """(model, optimizer, scheduler) as Tailor takes them: under DeepSpeed, the engine
        (which holds the optimizer) and Trainer's scheduler."""
        if self.is_deepspeed_enabled:
            return self.model_wrapped, None, self.lr_scheduler
        return self.model, self.optimizer, self.lr_scheduler

    # -- resuming ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; ``resume_from_checkpoint=True`` or a tailored run directory resumes
        from the newest composite in place (module docstring)."""
        run = self._tailored_run(resume_from_checkpoint)
        # One writer per run, from the start: a second trainer on this run fails here, before it
        # trains (the Tailor built at the first save or restore shares this process's lock).
        lock = self._tiers().home.lock  # the run directory's writer lock (with the storage options)
        if self.is_world_process_zero():
            lock.acquire_or_look()
        try:
            if run is None:
                if resume_from_checkpoint is True and get_last_checkpoint(self.args.output_dir) is None:
                    resume_from_checkpoint = None  # nothing saved yet: a first run starts fresh
                if not resume_from_checkpoint:  # from step 0 (module docstring)
                    refuse_a_fresh_start(self._tiers(), self.tailor_run_dir,
                                         ": train(resume_from_checkpoint=True) resumes from it",
                                         "give another output_dir or tailor_run_dir")
                return super().train(resume_from_checkpoint, *args, **kwargs)
            step = run.latest_step()
            scratch = self._scratch_dir()
            self._resume = (run, step, scratch)
            trainer_state = saved_state(run.read_global(step), TRAINER_STATE_KEY)
            (scratch / TRAINER_STATE_NAME).write_text(
                trainer_state_json(trainer_state, step, self.args.per_device_train_batch_size), encoding="utf-8"
            )
            with _deepspeed_loads_nothing_from(scratch):
                return super().train(str(scratch), *args, **kwargs)
        finally:
            if self._resume is not None:
                shutil.rmtree(self._resume[2], ignore_errors=True)
                self._resume = None
            try:
                self._close_tailor()
            finally:
                lock.release()

    def _resuming(self, checkpoint: Any) -> bool:
        return self._resume is not None and checkpoint is not None and Path(checkpoint) == self._resume[2]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._resuming(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # Resuming a tailored run: the weights are loaded with the optimizer state, below.

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._resuming(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        run, step, _ = self._resume
        report = restore_composite(self._tailor_for_save(), run, step, self._live_objects())
        if self.is_world_process_zero():
            announce(report, run)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._resuming(checkpoint):
            return super()._load_rng_state(checkpoint)
        # Trainer sets the RNG right before the resumed epoch iterates; so do we (restore() set
        # it earlier, and data loading may have drawn from it since).
        run, step, _ = self._resume
        own = run.read_rank_state(step, self.args.process_index)
        if own is not None and own.get("rng") is not None:
            restore_rng(own["rng"])

    def _tiers(self) -> Tiers:
        return Tiers.of(self.tailor_run_dir, self.tailor_config)

    def _scratch_dir(self) -> Path:
        """A new local directory for the resume's ``trainer_state.json``: in ``output_dir``, or
        the system's temporary directory where ``output_dir`` is a URL."""
        output_dir = None if is_url(self.args.output_dir) else Path(self.args.output_dir)
        if output_dir is not None:
            output_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".tailor-resume-", dir=output_dir))

    def _tailored_run(self, resume_from_checkpoint: str | bool | None) -> Run | None:
        """The tailored run to resume from, or None to let Trainer handle the argument."""
        if resume_from_checkpoint is True:  # the newest composite of the run directory or its tiers
            return self._tiers().newest_run()
        if isinstance(resume_from_checkpoint, (str, PathLike)):
            tiers, run = self._tiers(), Run(resume_from_checkpoint)
            index = tiers.index_of(run)  # by the storage's identity
            if index is not None:
                run = tiers.levels[index].run  # this run's own tier, opened with its storage options
            return run if run.steps() else None
        return None

    def _close_tailor(self) -> None:
        # The last async save is waited for here; the next train() continues from a restore.
        if self._tailor is not None:
            try:
                self._tailor.close()
            finally:
                self._tailor = None


@contextmanager
def _deepspeed_loads_nothing_from(scratch: Path) -> Iterator[None]:
    """Under DeepSpeed, Trainer loads a resumed checkpoint into the engine with the module-level
    ``deepspeed_load_checkpoint``, which has no method to override: for our resume directory it
    does nothing (``_load_optimizer_and_scheduler`` restores the composite into the engine)."""
    import transformers.trainer as trainer_module

    original = trainer_module.deepspeed_load_checkpoint

    def load(engine: Any, checkpoint_path: str, *args: Any, **kwargs: Any) -> Any:
        if Path(checkpoint_path) == scratch:
            return None
        return original(engine, checkpoint_path, *args, **kwargs)

    trainer_module.deepspeed_load_checkpoint = load
    try:
        yield
    finally:
        trainer_module.deepspeed_load_checkpoint = original
