"""A tier as a ``TailorConfig`` declares it: ``Tier`` (validated; every problem in one
ConfigError): where it is, whether every rank reaches it (``scope="shared"``) or each node has
its own (``scope="node"``, with ``replicas`` and ``jump``), its retention and cadence."""

from __future__ import annotations

from os import PathLike
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from llmtailor.errors import ConfigError, describe_validation
from llmtailor.store.retention import Keep
from llmtailor.store.storage.location import is_url

LAG_INTERVALS = 10
"""The default ``max_lag`` in promotion intervals (``promote_every``): see ``Tier.max_lag``."""


class Tier(BaseModel):
    """A faster store in front of the run directory (host memory, node-local disk): a complete
    llmtailor run of its own at ``location``, in the same format. ``TailorConfig.tiers`` lists
    them fastest first; the run directory itself is the last, durable tier. Saves commit to the
    first tier; a background promoter copies committed composites down the tiers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    location: str
    """A local directory (``/dev/shm/exp1``: host memory, outlives the training process but not
    the node; ``/local/nvme/exp1``) or an object-store URL."""
    keep: Keep = 2
    """Retention in this tier: the newest ``keep`` composites (and what they need); None keeps
    everything (a memory tier then fills up)."""
    promote_every: int = 1
    """Cadence of the next tier: a composite committed here is promoted to the next slower tier
    once it is at least this many steps after the newest composite that tier holds (each
    promotion takes the newest composite here; ``close()`` promotes the last save everywhere)."""
    max_lag: int | None = None
    """Bounded loss: when the next slower tier's newest composite is more than ``max_lag``
    steps behind this tier's newest, the next save waits (before it writes anything) until the
    promotion catches up; None never waits. Default: ``10 * promote_every``. A tier that can be
    lost as a whole (host memory, a node's disk: every node at once in a job-wide failure) then
    loses at most that many steps, while a promotion that lags a few intervals (a slow upload,
    the store's hiccup) never stalls training: the promoter skips to the newest composite, so
    in steady state the next tier is ``promote_every`` plus one promotion's duration behind,
    and only a store that cannot keep up at all reaches ten intervals. At least
    ``promote_every`` (a composite moves on only every ``promote_every`` steps)."""
    storage_options: dict[str, Any] | None = None
    """The store's options for an object-store URL (as ``TailorConfig.storage_options``)."""
    scope: Literal["shared", "node"] = "shared"
    """``"shared"``: one store every rank reaches. ``"node"``: a local path each node has for
    itself (``/dev/shm/exp1`` on every node): each node's copy holds the parts of its own ranks
    and of the nodes it keeps replicas of, plus the manifest, the unit indexes and the global
    state; a snapshot is committed there once every node's parts have ``replicas`` copies.
    Only the first tier may be node-local."""
    replicas: int = 1
    """Copies of each node's parts, on distinct nodes (1: its own copy only). Node n's parts
    are held by nodes n, n + jump, n + 2 jump, ... (mod the number of nodes)."""
    jump: int = 1
    """Spacing of the nodes holding one node's parts: with 1 the copy lives on the next node;
    choose it so that partners sit in another failure domain (another rack)."""

    def __init__(self, location: str | PathLike | None = None, /, **options: Any):
        """``Tier("/dev/shm/exp1", keep=2, promote_every=50)``; every problem in one ConfigError."""
        if location is not None:
            options["location"] = location
        try:
            super().__init__(**options)
        except ValidationError as err:
            raise ConfigError(f"Tier options: {describe_validation(err)}") from None

    @field_validator("location", mode="before")
    @classmethod
    def _a_location(cls, value: Any) -> Any:
        value = str(value) if isinstance(value, PathLike) else value
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"a tier's location must be a path or URL, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_lag(cls, options: Any) -> Any:
        """``max_lag`` left out: ``LAG_INTERVALS`` promotion intervals (None, given, never waits)."""
        every = options.get("promote_every", 1) if isinstance(options, dict) else None
        if isinstance(options, dict) and "max_lag" not in options and isinstance(every, int) and every >= 1:
            return {**options, "max_lag": LAG_INTERVALS * every}
        return options

    @model_validator(mode="after")
    def _lag_over_cadence(self) -> Tier:
        if self.max_lag is not None and self.max_lag < self.promote_every:
            raise ValueError(f"max_lag={self.max_lag} must be at least promote_every={self.promote_every} (a composite "
                             "moves to the next tier only every promote_every steps), or None (never wait)")
        return self

    @field_validator("promote_every", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"promote_every={value!r} must be a positive number of steps")
        return value

    @field_validator("scope", mode="before")
    @classmethod
    def _a_scope(cls, value: Any) -> Any:
        if value not in ("shared", "node"):
            raise ValueError(f"scope={value!r}: expected 'node' or 'shared'")
        return value

    @field_validator("replicas", "jump", mode="before")
    @classmethod
    def _a_count(cls, value: Any, info: Any) -> Any:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{info.field_name}={value!r} must be a positive whole number")
        return value

    @model_validator(mode="after")
    def _placement(self) -> Tier:
        if self.scope == "node" and is_url(self.location):
            raise ValueError(f"{self.location}: a node-local tier (scope='node') is a local path each node has "
                             "(/dev/shm/..., a local disk), not a URL")
        if self.scope == "shared" and (self.replicas, self.jump) != (1, 1):
            raise ValueError(f"replicas={self.replicas} and jump={self.jump} need scope='node' (a shared tier is one "
                             "store: it keeps one copy)")
        return self
