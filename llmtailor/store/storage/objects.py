"""Object stores as a ``Storage``: S3 and compatible stores, GCS, Azure, through obstore.

Why obstore (measured against fsspec + s3fs on the same server: ``bench/bench_object_store.py``,
figures in ``bench/RESULTS.md``): its uploads were faster (147 vs 115 MB/s streaming 64 MB files
in 16 MB parts; ranged reads equal), and it is one client for S3, GCS and Azure with the same
conditional writes on all three (``mode="create"`` and an ETag match: the lease-object lock
needs both), multipart uploads and concurrent ranged reads, retries with backoff built in, and
configuration the way each cloud's own tools read it (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``
environment variables) or as options. Not a reason: its work outside Python's interpreter lock
did not spare a Python thread running beside an upload on the 2-core machine measured (the
loop ran at 79% of its idle speed beside obstore's uploads, 93% beside s3fs's: obstore's own
threads compete for the cores).

How the store's guarantees hold without rename or ``flock``:

- **Commit.** A snapshot's files go straight to their final keys under
  ``snapshots/step-N/``; the manifest is written last, only if absent (a conditional write), and
  is the commit marker: ``Run.steps`` lists only snapshots whose manifest exists. Then ``latest``
  is replaced (one PUT: atomic). A crash before the manifest leaves objects no reader trusts;
  the next writer (holding the lock) or ``gc`` removes them, and aborts unfinished multipart
  uploads under the run (S3: through boto3, obstore has no call to list them).
- **Lost answers.** The server may act on a request whose answer never arrives (a 503 in its
  place, a dropped connection); obstore retries it. A conditional write retried so meets its
  own object ("already exists", or an ETag that moved): ``put_if`` reads the object back, and
  one holding exactly the bytes it meant to write is its own, written. So the manifest's
  commit and the lease's writes succeed; other bytes are still refused. A retried delete
  meets nothing, which is no error.
- **One writer.** ``.lock`` is a lease object written only if absent, naming its holder; the
  holder rewrites it (conditionally on its own ETag) every ``lock_ttl / 3`` seconds. A
  contender that finds it watches its ETag: one that changes is a live writer (refused, naming
  it); one unchanged for ``lock_ttl`` seconds is a dead writer's, taken over conditionally (so
  two contenders cannot both win). A holder on this host whose process is gone is taken over
  at once. A writer that lost its lease refuses to commit.
- **Reader leases.** A reader writes ``snapshots/step-N/.readers/<id>`` (with an expiry), then
  checks that the snapshot is committed and not marked ``.removing``; retention writes
  ``.removing``, then looks for unexpired reader leases and backs off if it finds one. Each side
  writes before it reads the other's mark, so at least one of them sees the other. Retention
  then deletes the manifest first (the snapshot stops being one at once), then the rest.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from llmtailor.constants import LATEST_FILE, LOCK_FILE, MANIFEST_FILE, SNAPSHOTS_DIR, TMP_DIR, TRASH_DIR
from llmtailor.errors import ConfigError, IntegrityError, StorageError, TailorError
from llmtailor.store.storage.base import PIECE, Batch, Lease, Leftovers, Sink, Storage, WriterLockBackend
from llmtailor.store.storage.object_errors import MISSING, explain

READERS_DIR = ".readers"
REMOVING_MARK = ".removing"
READER_LEASE_SECONDS = 6 * 3600.0
"""How long a reader's lease holds if the reader never releases it (it died)."""
DEFAULT_LOCK_TTL = 30.0
UPLOAD_PART = 16 << 20
UPLOAD_CONCURRENCY = 8

_OWN_OPTIONS = {"lock_ttl"}
"""Options llmtailor reads itself; every other option goes to obstore's store constructor
(``endpoint``, ``region``, ``access_key_id``, ``allow_http``, ``client_options``,
``retry_config``, ...)."""
_ALIASES = {"endpoint_url": "endpoint", "aws_endpoint_url": "endpoint", "key": "access_key_id",
            "secret": "secret_access_key", "token": "session_token"}
_CLIENT_OPTIONS = {"allow_http", "allow_invalid_certificates", "timeout", "connect_timeout", "proxy_url",
                   "user_agent", "http1_only", "http2_only", "pool_idle_timeout", "pool_max_idle_per_host"}
"""Options of the HTTP client, not of the store: given with the others, passed to the client."""
DEFAULT_RETRY = {"max_retries": 6, "retry_timeout": 120.0,
                 "backoff": {"init_backoff": 0.1, "max_backoff": 5.0, "base": 2.0}}
