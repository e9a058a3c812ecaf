"""How a run on an object store commits a snapshot, with no rename: its files go straight to
their final keys under ``snapshots/step-N/``; the manifest, written last and only if absent (a
conditional write), is the commit marker (``Catalog.steps`` lists only snapshots whose
manifest exists). A crash before the manifest leaves objects no reader trusts; the next writer
(holding the lock) or ``gc`` removes them, and aborts unfinished multipart uploads under the run
(S3: through boto3, obstore has no call to list them). Retention deletes a snapshot's manifest
first (it stops being a snapshot at once), then the rest.

A manifest PUT whose client gave up (a crash, a store unreachable through the writer's close)
may still be on its way, or queued at the server, and be stored later. So before the next writer
removes a snapshot without manifest, it claims the manifest's key with a tombstone (``tombstone``,
a few bytes of its own, written only if absent): the late PUT, conditional too, is then refused,
and never makes a snapshot whose files are gone. A tombstone is no commit marker (``is_committed``);
it stays until a save of that step replaces it (a conditional write over that very object). Where
such a save left files beside the tombstone, its PUT (conditional on that tombstone) may be on its
way too: the next writer replaces the tombstone with a new one, only over it, before it removes
them. A tombstone's bytes are its own: an empty one's version (S3's ETag, the MD5 of no bytes)
was every empty tombstone's, so a PUT over one landed over any later one.

Neither gc nor retention removes a tombstone (``TOMBSTONES``): a manifest write still on its way
is refused only while an object holds its key, and nothing bounds when one may land.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable

from llmtailor.constants import MANIFEST_FILE, SNAPSHOTS_DIR, TMP_DIR, TRASH_DIR, parse_snapshot_name
from llmtailor.errors import StorageError, TailorError
from llmtailor.store.storage.local_durable import waited_on_for_work
from llmtailor.store.storage.object_lock import ObjectLocks, is_committed
from llmtailor.store.storage.object_options import env_endpoint
from llmtailor.store.storage.object_store import ObjectStore, Version
from llmtailor.store.storage.strategies import Leftovers, SnapshotCommits, Unconfirmed

log = logging.getLogger(__name__)


def tombstone() -> bytes:
    """What a manifest key holds where the next writer cleared a snapshot without manifest (module
    docstring): bytes of its own (``object_lock.TOMBSTONE_BYTES``), so that its version (an S3 ETag: the bytes'
    MD5) is this write's alone, and a PUT conditional on a tombstone replaced since is refused."""
    return uuid.uuid4().bytes


TOMBSTONES = ("a tombstone each (a manifest of a few bytes of its own: no snapshot), claimed by a writer before it "
              "removed the files of a snapshot left without manifest, so that a manifest write still on its way (its writer closed "
              "with the store unreachable) is refused; kept for good: a write a client gave up on may still be "
              "stored at any later time (queued at the server, or behind a proxy, and the client cannot take it "
              "back), and without the tombstone it would commit a snapshot whose files are gone. A save of that "
              "step replaces it. An llmtailor from before tombstones (2026-11-28) reads one as a damaged manifest")
"""What ``inspect`` and ``verify`` say of a run's tombstones (after the steps: ``tombstones_note``)."""


def tombstones_note(steps: list[int]) -> str:
    """The line ``inspect`` and ``verify`` print for the tombstones at ``steps``."""
    return f"step(s) {', '.join(map(str, steps))}: {TOMBSTONES}"


