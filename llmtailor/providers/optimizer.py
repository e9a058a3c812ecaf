"""Optimizer state matched by parameter name, never by position alone.

torch optimizers key their state by parameter object and their ``state_dict`` by position
in the param groups. A snapshot stores each parameter's state under its name, and the param
groups with names in place of positions, so state saved from one optimizer loads into another
built with the same parameters in any group order, and a unit's state can be taken from one
snapshot and its neighbour's from another.

Wrapper optimizers (``OptimizerChain``): an optimizer holding an inner torch optimizer, such as
pytorch_optimizer's ``Lookahead`` (its own per-parameter slow weights over AdamW's moments) or
accelerate's ``AcceleratedOptimizer`` (no state of its own), is seen as the chain of optimizers
that keep state. Each parameter's state is saved from every level: the innermost torch
optimizer's under its own keys (``exp_avg``), a wrapper's under its class name
(``Lookahead.slow_params``); param groups are the innermost's, which the wrappers share. What a
chain cannot be captured completely from (several inner optimizers, a wrapper with param groups
of its own, state not keyed by parameters, a sharded optimizer such as
``ZeroRedundancyOptimizer``) is refused when the ``Tailor`` is built, naming what is missing.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch

from llmtailor.errors import IncompatibleModelError, IntegrityError, UnsupportedStateError

ParamState = dict[str, Any]

# Optimizers whose per-parameter state is the same (exp_avg, exp_avg_sq, step): a snapshot of
# one restores into another (a DeepSpeed run with FusedAdam into torch's AdamW, say).
_ADAM_FAMILY = {"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"}
# Optimizers that shard their state over ranks in their own way: a rank holds only its share.
_SHARDED = {"ZeroRedundancyOptimizer"}


def class_name(optimizer: Any) -> str:
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


class OptimizerChain:
    """A user's optimizer as the levels that keep per-parameter state, outermost first (module
    docstring). ``levels`` pairs each with the prefix of its state keys in a snapshot."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        chain = [optimizer]
        while True:
            inner = [v for v in vars(chain[-1]).values() if isinstance(v, torch.optim.Optimizer) and v is not chain[-1]]
            name = type(chain[-1]).__name__
            if name in _SHARDED:
                raise UnsupportedStateError(
                    f"{name} shards the optimizer state over the ranks in its own way, so no rank can save it by "
                    "parameter: llmtailor needs a plain torch optimizer (under DDP), FSDP2 or a DeepSpeed ZeRO engine"
                )
            if len(inner) > 1:
                raise UnsupportedStateError(
                    f"{name} holds several optimizers ({', '.join(type(o).__name__ for o in inner)}): llmtailor cannot "
                    "tell which state belongs where; give Tailor one optimizer"
                )
            if not inner:
                break
            chain.append(inner[0])
        self.innermost = chain[-1]
        self.chain = chain
        """Every level, outermost first (wrappers without state of their own included)."""
        seen: set[int] = set()
        levels: list[tuple[str, torch.optim.Optimizer]] = []
        for level in reversed(chain):  # innermost first: a wrapper sharing its state is skipped
            state = getattr(level, "state", None)
            if state is None or id(state) in seen:
                continue
            seen.add(id(state))
            levels.append(("" if level is self.innermost else f"{type(level).__name__}.", level))
        self.levels = levels[::-1]
        for _, level in self.levels:
            groups = getattr(level, "param_groups", None)
            if groups is not None and groups is not self.innermost.param_groups:
                raise UnsupportedStateError(
                    f"{type(level).__name__} keeps param groups of its own beside {type(self.innermost).__name__}'s; "
                    "llmtailor saves the innermost optimizer's groups only"
                )
        self.check_keys()

    def hookable(self) -> list[torch.optim.Optimizer]:
        """The levels whose ``step`` fires torch's step hooks (the innermost always does; a
        wrapper that never ran ``Optimizer.__init__``, like accelerate's, does not)."""
        return [level for level in self.chain if hasattr(level, "_optimizer_step_pre_hooks")]

    def classes(self) -> list[str]:
        """The classes of the levels that keep state, outermost first (recorded in a snapshot)."""
        return [class_name(level) for _, level in self.levels]

    def check_keys(self) -> None:
        """Refuse state not keyed by parameter (a global counter under a string key, say): it
        has no unit to travel with."""
        for _, level in self.levels:
            odd = [key for key in level.state if not isinstance(key, torch.Tensor)]
            if odd:
                raise UnsupportedStateError(
                    f"{type(level).__name__} keeps state under {odd[:3]!r}, not by parameter: llmtailor saves "
                    "optimizer state by parameter name and cannot capture it"
                )

    def param_state(self, param: torch.Tensor) -> ParamState:
        """Every level's live state of ``param`` (references), wrapper keys prefixed."""
        merged: ParamState = {}
        for prefix, level in self.levels:
            for key, value in level.state.get(param, {}).items():
                merged[prefix + key] = value
        return merged

    def group_records(self, name_of: dict[int, str]) -> list[dict[str, Any]]:
        return group_records(self.innermost, name_of)

    def load_by_name(self, groups: list[dict[str, Any]], state: dict[str, ParamState], name_of: dict[int, str],
                     frozen: Set[str] = frozenset()) -> None:
        """The innermost optimizer's groups and state through ``load_by_name``; each wrapper's
        per-parameter state set directly (its own ``load_state_dict`` has a format of its own)."""
        prefixes = [prefix for prefix, _ in self.levels if prefix]
        own = {name: {k: v for k, v in entries.items() if not k.startswith(tuple(prefixes))} for name, entries in state.items()}
        load_by_name(self.innermost, groups, own, name_of, frozen)
        params = {name: p for g in self.innermost.param_groups for p in g["params"] if (name := name_of.get(id(p)))}
        for prefix, level in self.levels:
            if not prefix:
                continue
            for name, entries in state.items():
                values = {k[len(prefix):]: v for k, v in entries.items() if k.startswith(prefix)}
                if values and name in params:
                    param = params[name]
                    level.state[param] = {
                        k: v.to(param.device) if isinstance(v, torch.Tensor) else v for k, v in values.items()
                    }

    def check_groups(self, groups: list[dict[str, Any]], name_of: dict[int, str], frozen: Set[str] = frozenset()) -> None:
        """Refuse saved ``groups`` that do not hold the live groups' parameters (names), the
        model's ``frozen`` ones aside (``match_groups``)."""
        match_groups([[_name(name_of, p, i) for p in g["params"]] for i, g in enumerate(self.innermost.param_groups)], groups,
                      frozen)

    def check_restorable(
        self, shared: dict[str, Any], saved_state: dict[str, set[str]], tensors: dict[str, torch.Tensor]
    ) -> None:
        """Refuse a snapshot saved from another kind of optimizer (before any byte is read): by
        its recorded class, else by what its groups and state hold (``check_group_keys``,
        ``check_state_keys``); ``tensors`` are the live parameters by name."""
        check_classes(shared.get("optimizer_class"), self.classes())
        live = type(self.innermost).__name__
        check_group_keys(shared["optimizer_groups"], self.innermost)
        check_state_keys(saved_state, {name: set(self.param_state(t)) for name, t in tensors.items()}, live)


