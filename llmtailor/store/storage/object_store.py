"""An object store's files as a ``Storage``'s bytes: S3 and compatible stores, GCS, Azure,
through obstore (why obstore, and how the store's guarantees hold without rename or ``flock``:
``storage/objects.py``). Conditional writes (``put_if``) are here too: the commit marker and the
lease-object lock are made of them.

**Lost answers.** The server may act on a request whose answer never arrives (a 503 in its
place, a dropped connection); obstore retries it. A conditional write retried so meets its own
object ("already exists", or a version that moved): ``put_if`` reads the object back, and one
holding exactly the bytes it meant to write is its own, written. A retried delete meets nothing,
which is no error.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from llmtailor.errors import ConfigError, IntegrityError, TailorError
from llmtailor.store.storage.base import PIECE, LazyPool, Storage
from llmtailor.store.storage.object_errors import credential_services, explain, failure
from llmtailor.store.storage.object_options import load_obstore, resolve_options
from llmtailor.store.storage.object_uploads import ObjectBatch


_askers = LazyPool(8, "llmtailor-ask")
"""Threads asking small requests side by side (``ObjectStore.together``)."""

_STORES_KEPT = 16
"""obstore stores kept for reuse in a process (``_store_for``), the least recently used dropped."""

_ENVIRONMENT = ("AWS_", "AZURE_", "GOOGLE_", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
"""Prefixes of the environment variables obstore's store reads when it is made (credentials,
endpoint, region, proxies): part of what a kept store is looked up by."""

_stores: OrderedDict[tuple, Any] = OrderedDict()
_stores_lock = threading.Lock()


def _store_for(url: str, retry: dict[str, Any], client: dict[str, Any], given: dict[str, Any]) -> Any:
    """obstore's store for ``url`` with these options, made once per process for the same URL,
    options and environment (``_ENVIRONMENT``) and kept (``_STORES_KEPT``): making one costs
    about 11 ms of CPU (its HTTP client), paid by every ``Tailor`` of a process (a restore in a
    loop, a tool opening a run several times) where fsspec keeps its filesystems the same way.
    A store holds no state of a run (only its client's connections and credentials), and obstore
    uses one from many threads. Never shared with a forked child (the process id is part of
    the key); options that are not plain values (a credential provider, say) make a store of
    their own every time, as does ``memory://``, whose store holds the objects themselves (kept,
    a run there would be found again, then lost once the store left the cache)."""
    plain = _plain([retry, client, given])
    if plain is None or url.lower().startswith("memory:"):
        return load_obstore().store.from_url(url, retry_config=retry, client_options=client or None, **given)
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith(_ENVIRONMENT)))
    key = (os.getpid(), url, plain, environment)
    with _stores_lock:
        store = _stores.get(key)
        if store is not None:
            _stores.move_to_end(key)
            return store
    store = load_obstore().store.from_url(url, retry_config=retry, client_options=client or None, **given)
    with _stores_lock:
        _stores[key] = store
        while len(_stores) > _STORES_KEPT:
            _stores.popitem(last=False)
    return store


def _plain(value: Any) -> Any:
    """``value`` as a hashable key when it is made of plain values only (text, numbers, None,
    durations, and mappings and lists of them), else None."""
    if value is None or isinstance(value, (str, int, float, bool, timedelta)):
        return (type(value).__name__, value)
    if isinstance(value, Mapping):
        items = [(k, _plain(v)) for k, v in value.items()]
        return None if any(v is None or not isinstance(k, str) for k, v in items) else ("map", tuple(sorted(items)))
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return None if any(v is None for v in items) else ("list", tuple(items))
    return None


@dataclass(frozen=True)
class Version:
    """Which write of an object this is: its ETag, and its ``generation`` where the store keeps
    one (GCS; S3 with versioning). A conditional overwrite names both: S3 and Azure match the
    ETag, GCS only the generation (obstore refuses a GCS update without it)."""

    e_tag: str | None
    generation: str | None = None

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> Version:
        """The version in obstore's ``PutResult`` or ``ObjectMeta``."""
        return cls(meta.get("e_tag"), meta.get("version"))

    def mode(self) -> dict[str, str]:
        """obstore's ``put`` mode writing only over this version (``None`` fields left out:
        obstore refuses them)."""
        return {name: value for name, value in (("e_tag", self.e_tag), ("version", self.generation)) if value is not None}


