"""Whether a prefix of an object store is a run, or may become one."""

from __future__ import annotations

from llmtailor.constants import LATEST_FILE, LOCK_FILE, SNAPSHOTS_DIR
from llmtailor.store.storage.base import Storage
from llmtailor.store.storage.strategies import RunDetection


class ObjectDetection(RunDetection):
    """Run detection of an object-store prefix: a run holds ``snapshots/``, ``latest`` or
    ``.lock`` (what a writer leaves)."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def describe_non_run(self) -> str | None:
        names = set(self.storage.list_dir(""))
        if names & {SNAPSHOTS_DIR, LATEST_FILE, LOCK_FILE}:
            return None
        if not names:
            return f"{self.storage.url}: no such run (nothing stored under this prefix)"
        return f"{self.storage.url}: not an llmtailor run (no {SNAPSHOTS_DIR}/ under this prefix)"

    def is_fresh(self) -> bool:
        return not self.storage.list_dir("")
