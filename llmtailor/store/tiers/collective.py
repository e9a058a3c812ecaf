"""Collective promotion: a composite of a node-local tier (``Tier(scope="node")``) promoted to
the next, shared tier by every node at once, each node uploading its own parts.

No node holds a node-local composite whole (each holds its own ranks' parts and its replicas of
a few others), and uploading from one node would send every byte through its link. So, with the
same outcome as ``promote.promote`` (every snapshot the composite needs that the shared tier
lacks, committed there oldest first, manifest last and only if absent, carriers marked, then
``latest``):

1. rank 0 (its promoter thread) decides, alone, which composite and which of its snapshots the
   shared tier lacks (``promote.lacking``), opens each one's staging place there
   (``SnapshotCommit.begin``: on an object store the final prefix, invisible without its
   manifest) and posts the order through the coordinator's store (``promotion/<n>``), so every
   node promotes the same step;
2. each node's leader (``NodeUploader``, a background thread; rank 0 itself for its node)
   first leases each snapshot of the order in its own copy (``ReadLeases``; rank 0 leased the
   whole composite before it decided), then uploads its own node's parts of those snapshots
   from its own copy: the files its node's ranks wrote (``constants.writer_rank``; the node of
   each rank from the snapshot's own manifest, ``notes["nodes"]``), never its replicas of other
   nodes' parts, at most ``UPLOADS`` files at a time (the bound on what one node sends at
   once), each checked against its checksum on the way (``promote.copy_file``: a damaged copy
   is never promoted); then it posts how it fared (``promotion/<n>/node/<i>``);
3. rank 0, once every node reported success within the timeout, uploads the files of no rank
   (the global state, the unit indexes: every node holds them) and commits each snapshot.

Invariants. No node reads a snapshot of its copy for a promotion without holding a read lease
on it, so the node's own retention (``keep=K``, run by its leader after each save while the
promotion is in flight) leaves in place every snapshot a node is uploading: a part is uploaded
whole or not at all, however far the promotion lags. And no node's retention removes a composite
ordered before that node's uploader took the order up (and leased it), however late that is:
the commit of every save carries rank 0's word on the composites its promoter reads or may
choose next (``Tiers.may_promote``, ``Promoter.may_read``: at most two), and every node's retention
after that save spares them (``node_commit``, ``retention.plan_retention``), so every node's
copy keeps what rank 0's keeps. What an order names is always among what the save before it
spared, so it is still in every copy when the follower leases it. Sparing holds nothing (no
lease to release): once the promotion ended, the next save's retention removes what it spared,
and ``close`` runs retention once more, sparing nothing. While a promotion stalls, each copy
keeps at most two composites more than its ``keep``, and ``max_lag`` holds the saves.

A follower whose copy lacks a snapshot ordered all the same (removed by other hands) reports the
steps gone, before it reads anything, and rank 0 fails the promotion with
SnapshotNotFoundError, which the promoter takes as a source that moved on (``promote.Promoter``:
the newer composite is promoted next).

A node that fails, dies or does not report in time fails the promotion (retried, then reported
as any failed promotion): rank 0 abandons every staging place, and nothing of it was visible in
the shared tier (no manifest). What a crash of rank 0 itself leaves (a staging place, a carrier
committed before its composite) is removed by the next writer when it takes the tier's lock
(the storage's ``clear_leftovers``; ``promote.clear_stray_carriers``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from contextlib import contextmanager
from typing import Any, TypeVar

from llmtailor.constants import writer_rank
from llmtailor.distributed.coordinator import CoordinationError, Coordinator, describe_error
from llmtailor.distributed.nodes import Nodes
from llmtailor.distributed.progress import carried
from llmtailor.errors import SnapshotNotFoundError, TailorError
from llmtailor.store.catalog import ReadLeases
from llmtailor.store.commit import SnapshotCommit
from llmtailor.store.manifest import FileEntry
from llmtailor.store.run import Run
from llmtailor.store.storage.base import LazyPool
from llmtailor.store.tiers.levels import Level
from llmtailor.store.tiers.promote import copy_file, lacking, point_latest, promoted_manifest, unconfirmed_stops

log = logging.getLogger(__name__)
T = TypeVar("T")

UPLOADS = 4
"""Files one node uploads at once during a collective promotion: its bound on the bandwidth
a promotion takes from training's own traffic (an object store's multipart upload of one file
may open a few streams of its own)."""
_uploaders = LazyPool(UPLOADS, "llmtailor-upload")
_LANE = "node-upload"
"""The beats of a node's uploader (``Coordinator.working``'s lane): it serves rank 0's orders on a
thread of its own while the node's training thread saves (its blocks' beats are no sign of the
upload's)."""
"""Threads uploading a node's files of a promotion (``upload``): a pool that, at an exit without
``close()`` (a promotion due then), asks one file after another instead of failing."""
IDLE_WAIT = 0.2
"""Seconds between two looks of ``NodeUploader.join`` for rank 0's stop; and the pause before an
idle uploader waits again for the next order after a wait that ended without one."""
GONE_AFTER = 5.0
"""Seconds an uploader's looks at the job's store, or its report's posts, must fail in a row
before it takes the store for gone and stops (``NodeUploader._retried``): one failed call may be
a hiccup (a busy machine, a connection reset, a client's timeout) after which the store answers
again."""
_STORE_FAILED = (CoordinationError, RuntimeError, OSError)
"""How a call to the job's store fails: the coordinator's error for a store gone, or what
torch's client raises itself (its ``DistError`` family are ``RuntimeError``: a timeout, a
connection reset) or the system does."""