class ObjectStore(Storage):
    """The files of a run at an object-store URL (module docstring). ``options``: obstore's
    store options (``endpoint``, ``region``, credentials, ``allow_http``, ``client_options``,
    ``retry_config``) and ``lock_ttl`` (seconds; default 30); anything not given is read from
    the environment as the cloud's own tools do (``object_options``)."""

    remote = True
    request_bytes = 16 << 20
    """A large range is requested in parts of 16 MiB (up to 24 MiB, a short last part joined:
    ``store.fetch``), not 8: S3's own guidance names 8 or 16 MB for ranged GETs, and a request
    costs a round trip whatever its size (and an emulator such as moto reads the whole object for
    each ranged GET: the bench's 24.6 MB unit files were three GETs each, 74 MB read to serve 25).
    A unit file of up to 24 MiB is then one GET; a larger one still several side by side."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None):
        obstore = load_obstore()
        self.url = url.rstrip("/")
        self.root = self.url
        scheme, _, rest = self.url.partition("://")
        self.scheme = scheme.lower()
        self.bucket, _, self.prefix = rest.partition("/")
        resolved = resolve_options(self.scheme, options)
        self.options, self.lock_ttl, given = resolved.given, resolved.lock_ttl, resolved.store
        self._services = credential_services(given)
        try:
            self.store = _store_for(self.url, resolved.retry, resolved.client, given)
        except Exception as err:  # obstore's configuration errors: a value it cannot parse, a bad URL
            named = f" with storage options {sorted(self.options)}" if self.options else ""
            said = explain(err, services=self._services).text
            raise ConfigError(f"{self.url}: cannot use this location{named} ({said})") from None
        except BaseException as err:  # an option obstore's Rust side does not know panics (not an Exception)
            if type(err).__name__ != "PanicException":
                raise
            raise ConfigError(f"{self.url}: cannot use these storage options {sorted(given)} ({err})") from None
        self._errors = obstore.exceptions

    def identity(self) -> str:
        return self.url

    def together(self, *asks: Callable[[], Any]) -> list[Any]:
        """``Storage.together``: the first ask on this thread (it may use what this thread holds,
        such as a listing taken inside ``Catalog.listed``), the others on threads of a small pool
        meanwhile, each a round trip of its own."""
        if len(asks) < 2:
            return [ask() for ask in asks]
        others: list[Future[Any]] = [_askers.submit(ask) for ask in asks[1:]]
        try:
            first = asks[0]()
        finally:
            wait(others)  # every ask ended, whatever the first did
        for future in others:
            error = future.exception()
            if error is not None:
                raise error
        return [first, *(future.result() for future in others)]

    # -- errors -------------------------------------------------------------------------------

    def failure(self, err: Exception, key: str, missing: str = "file is missing") -> TailorError:
        """An obstore error as one line naming the object ``key`` (``object_errors.failure``)."""
        return failure(err, self.where(key), missing, self._services)

    # -- reading ------------------------------------------------------------------------------

    def size(self, key: str) -> int | None:
        try:
            return int(load_obstore().head(self.store, key)["size"])
        except FileNotFoundError:
            return None
        except Exception as err:
            raise self.failure(err, key) from None

    def exists(self, key: str) -> bool:
        if self.size(key) is not None:
            return True
        return bool(self._children(key))

    def is_file(self, key: str) -> bool:
        return self.size(key) is not None

    def read(self, key: str) -> bytearray:
        try:
            return bytearray(load_obstore().get(self.store, key).bytes())
        except Exception as err:
            raise self.failure(err, key) from None

    def read_range(self, key: str, start: int, length: int) -> memoryview | bytes:
        if length == 0:
            return b""
        try:
            data = load_obstore().get_range(self.store, key, start=start, length=length)
        except Exception as err:
            raise self._truncated_or(err, key) from None
        if len(data) != length:
            raise IntegrityError(f"{self.where(key)}: shorter than the data it should hold (truncated)")
        return memoryview(data)

    def read_start(self, key: str, length: int) -> tuple[int | None, memoryview | bytes]:
        if length <= 0:
            return super().read_start(key, length)
        try:  # a ranged GET past the end gives what there is; its answer names the object's size
            result = load_obstore().get(self.store, key, options={"range": (0, length)})
            return int(result.meta["size"]), memoryview(result.bytes())
        except FileNotFoundError:
            return None, b""
        except Exception as err:
            if "range" in str(err).lower():  # an empty object: no range of it can be served
                return super().read_start(key, length)
            raise self.failure(err, key) from None

    def _truncated_or(self, err: Exception, key: str) -> TailorError:
        if "range" in str(err).lower() and not isinstance(err, FileNotFoundError):
            return IntegrityError(f"{self.where(key)}: shorter than the data it should hold (truncated)")
        return self.failure(err, key)

    def pieces(self, key: str, start: int = 0, length: int | None = None) -> Iterator[memoryview | bytes]:
        if start or length is not None:
            yield from super().pieces(key, start, length)
            return
        try:
            result = load_obstore().get(self.store, key)
            for piece in result.stream(min_chunk_size=PIECE):
                yield memoryview(piece)
        except Exception as err:
            raise self.failure(err, key) from None

    def _children(self, prefix: str) -> tuple[list[str], list[dict]]:
        base = f"{prefix.rstrip('/')}/" if prefix else None
        try:
            listed = load_obstore().list_with_delimiter(self.store, base)
        except Exception as err:
            raise self.failure(err, prefix) from None
        return listed["common_prefixes"], listed["objects"]

    def list_dir(self, prefix: str) -> list[str]:
        dirs, objects = self._children(prefix)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in dirs] + [o["path"].rsplit("/", 1)[-1] for o in objects]

    def walk(self, prefix: str) -> Iterator[tuple[str, int]]:
        base = f"{prefix.rstrip('/')}/" if prefix else None
        try:
            for chunk in load_obstore().list(self.store, base):
                for meta in chunk:
                    yield meta["path"], int(meta["size"])
        except Exception as err:
            raise self.failure(err, prefix) from None

    # -- writing ------------------------------------------------------------------------------

    def batch(self) -> ObjectBatch:
        return ObjectBatch(self.store, self.failure)

    def put(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        if exclusive:
            if self.put_if(key, data, None) is None:
                raise TailorError(f"{self.where(key)} already exists; refusing to overwrite it")
            return
        try:
            load_obstore().put(self.store, key, data, mode="overwrite")
        except Exception as err:
            raise self.failure(err, key) from None

    def put_if(self, key: str, data: bytes, over: Version | None) -> Version | None:
        """A conditional write: with ``over=None``, only if ``key`` is absent; with a
        ``Version``, only if the object still is that version. Returns the version written, or
        None when the condition does not hold (another object is there, or it changed or
        vanished). An object found holding exactly ``data`` is this write's own, a success:
        the server stored it and its answer was lost (a 503, a dropped connection), so the
        client's retry met it, or gave up."""
        errors = self._errors
        try:
            return Version.of(load_obstore().put(self.store, key, data, mode="create" if over is None else over.mode()))
        except Exception as err:
            found = self.version_if_holding(key, data)
            if found is not None:
                return found
            if isinstance(err, errors.AlreadyExistsError | errors.PreconditionError | FileNotFoundError):
                return None
            raise self.failure(err, key) from None

    def holds(self, key: str, data: bytes) -> bool | None:
        """Whether ``key`` holds exactly ``data``: None when it cannot be read now."""
        return self._read_back(key, lambda found: found == data)[0]

    def version_if_holding(self, key: str, data: bytes) -> Version | None:
        """The version of ``key`` when it holds exactly ``data``; None when it does not, is
        missing, or cannot be read now (the caller reports its own failure then)."""
        return self.version_if(key, lambda found: found == data)

    def version_if(self, key: str, test: Callable[[bytes], bool]) -> Version | None:
        """The version of ``key`` when its bytes pass ``test``; None when they do not, it is
        missing, or it cannot be read now."""
        return self._read_back(key, test)[1]

    def _read_back(self, key: str, test: Callable[[bytes], bool]) -> tuple[bool | None, Version | None]:
        """Whether ``key``'s bytes pass ``test`` (False where it is missing, None where it
        cannot be read now), and then its version."""
        try:
            result = load_obstore().get(self.store, key)
            same = test(bytes(result.bytes()))
            return same, Version.of(result.meta) if same else None
        except FileNotFoundError:
            return False, None
        except Exception:
            return None, None

    def replace(self, key: str, data: bytes) -> None:
        self.put(key, data)  # one PUT replaces an object whole

    def remove(self, key: str) -> None:
        try:
            load_obstore().delete(self.store, key)
        except FileNotFoundError:
            pass
        except Exception as err:
            raise self.failure(err, key) from None

    def remove_tree(self, prefix: str, keep: str | None = None) -> int:
        """Remove every object under ``prefix`` but ``keep``; returns how many there were."""
        keys = [key for key, _ in self.walk(prefix) if key != keep]
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            try:
                load_obstore().delete(self.store, chunk)
            except FileNotFoundError:  # one gone meanwhile (a store that says so): the rest one by one
                for key in chunk:
                    self.remove(key)
            except Exception as err:
                raise self.failure(err, prefix) from None
        return len(keys)
