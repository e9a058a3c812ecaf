"""One snapshot's commit into a run, the same for a save (``writer.persist``, its ranks' files)
and a promotion (``tiers.promote``, a copy from a faster tier): ``begin`` (the storage's staging
place: a private directory under ``.tmp/`` locally, the final prefix on an object store), write
the files there (``files``), then ``commit``: confirm that the writer lock is still held, and
the storage's commit writes the manifest last and only if absent (on an object store that write
is the commit; locally the manifest and the staged directories are fsynced together, then the
directory renamed into ``snapshots/`` atomically, its parent fsynced). Any failure from the
first file written to the commit abandons what was staged (``abandoned_on_failure``): every
earlier snapshot stays as it was. Then ``replace_latest`` points the run at the new composite
(or ``commit(..., latest=True)`` does, its new file made durable with the manifest).

Once the snapshot is visible (renamed in; its manifest written), the save is committed: what
fails after (``latest`` not replaced, the fsync of ``snapshots/`` or of the run's directory) is
not a failed save. ``commit`` returns it as one message saying what is and what may not be
durable (``describe_unconfirmed``); the writer counts the save committed and raises that message
once its bookkeeping says so (``Tailor``: its lineage extends the snapshot, which a restore finds;
retention and promotions wait for the next save, and while the snapshot's name is doubtful its
retention keeps a composite that does not need it: ``SnapshotCommits.doubtful``). So does a commit without ``latest``: a
promotion counts the snapshot as in the slower tier, leaves that tier's ``latest`` and retention
as they are and reports the message as its failure, never retried (``tiers.promote``); a healing
counts its snapshot as in the node's copy and logs it (``tiers.healing``). Undoing the rename
instead is not sound: a reader may hold the snapshot already, and the undo would have to be made
durable through the directory whose fsync just failed.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from llmtailor.constants import LATEST_FILE, SNAPSHOTS_DIR, snapshot_dirname
from llmtailor.distributed.progress import advance, carried, waiting
from llmtailor.errors import TailorError
from llmtailor.store.run import Run
from llmtailor.store.storage import Batch, Sink, Unconfirmed
from llmtailor.store.storage.local_durable import report_progress

report_progress(advance, carried, waiting)  # each fsync of a commit's files shows its rank live to the ranks waiting for it


class SnapshotCommit:
    """The commit of the snapshot of ``step`` into ``run``, staged at ``staging`` (module
    docstring). Every rank of a save builds one from the staging place its leader began."""

    def __init__(self, run: Run, step: int, staging: str):
        self.run, self.step, self.staging = run, step, staging
        self.final = run.snapshot_key(step)

    @classmethod
    def begin(cls, run: Run, step: int, world_size: int = 1) -> SnapshotCommit:
        """Open the staging place of the snapshot of ``step``, for ``world_size`` ranks to write
        into; TailorError when that snapshot is committed already."""
        final = run.snapshot_key(step)
        return cls(run, step, run.storage.commits.begin(snapshot_dirname(step), final, world_size))

    def key(self, relpath: str) -> str:
        """The key the snapshot's file ``relpath`` has while it is staged."""
        return self.run.storage.commits.key(self.staging, relpath)

    @contextmanager
    def files(self) -> Iterator[StagedFiles]:
        """A batch of the snapshot's files: yields ``create(relpath)``, a sink for each; every
        file closed in the block is durable when the block ends, or at ``create.drain()``
        (``Storage.batch``)."""
        with self.run.storage.batch() as batch:
            yield StagedFiles(self, batch)

    def commit(self, manifest: bytes, confirm: Callable[[], None] | None = None, latest: bool = False,
               pending: StagedFiles | None = None, parent: int | None = None, what: str = "saved",
               publish: Callable[[], None] | None = None) -> str | None:
        """``confirm()`` (that the writer lock is still held: raises if not), then the storage's
        commit: the manifest, last and only if absent, and the snapshot committed
        (``SnapshotCommits.commit``). Staged files must be durable, or in ``pending`` (a batch
        still in flight: drained before anything is committed; locally, while the manifest and
        the directories are fsynced). ``latest``: and the run's ``latest`` pointed at it once it
        is committed (as ``replace_latest``; locally the pointer's new file is made durable with
        the manifest); returns what failed once the snapshot was committed, as one message
        (module docstring), or None; so too without ``latest`` (a promotion, a healing: ``what``
        the message calls the commit). A failure raised means nothing was committed. ``parent``: the step of the snapshot's
        parent (``SnapshotCommits.commit``: passed on while this process commits no other
        snapshot of the run in the background). ``publish``: called just before the snapshot is
        published, everything else durable (``SnapshotCommits.commit``)."""
        if confirm is not None:
            confirm()
        pointer = (LATEST_FILE, _pointing_at(self.step)) if latest else None
        alone = parent is not None and not self.run.committing_in_background()
        failed = self.run.storage.commits.commit(self.staging, self.final, manifest, pointer,
                                                 pending.drain if pending is not None else None, parent if alone else None,
                                                 publish)
        return None if failed is None else describe_unconfirmed(self.run, self.step, failed, what)

    def abandon(self) -> None:
        """Remove what was staged (never a committed snapshot)."""
        self.run.storage.commits.abandon(self.staging)

    @contextmanager
    def abandoned_on_failure(self) -> Iterator[None]:
        """``abandon`` if the block raises (and re-raise)."""
        try:
            yield
        except BaseException:
            self.abandon()
            raise