def check_classes(saved: list[str] | None, live: list[str]) -> None:
    """Refuse a snapshot saved from another optimizer (before any byte is read): its state
    would load and the next step fail, or worse. The same wrappers over optimizers of one
    family of equal per-parameter state pass (Adam, AdamW, DeepSpeed's FusedAdam and CPU
    Adam). Snapshots that record no class (imports, merges, earlier versions) are judged by
    their keys alone (``check_group_keys``, ``check_state_keys``)."""
    if not saved:
        return
    if not isinstance(saved, list) or not all(isinstance(name, str) for name in saved):
        raise IntegrityError(f"the snapshot's optimizer_class {saved!r} is malformed (a list of class names expected)")
    if _same_kind(saved, live):
        return
    raise IncompatibleModelError(
        f"the snapshot's optimizer is {' over '.join(saved)}, the live one {' over '.join(live)}: their state does "
        "not carry over; build the optimizer the run was saved with"
    )


def check_group_keys(groups: list[dict[str, Any]], live: torch.optim.Optimizer) -> None:
    """Refuse saved param groups that lack a hyperparameter the live optimizer's ``step`` reads.

    ``load_state_dict`` replaces the live groups with the saved ones, and an optimizer fills in
    by itself only the switches torch added over versions (``foreach``, ``maximize``, ...): a
    snapshot from AdamW would load into ``SGD(momentum=0.9)`` and its next step raise
    ``KeyError: 'momentum'``. This is what tells another optimizer apart in a snapshot that
    records no class (``import-hf``, ``import-deepspeed``). Keys beyond the live optimizer's (an
    LR scheduler's ``initial_lr``, FusedAdam's ``bias_correction``) are harmless and pass."""
    filled = filled_on_load(live)
    needed = {key for group in live.param_groups for key in group} - filled
    for index, group in enumerate(groups):
        if not isinstance(group, dict):
            raise IntegrityError(f"the snapshot's optimizer param group {index} is malformed (a dict expected)")
        missing = sorted(needed - set(group))
        if missing:
            extra = sorted(set(group) - needed - filled)
            raise IncompatibleModelError(
                f"the snapshot's optimizer param group {index} lacks {missing}, which the live {type(live).__name__} "
                f"reads (it holds {extra} instead): the run was saved with another optimizer; build the one it was "
                "saved with"
            )


def filled_on_load(optimizer: torch.optim.Optimizer) -> set[str]:
    """The group keys ``optimizer``'s class sets itself when loading groups that lack them (its
    ``__setstate__``, which ``load_state_dict`` calls), found by loading an empty group into a
    blank instance; with ``params``. An optimizer whose own loading cannot take an empty group
    is not second-guessed: every key counts as filled."""
    kind = type(optimizer)
    try:
        probe = kind.__new__(kind)
        probe.__setstate__({"defaults": dict(optimizer.defaults), "state": {}, "param_groups": [{"params": []}]})
        return set(probe.param_groups[0])
    except Exception:  # noqa: BLE001 - a custom __setstate__: leave the judgement to its own load
        return {key for group in optimizer.param_groups for key in group}


