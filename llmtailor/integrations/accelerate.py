"""Tailored checkpoints for Hugging Face accelerate custom loops: one changed line.

    from llmtailor import Parity
    from llmtailor.integrations.accelerate import TailorAccelerator

    accelerator = TailorAccelerator(tailor_run_dir="runs/exp", tailor_policy=Parity())   # was Accelerator()
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    start = accelerator.load_state().step if accelerator.tailor_resumable() else 0
    for step, batch in enumerate(accelerator.skip_first_batches(dataloader, start), start=start + 1):
        ...                                                    # forward, accelerator.backward, step
        if step % 100 == 0:
            accelerator.save_state(step=step)
    accelerator.end_training()                                 # waits for an async save in flight

``TailorAccelerator`` is an ``accelerate.Accelerator`` whose ``save_state`` and ``load_state``
go through llmtailor. ``save_state(step=N)`` writes one tailored snapshot of the prepared model,
optimizer and LR scheduler (the units the policy picks, with their optimizer state; each
process's RNG streams) plus, as the state of its Tailor's stateful object ``accelerate``
(``integrations/resume.py``), what ``Accelerator.save_state`` keeps beside them: the
gradient-accumulation step counter, each object registered with ``register_for_checkpointing``
(its ``state_dict``), each stateful dataloader's position
(``DataLoaderConfiguration(use_stateful_dataloader=True)``) and the gradient scaler; ``extra=``
is the snapshot's extras, yours (a data position for ``skip_first_batches``, say). A run written
before stateful objects (its extras ``{"accelerate": state, "user": yours}``) loads as well.
``load_state()`` restores the newest composite in place (``Tailor.restore``: the live objects ``prepare``
returned) and all of that, and returns the ``RestoreReport`` (``step``, ``extra``: yours).
``load_state(RUN)`` of another tailored run loads from there (this run's own snapshots then
start a lineage of their own); any other directory, and ``save_state(DIR)`` of a directory
other than the run's, are ``Accelerator``'s own, unchanged. The first ``save_state`` of an
accelerator that loaded nothing from the run is refused when the run holds a composite (a
restart that left out ``load_state``): it would start a lineage of its own there, and retention
then deleted what the run held. A ``save_state`` in the middle of a gradient accumulation
(``accelerator.sync_gradients`` False: the gradients accumulated so far are in no snapshot) is
refused: save after the optimizer step of an accumulation's last micro step.

The run is what ``Tailor`` takes: a local path or an object-store URL
(``tailor_run_dir="s3://bucket/exp"``, with ``TailorConfig(storage_options=...)``); a directory
given to ``save_state`` / ``load_state`` is the run when its storage is the run's or a tier's
(``file:///data/exp`` is ``/data/exp``; ``integrations/location.py``).

RNG order across a resume (with the ``Full`` policy training continues bit for bit, dropout
included): resuming mid-epoch, ``skip_first_batches`` makes a DataLoader iterator, which draws a
base seed from the RNG, that the uninterrupted run made at the epoch's start, before the save; so
``skip_first_batches`` right after ``load_state`` gives a loader that sets the RNG streams back to
what ``load_state`` restored when it gives its first batch (as HF Trainer does). At an epoch
boundary, iterate the dataloader itself (or skip 0 batches): its iterator draws as the
uninterrupted run's next epoch did.

Objects: one model and one optimizer (several are refused), at most one LR scheduler; plain,
DDP (``accelerate launch --multi_gpu --num_processes N`` with ``Accelerator(cpu=True)`` runs N
CPU processes) or a DeepSpeed engine (``accelerate launch --use_deepspeed``; on CPU with
``DS_ACCELERATOR=cpu``). The run's writer lock is taken when the ``TailorAccelerator`` is built
(by the main process: a second trainer on the run fails there, before it trains) and released by
``end_training`` (or at exit).
"""

from __future__ import annotations

import dataclasses
from os import PathLike
from typing import Any

from accelerate import Accelerator

from llmtailor.config import TailorConfig
from llmtailor.errors import ConfigError, UnsupportedStateError
from llmtailor.integrations.location import run_location
from llmtailor.integrations.resume import refuse_a_fresh_start, restore_composite
from llmtailor.policies import Policy
from llmtailor.providers.rng import capture_rng, restore_rng
from llmtailor.providers.stateful import not_saved
from llmtailor.reports import PendingSave, RestoreReport, SaveReport
from llmtailor.store.run import Run
from llmtailor.store.tiers import Tiers
from llmtailor.tailor import Tailor

ACCELERATE_KEY = "accelerate"
"""The name of the stateful object keeping the accelerator's own state (``providers/stateful.py``)."""
USER_KEY = "user"
"""Before stateful objects, the snapshot's extras were ``{ACCELERATE_KEY: state, USER_KEY: yours}``."""


