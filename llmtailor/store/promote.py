"""Promotion: copying a committed composite from one tier to the next slower one.

``promote`` copies the composite of a step from tier A to tier B so that it is complete in B:
every snapshot it needs that B lacks is copied, oldest first, each file streamed from A and
checked against its checksum on the way (a damaged source is never promoted), each snapshot
committed in B with B's own protocol (files, then the manifest only if absent, then the
commit; ``Storage.begin_snapshot``), then B's ``latest``. A copied manifest is A's but for its
``parent``: the composite's names the composite promoted to B before it on the same lineage
(B's lineage is the promoted composites, so B's retention counts them); a snapshot copied only for what the composite needs
(a carrier) names none, and a ``carried_for`` note says so (``verify`` does not miss its own
composite there). A crash or failure at any point leaves B as it was plus, at most, whole older snapshots
(never read as the newest: ``latest`` and the parent links do not lead to them).

``Promoter`` runs promotions in the background, one at a time, down every tier: after each
commit to the first tier it wakes, and for each pair of tiers promotes the newest composite of
the faster one when it is at least ``promote_every`` steps after the slower one's newest (so a
lagging promoter skips composites, never queues them). A failed promotion is retried, then kept
and reported once by ``take_failure`` (the writer's next save, wait or close); neither tier is
damaged by it. Training never waits for a promotion but at ``finish`` (``close``), which
promotes the last composite to every tier.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import xxhash

from llmtailor.constants import CARRIED_FOR, MANIFEST_FILE, snapshot_dirname
from llmtailor.errors import IntegrityError, SnapshotNotFoundError, TailorError
from llmtailor.store.manifest import FileEntry, Manifest
from llmtailor.store.retention import retain_after_commit
from llmtailor.store.run import Run
from llmtailor.store.storage import Sink, Storage
from llmtailor.store.writer import replace_latest

if TYPE_CHECKING:
    from llmtailor.store.tiers import Level

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Tries of one promotion before its failure is reported."""
RETRY_WAIT = 1.0
"""Seconds before the second try; doubled before each next one."""


def promote(source: Run, target: Level, step: int, parent: int | None = None) -> tuple[list[int], int]:
    """Copy the composite of ``step`` from ``source`` into the tier ``target`` (module
    docstring), its ``parent`` link naming ``parent`` when that is a snapshot of ``target``
    older than ``step`` (the composite promoted there before on this lineage); returns the
    snapshots copied and their bytes. The caller holds ``target``'s writer lock (each
    commit confirms it). SnapshotNotFoundError when ``source`` no longer holds the composite
    (its retention moved on to a newer one)."""
    dst = target.run
    copied, size = [], 0
    with source.reading(step) as composite:  # leased: the source's retention leaves it in place
        target.lock.claim()
        held = set(dst.steps())
        for needed in sorted(source.needs(composite)):
            if needed in held:
                _check_same(source, dst, needed)
                continue
            _copy_snapshot(source, target, needed, step, parent if parent in held and parent < step else None)
            copied.append(needed)
            size += source.manifest(needed).total_bytes()
    failure = replace_latest(dst, step)
    if failure is not None:
        log.warning("llmtailor promotion: %s", failure)
    return copied, size


def _check_same(source: Run, dst: Run, step: int) -> None:
    """The snapshot of ``step`` that ``dst`` holds is the one ``source`` holds (a promotion
    repeated); not one of another lineage that reused the step."""
    def essence(manifest: Manifest) -> Manifest:
        notes = {k: v for k, v in manifest.notes.items() if k != CARRIED_FOR}
        return manifest.model_copy(update={"parent": None, "notes": notes})

    if essence(source.manifest(step)) != essence(dst.manifest(step)):
        raise TailorError(f"{dst.where(step)} is another snapshot of step {step} than {source.where(step)} "
                          "(written by another lineage); it is not replaced")


def _copy_snapshot(source: Run, target: Level, step: int, composite: int, parent: int | None) -> None:
    """Copy the snapshot of ``step``, which the composite of ``composite`` needs (``parent``: the
    link the composite's copy gets)."""
    dst = target.run
    storage = dst.storage
    manifest = source.manifest(step)
    if step == composite:
        manifest = manifest.model_copy(update={"parent": parent})
    else:
        manifest = manifest.model_copy(update={"parent": None, "notes": {**manifest.notes, CARRIED_FOR: composite}})
    final = dst.snapshot_key(step)
    staging = storage.begin_snapshot(snapshot_dirname(step), final, 1)
    try:
        with storage.batch() as batch:
            for entry in source.stored_files(step):
                _copy_file(source.storage, f"{source.snapshot_key(step)}/{entry.path}",
                           batch.create(storage.staging_key(staging, entry.path)), entry)
        target.lock.check_held()
        storage.put(storage.staging_key(staging, MANIFEST_FILE), manifest.dumps().encode(), exclusive=True)
        storage.commit_snapshot(staging, final)
    except BaseException:
        storage.abandon_snapshot(staging)
        raise


def _copy_file(source: Storage, key: str, sink: Sink, entry: FileEntry) -> None:
    """Stream ``key`` into ``sink``, checked against ``entry`` before the sink is closed."""
    hasher, seen = xxhash.xxh3_64(), 0
    try:
        for piece in source.pieces(key):
            hasher.update(piece)
            sink.write(piece)
            seen += len(piece)
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


class Promoter:
    """Background promotion down a run's tiers (module docstring). ``newest`` is the newest
    composite each tier holds, as this writer knows it (the first tier's is set by
    ``committed``)."""

    def __init__(self, levels: list[Level], newest: list[int | None]):
        self._levels = levels
        self._newest = list(newest)
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wanted = False
        self._final = False
        self._failures: list[str] = []
        self.done: list[Promotion] = []
        """Every promotion done, in order."""

    def committed(self, step: int) -> None:
        """The first tier committed ``step``: promote what is due, in the background."""
        with self._guard:
            self._newest[0] = step
            self._wake()

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
        while True:
            with self._guard:
                if not self._wanted:
                    self._thread = None
                    self._final = False
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
        every = self._levels[target - 1].promote_every or 1
        if step is None or (there is not None and (step <= there or (not final and step - there < every))):
            return
        # Runs of its own, fresh for each promotion: no manifest cached from another promotion
        # (a step saved again after a restore is another snapshot), none shared with training.
        source = Run(self._levels[target - 1].run.storage)
        level = replace(self._levels[target], run=Run(self._levels[target].run.storage))
        wait, start = RETRY_WAIT, time.perf_counter()
        for attempt in range(1, ATTEMPTS + 1):
            try:
                copied, size = promote(source, level, step, there)
                break
            except SnapshotNotFoundError:
                return  # the source moved on: its newer composite comes with the next commit
            except (TailorError, OSError) as err:
                if attempt == ATTEMPTS:
                    self._fail(f"promoting step {step} from {source.root} to {level.name} failed {ATTEMPTS} times "
                               f"({err}); both tiers are intact, and step {step} stays in {source.root}")
                    return
                time.sleep(wait)
                wait *= 2
        done = Promotion(level.name, step, copied, size, time.perf_counter() - start)
        with self._guard:
            self._newest[target] = step
            self.done.append(done)
        if level.keep is not None:
            retain_after_commit(level.run, level.keep, level.run.where(step))

    def _fail(self, message: str) -> None:
        log.warning("llmtailor: %s", message)
        with self._guard:
            self._failures.append(message)


__all__ = ["ATTEMPTS", "Promoter", "Promotion", "promote"]
