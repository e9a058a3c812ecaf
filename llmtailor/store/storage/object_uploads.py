"""Writing files to an object store: each uploaded as it is written (multipart, its parts
concurrently), a batch's uploads completed on helper threads while the next file is written."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from llmtailor.store.storage.base import Batch, Sink
from llmtailor.errors import TailorError
from llmtailor.store.storage.object_options import load_obstore

UPLOAD_PART = 16 << 20


UPLOAD_CONCURRENCY = 8


class ObjectSink(Sink):
    """A file uploaded as it is written: a multipart upload in ``UPLOAD_PART`` parts, up to
    ``UPLOAD_CONCURRENCY`` in flight (one PUT for a small file); durable once closed (in a
    batch: once the batch drains, its last parts finishing while the next file is written)."""

    def __init__(self, store: Any, key: str, batch: ObjectBatch):
        self.key, self._batch = key, batch
        try:
            self._writer = load_obstore().open_writer(store, key, buffer_size=UPLOAD_PART,
                                                      max_concurrency=UPLOAD_CONCURRENCY)
        except Exception as err:
            raise batch.failure(err, key) from None

    def write(self, data: memoryview | bytes) -> None:
        """Take ``data`` for upload. obstore keeps a reference to the buffer it is given, not a
        copy, until the part holding it is sent, and a caller may reuse its buffer at once
        (``Storage.pieces``): a view is copied here, immutable bytes are not."""
        try:
            self._writer.write(bytes(data) if isinstance(data, memoryview) else data)
        except Exception as err:
            raise self._batch.failure(err, self.key) from None

    def close(self) -> None:
        self._batch.closing(self)

    def finish(self) -> None:
        """Complete the upload (blocks until its last parts are stored)."""
        try:
            self._writer.close()
        except Exception as err:
            raise self._batch.failure(err, self.key) from None

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

    def __init__(self, store: Any, failure: Callable[[Exception, str], TailorError]):
        """``store``: obstore's store; ``failure(err, key)``: obstore's error ``err`` as the
        storage raises it for the file ``key`` (``ObjectStore.failure``)."""
        self._store, self.failure = store, failure
        self._slots = threading.BoundedSemaphore(self.CLOSING)
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def create(self, key: str) -> ObjectSink:
        self._raise_first()
        return ObjectSink(self._store, key, self)

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