"""Transient errors (5xx, throttling, dropped connections) are retried with exponential backoff
and jitter, at most 6 times within 2 minutes; then the error names the object."""


def _obstore():
    try:
        import obstore
        import obstore.store
    except ImportError:  # pragma: no cover - a dependency; named for a broken install
        raise ConfigError("object-store runs need the obstore package: pip install obstore") from None
    return obstore


class ObjectStorage(Storage):
    """A run at an object-store URL (module docstring). ``options``: obstore's store options
    (``endpoint``, ``region``, credentials, ``allow_http``, ``client_options``,
    ``retry_config``) and ``lock_ttl`` (seconds; default 30); anything not given is read from
    the environment as the cloud's own tools do."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None):
        obstore = _obstore()
        self.url = url.rstrip("/")
        self.root = self.url
        scheme, _, rest = self.url.partition("://")
        self.scheme = scheme.lower()
        self.bucket, _, self.prefix = rest.partition("/")
        given = {_ALIASES.get(k.lower(), k.lower()): v for k, v in {**_env_options(), **(options or {})}.items()}
        self.options = dict(given)
        self.lock_ttl = _lock_ttl(given.pop("lock_ttl", DEFAULT_LOCK_TTL))
        retry = _retry_config(_mapping("retry_config", given.pop("retry_config", DEFAULT_RETRY)))
        client = {**{k: given.pop(k) for k in list(given) if k in _CLIENT_OPTIONS},
                  **_mapping("client_options", given.pop("client_options", None) or {})}
        endpoint = given.get("endpoint") or (_env_endpoint() if self.scheme == "s3" else None)
        if str(endpoint or "").lower().startswith("http://"):
            client = {"allow_http": True, **client}  # the endpoint names http: what was meant (allow_http=false wins)
        try:
            self.store = obstore.store.from_url(self.url, retry_config=retry, client_options=client or None, **given)
        except Exception as err:  # obstore's configuration errors: a value it cannot parse, a bad URL
            named = f" with storage options {sorted(self.options)}" if self.options else ""
            raise ConfigError(f"{self.url}: cannot use this location{named} ({explain(err).text})") from None
        except BaseException as err:  # an option obstore's Rust side does not know panics (not an Exception)
            if type(err).__name__ != "PanicException":
                raise
            raise ConfigError(f"{self.url}: cannot use these storage options {sorted(given)} ({err})") from None
        self._errors = obstore.exceptions
        self._discarding: set[str] = set()

    def identity(self) -> str:
        return self.url

    # -- errors -------------------------------------------------------------------------------

    def _fail(self, err: Exception, key: str, missing: str = "file is missing") -> TailorError:
        """An obstore error as one line naming the object: IntegrityError when it is missing,
        StorageError otherwise (after obstore's retries of transient errors)."""
        where = self.where(key)
        denied = isinstance(err, self._errors.PermissionDeniedError | self._errors.UnauthenticatedError)
        explained = explain(err, denied=denied, missing=isinstance(err, FileNotFoundError))
        if explained.kind == MISSING:
            return IntegrityError(f"{where}: {missing}")
        return StorageError(f"{where}: {explained.text}")

    # -- reading ------------------------------------------------------------------------------

    def size(self, key: str) -> int | None:
        try:
            return int(_obstore().head(self.store, key)["size"])
        except FileNotFoundError:
            return None
        except Exception as err:
            raise self._fail(err, key) from None

    def exists(self, key: str) -> bool:
        if self.size(key) is not None:
            return True
        return bool(self._children(key))

    def is_file(self, key: str) -> bool:
        return self.size(key) is not None

    def read(self, key: str) -> bytearray:
        try:
            return bytearray(_obstore().get(self.store, key).bytes())
        except Exception as err:
            raise self._fail(err, key) from None

    def read_range(self, key: str, start: int, length: int) -> memoryview | bytes:
        if length == 0:
            return b""
        try:
            data = _obstore().get_range(self.store, key, start=start, length=length)
        except Exception as err:
            raise self._truncated_or(err, key) from None
        if len(data) != length:
            raise IntegrityError(f"{self.where(key)}: shorter than the data it should hold (truncated)")
        return memoryview(data)

    def _truncated_or(self, err: Exception, key: str) -> TailorError:
        if "range" in str(err).lower() and not isinstance(err, FileNotFoundError):
            return IntegrityError(f"{self.where(key)}: shorter than the data it should hold (truncated)")
        return self._fail(err, key)

    def pieces(self, key: str, start: int = 0, length: int | None = None) -> Iterator[memoryview | bytes]:
        if start or length is not None:
            yield from super().pieces(key, start, length)
            return
        try:
            result = _obstore().get(self.store, key)
            for piece in result.stream(min_chunk_size=PIECE):
                yield memoryview(piece)
        except Exception as err:
            raise self._fail(err, key) from None

    def _children(self, prefix: str) -> tuple[list[str], list[dict]]:
        base = f"{prefix.rstrip('/')}/" if prefix else None
        try:
            listed = _obstore().list_with_delimiter(self.store, base)
        except Exception as err:
            raise self._fail(err, prefix) from None
        return listed["common_prefixes"], listed["objects"]

    def list_dir(self, prefix: str) -> list[str]:
        dirs, objects = self._children(prefix)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in dirs] + [o["path"].rsplit("/", 1)[-1] for o in objects]

    def walk(self, prefix: str) -> Iterator[tuple[str, int]]:
        base = f"{prefix.rstrip('/')}/" if prefix else None
        try:
            for chunk in _obstore().list(self.store, base):
                for meta in chunk:
                    yield meta["path"], int(meta["size"])
        except Exception as err:
            raise self._fail(err, prefix) from None

    # -- writing ------------------------------------------------------------------------------

    def batch(self) -> ObjectBatch:
        return ObjectBatch(self)

    def put(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        if exclusive:
            if self.put_if(key, data, "create") is None:
                raise TailorError(f"{self.where(key)} already exists; refusing to overwrite it")
            return
        try:
            _obstore().put(self.store, key, data, mode="overwrite")
        except Exception as err:
            raise self._fail(err, key) from None

    def put_if(self, key: str, data: bytes, mode: str | dict[str, str]) -> str | None:
        """A conditional write: ``mode="create"``, only if ``key`` is absent; ``{"e_tag": E}``,
        only if it still has ETag E. Returns the ETag written, or None when the condition does
        not hold (another object is there, or it changed or vanished). An object found holding
        exactly ``data`` is this write's own, a success: the server stored it and its answer
        was lost (a 503, a dropped connection), so the client's retry met it, or gave up."""
        errors = self._errors
        try:
            return _obstore().put(self.store, key, data, mode=mode)["e_tag"]
        except Exception as err:
            found = self._etag_if_holding(key, data)
            if found is not None:
                return found
            if isinstance(err, errors.AlreadyExistsError | errors.PreconditionError | FileNotFoundError):
                return None
            raise self._fail(err, key) from None

    def _etag_if_holding(self, key: str, data: bytes) -> str | None:
        """The ETag of ``key`` when it holds exactly ``data``; None when it does not, is
        missing, or cannot be read now (the caller reports its own failure then)."""
        try:
            result = _obstore().get(self.store, key)
            return result.meta["e_tag"] if bytes(result.bytes()) == data else None
        except Exception:
            return None

    def replace(self, key: str, data: bytes) -> None:
        self.put(key, data)  # one PUT replaces an object whole

    def remove(self, key: str) -> None:
        try:
            _obstore().delete(self.store, key)
        except FileNotFoundError:
            pass
        except Exception as err:
            raise self._fail(err, key) from None

    def remove_tree(self, prefix: str) -> None:
        self._remove_all(prefix)

    def _remove_all(self, prefix: str) -> int:
        """Remove every object under ``prefix``; returns how many there were."""
        keys = [key for key, _ in self.walk(prefix)]
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            try:
                _obstore().delete(self.store, chunk)
            except FileNotFoundError:  # one gone meanwhile (a store that says so): the rest one by one
                for key in chunk:
                    self.remove(key)
            except Exception as err:
                raise self._fail(err, prefix) from None
        return len(keys)

    # -- the snapshot commit ------------------------------------------------------------------

    def begin_snapshot(self, name: str, final: str, world_size: int) -> str:
        if self.is_file(f"{final}/{MANIFEST_FILE}"):
            raise TailorError(f"{self.where(final)} already exists; refusing to overwrite a committed snapshot")
        return final  # the files go to their final keys; the manifest commits them

    def commit_snapshot(self, staging: str, final: str) -> None:
        """Nothing: the manifest, written last only if absent, committed the snapshot."""

    def abandon_snapshot(self, staging: str) -> None:
        if self.is_file(f"{staging}/{MANIFEST_FILE}"):
            return  # committed after all (an answer lost after the write): never remove it
        try:
            self.remove_tree(staging)
        except TailorError:
            pass  # left for the next writer or gc: no reader trusts a snapshot without manifest

    def staging_key(self, staging: str, relpath: str) -> str:
        return f"{staging}/{relpath}"

    # -- locks and retention ------------------------------------------------------------------

    def writer_lock(self) -> ObjectWriterLock:
        return ObjectWriterLock(self)

    def lease_for_reading(self, snapshot: str) -> Lease | None:
        key = f"{snapshot}/{READERS_DIR}/{uuid.uuid4().hex}"
        record = {"holder": _holder(), "expires": time.time() + READER_LEASE_SECONDS}
        try:
            self.put(key, json.dumps(record).encode())
        except StorageError as err:
            if "permission denied" in str(err):
                return _ObjectLease(self, None) if self.is_file(f"{snapshot}/{MANIFEST_FILE}") else None
            raise
        lease = _ObjectLease(self, key)
        # Written first, then read: retention writes its mark first, then reads the leases.
        if self.is_file(f"{snapshot}/{REMOVING_MARK}") or not self.is_file(f"{snapshot}/{MANIFEST_FILE}"):
            lease.release()
            return None
        return lease

    def lease_for_removal(self, snapshot: str) -> Lease | None:
        if not self.is_file(f"{snapshot}/{MANIFEST_FILE}"):
            return None
        mark = f"{snapshot}/{REMOVING_MARK}"
        self.put(mark, _holder().encode())
        now = time.time()
        for key, _ in self.walk(f"{snapshot}/{READERS_DIR}"):
            try:
                expires = json.loads(bytes(self.read(key)))["expires"]
            except (TailorError, ValueError, KeyError, TypeError):
                continue  # gone meanwhile, or not a lease
            if expires > now:
                self.remove(mark)
                return None
            self.remove(key)  # a reader that died: its lease has expired
        self._discarding.add(snapshot)
        return _RemovalLease(self, snapshot)

    def discard_snapshot(self, snapshot: str) -> str:
        # The manifest goes first: from then on the snapshot is not one, at once.
        self.remove(f"{snapshot}/{MANIFEST_FILE}")
        self._discarding.discard(snapshot)
        return snapshot

    def purge(self, token: str) -> None:
        self.remove_tree(token)

    def clear_leftovers(self) -> Leftovers:
        """Snapshots without a manifest (a crashed save, a removal cut short), temporary
        objects, and unfinished multipart uploads under the run: the caller holds the lock, so
        none of them belongs to a live writer."""
        objects = 0
        for name in self.list_dir(SNAPSHOTS_DIR):
            snapshot = f"{SNAPSHOTS_DIR}/{name}"
            if not self.is_file(f"{snapshot}/{MANIFEST_FILE}"):
                objects += self._remove_all(snapshot)
        for leftover in (TMP_DIR, TRASH_DIR):
            objects += self._remove_all(leftover)
        return Leftovers(files=objects, uploads=abort_multipart_uploads(self), noun="object")

    def describe_non_run(self) -> str | None:
        names = set(self.list_dir(""))
        if names & {SNAPSHOTS_DIR, LATEST_FILE, LOCK_FILE}:
            return None
        if not names:
            return f"{self.url}: no such run (nothing stored under this prefix)"
        return f"{self.url}: not an llmtailor run (no {SNAPSHOTS_DIR}/ under this prefix)"

    def is_fresh(self) -> bool:
        return not self.list_dir("")


class _ObjectLease(Lease):
    def __init__(self, storage: ObjectStorage, key: str | None):
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

    def __init__(self, storage: ObjectStorage, snapshot: str):
        self.storage, self.snapshot = storage, snapshot

    def release(self) -> None:
        if self.snapshot in self.storage._discarding:
            self.storage._discarding.discard(self.snapshot)
            try:
                self.storage.remove(f"{self.snapshot}/{REMOVING_MARK}")
            except TailorError:
                pass


class ObjectSink(Sink):
    """A file uploaded as it is written: a multipart upload in ``UPLOAD_PART`` parts, up to
    ``UPLOAD_CONCURRENCY`` in flight (one PUT for a small file); durable once closed (in a
    batch: once the batch drains, its last parts finishing while the next file is written)."""

    def __init__(self, storage: ObjectStorage, key: str, batch: ObjectBatch):
        self.storage, self.key, self._batch = storage, key, batch
        try:
            self._writer = _obstore().open_writer(storage.store, key, buffer_size=UPLOAD_PART,
                                                  max_concurrency=UPLOAD_CONCURRENCY)
        except Exception as err:
            raise storage._fail(err, key) from None

    def write(self, data: memoryview | bytes) -> None:
        try:
            self._writer.write(data)
        except Exception as err:
            raise self.storage._fail(err, self.key) from None

    def close(self) -> None:
        self._batch.closing(self)

    def finish(self) -> None:
        """Complete the upload (blocks until its last parts are stored)."""
        try:
            self._writer.close()
        except Exception as err:
            raise self.storage._fail(err, self.key) from None

    def abort(self) -> None:
        # obstore aborts no upload it was not told to complete; an unfinished multipart upload
        # is invisible to readers and removed by the next writer or gc (clear_leftovers).
        self._writer = None


class ObjectBatch(Batch):
    """Files written one after another, each uploaded (its parts concurrently); a closed file's
    upload is completed on a helper thread while the next file is written, at most
    ``CLOSING`` at a time (memory stays bounded); every file is stored when ``drain``
    returns, or it raises the first failure.

    Threads of its own, not an executor: an async save still in flight when a script ends must
    still complete while the interpreter waits for it (an executor refuses work then)."""

    CLOSING = 3

    def __init__(self, storage: ObjectStorage):
        self.storage = storage
        self._slots = threading.BoundedSemaphore(self.CLOSING)
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def create(self, key: str) -> ObjectSink:
        self._raise_first()
        return ObjectSink(self.storage, key, self)

    def closing(self, sink: ObjectSink) -> None:
        self._slots.acquire()

        def finish() -> None:
            try:
                sink.finish()
            except BaseException as err:  # raised by drain, in the writer's thread
                self._errors.append(err)
            finally:
                self._slots.release()

        thread = threading.Thread(target=finish, name="llmtailor-upload", daemon=True)
        thread.start()
        self._threads.append(thread)

    def drain(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        self._raise_first()

    def _raise_first(self) -> None:
        if self._errors:
            raise self._errors[0]

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.drain()
        else:
            for thread in self._threads:  # a failed part: let the uploads in flight end first
                thread.join()


class ObjectWriterLock(WriterLockBackend):
    """The run's writer lease object ``.lock`` (module docstring)."""

    POLL = 0.5

    def __init__(self, storage: ObjectStorage):
        self.storage = storage
        self._etag: str | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({"holder": _holder(), "renewed": time.time(), "ttl": self.storage.lock_ttl}).encode()

    def take(self) -> None:
        storage = self.storage
        while True:
            self._etag = storage.put_if(LOCK_FILE, self._record(), "create")
            if self._etag is not None:
                break
            current = self._current()
            if current is None:
                continue  # released meanwhile: try again
            holder, etag = current
            here = self._on_this_host(holder)
            if here is True or (here is None and not self._stale(etag)):
                raise TailorError(
                    f"{storage.url} is being written by another writer ({holder.get('holder', 'unknown')}); "
                    "a run has one writer at a time"
                )
            # Taken over only if nobody else did first.
            self._etag = storage.put_if(LOCK_FILE, self._record(), {"e_tag": etag})
            if self._etag is not None:
                break
        self._lost = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="llmtailor-lock", daemon=True)
        self._thread.start()

    def _current(self) -> tuple[dict, str] | None:
        try:
            result = _obstore().get(self.storage.store, LOCK_FILE)
            data, etag = bytes(result.bytes()), result.meta["e_tag"]
        except FileNotFoundError:
            return None
        except Exception as err:
            raise self.storage._fail(err, LOCK_FILE) from None
        try:
            holder = json.loads(data)
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), etag

    @staticmethod
    def _on_this_host(holder: dict) -> bool | None:
        """For a holder on this host: whether its process lives (True: refused at once; False:
        a crash, its lease void at once); None for a holder elsewhere (watched)."""
        parts = str(holder.get("holder", "")).split()
        if len(parts) != 4 or parts[0] != "pid" or parts[2] != "on" or parts[3] != socket.gethostname():
            return None
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError):
            return True
        return True

    @classmethod
    def _dead_here(cls, holder: dict) -> bool:
        return cls._on_this_host(holder) is False

    def _stale(self, etag: str) -> bool:
        """Watch the lease for up to ``lock_ttl`` seconds: renewed (its ETag changed) means a
        live holder; unchanged that long, a dead one."""
        deadline = time.monotonic() + self.storage.lock_ttl
        while time.monotonic() < deadline:
            time.sleep(min(self.POLL, max(0.0, deadline - time.monotonic())))
            try:
                now = _obstore().head(self.storage.store, LOCK_FILE)["e_tag"]
            except FileNotFoundError:
                return True
            except Exception as err:
                raise self.storage._fail(err, LOCK_FILE) from None
            if now != etag:
                return False
        return True

    def _renew(self) -> None:
        period = self.storage.lock_ttl / 3
        last = time.monotonic()
        while not self._stop.wait(period):
            try:
                renewed = self.storage.put_if(LOCK_FILE, self._record(), {"e_tag": self._etag})
            except TailorError as err:  # transient: retried at the next period while the lease holds
                if time.monotonic() - last > self.storage.lock_ttl:
                    self._lost = f"the run's lock could not be renewed for {self.storage.lock_ttl:g} s ({err})"
                    return
                continue
            if renewed is None:
                self._lost = "another writer took the run's lock over"
                return
            self._etag, last = renewed, time.monotonic()

    def check_held(self) -> None:
        if self._lost is not None:
            raise TailorError(f"{self.storage.url}: this writer no longer holds the run's lock ({self._lost}); "
                              "nothing more is committed")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._lost is None and self._etag is not None:
            try:
                current = self._current()
                if current is not None and current[1] == self._etag:
                    self.storage.remove(LOCK_FILE)
            except TailorError:  # the lease expires on its own; a release never fails a program
                pass
        self._etag = None

    def holder_if_other(self) -> str | None:
        current = self._current()
        if current is None or current[1] == self._etag:
            return None
        holder, _ = current
        if self._dead_here(holder) or time.time() - float(holder.get("renewed", 0)) > float(holder.get("ttl", DEFAULT_LOCK_TTL)):
            return None
        return str(holder.get("holder", "unknown process"))


