"""The locks of a run on an object store, made of conditional writes (``ObjectStore.put_if``).

- **One writer.** ``.lock`` is a lease object written only if absent, naming its holder; the
  holder rewrites it (conditionally on its own version: ETag, or GCS's generation) every
  ``lock_ttl / 3`` seconds. A contender that finds it watches its version: one that changes is
  a live writer (refused, naming it); one unchanged for ``lock_ttl`` seconds is a dead
  writer's, taken over conditionally (so two contenders cannot both win). A holder on this
  host whose process is gone is taken over at once; one whose process lives is refused at once
  while its lease is renewed, and watched as one elsewhere once its lease went unrenewed past
  its ttl (its pid may name another process by now: pids are reused, and a container restarted
  with the same hostname gives them out alike). "On this host" is the hostname and the pid
  namespace the lease records (``ns``: the kernel's boot id and the namespace's inode): a
  process of another container under the same hostname is watched as one elsewhere, never
  judged by a pid that means another process here. A lease naming this very process (its pid)
  is told by what this process holds (``_HOLDING``), never by its pid, which is alive: held by
  none of its writers, it was a predecessor's that died and whose pid this process now has
  (a container's first process: the same low pid each time), taken over at once where the
  lease records this namespace, watched where it records none.
- **Fenced.** A writer that lost its lease refuses to commit, and removes nothing. Its renewal
  thread may not have noticed yet (the whole process was paused past its ttl: SIGSTOP, a long
  GC, a suspended VM), so the commit asks the lease itself (``ObjectLocks.confirm_writer``),
  once the snapshot's files are all stored and right before its manifest's write: a lease last
  renewed (the request sent) less than ``CONFIRMED_WITHIN`` of its ttl ago is held still, since
  a contender takes it over only after watching that renewal's version unchanged for a whole
  ttl; an older one is renewed there and then, conditionally on its own version, so a
  contender's takeover and this renewal cannot both succeed. Confirmed, the files were stored
  before any takeover: the next writer's ``clear_leftovers`` finds them and claims the
  manifest's key with a tombstone, so the manifest's write (only if absent, or only over the
  tombstone this writer found), whenever it lands, is refused once a successor took over, and
  a snapshot is never committed with a successor's files, nor over its branch. What is left
  open: what a writer sends after its confirmation and does not condition on a version, if it
  is paused past its lease in between (``latest``'s replacement, a retention's or an abandoned
  save's DELETEs) (docs/failures.md).
- **Reader leases.** A reader writes ``snapshots/step-N/.readers/<id>`` (with an expiry), then
  checks that the snapshot is committed and not marked ``.removing`` (both asked at once: a GET
  of the manifest, kept for the reader as ``Lease.marker``, and a HEAD of the mark); retention writes
  ``.removing``, then looks for unexpired reader leases and backs off if it finds one. Each side
  writes before it reads the other's mark, so at least one of them sees the other. A reader whose
  lease the server refuses for want of rights (read-only credentials: ``errno.EACCES``, as
  ``object_errors.failure`` says, never told by the error's text) reads without one, as a
  reader of a read-only local run does; any other failure fails the read.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import weakref

from llmtailor.constants import LOCK_FILE, MANIFEST_FILE
from llmtailor.errors import IntegrityError, StorageError, TailorError
from llmtailor.store.storage.object_options import DEFAULT_LOCK_TTL, load_obstore
from llmtailor.store.storage.object_store import ObjectStore, Version
from llmtailor.store.storage.strategies import CANNOT_CREATE, Lease, RunLocks, WriterLockBackend, this_process

READERS_DIR = ".readers"


REMOVING_MARK = ".removing"


READER_LEASE_SECONDS = 6 * 3600.0
"""How long a reader's lease holds if the reader never releases it (it died)."""

TOMBSTONE_BYTES = 16
"""At most this many bytes at a manifest's key are a tombstone, no manifest (``object_commit``:
each one's bytes its own, so each write of one is another version); a manifest is longer."""


