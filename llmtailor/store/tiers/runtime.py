"""The tiers of a writer at run time: ``Tiers`` takes every tier's writer lock (all or none),
records the tiers in each, commits retention after each save to the first tier, and runs the
``Promoter`` (``promote.py``) that copies committed composites down the tiers.

A writer never closed (a script that ends without ``close()``) is finished at exit
(``_Unclosed``), once the interpreter waited for its saves and promotions in flight.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from llmtailor.distributed.coordinator import Coordinator
from llmtailor.distributed.courier import Courier
from llmtailor.distributed.nodes import Nodes
from llmtailor.distributed.progress import Scope
from llmtailor.errors import ConfigError, NodeTierError, PromotionError, TailorError
from llmtailor.store.node_commit import NodePlacement
from llmtailor.store.retention import retain_after_commit
from llmtailor.store.run import Run
from llmtailor.store.catalog import LeasedComposite
from llmtailor.store.tiers.collective import Crew, NodeUploader, follows
from llmtailor.store.tiers.choice import Candidates, Choice, candidates, choose, newest_steps, raise_problem
from llmtailor.store.tiers.config import Tier
from llmtailor.store.tiers.healing import Healing, clear_unwhole, recover
from llmtailor.store.tiers.levels import Level
from llmtailor.store.tiers.promote import Promoter, Promotion, clear_stray_carriers
from llmtailor.store.tiers.record import TierRecord
from llmtailor.store.tiers.recovery import NodeChoice

log = logging.getLogger(__name__)


class Tiers:
    """The tiers of a run, fastest first; the run directory ``home`` is the last."""

    def __init__(self, home: str | Path, tiers: Sequence[Tier] = (), keep: int | None = None,
                 storage_options: dict[str, Any] | None = None):
        levels = [Level.of(Run(t.location, t.storage_options), t.keep, t.promote_every, t.scope, t.replicas, t.jump,
                           t.max_lag) for t in tiers]
        levels.append(Level.of(Run(home, storage_options), keep, None))
        for i, level in enumerate(levels):
            for other in levels[:i]:
                if level.run.storage.same_place(other.run.storage):
                    raise ConfigError(f"tier {other.name} and {level.name} are one location: every tier needs its own")
        self.levels = levels
        self.promoter: Promoter | None = None
        """Set by ``open_for_writing`` (the writer's rank 0, with more than one tier)."""
        self.uploader: NodeUploader | None = None
        """A node leader's part of collective promotions (``_promote_together``), not rank 0's."""
        self.placement: NodePlacement | None = None
        """Set by ``open_for_writing`` when the first tier is node-local in a job of several
        ranks: saves then commit there with ``store.node_commit``."""
        self._record = TierRecord(levels)
        """This writer's ``tiers.json`` in each tier (``abandon`` puts back what it replaced)."""
        self._unclosed: _Unclosed | None = None
        """What the exit finishes if this writer is never closed (``open_for_writing``)."""
        self.unhealed: str | None = None
        """Why this node's copy lacks what a healing sent it (its background write failed), until
        a restore lists the copies again (``recover``): every save is refused meanwhile
        (``settle_healing``)."""
        self.healing: Healing | None = None
        """The healing ``recover`` left running beside the restore that follows (``healed``)."""
        self.healing_progress: tuple[Scope, ...] = ()
        """The last healing's progress (``Healing.progress``), its writes' and commits' after its
        outcome too: a wait for them shows it as its own (``Coordinator.working``)."""

    @classmethod
    def of(cls, home: str | Path, config: Any) -> Tiers:
        """The tiers a ``TailorConfig`` declares in front of the run directory ``home`` (its
        ``tiers``, ``keep`` and ``storage_options``)."""
        return cls(home, config.tiers, config.keep, config.storage_options)

    @property
    def first(self) -> Level:
        """Where saves commit."""
        return self.levels[0]

    @property
    def home(self) -> Level:
        return self.levels[-1]

    def __len__(self) -> int:
        return len(self.levels)

    def index_of(self, run: Run) -> int | None:
        """The tier ``run`` is, or None."""
        for i, level in enumerate(self.levels):
            if level.run.storage.same_place(run.storage):
                return i
        return None

    # -- locks and the record -------------------------------------------------------------

    def open_for_writing(self, coordinator: Coordinator, read_only: bool = False) -> None:
        """Collective: rank 0 takes every tier's writer lock (all or none), records the tiers in
        each, removes the carriers a killed promotion left (``promote.clear_stray_carriers``)
        and starts promoting; every rank raises what failed, and a failed start leaves every
        tier as it was (``abandon``). With more than one tier, a tier that cannot be written (a
        read-only or foreign path) is a ConfigError naming it, before anything is recorded; a
        run directory alone may be read-only (``WriterLock.acquire_or_look``: it restores, and
        its first save fails, saying why). Nothing for a reader (``read_only``).

        In a distributed job every tier must be one store that every rank reaches (rank 0
        commits every rank's files there, and promotes them): each rank looks for the record
        rank 0 just wrote, and a tier some rank cannot see (node-local storage on another node)
        fails the Tailor on every rank, naming it; a node-local first tier (``Tier(scope="node")``)
        is the exception: ``_open_nodes``."""
        if read_only:
            return
        if self.first.node_local:
            self._open_nodes(coordinator)
        else:
            round_ = coordinator.new_round()
            token = coordinator.broadcast(f"{round_}/lock", self._open if coordinator.is_leader else None)
            if token is not None and coordinator.world_size > 1:
                self._refuse_unseen(coordinator, round_, token, self.levels)
        self._unclosed = _Unclosed(self, self.promoter, self.uploader)
        _UNCLOSED[self._unclosed] = None

    def _refuse_unseen(self, coordinator: Coordinator, round_: str, token: str, levels: list[Level]) -> None:
        """Collective: a tier of ``levels`` in which some rank does not find the record of
        ``token`` (rank 0's) fails the writer on every rank, naming it (``open_for_writing``)."""
        blind = [level.name for level in levels if not TierRecord.seen(level, token)]
        unseen = {rank: names for rank, names in enumerate(coordinator.exchange(f"{round_}/seen", blind)) if names}
        if unseen:
            self.abandon()
            which = "; ".join(f"rank {rank} cannot see {', '.join(names)}" for rank, names in unseen.items())
            raise ConfigError(f"every tier must be one store all ranks reach (rank 0 commits and promotes every "
                              f"rank's files there): {which} (node-local storage on another node?). Tiers per node "
                              "are not supported: give tiers every rank reaches (a shared or object store), or none")

    def _open_nodes(self, coordinator: Coordinator) -> None:
        """``open_for_writing`` with a node-local first tier (collective): the nodes found
        (``Nodes.discover``) and checked against the tier's ``replicas`` and ``jump`` (every rank
        raises the same ConfigError), the courier opened; each node's leader takes its copy's
        lock and records the tiers there, rank 0 also every shared tier's (``_open_node``); a
        node that cannot fails the writer on every rank, naming it, and every node's start is
        undone. Every rank must then see the shared tiers, as in ``open_for_writing``."""
        first, single = self.first, coordinator.world_size == 1
        nodes = Nodes.single(1) if single else Nodes.discover(coordinator)
        nodes.check_even()
        nodes.holders(0, first.replicas, first.jump)  # every node's holders are alike: one check
        courier = None if single else Courier.open(coordinator.timeout, board=coordinator)
        round_ = coordinator.new_round()
        leads = nodes.leader_of(nodes.node_of_rank(coordinator.rank)) == coordinator.rank
        node = nodes.node_of_rank(coordinator.rank)
        outcomes = coordinator.exchange(f"{round_}/nodes", self._open_node(coordinator.is_leader, node) if leads else None)
        failed = {nodes.node_of_rank(rank): o["error"] for rank, o in enumerate(outcomes) if o and "error" in o}
        if failed:
            self.abandon()
            where = "; ".join(f"node {node}: {why}" for node, why in sorted(failed.items()))
            raise ConfigError(f"the node-local tier cannot be written on node(s) {sorted(failed)}: {where}")
        if courier is not None:
            self.placement = NodePlacement(nodes, first.replicas, first.jump, courier)
            self._refuse_unseen(coordinator, round_, outcomes[0]["token"], self.levels[1:])
            self._promote_together(nodes, coordinator)

    def _promote_together(self, nodes: Nodes, coordinator: Coordinator) -> None:
        """With a node-local first tier and a tier after it, promotions are collective
        (``collective.py``): rank 0's promoter leads them, each other node's leader follows."""
        if len(self.levels) == 1:
            return
        if self.promoter is not None:
            self.promoter.crew = Crew(nodes, coordinator)
        elif follows(nodes, coordinator.rank):
            node = nodes.node_of_rank(coordinator.rank)
            self.uploader = NodeUploader(self.first.run, self.levels[1].run, node, coordinator).start()

    def _open_node(self, everything: bool, node: int) -> dict[str, str]:
        """A node leader's part of ``_open_nodes``: its copy's lock and record, naming ``node``
        (``everything``, rank 0: every tier's, and the promoter); ``{"token"}``, or ``{"error"}``
        with this node's start undone."""
        levels = self.levels if everything else [self.first]
        try:
            for level in levels:
                level.take()
            token = self._record.write(levels, node)
            for level in levels:
                clear_stray_carriers(level.run)
            if everything:
                self.promoter = Promoter(self.levels, [level.run.latest_step() for level in self.levels])
            return {"token": token}
        except (TailorError, OSError) as err:
            self.abandon()
            return {"error": str(err)}

    def keeps_first(self, rank: int) -> bool:
        """Whether ``rank`` commits the first tier and keeps its retention: rank 0, or with a
        node-local first tier, each node's leader (its node's copy)."""
        return self.placement.leads(rank) if self.placement is not None else rank == 0

    def _open(self) -> str | None:
        """Rank 0's part of ``open_for_writing``; the record's token (None: nothing recorded)."""
        try:
            if len(self.levels) == 1:  # one tier: nothing to record or promote, no thread
                self.home.lock.acquire_or_look()
                token = None
            else:
                for level in self.levels:
                    level.take()
                token = self._record.write()
            for level in self.levels:
                if level.lock.held:
                    clear_stray_carriers(level.run)
            if len(self.levels) > 1:
                self.promoter = Promoter(self.levels, [level.run.latest_step() for level in self.levels])
            return token
        except BaseException:
            self.abandon()
            raise

    def committed(self, step: int, where: str, spare: Sequence[int] = ()) -> None:
        """Where the first tier is kept (``keeps_first``), once the save of ``step`` committed
        there (at ``where``): that tier's retention, sparing the composites of ``spare`` (what
        ``may_promote`` answered on rank 0 as the save committed: each node's copy alike, the same
        manifests and the same spare), then on rank 0 the promotions due (in the background)."""
        if self.first.keep is not None:
            self.first.held_back = retain_after_commit(self.first.run, self.first.keep, where, spare)
        if self.promoter is not None:
            self.promoter.committed(step)

    def may_promote(self) -> list[int]:
        """Rank 0, as a save commits on every node (``node_commit``: the commit's last message
        carries it): the composites of the first tier its promoter reads or may choose next
        (``Promoter.may_read``), which every node's retention after that save spares (``committed``).
        A follower leases a composite only once it takes its order up; meanwhile its own saves go
        on, and with a small ``keep`` its retention would remove the composite ordered first."""
        return self.promoter.may_read(0) if self.promoter is not None else []

    def restored(self, level: int, step: int) -> None:
        if self.promoter is not None:
            self.promoter.restored(level, step)

    @property
    def promotions(self) -> list[Promotion]:
        """The promotions this writer made so far (rank 0; empty elsewhere)."""
        return list(self.promoter.done) if self.promoter is not None else []

    def wait_promotions(self) -> None:
        """Wait for the promotion in flight, if any (rank 0)."""
        if self.promoter is not None:
            self.promoter.wait()

    def prepare_save(self, step: int, timeout: float, coordinator: Coordinator | None = None) -> None:
        """Where the first tier is committed (rank 0; each node's leader of a node-local one),
        as a save of ``step`` opens, inside the save's own first message (so every rank raises
        what this raises, and a save costs no message of its own here). This node's healed copy
        settled first (``settle_healing``): the others wait on while its writes advance (as at
        ``close``: ``coordinator.working``). Rank 0: raise the
        promotion failures met since the last report, each once, as a PromotionError; then,
        while a tier is more than its ``max_lag`` behind the one before it, wait (up to
        ``timeout`` seconds) for the promotion to catch up. Then claim the first tier's lock.
        Nothing of the save is written yet."""
        healing = coordinator is not None and self.healing_progress and self.first.run.committing_in_background()
        healed = coordinator.working(*self.healing_progress) if healing else nullcontext()
        try:
            with healed:
                self.settle_healing()
        except NodeTierError as err:
            raise NodeTierError(f"step {step} was not saved: {err}") from None
        if self.promoter is not None:
            _catch_up(self.promoter, step, timeout)
        self.first.lock.claim()

    def raise_failure(self, coordinator: Coordinator) -> None:
        """Collective: raise on every rank the promotion failures rank 0 met since the last
        call (each once), as a PromotionError. With one tier, nothing to do and no message."""
        if len(self.levels) > 1:
            failure = (lambda: self.promoter.take_failure() if self.promoter else None) if coordinator.is_leader else None
            message = coordinator.broadcast(f"{coordinator.new_round()}/promotion", failure)
            if message is not None:
                raise PromotionError(message)

    def close(self, coordinator: Coordinator) -> None:
        """Collective: promote the newest composite of the first tier to every tier and wait for
        it; then, nothing of this writer reading any more, retention once more where it passed
        over what a reader held (``retain_held_back``); then release the locks (also when that
        fails). With a node-local first tier, the nodes first tell one another whether a healing
        of their copy failed (``_unhealed_nodes``): then nothing is promoted (that copy lacks part
        of the composite restored) and every rank raises a NodeTierError naming each such node,
        so no rank is left waiting for one that raised (``Tailor.close``'s next message)."""
        unhealed: dict[int, str] = {}
        _UNCLOSED.pop(self._unclosed, None)
        try:
            unhealed = self._unhealed_nodes(coordinator)
            if not unhealed:
                if self.promoter is not None:  # the others wait on while it advances (a large upload)
                    with coordinator.working(self.promoter.progress):
                        self.promoter.finish()
                if self.uploader is not None:  # rank 0 says stop once its last promotion is committed
                    self.uploader.join()
                self.retain_held_back()
        finally:
            try:
                if self.promoter is not None:  # a close interrupted (Ctrl-C): its promotion in flight ends first
                    self.promoter.wait()
            finally:  # interrupted again: released now, and a promotion still running cannot commit (check_held)
                if self.promoter is not None and self.promoter.crew is not None:
                    self.promoter.crew.stop()
                self.release()
                self._close_courier()
        if unhealed:
            promoted = "; nothing was promoted at close" if len(self.levels) > 1 else ""
            raise NodeTierError(f"the healing of the copy of node(s) {sorted(unhealed)} did not complete: "
                                f"{'; '.join(why for _, why in sorted(unhealed.items()))}{promoted}. The composite "
                                "restored stays whole in the other nodes' copies, every earlier one where it was: "
                                "restore() again (on every rank; the next job's restore too) heals the copy")

    def _unhealed_nodes(self, coordinator: Coordinator) -> dict[int, str]:
        """Collective with a node-local first tier (``close``): node -> why the healing of its
        copy did not complete (``settle_healing`` on its leader), the same on every rank; nothing
        otherwise, and no message. The others wait on while this node's healed copy is still
        being written (``Coordinator.working``: its writes and fsyncs advance)."""
        try:
            with coordinator.working(*self.healing_progress):
                self.settle_healing()
            mine = None
        except NodeTierError:
            mine = self.unhealed
        if self.placement is None:
            return {0: mine} if mine is not None else {}
        reports = coordinator.exchange(f"{coordinator.new_round()}/healed", mine)
        return {self.placement.nodes.node_of_rank(rank): why for rank, why in enumerate(reports) if why is not None}

    def retain_held_back(self) -> None:
        """Each tier's retention once more where this writer's last one passed over snapshots a
        reader held (``Level.held_back``), the promoter drained: what a tier keeps after a run is
        its newest ``keep`` composites whatever pace the promoter had (a snapshot an outside
        reader still holds stays, as ever). Runs where that retention ran: the first tier's
        where it is kept (``keeps_first``), the others' on rank 0. Never a composite the
        promotion still needs: the newest of the first tier is kept, and was promoted."""
        for level in self.levels:
            if level.held_back and level.keep is not None:
                # The promoter's runs are fresh (promote.py): a slower tier's own may hold stale manifests.
                run = level.run if level is self.first else Run(level.run.storage)
                level.held_back = retain_after_commit(run, level.keep, f"{level.name} (at close)")

    def release(self) -> None:
        """Release every tier's lock (held or not), for good: a promotion still running takes
        none back (it commits nothing more: ``check_held``); promote nothing more."""
        for level in self.levels:
            level.lock.release(for_good=True)

    def abandon(self) -> None:
        """Undo a writer's start that failed: each tier's record put back as it was, every lock
        released and what taking it created removed (a new tier's directory and ``.lock``)."""
        _UNCLOSED.pop(self._unclosed, None)
        self.promoter = None
        self._record.put_back()
        for level in self.levels:
            level.lock.abandon()
        self._close_courier()

    def _close_courier(self) -> None:
        """The courier's gloo group let go (``Courier.close``: its connections to every other
        rank and its threads end): a closed writer, kept by the script, holds none of them."""
        courier = self.placement.courier if self.placement is not None else None
        if courier is not None:
            courier.close()

    # -- reading ----------------------------------------------------------------------------

    def latest_step(self, coordinator: Coordinator | None = None) -> int | None:
        """The newest composite step of any tier; a tier that cannot be read raises (a script
        must not start afresh because its store did not answer). With a node-local first tier
        and a ``coordinator`` (collective then): the newest over every node's copy, so every
        rank answers alike, a replaced node's empty copy included."""
        found = [step for step, _ in newest_steps(self.levels, raise_problem)]
        newest = max(found) if found else None
        if self.placement is None or coordinator is None:
            return newest
        everywhere = [s for s in coordinator.exchange(f"{coordinator.new_round()}/latest", newest) if s is not None]
        return max(everywhere) if everywhere else None

    def newest_run(self) -> Run | None:
        """The run (tier) holding the newest composite whole, or None when no tier holds one."""
        if self.latest_step() is None:
            return None
        chosen, held = self.choose(None)
        held.close()
        return self.levels[chosen.level].run

    def choose(self, step: int | None, offer: NodeChoice | None = None) -> tuple[Choice, LeasedComposite]:
        """The composite a restore reads, leased: of ``step`` (default: the newest), from the
        fastest tier holding it whole (``choice.choose``; ``offer``: a node-local first tier's,
        from ``recover``); the caller closes the lease."""
        return choose(self.levels, step, offer)

    def candidates(self, offer: NodeChoice | None = None) -> Candidates:
        """What ``restore(fallback=True)`` tries, in order (``choice.candidates``)."""
        return candidates(self.levels, offer)

    # -- a node-local first tier after a node loss (healing.py) ----------------------------------

    def recover(self, coordinator: Coordinator, step: int | None) -> tuple[NodeChoice | None, dict[int, list[int]]]:
        """Collective, before a restore, with a node-local first tier: the composite the nodes
        hold whole together (of ``step``; default the newest), every node's copy of it made whole
        from the others' (``healing.recover``), and which nodes' copies served which node.
        ``(None, {})`` without a node-local tier (nothing to decide across nodes). The healing
        may still run when this returns (``healing``): the restore takes its outcome (``healed``)."""
        if self.placement is None:
            return None, {}
        offer, served, self.healing = recover(self.first.run, self.placement.nodes, self.placement.courier, coordinator,
                                              step)
        self.healing_progress = () if self.healing is None else (self.healing.progress,)
        # Its survey settled the commits an earlier healing left running and listed the copies
        # as they are: what a failed one left out was healed again, or the composite chosen (or
        # the next tier) does not need it. That failure (logged when it happened) stops no save.
        self.first.run.commit_failure()
        self.unhealed = None
        return offer, served

    def healed(self) -> str | None:
        """Wait for this rank's part of the healing ``recover`` left running (once; None when
        there is none): the first failure of this node's receiving, or None; the failure of a
        stream raised (``healing.Healing.outcome``)."""
        healing, self.healing = self.healing, None
        return None if healing is None else healing.outcome()

    def settle_healing(self) -> None:
        """Wait for this node's copy's commits a healing left running (``healing.Receiving``:
        a restore reads the arrived bytes meanwhile); raise a NodeTierError if one failed, and
        again at every call until a restore heals the copy (``recover``): a save would extend a
        composite this node's copy lacks part of (its parts held by fewer nodes than
        ``replicas``, and not promotable from this node). Every save (inside its first message:
        every rank raises it) and ``close`` call this."""
        run = self.first.run
        run.settle_commits()
        failure = run.commit_failure()
        if failure is not None:
            self.unhealed = failure
        if self.unhealed is not None:
            raise NodeTierError(f"the healing of this node's copy did not complete: {self.unhealed}; this node's copy "
                                "lacks part of the composite restored, so no save extends it: restore() again (on every "
                                "rank) to heal the copy")

    def clear_unwhole(self, coordinator: Coordinator) -> dict[int, list[int]]:
        """Collective, at a writer's start, with a node-local first tier: remove from every
        node's copy the snapshots above the newest composite whole across the nodes
        (``healing.clear_unwhole``); what each node removed."""
        if self.placement is None:
            return {}
        cleared = clear_unwhole(self.first.run, self.placement.nodes, coordinator)
        if self.promoter is not None and cleared:  # it counted from what rank 0's copy held before
            self.promoter.cleared(self.first.run.latest_step())
        return cleared


class _Unclosed:
    """What ``Tiers.close`` would do that a writer never closed leaves to the exit: run once the
    interpreter waited for every save and promotion in flight (their threads are not daemons),
    while the storage and the job's store still answer. Rank 0 tells every node's uploader that
    no order follows (``Crew.stop``); a node's leader serves rank 0's orders until then
    (``NodeUploader.join``: its uploader is a daemon thread, which would die with the interpreter
    while rank 0 waits for its part of the promotion due at the last save); then every lock is
    released (at the interpreter's teardown it cannot be: an object store's lease would stay until
    its TTL).

    A writer dropped without ``close()`` (a local of a function that returned; a notebook's or a
    sweep's Tailor made again) is not kept alive here: its tiers, their locks and its promoter go
    with it (a promotion in flight keeps its promoter until it ends: its thread holds it), so the
    next writer of the run in this process can save. What the other nodes wait for is kept only
    until they need it no more: rank 0's crew tells every node's uploader that no order follows
    (``Crew.stop``) once its tiers and its promoter are gone (no promotion in flight); a node
    leader's uploader serves rank 0's orders until then, and ends. Nothing of a dropped writer
    is left here after that (before, each one's crew and its store client on rank 0, and an idle
    uploader thread on each node's leader, stayed until the interpreter exited)."""

    def __init__(self, tiers: Tiers, promoter: Promoter | None, uploader: NodeUploader | None):
        self.tiers = weakref.ref(tiers, self._dropped)
        self.promoter = weakref.ref(promoter, self._dropped) if promoter is not None else None
        self.crew, self.uploader = (promoter.crew if promoter is not None else None), uploader
        self._gone = threading.Lock()

    def _dropped(self, _: weakref.ref | None = None) -> None:
        """Once the writer is gone (its tiers, and its promoter: a promotion in flight holds it
        until it ends): rank 0's crew stopped, and this entry gone once the uploader ended too.
        Runs where the last reference went (a weakref's callback), or on the uploader's thread."""
        if self not in _UNCLOSED:  # closed (``close`` stopped the crew, joined the uploader) or abandoned
            return
        if self.tiers() is not None or (self.promoter is not None and self.promoter() is not None):
            return
        with self._gone:  # the tiers' and the promoter's callbacks may meet (the promoter's ends on its thread)
            crew, self.crew = self.crew, None
        if crew is not None:
            try:
                crew.stop()
            except Exception as err:  # the job's store gone: the uploaders give up on their own (``NodeUploader.join``)
                log.warning("llmtailor: a dropped writer could not tell the nodes' uploaders to stop: %s: %s",
                            type(err).__name__, err)
        uploader = self.uploader
        if uploader is None or uploader.stopped(then=self._dropped):
            _UNCLOSED.pop(self, None)
            self.uploader = None  # it may hold this entry (``then``): neither keeps the other, nor its coordinator

    def finish(self) -> None:
        if self.uploader is not None:
            self.uploader.join()
        with self._gone:  # stopped once: here, or as the writer goes (``_dropped``)
            crew, self.crew = self.crew, None
        if crew is not None:
            promoter = self.promoter() if self.promoter is not None else None
            if promoter is not None:  # gone: nothing in flight (its thread would hold it)
                promoter.wait()
            crew.stop()
        tiers = self.tiers()
        if tiers is not None:
            tiers.release()


_UNCLOSED: dict[_Unclosed, None] = {}
"""The writers open in this process, in the order they opened, until ``close`` or ``abandon``
(a forked child's own: the parent's are not its to finish)."""
os.register_at_fork(after_in_child=_UNCLOSED.clear)


@atexit.register
def _finish_unclosed() -> None:
    """At exit, each writer never closed (``_Unclosed``); one that fails is said, not raised."""
    for unclosed in list(_UNCLOSED):
        try:
            unclosed.finish()
        except Exception as err:  # the job's store or the storage gone: the next writer clears up
            log.warning("llmtailor: a writer not closed could not finish at exit: %s: %s", type(err).__name__, err)
    _UNCLOSED.clear()


def _catch_up(promoter: Promoter, step: int, timeout: float) -> None:
    """``Tiers.prepare_save``'s promotion part: the failures to report, the lag to wait for."""
    try:
        promoter.catch_up(timeout)
    except PromotionError as err:
        raise PromotionError(f"{err}; step {step} was not saved: call save({step}) again") from None
    failure = promoter.take_failure()
    if failure is not None:
        raise PromotionError(failure)