class ObjectCommits(SnapshotCommits):
    """The snapshot commit of a run on an object store (module docstring); ``locks``: its
    reader leases (a discarded snapshot's removal lease keeps its mark)."""

    def __init__(self, storage: ObjectStore, locks: ObjectLocks):
        self.storage, self.locks = storage, locks
        self._over: dict[str, Version] = {}
        """Snapshot -> the tombstone at its manifest's key (``tombstone``) a save there replaces."""
        self._unsettled: dict[str, bytes] = {}
        """Snapshot -> the manifest whose write this process could not settle (``_written_after_all``):
        its files stay, and no save writes there again before it is settled (``begin``)."""

    def begin(self, name: str, final: str, world_size: int) -> str:
        key = f"{final}/{MANIFEST_FILE}"
        size = self.storage.size(key)
        if is_committed(size):
            raise TailorError(f"{self.storage.where(final)} already exists; refusing to overwrite a committed snapshot")
        if final in self._unsettled:
            self._settle(final)
        self._over.pop(final, None)
        if size is not None:  # a tombstone: the manifest replaces that very object (``_write``)
            self._over[final] = self.storage.version_if(key, _is_tombstone)
        return final  # the files go to their final keys; the manifest commits them

    def settle(self) -> None:
        """Each manifest whose write is unsettled (``_written_after_all``) written once more, only
        if absent: answered, its snapshot is committed, whole (its files were kept), and a late
        write is refused; unanswered, logged (the next writer may remove its files, and a write
        still on its way may then store it alone)."""
        for final in list(self._unsettled):
            try:
                self._write_again(final)
            except TailorError as err:
                log.warning("llmtailor: %s: the write of its manifest may still be stored, and writing it once more "
                            "failed (%s): the next writer may remove its files", self.storage.where(final), err)
                continue
            log.info("llmtailor: %s: the manifest whose write was unsettled is stored now: that snapshot is committed",
                     self.storage.where(final))

    def _settle(self, final: str) -> None:
        """A new commit at ``final``, whose manifest's earlier write is unsettled: a write still
        on its way may store it over the new files. The same manifest is written once more, only
        if absent (its files are the ones kept): answered, the snapshot is committed as that
        earlier save made it (a TailorError refuses the new one, as for any committed snapshot;
        a promotion finds it there and goes on); unanswered, the new commit is refused, saying
        why."""
        where = self.storage.where(final)
        try:
            self._write_again(final)
        except TailorError as err:
            raise TailorError(f"{where}: the write of its manifest by an earlier save of this writer may still be "
                              f"stored, and writing it once more failed ({err}); its files are kept for it, and "
                              "saving this step again would rewrite them under that manifest: save a later step") from None
        raise TailorError(f"{where}: the manifest an earlier save of this writer could not settle is stored now: that "
                          "snapshot is committed, whole; refusing to overwrite it")

    def _write_again(self, final: str) -> None:
        """The unsettled manifest of ``final`` written once more, only if absent: settled when
        this returns (stored now, or found there); a TailorError when it is not answered."""
        if self.storage.put_if(f"{final}/{MANIFEST_FILE}", self._unsettled[final], self._over.get(final)) is None:
            raise TailorError("another manifest is there")
        del self._unsettled[final]

    def commit(self, staging: str, final: str, manifest: bytes, pointer: tuple[str, bytes] | None = None,
               pending: Callable[[], None] | None = None, parent: int | None = None,
               publish: Callable[[], None] | None = None) -> Unconfirmed | None:
        """The manifest, written last (once every upload in flight has completed, and the writer's
        lease confirmed after them: ``ObjectLocks.confirm_writer``) and only if absent, is the
        commit; then the pointer (its lease confirmed again). A write that failed is looked at
        once more (``_written_after_all``): its answer may be lost after the server stored it."""
        if pending is not None:
            pending()
        with waited_on_for_work():  # a renewal of the lease where its thread fell behind
            self.locks.confirm_writer()  # the files stored before any successor could take the run over (object_lock)
        if publish is not None:
            publish()
        key = f"{staging}/{MANIFEST_FILE}"
        with waited_on_for_work():  # its client's retries (2 minutes by default) and the read-back: a wait on the store
            try:
                self._write(staging, key, manifest)
            except TailorError as err:
                self._written_after_all(key, manifest, err)
        if pointer is not None:
            try:
                with waited_on_for_work():
                    self.locks.confirm_writer()  # a successor's `latest` is never replaced by this writer's
                    self.storage.replace(*pointer)
            except OSError as err:
                return Unconfirmed(pointer=err)
            except TailorError as err:  # the lease lost since the manifest's write: `latest` is the successor's
                return Unconfirmed(pointer=StorageError(str(err)))
        return None

    def _write(self, final: str, key: str, manifest: bytes) -> None:
        """The manifest's write, only if absent, or only over the tombstone ``begin`` found."""
        over = self._over.get(final)
        if over is None:
            self.storage.put(key, manifest, exclusive=True)
        elif self.storage.put_if(key, manifest, over) is None:
            raise TailorError(f"{self.storage.where(key)}: the tombstone there changed")

    def _written_after_all(self, key: str, manifest: bytes, failed: TailorError) -> None:
        """Return when the manifest's write that failed (``failed``: its answer lost, or "already
        exists" where its retry met it, and the read-back ``put_if`` made then failed too) is
        found stored after all, with these bytes: the snapshot is committed (the writer lock is
        held, and ``begin`` found no manifest). A manifest not found may still be on its way: a
        request the client gave up on can reach the server, or wait there, and be stored later.
        So it is written once more, only if absent, which settles it when answered: stored now,
        or found stored with these bytes, the snapshot is committed (a late write is refused);
        another manifest found there, it is not. Unanswered or unreadable, the outcome is
        unknown: a TailorError says so, the snapshot's files are kept (``abandon``: a manifest
        that lands later finds its snapshot whole) and a save of that step again settles it
        first (``begin``); the writer goes on from the composite before (sound whichever it was;
        the next writer's ``clear_leftovers`` removes the files if no manifest came)."""
        if self.storage.holds(key, manifest):
            return
        try:
            if self.storage.put_if(key, manifest, self._over.get(key.rsplit("/", 1)[0])) is not None:
                return  # stored by this write, or found stored with these bytes
            holds = self.storage.holds(key, manifest)  # refused: a manifest is there
        except TailorError as again:
            holds, why = None, f"and so did a second ({again})"
        else:
            why = "and it could not be read back"
        if holds:
            return
        if holds is False:  # another manifest is there: this one is never stored
            raise failed
        final = key.rsplit("/", 1)[0]
        self._unsettled[final] = manifest
        step = parse_snapshot_name(final.split("/")[-1])
        raise TailorError(f"{self.storage.where(key)}: the write of the manifest failed ({failed}) {why}: the storage "
                          f"may have stored it, so step {step} may be committed or not, now or once a write still on "
                          "its way is stored (a restore takes it if it is; its files are kept for it); this writer goes "
                          "on from the composite before it") from None

    def abandon(self, staging: str) -> None:
        if staging in self._unsettled:
            return  # its manifest may still be stored: its files stay (``_written_after_all``)
        key = f"{staging}/{MANIFEST_FILE}"
        try:
            size = self.storage.size(key)
            if is_committed(size):
                return  # committed after all (an answer lost after the write): never remove it
            with waited_on_for_work():  # a LIST and a DELETE per 1000 objects, each through its retries
                self.locks.confirm_writer()  # lost: its successor may be writing this step; it clears what is left
                self.storage.remove_tree(staging, keep=key if size is not None else None)  # a tombstone stays
        except TailorError:
            pass  # left for the next writer or gc: no reader trusts a snapshot without manifest

    def discard(self, snapshot: str) -> str:
        # The manifest goes first: from then on the snapshot is not one, at once.
        with waited_on_for_work():
            self.locks.confirm_writer()  # a writer that lost the run removes nothing of it
            self.storage.remove(f"{snapshot}/{MANIFEST_FILE}")
        self.locks.discarding.discard(snapshot)
        return snapshot

    def purge(self, token: str) -> None:
        with waited_on_for_work():
            self.locks.confirm_writer()
            self.storage.remove_tree(token)

    def clear_leftovers(self) -> Leftovers:
        """Snapshots without a manifest (a crashed save, a removal cut short, a save whose
        manifest's write was unsettled), temporary objects, and unfinished multipart uploads
        under the run: the caller holds the lock, so none of them belongs to a live writer. Each
        such snapshot's manifest key is claimed first with a tombstone, only if absent (module
        docstring): a manifest stored meanwhile keeps its snapshot, and one still on its way is
        refused once its files are gone."""
        storage, objects = self.storage, 0
        for name in storage.list_dir(SNAPSHOTS_DIR):
            snapshot = f"{SNAPSHOTS_DIR}/{name}"
            key = f"{snapshot}/{MANIFEST_FILE}"
            size = storage.size(key)
            if is_committed(size) or not self._claimed(snapshot, key, size):
                continue  # committed (a manifest stored just now: the tombstone refused)
            objects += storage.remove_tree(snapshot, keep=key)
        for leftover in (TMP_DIR, TRASH_DIR):
            objects += storage.remove_tree(leftover)
        return Leftovers(files=objects, uploads=abort_multipart_uploads(storage), noun="object")

    def _claimed(self, snapshot: str, key: str, size: int | None) -> bool:
        """``key`` (the manifest's of ``snapshot``, none there) claimed with a new tombstone: only
        if absent, or, where a tombstone is there and other objects beside it (a save over that
        tombstone, whose manifest PUT, conditional on it, may still be on its way), only over
        that very tombstone, so that PUT is refused. A tombstone alone is claimed already: a PUT
        conditional on it comes only from a save over it, whose files come first. Not an empty
        one (an llmtailor's from before 2026-11-28): its version was every empty tombstone's, so a
        PUT over another one, whose files that llmtailor removed, matches it too; it is replaced
        once. False where a manifest got there first."""
        if size is None:
            return self.storage.put_if(key, tombstone(), None) is not None
        if size and all(found == key for found, _ in self.storage.walk(snapshot)):
            return True  # a tombstone of its own bytes alone: no save over it
        found = self.storage.version_if(key, _is_tombstone)
        return found is not None and self.storage.put_if(key, tombstone(), found) is not None


