"""Promotion: copying a committed composite from one tier to the next slower one.

``promote`` copies the composite of a step from tier A to tier B so that it is complete in B:
every snapshot it needs that B lacks is copied, oldest first, each file streamed from A and
checked against its checksum on the way (a damaged source is never promoted), each snapshot
committed in B with B's own protocol (files, then the manifest only if absent, then the
commit: ``store.commit.SnapshotCommit``, as a save), then B's ``latest``. A copied manifest is A's but for its
``parent``: the composite's names the composite promoted to B before it on the same lineage
(B's lineage is the promoted composites, so B's retention counts them); a snapshot copied only for what the composite needs
(a carrier) names none, and a ``carried_for`` note says so (``verify`` does not miss its own
composite there). A crash or failure at any point leaves B as it was plus, at most, whole older snapshots
(never read as the newest: ``latest`` and the parent links do not lead to them).

A carrier whose composite never committed in B (the promotion was killed or failed after the
carrier's commit), and which no composite of B needs, belongs to no lineage: nothing restores
it, and a later lineage (one resumed from an older composite after the faster tier was lost)
may need a snapshot of its step. Such a *stray* carrier is replaced when a promotion needs its
step, and the next writer removes those a killed promotion left above B's newest composite
when it starts (``clear_stray_carriers``); a snapshot of B that a composite needs is never
replaced (``promote`` fails, naming it).

``Promoter`` runs promotions in the background, one at a time, down every tier: after each
commit to the first tier it wakes, and for each pair of tiers promotes the newest composite of
the faster one when it is at least ``promote_every`` steps after the slower one's newest (so a
lagging promoter skips composites, never queues them: a composite the faster tier's retention
removed before its promotion began is passed over without a word, as its newer one is promoted
next). A failed promotion is retried; where the faster tier's retention removed the composite
while the promoter waited to try again, the retry promotes that tier's newest composite in its
place, and the ``Promotion`` done names what it superseded (``superseded``; also logged). After
``ATTEMPTS`` failed tries the failure is kept and reported once by ``take_failure`` (the writer's
next save, wait or close); neither tier is damaged by it. A promotion whose snapshot was renamed
in but whose name could not be made durable (``PromotedUnconfirmed``) is not a failed try: that
snapshot is committed, the promotion stops there (the tier's ``latest`` and retention left for
the next promotion), counts as done where that snapshot was the composite's own, and its message
is reported as above, never retried. Training waits for a promotion only at
``finish`` (``close``), which promotes the last composite to every tier, and where a tier falls
more than its ``max_lag`` behind the faster one (``catch_up``: bounded loss): the next save then
waits until the promotion has caught up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from llmtailor.constants import CARRIED_FOR
from llmtailor.distributed.progress import Scope, advance, within
from llmtailor.errors import IntegrityError, PromotionError, SnapshotNotFoundError, TailorError, describe_os_error
from llmtailor.store.catalog import Composite
from llmtailor.store.commit import SnapshotCommit, replace_latest
from llmtailor.store.manifest import FileEntry, Manifest
from llmtailor.store.retention import discard_snapshots, retain_after_commit
from llmtailor.store.run import Run
from llmtailor.store.storage import Sink, Storage
from llmtailor.store.tiers.levels import Level

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Tries of one promotion before its failure is reported."""
RETRY_WAIT = 1.0
"""Seconds before the second try; doubled before each next one."""


class PromotedUnconfirmed(TailorError):
    """A snapshot of a promotion was committed in the slower tier (visible there, whole), but
    what followed its rename failed (``store.commit``: the fsync of its name): the promotion
    stopped there, nothing more committed and that tier's ``latest`` left as it was (it names a
    composite only once its names were made durable). ``whole``: the composite's own snapshot was
    that one (the promotion is done, its carriers before it); else only carriers are in, and the
    next promotion there goes on from them (they are the same snapshots: ``lacking`` passes over
    them). Never retried: the snapshot is committed, and a second fsync after a failed one may
    succeed with the name lost, so nothing more can be confirmed; the message is the failure the
    writer reports (``Promoter``)."""

    def __init__(self, message: str, step: int, copied: list[int], size: int, whole: bool):
        super().__init__(message)
        self.step, self.copied, self.bytes, self.whole = step, copied, size, whole


