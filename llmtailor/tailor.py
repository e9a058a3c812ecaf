"""``Tailor``: tailored checkpointing for a PyTorch training loop.

    tailor = Tailor("runs/exp1", model, optimizer, lr_scheduler, policy=Parity())
    if tailor.latest_step() is not None:
        start = tailor.restore().step
    ...
    tailor.save(step, extra={"epoch": epoch})

More of the job's own state (a data loader's position, a framework's loop state) goes in as
stateful objects, saved at each save and loaded back by ``restore``, each rank its own
(``providers/stateful.py``): ``Tailor(..., stateful={"loader": loader})``.

With ``tiers=[Tier("/dev/shm/exp1", keep=2, promote_every=50)]`` saves commit to host memory
and composites reach the run directory in the background (``store/tiers/``, its
``promote.py``); ``restore`` takes the newest composite of any tier.

Each save writes the units the policy picks plus the global state; ``restore`` loads the
composite (each unit from its newest version, global state from the composite's step) into
the live objects in place. In a torch.distributed job every rank makes the same calls (they
are collective): each rank writes its own shards, one manifest commits them all, and a run
saved at one world size restores at another. Ranks may hold different layers (pipeline stages,
the original names kept): the run's layout is the union of theirs, each rank writes and reads
only the units it holds, and each stage's optimizer groups and LR scheduler are saved with it;
what cannot be saved so is refused on every rank when the Tailor is built, before any other
collective (``providers/agreement.py``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from llmtailor.async_stager import AsyncStager, unconfirmed_text
from llmtailor.config import TailorConfig
from llmtailor.distributed.coordinator import Coordinator, make_coordinator
from llmtailor.distributed.progress import carried
from llmtailor.drift import DriftWatch
from llmtailor.errors import ConfigError, IntegrityError, SnapshotNotFoundError, StorageError, TailorError
from llmtailor.frozen import BaseModel, FrozenParts, FrozenPlan, FrozenSurvey
from llmtailor.layouts import Layout
from llmtailor.policies import Policy, SaveContext
from llmtailor.providers import StateProvider, make_provider
from llmtailor.providers.stateful import Stateful, StatefulObjects
from llmtailor.reports import PendingSave, RestoreReport, SaveReport
from llmtailor.store.catalog import Composite, LeasedComposite
from llmtailor.store.lineage import Lineage, refuse_a_fresh_start
from llmtailor.store.run import Run
from llmtailor.store.shared_reads import share_manifests, share_small_files
from llmtailor.store.staged import PersistResult, StagedSnapshot
from llmtailor.store.tiers import Choice, Level, Tiers
from llmtailor.store.tiers.healing import passed_over
from llmtailor.store.tiers.recovery import NodeChoice
from llmtailor.store.node_commit import persist_on_nodes
from llmtailor.store.writer import persist


class Tailor:
    """Save and restore tailored checkpoints of a model, optimizer and LR scheduler.

    ``model`` is a plain ``torch.nn.Module``, a DDP-wrapped one, one sharded with FSDP2
    (``fully_shard``), or a DeepSpeed engine; in a torch.distributed job, every rank constructs
    its Tailor and calls ``save`` and ``restore`` (collectives). Options: ``TailorConfig``'s
    fields, as keyword arguments or ``config=``. ``stateful``: name -> object with ``state_dict``
    and ``load_state_dict``, saved at each save and loaded by ``restore`` (``providers/stateful.py``).

    Invariants: a save never touches an earlier snapshot; after ``restore(T)`` every weight and
    optimizer tensor equals, bit for bit, the version the composite of T names, and with the
    ``Full`` policy training continues bitwise as if uninterrupted (on CPU). Optimizer state is
    matched by parameter name. Restoring never unpickles. One writer per run: rank 0 locks it
    (and each of its tiers) when the Tailor is built (``read_only=True``: no lock), until
    ``close`` or process exit.
    """

    def __init__(self, run_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any | None = None, policy: Policy | None = None, *, config: TailorConfig | None = None,
                 stateful: Mapping[str, Stateful] | None = None, **options: Any):
        self.config = TailorConfig.of(config, policy=policy, **options)
        self.stateful = StatefulObjects.of(stateful)  # saved and loaded per rank with the extras
        self.policy, self.keep, self.read_only = self.config.policy, self.config.keep, self.config.read_only
        self.tiers = Tiers.of(run_dir, self.config)
        self.run = self.tiers.first.run  # where saves commit: the run directory, or the fastest tier
        self.coordinator: Coordinator = make_coordinator(self.config.timeout)
        self.provider: StateProvider = make_provider(model, optimizer, lr_scheduler, self.coordinator, self.config.family)
        self.layout: Layout = self.provider.stages.layout  # the run's: every rank's units (pipeline stages)
        self.policy.check_units(list(self.layout.units))
        self.lineage = Lineage()  # the lineage it extends: set by restore() and by its own saves
        self._stager = (AsyncStager(self.provider.optimizers(), self.config.async_in_flight)
                        if self.config.async_save else None)
        self._drift = (DriftWatch(list(self.layout.units), self.provider, self.coordinator.all_reduce_sum)
                       if self.config.track_drift else None)
        self._frozen = FrozenParts(self.provider, self.coordinator,
                                   BaseModel(self.config.base) if self.config.base is not None else None)
        self._partly_restored: str | None = None  # a restore failed after touching the live state
        self._pending = _Pending(self.run, self.lineage, self._frozen, self._drift)
        try:  # one writer per run, settled before any training is spent: a second trainer fails here
            self.tiers.open_for_writing(self.coordinator, self.read_only)
            if not self.read_only:  # what a crash left on some nodes only is never restored: gone before any save
                self.tiers.clear_unwhole(self.coordinator)
        except BaseException:
            self._pending.close(self._stager)
            self.tiers.abandon()  # a failed construction leaves every tier as it found it
            raise

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def latest_step(self) -> int | None:
        """Step of the newest committed composite in the run directory (or any of its tiers), or None.
        With a node-local tier it is collective (every rank calls it): the newest of every node's copy."""
        return self.tiers.latest_step(self.coordinator)

    # -- saving -------------------------------------------------------------------------------

    def save(self, step: int, extra: Any = None, *, blocking: bool | None = None) -> SaveReport | PendingSave:
        """Write the units the policy picks, plus global state, as the snapshot of ``step`` (to
        the first tier, with tiers). ``extra``: any tree of dicts, lists, tuples, numbers,
        strings, tensors and numpy arrays (data position, epoch, ...); ``restore`` returns it,
        each rank its own. Synchronous (the default, or ``blocking=True``): returns a
        ``SaveReport`` once the snapshot is committed. With ``async_save=True`` (and ``blocking``
        not True): returns a ``PendingSave`` once the save is staged, behind the one in flight
        (``async_in_flight`` at most: it waits for the oldest, raising its failure, ``_Pending.settle``);
        ``wait()`` / ``close()`` make the last save durable."""
        sync = blocking or (blocking is None and self._stager is None)
        if not sync and self._stager is None:
            raise ConfigError("save(blocking=False) needs a Tailor made with async_save=True")
        self._check_save(step, in_flight=0 if sync or self.policy.weighs_bytes else self._stager.in_flight - 1)  # bytes: as committed
        start = time.perf_counter()
        self.provider.refresh()
        drift, survey, frozen_news = _measure(self._drift, self._frozen, self.coordinator)
        lineage = self.lineage  # with a save in flight: as if it committed (``Lineage.staged``)
        round_ = self.coordinator.new_round()  # on every rank in one order (two saves may be in flight)
        frozen = self._frozen.plan(f"{round_}/frozen", set(lineage.composite), survey, frozen_news)
        decision = self.policy.decide(SaveContext(
            save_index=lineage.save_index, step=step, units=tuple(self.layout.units), last_saved=lineage.composite,
            last_saved_index=lineage.saved_index, drift=drift, unit_bytes=self._frozen.weighed_bytes(lineage.unit_bytes),
            frozen=frozenset(frozen.quiet),
        ))
        units = frozen.written(decision.units)  # frozen, unchanged units cost nothing
        staged = self._stage(step, units, {**lineage.composite, **{unit: step for unit in units}}, extra, frozen, sync and self.world_size == 1)
        skipped = [u for u in decision.units if u not in units]
        staged.decision = {**decision.record, **({"drift": drift} if drift is not None else {}),
                           **({"frozen_unchanged": skipped} if skipped else {})}
        staged.round = round_
        if sync:
            self._pending.staged(step, staged.composite, frozen, units)
            try:
                result = self._persist(staged)
            except BaseException:
                self._pending.rolled_back()
                raise
            _raise_unconfirmed(self._pending.committed(step, staged.composite, result))
            self._after_commit(step, result)
            return SaveReport.of(step, units, result, time.perf_counter() - start)
        job = self._stager.start(staged, list(staged.units), self._persist,
                                 after=lambda result: self._after_commit(step, result),
                                 target=str(self.run.root), chosen=units)
        self._pending.staged(step, staged.composite, frozen, units)  # settled on this thread only: after start is fine
        job.blocked_seconds = time.perf_counter() - start
        return PendingSave(job, SaveReport.of)

    def _check_save(self, step: int, in_flight: int) -> None:
        """Refuse a save of ``step`` that cannot be made, once the saves in flight but the newest
        ``in_flight`` are settled (raising a failure among them)."""
        if self.read_only:
            raise ConfigError(f"this Tailor of {self.run.root} was made with read_only=True: it restores, it does not save")
        self._settle(raise_error=True, refused=step, keep=in_flight)
        if self._partly_restored is not None:
            raise TailorError(f"{self._partly_restored}, so the live model and optimizer may hold a mix of states; saving "
                              "them is refused: restore() again (fallback=True passes over damaged composites) before saving")
        if self.lineage.parent is None and self.lineage.floor is None:  # restored nothing, saved nothing yet
            _check_fresh_start(self.tiers, self.coordinator, self.lineage, self.config.fresh_start)
        self.lineage.check_next(step)  # the save in flight, if any, is the parent

    def wait(self, *, promoted: bool = False) -> SaveReport | None:
        """Block until the async saves in flight (if any) are committed and durable; return the
        newest one's report, or raise what failed in the background (once). ``promoted=True``: and the
        promotion to a slower tier in flight."""
        if promoted:
            self._settle(raise_error=False)  # its commit starts the promotion waited for
            self.tiers.wait_promotions()
        job = self._stager.unsettled[-1] if self._stager is not None and self._stager.unsettled else None
        self._settle(raise_error=True)
        self.tiers.raise_failure(self.coordinator)
        if job is None:
            return None
        return SaveReport.of(job.step, job.units, job.outcome, job.copy_seconds + job.persist_seconds)

    def fence(self) -> None:
        """Block until the async save in flight (if any) has taken its copies: call it before an
        in-place change of weights or optimizer state outside ``optimizer.step()`` (loading a
        state dict, an EMA swap) while a save may be in flight (``optimizer.step()`` and the
        ``train()`` / ``eval()`` of schedule-free optimizers are fenced for you); one made
        without it fails that save (version counters), never commits a mix."""
        if self._stager is not None:
            self._stager.wait_copied()

    def _settle(self, raise_error: bool, refused: int | None = None, keep: int = 0) -> None:
        """Settle the async saves in flight but the newest ``keep`` (``_Pending.settle``; closed: refused)."""
        self._pending.settle(self._stager, raise_error, refused, keep)

    def _persist(self, staged: StagedSnapshot) -> PersistResult:
        """The commit recipe of the first tier's placement: one copy per node of a node-local
        tier (``store.node_commit``), else one store every rank writes (``store.writer``). Its
        ``prepare`` runs inside the save's first message (what it raises, every rank raises): a
        lagging tier is waited for up to half the timeout, the others' wait for that message."""
        hooks = {"prepare": functools.partial(self.tiers.prepare_save, staged.step, self.config.timeout / 2, self.coordinator),
                 "confirm": self.tiers.first.lock.check_held}
        if self.tiers.placement is not None:  # its retention spares what rank 0's promoter may read
            return persist_on_nodes(self.run, staged, self.tiers.placement, self.coordinator, spare=self.tiers.may_promote, **hooks)
        return persist(self.run, staged, coordinator=self.coordinator, **hooks)

    def _stage(self, step: int, units: list[str], composite: dict[str, int], extra: Any, frozen: FrozenPlan,
               later: bool) -> StagedSnapshot:
        """What this rank writes: its pieces of the units it holds (staged one at a time, as the writer asks for
        them) and the global state, encoded now or, ``later`` (a synchronous save of one process), by the writer."""
        stages = self.provider.stages
        staged = StagedSnapshot(
            step=step, parent=self.lineage.parent, save_index=self.lineage.save_index, policy=self.policy.describe(),
            layout=self.layout.to_record(), holds=list(self.provider.layout.units),
            units=(self._frozen.split(self.provider.stage_unit(u), frozen) for u in self.provider.writes(units)),
            composite=composite, global_doc=None, global_tensors=None, world_size=self.world_size,
            provider=self.provider.kind, encode=functools.partial(self.provider.encode_global, step, extra, self.stateful),
            notes={**self.provider.notes(), **({"stages": stages.record()} if stages.pipelined else {})},
            base=self._frozen.base_record())
        return staged if later else staged.encoded_now(keep_failure=self.world_size > 1)

    def _after_commit(self, step: int, result: PersistResult) -> None:
        if self.tiers.keeps_first(self.rank) and not result.unconfirmed:
            self.tiers.committed(step, str(result.path), result.spare)  # retention, then promotions due

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, fallback: bool = False, verify: bool | str = True) -> RestoreReport:
        """Load the newest committed composite (or the one as of ``step``) in place; with tiers,
        from the fastest tier holding the newest whole (the report's ``tier`` says which).

        Compatibility (layout, names, shapes, dtypes, optimizer class and groups) is checked
        from the manifests before any tensor byte is read. ``verify=True`` checks every chunk
        read against its checksum, a frozen tensor the model holds (unread) by a sample of every
        row (``"exact"``: all its bytes); ``verify=False`` (distributed providers) reads only the
        byte ranges this rank holds and leaves checking to ``llmtailor verify``. ``fallback=True``
        (no ``step``): the composites of the lineage are tried newest first, each verified while
        it loads (every byte read once, checked before it is used, whatever ``verify``); one that
        is damaged, missing or unreadable is passed over for the next (``skipped`` says what and
        why), the live state then being loaded whole again by the next.

        One resolution and one lease per restore: rank 0 lists each tier once, picks the
        composite and leases every snapshot it needs; the restore reads under that lease.

        Collective in a distributed job: rank 0 picks the composite, every rank reads its part,
        then the ranks agree that every read succeeded before any enters a collective to finish
        (DeepSpeed's low-precision refresh): a failure on one rank makes every rank raise, naming
        it. A restore that failed after the live state was touched (on any rank, or the ranks
        could not agree) leaves this Tailor refusing to save until a restore succeeds."""
        _check_verify(verify)
        self._settle(raise_error=False)  # a failure in flight stays for the next save / wait / close
        self.provider.refresh()
        start = time.perf_counter()
        restoring = _Restoring(self.tiers, self.provider, self.coordinator)
        with ExitStack() as held:
            try:
                level, composite, skipped, floor = restoring.load(step, fallback, verify, held)
            finally:
                self._partly_restored = restoring.partly or self._partly_restored
            self.provider.finish_load()
            self._partly_restored = None
            run = self.tiers.levels[level].run
            extra, unmapped = self.provider.restore_rank_state(restoring.rank_state, self.stateful)
        self.lineage.restored(run, composite, extend=level == 0, newest=floor)  # from a slower tier: the next save is full
        self._frozen.restored(run, composite, held=level == 0)
        self.tiers.restored(level, composite.step)
        if self._drift is not None:
            self._drift.restored()
        return RestoreReport.of(composite, extra, time.perf_counter() - start, skipped, unmapped, str(run.root),
                                restoring.served_by)

    def close(self) -> None:
        """Wait for the async saves in flight and, with tiers, for the last composite's promotion to
        every tier (raising what failed); remove the fence and hooks; release the writer locks and
        the connections to the other ranks. Then closed, even if it raised: ``close`` again does
        nothing; ``save``, ``restore``, ``wait`` raise."""
        if self._pending.closed:
            return
        try:
            try:
                self._settle(raise_error=True)
            finally:
                self._pending.close(self._stager)
                self.tiers.close(self.coordinator)  # the last promotion, then the locks (collective)
            self.tiers.raise_failure(self.coordinator)
        finally:  # a closed Tailor the script keeps holds no connection (the courier's: ``Tiers.close``)
            self.coordinator.let_go()

    def __enter__(self) -> Tailor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pending:
    """What a writer's saves leave pending until they commit: the lineage the next save extends,
    the frozen tensors they write, their units' drift references. Each save is staged (the next
    save builds on it), then committed or rolled back, in order (async saves: up to two in flight)."""

    def __init__(self, run: Run, lineage: Lineage, frozen: FrozenParts, drift: DriftWatch | None):
        self.run, self.lineage, self.frozen, self.drift = run, lineage, frozen, drift
        self.closed = False
        """Set by ``close`` (``Tailor.close``): its locks released, nothing more is saved or restored."""
        self.unconfirmed: list[str] = []
        """What async saves committed could not confirm (``PersistResult.unconfirmed``), not yet
        raised: kept, as a failure is, by a ``settle`` that does not raise, or behind a failure raised."""

    def staged(self, step: int, composite: dict[str, int], frozen: FrozenPlan, units: list[str]) -> None:
        """The save of ``step`` is staged: the next save extends it until it commits or fails."""
        self.lineage.staged(step, composite)
        self.frozen.saving(frozen, units, step)
        if self.drift is not None:
            self.drift.saving(units)

    def committed(self, step: int, composite: dict[str, int], result: PersistResult | None) -> str | None:
        """The oldest save staged, of ``step``, committed; returns what failed once it was
        committed, if anything (``PersistResult.unconfirmed``)."""
        self.lineage.committed(self.run, step, composite)
        self.frozen.committed()
        if self.drift is not None:
            self.drift.committed()
        return result.unconfirmed if result is not None else None

    def rolled_back(self) -> None:
        """Every save staged and not committed failed: back to the last committed one's state."""
        self.lineage.failed()
        self.frozen.failed()
        if self.drift is not None:
            self.drift.failed()

    def close(self, stager: AsyncStager | None) -> None:
        """No save follows: the async fence and the drift hooks removed; ``settle`` refuses from now."""
        self.closed = True
        if stager is not None:
            stager.close()
        if self.drift is not None:
            self.drift.close()

    def settle(self, stager: AsyncStager | None, raise_error: bool, refused: int | None, keep: int) -> None:
        """Settle the async saves in flight but the newest ``keep`` (``AsyncStager.settle``): the
        committed ones in order; after a failure, back to the last committed save. The failure
        is raised (once) when ``raise_error``, else kept for the next call. Closed (``close``):
        a TailorError (a save, restore or wait would take the run's locks again, released)."""
        if self.closed:
            raise TailorError(f"this Tailor of {self.run.root} is closed: its locks are released and it saves and "
                              "restores nothing more; make a new Tailor to go on")
        if stager is None:
            return
        committed, failed = stager.settle(keep)
        self.unconfirmed += [said for job in committed if (said := self.committed(job.step, job.composite, job.outcome))]
        if failed:
            self.rolled_back()
        if raise_error:  # everything kept, in one error: no call may follow (a close) to say the rest
            kept, self.unconfirmed = self.unconfirmed, []
            stager.raise_failure(refused=refused, newest=self.lineage.parent, unconfirmed=kept)
            _raise_unconfirmed(*kept, refused=refused)