def abort_multipart_uploads(storage: ObjectStorage) -> int:
    """Abort the unfinished multipart uploads under the run (S3; a crashed writer's). Uses
    boto3 when it is installed (obstore cannot list uploads); returns how many were aborted."""
    if storage.scheme != "s3":
        return 0  # GCS and Azure discard uncommitted uploads (blocks) on their own
    try:
        import boto3
    except ImportError:
        return 0
    options = storage.options
    endpoint = options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or _env_endpoint()
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
        import logging

        logging.getLogger(__name__).warning("llmtailor: could not abort unfinished uploads under %s: %s", storage.url, err)
    return aborted


def _lock_ttl(value: Any) -> float:
    try:
        ttl = float(value)
    except (TypeError, ValueError):
        ttl = math.nan
    if not (math.isfinite(ttl) and ttl > 0):
        raise ConfigError(f"storage option lock_ttl={value!r}: expected seconds, a number > 0 "
                          f"(how long a writer's lease holds unrenewed; default {DEFAULT_LOCK_TTL:g})")
    return ttl


def _mapping(name: str, value: Any) -> Mapping[str, Any]:
    """A structured option (``retry_config``, ``client_options``): a mapping, or a JSON object
    as text (``--storage-option retry_config={"max_retries": 3}``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if not isinstance(value, Mapping):
        raise ConfigError(f"storage option {name}={value!r}: expected a JSON object of its settings")
    return value


def _env_endpoint() -> str | None:
    """The S3 endpoint the environment names, as obstore (and the AWS tools) read it."""
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")


def _retry_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """obstore's retry configuration, with durations given as seconds accepted."""
    from datetime import timedelta

    def duration(value: Any) -> Any:
        return timedelta(seconds=float(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    out = dict(config)
    if "retry_timeout" in out:
        out["retry_timeout"] = duration(out["retry_timeout"])
    if isinstance(out.get("backoff"), Mapping):
        backoff = dict(out["backoff"])
        for key in ("init_backoff", "max_backoff"):
            if key in backoff:
                backoff[key] = duration(backoff[key])
        out["backoff"] = backoff
    return out


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


OPTIONS_ENV = "LLMTAILOR_STORAGE_OPTIONS"
"""An environment variable holding default storage options as a JSON object (the CLI's
``--storage-option KEY=VALUE`` sets it for the one command); options given in code win."""


def _env_options() -> dict[str, Any]:
    text = os.environ.get(OPTIONS_ENV)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{OPTIONS_ENV} is not a JSON object ({err})") from None
    if not isinstance(options, dict):
        raise ConfigError(f"{OPTIONS_ENV} is not a JSON object")
    return options