def is_committed(size: int | None) -> bool:
    """Whether a manifest object of ``size`` bytes (None: missing) commits its snapshot: a
    tombstone (``TOMBSTONE_BYTES``; an empty one, as the tombstones written first) does not."""
    return size is not None and size > TOMBSTONE_BYTES


class ObjectLocks(RunLocks):
    """The writer lock and reader leases of a run on an object store (module docstring)."""

    checks_committed = True  # a reader's lease looks for the manifest once written

    def __init__(self, storage: ObjectStore):
        self.storage = storage
        self.discarding: set[str] = set()
        """Snapshots retention holds the removal lease of and has not discarded yet."""

    def writer(self) -> ObjectWriterLock:
        return ObjectWriterLock(self.storage)

    def lease_for_reading(self, snapshot: str, *, marker: bool = False) -> Lease | None:
        key = f"{snapshot}/{READERS_DIR}/{uuid.uuid4().hex}"
        record = {"holder": this_process(), "expires": time.time() + READER_LEASE_SECONDS}
        try:
            self.storage.put(key, json.dumps(record).encode())
        except StorageError as err:
            if err.errno not in CANNOT_CREATE:  # read-only credentials: read without a lease (as a local read-only run)
                raise
            return _ObjectLease(self.storage, None) if self.storage.is_file(f"{snapshot}/{MANIFEST_FILE}") else None
        lease = _ObjectLease(self.storage, key)
        # Written first, then read: retention writes its mark first, then reads the leases.
        try:
            removing, committed = self.storage.together(lambda: self.storage.is_file(f"{snapshot}/{REMOVING_MARK}"),
                                                        lambda: self._committed(snapshot, marker))
        except BaseException:
            lease.release()
            raise
        if removing or committed is None:
            lease.release()
            return None
        lease.marker = committed if marker else None
        return lease

    def _committed(self, snapshot: str, read: bool) -> bytes | None:
        """The snapshot's manifest (its commit marker; ``read``: its bytes, else b"" once found
        by a HEAD), or None when it has none."""
        key = f"{snapshot}/{MANIFEST_FILE}"
        if not read:
            return b"" if is_committed(self.storage.size(key)) else None
        try:
            raw = bytes(self.storage.read(key))
            return raw if is_committed(len(raw)) else None
        except IntegrityError:  # the object store's read says so of a missing object only
            return None

    def confirm_writer(self) -> None:
        """Raise TailorError unless this process's writer lease of the run, if it holds one, is
        held now (``ObjectWriterLock.confirm``; module docstring: Fenced): a commit asks it once
        its files are stored, right before its manifest's write, and so does a removal. A
        process that holds none (its caller confirmed otherwise) is let be."""
        identity = self.storage.identity()
        for lock in list(_HOLDING):
            if lock.storage.identity() == identity:
                lock.confirm()
                return

    def lease_for_removal(self, snapshot: str) -> Lease | None:
        if not is_committed(self.storage.size(f"{snapshot}/{MANIFEST_FILE}")):
            return None
        mark = f"{snapshot}/{REMOVING_MARK}"
        self.storage.put(mark, this_process().encode())
        now = time.time()
        for key, _ in self.storage.walk(f"{snapshot}/{READERS_DIR}"):
            try:
                expires = json.loads(bytes(self.storage.read(key)))["expires"]
            except (TailorError, ValueError, KeyError, TypeError):
                continue  # gone meanwhile, or not a lease
            if expires > now:
                self.storage.remove(mark)
                return None
            self.storage.remove(key)  # a reader that died: its lease has expired
        self.discarding.add(snapshot)
        return _RemovalLease(self, snapshot)


class _ObjectLease(Lease):
    def __init__(self, storage: ObjectStore, key: str | None):
        self.storage, self.key = storage, key
        self.held = key is not None

    def release(self) -> None:
        if self.key is not None:
            key, self.key = self.key, None
            try:
                self.storage.remove(key)
            except TailorError:
                pass  # it expires on its own


class _RemovalLease(Lease):
    """Retention's claim on a snapshot: its ``.removing`` mark, taken back on release unless
    the snapshot was discarded meanwhile."""

    def __init__(self, locks: ObjectLocks, snapshot: str):
        self.locks, self.snapshot = locks, snapshot

    def release(self) -> None:
        if self.snapshot in self.locks.discarding:
            self.locks.discarding.discard(self.snapshot)
            try:
                self.locks.storage.remove(f"{self.snapshot}/{REMOVING_MARK}")
            except TailorError:
                pass


