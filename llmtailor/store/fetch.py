"""Concurrent ranged reads: one byte range of a run's file, fetched as parts in parallel into one
buffer, each part checksummed in order as soon as it is in, so verifying overlaps fetching.

A restore's reads are large (a unit's file, a chunk of a sharded tensor). Read in one request,
an object store serves one ranged GET at a time, and the checksum waits for the last byte.
Here a range of more than ``PART`` bytes is split into parts fetched by a bounded pool of
threads (obstore's ranged gets and ``preadv`` both leave the interpreter while they wait),
each written straight into its place in the buffer the caller gets (``Storage.read_into``: a
local file is read into it with no staging copy), while the calling thread feeds the parts, in
order, to the checksum. How many parts are requested at once is the storage's
(``Storage.reads_in_flight``): all of them from an object store; one at a time from a local
file, in file order, by one thread that reads on without waiting for the caller (a disk reads a
file fastest as one stream, and the checksum of each part then overlaps the read of the next:
``_read_in_order``). The bytes are returned only after every part is in; the caller
compares the checksum before it uses them. From a remote store, where a request costs a round
trip whatever its size, a fetch's short last part (under half a part) comes with the part before
it, in one request of up to a part and a half (``_joined``). A part is ``PART`` bytes, or the
storage's own request size (``Storage.request_bytes``: an object store's is larger, ``part_bytes``).

A whole file read from its start (``sized``) has its size checked by the request of its first
part where the store's ranged read answers it (an object store's GET: ``Storage.read_start``),
not by a request of its own before (a HEAD: on an object store a round trip per file); the
check is raised before any other failure of the fetch and before it returns.
"""

from __future__ import annotations

import functools
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from llmtailor.distributed.progress import advance, carried
from llmtailor.errors import IntegrityError
from llmtailor.store.storage.base import LazyPool, Storage

PART = 8 << 20
"""Bytes fetched by one request of a large range (boto3's transfer manager uses 8 MiB too)."""

WORKERS = 8
"""Requests in flight at most, over every range being fetched in the process."""

_LARGE = 1 << 20
"""Bytes from which a buffer is fresh anonymous memory (``mmap``): a bytearray is zeroed first."""

_SMALL = 256 << 10
"""Views under this many bytes next to each other are read as one request (``_parts``)."""

_workers = LazyPool(WORKERS, "llmtailor-fetch")


def part_bytes(storage: Storage) -> int:
    """Bytes of one request of a large range of ``storage``: its own request size where it has
    one (``Storage.request_bytes``), else ``PART``."""
    return storage.request_bytes or PART


