"""One tier of a writer: its run, its writer lock, its retention and the cadence of the next
tier (``Level``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtailor.errors import ConfigError, StorageError
from llmtailor.store.lock import WriterLock
from llmtailor.store.run import Run


@dataclass
class Level:
    """One tier of a run: its store, writer lock, retention and the cadence of the next tier."""

    run: Run
    lock: WriterLock
    keep: int | None
    promote_every: int | None
    """None for the last tier (nothing after it)."""
    scope: str = "shared"
    """``"node"``: each node has its own copy at ``run`` (``Tier.scope``), with ``replicas``
    copies of each node's parts, on nodes ``jump`` apart."""
    replicas: int = 1
    jump: int = 1
    max_lag: int | None = None
    """How far (steps) the next tier may fall behind before a save waits (``Tier.max_lag``);
    None: never waits (and the last tier)."""
    held_back: bool = False
    """This writer's last retention of the tier passed over snapshots a reader held (the
    promoter's lease, mostly): ``Tiers.close`` runs it once more, once nothing of the writer reads."""

    @property
    def name(self) -> str:
        return str(self.run.root)

    def record(self) -> dict[str, Any]:
        location = str(Path(self.run.root).resolve()) if self.run.is_local else self.run.storage.url
        placed = {"scope": "node", "replicas": self.replicas, "jump": self.jump} if self.node_local else {}
        return {"location": location, "keep": self.keep, "promote_every": self.promote_every, "max_lag": self.max_lag,
                **placed}

    @property
    def node_local(self) -> bool:
        return self.scope == "node"

    @classmethod
    def of(cls, run: Run, keep: int | None, promote_every: int | None, scope: str = "shared", replicas: int = 1,
           jump: int = 1, max_lag: int | None = None) -> Level:
        """The tier at ``run``, with a writer lock of its own (not taken)."""
        return cls(run, WriterLock(run.storage), keep, promote_every, scope, replicas, jump, max_lag)

    def take(self) -> None:
        """Take the tier's writer lock, which also proves that the tier can be written (the lock
        file is written there): one that cannot be is a ConfigError naming it and why."""
        try:
            self.lock.acquire()
        except StorageError as err:
            raise ConfigError(f"{err} (a tier of this writer, which saves to every tier: give tiers it can write, or "
                              "read_only=True to restore only)") from None
