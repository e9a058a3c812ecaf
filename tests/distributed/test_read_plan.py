"""The read plan's own rules, in one process: who reads what, and the packing of an item's
tensors into the one buffer that is broadcast (the broadcasts themselves: test_read_once.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed import HashStore

from llmtailor.distributed.coordinator import LocalCoordinator
from llmtailor.distributed.read_plan import ReadPlan, ReadRefused, balance, nbytes, pack, unpack
from llmtailor.errors import IntegrityError


def test_pack_and_unpack_give_back_tensors_of_every_dtype_and_shape_bit_for_bit():
    tensors = [torch.randn(3, 5), torch.tensor(7, dtype=torch.int64), torch.randn(2, 3).to(torch.bfloat16),
               torch.empty(0, 4), torch.tensor([True, False, True]), torch.randn(4, 6)[:, 1:4]]  # a strided view too
    specs = [(t.dtype, list(t.shape)) for t in tensors]
    buffer = pack(tensors, specs)
    assert buffer.dtype == torch.uint8 and buffer.numel() >= nbytes(specs)
    back = unpack(buffer.clone(), specs)
    assert all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t) for b, t in zip(back, tensors))


def test_each_item_has_one_reader_the_bytes_spread_over_the_group_in_the_items_order():
    items = {"unit 'embed' of step 4": 900, "unit 'layer.0' of step 2": 400, "unit 'layer.1' of step 4": 400,
             "unit 'norm' of step 4": 10}
    coordinator = LocalCoordinator()
    coordinator.world_size, coordinator.rank = 3, 1
    plan = ReadPlan(coordinator, items, ranks=[1, 4, 7])
    assert list(plan.readers) == list(items)  # the items' order (``deliver`` goes through them so)
    assert plan.readers == {"unit 'embed' of step 4": 1, "unit 'layer.0' of step 2": 4, "unit 'layer.1' of step 4": 7,
                            "unit 'norm' of step 4": 4}
    assert plan.mine() == ["unit 'embed' of step 4"]
    assert balance({"a": 5, "b": 5, "c": 1}, 2) == {"a": 0, "b": 1, "c": 0}  # ties: the given order, the lowest rank


def test_fetch_takes_the_items_in_the_order_their_readers_have_them_each_reader_reading_its_own_smallest_first():
    """Taken in the items' order, every rank would first wait for the embedding's reader to have
    read all of it, nothing sent meanwhile, and a reader of three layers would read its third
    only once its first had been sent (two read ahead). By the bytes each reader has read when
    it has an item (its own smallest first), the first sends start once a small item is in."""
    items = {"embed": 900, "layer.0": 300, "layer.1": 300, "layer.2": 300, "layer.3": 300, "norm": 10, "head": 900}
    coordinator = LocalCoordinator()
    coordinator.world_size, coordinator.rank = 3, 0
    plan = ReadPlan(coordinator, items)
    assert plan.readers == {"embed": 0, "head": 1, "layer.0": 2, "layer.1": 2, "layer.2": 2, "layer.3": 0,
                            "norm": 1}
    # Rank 0 has read layer.3 at 300 bytes, embed at 1200; rank 1 norm at 10, head at 910; rank 2
    # layer.0, .1, .2 at 300, 600, 900 (ties: the items' order).
    assert plan.turns() == ["norm", "layer.0", "layer.3", "layer.1", "layer.2", "head", "embed"]
    assert sorted(plan.turns()) == sorted(items)


def test_an_item_is_read_by_one_of_its_candidates_the_ranks_whose_node_holds_its_files():
    """A node-local tier holds a unit's files only on some nodes (``replicas`` < nodes): its reader
    is one of the ranks there, the bytes still balanced among the candidates."""
    sizes = {"a": 9, "b": 5, "c": 5, "d": 1}
    assert balance(sizes, 4, {"a": [2, 3], "b": [2, 3], "c": [0, 1]}) == {"a": 2, "b": 3, "c": 0, "d": 1}
    coordinator = LocalCoordinator()
    coordinator.world_size, coordinator.rank = 3, 0
    plan = ReadPlan(coordinator, sizes, ranks=[1, 4, 7], candidates={"a": [7], "b": [4, 7]})
    assert plan.readers == {"a": 7, "b": 4, "c": 1, "d": 1}


def test_the_ranks_that_can_read_files_of_a_node_local_snapshot_are_those_on_the_nodes_holding_them():
    from llmtailor.constants import pack_filename, unit_filename
    from llmtailor.store.node_parts import reading_ranks

    placed = {"nodes": {"node_of": [0, 0, 1, 1, 2, 2], "replicas": 2, "jump": 1}}  # node n's parts on n and n+1
    assert reading_ranks(placed, [unit_filename("layer.1", 3, 6)], 6) == [2, 3, 4, 5]
    assert reading_ranks(placed, [pack_filename(5, 0)], 6) == [0, 1, 4, 5]  # node 2's parts: on 2 and 0
    assert reading_ranks(placed, [unit_filename("layer.1", 0, 6), unit_filename("layer.1", 2, 6)], 6) == [2, 3]
    assert reading_ranks(placed, ["global.json"], 6) == [0, 1, 2, 3, 4, 5]
    assert reading_ranks(placed, [unit_filename("layer.1", 3, 6)], 3) is None  # another world size
    assert reading_ranks({}, [unit_filename("layer.1", 3, 6)], 6) is None  # not node-local


def test_once_a_read_failed_a_rank_reads_nothing_more_and_raises_the_first_failure_at_the_end():
    """``deliver``: the restore fails once a read failed, so the rank whose read failed begins
    none of its reads not yet begun (the rest of the composite read first would cost only
    time), sends those items as failed, goes on to the end of the plan and raises the read's
    own failure there. One rank, over a gloo group of one (the messages between ranks:
    test_read_once.py); two reads ahead, so at most the two after the failed one were begun."""
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        items, reads = {f"piece {i}": 100 for i in range(10)}, []

        def read(item: str) -> torch.Tensor:
            reads.append(item)
            if item == "piece 0":
                raise IntegrityError("piece 0: checksum mismatch")
            return torch.zeros(100, dtype=torch.uint8)

        plan = ReadPlan(LocalCoordinator(), items)
        with pytest.raises(IntegrityError, match=r"^rank 0 read piece 0 and refused it: piece 0: checksum mismatch$"):
            for _, slices in plan.deliver(read, lambda item: {0: [(0, 100)]}, threads=2):
                with contextlib.suppress(ReadRefused):
                    slices()
        assert set(reads) <= {"piece 0", "piece 1", "piece 2"}, reads
    finally:
        dist.destroy_process_group()


def test_a_rank_s_reads_start_with_the_plan_not_when_its_first_item_comes_up():
    """A rank whose first item comes late in the plan (rank 0 of the bench's DDP restore: its
    first, layer.3, is the third turn) began reading only once the items before it were read
    by their readers and sent, its reads in series with theirs. Its first reads (up to the
    read-ahead's depth) start as the plan does, before any item is taken; the next as one is."""
    import threading

    from llmtailor.distributed import read_plan

    started = {item: threading.Event() for item in ("a", "b", "c")}
    go = threading.Event()

    def read(item: str) -> str:
        started[item].set()
        go.wait(60)
        return item

    ahead = read_plan._ReadAhead(["a", "b", "c"], read, 2, 2)
    try:
        assert started["a"].wait(60) and started["b"].wait(60)  # no item taken yet
        assert not started["c"].is_set()  # at most two ahead: memory stays bounded
        go.set()
        assert [future.result() for future in ahead] == ["a", "b", "c"]
    finally:
        go.set()
        ahead.close()


def test_fetch_starts_a_rank_s_reads_before_what_it_does_meanwhile_and_raises_what_that_raises():
    """A DDP restore's ranks exchanged what frozen tensors each holds, then built the plan and
    began reading: coordinator rounds before the first request (0.03-0.05 s on rank 0 of the
    bench). A rank holding none needs no answer to plan (no tensor is then held by all), so the
    exchange is ``fetch``'s ``meanwhile``: run once the rank's first reads have started, before
    the first broadcast; what it raises (a rank that failed before loading) is raised there.
    One rank, over a gloo group of one."""
    import threading

    from llmtailor.distributed.coordinator import CoordinationError

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        started = threading.Event()

        def read(item: str) -> list[torch.Tensor]:
            started.set()
            return [torch.full((4,), float(len(item)))]

        def specs(item: str) -> list[tuple[torch.dtype, list[int]]]:
            return [(torch.float32, [4])]

        seen: list[bool] = []
        plan = ReadPlan(LocalCoordinator(), {"a": 16, "bb": 16})
        got = list(plan.fetch(read, specs, lambda: seen.append(started.wait(60))))
        assert seen == [True]
        assert [(item, tensors[0].tolist()) for item, tensors in got] == [("a", [1.0] * 4), ("bb", [2.0] * 4)]

        def failed() -> None:
            raise CoordinationError("rank 1 did not report")

        with pytest.raises(CoordinationError, match="rank 1 did not report"):
            list(plan.fetch(read, specs, failed))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("refused", ["isend", "irecv"])
def test_a_message_gloo_refuses_to_post_after_a_peer_was_lost_fails_naming_the_peer_and_the_item(monkeypatch, refused):
    """Once gloo has seen a peer's connection reset, it refuses to post the next send or receive
    to that peer at once (``RuntimeError: ... Connection reset by peer``), before any wait: that
    error went out bare, so a survivor of a lost reader did not say which rank or item it was
    exchanging (CI at 2b1b977, test_read_once.py's killed reader). Each refused post is named
    as a failed wait is. One process, over a gloo group of one; a plan of two ranks whose
    rank 1 is gone, rank 0 reading every item (it only sends) or rank 1 (it only receives)."""
    from llmtailor.distributed.coordinator import CoordinationError

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        def reset(*args, **kwargs):
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:404: Connection reset by peer")

        monkeypatch.setattr(dist, refused, reset)
        items = {"unit 'a' of step 4": 16, "unit 'b' of step 4": 16}
        reader = 0 if refused == "isend" else 1  # rank 0 only sends, or only receives
        plan = ReadPlan(LocalCoordinator(), items, ranks=[0, 1], candidates=dict.fromkeys(items, [reader]))
        assert set(plan.readers.values()) == {reader}
        what = "send" if refused == "isend" else "receipt"
        with pytest.raises(CoordinationError, match=rf"^the {what} of unit '.' of step 4 between rank 0 and rank 1 failed: "
                                                    r"a rank died, .*Connection reset by peer"):
            list(plan.fetch(lambda item: [torch.zeros(4)], lambda item: [(torch.float32, [4])]))
    finally:
        dist.destroy_process_group()
