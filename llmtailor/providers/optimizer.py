"""Optimizer state matched by parameter name, never by position alone.

torch optimizers key their state by parameter object and their ``state_dict`` by position
in the param groups. A snapshot stores each parameter's state under its name, and the param
groups with names in place of positions, so state saved from one optimizer loads into another
built with the same parameters in any group order, and a unit's state can be taken from one
snapshot and its neighbour's from another.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtailor.errors import IncompatibleModelError

ParamState = dict[str, Any]


def innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers such as accelerate's ``AcceleratedOptimizer``: the
    one whose ``step`` runs the update (and fires step hooks)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def group_records(optimizer: torch.optim.Optimizer, name_of: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's param groups as saved: hyperparameters, and ``params`` as names."""
    records = []
    for index, group in enumerate(optimizer.param_groups):
        record = {key: value for key, value in group.items() if key != "params"}
        record["params"] = [_name(name_of, p, index) for p in group["params"]]
        records.append(record)
    return records


def param_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> ParamState:
    """The live state of one parameter (references, not copies); empty before its first step."""
    return optimizer.state.get(param, {})


def load_by_name(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    state: dict[str, ParamState],
    name_of: dict[int, str],
) -> None:
    """Load saved ``groups`` (names in ``params``) and per-name ``state`` into ``optimizer``.

    The live optimizer must hold the same parameters in the same grouping (group order and
    order within a group may differ). Goes through ``Optimizer.load_state_dict`` so torch's
    own rules (dtype and device of state, hooks) apply."""
    live = [[_name(name_of, p, i) for p in g["params"]] for i, g in enumerate(optimizer.param_groups)]
    ordered = _match_groups(live, groups)
    live_order = [{**saved, "params": names} for saved, names in zip(ordered, live)]
    optimizer.load_state_dict(positional_state_dict(live_order, state))


def positional_state_dict(groups: list[dict[str, Any]], state: dict[str, ParamState]) -> dict[str, Any]:
    """``Optimizer.state_dict()``'s form of ``groups`` (``params`` as names) and per-name
    ``state``: parameters numbered across the groups in their order, as torch does; a
    parameter without state gets no entry."""
    index: dict[str, int] = {}
    param_groups = []
    for group in groups:
        numbers = [index.setdefault(name, len(index)) for name in group["params"]]
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    numbered = {index[name]: dict(entries) for name, entries in state.items() if name in index and entries}
    return {"state": dict(sorted(numbered.items())), "param_groups": param_groups}


def _match_groups(live: list[list[str]], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each live group, the saved group holding exactly its parameters."""
    by_members = {frozenset(g["params"]): g for g in saved}
    ordered, problems = [], []
    for index, names in enumerate(live):
        match = by_members.get(frozenset(names))
        if match is None:
            problems.append(_describe_mismatch(index, names, saved))
        ordered.append(match)
    if problems or len(saved) != len(live):
        raise IncompatibleModelError(
            f"the optimizer's param groups differ from the snapshot's ({len(live)} live, {len(saved)} saved): "
            + "; ".join(problems or ["group counts differ"])
        )
    return ordered


def _describe_mismatch(index: int, names: list[str], saved: list[dict[str, Any]]) -> str:
    live = set(names)
    best = max(saved, key=lambda g: len(live & set(g["params"])), default={"params": []})
    missing = sorted(set(best["params"]) - live)[:3]
    extra = sorted(live - set(best["params"]))[:3]
    return f"live group {index} ({len(names)} params) matches no saved group (closest lacks {extra}, has extra {missing})"


def _name(name_of: dict[int, str], param: torch.Tensor, group: int) -> str:
    try:
        return name_of[id(param)]
    except KeyError:
        raise IncompatibleModelError(
            f"optimizer param group {group} holds a tensor of shape {tuple(param.shape)} that is not a "
            "parameter of the model; llmtailor matches optimizer state by parameter name"
        ) from None
