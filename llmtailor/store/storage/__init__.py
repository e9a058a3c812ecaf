"""Where runs live: the bottom floor of the store, importing nothing of llmtailor but ``errors``
and ``constants``. The storage interface (``base.py``: a run's bytes by key) and the strategies
each backend brings beside it (``strategies.py``: snapshot commits, locks and leases, run
detection); the local filesystem (``local*.py``) and object stores (``object*.py``);
``open_storage`` (``location.py``) picks one from a path or URL."""

from llmtailor.store.storage.base import Batch, Sink, Storage
from llmtailor.store.storage.location import is_url, open_storage
from llmtailor.store.storage.strategies import (Lease, Leftovers, RunDetection, RunLocks, SnapshotCommits, Unconfirmed,
                                               WriterLockBackend)

__all__ = ["Batch", "Lease", "Leftovers", "RunDetection", "RunLocks", "Sink", "SnapshotCommits", "Storage",
           "Unconfirmed", "WriterLockBackend", "is_url", "open_storage"]
