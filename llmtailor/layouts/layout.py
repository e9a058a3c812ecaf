"""Layouts: the unit (embed, layer.<i>, norm, head, other) of every tensor of a model.

Families are data: one JSON file each in ``families/``, read by the one code path below;
``generic.json`` is the fallback for models no family claims. A family file holds ``family``
(its file's stem), ``model_types`` (the HF ``config.model_type`` values it serves), an optional
``_doc`` note, and for ``embed``, ``layer``, ``norm`` and ``head`` a list of name patterns, e.g.
``"layer": ["model.layers.{i}.", "layers.{i}."]``, and ``num_layers_key``: the key of the
model's HF config holding its number of layers (``num_hidden_layers``, gpt2's ``n_layer``),
which a merge that changes the depth updates; any other key is an error.

A pattern is a dotted name prefix ending in ``.``; ``{i}`` captures the layer index. It matches
at the start of a name or after any ``.``, so wrapped models (``module.``, ``_orig_mod.``) need
no extra patterns. When several match, the earliest match (the outermost module) wins, so
``layers.0.norm.weight`` is in ``layer.0``; ties go to the key listed first; no match: ``other``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from llmtailor.constants import EMBED, HEAD, LAYER_PREFIX, NORM, OTHER, layer_unit
from llmtailor.errors import ConfigError, IncompatibleModelError, describe_validation

if TYPE_CHECKING:
    import torch

GENERIC = "generic"
_INDEX = "{i}"
_FAMILIES_DIR = Path(__file__).with_name("families")
_LAYER_KEY = LAYER_PREFIX.rstrip(".")  # the family-file key holding layer patterns
_PATTERN_KEYS = (EMBED, _LAYER_KEY, NORM, HEAD)  # also the tie-break order
_AUX_RANK = {EMBED: 0, NORM: 2, HEAD: 3, OTHER: 4}  # layers rank 1, between embed and norm
_LAYER_UNIT = re.compile(re.escape(LAYER_PREFIX) + r"(0|[1-9][0-9]*)")


class UnknownTensorError(IncompatibleModelError, KeyError):
    """A tensor name the layout does not hold; also a KeyError, for mapping-style callers."""
    __str__ = Exception.__str__  # KeyError's own would quote the whole message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, data: object, where: str):
        """Validate JSON text or objects, or raise one ConfigError naming ``where`` and every bad key."""
        try:
            return cls.model_validate_json(data) if isinstance(data, str) else cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(f"{where}: {describe_validation(err, limit=50)}") from None


class _LayoutRecord(_Strict):
    family: str
    units: dict[str, list[str]]
    aliases: dict[str, str]


class FamilySpec(_Strict):
    """One family's name patterns, validated from its JSON file (schema: module docstring)."""
    family: str
    model_types: tuple[str, ...] = ()
    num_layers_key: str | None = None
    embed: tuple[str, ...] = ()
    layer: tuple[str, ...] = ()
    norm: tuple[str, ...] = ()
    head: tuple[str, ...] = ()
    doc: str = Field("", alias="_doc")

    @field_validator(*_PATTERN_KEYS)
    @classmethod
    def _check_patterns(cls, patterns: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        wanted = int(info.field_name == _LAYER_KEY)  # only layer patterns carry an index
        bad = [p for p in patterns if not p.endswith(".") or p.startswith(".") or p.count(_INDEX) != wanted]
        if bad:
            raise ValueError(f"patterns {bad} must be dotted prefixes ending in '.' with {wanted} {_INDEX}")
        return patterns

    @classmethod
    def from_json(cls, path: Path) -> FamilySpec:
        """Read and validate a family file; one ConfigError names the file and every bad key."""
        spec = cls.parse(Path(path).read_text(), str(path))
        if spec.family != Path(path).stem:
            raise ConfigError(f"{path}: key 'family' is {spec.family!r}, expected the file's stem")
        return spec

    @cached_property
    def matchers(self) -> list[tuple[str, re.Pattern[str]]]:
        """(key, regex) pairs in tie-break order; group 1 of a layer regex is the index."""
        boundary = r"(?<![^.])"  # the start of the name or just after a '.'
        return [(key, re.compile(boundary + r"(\d+)".join(map(re.escape, p.split(_INDEX)))))
                for key in _PATTERN_KEYS for p in getattr(self, key)]

    def unit_for(self, name: str) -> str:
        """The unit of tensor ``name`` under this family's patterns (``other`` if none match)."""
        hit = self._hit(name)
        if hit is None:
            return OTHER
        key, m = hit
        return layer_unit(int(m.group(1))) if key == _LAYER_KEY else key

    def stack_of(self, name: str) -> str | None:
        """The stack of layers tensor ``name`` is a layer of, named by what precedes its index
        (``model.layers``); None for a tensor of no layer."""
        hit = self._hit(name)
        return name[:hit[1].start(1)].rstrip(".") if hit is not None and hit[0] == _LAYER_KEY else None

    def _hit(self, name: str) -> tuple[str, re.Match[str]] | None:
        hits = [(m.start(), key, m) for key, regex in self.matchers if (m := regex.search(name))]
        if not hits:
            return None
        _, key, m = min(hits, key=lambda hit: hit[0])  # min keeps the first of equal starts
        return key, m


def list_families() -> list[str]:
    """Names of the shipped families, sorted; ``generic`` is among them."""
    return sorted(path.stem for path in _FAMILIES_DIR.glob("*.json"))


@cache
def load_family(name: str) -> FamilySpec:
    """The validated spec of family ``name``; ConfigError listing the known families if unknown."""
    if name not in list_families():
        raise ConfigError(f"unknown model family {name!r}; known families: {', '.join(list_families())}")
    return FamilySpec.from_json(_FAMILIES_DIR / f"{name}.json")


def unit_rank(unit: str) -> tuple[int, int] | None:
    """Sort key of the canonical unit order; None for a string that is not a unit name."""
    m = _LAYER_UNIT.fullmatch(unit)
    return (1, int(m.group(1))) if m else ((_AUX_RANK[unit], 0) if unit in _AUX_RANK else None)


def name_units(units: list[str], limit: int = 6) -> str:
    """Unit names for a message: all of them, or the first ``limit`` and how many in all."""
    return ", ".join(units) if len(units) <= limit else f"{', '.join(units[:limit])}, ... ({len(units)} in all)"


@dataclass(frozen=True)
class Layout:
    """Which unit each tensor of one model belongs to. Invariants: ``units`` is in canonical
    order (embed, layer.0..N-1 numerically, norm, head, other), holds only non-empty units and
    each canonical name once, in model order; an alias (a later name of a tied tensor) maps to a
    canonical name and shares its unit, so a head tied to the embedding is in ``embed``, once.
    """

    family: str
    units: dict[str, tuple[str, ...]]  # lists are accepted and stored as tuples
    aliases: dict[str, str] = field(default_factory=dict)
    _unit_by_name: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ordered = {u: tuple(self.units[u]) for u in sorted(self.units, key=unit_rank)}
        object.__setattr__(self, "units", ordered)  # canonical order, whoever built the dict
        index = self._canonical_units()
        index.update({alias: index[target] for alias, target in self.aliases.items()})
        object.__setattr__(self, "_unit_by_name", index)

    def _canonical_units(self) -> dict[str, str]:
        return {name: unit for unit, names in self.units.items() for name in names}

    def unit_of(self, name: str) -> str:
        """The unit of a canonical or alias tensor name; UnknownTensorError for any other."""
        try:
            return self._unit_by_name[name]
        except KeyError:
            raise UnknownTensorError(f"tensor {name!r} is not in the {self.family!r} layout") from None

    @property
    def num_layers(self) -> int:
        return len(self.layer_units())

    def layer_units(self) -> list[str]:
        return [u for u in self.units if u.startswith(LAYER_PREFIX)]

    def layer_stacks(self) -> list[str]:
        """The stacks of layers the layer units hold, in model order, each named by what
        precedes the layer index: one for a language model (``model.layers``); several for a
        multimodal one under the name-based fallback (``model.language_model.layers``,
        ``model.vision_tower.encoder.layers``), whose unit ``layer.<i>`` holds layer i of each."""
        spec = load_family(self.family)
        stacks = (spec.stack_of(name) for unit in self.layer_units() for name in self.units[unit])
        return list(dict.fromkeys(s for s in stacks if s is not None))

    def aux_units(self) -> list[str]:
        return [u for u in self.units if not u.startswith(LAYER_PREFIX)]

    def tensor_names(self) -> list[str]:
        return [name for names in self.units.values() for name in names]

    def to_record(self) -> dict:
        return {"family": self.family, "units": {u: list(n) for u, n in self.units.items()},
                "aliases": dict(self.aliases)}

    @classmethod
    def from_record(cls, record: dict) -> Layout:
        """Inverse of ``to_record``; one ConfigError names every bad key."""
        r = _LayoutRecord.parse(record, "layout record")
        counts = Counter(name for names in r.units.values() for name in names)
        problems = [f"units[{u!r}]: expected a unit (embed, layer.<i>, norm, head, other) with tensors"
                    for u, names in r.units.items() if unit_rank(u) is None or not names]
        problems += [f"units: tensor {n!r} is listed {c} times" for n, c in counts.items() if c > 1]
        problems += [f"aliases[{a!r}]: must map a non-canonical name to a canonical one"
                     for a, target in r.aliases.items() if a in counts or target not in counts]
        if problems:
            raise ConfigError("layout record: " + "; ".join(problems))
        return cls(r.family, r.units, r.aliases)

    def diff(self, other: Layout) -> list[str]:
        """What ``other`` lacks, adds or moves relative to this layout; empty if units+names match."""
        out = [f"unit {u} missing ({len(self.units[u])} tensors)" for u in self.units if u not in other.units]
        out += [f"unit {u} extra ({len(other.units[u])} tensors)" for u in other.units if u not in self.units]
        mine, theirs = self._canonical_units(), other._canonical_units()
        # Tensors of a unit missing or extra as a whole are covered by the unit's line above.
        out += [f"tensor {n!r} missing from unit {u}" for n, u in mine.items() if u in other.units and n not in theirs]
        out += [f"tensor {n!r} extra in unit {u}" for n, u in theirs.items() if u in self.units and n not in mine]
        out += [f"tensor {n!r} moved from unit {u} to {theirs[n]}" for n, u in mine.items()
                if n in theirs and theirs[n] != u and u in other.units]
        return out


def build_layout(model: torch.nn.Module, family: str | None = None,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> Layout:
    """Map every tensor of ``model.state_dict()`` (persistent buffers included) to a unit;
    ``tensors``: the model's tensors under the names a provider gives them, where those differ
    from its state dict's (a DeepSpeed engine's random-LTD wrappers left out, say).

    Family: ``family``, else the first HF ``config.model_type`` on the model or a wrapped module
    if a family serves it, else ``generic``. A tensor object under several names (tied weights)
    counts once: the first name is canonical, later ones become its aliases."""
    spec = load_family(family) if family is not None else _detect_family(model)
    units: dict[str, list[str]] = {}
    aliases: dict[str, str] = {}
    canonical_by_id: dict[int, str] = {}  # ids stay unique: the state dict keeps every tensor alive
    for name, tensor in (model.state_dict(keep_vars=True) if tensors is None else tensors).items():
        canonical = canonical_by_id.setdefault(id(tensor), name)
        if canonical != name:
            aliases[name] = canonical
        else:
            units.setdefault(spec.unit_for(name), []).append(name)
    return Layout(spec.family, units, aliases)


def layout_from_names(names: list[str], family: str = GENERIC, aliases: dict[str, str] | None = None) -> Layout:
    """The layout of a model known only by its tensor names (in model order), e.g. from a
    checkpoint without a model config; ``aliases`` maps tied names to their canonical one."""
    spec = load_family(family)
    units: dict[str, list[str]] = {}
    for name in names:
        if name not in (aliases or {}):
            units.setdefault(spec.unit_for(name), []).append(name)
    return Layout(spec.family, units, dict(aliases or {}))


def _detect_family(model: torch.nn.Module) -> FamilySpec:
    # Pre-order, so the outermost config wins; wrappers (DDP, torch.compile, PEFT) hold the HF model.
    types = (getattr(getattr(m, "config", None), "model_type", None) for m in model.modules())
    model_type = next((t for t in types if isinstance(t, str)), None)
    served = [f for f in list_families() if model_type in load_family(f).model_types]
    return load_family(served[0] if served else GENERIC)  # tests check a model_type has one family