class StagedFiles:
    """``create(relpath)``: a sink for the staged snapshot's file ``relpath``, made durable
    with the others of its batch (``SnapshotCommit.files``); ``drain()`` returns once every
    file closed so far is durable."""

    def __init__(self, snapshot: SnapshotCommit, batch: Batch):
        self.snapshot, self.batch = snapshot, batch

    def __call__(self, relpath: str) -> Sink:
        # A writer paused past its object-store lease (its successor may be saving this very
        # step, under the same names) writes no file more once it goes on (object_lock: Fenced).
        self.snapshot.run.storage.locks.confirm_writer()
        return self.batch.create(self.snapshot.key(relpath))

    def drain(self) -> None:
        self.batch.drain()


def replace_latest(run: Run, step: int) -> str | None:
    """Point the run's ``latest`` at the snapshot of ``step``; a failure is returned as a
    message (the snapshot stays committed and found through its parent link), not raised."""
    try:
        run.storage.replace(LATEST_FILE, _pointing_at(step))
    except OSError as err:
        return _pointer_failure(run, step, err)
    return None


def _pointing_at(step: int) -> bytes:
    return (snapshot_dirname(step) + "\n").encode()


def _pointer_failure(run: Run, step: int, err: OSError) -> str:
    # The snapshot is committed and loadable: its manifest names its parent, which the old
    # pointer names, so Run.latest_step() finds it. Report, do not undo.
    return (
        f"step {step} was saved and committed in {run.root}, but its {LATEST_FILE} pointer "
        f"could not be updated ({_reason(err)}); restore still finds step {step} through its parent link"
    )


def describe_unconfirmed(run: Run, step: int, failed: Unconfirmed, what: str = "saved") -> str:
    """What a commit of ``step`` could not do or confirm once the snapshot was visible
    (``Unconfirmed``), as one message (``what``: how the snapshot came there, "saved", "promoted",
    "healed"): the snapshot committed, what may not be durable, and
    what a restore finds now (the run looked at again: the snapshot itself, through its parent
    link where ``latest`` was not replaced; or, a save that branched off an older composite,
    another that stays the run's newest until ``latest`` names this one)."""
    said = []
    if failed.durable is not None:
        said.append(f"its name in {SNAPSHOTS_DIR}/ could not be made durable ({_reason(failed.durable)}): a crash of the "
                    "machine before the storage writes it out may lose the snapshot and bring back the composite before "
                    "it, whole")
    if failed.pointer is failed.durable and failed.pointer is not None:
        said.append(f"its {LATEST_FILE} pointer was left as it was (it names a snapshot only once that is durable)")
    elif failed.pointer is not None:
        said.append(f"its {LATEST_FILE} pointer could not be updated ({_reason(failed.pointer)})")
    if failed.pointer_durable is not None:
        said.append(f"{LATEST_FILE} names it, but that could not be made durable ({_reason(failed.pointer_durable)}): a "
                    f"crash of the machine may bring back the {LATEST_FILE} before it")
    return f"step {step} was {what} and committed in {run.root}, but {'; '.join(said)}; {_found(run, step, failed)}"


def _found(run: Run, step: int, failed: Unconfirmed) -> str:
    """What a restore of ``run``'s newest composite takes now, the commit of ``step`` visible."""
    try:
        newest = run.latest_step()
    except (TailorError, OSError) as err:
        return f"the run could not be read again to say what a restore finds now ({err})"
    if newest == step:
        link = " through its parent link" if failed.pointer is not None else ""
        return f"the snapshot is readable and whole, and a restore finds step {step} now{link}"
    return (f"the snapshot is readable and whole (restore({step}) loads it), and a restore of the newest composite "
            f"finds step {newest} now")


def _reason(err: OSError) -> str:
    return "no space left on the device" if err.errno in (errno.ENOSPC, errno.EDQUOT) else (err.strerror or str(err))