class _Gone(Exception):
    """The job's store failed every call for ``GONE_AFTER`` s (``NodeUploader._retried``)."""


def order_tag(number: int) -> str:
    return f"promotion/{number}"


def report_tag(number: int, node: int) -> str:
    return f"promotion/{number}/node/{node}"


def node_files(source: Run, step: int, node: int | None) -> list[FileEntry]:
    """The files of ``source``'s snapshot of ``step`` that ``node`` uploads: those its ranks
    wrote (by the placement its manifest records), or with ``node`` None the files of no rank.
    A snapshot that records no placement (one node) is node 0's."""
    placed = source.manifest(step).notes.get("nodes")
    nodes = Nodes.of_record(placed) if isinstance(placed, dict) else None

    def owner(entry: FileEntry) -> int | None:
        rank = writer_rank(entry.path)
        if rank is None:
            return None
        return nodes.node_of_rank(rank) if nodes is not None and rank < nodes.world_size else 0

    return [entry for entry in source.stored_files(step) if owner(entry) == node]


def upload(source: Run, dst: Run, staging: dict[int, str], node: int | None) -> int:
    """Upload ``node``'s files (``node_files``) of each snapshot ``staging`` names (step ->
    its staging place in ``dst``), ``UPLOADS`` at a time, each checked on the way; their bytes.
    Durable on return; the first failure raises. The caller holds a read lease on each of those
    snapshots in ``source`` (module docstring: rank 0 the composite's, a follower the order's)."""
    work = [(step, entry) for step in sorted(staging) for entry in node_files(source, step, node)]

    def one(step: int, entry: FileEntry) -> int:
        snapshot = SnapshotCommit(dst, step, staging[step])
        with snapshot.files() as create:  # one sink at a time per batch: a batch of its own per file
            copy_file(source.storage, f"{source.snapshot_key(step)}/{entry.path}", create(entry.path), entry)
        return entry.bytes

    futures = [_uploaders.submit(carried(one), step, entry) for step, entry in work]
    wait(futures)  # every upload ended, whatever the first did
    return sum(future.result() for future in futures)


