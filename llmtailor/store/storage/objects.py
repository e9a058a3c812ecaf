"""Object stores as a ``Storage``: S3 and compatible stores, GCS, Azure, through obstore.

Why obstore (measured against fsspec + s3fs on the same server: ``bench/bench_object_store.py``,
figures in ``bench/RESULTS.md``): its uploads were faster (147 vs 115 MB/s streaming 64 MB files
in 16 MB parts; ranged reads equal), and it is one client for S3, GCS and Azure with the same
conditional writes on all three (``mode="create"`` and a version match, the ETag or GCS's
generation: the lease-object lock needs both), multipart uploads and concurrent ranged reads, retries with backoff built in, and
configuration the way each cloud's own tools read it (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``
environment variables) or as options. Not a reason: its work outside Python's interpreter lock
did not spare a Python thread running beside an upload on the 2-core machine measured (the
loop ran at 79% of its idle speed beside obstore's uploads, 93% beside s3fs's: obstore's own
threads compete for the cores).

How the store's guarantees hold without rename or ``flock``, each beside this module:

- **Bytes** (``object_store``, ``object_uploads``): objects by key, ranged reads, multipart
  uploads; conditional writes that recognise their own object when an answer was lost.
- **Commit** (``object_commit``): the manifest, written last only if absent, is the commit
  marker; a crash's objects and unfinished uploads are removed by the next writer or ``gc``.
- **One writer, reader leases** (``object_lock``): a lease object renewed while held; reader
  lease objects and a ``.removing`` mark, each side writing before it reads the other's.
- **Options** (``object_options``), **errors in one line** (``object_errors``), **what a prefix
  is** (``object_detect``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmtailor.store.storage.object_commit import ObjectCommits
from llmtailor.store.storage.object_detect import ObjectDetection
from llmtailor.store.storage.object_lock import ObjectLocks
from llmtailor.store.storage.object_store import ObjectStore


class ObjectStorage(ObjectStore):
    """A run at an object-store URL: its files (``ObjectStore``: ``options`` are described there)
    with the object store's commit, locks and run detection (module docstring)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None):
        super().__init__(url, options)
        self.locks = ObjectLocks(self)
        self.commits = ObjectCommits(self, self.locks)
        self.detection = ObjectDetection(self)
