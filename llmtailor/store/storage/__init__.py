"""Where runs live: the storage interface (``base.py``), the local filesystem (``local.py``)
and object stores (``objects.py``); ``open_storage`` picks one from a path or URL."""

from llmtailor.store.storage.base import Batch, Lease, Leftovers, Sink, Storage, WriterLockBackend, is_url, open_storage

__all__ = ["Batch", "Lease", "Leftovers", "Sink", "Storage", "WriterLockBackend", "is_url", "open_storage"]
