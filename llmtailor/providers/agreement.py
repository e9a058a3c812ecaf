"""What the ranks of a job must hold alike: one layout, checked when a ``Tailor`` is built.

Every rank of a job saves and restores the same units (each its own pieces of them) and the
leader commits one manifest recording one layout, so every rank must see the same model: the
same units, the same tensor names, global shapes and dtypes. Ranks holding different layers
(pipeline-parallel stages, as torchtitan's pipeline split keeps the original names of the
layers each stage holds) or models built differently are refused on every rank alike, before
any other collective (drift sampling, the writer lock, a save) could hang or commit part of
the model. The ranks exchange a digest of what they hold; only on a mismatch does each
distinct layout travel once, to name what differs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from llmtailor.errors import UnsupportedLayoutError
from llmtailor.layouts import Layout, name_units
from llmtailor.providers.base import StateProvider
from llmtailor.store.manifest import dtype_name

_SHOWN = 4  # differences named per group of ranks


def held_layout(provider: StateProvider) -> dict[str, Any]:
    """This rank's layout record (units, tensor names, aliases) with every tensor's global shape
    and dtype: what each rank of a job must hold alike (JSON)."""
    specs = {name: [list(shape), dtype_name(dtype)] for name, (shape, dtype) in provider.live_specs().items()}
    return {**provider.layout.to_record(), "specs": specs}


def check_same_layout(provider: StateProvider, tag: str) -> None:
    """Collective (every rank, the same ``tag``): return when every rank holds the same layout
    (``held_layout``), else raise one UnsupportedLayoutError, the same on every rank, naming
    the ranks and what they hold differently. One small message per rank when they agree."""
    coordinator = provider.coordinator
    if coordinator.world_size == 1:
        return
    record = held_layout(provider)
    digests = coordinator.exchange(f"{tag}/digest", layout_digest(record))
    if len(set(digests)) == 1:
        return
    groups: dict[str, list[int]] = {}
    for rank, held in enumerate(digests):
        groups.setdefault(held, []).append(rank)
    first = {ranks[0] for ranks in groups.values()}  # one rank of each group sends its layout
    records = coordinator.exchange(f"{tag}/layouts", record if coordinator.rank in first else None)
    raise UnsupportedLayoutError(describe_layouts([(ranks, records[ranks[0]]) for ranks in groups.values()]))


def layout_digest(record: dict[str, Any]) -> str:
    """A digest of a ``held_layout`` record; each unit's tensor names are sorted first (ranks
    listing them in another order hold the same layout)."""
    canonical = {**record, "units": {unit: sorted(names) for unit, names in record["units"].items()}}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def describe_layouts(groups: list[tuple[list[int], dict[str, Any]]]) -> str:
    """One line naming how each group of ranks (rank 0's first) holds another layout than rank
    0's, and what is supported."""
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
        return (f"the ranks of this job hold different units of the model: {'; '.join(problems)}. Ranks holding "
                "different layers (pipeline-parallel stages) are not supported yet: every rank must hold every unit "
                "(data parallel, FSDP2 or DeepSpeed ZeRO shards of the whole model)")
    return (f"the ranks of this job hold different models: {'; '.join(problems)}; "
            "every rank must build the same model")


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


__all__ = ["check_same_layout", "describe_layouts", "held_layout", "layout_digest"]
