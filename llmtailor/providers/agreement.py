"""What the ranks of a job must hold alike: one layout, agreed when a ``Tailor`` is built.

The leader commits one manifest recording one layout, the run's: the union of what the ranks
hold. Ranks may hold different units as pipeline-parallel stages do (torchtitan's pipeline
split keeps the original names of the layers each stage holds): each group of ranks holding the
same units is a stage, and a unit is held whole by the ranks of one stage (each its shards of
it, under FSDP2). What cannot be saved that way is refused on every rank alike, before any other
collective (drift sampling, the writer lock, a save) could hang or commit part of the model:
ranks of one stage holding different models, stages of different model families, a unit held
by two stages (a layer split between them, or a stage's units overlapping another's). The ranks
exchange a digest of what they hold; only where they differ does each distinct layout travel once.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from llmtailor.errors import UnsupportedLayoutError
from llmtailor.layouts import Layout, name_units
from llmtailor.providers.base import Stages, StateProvider
from llmtailor.store.manifest import dtype_name

_SHOWN = 4  # differences named per group of ranks


def held_layout(provider: StateProvider) -> dict[str, Any]:
    """This rank's layout record (units, tensor names, aliases) with every tensor's global shape
    and dtype: what each rank of a job must hold alike (JSON)."""
    specs = {name: [list(shape), dtype_name(dtype)] for name, (shape, dtype) in provider.live_specs().items()}
    return {**provider.layout.to_record(), "specs": specs}


def agree_layout(provider: StateProvider, tag: str) -> Stages:
    """Collective (every rank, the same ``tag``): the ``Stages`` of the job, the same on every
    rank, set as ``provider.stages``: one stage when every rank holds the same layout
    (``held_layout``), else one per group of ranks holding the same units, the run's layout their
    union. Raises one UnsupportedLayoutError, the same on every rank, for what cannot be saved
    (module docstring). One small message per rank when the ranks hold the same layout."""
    coordinator = provider.coordinator
    if coordinator.world_size == 1:
        return provider.stages
    record = held_layout(provider)
    digests = coordinator.exchange(f"{tag}/digest", layout_digest(record))
    if len(set(digests)) == 1:
        provider.stages = Stages.single(provider.layout, coordinator.world_size)
    else:
        groups: dict[str, list[int]] = {}
        for rank, held in enumerate(digests):
            groups.setdefault(held, []).append(rank)
        first = {ranks[0] for ranks in groups.values()}  # one rank of each group sends its layout
        records = coordinator.exchange(f"{tag}/layouts", record if coordinator.rank in first else None)
        provider.stages = stages_of([(ranks, records[ranks[0]]) for ranks in groups.values()])
    return provider.stages


def stages_of(groups: list[tuple[list[int], dict[str, Any]]]) -> Stages:
    """The stages of ranks grouped by the layout they hold (``held_layout`` records, rank 0's group
    first): each group a stage, when no unit is held by two groups and every group's family is
    rank 0's; else UnsupportedLayoutError (``describe_layouts``)."""
    held: dict[str, list[int]] = {}
    for ranks, record in groups:
        for unit in record["units"]:
            held.setdefault(unit, []).append(ranks[0])
    shared = [unit for unit, firsts in held.items() if len(firsts) > 1]
    families = {record["family"] for _, record in groups}
    if shared or len(families) > 1:
        raise UnsupportedLayoutError(describe_layouts(groups))
    layouts = [Layout.from_record({key: record[key] for key in ("family", "units", "aliases")}) for _, record in groups]
    union = Layout(layouts[0].family, {u: names for layout in layouts for u, names in layout.units.items()},
                   {alias: name for layout in layouts for alias, name in layout.aliases.items()})
    return Stages(union, tuple((tuple(ranks), tuple(layout.units)) for (ranks, _), layout in zip(groups, layouts)))


def layout_digest(record: dict[str, Any]) -> str:
    """A digest of a ``held_layout`` record; each unit's tensor names are sorted first (ranks
    listing them in another order hold the same layout)."""
    canonical = {**record, "units": {unit: sorted(names) for unit, names in record["units"].items()}}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def describe_layouts(groups: list[tuple[list[int], dict[str, Any]]]) -> str:
    """One line naming how each group of ranks (rank 0's first) holds another layout than rank
    0's, and what is supported: ranks holding the same units must hold the same model; ranks
    holding different units (pipeline stages) must not share a unit."""
    (_, reference), *others = groups
    problems, stages = [], False
    for ranks, record in others:
        who, verb = (f"rank {ranks[0]}", "s") if len(ranks) == 1 else (f"ranks {', '.join(map(str, ranks))}", "")
        extra = [u for u in record["units"] if u not in reference["units"]]
        lacking = [u for u in reference["units"] if u not in record["units"]]
        if extra:
            problems.append(f"{who} hold{verb} units [{name_units(extra)}] that rank 0 does not")
        if lacking:
            problems.append(f"{who} lack{verb} units [{name_units(lacking)}] that rank 0 holds")
        stages = stages or bool(extra or lacking)
        if not (extra or lacking):
            differences = _tensor_differences(reference, record)
            more = [f"... ({len(differences)} differences in all)"] if len(differences) > _SHOWN else []
            problems += [f"{who}: {d}" for d in differences[:_SHOWN]] + more
    if stages:
        shared = _shared_units(groups)
        return (f"the ranks of this job hold different units of the model: {'; '.join(problems)}. "
                + (f"Units [{name_units(shared)}] are held by ranks holding different units: " if shared else
                   "They are not of one model family: ")
                + "ranks may hold different layers (pipeline-parallel stages) only as stages of one model, each unit "
                  "held whole by the ranks of one stage, with the same units")
    return (f"the ranks of this job hold different models: {'; '.join(problems)}; "
            "every rank must build the same model")


def _shared_units(groups: list[tuple[list[int], dict[str, Any]]]) -> list[str]:
    """The units more than one group holds."""
    seen: dict[str, int] = {}
    for _, record in groups:
        for unit in record["units"]:
            seen[unit] = seen.get(unit, 0) + 1
    return [unit for unit, count in seen.items() if count > 1]


def _tensor_differences(reference: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """What differs between two layouts of the same units: family, tensor names, tied names,
    global shapes and dtypes."""
    out = [] if record["family"] == reference["family"] else [
        f"layout family {record['family']!r}, rank 0's {reference['family']!r}"]
    layouts = [Layout.from_record({key: r[key] for key in ("family", "units", "aliases")}) for r in (reference, record)]
    out += layouts[0].diff(layouts[1])
    if record["aliases"] != reference["aliases"]:
        out.append(f"tied tensors {record['aliases']}, rank 0's {reference['aliases']}")
    mine, theirs = reference["specs"], record["specs"]
    out += [f"{name} is {theirs[name][1]} {theirs[name][0]}, rank 0's {spec[1]} {spec[0]}"
            for name, spec in mine.items() if name in theirs and theirs[name] != spec]
    return out


__all__ = ["agree_layout", "describe_layouts", "held_layout", "layout_digest", "stages_of"]
