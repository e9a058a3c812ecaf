"""Recovery of a node-local tier after a node loss, planned from what each node holds: which
composite a restore takes (``choose_on_nodes``), which files move between nodes before it is read
(``healing``), and what a writer's start removes (``clearing``). Pure functions over
``Holdings`` (each node's leader lists its own copy, ``store.tiers.healing.held_here``); no I/O.

A node-local tier keeps, on node n, the manifest, the unit indexes and the global files of each
snapshot, and the parts (files written by the ranks) of every node in ``Nodes.held_by(n)``. A
node lost and replaced comes back empty; its parts live on in its partners' copies while
``replicas`` > 1. So:

- a composite is *whole across the nodes* when every snapshot it reads is committed on some node,
  the nodes holding it agree on its manifest, and each file its manifest and indexes list is on
  some node (with its recorded size: checksums are checked when a file moves, and on read);
- a restore takes the newest whole composite saved at this job's placement (node-local copies
  are where that placement put them), passing over the newer ones with the reason;
- before it is read, each node receives from a node holding them the files it should hold
  (``held_by``) but lacks: then every rank reads its own node's copy, as after a clean stop;
- above the newest whole composite nothing can be restored (a crash between the nodes' local
  commits, or during replication, leaves a snapshot on some nodes only): a writer's start
  removes it from every node, so no tier shows a composite that is not whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from llmtailor.constants import MANIFEST_FILE, writer_rank
from llmtailor.distributed.nodes import Nodes


class Held(NamedTuple):
    """What one node's copy holds of one committed snapshot (JSON: it travels to rank 0).

    ``manifest``: ``[bytes, xxh3]`` of its manifest; ``placement``: the manifest's
    ``notes["nodes"]`` (``{"node_of", "replicas", "jump"}``; None: a snapshot of a shared
    tier's kind); ``needs``: the snapshots its composite reads (``Catalog.needs``); ``files``:
    every file the snapshot holds in all (every node's parts), as its manifest and indexes list
    them, ``path -> [bytes, xxh3]``; ``present``: the files this node has, its manifest
    included, ``path -> bytes``."""

    manifest: list
    placement: dict[str, Any] | None
    needs: list[int]
    files: dict[str, list]
    present: dict[str, int]


Holdings = dict[int, dict[int, Held]]
"""node -> step -> what that node holds of the snapshot of ``step`` (committed ones only)."""


class NodeChoice(NamedTuple):
    """What the node-local tier offers a restore: the composite's step (None: none is whole at
    this placement) and the newer composites passed over, and why."""

    step: int | None
    skipped: dict[int, str]


class Transfer(NamedTuple):
    """One file moving before a restore: of the snapshot of ``step``, ``path`` (``bytes`` long,
    checksum ``xxh3``), from node ``source``'s copy into node ``dest``'s."""

    step: int
    path: str
    bytes: int
    xxh3: str
    source: int
    dest: int


def of_json(raw: Any) -> Holdings:
    """``Holdings`` back from JSON (integer keys, ``Held`` tuples)."""
    return {int(node): {int(step): Held(*held) for step, held in steps.items()} for node, steps in raw.items()}


def holders_of(holdings: Holdings, step: int) -> list[int]:
    """The nodes on which the snapshot of ``step`` is committed, ascending."""
    return sorted(node for node, steps in holdings.items() if step in steps)


def snapshot_problem(holdings: Holdings, step: int) -> str | None:
    """Why the snapshot of ``step`` is not whole across the nodes (module docstring), or None."""
    holders = holders_of(holdings, step)
    if not holders:
        return f"step {step} is committed on no node"
    if len({tuple(holdings[n][step].manifest) for n in holders}) > 1:
        return f"the nodes' manifests of step {step} differ (nodes {holders})"
    files = holdings[holders[0]][step].files
    lost = [path for path, (size, _) in files.items()
            if not any(holdings[n][step].present.get(path) == size for n in holders)]
    if lost:
        shown = ", ".join(sorted(lost)[:3]) + (", ..." if len(lost) > 3 else "")
        return f"step {step}: {len(lost)} file(s) on no live node ({shown})"
    return None


def needs_of(holdings: Holdings, step: int) -> list[int]:
    """The snapshots the composite of ``step`` reads, newest first (as its holders list them)."""
    return sorted({s for n in holders_of(holdings, step) for s in holdings[n][step].needs} | {step}, reverse=True)


def composite_problem(holdings: Holdings, step: int, node_of: tuple[int, ...] | None = None) -> str | None:
    """Why the composite of ``step`` cannot be restored from the nodes' copies (None: it can):
    a snapshot it reads is not whole across the nodes, or (``node_of`` given: this job's
    placement) was saved at another placement."""
    for needed in needs_of(holdings, step):
        problem = snapshot_problem(holdings, needed)
        if problem is None and node_of is not None:
            problem = _placement_problem(holdings[holders_of(holdings, needed)[0]][needed], needed, node_of)
        if problem is not None:
            return problem if needed == step else f"it reads {problem}"
    return None


def _placement_problem(held: Held, step: int, node_of: tuple[int, ...]) -> str | None:
    saved = (held.placement or {}).get("node_of")
    if saved is not None and tuple(saved) == tuple(node_of):
        return None
    return (f"step {step} was saved at another placement (node of each rank: {saved}; this job's: {list(node_of)}): "
            "a node-local tier restores only at the placement that saved it")


def choose_on_nodes(holdings: Holdings, node_of: tuple[int, ...], step: int | None = None) -> NodeChoice:
    """The composite a restore can take from the nodes' copies (module docstring): of ``step``
    (default: the newest whole one), at this job's placement ``node_of``; the newer ones passed
    over, each with its reason."""
    steps = sorted({s for held in holdings.values() for s in held}, reverse=True) if step is None else [step]
    skipped: dict[int, str] = {}
    for candidate in steps:
        problem = composite_problem(holdings, candidate, node_of)
        if problem is None:
            return NodeChoice(candidate, skipped)
        skipped[candidate] = f"node-local tier: {problem}"
    return NodeChoice(None, skipped)


def healing(holdings: Holdings, step: int) -> list[Transfer]:
    """The files to move so that every node holds what it should of each snapshot the composite
    of ``step`` reads (its manifest, indexes and global files, and the parts of the nodes it
    keeps: ``Nodes.held_by``), each from a node holding it: the part's own holders first, in
    their order (its owner, then its replicas), then any node. The composite must be whole
    (``composite_problem`` None)."""
    moves = []
    for needed in needs_of(holdings, step):
        holders = holders_of(holdings, needed)
        first = holdings[holders[0]][needed]
        nodes, replicas, jump = _placement(first)
        expected = {**first.files, MANIFEST_FILE: first.manifest}
        for dest in range(nodes.count):
            present = holdings[dest][needed].present if needed in holdings.get(dest, {}) else {}
            for path in sorted(_kept_by(dest, expected, nodes, replicas, jump)):
                size, xxh3 = expected[path]
                if present.get(path) != size:
                    source = _source(holdings, needed, path, size, dest, nodes, replicas, jump)
                    moves.append(Transfer(needed, path, size, xxh3, source, dest))
    return moves


def _placement(held: Held) -> tuple[Nodes, int, int]:
    placement = held.placement or {}
    return Nodes(tuple(placement["node_of"])), int(placement.get("replicas", 1)), int(placement.get("jump", 1))


def _owner(path: str, nodes: Nodes) -> int | None:
    """The node whose part the file is (None: a file every node holds)."""
    rank = writer_rank(path)
    return None if rank is None else nodes.node_of_rank(rank)


def _kept_by(node: int, expected: dict[str, list], nodes: Nodes, replicas: int, jump: int) -> list[str]:
    """The files of a snapshot that ``node``'s copy should hold."""
    kept = set(nodes.held_by(node, replicas, jump))
    return [path for path in expected if _owner(path, nodes) in kept or _owner(path, nodes) is None]


def _source(holdings: Holdings, step: int, path: str, size: int, dest: int, nodes: Nodes, replicas: int,
            jump: int) -> int:
    owner = _owner(path, nodes)
    preferred = nodes.holders(owner, replicas, jump) if owner is not None else []
    order = preferred + [n for n in sorted(holdings) if n not in preferred]
    for node in order:
        if node != dest and holdings.get(node, {}).get(step) is not None and holdings[node][step].present.get(path) == size:
            return node
    raise ValueError(f"step {step}: no node holds {path} (the composite is not whole)")


def clearing(holdings: Holdings, node_of: tuple[int, ...]) -> dict[int, list[int]]:
    """node -> the snapshots a writer's start removes from its copy: those saved at this job's
    placement above the newest composite whole across the nodes (none of them can be restored:
    module docstring). Snapshots of another placement are left alone (another launch may read
    them)."""
    ours = sorted({s for held in holdings.values() for s, h in held.items() if _placement_problem(h, s, node_of) is None},
                  reverse=True)
    whole = next((s for s in ours if composite_problem(holdings, s) is None), None)
    doomed = {s for s in ours if whole is None or s > whole}
    return {node: sorted(s for s in held if s in doomed) for node, held in holdings.items() if doomed & set(held)}


def served_by(moves: list[Transfer]) -> dict[int, list[int]]:
    """node -> the nodes whose copies sent it the files it lacked (for the restore's report)."""
    served: dict[int, set[int]] = {}
    for move in moves:
        served.setdefault(move.dest, set()).add(move.source)
    return {node: sorted(sources) for node, sources in sorted(served.items())}
