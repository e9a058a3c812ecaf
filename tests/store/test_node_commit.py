"""The node-scoped commit's own rules, in one process: which ranks send what to whom, the
check rank 0 makes before it commits (every file of every rank arrived at each partner as its
writer wrote it), and what a rank sends (its files as its node holds them). The commit itself, with real processes: tests/distributed/test_node_tiers.py."""

from __future__ import annotations

import pytest
import torch

from llmtailor.constants import GLOBAL_JSON, pack_filename, rank_state_files
from llmtailor.distributed.courier import packed, unpacked
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import IntegrityError, TailorError
from llmtailor.store.checked import write_bytes_to
from llmtailor.store.commit import SnapshotCommit
from llmtailor.store.manifest import FileEntry
from llmtailor.store.node_commit import NodePlacement, _replicate, check_copies, held_files
from llmtailor.store.run import Run
from llmtailor.store.staged import InTurn, RankPart
from helpers import landed
from storage_calls import StorageCalls


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

    def exchange_packed(self, outgoing, sources, into=None):
        self.outgoing = outgoing
        return {source: self.sent for source in sources}


def test_a_part_damaged_on_its_node_after_it_was_written_is_caught_before_the_commit(tmp_path):
    """What a rank sends is its node's staging as it holds it (not the bytes it meant to write),
    so a file changed there after it was written reaches its partner changed, and rank 0's check
    of the copies refuses the commit; a file of another size fails the sending rank's part."""
    node0, node1 = (SnapshotCommit.begin(Run(tmp_path / f"node{n}"), 4, 2) for n in range(2))
    path = pack_filename(1, 0)
    with node1.files() as create:
        written = write_bytes_to(create(path), bytes(range(200)), path)
    staged = node1.run.storage.path(node1.key(path))
    staged.write_bytes(b"\xff" + bytes(range(1, 200)))  # damaged in memory, the same size
    placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=_Courier(held_files(node1, [written])))
    copies = _replicate(node0, None, placement, rank=0, turn=InTurn())  # no save before it
    assert copies["1"][0]["bytes"] == 200 and copies["1"][0]["xxh3_64"] != written.xxh3_64
    parts = [RankPart(files=[]), RankPart(files=[written])]
    with pytest.raises(TailorError, match=r"rank 0 \(node 0\) holds no copy of packs/rank-00001.0.safetensors of rank 1 "
                                          r"as written \(200 bytes"):
        check_copies(4, placement, parts, [copies, {"0": []}])
    staged.write_bytes(bytes(range(150)))  # cut short
    with pytest.raises(IntegrityError, match=r"rank-00001.0.safetensors: 150 bytes stored, 200 written"):
        held_files(node1, [written])


def test_a_rank_sends_its_files_as_its_node_holds_them_without_reading_them_back(tmp_path, monkeypatch):
    """A save at every step sends its part from the files it just wrote, mapped, not read back
    into fresh memory (issue 32: the read-back was a tenth of a save's background work); the
    bytes sent are the bytes written, as their entries say, for each partner and rank 0's
    global files for a node holding none of its parts."""
    node0 = SnapshotCommit.begin(Run(tmp_path / "node0"), 4, 2)
    content = {pack_filename(0, 0): bytes(range(256)) * 40, rank_state_files(0)[0]: b"", GLOBAL_JSON: b'{"step": 4}'}
    with node0.files() as create:
        written = [write_bytes_to(create(path), data, path) for path, data in content.items()]
    calls = StorageCalls.install(monkeypatch)
    courier = _Courier(packed([]))  # node 2 sends rank 0 nothing here
    three = NodePlacement(Nodes((0, 1, 2)), replicas=2, jump=1, courier=courier)  # node 2 holds none of rank 0's parts
    _replicate(node0, RankPart(files=written), three, rank=0, turn=InTurn())
    assert [call for call in calls.calls if call[0] in ("read", "read_range", "read_into", "pieces")] == []
    assert sorted(courier.outgoing) == [1, 2]
    assert [(path, bytes(data)) for path, data in unpacked(courier.outgoing[1])] == list(content.items())
    assert [(path, bytes(data)) for path, data in unpacked(courier.outgoing[2])] == [(GLOBAL_JSON, content[GLOBAL_JSON])]


class _Landing(_Courier):
    """As ``_Courier``, the bytes landing where the receiver asks (``into``), as gloo's receives would."""

    def exchange_packed(self, outgoing, sources, into=None):
        self.outgoing = outgoing
        return {source: landed(self.sent, source, into) for source in sources}