class Crew:
    """The nodes of a job that promote a node-local tier together (module docstring): the
    job's ``nodes`` and the coordinator their messages go through. Rank 0's promoter calls
    ``promote``; each other node's leader runs a ``NodeUploader``."""

    def __init__(self, nodes: Nodes, coordinator: Coordinator):
        self.nodes, self.coordinator = nodes, coordinator
        self._orders = 0

    def promote(self, source: Run, target: Level, step: int, parent: int | None = None) -> tuple[list[int], int]:
        """``promote.promote``, collectively (module docstring); rank 0's promoter thread.
        Returns the snapshots copied and their bytes; PromotedUnconfirmed as ``promote``."""
        dst = target.run
        with source.reading(step) as composite:  # leased: the source's retention leaves it in place
            target.lock.claim()
            needed, parent = lacking(source, dst, composite, parent)
            if not needed:
                point_latest(dst, step)
                return [], 0
            with _staged(source, dst, needed) as (staging, committed):
                self._orders += 1
                number = self._orders
                self.coordinator.post(order_tag(number), {"staging": {str(s): name for s, name in staging.items()}})
                upload(source, dst, staging, 0)
                self._await_nodes(number)
                upload(source, dst, staging, None)  # the files of no rank: every node holds them
                for snapshot in needed:  # oldest first: the composite's own last
                    unconfirmed = SnapshotCommit(dst, snapshot, staging[snapshot]).commit(
                        promoted_manifest(source, snapshot, step, parent), confirm=target.lock.check_held, what="promoted")
                    committed.add(snapshot)
                    if unconfirmed is not None:  # committed: the promotion stops there (``promote.PromotedUnconfirmed``)
                        done = sorted(committed)
                        unconfirmed_stops(unconfirmed, target, step, snapshot, done,
                                          sum(source.manifest(s).total_bytes() for s in done))
            size = sum(source.manifest(s).total_bytes() for s in needed)
        point_latest(dst, step)
        return needed, size

    def _await_nodes(self, number: int) -> None:
        """Every other node's report on order ``number``; a SnapshotNotFoundError naming each
        node whose copy no longer held a snapshot of it, a TailorError naming each node that
        failed (a CoordinationError naming the leaders that did not report in time)."""
        leaders = {self.nodes.leader_of(node): report_tag(number, node) for node in range(1, self.nodes.count)}
        reports = self.coordinator.collect(leaders, f"their part of promotion {number}", lane=_LANE)
        gone = {self.nodes.node_of_rank(rank): r["gone"] for rank, r in reports.items() if "gone" in r}
        if gone:  # for good: no retry brings them back (module docstring)
            raise SnapshotNotFoundError(
                "node(s) " + "; ".join(f"{node}: step(s) {steps}" for node, steps in sorted(gone.items()))
                + " left their copy (its retention moved on to a newer composite) before the promotion reached it")
        failed = {self.nodes.node_of_rank(rank): r["error"] for rank, r in reports.items() if "error" in r}
        if failed:
            raise TailorError("node(s) " + "; ".join(f"{node}: {why}" for node, why in sorted(failed.items()))
                              + " could not upload their parts")

    def stop(self) -> None:
        """Tell every node's uploader that no order follows (rank 0, at ``close``)."""
        self._orders += 1
        self.coordinator.post(order_tag(self._orders), {"stop": True})


@contextmanager
def _staged(source: Run, dst: Run, steps: list[int]) -> Iterator[tuple[dict[int, str], set[int]]]:
    """The staging place of each snapshot of ``steps`` in ``dst``, and the set the block adds
    each step it committed to; if the block raises, every staging place not committed is
    abandoned (a committed snapshot is never touched)."""
    staging: dict[int, str] = {}
    committed: set[int] = set()
    try:
        for step in steps:
            staging[step] = SnapshotCommit.begin(dst, step, source.manifest(step).world_size).staging
        yield staging, committed
    except BaseException:
        for step, name in staging.items():
            if step not in committed:
                SnapshotCommit(dst, step, name).abandon()
        raise