def promote(source: Run, target: Level, step: int, parent: int | None = None) -> tuple[list[int], int]:
    """Copy the composite of ``step`` from ``source`` into the tier ``target`` (module
    docstring), its ``parent`` link naming ``parent`` when that is a snapshot of ``target``
    older than ``step`` (the composite promoted there before on this lineage); returns the
    snapshots copied and their bytes. The caller holds ``target``'s writer lock (each
    commit confirms it). SnapshotNotFoundError when ``source`` no longer holds the composite
    (its retention moved on to a newer one); PromotedUnconfirmed when a snapshot was committed
    but its name not confirmed durable."""
    copied, size = [], 0
    with source.reading(step) as composite:  # leased: the source's retention leaves it in place
        target.lock.claim()
        needed, parent = lacking(source, target.run, composite, parent)
        for snapshot in needed:
            unconfirmed = _copy_snapshot(source, target, snapshot, step, parent)
            copied.append(snapshot)
            size += source.manifest(snapshot).total_bytes()
            unconfirmed_stops(unconfirmed, target, step, snapshot, copied, size)
    point_latest(target.run, step)
    return copied, size


def unconfirmed_stops(unconfirmed: str | None, target: Level, step: int, snapshot: int, copied: list[int],
                      size: int) -> None:
    """Raise PromotedUnconfirmed where the commit of ``snapshot`` (of the promotion of ``step``
    to ``target``, which copied ``copied``, ``size`` bytes so far) said ``unconfirmed``."""
    if unconfirmed is None:
        return
    where = target.run.root
    rest = (f"{where}'s latest was left as it was (it names a composite only once that is durable); the next promotion "
            "there moves it" if snapshot == step else
            f"the composite of step {step} it was copied for was not promoted (nothing more was committed in {where}); "
            "the next promotion there goes on from it")
    raise PromotedUnconfirmed(f"promoting step {step} to {target.name}: {unconfirmed}. {rest[0].upper()}{rest[1:]}",
                              step, list(copied), size, whole=snapshot == step)


def lacking(source: Run, dst: Run, composite: Composite, parent: int | None) -> tuple[list[int], int | None]:
    """The snapshots of ``composite`` (of ``source``) that ``dst`` lacks, oldest first (a stray
    carrier of one of their steps removed from ``dst`` to make room), and the ``parent`` link the
    composite's copy gets: ``parent`` if ``dst`` holds that older snapshot, else None."""
    held = set(dst.steps())
    needed = []
    for step in sorted(source.needs(composite)):
        if step in held:
            if _same_snapshot(source, dst, step):
                continue
            _replace_stray_carrier(source, dst, step)
        needed.append(step)
    return needed, parent if parent in held and parent < composite.step else None


def point_latest(dst: Run, step: int) -> None:
    """``dst``'s ``latest`` to the composite just promoted; a failure is logged (it is found
    through its parent link all the same)."""
    failure = replace_latest(dst, step)
    if failure is not None:
        log.warning("llmtailor promotion: %s", failure)


def _same_snapshot(source: Run, dst: Run, step: int) -> bool:
    """Whether the snapshot of ``step`` that ``dst`` holds is the one ``source`` holds (a
    promotion repeated), not one of another lineage that reused the step."""
    def essence(manifest: Manifest) -> Manifest:
        notes = {k: v for k, v in manifest.notes.items() if k != CARRIED_FOR}
        return manifest.model_copy(update={"parent": None, "notes": notes})

    return essence(source.manifest(step)) == essence(dst.manifest(step))


def _replace_stray_carrier(source: Run, dst: Run, step: int) -> None:
    """Remove ``dst``'s snapshot of ``step``, another than ``source``'s, for ``source``'s to be
    copied in its place: only a stray carrier (module docstring) goes; any other raises."""
    if step not in stray_carriers(dst, [step]):
        raise TailorError(f"{dst.where(step)} is another snapshot of step {step} than {source.where(step)} "
                          "(written by another lineage, and a composite there needs it); it is not replaced")
    log.info("llmtailor promotion: replacing %s, a carrier no composite there needs, with %s",
             dst.where(step), source.where(step))
    if step not in discard_snapshots(dst, [step]).deleted:
        raise TailorError(f"{dst.where(step)}, a carrier no composite there needs, could not be removed to make room "
                          f"for {source.where(step)} (being read, or see the log)")


