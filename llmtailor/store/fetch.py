"""Concurrent ranged reads: one byte range of a run's file, fetched as parts in parallel into one
buffer, each part checksummed in order as soon as it is in, so verifying overlaps fetching.

A restore's reads are large (a unit's file, a chunk of a sharded tensor). Read one after
another, an object store serves one ranged GET at a time and a local disk one request at a
time, and the checksum waits for the last byte. Here a range of more than ``PART`` bytes is
split into parts fetched by a bounded pool of threads (obstore's ranged gets and ``preadv``
both leave the interpreter while they wait), each written straight into its place in the
buffer the caller gets (``Storage.read_into``: a local file is read into it with no staging
copy), while the calling thread feeds the parts, in order, to the checksum. The bytes are
returned only after every part is in; the caller compares the checksum before it uses them.
"""

from __future__ import annotations

import atexit
import mmap
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from llmtailor.store.storage.base import Storage

PART = 8 << 20
"""Bytes fetched by one request of a large range (boto3's transfer manager uses 8 MiB too)."""

WORKERS = 8
"""Requests in flight at most, over every range being fetched in the process."""

_LARGE = 1 << 20
"""Bytes from which a buffer is fresh anonymous memory (``mmap``): a bytearray is zeroed first."""

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="llmtailor-fetch")
            atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
        return _pool


def new_buffer(length: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``length`` bytes (``torch.frombuffer`` takes either kind)."""
    return mmap.mmap(-1, length) if length >= _LARGE else bytearray(length)


def fetch(storage: Storage, key: str, start: int, length: int, hasher: Any = None) -> bytearray | mmap.mmap:
    """``length`` bytes of ``key`` from ``start``, fetched in parts concurrently (module
    docstring); ``hasher`` (an ``xxhash`` state), when given, is fed every byte in order before
    this returns. Errors as ``Storage.read_range`` (a short file: IntegrityError naming it)."""
    buffer = new_buffer(length)
    view = memoryview(buffer)
    if length <= PART:
        if length:
            storage.read_into(key, start, view)
        if hasher is not None:
            hasher.update(view)
        return buffer
    parts = [(at, min(PART, length - at)) for at in range(0, length, PART)]
    pool = _workers()
    futures: list[Future] = [pool.submit(storage.read_into, key, start + at, view[at : at + n]) for at, n in parts]
    try:
        for (at, n), future in zip(parts, futures):
            future.result()
            if hasher is not None:
                hasher.update(view[at : at + n])
    except BaseException:
        for future in futures:
            future.cancel()
        wait(futures)  # no part is written into the buffer once this has returned
        raise
    return buffer