def check_state_keys(saved: dict[str, set[str]], live: dict[str, set[str]], optimizer: str) -> None:
    """Refuse a snapshot whose per-parameter state lacks keys the live optimizer keeps, for the
    parameters both hold state of (``saved``: the composite's keys by parameter name, from
    its unit indexes; ``live``: the live optimizer's). Loaded, it would leave the next step
    without them (Adamax's ``exp_inf`` in an AdamW snapshot: both have the same group keys). A
    fresh optimizer keeps no state yet, so only its group keys speak for it."""
    for name in sorted(saved.keys() & live.keys()):
        missing = sorted(live[name] - saved[name])
        if saved[name] and live[name] and missing:
            raise IncompatibleModelError(
                f"the snapshot's optimizer state of {name!r} holds {sorted(saved[name])}, but the live {optimizer} "
                f"keeps {missing} too: the run was saved with another optimizer; build the one it was saved with"
            )


def _same_kind(saved: list[str], live: list[str]) -> bool:
    if saved == live:
        return True
    short = [[name.rsplit(".", 1)[-1] for name in names] for names in (saved, live)]
    # The same wrappers over members of one family of equal per-parameter state.
    return (len(short[0]) == len(short[1]) and short[0][:-1] == short[1][:-1]
            and {short[0][-1], short[1][-1]} <= _ADAM_FAMILY)


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
    frozen: Set[str] = frozenset(),
) -> None:
    """Load saved ``groups`` (names in ``params``) and per-name ``state`` into ``optimizer``.

    The live optimizer must hold the same parameters in the same grouping (group order and
    order within a group may differ), the model's ``frozen`` parameters aside (``match_groups``).
    Goes through ``Optimizer.load_state_dict`` so torch's own rules (dtype and device of state,
    hooks) apply."""
    live = [[_name(name_of, p, i) for p in g["params"]] for i, g in enumerate(optimizer.param_groups)]
    ordered = match_groups(live, groups, frozen)
    live_order = [{**saved, "params": names} for saved, names in zip(ordered, live)]
    optimizer.load_state_dict(positional_state_dict(live_order, state))


def regroup(saved: list[dict[str, Any]], live: list[list[str]], held: set[str]) -> list[dict[str, Any]]:
    """Saved param groups (``params`` as names; the groups of several pipeline stages' optimizers
    together) cut along the live grouping ``live`` (names per live group): per live group, its
    names with the hyperparameters of the saved groups holding them, which must agree. Every
    name of ``live``, and every saved name this rank holds (``held``), in exactly one of each;
    IncompatibleModelError naming what does not fit."""
    group_of = {name: index for index, group in enumerate(saved) for name in group["params"]}
    cut = []
    for index, names in enumerate(live):
        lacking = [name for name in names if name not in group_of]
        sources = sorted({group_of[name] for name in names if name in group_of})
        if lacking or not sources:
            raise IncompatibleModelError(f"live optimizer group {index} holds {lacking[:3] or 'no parameter'}, which no "
                                         "param group of the snapshot holds")
        hyper = [{key: value for key, value in saved[s].items() if key != "params"} for s in sources]
        differing = sorted({key for h in hyper[1:] for key in h.keys() | hyper[0].keys() if h.get(key) != hyper[0].get(key)})
        if differing:
            raise IncompatibleModelError(f"live optimizer group {index} holds parameters of saved groups {sources} whose "
                                         f"{differing} differ: build the optimizer's groups as the run saved them")
        cut.append({**hyper[0], "params": list(names)})
    in_live = {name for names in live for name in names}
    stray = sorted(name for name in group_of if name in held and name not in in_live)
    if stray:
        raise IncompatibleModelError(f"the snapshot's param groups hold {stray[:3]}, which no live optimizer group holds")
    return cut


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


def match_groups(live: list[list[str]], saved: list[dict[str, Any]], frozen: Set[str] = frozenset()) -> list[dict[str, Any]]:
    """For each live group, the saved group holding exactly its parameters, the model's
    ``frozen`` ones (requiring no grad) aside on both sides: an optimizer may hold them or not (DeepSpeed's
    records of its groups leave them out, as it does; HF Trainer builds its groups without them;
    ``AdamW(model.parameters())`` holds them), and no step changes them. Saved groups holding the
    same parameters (frozen-only ones: none) match the live ones in order."""
    by_members: dict[frozenset[str], list[dict[str, Any]]] = {}
    for group in saved:
        by_members.setdefault(frozenset(group["params"]) - frozen, []).append(group)
    ordered, problems = [], []
    for index, names in enumerate(live):
        candidates = by_members.get(frozenset(names) - frozen)
        match = candidates.pop(0) if candidates else None
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
