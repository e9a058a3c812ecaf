"""``Tailor``: tailored checkpointing for a PyTorch training loop.

    tailor = Tailor("runs/exp1", model, optimizer, lr_scheduler, policy=Parity())
    if tailor.latest_step() is not None:
        start = tailor.restore().step
    ...
    tailor.save(step, extra={"epoch": epoch})

Each save writes the units the policy picks plus the global state; ``restore`` loads the
composite (each unit from its newest version, global state from the composite's step) into
the live objects in place. In a torch.distributed job every rank makes the same calls (they
are collective): each rank writes its own shards, one manifest commits them all, and a run
saved at one world size restores at another.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtailor.errors import BackgroundSaveError, ConfigError, IntegrityError, TailorError
from llmtailor.layouts import Layout
from llmtailor.drift import DriftTracker, Sample, drift_figures
from llmtailor.policies import Adaptive, Full, Policy, SaveContext
from llmtailor.providers import StateProvider, make_provider
from llmtailor.store import codec
from llmtailor.store.coordinator import DEFAULT_TIMEOUT, CoordinationError, Coordinator, describe_error, make_coordinator
from llmtailor.store.lock import WriterLock
from llmtailor.store.retention import apply_retention, check_keep, plan_retention
from llmtailor.store.run import Composite, Run
from llmtailor.store.staging import AsyncStager, BackgroundSave
from llmtailor.store.staged import PersistResult, StagedSnapshot
from llmtailor.store.writer import persist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveReport:
    """What one save wrote."""

    step: int
    units: list[str]
    bytes: int
    """Bytes of the whole snapshot (every rank's files)."""
    seconds: float
    path: Path
    unit_bytes: dict[str, int]
    """Bytes this rank wrote per unit."""
    rank_bytes: int = 0
    """Bytes this rank wrote in all."""


class PendingSave:
    """An async save in flight: ``save`` returned once the units were chosen and the global
    state captured; the copies and the write go on in the background."""

    def __init__(self, job: BackgroundSave, to_report: Callable[[PersistResult, float], SaveReport]):
        self._job, self._to_report = job, to_report
        self.step: int = job.step
        self.units: list[str] = job.units
        self.blocked_seconds: float = job.blocked_seconds
        """How long ``save`` blocked the training loop."""

    def done(self) -> bool:
        return self._job.done()

    @property
    def copy_seconds(self) -> float:
        """Seconds the background thread spent copying into host buffers (once done)."""
        return self._job.copy_seconds

    @property
    def persist_seconds(self) -> float:
        """Seconds the background thread spent writing and committing (once done)."""
        return self._job.persist_seconds

    def result(self, timeout: float | None = None) -> SaveReport:
        """Wait until the snapshot is committed and durable; raise what failed in the background."""
        outcome = self._job.result(timeout)
        return self._to_report(outcome, self._job.copy_seconds + self._job.persist_seconds)


@dataclass(frozen=True)
class RestoreReport:
    """What a restore loaded: the composite's step, the user extras saved with it (this rank's),
    and the step each unit came from."""

    step: int
    extra: Any
    sources: dict[str, int]
    seconds: float
    skipped: dict[int, str]
    """With ``fallback=True``: newer composites passed over, and why."""
    saved_world_size: int = 1
    unmapped: tuple[str, ...] = ()
    """Per-rank state that could not be mapped at this world size (empty at the saved one)."""


class Tailor:
    """Save and restore tailored checkpoints of a model, optimizer and LR scheduler.

    ``model`` is a plain ``torch.nn.Module``, a DDP-wrapped one, or one sharded with FSDP2
    (``fully_shard``); in a torch.distributed job, every rank constructs its Tailor and calls
    ``save`` and ``restore`` (collectives).

    Invariants: a save never touches an earlier snapshot; after ``restore(T)`` every weight and
    optimizer tensor equals, bit for bit, the version the composite of T names, and with the
    ``Full`` policy training continues bitwise as if uninterrupted (on CPU). Optimizer state is
    matched by parameter name. Restoring never unpickles. One ``Tailor`` at a time may write to
    a run directory (a lock, taken by rank 0 at the first save, released by ``close`` or
    process exit).
    """

    def __init__(
        self,
        run_dir: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        policy: Policy | None = None,
        *,
        family: str | None = None,
        keep: int | None = None,
        async_save: bool = False,
        track_drift: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        read_only: bool = False,
    ):
        """``keep=K``: after each save, delete every snapshot that the newest K composites do not
        need (``llmtailor gc`` does the same on demand). ``async_save=True``: ``save`` returns
        at once (a ``PendingSave``); the tensors are copied and written in the background, and
        the next ``optimizer.step()`` waits only until the copies are taken (a step pre-hook
        installed here; nothing to add to the training loop). ``track_drift``: measure each unit's
        drift since its last saved version at every save (``llmtailor.drift``; recorded in the
        manifest, what the ``Adaptive`` policy decides by and ``llmtailor drift`` plots).
        ``timeout``: seconds a rank waits for the others during a collective save or restore
        before failing with an error naming the ranks that did not answer. ``read_only=True``:
        a Tailor that only restores (an evaluation job beside the trainer): it does not mind a
        writer on the run, and refuses to save."""
        if policy is not None and not isinstance(policy, Policy):
            raise ConfigError(f"policy must be a llmtailor policy (Full(), Parity(), ...), got {policy!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds")
        self.keep = keep if keep is None else check_keep(keep)
        self.run = Run(run_dir)
        self._lock = WriterLock(self.run.root)
        self.coordinator: Coordinator = make_coordinator(timeout)
        self.provider: StateProvider = make_provider(model, optimizer, lr_scheduler, self.coordinator, family)
        self.layout: Layout = self.provider.layout
        self.policy: Policy = policy or Full()
        self.policy.check_units(list(self.layout.units))
        # The lineage this process extends: set by restore() or by its own saves. A fresh
        # Tailor starts a new lineage, whose first save is full.
        self._parent: int | None = None
        self._save_index = 0
        self._composite: dict[str, int] = {}
        self.async_save = bool(async_save)
        self._stager = AsyncStager(self.provider.optimizers()) if self.async_save else None
        self._inflight: tuple[PendingSave, int, dict[str, int]] | None = None
        """The async save in flight: its job, step and composite (the lineage once it commits)."""
        if isinstance(self.policy, Adaptive) and not track_drift:
            raise ConfigError("the Adaptive policy decides by measured drift: it needs track_drift=True")
        self._drift = DriftTracker() if track_drift else None
        # The tracker keeps views of the live tensors; an optimizer loading new state replaces
        # them, so it lets go at once rather than holding the old state's memory until a save.
        # (The hook holds the tracker only: an optimizer must not keep this Tailor, and its
        # writer lock, alive.)
        tracker = self._drift
        self._drift_hooks = [
            opt.register_load_state_dict_pre_hook(lambda *_: tracker.forget())
            for opt in (self.provider.optimizers() if tracker is not None else [])
            if hasattr(opt, "_optimizer_load_state_dict_pre_hooks")  # a torch Optimizer that ran its __init__
        ]
        self._saved_index: dict[str, int] = {}
        self._unit_bytes: dict[str, int] = {}
        self._pending_drift: tuple[Sample, list[str]] | None = None
        self._partly_restored: str | None = None
        """Set when a restore failed after the live state was touched: saving is refused."""
        # One writer per run, settled before any training is spent: a second trainer on a run
        # another process writes fails here, not at its first save. Rank 0 takes the lock;
        # every rank learns how it went.
        self.read_only = bool(read_only)
        try:
            if not self.read_only:
                round_ = self.coordinator.new_round()
                self.coordinator.broadcast(f"{round_}/lock", self._lock.acquire_or_look if self.coordinator.is_leader else None)
        except BaseException:
            self._remove_hooks()
            raise

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def latest_step(self) -> int | None:
        """Step of the newest committed composite in the run directory, or None."""
        return self.run.latest_step()

    # -- saving -------------------------------------------------------------------------------

    def save(self, step: int, extra: Any = None, *, blocking: bool | None = None) -> SaveReport | PendingSave:
        """Write the units the policy picks, plus global state, as the snapshot of ``step``.

        ``extra`` is any tree of dicts, lists, tuples, numbers, strings, tensors and numpy
        arrays (data position, epoch, ...); ``restore`` returns it, each rank its own.

        Synchronous (the default, or ``blocking=True``): returns a ``SaveReport`` once the
        snapshot is committed. With ``async_save=True`` (and ``blocking`` not True): waits for
        the save still in flight, if any (raising its error), and returns a ``PendingSave`` at
        once. The final save of a run is best made with ``blocking=True`` (or followed by
        ``wait()``/``close()``)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        if self.read_only:
            raise ConfigError(f"this Tailor of {self.run.root} was made with read_only=True: it restores, it does not save")
        self._settle(raise_error=True, next_step=step)
        if self._partly_restored is not None:
            raise TailorError(
                f"{self._partly_restored}, so the live model and optimizer may hold a mix of states; saving them is "
                "refused: restore() again (fallback=True passes over damaged composites) before saving"
            )
        if self._parent is not None and step <= self._parent:
            raise ConfigError(f"step {step} is not after the previous snapshot's step {self._parent}")
        start = time.perf_counter()
        drift, gathered = self._measure_drift()
        decision = self.policy.decide(
            SaveContext(
                save_index=self._save_index,
                step=step,
                units=tuple(self.layout.units),
                last_saved=self._composite,
                last_saved_index=self._saved_index,
                drift=drift,
                unit_bytes=self._unit_bytes,
                frozen=frozenset(self.provider.frozen_units()),
            )
        )
        units = decision.units
        composite = {**self._composite, **{unit: step for unit in units}}
        staged = self._stage(step, units, composite, extra)
        staged.decision = {**decision.record, **({"drift": drift} if drift is not None else {})}
        # The saved units' sampled values, taken now (before the next step): their new references.
        self._pending_drift = (gathered, units) if gathered is not None else None

        def report(result: PersistResult, seconds: float) -> SaveReport:
            return SaveReport(step, units, result.bytes, seconds, result.path, result.unit_bytes, result.rank_bytes)

        if blocking or (blocking is None and not self.async_save):
            result = self._persist(staged)
            self._extend_to(step, composite)
            self._raise_pointer_error(result)
            self._retain(result)
            return report(result, time.perf_counter() - start)
        if self._stager is None:
            raise ConfigError("save(blocking=False) needs a Tailor made with async_save=True")
        units_now = list(staged.units)  # this rank's pieces: references, no bytes copied yet
        job = self._stager.start(staged, units_now, self._persist, after=self._retain, target=str(self.run.root))
        job.blocked_seconds = time.perf_counter() - start
        pending = PendingSave(job, report)
        self._inflight = (pending, step, composite)
        return pending

    def wait(self) -> SaveReport | None:
        """Block until the async save in flight (if any) is committed and durable; return its
        report, or raise what failed in the background (once)."""
        if self._inflight is None:
            return None
        pending = self._inflight[0]
        self._settle(raise_error=True)
        return pending.result()

    def fence(self) -> None:
        """Block until the async save in flight (if any) has taken its copies. Call it before
        changing weights or optimizer state in place outside ``optimizer.step()`` (loading a
        state dict, an EMA swap, ...) while a save may be in flight; ``optimizer.step()`` and
        the ``train()`` / ``eval()`` of schedule-free optimizers are fenced for you. A change
        made without it fails that save (version counters), never commits a mix of values."""
        if self._stager is not None:
            self._stager.wait_copied()

    def _settle(self, raise_error: bool, next_step: int | None = None) -> None:
        """Wait for the async save in flight; on success, make its composite the lineage's.
        Its failure is raised here (once, as a BackgroundSaveError saying what was and was not
        saved; ``next_step``: the save that is refused because of it) when ``raise_error``,
        else kept for the next call."""
        if self._inflight is None:
            return
        pending, step, composite = self._inflight
        job = pending._job
        job.finished.wait()
        if job.error is None:
            self._inflight = None
            self._extend_to(step, composite)
            self._raise_pointer_error(job.outcome)
        elif raise_error:
            self._inflight = None
            try:
                job.result()
            except BaseException as err:
                newest = "no composite" if self._parent is None else f"step {self._parent}"
                failed = (
                    f"the async save of step {step} failed in the background ({describe_error(err)}); nothing of "
                    f"it was committed and the run's newest composite is still {newest}"
                )
                if next_step is not None:
                    failed = f"step {next_step} was not saved: {failed}. Call save({next_step}) again to save this step"
                raise BackgroundSaveError(failed) from err

    def _persist(self, staged: StagedSnapshot) -> PersistResult:
        return persist(self.run, staged, coordinator=self.coordinator, prepare=self._lock.claim)

    def _extend_to(self, step: int, composite: dict[str, int]) -> None:
        saved = [unit for unit, source in composite.items() if source == step]
        self._saved_index.update({unit: self._save_index for unit in saved})
        manifest = self.run.manifest(step)
        self._unit_bytes.update({unit: manifest.unit_bytes(unit) for unit in saved})
        if self._drift is not None and self._pending_drift is not None:
            self._drift.adopt(*self._pending_drift)
        self._pending_drift = None
        self._parent, self._save_index, self._composite = step, self._save_index + 1, composite

    def _sample_all(self) -> Sample:
        units = list(self.layout.units)
        return self._drift.gather(units, self.provider)

    def _measure_drift(self) -> tuple[dict[str, dict[str, float | None]] | None, Sample | None]:
        """Each unit's drift since its last saved version, the same on every rank (one
        all-reduce of the per-rank sums), and the sample it was measured on."""
        if self._drift is None:
            return None, None
        units = list(self.layout.units)
        gathered = self._sample_all()
        sums = self.coordinator.all_reduce_sum(self._drift.partial_sums(units, gathered))
        return drift_figures(units, sums, self._drift.known()), gathered

    def _stage(self, step: int, units: list[str], composite: dict[str, int], extra: Any) -> StagedSnapshot:
        """What this rank writes: its pieces of the units it holds (staged one at a time, as
        the writer asks for them) and the global state, encoded now (a copy)."""
        error: BaseException | None = None
        global_doc = global_tensors = rank_doc = rank_tensors = None
        try:
            own = {**self.provider.capture_rank(), "extra": extra}
            if self.coordinator.is_leader:
                state = {"step": step, **self.provider.capture_shared(), **own}
                global_doc, global_tensors = codec.encode(state, where="global state")
            else:
                rank_doc, rank_tensors = codec.encode(own, where=f"global state of rank {self.rank}")
        except TailorError as err:
            if self.world_size == 1:
                raise  # refused before anything is written
            error = err  # the save must fail on every rank: persisting reports it
        return StagedSnapshot(
            step=step,
            parent=self._parent,
            save_index=self._save_index,
            policy=self.policy.describe(),
            layout=self.layout.to_record(),
            units=(self.provider.stage_unit(unit) for unit in self.provider.writes(units)),
            composite=composite,
            global_doc=global_doc,
            global_tensors=global_tensors,
            rank_doc=rank_doc,
            rank_tensors=rank_tensors,
            world_size=self.world_size,
            provider=self.provider.kind,
            notes=self.provider.notes(),
            error=error,
        )

    @staticmethod
    def _raise_pointer_error(result: PersistResult | None) -> None:
        if result is not None and result.pointer_error:
            raise TailorError(result.pointer_error)

    def _retain(self, result: PersistResult) -> None:
        """Retention after a commit (rank 0): a failure is logged, never fatal to the save."""
        if self.keep is None or not self.coordinator.is_leader or result.pointer_error:
            return
        try:
            apply_retention(self.run, plan_retention(self.run, self.keep))
        except (TailorError, OSError) as err:
            log.warning("llmtailor retention after step %s: %s", result.path.name, err)

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, fallback: bool = False, verify: bool = True) -> RestoreReport:
        """Load the newest committed composite (or the one as of ``step``) in place.

        Compatibility (layout, names, shapes, dtypes, optimizer class and groups) is checked
        from the manifests before any tensor byte is read. ``verify=True`` checks every chunk
        read against its checksum; ``verify=False`` (distributed providers) reads only the byte
        ranges this rank holds and leaves checking to ``llmtailor verify``. With
        ``fallback=True`` (and no ``step``), a composite any of whose files fails verification
        is passed over for the newest older one that verifies whole; the report's ``skipped``
        says what was passed over and why.

        Collective in a distributed job: rank 0 picks the composite, every rank reads its part
        into its live state, then the ranks agree that every read succeeded before any of them
        enters a collective to finish (DeepSpeed's low-precision refresh), so a failure on one
        rank makes every rank raise, naming the rank and its error, instead of leaving the
        others blocked in a collective. A restore that failed after the live state was touched
        (on any rank) leaves this Tailor refusing to save until a restore succeeds: a mix of
        states is never written as a snapshot."""
        self._settle(raise_error=False)  # a failure in flight stays for the next save / wait / close
        round_ = self.coordinator.new_round()
        choice = self.coordinator.broadcast(
            f"{round_}/choose", (lambda: self._choose(step, fallback)) if self.coordinator.is_leader else None
        )
        start = time.perf_counter()
        # Leased: retention elsewhere (gc, keep=) cannot remove what is read. A composite it
        # removed first gives way to the newest if that was asked for (one process: ranks
        # resolving again on their own could disagree), else fails before any byte is read.
        newest = step is None and self.world_size == 1
        with ExitStack() as held:
            composite, touched, error = None, False, None
            try:
                composite = held.enter_context(self.run.reading(choice["step"], newest_if_removed=newest))
                self.provider.check_compatible(
                    composite.manifest, lambda unit: self.run.unit_entry(composite.sources[unit], unit)
                )
                missing = set(self.layout.units) - set(composite.sources)
                if missing:
                    raise IntegrityError(f"composite of step {composite.step} names no version of units {sorted(missing)}")
                shared = self.run.read_global(composite.step)
                self.provider.check_global(shared)
                touched = True  # from here on the live state changes
                self.provider.load(self.run, dict(composite.sources), shared, verify)
            except BaseException as err:
                error = err
            self._agree(f"{round_}/loaded", choice["step"], error, touched)
            assert composite is not None
            self.provider.finish_load()
            extra, unmapped = self._load_rank_state(composite)
        self._extend(composite)
        if self._drift is not None:  # the live state now is the composite: every unit's reference
            self._drift.adopt(self._sample_all())
        return RestoreReport(
            step=composite.step,
            extra=extra,
            sources=dict(composite.sources),
            seconds=time.perf_counter() - start,
            skipped={int(k): v for k, v in choice["skipped"].items()},
            saved_world_size=composite.manifest.world_size,
            unmapped=unmapped,
        )

    def _agree(self, tag: str, step: int, error: BaseException | None, touched: bool) -> None:
        """Return when every rank's reads succeeded; else raise on every rank, the same error
        type everywhere (so ranks handling it alike stay in step), naming each failed rank and
        its error. Marks this Tailor partly restored when any rank had touched its live state."""
        mine = {"touched": touched, "error": None if error is None else describe_error(error),
                "integrity": isinstance(error, IntegrityError)}
        outcomes = self.coordinator.exchange(tag, mine)
        failed = {rank: o for rank, o in enumerate(outcomes) if o["error"] is not None}
        if not failed:
            self._partly_restored = None
            return
        partly = any(o["touched"] for o in outcomes)
        if partly:
            self._partly_restored = f"the restore of step {step} failed part-way"
        if self.world_size == 1:
            assert error is not None
            if isinstance(error, IntegrityError) and touched:
                raise IntegrityError(
                    f"{error}. Nothing was written to disk; the live model may be partly restored. "
                    "restore(fallback=True) loads the newest composite that verifies"
                ) from None
            raise error
        kind = IntegrityError if all(o["integrity"] for o in failed.values()) else CoordinationError
        where = "; ".join(f"rank {rank}: {o['error']}" for rank, o in failed.items())
        state = ("the live model and optimizer may be partly restored on every rank" if partly
                 else "no rank's live state was changed")
        raise kind(f"restore of step {step} failed on rank(s) {sorted(failed)} ({where}); {state}; nothing was "
                   "written to disk. restore(fallback=True) loads the newest composite that verifies") from error

    def _choose(self, step: int | None, fallback: bool) -> dict[str, Any]:
        if not fallback or step is not None:
            return {"step": self.run.resolve(step).step, "skipped": {}}
        skipped: dict[int, str] = {}
        if not self.run.steps():
            raise IntegrityError(f"{self.run.root}: no committed snapshot in this run directory")
        for candidate in self.run.lineage(through_damage=True):
            problems = self._problems_of(candidate)
            if not problems:
                return {"step": candidate, "skipped": skipped}
            skipped[candidate] = "; ".join(problems[:3])
        raise IntegrityError(
            f"{self.run.root}: no composite verifies: "
            + " | ".join(f"step {s}: {why}" for s, why in skipped.items())
        )

    def _extend(self, composite: Composite) -> None:
        self._parent = composite.step
        self._save_index = composite.manifest.save_index + 1
        self._composite = dict(composite.sources)
        for unit, source in composite.sources.items():
            manifest = self.run.manifest(source)
            self._saved_index[unit] = manifest.save_index
            self._unit_bytes[unit] = manifest.unit_bytes(unit)

    def close(self) -> None:
        """Wait for the async save in flight (raising its error), remove the fence and hooks,
        release the run's writer lock (also released when the process exits)."""
        try:
            self._settle(raise_error=True)
        finally:
            self._remove_hooks()
            self._lock.release()

    def _remove_hooks(self) -> None:
        if self._stager is not None:
            self._stager.close()
        for hook in self._drift_hooks:
            hook.remove()
        self._drift_hooks = []
        if self._drift is not None:
            self._drift.forget()

    def __enter__(self) -> Tailor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load_rank_state(self, composite: Composite) -> tuple[Any, tuple[str, ...]]:
        """This rank's RNG states and extras: its own at the saved world size. At another world
        size rank r takes saved rank r's where there is one; a rank beyond the saved world
        keeps its RNG streams and gets rank 0's extras; saved ranks beyond the current world
        are not used. Both are reported in ``unmapped``."""
        saved, world, rank = composite.manifest.world_size, self.world_size, self.rank
        unmapped: list[str] = []
        if world > saved:
            who = f"rank {saved} kept its" if world - saved == 1 else f"ranks {saved}..{world - 1} kept their"
            unmapped.append(f"{who} RNG streams and got rank 0's extras (saved at world size {saved})")
        elif world < saved:
            who = f"rank {world}" if saved - world == 1 else f"ranks {world}..{saved - 1}"
            unmapped.append(f"the RNG states and extras of saved {who} were not used (saved at world size {saved})")
        own = self.run.read_rank_state(composite.step, rank) if rank < saved else None
        if own is None:
            return self.run.read_rank_state(composite.step, 0)["extra"], tuple(unmapped)
        if not self.provider.load_rank(own):
            unmapped.append("the snapshot holds no RNG state (imported from a checkpoint that keeps none): RNG streams left as they were")
        return own.get("extra"), tuple(unmapped)

    def _problems_of(self, step: int) -> list[str]:
        try:
            return self.run.verify(step)
        except TailorError as err:
            return [str(err)]