class TailorAccelerator(Accelerator):
    """``accelerate.Accelerator`` saving and loading state as tailored snapshots (module
    docstring). ``tailor_run_dir``: the run (a local path or a URL); ``tailor_policy`` /
    ``tailor_config``: the options of its ``Tailor``; every other argument is ``Accelerator``'s."""

    def __init__(self, *args: Any, tailor_run_dir: str | PathLike, tailor_policy: Policy | None = None,
                 tailor_config: TailorConfig | None = None, **kwargs: Any):
        # Checked before any set-up: the options, and a location the store can use.
        self.tailor_config = TailorConfig.of(tailor_config, policy=tailor_policy)
        self.tailor_run_dir = run_location(tailor_run_dir, "tailor_run_dir")
        self._tailor: Tailor | None = None
        self._own = _OwnState(self)  # the accelerator's own state, a stateful object of its Tailor
        self._resumed_rng: dict[str, Any] | None = None  # the RNG streams load_state set, until training goes on
        self._lock = self._tiers().home.lock  # the run directory's writer lock (with the storage options)
        super().__init__(*args, **kwargs)
        # One writer per run, from the start: a second trainer on this run fails here, before it
        # trains (the Tailor built at the first save_state / load_state shares this process's lock).
        if self._is_rank_zero() and not self.tailor_config.read_only:
            self._lock.acquire_or_look()

    def tailor_resumable(self) -> bool:
        """Whether the run holds a committed composite for ``load_state`` to restore."""
        return self._tiers().latest_step() is not None

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, *, step: int | None = None,
                   extra: Any = None, **kwargs: Any) -> SaveReport | PendingSave | str:
        """A tailored snapshot of ``step`` (default: the run's newest step + 1) with the
        accelerator's state and ``extra``; ``output_dir`` other than the run: accelerate's own save."""
        if not self._ours(output_dir):
            return super().save_state(output_dir, safe_serialization, **kwargs)
        if not self.sync_gradients:
            raise ConfigError(
                f"save_state in the middle of a gradient accumulation (micro step {self.step}, accumulating "
                f"{self.gradient_accumulation_steps}): the gradients accumulated so far are in no snapshot, so a "
                "resume from it would step without them; save after the optimizer step of an accumulation's last "
                "micro step (if accelerator.sync_gradients: accelerator.save_state(...))"
            )
        if self._tailor is None:  # no tailored save_state or load_state yet (module docstring)
            refuse_a_fresh_start(self._tiers(), self.tailor_run_dir,
                                 ", which this accelerator did not load: load_state() resumes from it "
                                 "(tailor_resumable() says whether there is one)", "give another tailor_run_dir")
        tailor = self._tailor_for_run()
        if step is None:
            step = (tailor.latest_step() or 0) + 1
        return tailor.save(step, extra=extra)  # the accelerator's own state refused before anything is written

    def load_state(self, input_dir: str | None = None, *, step: int | None = None, **kwargs: Any) -> RestoreReport | None:
        """Restore the composite of ``step`` (default: the newest) and the accelerator's state;
        return the report, its ``extra`` the one given to ``save_state``. A directory that is not
        a tailored run: accelerate's own load."""
        if not self._ours(input_dir) and Run(input_dir).latest_step() is None:
            return super().load_state(input_dir, **kwargs)
        tailor = self._tailor_for_run()
        run = tailor.run if input_dir is None else Run(input_dir)  # this run: the newest composite of any tier
        self._own.restored = False
        report = restore_composite(tailor, run, step, self._live_objects())
        if not self._own.restored:
            report = self._load_from_extras(report)
        self._resumed_rng = capture_rng()
        return report

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's ``skip_first_batches``; right after ``load_state``, resuming mid-epoch
        (``num_batches`` > 0), the loader returned sets each process's RNG streams back to what
        ``load_state`` restored once it has made its iterator (which draws a base seed from them)
        and before it gives its first batch: the steps after it draw what the uninterrupted run's
        did (that run made its iterator at the epoch's start, before the save)."""
        skipped = super().skip_first_batches(dataloader, num_batches)
        rng, self._resumed_rng = self._resumed_rng, None
        return _RngSetAtFirstBatch(skipped, rng) if rng is not None and num_batches > 0 else skipped

    def backward(self, loss: Any, **kwargs: Any) -> None:
        self._resumed_rng = None  # training went on: a later skip_first_batches is no resume
        super().backward(loss, **kwargs)

    def end_training(self) -> None:
        """Wait for an async save in flight (raising its error), release the run's lock, then
        accelerate's own ``end_training``."""
        tailor, self._tailor = self._tailor, None
        try:
            if tailor is not None:
                tailor.close()
        finally:
            try:
                self._lock.release()
            finally:
                super().end_training()

    # -- the accelerator's own state -------------------------------------------------------

    def _own_state(self) -> dict[str, Any]:
        from llmtailor.store import codec

        state = {
            "step": self.step,
            "custom": [obj.state_dict() for obj in self._custom_objects],
            "dataloaders": [dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
                            for dl in self._dataloaders],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
        try:
            codec.encode(state, where="the accelerator's state")
        except UnsupportedStateError as err:
            raise ConfigError(f"{err}: objects registered for checkpointing must hold tensors, numbers, strings, "
                              "lists and dicts (TailorAccelerator stores no pickle)") from None
        return state

    def _load_from_extras(self, report: RestoreReport) -> RestoreReport:
        """A snapshot without the accelerator's state as a stateful object: written before there
        were any, with the extras ``{ACCELERATE_KEY: state, USER_KEY: yours}``, or by another
        writer (no state of the accelerator's own: refused if objects are registered). Loaded as
        before stateful objects; the report's extras are yours."""
        saved = report.extra if isinstance(report.extra, dict) else {}
        self._load_own_state(saved.get(ACCELERATE_KEY) or {})
        unmapped = tuple(note for note in report.unmapped if note != not_saved(ACCELERATE_KEY))
        return dataclasses.replace(report, extra=saved.get(USER_KEY), unmapped=unmapped)

    def _load_own_state(self, state: dict[str, Any]) -> None:
        if "step" in state:
            self.step = state["step"]
        custom = state.get("custom") or []
        if len(custom) != len(self._custom_objects):
            raise ConfigError(f"the snapshot holds {len(custom)} objects registered for checkpointing, this run "
                              f"registered {len(self._custom_objects)}: register the same ones, in the same order")
        for obj, saved in zip(self._custom_objects, custom):
            obj.load_state_dict(saved)
        for dl, saved in zip(self._dataloaders, state.get("dataloaders") or []):
            if saved is not None and getattr(dl, "use_stateful_dataloader", False):
                dl.load_state_dict(saved)
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])

    # -- the Tailor ------------------------------------------------------------------------

    def _is_rank_zero(self) -> bool:
        """Whether this is the job's first process, by torch.distributed's rank where it is set
        up: under DeepSpeed on CPU, accelerate's own state counts one process, so every rank
        would take itself for the main one (and race the others for the lock)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
        return self.is_main_process

    def _tiers(self) -> Tiers:
        return Tiers.of(self.tailor_run_dir, self.tailor_config)

    def _ours(self, directory: str | PathLike | None) -> bool:
        """Whether ``directory`` is this run (its run directory or one of its tiers), by the
        storage's identity."""
        return directory is None or self._tiers().index_of(Run(directory)) is not None

    def _tailor_for_run(self) -> Tailor:
        if self._tailor is None:
            self._tailor = Tailor(self.tailor_run_dir, *self._live_objects(), config=self.tailor_config, fresh_start=True,
                                  stateful={ACCELERATE_KEY: self._own})
        return self._tailor

    def _live_objects(self) -> tuple[Any, Any, Any]:
        """The prepared model, optimizer and LR scheduler (a DeepSpeed engine brings its own
        optimizer, and its scheduler unless it has none)."""
        from llmtailor.providers.deepspeed import is_engine

        models, optimizers, schedulers = self._models, self._optimizers, self._schedulers
        if len(models) != 1 or len(optimizers) > 1 or len(schedulers) > 1:
            raise ConfigError(
                f"TailorAccelerator saves one model, one optimizer and at most one LR scheduler; prepare() was given "
                f"{len(models)} models, {len(optimizers)} optimizers and {len(schedulers)} schedulers"
            )
        model = models[0]
        scheduler = schedulers[0] if schedulers else None
        if is_engine(model):
            return model, None, scheduler if model.lr_scheduler is None else None
        if not optimizers:
            raise ConfigError("TailorAccelerator needs the optimizer passed through prepare()")
        return model, optimizers[0], scheduler


class _OwnState:
    """The accelerator's own state (``_own_state``) as a stateful object of its Tailor;
    ``restored``: whether a restore loaded it since the flag was cleared."""

    def __init__(self, accelerator: TailorAccelerator):
        self.accelerator, self.restored = accelerator, False

    def state_dict(self) -> dict[str, Any]:
        return self.accelerator._own_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator._load_own_state(state)
        self.restored = True


class _RngSetAtFirstBatch:
    """A loader that sets the RNG streams to ``rng`` when it gives its first batch (after its
    iterator is made), once; anything else is the wrapped loader's."""

    def __init__(self, loader: Any, rng: dict[str, Any]):
        self.loader, self._rng = loader, rng

    def __iter__(self) -> Any:
        for batch in self.loader:
            if self._rng is not None:
                restore_rng(self._rng)
                self._rng = None
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
