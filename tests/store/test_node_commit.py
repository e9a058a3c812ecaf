"""The node-scoped commit's own rules, in one process: which ranks send what to whom, and the
check rank 0 makes before it commits (every file of every rank arrived at each partner as its
writer wrote it). The commit itself, with real processes: tests/distributed/test_node_tiers.py."""

from __future__ import annotations

import pytest

from llmtailor.constants import GLOBAL_JSON, pack_filename, rank_state_files
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import TailorError
from llmtailor.store.manifest import FileEntry
from llmtailor.store.node_commit import NodePlacement, check_copies
from llmtailor.store.staged import RankPart


def entry(path: str, size: int = 10, digest: str = "0123456789abcdef") -> FileEntry:
    return FileEntry(path=path, bytes=size, xxh3_64=digest)


def arrived(*files: FileEntry) -> list[dict]:
    return [f.model_dump(mode="json") for f in files]


def test_each_rank_sends_to_the_same_index_on_its_partner_nodes_and_rank_0_the_global_files_to_the_rest():
    three = NodePlacement(Nodes((0, 0, 1, 1, 2, 2)), replicas=2, jump=1, courier=None)
    assert [three.partners(rank) for rank in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert [three.sources(rank) for rank in range(6)] == [[4], [5], [0], [1], [2, 0], [3]]  # node 2 holds none of 0's
    assert three.global_receivers() == [4] and [three.leads(rank) for rank in range(6)] == [True, False] * 3
    assert three.record() == {"node_of": [0, 0, 1, 1, 2, 2], "replicas": 2, "jump": 1}


def test_rank_0_commits_only_once_every_file_arrived_at_each_partner_as_written():
    placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=None)
    zero = [entry(pack_filename(0, 0)), entry(rank_state_files(0)[0]), entry(GLOBAL_JSON)]
    one = [entry(pack_filename(1, 0)), entry(rank_state_files(1)[0])]
    parts = [RankPart(files=zero), RankPart(files=one)]
    check_copies(4, placement, parts, [{"1": arrived(*one)}, {"0": arrived(*zero)}])
    garbled = [entry(pack_filename(1, 0), digest="fedcba9876543210"), one[1]]
    with pytest.raises(TailorError, match=r"step 4 was not committed: rank 0 \(node 0\) holds no copy of "
                                          r"packs/rank-00001.0.safetensors of rank 1 as written"):
        check_copies(4, placement, parts, [{"1": arrived(*garbled)}, {"0": arrived(*zero)}])
    with pytest.raises(TailorError, match=r"rank 1 \(node 1\) holds no copy of global.json of rank 0 .*got nothing"):
        check_copies(4, placement, parts, [{"1": arrived(*one)}, {"0": arrived(*zero[:2])}])