def _check_fresh_start(tiers: Tiers, coordinator: Coordinator, lineage: Lineage, fresh_start: bool) -> None:
    """Collective, before the first save of a Tailor that restored nothing: refused where the
    run holds a composite, unless ``fresh_start`` (then that save comes after its newest step;
    ``store.lineage.refuse_a_fresh_start``). The newest step is read by rank 0 (each node's
    copy of a node-local tier), so every rank raises alike, once rank 0 holds the writer lock
    (a second writer is refused as that, not for what the first one saved)."""
    def newest() -> int | None:
        tiers.first.lock.claim()
        return tiers.latest_step()

    if tiers.placement is not None:
        held = tiers.latest_step(coordinator)
    else:
        held = coordinator.broadcast(f"{coordinator.new_round()}/held", newest if coordinator.is_leader else None)
    if not fresh_start:
        refuse_a_fresh_start(tiers.home.run.root, held, ", which this Tailor did not restore: restore() "
                             "resumes from it", "give another run directory, or fresh_start=True to start a "
                             "lineage of its own after it")
    lineage.starts_after(held)


def _raise_unconfirmed(*errors: str | None, refused: int | None = None) -> None:
    """Saves committed whose ``latest`` could not be replaced, or whose durability could not be
    confirmed (``PersistResult.unconfirmed``): raised, each said in one error, once the saves
    count as committed (the lineage extended: the next save's parent; retention and promotions
    wait for the next save: ``_after_commit``). ``refused``: the step of a save refused because
    of them (an async save's, raised as the next one opens)."""
    said = unconfirmed_text([error for error in errors if error])
    if said and refused is not None:
        raise TailorError(f"step {refused} was not saved: the async save(s) before it said: {said}. Call "
                          f"save({refused}) again to save this step")
    if said:
        raise TailorError(said)


