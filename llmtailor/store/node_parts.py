"""Which parts of a snapshot a node's copy of a node-local tier holds: the placement the
snapshot's manifest records (``notes["nodes"]``: the node of each rank, ``replicas``, ``jump``)
and the node whose copy a run directory is (its ``tiers.json`` names it). A file of a rank's part
is in node n's copy when the writer's node is one of those ``Nodes.held_by(n)``; the global files,
the manifest and the unit indexes are in every copy (``store.node_commit`` writes them so)."""

from __future__ import annotations

import json
from typing import Any

from llmtailor.constants import TIERS_FILE, writer_rank
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import TailorError
from llmtailor.store.storage import Storage


def copy_node(storage: Storage) -> int | None:
    """The node whose copy of a node-local tier the run at ``storage`` is (its ``tiers.json``
    says, as the writer recorded it); None for any other run, or one that cannot be read."""
    try:
        node = json.loads(bytes(storage.read(TIERS_FILE))).get("node")
    except (TailorError, OSError, ValueError, AttributeError):
        return None
    return node if isinstance(node, int) and not isinstance(node, bool) else None


def parts_elsewhere(notes: dict[str, Any], node: int | None) -> tuple[Nodes, set[int]] | None:
    """``(nodes, the nodes whose parts node ``node``'s copy does not hold)`` of a snapshot saved at
    the placement ``notes`` record; None when the copy holds every part (no placement, not a
    node's copy, or a placement it was not saved at)."""
    placed = notes.get("nodes")
    if node is None or not isinstance(placed, dict):
        return None
    try:
        nodes = Nodes.of_record(placed)
        held = set(nodes.held_by(node, int(placed["replicas"]), int(placed["jump"])))
    except (TailorError, KeyError, TypeError, ValueError):
        return None
    return nodes, set(range(nodes.count)) - held


def reading_ranks(notes: dict[str, Any], paths: list[str], world_size: int) -> list[int] | None:
    """The ranks whose node's copy of a node-local tier holds every file of ``paths`` of a
    snapshot saved at the placement its manifest's ``notes`` record (``notes["nodes"]``): those
    that can read them at a restore at that placement (``read_plan.balance``'s candidates).
    None where any rank can: a snapshot saved with no node placement, or read at another world
    size."""
    placed = notes.get("nodes")
    if not isinstance(placed, dict) or len(placed.get("node_of", ())) != world_size:
        return None
    nodes = Nodes.of_record(placed)
    holding = set(range(nodes.count))
    for path in paths:
        writer = writer_rank(path)
        if writer is not None:
            holding &= set(nodes.holders(nodes.node_of_rank(writer), placed["replicas"], placed["jump"]))
    return [rank for rank in range(world_size) if nodes.node_of_rank(rank) in holding]
