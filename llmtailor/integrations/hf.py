"""Tailored checkpoints for Hugging Face ``transformers.Trainer``: three changed lines.

    from llmtailor.integrations.hf import TailorTrainer          # 1: the import
    from llmtailor import Parity

    trainer = TailorTrainer(model=model, args=args, train_dataset=data,
                            tailor_policy=Parity())              # 2: the class (+ a policy)
    trainer.train(resume_from_checkpoint=True)                   # 3: resume after a crash

On Trainer's own save schedule (``save_strategy`` / ``save_steps``) ``TailorTrainer`` writes one
tailored snapshot to ``args.output_dir/tailored`` (the units the policy picks, plus optimizer
groups, LR scheduler, RNG, and the TrainerState and TrainingArguments as JSON) instead of a
``checkpoint-N/`` directory. ``args.save_total_limit`` becomes ``keep``: snapshots the newest
K composites do not need are deleted.

Resume: ``train(resume_from_checkpoint=True)`` (or the path of a tailored run directory)
exports the newest composite to a temporary ``checkpoint-N/`` directory in ``output_dir``
(``llmtailor.interop.hf_export``) and hands it to ``Trainer.train``, so everything Trainer
restores itself — global step, epoch, batches skipped, LR schedule, RNG, log history, best
metric, callbacks' state, weights and optimizer state — goes through Trainer's own code. The
temporary directory is removed when ``train`` returns or fails. Without a committed snapshot,
``resume_from_checkpoint=True`` falls back to Trainer's own ``checkpoint-N/`` directories in
``output_dir`` and, if there are none, starts from scratch (so one script serves the first run
and every restart); a path to an ordinary ``checkpoint-N/`` directory goes to Trainer unchanged.

Limits: one process (no DeepSpeed / FSDP / multi-GPU yet); ``load_best_model_at_end`` is
refused (it needs Trainer's checkpoint directories); the optimizer must use Trainer's own
decay / no-decay groups for the resume export (a custom ``create_optimizer`` is refused there,
with the first differing parameter named).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import transformers
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint

from llmtailor.errors import ConfigError
from llmtailor.interop.hf_export import export_hf
from llmtailor.policies import Full, Policy
from llmtailor.store.run import Run
from llmtailor.tailor import Tailor

RUN_DIRNAME = "tailored"


class TailorTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints are tailored snapshots (module docstring).

    Extra keyword arguments: ``tailor_policy`` (default ``Full()``) and ``tailor_keep`` (default
    ``args.save_total_limit``). The run directory is ``args.output_dir/tailored``
    (``self.tailor_run_dir``)."""

    def __init__(self, *args: Any, tailor_policy: Policy | None = None, tailor_keep: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if tailor_policy is not None and not isinstance(tailor_policy, Policy):
            raise ConfigError(f"tailor_policy must be a llmtailor policy (Full(), Parity(), ...), got {tailor_policy!r}")
        if self.args.load_best_model_at_end:
            raise ConfigError(
                "TailorTrainer does not support load_best_model_at_end=True: it needs Trainer's own "
                "checkpoint-N directories, which TailorTrainer does not write"
            )
        if self.args.world_size > 1:
            raise ConfigError("TailorTrainer runs in one process for now (world_size is %d)" % self.args.world_size)
        self.tailor_policy: Policy = tailor_policy or Full()
        self.tailor_keep = tailor_keep if tailor_keep is not None else self.args.save_total_limit
        self.tailor_run_dir = Path(self.args.output_dir) / RUN_DIRNAME
        self._tailor: Tailor | None = None
        self._resumed_from: int | None = None  # step of the composite this train() resumed

    # -- saving ------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """One tailored snapshot at ``state.global_step`` in place of ``checkpoint-N/``."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        if not self.args.should_save:
            return
        # As Trainer does: record the stateful callbacks' state in the TrainerState first.
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        extra = {
            # JSON round trips: only plain dicts, lists, numbers and strings go into the snapshot.
            "trainer_state": json.loads(json.dumps(asdict(self.state))),
            "training_args": json.loads(self.args.to_json_string()),
        }
        self._tailor_for_save().save(self.state.global_step, extra=extra)

    def _tailor_for_save(self) -> Tailor:
        if self._tailor is None:
            self._tailor = Tailor(
                self.tailor_run_dir,
                self.model,
                self.optimizer,
                self.lr_scheduler,
                self.tailor_policy,
                keep=self.tailor_keep,
            )
            if self._resumed_from is not None:
                self._tailor.continue_from(self._resumed_from)
        return self._tailor

    # -- resuming ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; ``resume_from_checkpoint=True`` or a tailored run directory resumes
        from the newest composite through Trainer's own resume path (module docstring)."""
        run = self._tailored_run(resume_from_checkpoint)
        if run is None:
            if resume_from_checkpoint is True and get_last_checkpoint(self.args.output_dir) is None:
                resume_from_checkpoint = None  # nothing saved yet: a first run starts fresh
            try:
                return super().train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self._close_tailor()
        Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".tailor-resume-", dir=self.args.output_dir))
        try:
            self._resumed_from = run.latest_step()
            checkpoint = export_hf(run, self._resumed_from, scratch)
            return super().train(str(checkpoint), *args, **kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self._close_tailor()
            self._resumed_from = None

    def _tailored_run(self, resume_from_checkpoint: str | bool | None) -> Run | None:
        """The tailored run to resume from, or None to let Trainer handle the argument."""
        if resume_from_checkpoint is True:
            run = Run(self.tailor_run_dir)
            return run if run.latest_step() is not None else None
        if isinstance(resume_from_checkpoint, (str, Path)):
            run = Run(resume_from_checkpoint)
            return run if run.steps() else None
        return None

    def _close_tailor(self) -> None:
        # The next train() in this process continues the lineage from a fresh restore.
        if self._tailor is not None:
            self._tailor.close()
            self._tailor = None