class _Restoring:
    """One ``Tailor.restore``'s reading (collective): what to load, decided by rank 0 and sent
    to every rank (``plan``), then each composite tried in turn, loaded on every rank, the ranks
    agreeing on the outcome (``attempt``). ``partly``: set once the live state was touched (a
    mix until a load succeeds), for the Tailor to refuse saves meanwhile."""

    def __init__(self, tiers: Tiers, provider: StateProvider, coordinator: Coordinator):
        self.tiers, self.provider, self.coordinator = tiers, provider, coordinator
        self.round = coordinator.new_round()
        self.partly: str | None = None
        self.served_by: dict[int, list[int]] = {}
        """With a node-local tier: node -> the nodes whose copies sent it what it lacked."""
        self.shared: dict[str, Any] | None = None
        """The global state of the composite last checked (``check_composite``), decoded once."""
        self.rank_state: tuple[dict[str, Any], bool, list[str]] | None = None
        """This rank's saved state of the composite last loaded (``StateProvider.read_rank_state``)."""
        self.offer: NodeChoice | None = None
        """What a node-local first tier offered (``Tiers.recover``)."""
        self.healing = False
        """Whether a healing of the node-local tier ran beside the first attempt (the same on
        every rank): its outcome is then part of that attempt's (``attempt``)."""
        self.unhealed: str | None = None
        """Why this rank's part of that healing failed, if it did."""

    def load(self, step: int | None, fallback: bool, verify: bool | str,
             held: ExitStack) -> tuple[int, Composite, dict[int, str], int | None]:
        """Load the composite into the live state, its lease held by ``held``: ``(tier, composite,
        skipped, floor)``. With ``fallback`` (no ``step``), every byte read is verified: a damaged
        composite fails while it loads and the next is tried (each byte read once)."""
        for tier in self.tiers.levels:  # what a healing hands over (``UnitReader.arrived``) serves this restore only;
            held.callback(tier.run.units.clear_arrivals)  # the healed copy's writes wait for its end (``Catalog.hold_back``)
            held.callback(tier.run.units.coming.clear)
            held.callback(tier.run.release_held)
        held.callback(self._healing_ended)
        attempts, skipped, unread, floor = self.plan(step, fallback, held)
        fallback = fallback and step is None
        index = 0
        while index < len(attempts):
            level, chosen, leased = attempts[index]
            lease, failure = self.attempt(index, self.tiers.levels[level], chosen, leased, verify or fallback, fallback)
            if lease is not None:
                composite = held.enter_context(lease)
                break
            index += 1
            why = None if fallback else self._unhealed_anywhere(failure)
            if why is not None:  # the tier passed over, as a healing that ended before the choice passes it
                attempts[index:], skipped, floor = self.choose(step, passed_over(self.offer, why), held,
                                                               f"{self.round}/choose/{index}")
                continue
            if not fallback or not isinstance(failure, IntegrityError):
                raise failure
            name = f"{self.tiers.levels[level].name}: " if len(self.tiers) > 1 else ""
            skipped.setdefault(chosen, f"{name}{failure}")
        else:
            shown = " | ".join(f"step {s}: {why}" for s, why in skipped.items())
            raise IntegrityError(f"{self.tiers.home.run.root}: no composite verifies: {shown}")
        if unread:  # a tier that could not be read: said with the composite chosen
            skipped[composite.step] = "; ".join([*unread, *([skipped[composite.step]] if composite.step in skipped else [])])
        return level, composite, {s: why for s, why in skipped.items() if s >= composite.step}, floor

    def plan(self, step: int | None, fallback: bool, held: ExitStack) -> tuple[list, dict[int, str], list[str], int | None]:
        """``(tier, step, lease)`` attempts (the lease rank 0 took choosing, None elsewhere), what
        was passed over, the tiers that could not be read, and the floor of the next save
        (``Lineage``). Without ``fallback`` (or with a ``step``): the one composite
        ``Tiers.choose`` picks, leased once. With it: the candidates (``Tiers.candidates``).
        A node-local first tier offers what the nodes hold whole together, each node's copy of
        it made whole first (``Tiers.recover``)."""
        leader = self.coordinator.is_leader
        offer, self.served_by = self.tiers.recover(self.coordinator, step)
        self.offer, self.healing = offer, self.tiers.healing is not None
        if fallback and step is None:
            attempts, unread, floor = self.coordinator.broadcast(
                f"{self.round}/candidates", (lambda: self.tiers.candidates(offer)) if leader else None)
            passed = {s: f"{self.tiers.first.name}: {why}" for s, why in offer.skipped.items()} if offer else {}
            return [(level, chosen, None) for level, chosen in attempts], passed, list(unread), floor
        attempts, skipped, floor = self.choose(step, offer, held, f"{self.round}/choose")
        return attempts, skipped, [], floor

    def choose(self, step: int | None, offer: NodeChoice | None, held: ExitStack,
               tag: str) -> tuple[list, dict[int, str], int | None]:
        """Collective: the one composite ``Tiers.choose`` picks on rank 0 (``offer``: what a
        node-local first tier offers), as ``plan``'s one attempt, what was passed over and the floor."""
        leased: list[LeasedComposite] = []

        def choose() -> Choice:
            choice, lease = self.tiers.choose(step, offer)
            held.callback(lease.close)
            leased.append(lease)
            return choice

        level, chosen, skipped, floor = self.coordinator.broadcast(tag, choose if self.coordinator.is_leader else None)
        return [(level, chosen, leased[0] if leased else None)], {int(s): why for s, why in skipped.items()}, floor

    def _healed(self, error: BaseException | None) -> BaseException | None:
        """This rank's part of a healing that ran beside the first attempt, waited for (its
        reads may have been done before its last files arrived): the attempt's failure where it
        failed, in place of what a read made of it (a file withdrawn, a wait that raised): the
        healing's IntegrityError naming the node, file and sender, or its stream's failure. The
        ranks that agree next wait on while the healing advances (``Coordinator.working``)."""
        try:
            with self.coordinator.working(*self.tiers.healing_progress):  # the healing's threads' progress
                self.unhealed = self.tiers.healed()
        except BaseException as err:  # a stream failed: a peer died or timed out (CoordinationError, naming it)
            return err
        return IntegrityError(f"healing the node-local tier failed: {self.unhealed}") if self.unhealed else error

    def _unhealed_anywhere(self, failure: BaseException | None) -> str | None:
        """Collective after the first attempt failed with damage while a healing ran beside it:
        why the healing failed on any node (the ranks tell one another), or None."""
        if not self.healing or not isinstance(failure, IntegrityError):
            return None
        self.healing = False
        failed = [why for why in self.coordinator.exchange(f"{self.round}/healed", self.unhealed) if why]
        return f"healing the node-local tier failed: {'; '.join(failed)}" if failed else None

    def _healing_ended(self) -> None:
        """As the restore ends, however: no healing runs on (its courier is then free)."""
        with contextlib.suppress(Exception):
            self.tiers.healed()

    def attempt(self, index: int, tier: Level, chosen: int, leased: LeasedComposite | None, verify: bool | str,
                skippable: bool) -> tuple[LeasedComposite | None, BaseException | None]:
        """Lease (unless ``leased``), check and load the composite of ``chosen`` from ``tier``
        into the live state on every rank, its manifests, unit indexes and global state read
        once in the job (``store.shared_reads``), and read this rank's own state; the ranks agree
        on the outcome (``Coordinator.agree``): every read of the restore is done by then, so
        from an object store every rank reads under rank 0's lease (the others take none). A
        healing of the node-local tier run beside the first attempt (``Tiers.recover``: its reads
        wait for each file to arrive) is waited for before the ranks agree, its failure the
        attempt's (``_healed``); ``load`` then passes that tier over as one. Returns the
        lease (for the restore to hold until it ends), or None and the failure every rank shares.
        ``skippable`` (fallback): a composite missing or unreadable counts as damage."""
        touched, error, lease, run = False, None, None, tier.run
        # The provider tags its messages with the coordinator's round, and an exchange's stay in
        # the store: a composite loaded under the round of the one before would take that one's
        # answers from ranks that have not answered yet (plans differing between ranks).
        self.coordinator.new_round()
        # The ranks that finish first wait for this one at ``agree`` as long as its reads go on
        # (a large composite on a slow store), not just the timeout (``Coordinator.working``).
        try:
            with self.coordinator.working():
                # Rank 0's manifests, then the indexes and global state read once in the job (shared_reads).
                lease = share_manifests(run, chosen, leased, self.coordinator, f"{self.round}/composite/{index}",
                                        covered=run.storage.remote and not tier.node_local)
                share_small_files(run, lease.composite, self.coordinator)
                shared = self.shared = self.provider.check_composite(run, lease.composite)
                # The live state changes from here: a mix until the ranks agree (agree may itself raise).
                touched, self.partly = True, f"the restore of step {chosen} did not complete"
                # This rank's own state is read beside the units, not after them (a round trip less at
                # the end of a restore from an object store), and before the ranks agree: every read
                # under rank 0's lease, a failed one on every rank; waited for however the load ends.
                with ThreadPoolExecutor(1, thread_name_prefix="llmtailor-state") as beside:
                    own = beside.submit(carried(self.provider.read_rank_state), run, lease.composite, shared)
                    self.provider.load(run, self.provider.held(lease.composite.sources), shared, verify)
                    self.rank_state = own.result()
        except BaseException as err:
            error = _as_damage(err, skippable)
        finally:
            run.units.received.clear()  # what other ranks sent served this attempt's reads
        if self.tiers.healing is not None:
            error = self._healed(error)
        try:
            failure, partly = self.coordinator.agree(f"{self.round}/loaded/{index}", chosen, error, touched)
        except BaseException:
            if lease is not None:
                lease.close()
            raise
        if partly:  # a failure that touched no rank's state leaves the mark as it was
            self.partly = f"the restore of step {chosen} failed part-way"
        if failure is None:
            return lease, None
        if lease is not None:
            lease.close()
        # One process: its own error names the damage best (the agreed one adds advice to it).
        return None, (error if skippable and self.coordinator.world_size == 1 and error is not None else failure)