def _lapsed(holder: dict) -> bool:
    """Whether the writer's lease ``holder`` (its record) went unrenewed for longer than its ttl."""
    return time.time() - float(holder.get("renewed", 0)) > float(holder.get("ttl", DEFAULT_LOCK_TTL))


CONFIRMED_WITHIN = 0.5
"""A writer's lease renewed (the request sent) less than this share of its ttl ago is held still
without asking the store (``ObjectWriterLock.confirm``): the renewal thread renews it every third
of its ttl, so a commit asks only where renewals fell behind (a paused process); the rest of the
ttl is the margin for clocks that run at other rates on the contender's machine."""


def _now() -> tuple[float, float]:
    """A moment, on two clocks (``_since``)."""
    return time.monotonic(), time.time()


def _since(then: tuple[float, float]) -> float:
    """Seconds since ``then`` (``_now``), the longer of the two clocks' counts: the monotonic clock
    does not count a suspended machine's sleep (a suspended VM's), the wall clock (set again once
    it wakes) does; a clock set back counts less, the other stands. So a pause is never counted
    shorter than it was: a writer that slept past its lease asks the store (``confirm``)."""
    return max(time.monotonic() - then[0], time.time() - then[1])


class ObjectWriterLock(WriterLockBackend):
    """The run's writer lease object ``.lock`` (module docstring)."""

    POLL = 0.5

    def __init__(self, storage: ObjectStore):
        self.storage = storage
        self._held: Version | None = None
        self._renewed_at = (0.0, 0.0)
        """When the request that wrote ``_held`` was sent (``_now``)."""
        self._renewing = threading.Lock()
        """One renewal at a time (the thread's, a commit's ``confirm``): each names the version the other wrote."""
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({"holder": this_process(), "ns": pid_namespace(), "renewed": time.time(),
                           "ttl": self.storage.lock_ttl}).encode()

    def take(self) -> None:
        storage = self.storage
        while True:
            self._renewed_at = _now()
            self._held = storage.put_if(LOCK_FILE, self._record(), None)
            if self._held is not None:
                break
            current = self._current()
            if current is None:
                continue  # released meanwhile: try again
            holder, version = current
            here = self._on_this_host(holder, version)
            if (here is True and not _lapsed(holder)) or (here is not False and not self._stale(version)):
                raise TailorError(
                    f"{storage.url} is being written by another writer ({holder.get('holder', 'unknown')}); "
                    "a run has one writer at a time"
                )
            # Taken over only if nobody else did first.
            self._renewed_at = _now()
            self._held = storage.put_if(LOCK_FILE, self._record(), version)
            if self._held is not None:
                break
        self._lost = None
        self._stop.clear()
        _HOLDING.add(self)
        self._thread = threading.Thread(target=self._renew, name="llmtailor-lock", daemon=True)
        self._thread.start()

    def _current(self) -> tuple[dict, Version] | None:
        try:
            result = load_obstore().get(self.storage.store, LOCK_FILE)
            data, version = bytes(result.bytes()), Version.of(result.meta)
        except FileNotFoundError:
            return None
        except Exception as err:
            raise self.storage.failure(err, LOCK_FILE) from None
        try:
            holder = json.loads(data)
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), version

    @staticmethod
    def _on_this_host(holder: dict, version: Version) -> bool | None:
        """For a holder on this host (its hostname, and the pid namespace its lease records:
        module docstring): whether its process lives (True: refused at once; False: a crash, its
        lease, of ``version``, void at once); None for a holder elsewhere, or one its pid cannot
        tell (watched). A lease naming this process's own pid is this process's only if one of
        its writers holds ``version`` (``_HOLDING``): else its pid, alive, says nothing of the
        holder, which died (this namespace) or may live in another (none recorded)."""
        parts = str(holder.get("holder", "")).split()
        if len(parts) != 4 or parts[0] != "pid" or parts[2] != "on" or parts[3] != socket.gethostname():
            return None
        namespace = holder.get("ns")
        if namespace is not None and namespace != pid_namespace():  # another container (or machine) of this name
            return None
        try:
            pid = int(parts[1])
        except ValueError:
            return True
        if pid == os.getpid():
            if any(lock._held == version for lock in list(_HOLDING)):
                return True
            return False if namespace is not None else None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    @classmethod
    def _dead_here(cls, holder: dict, version: Version) -> bool:
        return cls._on_this_host(holder, version) is False

    def _stale(self, version: Version) -> bool:
        """Watch the lease for up to ``lock_ttl`` seconds: renewed (its version changed) means a
        live holder; unchanged that long, a dead one."""
        deadline = time.monotonic() + self.storage.lock_ttl
        while time.monotonic() < deadline:
            time.sleep(min(self.POLL, max(0.0, deadline - time.monotonic())))
            try:
                now = Version.of(load_obstore().head(self.storage.store, LOCK_FILE))
            except FileNotFoundError:
                return True
            except Exception as err:
                raise self.storage.failure(err, LOCK_FILE) from None
            if now != version:
                return False
        return True

    def _renew(self) -> None:
        period = self.storage.lock_ttl / 3
        while not self._stop.wait(period):
            try:
                if not self._renew_once():
                    return
            except TailorError as err:  # transient: retried at the next period while the lease holds
                if _since(self._renewed_at) > self.storage.lock_ttl:
                    self._lost = f"the run's lock could not be renewed for {self.storage.lock_ttl:g} s ({err})"
                    return

    def _renew_once(self) -> bool:
        """The lease rewritten, only over the version this writer holds: False (and lost) where
        another writer took it over; a TailorError where the store did not answer."""
        with self._renewing:
            if self._lost is not None:
                return False
            sent = _now()
            renewed = self.storage.put_if(LOCK_FILE, self._record(), self._held)
            if renewed is None:
                self._lost = "another writer took the run's lock over"
                return False
            self._held, self._renewed_at = renewed, sent
            return True

    def check_held(self) -> None:
        if self._lost is not None:
            raise TailorError(f"{self.storage.url}: this writer no longer holds the run's lock ({self._lost}); "
                              "nothing more is committed")

    def confirm(self) -> None:
        """Return where this writer holds its lease (module docstring: Fenced): renewed less than
        ``CONFIRMED_WITHIN`` of its ttl ago, or renewed here, over its own version; else raise
        TailorError (taken over, or the store did not answer the renewal)."""
        self.check_held()
        if _since(self._renewed_at) < CONFIRMED_WITHIN * self.storage.lock_ttl:
            return
        try:
            renewed = self._renew_once()
        except TailorError as err:
            raise TailorError(f"{self.storage.url}: this writer could not confirm it still holds the run's lock ({err}); "
                              "nothing more is committed") from None
        if not renewed:
            self.check_held()

    def release(self) -> None:
        _HOLDING.discard(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._lost is None and self._held is not None:
            try:
                current = self._current()
                if current is not None and current[1] == self._held:
                    self.storage.remove(LOCK_FILE)
            except TailorError:  # the lease expires on its own; a release never fails a program
                pass
        self._held = None

    def holder_if_other(self) -> str | None:
        current = self._current()
        if current is None or current[1] == self._held:
            return None
        holder, version = current
        if self._dead_here(holder, version) or _lapsed(holder):
            return None
        return str(holder.get("holder", "unknown process"))


_HOLDING: weakref.WeakSet[ObjectWriterLock] = weakref.WeakSet()
"""The writer leases this process holds (taken, not released): a lease naming this process's pid
is its own only if one of them holds its version (``ObjectWriterLock._on_this_host``)."""
os.register_at_fork(after_in_child=_HOLDING.clear)  # a forked child holds none of its parent's


def pid_namespace() -> str | None:
    """This process's pid namespace, told apart across machines: the kernel's boot id and the
    namespace's inode (Linux); None where they cannot be read. Two processes of one hostname
    and one pid namespace are on one host, and a pid names one process there."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None
