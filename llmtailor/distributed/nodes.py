"""Which node each rank runs on, and which nodes keep a copy of each node's checkpoint parts.

A *node* is the ranks of one launch (``torchrun --nnodes N --node_rank i``): they share the
node's memory and local disks, and are lost together. A node-local tier keeps each node's parts
of a snapshot (the files its ranks wrote) in that node's own store, and copies of them on other
nodes, so that losing a node loses no part.

The placement rule (``Nodes.holders``): the parts of node ``n`` are held by the nodes
``n, n + jump, n + 2 * jump, ...`` (mod the number of nodes), ``replicas`` of them. With
``jump = 1`` each copy lives on the next node; a larger jump puts copies a rack (or any failure
domain) away when nodes are numbered rack by rack, as NVIDIA's resiliency extension spaces the
ranks of its replication cliques. The holders must be distinct nodes.

Invariant: every rank builds the same ``Nodes`` (``discover`` is collective), so the placement
is computed alike everywhere without further messages.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmtailor.errors import ConfigError

if TYPE_CHECKING:  # no torch on the paths that only read a run (verify, merge): coordinator imports it
    from llmtailor.distributed.coordinator import Coordinator


@dataclass(frozen=True)
class Nodes:
    """The node of each rank of a job (``node_of[rank]``); nodes are numbered 0..count-1."""

    node_of: tuple[int, ...]

    def __post_init__(self) -> None:
        if sorted(set(self.node_of)) != list(range(len(set(self.node_of)))):
            raise ConfigError(f"node numbers must be 0..N-1, got {sorted(set(self.node_of))}")

    @classmethod
    def single(cls, world_size: int) -> Nodes:
        """Every rank on one node."""
        return cls((0,) * world_size)

    @classmethod
    def discover(cls, coordinator: Coordinator) -> Nodes:
        """Collective: each rank's node, as its launch names it (``own_node_id``), numbered in
        the order of the nodes' lowest ranks."""
        ids = coordinator.exchange(f"{coordinator.new_round()}/node", own_node_id(coordinator.rank))
        numbers: dict[str, int] = {}
        for node_id in ids:
            numbers.setdefault(str(node_id), len(numbers))
        return cls(tuple(numbers[str(node_id)] for node_id in ids))

    @property
    def count(self) -> int:
        return len(set(self.node_of))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    def ranks_of(self, node: int) -> list[int]:
        return [rank for rank, n in enumerate(self.node_of) if n == node]

    def node_of_rank(self, rank: int) -> int:
        return self.node_of[rank]

    def leader_of(self, node: int) -> int:
        """The node's lowest rank: it writes what the node holds once (its manifest, say)."""
        return self.ranks_of(node)[0]

    def check_even(self) -> None:
        """ConfigError unless every node runs the same number of ranks (partner ranks pair up by
        their index within their node)."""
        sizes = {node: len(self.ranks_of(node)) for node in range(self.count)}
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"node {node}: {size}" for node, size in sizes.items())
            raise ConfigError(f"node-local tiers need the same number of ranks on every node, got {listed}")

    def holders(self, node: int, replicas: int, jump: int = 1) -> list[int]:
        """The nodes that hold ``node``'s parts, ``node`` first (module docstring); ConfigError
        when they are not ``replicas`` distinct nodes."""
        if replicas < 1 or jump < 1:
            raise ConfigError(f"replicas={replicas} and jump={jump} must be at least 1")
        held = [(node + i * jump) % self.count for i in range(replicas)]
        if len(set(held)) != replicas:
            raise ConfigError(
                f"replicas={replicas} with jump={jump} on {self.count} node(s) puts two copies of a node's parts on one "
                f"node (nodes {held}): replicas must be at most the number of nodes, and jump must reach "
                f"{replicas} different nodes")
        return held

    def held_by(self, node: int, replicas: int, jump: int = 1) -> list[int]:
        """The nodes whose parts ``node`` holds: itself first, then each node it keeps a copy
        for, in order of the copy (the first copy's owner first)."""
        owners = [(node - i * jump) % self.count for i in range(replicas)]
        for owner in owners:
            self.holders(owner, replicas, jump)  # the rule's own check, once per owner
        return owners

    def partner_ranks(self, rank: int, replicas: int, jump: int = 1) -> list[int]:
        """The ranks that receive copies of ``rank``'s files: on each other holder node, the
        rank with the same index within its node."""
        self.check_even()
        node = self.node_of[rank]
        index = self.ranks_of(node).index(rank)
        return [self.ranks_of(holder)[index] for holder in self.holders(node, replicas, jump)[1:]]

    def source_ranks(self, rank: int, replicas: int, jump: int = 1) -> list[int]:
        """The ranks whose files ``rank`` receives copies of (the inverse of ``partner_ranks``),
        in the order of ``held_by``."""
        self.check_even()
        node = self.node_of[rank]
        index = self.ranks_of(node).index(rank)
        return [self.ranks_of(owner)[index] for owner in self.held_by(node, replicas, jump)[1:]]

    def record(self) -> dict[str, Any]:
        return {"node_of": list(self.node_of)}

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> Nodes:
        return cls(tuple(int(n) for n in record["node_of"]))


def own_node_id(rank: int) -> str:
    """This process's node as its launcher names it: torchrun's ``GROUP_RANK`` (the node rank);
    without it ``rank // LOCAL_WORLD_SIZE``; without that, the host name."""
    if os.environ.get("GROUP_RANK", "").isdigit():
        return f"node-{int(os.environ['GROUP_RANK'])}"
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return f"node-{rank // int(local)}"
    return f"host-{socket.gethostname()}"