def _measure(drift: DriftWatch | None, frozen: FrozenParts,
             coordinator: Coordinator) -> tuple[dict[str, dict[str, float | None]] | None, FrozenSurvey, bool]:
    """A save's one meeting on the training thread: the units' drift (when tracked) and whether
    any rank's frozen tensors have news for the frozen plan (``FrozenParts.survey``, ``plan``),
    summed in one all-reduce, so every rank has the same figures and the same answer."""
    survey = frozen.survey()
    flag = torch.tensor([1.0 if survey.news else 0.0], dtype=torch.float64)
    figures = None
    if drift is not None:
        figures, flag = drift.measure(flag)
    elif coordinator.world_size > 1:
        flag = coordinator.all_reduce_sum(flag)
    return figures, survey, bool(flag[0] > 0)


def _as_damage(err: BaseException, skippable: bool) -> BaseException:
    """A rank's failed read as the damage it is: an IntegrityError that DCP's load wrapped (a
    ``CheckpointException`` holds each failure with its trace) is raised as itself, so the ranks
    agree it is damage and name the file; with ``skippable`` (fallback), a snapshot missing or
    unreadable counts as damage too. Anything else, as it is."""
    inner = err
    while type(inner).__name__ == "CheckpointException" and getattr(inner, "failures", None):
        inner = next(iter(inner.failures.values()))[0]
    if isinstance(inner, IntegrityError):
        return inner
    if skippable and isinstance(inner, (SnapshotNotFoundError, StorageError)):
        return IntegrityError(str(inner))
    return err


def _check_verify(verify: object) -> None:
    """``restore(verify=...)`` takes True, False or ``"exact"`` (ConfigError naming the value)."""
    if not isinstance(verify, (bool, str)) or verify not in (True, False, "exact"):
        raise ConfigError(f"restore(verify={verify!r}): expected True, False or \"exact\"")
