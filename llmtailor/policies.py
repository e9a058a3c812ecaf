"""Policies: which units each save writes.

A policy sees a ``SaveContext`` (save index, step, the units, when each was last saved, and
on demand per-unit statistics) and returns the units to write. ``Policy.choose`` wraps every
policy with two rules no policy can break: a unit with no saved version yet is always
written (so every composite is complete), and ``full_every=N`` forces a full baseline every
N-th save (bounding how far back a composite reaches).
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmtailor.constants import LAYER_PREFIX
from llmtailor.errors import ConfigError


@dataclass(frozen=True)
class SaveContext:
    save_index: int
    """0 for the first save of a run; continues across restores."""
    step: int
    units: tuple[str, ...]
    """Every unit of the layout, canonical order (embed, layer.0.., norm, head, other)."""
    last_saved: Mapping[str, int]
    """Unit -> step of its newest saved version; units never saved are absent."""
    last_saved_index: Mapping[str, int] = field(default_factory=dict)
    """Unit -> save index of its newest saved version (for staleness counted in saves)."""
    drift: Mapping[str, Mapping[str, float | None]] | None = None
    """Unit -> {"weight": d, "moments": d}: relative change since its last saved version,
    measured (``llmtailor.drift``); None where nothing is measured."""
    unit_bytes: Mapping[str, int] = field(default_factory=dict)
    """Unit -> bytes of its newest saved version (all ranks)."""
    frozen: frozenset[str] = frozenset()
    """Units whose parameters are all frozen (no optimizer step can change them)."""

    @property
    def layer_units(self) -> list[str]:
        return [u for u in self.units if u.startswith(LAYER_PREFIX)]

    @property
    def aux_units(self) -> list[str]:
        return [u for u in self.units if not u.startswith(LAYER_PREFIX)]


@dataclass(frozen=True)
class Decision:
    """The units a save writes, and the policy's record of why (stored in the manifest as
    ``decision``, so a choice can be audited and reproduced)."""

    units: list[str]
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy(ABC):
    full_every: int | None = field(default=None, kw_only=True)
    """Force a full save every N-th save (save index 0, N, 2N, ...)."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if self.full_every is not None and (not isinstance(self.full_every, int) or self.full_every < 1):
            problems.append(f"full_every={self.full_every!r} must be a positive integer or None")
        if problems:
            raise ConfigError(f"{type(self).__name__}: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        return []

    @property
    def weighs_bytes(self) -> bool:
        """Whether ``decide`` reads ``SaveContext.unit_bytes`` (each unit's newest version's
        bytes, known once that version committed): an async save then waits for the save in
        flight to commit before it decides (one save in flight, not two)."""
        return False

    def check_units(self, units: Sequence[str]) -> None:
        """Refuse options that name no unit of this layout (a layer index beyond the model, a
        pattern that matches nothing): they would be ignored silently. Called once the layout
        is known (``Tailor`` does, when it is built)."""
        problems = self._unit_problems(list(units))
        if problems:
            raise ConfigError(f"{type(self).__name__}: " + "; ".join(problems) + f" (units: {_span(list(units))})")

    def _unit_problems(self, units: list[str]) -> list[str]:
        return []

    @abstractmethod
    def select(self, ctx: SaveContext) -> set[str]:
        """The units this policy wants written at this save."""

    def choose(self, ctx: SaveContext) -> list[str]:
        """The units to write, in canonical order: ``select`` plus the rules above."""
        if self.full_every is not None and ctx.save_index % self.full_every == 0:
            return list(ctx.units)
        wanted = self.select(ctx) | {u for u in ctx.units if u not in ctx.last_saved}
        return [u for u in ctx.units if u in wanted]

    def decide(self, ctx: SaveContext) -> Decision:
        """``choose`` with the record kept in the manifest (fixed rules record nothing)."""
        return Decision(self.choose(ctx))

    def describe(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if v is not None}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


@dataclass(frozen=True)
class Full(Policy):
    """Every unit at every save."""

    def select(self, ctx: SaveContext) -> set[str]:
        return set(ctx.units)


@dataclass(frozen=True)
class Parity(Policy):
    """Even layers at even saves, odd layers at odd saves, auxiliary units every save
    (the LLMTailor paper's use case 1)."""

    def select(self, ctx: SaveContext) -> set[str]:
        parity = ctx.save_index % 2
        # By layer index, not position: the same layers whichever of them a layout holds.
        layers = {u for u in ctx.layer_units if int(u[len(LAYER_PREFIX):]) % 2 == parity}
        return layers | set(ctx.aux_units)


@dataclass(frozen=True)
class Filter(Policy):
    """Some units every save, the others every ``every``-th save (the paper's use case 2).

    ``always`` holds layer indices (negative counts from the last layer) and unit names or
    shell patterns (``"layer.1*"``). Default: the first two and last two layers, plus every
    auxiliary unit (``aux=True``)."""

    always: tuple[int | str, ...] = (0, 1, -2, -1)
    every: int = 4
    aux: bool = True

    def _problems(self) -> list[str]:
        problems = []
        if not isinstance(self.every, int) or self.every < 1:
            problems.append(f"every={self.every!r} must be a positive integer")
        for item in self.always:
            if not isinstance(item, (int, str)) or isinstance(item, bool):
                problems.append(f"always entry {item!r} must be a layer index or a unit name/pattern")
        return problems

    def _unit_problems(self, units: list[str]) -> list[str]:
        layers = [u for u in units if u.startswith(LAYER_PREFIX)]
        problems = []
        for item in self.always:
            if isinstance(item, int) and not -len(layers) <= item < len(layers):
                problems.append(f"always entry {item} is not a layer index of this model ({len(layers)} layers)")
            elif isinstance(item, str) and not fnmatch.filter(units, item):
                problems.append(f"always entry {item!r} matches no unit")
        return problems

    def select(self, ctx: SaveContext) -> set[str]:
        if ctx.save_index % self.every == 0:
            return set(ctx.units)
        layers = ctx.layer_units
        chosen = set(ctx.aux_units) if self.aux else set()
        for item in self.always:
            if isinstance(item, int):
                if -len(layers) <= item < len(layers):
                    chosen.add(layers[item])
            else:
                chosen.update(fnmatch.filter(ctx.units, item))
        return chosen


@dataclass(frozen=True)
class Interval(Policy):
    """A period per unit: a unit is written at saves whose index is a multiple of its period.

    ``periods`` maps unit names or shell patterns to periods (first match wins);
    unmatched units use ``default``."""

    periods: Mapping[str, int] = field(default_factory=dict)
    default: int = 1

    def _problems(self) -> list[str]:
        return [
            f"period of {key!r} is {value!r}; it must be a positive integer"
            for key, value in [*self.periods.items(), ("default", self.default)]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1
        ]

    def _unit_problems(self, units: list[str]) -> list[str]:
        return [f"pattern {pattern!r} matches no unit" for pattern in self.periods
                if not any(fnmatch.fnmatchcase(u, pattern) for u in units)]

    def period_of(self, unit: str) -> int:
        for pattern, period in self.periods.items():
            if fnmatch.fnmatchcase(unit, pattern):
                return period
        return self.default

    def select(self, ctx: SaveContext) -> set[str]:
        return {u for u in ctx.units if ctx.save_index % self.period_of(u) == 0}

    def __hash__(self) -> int:
        return hash((tuple(self.periods.items()), self.default, self.full_every))


@dataclass(frozen=True)
class Adaptive(Policy):
    """Units chosen by their measured drift since their last saved version (``llmtailor.drift``).

    Exactly one mode: ``threshold=t`` writes every unit whose drift exceeds ``t``;
    ``budget=B`` writes the units with the most drift that fit B bytes (an int) or that
    fraction of a full save (a float in (0, 1]), measured by each unit's last saved size
    (with 1% slack, so file headers do not push out a unit that fits by its tensors).
    Always, whatever the drift: a unit not saved for ``max_staleness`` saves is written (units
    whose parameters are all frozen excepted: nothing can change them), a unit never saved is
    written, and ``full_every`` forces full baselines. With ``aux=True`` (default) the auxiliary
    units (embed, norm, head) are written at every save, as Parity and Filter write them, and the
    drift decides among the layers (their bytes count against the budget). A unit's score is
    its weight drift (``on="weight"``, default), its moments' (``on="moments"``) or the larger
    (``on="max"``).

    The manifest records the figures and the decision (``decision``); ``replay`` re-derives the
    units from that record alone, so every decision can be audited."""

    threshold: float | None = None
    budget: float | int | None = None
    max_staleness: int = 4
    on: str = "weight"
    aux: bool = True

    def _problems(self) -> list[str]:
        problems = []
        if (self.threshold is None) == (self.budget is None):
            problems.append("give exactly one of threshold= (drift) or budget= (bytes, or a fraction of a full save)")
        if self.threshold is not None and (isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float))
                                           or not self.threshold >= 0):
            problems.append(f"threshold={self.threshold!r} must be a non-negative number")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
                problems.append(f"budget={self.budget!r} must be bytes (an int) or a fraction of a full save (a float)")
            elif isinstance(self.budget, float) and not 0 < self.budget <= 1:
                problems.append(f"budget={self.budget!r}: a fraction of a full save must be in (0, 1]")
            elif isinstance(self.budget, int) and self.budget < 0:
                problems.append(f"budget={self.budget!r} bytes must not be negative")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 1:
            problems.append(f"max_staleness={self.max_staleness!r} must be a positive integer (saves)")
        if self.on not in ("max", "weight", "moments"):
            problems.append(f"on={self.on!r} must be 'max', 'weight' or 'moments'")
        return problems

    def select(self, ctx: SaveContext) -> set[str]:
        return set(self.decide(ctx).units)

    @property
    def weighs_bytes(self) -> bool:
        return True  # its record holds every unit's bytes (its budget weighs them)

    def decide(self, ctx: SaveContext) -> Decision:
        if self.full_every is not None and ctx.save_index % self.full_every == 0:
            return Decision(list(ctx.units), {"policy": "Adaptive", "full_every": True})
        record = {
            "policy": "Adaptive",
            "save_index": ctx.save_index,
            "units": list(ctx.units),
            "never_saved": [u for u in ctx.units if u not in ctx.last_saved],
            "age": {u: ctx.save_index - ctx.last_saved_index[u] for u in ctx.units if u in ctx.last_saved_index},
            "score": {u: self._score((ctx.drift or {}).get(u)) for u in ctx.units},
            "bytes": {u: ctx.unit_bytes[u] for u in ctx.units if u in ctx.unit_bytes},
            "frozen": sorted(ctx.frozen),
            "always": ctx.aux_units if self.aux else [],
        }
        units = self.replay(record)
        return Decision(units, {**record, "chosen": units})

    def _score(self, figures: Mapping[str, float | None] | None) -> float | None:
        if not figures:
            return None
        values = [figures.get(kind) for kind in (("weight", "moments") if self.on == "max" else (self.on,))]
        known = [v for v in values if v is not None]
        return max(known) if known else None

    def replay(self, record: Mapping[str, object]) -> list[str]:
        """The units a save writes, from a decision record alone (what ``decide`` stores)."""
        units: list[str] = list(record["units"])  # type: ignore[arg-type]
        age: Mapping[str, int] = record["age"]  # type: ignore[assignment]
        score: Mapping[str, float | None] = record["score"]  # type: ignore[assignment]
        sizes: Mapping[str, int] = record["bytes"]  # type: ignore[assignment]
        frozen = set(record["frozen"])  # type: ignore[arg-type]
        forced = set(record["never_saved"]) | set(record.get("always", []))  # type: ignore[arg-type]
        forced |= {u for u in units if u not in frozen and age.get(u, 0) >= self.max_staleness}
        forced |= {u for u in units if score.get(u) is None and u not in frozen}  # nothing measured: save it
        candidates = [u for u in units if u not in forced and score.get(u) is not None]
        if self.threshold is not None:
            chosen = {u for u in candidates if score[u] > self.threshold}  # type: ignore[operator]
        else:
            total = sum(sizes.get(u, 0) for u in units)
            budget = (self.budget * total if isinstance(self.budget, float) else self.budget) * 1.01
            room = budget - sum(sizes.get(u, 0) for u in forced)  # type: ignore[operator]
            chosen = set()
            for unit in sorted(candidates, key=lambda u: (-score[u], units.index(u))):  # type: ignore[operator]
                if score[unit] > 0 and sizes.get(unit, 0) <= room:  # type: ignore[operator]
                    chosen.add(unit)
                    room -= sizes.get(unit, 0)
        picked = forced | chosen
        return [u for u in units if u in picked]


def _span(units: list[str]) -> str:
    layers = [u for u in units if u.startswith(LAYER_PREFIX)]
    aux = [u for u in units if not u.startswith(LAYER_PREFIX)]
    shown = [f"{layers[0]}..{layers[-1]}"] if len(layers) > 2 else layers
    return ", ".join(aux[:1] + shown + aux[1:])


def policy_names() -> Sequence[str]:
    return ("full", "parity", "filter", "interval", "adaptive")


def make_policy(name: str, **options: Any) -> Policy:
    """Build a policy by name (for the CLI and configuration files)."""
    classes: dict[str, type[Policy]] = {
        "full": Full, "parity": Parity, "filter": Filter, "interval": Interval, "adaptive": Adaptive,
    }
    if name not in classes:
        raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(policy_names())}")
    try:
        return classes[name](**options)
    except TypeError as err:
        raise ConfigError(f"policy {name!r}: {err}") from None