def test_a_rank_receives_its_partners_files_straight_into_its_nodes_staged_files(tmp_path, monkeypatch):
    """A save at every step lands each partner's file in the file it keeps (a mapping of it),
    not in fresh memory then written out (issue 32: the write was a fifth of a save's
    background work); what is reported is what landed, checksummed, durable. Where a file cannot be
    mapped (empty, or a storage that does not map), it is written as before."""
    from llmtailor.store.storage.local import LocalSink

    writes = []
    real_write = LocalSink.write
    monkeypatch.setattr(LocalSink, "write", lambda sink, data: writes.append(sink.path.name) or real_write(sink, data))
    node0 = SnapshotCommit.begin(Run(tmp_path / "node0"), 4, 2)
    content = {pack_filename(1, 0): bytes(range(256)) * 40, rank_state_files(1)[0]: b"", rank_state_files(1)[1]: b"{}"}
    placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=_Landing(packed(list(content.items()))))
    copies = _replicate(node0, None, placement, rank=0, turn=InTurn())
    expected = [write_bytes_to(_Discard(), data, path) for path, data in content.items()]
    assert copies == {"1": arrived(*expected)}
    assert writes == []
    for path, data in content.items():
        assert node0.run.storage.path(node0.key(path)).read_bytes() == data


class _Discard:
    """A sink that keeps nothing (for a file entry's checksum)."""

    def write(self, data):
        pass

    def close(self):
        pass

    def abort(self):
        pass


def test_a_file_whose_space_cannot_be_taken_where_it_lands_is_written_once_it_arrived(tmp_path, monkeypatch):
    """A mapping refused (a full device says so as its space is taken) is no failure of the
    exchange: the file arrives in fresh memory and is written, failing there as it would."""
    import errno

    from llmtailor.store.storage.local import LocalSink

    def refused(sink, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalSink, "space", refused)
    node0 = SnapshotCommit.begin(Run(tmp_path / "node0"), 4, 2)
    content = {pack_filename(1, 0): bytes(range(256)) * 40, rank_state_files(1)[1]: b"{}"}
    placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=_Landing(packed(list(content.items()))))
    copies = _replicate(node0, None, placement, rank=0, turn=InTurn())
    assert copies == {"1": arrived(*(write_bytes_to(_Discard(), data, path) for path, data in content.items()))}
    for path, data in content.items():
        assert node0.run.storage.path(node0.key(path)).read_bytes() == data


class _LostMidReceipt(_Courier):
    """A partner lost while its files land: the receiver's buffers asked for (``into``), half of
    the first file in, then the exchange fails, naming it, as the courier's would."""

    def exchange_packed(self, outgoing, sources, into=None):
        from llmtailor.distributed.coordinator import CoordinationError

        buffers = into(sources[0], self.sent[0])
        first = bytes(unpacked(self.sent)[0][1])
        buffers[0][: len(first) // 2].copy_(torch.frombuffer(bytearray(first[: len(first) // 2]), dtype=torch.uint8))
        raise CoordinationError(f"receiving files from rank {sources[0]} failed: the rank died")


def test_a_partner_lost_while_its_files_land_in_their_mappings_leaves_no_file_descriptor_nor_mapping(tmp_path):
    """The staged files a lost partner's bytes were landing in (mapped) are removed, their
    descriptors closed, and their mappings gone once the failure is let go: nothing of them is
    left for the save's abandon, nor held open on the node."""
    import gc
    import os

    node0 = SnapshotCommit.begin(Run(tmp_path / "node0"), 4, 2)
    content = {pack_filename(1, 0): bytes(range(256)) * 4000, rank_state_files(1)[1]: b"{}"}
    placement = NodePlacement(Nodes((0, 1)), replicas=2, jump=1, courier=_LostMidReceipt(packed(list(content.items()))))
    gc.collect()  # what earlier tests left for the collector (a gloo group's sockets) is not counted here
    descriptors = len(os.listdir("/proc/self/fd"))
    staging = node0.run.storage.path(node0.key(pack_filename(1, 0)))
    with pytest.raises(TailorError, match="rank 1 failed: the rank died"):
        _replicate(node0, None, placement, rank=0, turn=InTurn())
    gc.collect()
    assert [path for path in content if node0.run.storage.path(node0.key(path)).exists()] == []
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert str(staging) not in open("/proc/self/maps").read()