def stray_carriers(run: Run, steps: Iterable[int]) -> list[int]:
    """The stray carriers among ``steps`` (module docstring): committed snapshots of ``run``
    with a ``carried_for`` note that no composite of ``run`` needs, a composite being any of
    its snapshots that is not a carrier, and its newest (``latest_step``: what a restore reads,
    whatever it is). Reads the manifests of the candidates and of the snapshots after them."""
    present, newest = run.steps(), run.latest_step()
    carriers = [s for s in steps if s in present and s != newest and CARRIED_FOR in run.manifest(s).notes]
    if not carriers:
        return []
    needed: set[int] = set()
    for step in present:  # a composite needs no snapshot after its own
        if step > min(carriers) and CARRIED_FOR not in run.manifest(step).notes:
            needed.update(run.needs(run.resolve(step)))
    return [s for s in carriers if s not in needed]


def clear_stray_carriers(run: Run) -> list[int]:
    """At a writer's start, holding the lock of ``run`` (a tier): remove the stray carriers a
    killed promotion left there; returns the steps removed. A promotion commits a composite's
    carriers, then the composite, then ``latest``: killed in between, it leaves them after the
    tier's newest composite, so only the snapshots after it are read (any other stray carrier
    is replaced when a promotion needs its step, and goes with the tier's retention). A
    failure is logged, never fatal: the carrier stays, harmless until its step is needed."""
    try:
        newest = run.latest_step()
        if newest is None:
            return []
        stray = stray_carriers(run, [step for step in run.steps() if step > newest])
        if stray:
            log.info("llmtailor: removing carrier(s) %s from %s, left by a promotion that did not finish", stray, run.root)
        return discard_snapshots(run, stray).deleted
    except (TailorError, OSError) as err:
        log.warning("llmtailor: looking for carriers a promotion left in %s: %s", run.root, err)
        return []


def _copy_snapshot(source: Run, target: Level, step: int, composite: int, parent: int | None) -> str | None:
    """Copy the snapshot of ``step``, which the composite of ``composite`` needs (``parent``: the
    link the composite's copy gets); what its commit could not confirm once committed, or None."""
    snapshot = SnapshotCommit.begin(target.run, step)
    with snapshot.abandoned_on_failure():
        with snapshot.files() as create:
            for entry in source.stored_files(step):
                copy_file(source.storage, f"{source.snapshot_key(step)}/{entry.path}", create(entry.path), entry)
        return snapshot.commit(promoted_manifest(source, step, composite, parent), confirm=target.lock.check_held,
                               what="promoted")


def promoted_manifest(source: Run, step: int, composite: int, parent: int | None) -> bytes:
    """The manifest of ``source``'s snapshot of ``step`` as promoted for the composite of
    ``composite`` (module docstring): that composite's own linked to ``parent``, a carrier marked
    ``carried_for`` and linked to none."""
    manifest = source.manifest(step)
    if step == composite:
        manifest = manifest.model_copy(update={"parent": parent})
    else:
        manifest = manifest.model_copy(update={"parent": None, "notes": {**manifest.notes, CARRIED_FOR: composite}})
    return manifest.dumps().encode()


def copy_file(source: Storage, key: str, sink: Sink, entry: FileEntry) -> None:
    """Stream ``key`` into ``sink``, checked against ``entry`` before the sink is closed."""
    hasher, seen = xxhash.xxh3_64(), 0
    try:
        for piece in source.pieces(key):
            hasher.update(piece)
            sink.write(piece)
            seen += len(piece)
            advance()  # a node uploading its part of a collective promotion shows it is live (``Coordinator.working``)
        if seen != entry.bytes or hasher.hexdigest() != entry.xxh3_64:
            raise IntegrityError(f"{source.where(key)}: does not match its checksum ({seen} bytes read, "
                                 f"{entry.bytes} recorded); not promoted")
        sink.close()
    except BaseException:
        sink.abort()
        raise


@dataclass(frozen=True)
class Promotion:
    """One promotion done: the composite of ``step`` copied to the tier at ``tier``."""

    tier: str
    step: int
    copied: list[int]
    """The snapshots copied (the composite's own and those it needs that the tier lacked)."""
    bytes: int
    seconds: float
    superseded: dict[int, str] = field(default_factory=dict)
    """Composites whose promotion failed and which the faster tier's retention removed before they
    could be tried again (step -> the failure): this one, newer, was promoted in their place."""