class NodeUploader:
    """A node leader's part of collective promotions (not rank 0's): a background thread that
    follows rank 0's orders, in order, uploading this node's parts from its own copy
    (``source``) into the shared tier ``dst``, until rank 0 says stop (``Crew.stop``)."""

    def __init__(self, source: Run, dst: Run, node: int, coordinator: Coordinator):
        self.source, self.dst, self.node, self.coordinator = source, dst, node, coordinator
        self._thread = threading.Thread(target=self._follow, name="llmtailor-node-upload", daemon=True)
        self._stopped = threading.Event()
        self._heard = time.monotonic()
        """When rank 0 was last heard from (an order came, or this node's part of one ended)."""
        self._serving = False
        """Whether this node serves an order now (rank 0 waits for it: ``join`` does too)."""
        self._then: Callable[[], None] | None = None

    def start(self) -> NodeUploader:
        self._thread.start()
        return self

    def join(self) -> None:
        """Wait until rank 0 said stop (it does once its last promotion is committed), or until
        rank 0 was silent for the coordinator's timeout (no order, and no progress of its close's
        block: ``Coordinator.beat``, a look that gives up within the timeout on a store that stopped
        answering, as every store call of the coordinator does; its last promotion may outlast
        the timeout, node 0 uploading most of it), counted from this call
        at the earliest and never while this node serves an order (a rank 0 that died says nothing: logged, not
        raised), or the thread ended on its own (its wait for an order, or its report, found the
        job's store gone: logged there; no order follows). Rank 0 orders the promotion of the
        last composite as its writer closes, while this one waits here: a silence before this
        call (promotions far apart) is no sign of its death (before, a close after an idle
        timeout returned at once, and the process could exit before its part was uploaded)."""
        since, beat = time.monotonic(), None
        while not self._stopped.wait(IDLE_WAIT):
            if self._thread.ident is not None and not self._thread.is_alive():
                return
            with contextlib.suppress(*_STORE_FAILED):  # rank 0's close advancing (its last promotion): heard
                beat, before = self.coordinator.beat(0), beat
                if before is not None and beat != before:
                    self._heard = time.monotonic()
            if not self._serving and time.monotonic() - max(self._heard, since) > self.coordinator.timeout:
                log.warning("llmtailor: node %d's uploader heard nothing from rank 0 for %g s; it stops",
                            self.node, self.coordinator.timeout)
                return

    def stopped(self, then: Callable[[], None]) -> bool:
        """Whether this uploader stopped: rank 0 said stop, or it stopped on its own (no order
        follows: its report found the job's store gone); if not yet, ``then()`` is called on its
        thread once it does, as the thread ends."""
        self._then = then
        return self._stopped.is_set()

    def _follow(self) -> None:
        try:
            self._orders()
        finally:  # however it ends (told to, or on its own): what waits for its end learns it
            self._stopped.set()
            then, self._then = self._then, None  # called once, and held no more (it holds this uploader)
            if then is not None:
                then()

    def _orders(self) -> None:
        """Serve rank 0's orders in turn until it says stop, or until the job's store is gone
        (an order cannot come, a report cannot reach it: logged)."""
        number = 1
        while True:
            try:
                order = self._next(number)
            except _Gone as gone:
                log.warning("llmtailor: node %d's uploader stops waiting for promotion order %d: %s (for %g s); no "
                            "promotion of this job follows", self.node, number, gone, GONE_AFTER)
                return
            if order.get("stop"):
                return
            self._serving = True
            try:
                with self.coordinator.working(lane=_LANE):  # rank 0 waits on while this node's upload goes on (a slow store)
                    report = self._serve(order)
            finally:  # heard before no longer serving: a ``join`` meanwhile counts the silence from now
                self._heard = time.monotonic()
                self._serving = False
            try:
                self._retried(functools.partial(self.coordinator.post, report_tag(number, self.node), report))
            except _Gone as gone:  # the job's store went away (rank 0 died): no order follows
                log.warning("llmtailor: node %d's uploader could not report on promotion %d and stops: %s (for %g s)",
                            self.node, number, gone, GONE_AFTER)
                return
            number += 1

    def _next(self, number: int) -> dict[str, Any]:
        """Order ``number``, once rank 0 posted it: waited for in the store's own ``wait``
        (woken as it lands), again and again while none comes (promotions may be far apart: an
        idle rank 0 says nothing). ``_Gone`` once the job's store is gone (the process hosting
        it died: rank 0's, or the launcher's): no order can come through it (``_retried``: a
        look that fails once may be a hiccup the next passes; before, the first failed look
        stopped this node's uploads for good, and earlier the uploader asked a dead store again
        every ``IDLE_WAIT`` for as long as its process lived). A store that outlives rank 0 (the
        launcher's) tells nothing of rank 0's death: the uploader waits on in the store's
        ``wait``; the launcher ends this process too (torchrun stops every worker of a job whose
        worker failed), and a close's ``join`` gives up after the timeout."""
        tag = order_tag(number)
        while True:
            try:
                order = self.coordinator.collect({0: tag}, f"promotion order {number}")[0]
            except _STORE_FAILED:  # none within the timeout, or the store failed: which, a look says
                posted, order = self._retried(functools.partial(self.coordinator.poll, tag))
                if not posted:
                    self._stopped.wait(IDLE_WAIT)
                    continue
            self._heard = time.monotonic()
            return order

    def _retried(self, call: Callable[[], T]) -> T:
        """``call()`` (a call to the job's store), again each ``IDLE_WAIT`` while it fails
        (``_STORE_FAILED``); ``_Gone``, with its last failure, once it failed for ``GONE_AFTER`` s."""
        failing: float | None = None  # since when every call failed
        while True:
            try:
                return call()
            except _STORE_FAILED as err:
                failing = time.monotonic() if failing is None else failing
                if time.monotonic() - failing >= GONE_AFTER:
                    raise _Gone(describe_error(err)) from err
                self._stopped.wait(IDLE_WAIT)

    def _serve(self, order: dict[str, Any]) -> dict[str, Any]:
        """This node's part of one order, each snapshot of it leased in this node's copy before
        anything is read and until its upload ended (module docstring): ``{"bytes"}`` uploaded,
        ``{"gone": [steps]}`` when the copy no longer held those (nothing read), or ``{"error"}``."""
        try:
            staging = {int(step): name for step, name in order["staging"].items()}
            # A snapshot a healing is still committing here (``Catalog.commit_later``) is not in
            # this copy yet: a fresh run would find it gone, and the promotion give way for good.
            self.source.wait_commits()
            # Runs of their own, fresh for each promotion (as the promoter's): no stale manifest.
            source = Run(self.source.storage)
            with ReadLeases(source) as leases:
                gone = [step for step in sorted(staging) if not leases.take(step)]
                if gone:
                    log.info("llmtailor: node %d's copy no longer holds step(s) %s of a promotion", self.node, gone)
                    return {"gone": gone}
                return {"bytes": upload(source, Run(self.dst.storage), staging, self.node)}
        except Exception as err:  # reported to rank 0, which fails the promotion, naming this node
            log.warning("llmtailor: node %d could not upload its parts: %s", self.node, err)
            return {"error": describe_error(err)}


def follows(nodes: Nodes, rank: int) -> bool:
    """Whether ``rank`` runs a ``NodeUploader``: it leads a node other than rank 0's (node 0)."""
    node = nodes.node_of_rank(rank)
    return node != 0 and nodes.leader_of(node) == rank


__all__ = ["Crew", "NodeUploader", "UPLOADS", "follows", "node_files", "upload"]
