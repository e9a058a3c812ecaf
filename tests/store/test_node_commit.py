"""The node-scoped commit's own rules, in one process: which ranks send what to whom, the
check rank 0 makes before it commits (every file of every rank arrived at each partner as its
writer wrote it), and what a rank sends (its files as its node holds them). The commit itself, with real processes: tests/distributed/test_node_tiers.py."""

from __future__ import annotations

import pytest

from llmtailor.constants import GLOBAL_JSON, pack_filename, rank_state_files
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import IntegrityError, TailorError
from llmtailor.store.checked import write_bytes_to
from llmtailor.store.commit import SnapshotCommit
from llmtailor.store.manifest import FileEntry
from llmtailor.store.node_commit import NodePlacement, _replicate, check_copies, read_packed
from llmtailor.store.run import Run
from llmtailor.store.staged import InTurn, RankPart


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


class _Courier:
    """Hands rank 0 what rank 1 sent (``sent``), as the real courier would over gloo."""

    def __init__(self, sent):
        self.sent = sent

    def exchange_packed(self, outgoing, sources):
        return {source: self.sent for source in sources}


def test_a_part_damaged_on_its_node_after_it_was_written_is_caught_before_the_commit(tmp_path):
    """What a rank sends is read back from its node's staging (not the bytes it meant to write),
    so a file changed there after it was written reaches its partner changed, and rank 0's check
    of the copies refuses the commit; a file of another size fails the sending rank's part."""
    node0, node1 = (SnapshotCommit.begin(Run(tmp_path / f"node{n}"), 4, 2) for n in range(2))
    path = pack_filename(1, 0)
    with node1.files() as create:
        written = write_bytes_to(create(path), bytes(range(200)), path)
    staged = node1.run.storage.path(node1.key(path))
    staged.write_bytes(b"\xff" + bytes(range(1, 200)))  # damaged in memory, the same size
    placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=_Courier(read_packed(node1, [written])))
    copies = _replicate(node0, None, placement, rank=0, turn=InTurn())  # no save before it
    assert copies["1"][0]["bytes"] == 200 and copies["1"][0]["xxh3_64"] != written.xxh3_64
    parts = [RankPart(files=[]), RankPart(files=[written])]
    with pytest.raises(TailorError, match=r"rank 0 \(node 0\) holds no copy of packs/rank-00001.0.safetensors of rank 1 "
                                          r"as written \(200 bytes"):
        check_copies(4, placement, parts, [copies, {"0": []}])
    staged.write_bytes(bytes(range(150)))  # cut short
    with pytest.raises(IntegrityError, match=r"rank-00001.0.safetensors: 150 bytes stored, 200 written"):
        read_packed(node1, [written])