class Promoter:
    """Background promotion down a run's tiers (module docstring). ``newest`` is the newest
    composite each tier holds, as this writer knows it (the first tier's is set by
    ``committed``)."""

    def __init__(self, levels: list[Level], newest: list[int | None]):
        self._levels = levels
        self._newest = list(newest)
        self._origin = list(newest)
        """The oldest composite each tier held for this writer: a slower tier holding none yet
        lags from there (``lag``)."""
        self._guard = threading.Condition()  # notified whenever a promotion ends, done or failed
        self._thread: threading.Thread | None = None
        self._wanted = False
        self._final = False
        self._failures: list[str] = []
        self._reading: list[int | None] = [None] * len(levels)
        """The composite of tier ``target - 1`` promoted (or retried) to each ``target`` now."""
        self.crew: Any = None
        """With a node-local tier, the nodes promoting it together (``collective.Crew``): its
        promotions to the next tier go through ``crew.promote`` instead of ``promote``."""
        self.done: list[Promotion] = []
        """Every promotion done, in order."""
        self.progress = Scope()
        """The progress of its promotions (their copies and fsyncs): a close that waits for the last
        one shows it as its own (``Tiers.close``: ``Coordinator.working``)."""

    def committed(self, step: int) -> None:
        """The first tier committed ``step``: promote what is due, in the background."""
        with self._guard:
            self._note(0, step)
            self._wake()

    def cleared(self, newest: int | None) -> None:
        """The first tier's snapshots above ``newest`` were removed before any save (a writer's
        start, ``Tiers.clear_unwhole``): its newest composite is ``newest`` again, so ``close``
        promotes that one, not one that is gone."""
        with self._guard:
            self._newest[0] = newest

    def may_read(self, level: int) -> list[int]:
        """The composites of tier ``level`` this promoter reads or may choose next: the one it
        promotes now (retries included), and the newest when it is due (``_due``). Whatever it
        chooses was among them at every call since its commit's ``committed``: it chooses only
        the newest, and only when due (``_newest`` only grows between restores, and its tier
        ``level + 1``'s newest too, so a composite due now was due then). So the retention that
        each node runs on its copy of a node-local tier after a save, sparing what this answered
        as that save committed on rank 0 (``Tiers.may_promote``), never removes a composite
        ordered before that node's uploader took the order up. At most two: retention stays
        bounded however far promotions fall behind (then ``max_lag`` holds the saves)."""
        if level + 1 >= len(self._levels):
            return []
        with self._guard:
            reading, newest = self._reading[level + 1], self._newest[level]
            due = newest if self._due(level + 1, newest, self._newest[level + 1], False) else None
        return sorted({step for step in (reading, due) if step is not None})

    def _due(self, target: int, step: int | None, there: int | None, final: bool) -> bool:
        """Whether the composite of ``step`` (of tier ``target - 1``) is promoted to ``target``,
        which holds ``there``: a newer one, at least ``promote_every`` steps after it (any newer
        one when ``final``)."""
        every = self._levels[target - 1].promote_every or 1
        return step is not None and (there is None or (step > there and (final or step - there >= every)))

    def lag(self, target: int) -> int:
        """How many steps tier ``target``'s newest composite is behind tier ``target - 1``'s (as
        this writer knows them); a tier that holds none yet counts from the oldest composite the
        faster one held for this writer."""
        with self._guard:
            ahead, there = self._newest[target - 1], self._newest[target]
            floor = there if there is not None else self._origin[target - 1]
        return 0 if ahead is None or floor is None else max(ahead - floor, 0)

    def catch_up(self, timeout: float) -> None:
        """Wait while some tier is more than its faster tier's ``max_lag`` behind it, until the
        promotions have caught up or one failed (``take_failure`` has it); logged, so a stalled
        training says why. A PromotionError when they do not catch up within ``timeout`` seconds,
        or the promoter stops short of it."""
        deadline = time.monotonic() + timeout
        with self._guard:
            behind = self._beyond_lag()
            if behind is None:
                return
            log.info("llmtailor: %s: the save waits for the promotion to catch up", behind)
            if self._thread is None:  # nothing in flight would close the gap (a restore reset it)
                self._wake()
            while behind is not None and not self._failures:
                left = deadline - time.monotonic()
                if self._thread is None or left <= 0:
                    stopped = "the promotion stopped short of it" if left > 0 else f"it did not catch up within {timeout:g} s"
                    raise PromotionError(f"{behind}, and {stopped} (see the log)")
                self._guard.wait(left)
                behind = self._beyond_lag()

    def _beyond_lag(self) -> str | None:
        """The first tier more than its faster tier's ``max_lag`` behind it, said; None when none is."""
        for target in range(1, len(self._levels)):
            bound = self._levels[target - 1].max_lag
            lag = self.lag(target)
            if bound is not None and lag > bound:
                return (f"{self._levels[target].name} is {lag} steps behind {self._levels[target - 1].name} "
                        f"(max_lag={bound})")
        return None

    def _note(self, level: int, step: int | None) -> None:
        """Tier ``level``'s newest composite is now ``step`` (under the guard)."""
        self._newest[level] = step
        if self._origin[level] is None:
            self._origin[level] = step

    def restored(self, level: int, step: int) -> None:
        """The writer restored the composite of ``step`` from tier ``level``: the lineage it
        extends now ends there in that tier. Another tier's newer composites (of a branch left,
        or not whole there) are not this lineage's: no cadence counts from them, no parent
        link names them; the next promotion there links to ``step`` if that tier holds it."""
        beyond = [i for i, newest in enumerate(self._newest) if i != level and newest is not None and newest > step]
        holding = {i for i in beyond if step in self._levels[i].run.steps()}
        with self._guard:
            self._newest[level] = step
            for i in beyond:
                self._newest[i] = step if i in holding else None
            self._origin = list(self._newest)  # a lineage of its own: its lag counts from here

    def finish(self) -> None:
        """Promote the newest composite of the first tier to every tier, whatever the cadence,
        and wait for it (and for any promotion in flight)."""
        with self._guard:
            self._final = True
            self._wake()
        self.wait()

    def wait(self) -> None:
        """Wait for the promotion in flight, if any."""
        with self._guard:
            thread = self._thread
        if thread is not None:
            thread.join()

    def take_failure(self) -> str | None:
        """The failures kept since the last call (each reported once), or None."""
        with self._guard:
            failures, self._failures = self._failures, []
        return "; ".join(failures) if failures else None

    def _wake(self) -> None:
        self._wanted = True
        if self._thread is None:
            # Not a daemon: a promotion in flight when a script ends is finished, not cut.
            self._thread = threading.Thread(target=self._work, name="llmtailor-promote", daemon=False)
            self._thread.start()

    def _work(self) -> None:
        with within(self.progress):
            self._passes()

    def _passes(self) -> None:
        while True:
            with self._guard:
                if not self._wanted:
                    self._thread = None
                    self._final = False
                    self._guard.notify_all()
                    return
                self._wanted, final = False, self._final
            for target in range(1, len(self._levels)):
                try:
                    self._pass(target, final)
                except Exception as err:  # never a dead promoter: reported like a failed promotion
                    self._fail(f"promotion to {self._levels[target].name} failed: {type(err).__name__}: {err}")

    def _pass(self, target: int, final: bool) -> None:
        """Promote tier ``target - 1``'s newest composite to ``target`` if it is due."""
        with self._guard:
            step, there = self._newest[target - 1], self._newest[target]
            if not self._due(target, step, there, final):
                return
            self._reading[target] = step  # the nodes' retention spares it from now (``may_read``)
        # Runs of its own, fresh for each promotion: no manifest cached from another promotion
        # (a step saved again after a restore is another snapshot), none shared with training.
        source = Run(self._levels[target - 1].run.storage)
        level = replace(self._levels[target], run=Run(self._levels[target].run.storage))
        start = time.perf_counter()
        try:
            done = self._with_retries(target, source, level, step, there)
        finally:
            with self._guard:
                self._reading[target] = None
        if done is None:
            return
        step, copied, size, superseded, confirmed = done
        with self._guard:
            self._note(target, step)
            self._guard.notify_all()
            self.done.append(Promotion(level.name, step, copied, size, time.perf_counter() - start, superseded))
        if level.keep is not None and not confirmed:  # as a save's: its retention waits (for close, at least)
            self._levels[target].held_back = True
        elif level.keep is not None:  # on the tier itself, not the copy: Tiers.close reads it
            self._levels[target].held_back = retain_after_commit(level.run, level.keep, level.run.where(step))

    def _with_retries(self, target: int, source: Run, level: Level, step: int,
                      there: int | None) -> tuple[int, list[int], int, dict[int, str], bool] | None:
        """``promote`` the composite of ``step``, retried (module docstring): the step promoted,
        the snapshots copied and their bytes, what it superseded, and whether every name it
        committed was confirmed durable; None when nothing was promoted (a failure is kept for
        ``take_failure``). A promotion that committed a snapshot whose name was not confirmed
        durable (``PromotedUnconfirmed``) is not retried: its message is kept as its failure,
        and the composite counts as promoted where its own snapshot was committed."""
        wait, failed = RETRY_WAIT, []  # failed: this promotion's failed tries, (step, why)
        while True:
            try:
                together = self.crew is not None and self._levels[target - 1].node_local
                copied, size = (self.crew.promote if together else promote)(source, level, step, there)
                return step, copied, size, {s: why for s, why in failed if s != step}, True
            except PromotedUnconfirmed as unconfirmed:
                self._fail(str(unconfirmed))
                superseded = {s: why for s, why in failed if s != step}
                return (step, unconfirmed.copied, unconfirmed.bytes, superseded, False) if unconfirmed.whole else None
            except SnapshotNotFoundError as gone:
                if not failed:
                    return None  # the source moved on before the promotion began: its newer composite comes next
                newer = self._successor(target, step, failed, gone)
                if newer is None:
                    return None
                step = newer  # the one that failed left the source meanwhile: its successor, at once
            except (TailorError, OSError) as err:
                if level.lock.closed:  # its writer closed meanwhile (a close() interrupted twice): no retry
                    log.warning("llmtailor: promoting step %d to %s stopped, its writer closed: %s", step, level.name, err)
                    return None
                failed.append((step, str(err) if isinstance(err, TailorError) else describe_os_error(err)))
                if len(failed) == ATTEMPTS:
                    self._fail(f"promoting step {step} from {source.root} to {level.name} failed {ATTEMPTS} times "
                               f"({_tries(failed)}); both tiers are intact, and step {step} stays in {source.root}")
                    return None
                _pause_before_retry(wait)
                wait *= 2

    def _successor(self, target: int, step: int, failed: list[tuple[int, str]], gone: Exception) -> int | None:
        """The composite to promote in place of ``step``, whose promotion failed and which then
        left the faster tier (its retention moved on): that tier's newest, said in the log; None
        (the failure kept for ``take_failure``) when there is no newer one."""
        source, name = self._levels[target - 1].run.root, self._levels[target].name
        with self._guard:
            newer = self._newest[target - 1]
            if newer is not None and newer > step:
                self._reading[target] = newer
        if newer is None or newer <= step:
            self._fail(f"promoting step {step} from {source} to {name} failed ({_tries(failed)}), and step {step} "
                       f"then left {source} ({gone}); it is not promoted, and {name} is intact")
            return None
        log.warning("llmtailor: promoting step %d from %s to %s failed (%s); %s removed it before it was tried again "
                    "(its retention), so step %d, its newest composite, is promoted in its place",
                    step, source, name, failed[-1][1], source, newer)
        return newer

    def _fail(self, message: str) -> None:
        log.warning("llmtailor: %s", message)
        with self._guard:
            self._failures.append(message)
            self._guard.notify_all()


def _tries(failed: list[tuple[int, str]]) -> str:
    """What each failed try met, the step named where the tries were of more than one."""
    if len({step for step, _ in failed}) == 1:
        return "; ".join(dict.fromkeys(why for _, why in failed))
    return "; ".join(f"step {step}: {why}" for step, why in dict.fromkeys(failed))


def _pause_before_retry(seconds: float) -> None:
    """The wait before a failed promotion is tried again (its own function: a test holds it to
    act while a promotion waits)."""
    time.sleep(seconds)


__all__ = ["ATTEMPTS", "PromotedUnconfirmed", "Promoter", "Promotion", "clear_stray_carriers", "promote", "stray_carriers"]
