"""Counting what the store asks of its storage: every read, size or listing and every reader
lease, by operation and key, from any ``Storage`` of the process (local or object store). A
test wraps the storage classes' methods with ``StorageCalls.install(monkeypatch)``, clears the
record before the work it measures, and asserts on what the work asked for; a job script of
the tests (a process of its own, no monkeypatch) counts with ``StorageCalls.in_process``."""

from __future__ import annotations

import functools
from collections import Counter
from types import SimpleNamespace

from llmtailor.store.storage.local import LocalStorage
from llmtailor.store.storage.local_lock import FlockLocks
from llmtailor.store.storage.object_lock import ObjectLocks
from llmtailor.store.storage.object_store import ObjectStore

READS = ("read", "read_range", "read_into", "pieces", "read_start")
LOOKS = ("size", "is_file", "exists", "list_dir")


class StorageCalls:
    """What the storage layer was asked, in order: ``(operation, key, bytes)`` (bytes: those a
    read returned; 0 for a look or a lease)."""

    def __init__(self):
        self.calls: list[tuple[str, str, int]] = []

    @classmethod
    def install(cls, monkeypatch, storages: tuple[type, ...] = (LocalStorage, ObjectStore)) -> StorageCalls:
        """Count the calls to ``storages`` (and every reader lease) from now on; ``monkeypatch``:
        anything with pytest's ``setattr(target, name, value)``."""
        record = cls()
        for storage in storages:
            for name in READS + LOOKS:
                if name in vars(storage):
                    monkeypatch.setattr(storage, name, record._counted(name, vars(storage)[name]))
        for locks in (FlockLocks, ObjectLocks):
            monkeypatch.setattr(locks, "lease_for_reading", record._counted("lease", vars(locks)["lease_for_reading"]))
        return record

    _in_process: dict[tuple[type, ...], StorageCalls] = {}

    @classmethod
    def in_process(cls, storages: tuple[type, ...] = (LocalStorage, ObjectStore)) -> StorageCalls:
        """``install`` for the rest of this process (a job script's), its record cleared: the
        same record at every call with the same ``storages`` (installed once: no call counted
        twice in it)."""
        if storages not in cls._in_process:
            cls._in_process[storages] = cls.install(SimpleNamespace(setattr=setattr), storages)
        record = cls._in_process[storages]
        record.clear()
        return record

    def _counted(self, name, method):
        if name == "pieces":
            @functools.wraps(method)
            def streamed(storage, key, *args, **kwargs):
                seen = 0
                for piece in method(storage, key, *args, **kwargs):
                    seen += len(piece)
                    yield piece
                self.calls.append((name, key, seen))
            return streamed

        @functools.wraps(method)
        def counted(storage, key, *args, **kwargs):
            result = method(storage, key, *args, **kwargs)
            size = (len(result) if name in ("read", "read_range") else len(args[1]) if name == "read_into"
                    else len(result[1]) if name == "read_start" else 0)
            self.calls.append((name, key, size))
            return result
        return counted

    def clear(self) -> None:
        self.calls.clear()

    def count(self, operation: str, ending: str = "") -> int:
        """How often ``operation`` was asked of a key ending with ``ending``."""
        return sum(1 for op, key, _ in self.calls if op == operation and key.endswith(ending))

    def leases(self) -> Counter:
        """Reader leases taken, by snapshot."""
        return Counter(key for op, key, _ in self.calls if op == "lease")

    def by_key(self, operations: tuple[str, ...] = READS) -> Counter:
        """How often ``operations`` (default: the reads) were asked, by key."""
        return Counter(key for op, key, _ in self.calls if op in operations)

    def bytes_by_key(self) -> Counter:
        """Bytes read, by key (``pieces`` of an object store, read by range, count twice)."""
        read: Counter = Counter()
        for op, key, size in self.calls:
            if op in READS:
                read[key] += size
        return read

    def bytes_read(self, ending: str = "") -> int:
        return sum(size for op, key, size in self.calls if op in READS and key.endswith(ending))