def _is_tombstone(data: bytes) -> bool:
    return not is_committed(len(data))


def abort_multipart_uploads(storage: ObjectStore) -> int:
    """Abort the unfinished multipart uploads under the run (S3; a crashed writer's). Uses
    boto3 when it is installed (obstore cannot list uploads); returns how many were aborted."""
    if storage.scheme != "s3":
        return 0  # GCS and Azure discard uncommitted uploads (blocks) on their own
    try:
        import boto3
    except ImportError:
        return 0
    options = storage.options
    endpoint = options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or env_endpoint()
    client = boto3.client(
        "s3", endpoint_url=endpoint,
        aws_access_key_id=options.get("access_key_id"), aws_secret_access_key=options.get("secret_access_key"),
        aws_session_token=options.get("session_token"),
        region_name=options.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
    )
    prefix = f"{storage.prefix.rstrip('/')}/" if storage.prefix else ""
    aborted = 0
    try:
        listed = client.list_multipart_uploads(Bucket=storage.bucket, Prefix=prefix)
        for upload in listed.get("Uploads", []):
            client.abort_multipart_upload(Bucket=storage.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
    except Exception as err:  # cleaning up is best effort: the uploads are invisible to readers
        log.warning("llmtailor: could not abort unfinished uploads under %s: %s", storage.url, err)
    return aborted