def new_buffer(length: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``length`` bytes (``torch.frombuffer`` takes either kind)."""
    return mmap.mmap(-1, length) if length >= _LARGE else bytearray(length)


Sized = Callable[[int | None], None]
"""Checks a file's size as the store answered it (None: no such file), raising where it is wrong."""


def fetch(storage: Storage, key: str, start: int, length: int, hasher: Any = None,
          sized: Sized | None = None) -> bytearray | mmap.mmap:
    """``length`` bytes of ``key`` from ``start``, fetched in parts concurrently (module
    docstring) into a new buffer; ``hasher`` and ``sized`` as ``fetch_into``'s."""
    buffer = new_buffer(length)
    fetch_into(storage, key, start, [memoryview(buffer)], hasher, sized)
    return buffer


def fetch_into(storage: Storage, key: str, start: int, views: list[memoryview], hasher: Any = None,
               sized: Sized | None = None) -> None:
    """Fill ``views`` (writable byte views: a live tensor's memory, or a new buffer's) with the
    consecutive bytes of ``key`` from ``start``, the first view's first, in parts fetched
    concurrently (module docstring), at most ``storage.reads_in_flight`` requested at once;
    ``hasher`` (an ``xxhash`` state), when given, is fed every byte in file order before this
    returns. ``sized`` (only from ``start`` 0): called with the file's size, from the first
    part's request where the store answers it there (module docstring), else asked first; what
    it raises is raised before any failure of another part. Errors as ``Storage.read_range``
    (a short file: IntegrityError naming it); once this has returned or raised, nothing writes
    into a view."""
    if sized is not None and start != 0:
        raise ValueError("fetch_into: a size is checked only on a read from the file's start")
    # A remote store pays a round trip per request whatever its size: there consecutive views
    # are read together up to a whole part (one copy out of the store's answer costs less).
    request = part_bytes(storage)
    parts = _parts(start, views, request if storage.remote else _SMALL, join=storage.remote, part=request)
    if sized is not None:
        if storage.remote and parts:
            parts[0].sized = sized
        else:  # a local file's size costs no round trip; its reads go straight into the views
            sized(storage.size(key))
    if sum(part.length for part in parts) <= request:  # small: one thread, no hand-over
        for part in parts:
            part.read(storage, key)
            part.done(hasher)
        return
    ahead = storage.reads_in_flight or len(parts)
    if ahead == 1:
        _read_in_order(storage, key, parts, hasher)
        return
    requests = Requests([functools.partial(part.read, storage, key) for part in parts], ahead)
    try:
        for index, part in enumerate(parts):  # each part hashed once in: verifying overlaps fetching
            requests.take(index)  # the next part requested before this one is hashed
            part.done(hasher)
    except BaseException:
        requests.stop()  # no part is written into a view once this has returned
        raise


class Requests:
    """The requests of one fetch, made on the fetch pool in file order, at most ``ahead`` of them
    in flight beyond the last one the caller took (``Storage.reads_in_flight``): a store that
    serves that many at once gets no more, and a caller that keeps each answer until it is
    placed holds at most ``ahead`` of them. A single request is made on the caller's thread when
    it is taken (nothing to overlap it with: no hand-over). The caller takes each in order
    (``take``); one that stops calls ``stop``, which returns once no request runs (none writes
    into memory freed behind it)."""

    def __init__(self, requests: list[Callable[[], Any]], ahead: int):
        self._requests, self._ahead = requests, max(1, ahead)
        self._futures: list[Future] = []
        self._kept = 0  # the requests before it were taken and passed: their answers let go
        if len(requests) > 1:
            self._request(self._ahead)

    def __len__(self) -> int:
        return len(self._requests)

    def take(self, index: int) -> Any:
        """Request ``index``'s answer, once it is in (what it raised, raised here); the next one
        requested before this returns, so the store is asked for it while the caller uses this one.
        The answers before ``index`` are let go here (the caller has them, or is done with them)."""
        for earlier in range(self._kept, index):
            self._futures[earlier] = _TAKEN
        self._kept = max(self._kept, index)
        if len(self._requests) == 1 and not self._futures:  # made here, now
            self._futures.append(Future())
            try:
                self._futures[0].set_result(self._requests[0]())
            except Exception as err:  # raised where its answer is taken, as a pool's request
                self._futures[0].set_exception(err)
        self._request(index + 1)
        answer = self._futures[index].result()
        self._request(index + 1 + self._ahead)
        return answer

    def stop(self) -> None:
        """The requests not started cancelled; returns once none runs."""
        for future in self._futures:
            future.cancel()
        wait(self._futures)

    def _request(self, until: int) -> None:
        while len(self._futures) < min(until, len(self._requests)):
            self._futures.append(_workers.submit(carried(self._requests[len(self._futures)])))


_TAKEN: Future = Future()
"""In ``Requests`` in place of a request taken and passed: its answer is not held there any more."""
_TAKEN.set_result(None)


def request_parts(storage: Storage, key: str, length: int, sized: Sized) -> tuple[list[int], Requests]:
    """The requests of a remote fetch of the whole file ``key`` (``length`` bytes: those of
    ``fetch``, ``part_cuts``), each part's bytes left as the store answers them, for a caller that
    puts them where they go itself, taking them in order: where each part starts, and the
    requests (``Requests``: at most ``storage.reads_in_flight`` in flight ahead of the caller, as
    ``fetch_into``'s). ``sized``: as ``fetch_into``'s, called from the first part's request
    before its bytes are given."""
    cuts = part_cuts(length, part=part_bytes(storage))
    parts = [_Part(start, None, [], end - start) for start, end in zip(cuts, [*cuts[1:], length])]
    parts[0].sized = sized

    def answer(part: _Part) -> memoryview | bytes:
        part.read(storage, key)
        data, part.answer = part.answer, None
        return data

    return cuts, Requests([functools.partial(answer, part) for part in parts], storage.reads_in_flight or len(cuts))


def _read_in_order(storage: Storage, key: str, parts: list[_Part], hasher: Any) -> None:
    """``parts`` read one after another in file order by one pool thread, which goes on to the
    next as soon as one is in, never waiting on the caller; the caller hashes each as it is in.
    (A part requested only once the caller has taken the one before leaves the disk idle while
    the caller is woken: milliseconds per part on a busy machine.)"""
    arrived: list[Future] = [Future() for _ in parts]
    stop = threading.Event()

    def read_all() -> None:
        for part, done in zip(parts, arrived):
            if stop.is_set():
                done.cancel()
                continue
            try:
                part.read(storage, key)
            except BaseException as error:  # raised to the caller by its part's result()
                done.set_exception(error)
                stop.set()
            else:
                done.set_result(None)

    reader = _workers.submit(carried(read_all))
    try:
        for part, done in zip(parts, arrived):
            done.result()
            part.done(hasher)
    except BaseException:
        stop.set()
        wait([reader])  # no part is written into a view once this has returned
        raise


class _Part:
    """One request: ``length`` bytes of the file from ``at`` into ``view``; or, ``scatter``, the
    small consecutive views it stands for: its bytes are then kept as the store answered them
    (``answer``: no staging buffer of their own) and copied out to each once hashed (none: the
    caller takes the answer, ``request_parts``)."""

    __slots__ = ("at", "length", "view", "scatter", "sized", "answer")

    def __init__(self, at: int, view: memoryview | None, scatter: list[memoryview] | None = None, length: int | None = None):
        self.at, self.view, self.scatter = at, view, scatter
        self.length = length if length is not None else len(view) if view is not None else sum(len(v) for v in scatter or ())
        self.sized: Sized | None = None
        """The first part of a whole file's read: its request checks the file's size too."""
        self.answer: memoryview | bytes | None = None

    def read(self, storage: Storage, key: str) -> None:
        if self.sized is not None:  # the size the store answers, checked before a byte is used
            size, data = storage.read_start(key, self.length)
            self.sized(size)
            if len(data) != self.length:
                raise IntegrityError(f"{storage.where(key)}: shorter than the data it should hold (truncated)")
            if self.scatter is not None:
                self.answer = data
            else:
                self.view[:] = data
        elif self.scatter is not None:
            self.answer = storage.read_range(key, self.at, self.length)
        elif self.length:
            storage.read_into(key, self.at, self.view)
        advance()  # a rank reading a large composite from a slow store shows it is live (``Coordinator.working``)

    def done(self, hasher: Any) -> None:
        """Once read: hash it, and copy a joined part out to its views."""
        data = self.view if self.scatter is None else memoryview(self.answer).cast("B")
        if hasher is not None:
            hasher.update(data)
        if self.scatter is not None:
            at = 0
            for view in self.scatter:
                view[:] = data[at : at + len(view)]
                at += len(view)
            self.answer = None


def _parts(start: int, views: list[memoryview], small_under: int = _SMALL, join: bool = False,
           part: int | None = None) -> list[_Part]:
    """The requests filling ``views`` from ``start``: a view over ``part`` bytes (``PART`` where
    not given) cut into parts of ``part``, views of under ``small_under`` bytes next to each other
    read as one, up to that many bytes (a Llama unit's norms and step counters are a few bytes
    each: one request, not one each). ``join`` (a remote store): no request ends a fetch or a
    view under half a part after a full one: it is joined to that one (``_joined``), so requests
    are of up to a part and a half."""
    part = part or PART
    parts: list[_Part] = []
    small: list[memoryview] = []
    at, limit = start, min(small_under, part)

    def flush() -> None:
        if small:
            length = sum(len(view) for view in small)
            parts.append(_Part(at - length, None, list(small)) if len(small) > 1 else _Part(at - length, small[0]))
            small.clear()

    for view in views:
        if len(view) >= limit or sum(len(v) for v in small) + len(view) > limit:
            flush()
        if len(view) < limit:
            small.append(view)
        else:
            cuts = part_cuts(len(view), join, part)
            parts += [_Part(at + cut, view[cut : end]) for cut, end in zip(cuts, [*cuts[1:], len(view)])]
        at += len(view)
    flush()
    if join:  # a short last request joins the one before it
        parts[-2:] = _joined(parts[-2:], part)
    return parts


def part_cuts(length: int, join: bool = True, part: int | None = None) -> list[int]:
    """Where the requests of ``length`` bytes start (offsets from 0): every ``part`` bytes
    (``PART`` where not given); with ``join`` (a remote store), a last one under half a part is
    left to the one before it (no short last request: ``_joined``), so requests are of up to a
    part and a half."""
    part = part or PART
    cuts = list(range(0, length, part))
    if join and len(cuts) > 1 and length - cuts[-1] < part // 2:
        cuts.pop()
    return cuts


def _joined(last: list[_Part], part: int) -> list[_Part]:
    """The last two requests of a remote fetch, joined into one (its answer copied out to the
    views they fill) when together they are under a part and a half. A request costs a
    round trip whatever its size (and an S3 emulator such as moto reads the whole object for
    each ranged GET), so a range a little over a part's size (a Llama layer's 8.9 MB in a pack:
    8 MiB and 0.9 MB) is one request, not two; a copy of its bytes costs less."""
    if len(last) < 2 or last[0].length + last[1].length >= part + part // 2:
        return last
    first, second = last
    return [_Part(first.at, None, (first.scatter or [first.view]) + (second.scatter or [second.view]))]
