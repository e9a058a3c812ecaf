"""``TailorConfig``: every option of a ``Tailor`` in one documented, validated object.

``Tailor(run_dir, model, ..., config=TailorConfig(keep=3, async_save=True))`` and
``Tailor(run_dir, model, ..., keep=3, async_save=True)`` mean the same; ``TailorTrainer``
passes its ``tailor_config`` through. Every problem is reported at once, naming the option and
the value (``ConfigError``). ``tiers`` takes ``Tier``s (``store/tiers/``).
"""

from __future__ import annotations

from os import PathLike
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmtailor.constants import MOST_IN_FLIGHT
from llmtailor.distributed.coordinator import DEFAULT_TIMEOUT
from llmtailor.errors import ConfigError, describe_validation
from llmtailor.policies import Adaptive, Full, Policy
from llmtailor.store.retention import Keep
from llmtailor.store.tiers import Tier


class TailorConfig(BaseModel):
    """The options of a ``Tailor`` (each field documents itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, arbitrary_types_allowed=True)

    policy: Policy = Field(default_factory=Full)
    """Which units each save writes (``Full()``, ``Parity()``, ``Filter()``, ``Interval()``,
    ``Adaptive()``); its options are checked against the model when the Tailor is built."""
    family: str | None = None
    """The model family's layout (``llama``, ``gpt2``, ...); default: detected from the model."""
    keep: Keep = None
    """After each save, delete every snapshot the newest ``keep`` composites do not need."""
    async_save: bool = False
    """``save`` returns at once; copies and writes go on in the background, fenced before the
    next ``optimizer.step()``."""
    async_in_flight: int = Field(default=1, ge=1, le=MOST_IN_FLIGHT)
    """With ``async_save``: how many saves may be in flight at once. 2 lets a save be staged,
    written and sent while the one before it commits (training waits less when a save takes
    longer than a step), at the cost of a second set of host buffers, a failure raised up to one
    save later, and up to two saves lost to a crash. ``Adaptive`` keeps one."""
    track_drift: bool = True
    """Measure each unit's drift since its last saved version at every save (what ``Adaptive``
    decides by and ``llmtailor drift`` plots)."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds a rank waits for the others in a collective save or restore before failing,
    naming the ranks that did not answer: seconds of silence, not in all. A rank still writing
    its part of a save or loading its share of a restore (reading, copying), or committing its
    node's copy of a node-local save (writing, fsyncing), shows its progress, and the others wait
    on while it does; one that shows none for ``timeout`` is lost (one fsync of a file longer than
    ``timeout`` is silence too). A gloo message or collective of a read plan waits ``timeout`` in
    all."""
    base: str | None = None
    """A ``save_pretrained`` directory of the model being fine-tuned: frozen tensors equal to its
    own are never copied into the run, only referenced (sizes and checksums recorded)."""
    fresh_start: bool = False
    """Let a Tailor that restored nothing save into a run that holds a composite: its first save
    starts a lineage of its own there (training from scratch, or resumed from another run), at a
    step after the run's newest; the run's older lineage is then an abandoned branch, which
    retention (``keep``) deletes at that save and ``gc`` can remove. Without
    it that first save is refused (a restart that left out ``restore()`` would make its state the
    run's newest and, with ``keep``, delete the training the run held). The integrations refuse a
    fresh start on their own terms (their resume line) and set it on their Tailor."""
    read_only: bool = False
    """Only restore (an evaluation job beside the trainer, a read-only copy of a run): no
    writer lock, and ``save`` is refused."""
    storage_options: dict[str, Any] | None = None
    """For a run at an object-store URL (``s3://bucket/prefix``, ``gs://``, ``az://``): the
    store's options (``endpoint``, ``region``, credentials, ``allow_http``, ``retry_config``,
    ``lock_ttl``); anything not given comes from the environment, as the cloud's own tools
    read it."""

    tiers: tuple[Tier, ...] = ()
    """Faster tiers in front of the run directory, fastest first (``Tier``): each save commits
    to the first; committed composites are promoted down to the run directory in the
    background; ``restore`` takes the newest composite of any tier (the fastest on a tie)."""

    @field_validator("policy", mode="before")
    @classmethod
    def _a_policy(cls, value: Any) -> Any:
        if not isinstance(value, Policy):
            raise ValueError(f"policy must be a llmtailor policy (Full(), Parity(), ...), got {value!r}")
        return value

    @field_validator("base", mode="before")
    @classmethod
    def _a_path(cls, value: Any) -> Any:
        return str(value) if isinstance(value, PathLike) else value

    @field_validator("tiers", mode="before")
    @classmethod
    def _tier_list(cls, value: Any) -> Any:
        items = list(value) if isinstance(value, (list, tuple)) else value
        if not isinstance(items, list) or not all(isinstance(t, Tier) for t in items):
            raise ValueError(f"tiers must be a list of llmtailor.Tier, fastest first, got {value!r}")
        locations = [t.location.rstrip("/") for t in items]
        if len(set(locations)) != len(locations):
            raise ValueError(f"tiers name one location twice: {locations}")
        later = [t.location for t in items[1:] if t.scope == "node"]
        if later:
            raise ValueError(f"only the first tier may be node-local (scope='node'), not {later}: saves commit to the "
                             "first tier, and the slower ones are shared")
        return tuple(items)

    @field_validator("timeout", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"timeout={value!r} must be a positive number of seconds")
        return float(value)

    @model_validator(mode="after")
    def _adaptive_measures(self) -> TailorConfig:
        if isinstance(self.policy, Adaptive) and not self.track_drift:
            raise ValueError("the Adaptive policy decides by measured drift: it needs track_drift=True")
        return self

    @classmethod
    def of(cls, config: TailorConfig | None = None, **options: Any) -> TailorConfig:
        """``config`` with ``options`` over it (None options are left out), validated; every
        problem in one ``ConfigError``."""
        given = {key: value for key, value in options.items() if value is not None}
        if config is not None and not isinstance(config, TailorConfig):
            raise ConfigError(f"config must be a TailorConfig, got {config!r}")
        try:
            if config is None:
                return cls(**given)
            return cls(**{**dict(config), **given})
        except ValidationError as err:
            raise ConfigError(f"Tailor options: {describe_validation(err)}") from None
