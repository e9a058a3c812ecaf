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

from helpers import on_threads


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


def test_the_items_of_one_object_stay_on_as_few_readers_as_the_byte_balance_allows():
    """Items read from one object together (a pack's units: ``Run.reading_together``, one request
    for all a reader has of it) go to a rank that has one of them already while its bytes stay
    within the fair share or the most any rank has: two packs of four equal layers at two ranks,
    each pack on one reader, where the greedy rule alone sent the layers round the ranks (each
    rank a request of each pack). A pack larger than a fair share is spread still, and no rank
    ends with more bytes than the fair share or the greedy rule's most."""
    def loads(owners, sizes, world):
        return [sum(n for i, n in sizes.items() if owners[i] == r) for r in range(world)]

    sizes = {f"{pack}{k}": 10 for pack in "ab" for k in range(4)}
    packs = {item: item[0] for item in sizes}
    greedy = balance(sizes, 2)
    assert {greedy["a0"], greedy["a1"]} == {0, 1}  # round the ranks
    owners = balance(sizes, 2, together=packs)
    assert [{owners[f"{pack}{k}"] for k in range(4)} for pack in "ab"] == [{0}, {1}], owners
    sizes = {f"p{k}": 10 for k in range(8)} | {"x": 20, "y": 20, "z": 1}
    owners = balance(sizes, 3, together={f"p{k}": "P" for k in range(8)})
    assert len({owners[f"p{k}"] for k in range(8)}) > 1, owners
    assert max(loads(owners, sizes, 3)) <= max(sum(sizes.values()) / 3, max(loads(balance(sizes, 3), sizes, 3))), owners
    # A norm of a few bytes joins its layer's reader even where that rank has the most bytes
    # (within 1/32 of them), where the greedy rule sent it to the other rank: its pack then two requests.
    sizes = {"embed": 2000, "layer.0": 1000, "layer.1": 1000, "norm": 4}
    assert balance(sizes, 2)["norm"] == 0
    assert balance(sizes, 2, together={"layer.0": "A", "norm": "A", "layer.1": "B"}) == {"embed": 0, "layer.0": 1, "layer.1": 1, "norm": 1}
    # Candidates still bound where an item goes.
    assert balance({"a0": 10, "a1": 10}, 2, {"a1": [1]}, together={"a0": "A", "a1": "A"}) == {"a0": 0, "a1": 1}


@pytest.mark.parametrize("layers, world", [(64, 2), (128, 4), (48, 2)])
def test_a_pack_of_many_small_units_is_still_spread_over_the_ranks_by_bytes(layers, world):
    """A deep model's layer units, each under 1/32 of a rank's fair share, all in one pack (units
    under 16 MiB are packed, up to 256 MiB a pack): a rank reading the pack takes its units while
    its bytes stay within the fair share or the most a rank had by the greedy rule's own choice,
    and 1/32 of it; bytes taken by joining never raise that bound. BEFORE (session 59, read59's
    ``together``): every unit on rank 0 (64 layers at 2 ranks: bytes [72, 0]; 128 at 4: [136, 0,
    0, 0]), the bound taken from the most any rank had, the joining rank's own, so each join let
    the next one in (from the most of another rank: [68, 68, 0, 0], two ranks leapfrogging)."""
    sizes = {"embed": 4, "head": 4, **{f"layer.{i}": 1 for i in range(layers)}}
    owners = balance(sizes, world, together={item: "pack" for item in sizes})
    loads = [sum(n for item, n in sizes.items() if owners[item] == rank) for rank in range(world)]
    greedy = balance(sizes, world)
    most = max(sum(sizes.values()) / world, max(sum(n for i, n in sizes.items() if greedy[i] == r) for r in range(world)))
    assert max(loads) <= most * (1 + 1 / 32), loads


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


def test_no_receipt_into_a_live_tensor_outlives_a_fetch_that_raised(monkeypatch):
    """``fetch`` receives an item straight into the live tensor ``into`` gives once its head is in;
    when a wait for another item failed (its reader lost), it raised with that receipt still
    posted (gloo cannot take a posted receive back), so the item's bytes, still on their way
    from a live reader, landed in the live tensor after the restore had raised: after a
    ``fallback`` attempt had loaded an older composite into the same tensors, say, which then
    held a mix while the restore reported success. Every receipt into caller memory is now
    waited for before ``fetch`` raises (within the timeout: a receipt that times out is dead,
    gloo closing the group's connections). One process, over a gloo group of one, the messages
    of ranks 1 (alive; item a's bytes, the head in, the rest on their way) and 2 (lost: item
    b's head fails once a's bytes were asked for) played by fakes of ``irecv``."""
    import threading

    from llmtailor.distributed.coordinator import CoordinationError

    asked_a = threading.Event()
    posted: list[Receipt] = []

    class Receipt:
        """A posted receive of rank 0's from rank 1 or 2 (gloo's work): its message lands on a
        wait, or, still posted, when the test lets it land late (``land``); a wait that times out
        leaves it dead, as gloo's does (every connection of the group closed)."""

        def __init__(self, buffer: torch.Tensor, src: int, tag: int):
            self.buffer, self.src, self.tag, self.open = buffer, src, tag, True
            self.head = self.tag == 0 and not any(r.tag == 0 for r in posted)
            if self.tag == 0 and not self.head:
                asked_a.set()

        def land(self) -> None:
            if self.open:
                self.open = False
                self.buffer.view(torch.float32)[:] = 7.0

        def wait(self, timeout):
            if self.src == 2:  # rank 2 is lost once rank 0 asked for a's bytes
                asked_a.wait(60)
                self.open = False
                raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:404: Connection reset by peer")
            if self.head:  # a's head: sent, 16 bytes follow, as one tensor of 16 bytes (the sizes a reader lists)
                self.buffer[:32].view(torch.int64)[:] = torch.tensor([0, 16, 1, 16])
                self.open = False
                return True
            if not released.wait(timeout.total_seconds()):  # a's bytes: on their way, in or not by the timeout
                self.open = False
                raise RuntimeError("Timed out waiting for recv operation to complete")
            self.land()
            return True

    def irecv(buffer, src, group=None, tag=0):
        posted.append(Receipt(buffer, src, tag))
        return posted[-1]

    released = threading.Event()
    monkeypatch.setattr(dist, "irecv", irecv)
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        coordinator = LocalCoordinator()
        coordinator.timeout = 2
        plan = ReadPlan(coordinator, {"a": 16, "b": 16}, ranks=[0, 1, 2], candidates={"a": [1], "b": [2]})
        live = torch.zeros(4)
        with pytest.raises(CoordinationError, match=r"^the receipt of b between rank 0 and rank 2 failed"):
            list(plan.fetch(lambda item: [torch.zeros(4)], lambda item: [(torch.float32, [4])], into=lambda item: [live]))
        at_raise = live.clone()
        for receipt in posted:  # what is still posted lands now, as a late message would
            receipt.land()
        assert torch.equal(live, at_raise), "a receipt into the live tensor outlived the raise"
    finally:
        released.set()
        dist.destroy_process_group()


def test_a_gloo_receive_whose_wait_timed_out_takes_no_late_message():
    """What ``fetch`` relies on once it failed: a receipt posted into a live tensor cannot be
    taken back, but one whose wait timed out is dead (gloo closes the group's connections), so
    its reader's message, sent late, never lands; one waited for to its end took its message.
    Two ranks of a real gloo group, each on a thread of this process."""
    import threading
    from datetime import timedelta

    store, groups = HashStore(), [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("late", store), rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    live = torch.zeros(4)
    sent = groups[1].send([torch.full((4,), 1.0)], 0, 3)  # kept: gloo drops a send whose work is dropped
    groups[0].recv([live], 1, 3).wait(timedelta(seconds=60))
    sent.wait(timedelta(seconds=60))
    assert live.tolist() == [1.0] * 4
    receipt = groups[0].recv([live], 1, 4)
    with pytest.raises(RuntimeError, match="Timed out"):
        receipt.wait(timedelta(seconds=0.2))
    # The late message: refused, failed in flight, or never asked for (its sender not yet told the connection closed)
    with pytest.raises(RuntimeError, match="Connection (closed|reset)|Timed out waiting"):
        groups[1].send([torch.full((4,), 2.0)], 0, 4).wait(timedelta(seconds=5))
    assert live.tolist() == [1.0] * 4


def test_a_reader_that_loses_a_peer_keeps_its_sends_to_the_others_until_they_are_done(monkeypatch):
    """A reader posts an item's sends to each other rank in turn; when gloo refused the one to a
    lost rank, those already posted to live ranks were dropped with the raise (gloo drops a send
    whose work is freed), so a live rank that had the item's head waited for its bytes until the
    timeout, and, since ``fetch`` waits for such receipts before it raises, took the timeout to
    fail where the lost rank is found at once. The sends posted are kept, waited for behind
    the raise. One process, over a gloo group of one: rank 0 reads the item, rank 1 is alive,
    rank 2 lost (``isend`` faked)."""
    import threading

    from llmtailor.distributed.coordinator import CoordinationError

    waited = threading.Event()

    class Sent:
        def wait(self, timeout):
            waited.set()
            return True

    def isend(tensor, dst, group=None, tag=0):
        if dst == 2:
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:404: Connection reset by peer")
        return Sent()

    monkeypatch.setattr(dist, "isend", isend)
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        plan = ReadPlan(LocalCoordinator(), {"a": 16}, ranks=[0, 1, 2], candidates={"a": [0]})
        with pytest.raises(CoordinationError, match=r"^the send of a between rank 0 and rank 2 failed"):
            list(plan.fetch(lambda item: [torch.zeros(4)], lambda item: [(torch.float32, [4])]))
        assert waited.wait(60), "the sends posted to rank 1 were dropped"
    finally:
        dist.destroy_process_group()


def test_a_deliver_stopped_before_its_caller_waited_for_an_item_waits_for_that_item_s_receipts():
    """``deliver`` posts the receipts of an item's parts as it hands the item over; a caller that
    stopped (an error of its own) before it waited for them dropped them unwaited, and gloo's
    connection to their reader, once their message came in, took no other (seen on a real
    group: the next message on it waited out the timeout), so a fallback attempt's
    restore hung on it. Each receipt posted and not waited for by the caller is waited for as
    ``deliver`` ends. One process, over a gloo group of one; rank 1 (``irecv`` faked) reads
    the item, its message in once waited for."""
    waited: list[int] = []

    class Receipt:
        def __init__(self, buffer: torch.Tensor):
            self.buffer = buffer

        def wait(self, timeout):
            waited.append(self.buffer.numel())
            return True  # a head of zeros: sent

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(dist, "irecv", lambda buffer, src, group=None, tag=0: Receipt(buffer))
            plan = ReadPlan(LocalCoordinator(), {"a": 100}, ranks=[0, 1], candidates={"a": [1]})
            delivering = plan.deliver(lambda item: torch.zeros(100, dtype=torch.uint8), lambda item: {0: [(0, 100)]})
            item, _ = next(delivering)
            assert item == "a" and waited == []
            delivering.close()  # the caller stopped before it waited for a's parts
        assert waited == [16, 100]  # the head, then the part
    finally:
        dist.destroy_process_group()



def _gloo_group(name: str, timeout: float, world: int) -> list:
    """The store and the ranks of a real gloo group, each to be used from a thread of this process."""
    from datetime import timedelta

    store = HashStore()
    return [store, *on_threads(world, lambda rank: dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world,
                                                                         timedelta(seconds=timeout)))]


def _over_the_group(monkeypatch) -> None:
    """``ReadPlan``'s messages on the group it was given (a gloo group of ``_gloo_group``, not
    registered with torch.distributed, so sent on it directly)."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None, tag=0: group.send([tensor], dst, tag))
    monkeypatch.setattr(dist, "irecv", lambda tensor, src, group=None, tag=0: group.recv([tensor], src, tag))


def test_an_item_s_small_tensors_go_in_one_message_and_land_in_their_live_tensors_bit_for_bit(monkeypatch):
    """``fetch`` sent each tensor of an item in a message of its own: a Llama layer's unit of
    AdamW state is 36 tensors (norms and step counters of a few bytes), so the bench's DDP
    restore made 338 messages (676 sends and receives), each work on both ranks. The
    reader now sends the tensors under ``_TOGETHER_UNDER`` bytes in one message (after the
    head, before the larger ones, each of which still goes alone): here a head, one message for
    the six small ones and one for the large one. Every dtype and shape arrives bit for bit, a
    live tensor given by ``into`` is the one returned, holding the bytes (the large one received
    straight into its memory), the others new. Two ranks of a real gloo group, on threads."""
    from llmtailor.distributed import read_plan
    from llmtailor.distributed.coordinator import StoreCoordinator

    _over_the_group(monkeypatch)
    sends: list[int] = []
    send = dist.isend
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None, tag=0: sends.append(tensor.numel()) or send(tensor, dst, group, tag))
    store, *groups = _gloo_group("together", 60, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=60) for rank in range(2)]
    large = read_plan._TOGETHER_UNDER // 4 + 3  # float32 elements: just over the limit
    sent = [torch.randn(3, 5), torch.tensor(7, dtype=torch.int64), torch.randn(2, 3).to(torch.bfloat16), torch.empty(0, 4),
            torch.randn(large), torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int16), torch.randn(1)]
    specs = [(t.dtype, list(t.shape)) for t in sent]
    live = {2: torch.zeros(2, 3, dtype=torch.bfloat16), 4: torch.zeros(large), 6: torch.zeros(5, dtype=torch.int16)}
    pointers = {at: t.data_ptr() for at, t in live.items()}

    def run(rank: int) -> list[torch.Tensor]:
        plan = ReadPlan(coordinators[rank], {"a": nbytes(specs)}, group=groups[rank], candidates={"a": [0]})
        into = (lambda item: [live.get(at) for at in range(len(specs))]) if rank == 1 else None
        return [tensors for _, tensors in plan.fetch(lambda item: [t.clone() for t in sent], lambda item: specs, into=into)][0]

    got = on_threads(2, run)
    assert not any(isinstance(outcome, BaseException) for outcome in got), got
    for tensors in got:
        assert [(t.dtype, list(t.shape)) for t in tensors] == specs
        assert all(torch.equal(t, s) for t, s in zip(tensors, sent))
    assert all(got[1][at] is live[at] and live[at].data_ptr() == pointers[at] for at in live)
    assert len(sends) == 3, sends  # the head, the six small tensors, the large one
    assert sends[2] == large * 4


def test_a_rank_whose_caller_stops_part_way_fails_the_others_promptly_and_the_group_serves_the_next_plan(monkeypatch):
    """A caller of ``fetch`` that stops taking the items on one rank (an error of its own, an
    interrupt) left the others waiting for its messages: they sat in their sends to it for the
    whole timeout (600 s by default), and then gloo closed the group, so a fallback attempt on
    it failed too. The stopped rank goes on to the end of the plan without its caller (its
    items unread, what comes in into memory of its own), the others learn it from its heads,
    read nothing more and raise, naming it, well before the timeout (300 s here; the threads
    are waited for 120 s); a failing ``into`` (the caller's code) stops a rank alike; and a
    next plan on the same group takes none of the earlier plans' messages. Three ranks of a
    real gloo group, each on a thread of this process."""
    from llmtailor.distributed.coordinator import PeerStopped, StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("stopped", 300, 3)
    coordinators = [StoreCoordinator.over(store, rank, 3, timeout=300) for rank in range(3)]
    items = {f"{owner}{n}": 64 for n in range(3) for owner in "abc"}  # a0.. read by rank 0, b0.. by rank 1, c0.. by 2
    candidates = {item: ["abc".index(item[0])] for item in items}
    live = [{item: torch.zeros(16) for item in items} for _ in range(3)]

    def plan(rank: int, value: float, into=None):
        into = into or (lambda item: [live[rank][item]])
        return ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates).fetch(
            lambda item: [torch.full((16,), value)], lambda item: [(torch.float32, [16])], into=into)

    def stopping(rank: int) -> list[str]:
        taken = []
        for item, _ in plan(rank, 1.0):
            taken.append(item)
            if rank == 0:
                raise KeyError(f"rank 0's own error at {item}")
        return taken

    outcomes = on_threads(3, stopping)
    assert isinstance(outcomes[0], KeyError), outcomes
    for outcome in outcomes[1:]:  # None: still waiting
        assert isinstance(outcome, PeerStopped), outcomes
        assert str(outcome).startswith("rank 0 stopped taking the items of the read plan part-way")

    def refusing(rank: int) -> list[str]:
        def into(item: str) -> list[torch.Tensor]:
            if rank == 0 and item == "b1":
                raise KeyError(f"no live tensor for {item}")
            return [live[rank][item]]
        return [item for item, _ in plan(rank, 3.0, into)]

    outcomes = on_threads(3, refusing)
    assert isinstance(outcomes[0], KeyError) and "no live tensor for b1" in str(outcomes[0]), outcomes
    for outcome in outcomes[1:]:  # unless rank 0 had sent all its items: then they received every item
        assert (isinstance(outcome, PeerStopped) and str(outcome).startswith("rank 0 stopped")
                or isinstance(outcome, list) and sorted(outcome) == sorted(items)), outcomes

    # The next plan on the same group (a fallback attempt: another composite, same items).
    outcomes = on_threads(3, lambda rank: {item: tensors[0].tolist() for item, tensors in plan(rank, 2.0)})
    assert outcomes == [dict.fromkeys(items, [2.0] * 16)] * 3, outcomes  # the last plan's bytes only


@pytest.mark.parametrize("late", [False, True], ids=["as_it_comes", "rank_1_reads_on_after_the_stop"])
def test_a_rank_whose_caller_stops_part_way_through_deliver_fails_the_others_promptly(monkeypatch, late):
    """``deliver`` alike: a caller that stopped on one rank left the others in their sends to it
    and in the collective at the plan's end until the timeout. The stopped rank goes on to the
    end without its caller (it posts under the plan's tag that it fails, so the others read
    nothing more), and every other rank raises, naming it, well before the timeout (300 s
    here; the threads are waited for 120 s); a next plan on the same group delivers its own
    bytes only. Two ranks of a real gloo group, each on a thread of this process. ``late``: rank 1's
    read of item 3 ends only once rank 0 posted its stop, so rank 1 skips its item 5 (sends it
    unread, one read at a time): its caller, taking items as a restore does, still gets
    ``PeerStopped`` (the flake of a loaded machine, where that order came by itself)."""
    import time

    from llmtailor.distributed.coordinator import PeerStopped, StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("stopped-deliver", 300, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=300) for rank in range(2)]
    items = {f"{n}": 64 for n in range(6)}  # read by ranks 0 and 1 in turn
    candidates = {item: [int(item) % 2] for item in items}

    def run(rank: int, attempt: int, value: int) -> dict[str, bytes]:
        plan = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates)
        got = {}

        def read(item: str) -> torch.Tensor:
            while late and attempt == 0 and item == "3" and not coordinators[1].poll("stopped/0/failed")[0]:
                time.sleep(0.01)  # until rank 0's stop is posted (an event, not a time)
            return torch.full((64,), value, dtype=torch.uint8)

        for item, parts in plan.deliver(read, lambda item: {0: [(0, 64)], 1: [(0, 64)]}, tag=f"stopped/{attempt}",
                                        threads=1 if late else 2):
            if attempt == 0 and rank == 0 and item == "2":
                raise KeyError(f"rank 0's own error at {item}")
            # As a restore takes them (shared_ranges.read_once): an item refused (a rank 1 that
            # learned of rank 0's stop before it read one of its own items sends it unread) is
            # skipped, and the plan's end raises why.
            with contextlib.suppress(ReadRefused):
                got[item] = bytes(parts()[(0, 64)])
        return got

    outcomes = on_threads(2, lambda rank: run(rank, 0, 1))
    assert isinstance(outcomes[0], KeyError), outcomes
    assert isinstance(outcomes[1], PeerStopped), outcomes  # None: still waiting
    assert str(outcomes[1]).startswith("rank 0 stopped taking the items of the read plan part-way")
    outcomes = on_threads(2, lambda rank: run(rank, 1, 2))
    assert outcomes == [dict.fromkeys(items, bytes([2] * 64))] * 2, outcomes


def test_a_plan_on_a_group_that_a_timed_out_wait_closed_says_so(monkeypatch):
    """A wait of a read plan that timed out (one left behind by a plan that failed, maybe after
    it) makes gloo close the group's connections, so a later plan on it (a fallback attempt's)
    failed with a bare "Connection closed" or a timeout of its own, as if a rank had died now.
    Its failure says that a wait on the group timed out before. Two ranks of a real gloo group,
    each on a thread of this process; rank 1 takes no part in the first plan."""
    from llmtailor.distributed.coordinator import CoordinationError, StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("closed", 60, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=1) for rank in range(2)]
    items, candidates = {"a": 64, "b": 64}, {"a": [0], "b": [1]}

    def plan(rank: int) -> list[str]:
        fetching = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates).fetch(
            lambda item: [torch.zeros(16)], lambda item: [(torch.float32, [16])])
        return [item for item, _ in fetching]

    with pytest.raises(CoordinationError, match="timeout"):
        plan(0)
    outcomes = on_threads(2, plan)
    assert isinstance(outcomes[0], CoordinationError), outcomes
    assert "a wait on this process group timed out before" in str(outcomes[0]), outcomes


def test_an_item_of_deliver_waited_for_after_the_plan_ended_gives_its_bytes_at_once(monkeypatch):
    """``deliver``'s end waits for the receipts its caller has not waited for yet (``_Receipt``):
    a caller that waits for an item's slices later, on a thread of its own (``shared_ranges``'
    loader takes the last batch's pieces while the plan ends), then waited for the same gloo
    receipt a second time: gloo's second wait sits until the timeout and then closes the
    group's connections, so the restore failed after the whole timeout (30 s here). An item's
    slices are waited for once, whoever asks first; the others get the same bytes. Two ranks
    of a real gloo group, each on a thread of this process."""
    from llmtailor.distributed.coordinator import StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("late-caller", 30, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=30) for rank in range(2)]
    items = {f"{n}": 64 for n in range(4)}  # read by ranks 0 and 1 in turn
    candidates = {item: [int(item) % 2] for item in items}

    def run(rank: int) -> dict[str, bytes]:
        plan = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates)
        taken = list(plan.deliver(lambda item: torch.full((64,), int(item), dtype=torch.uint8),
                                  lambda item: {0: [(0, 64)], 1: [(0, 64)]}))
        return {item: bytes(parts()[(0, 64)]) for item, parts in taken}  # every item waited for once the plan ended

    outcomes = on_threads(2, run)
    assert outcomes == [{item: bytes([int(item)] * 64) for item in items}] * 2, outcomes


def test_a_collective_whose_wait_timed_out_makes_every_later_one_on_the_group_refuse(monkeypatch):
    """A broadcast of a read plan (``_broadcast``: a failed read's error at the end of
    ``deliver``) whose wait timed out stays pending in gloo, where it paired with the group's
    next collective: rank 0's next broadcast took the data of the one after it, silently (a
    later restore on the same Tailor: mismatched data or a confusing hang). Every later
    collective, and every read plan, on that group refuses on that rank, saying why and what to
    do. Two ranks of a real gloo group, each on a thread of this process; rank 1 takes no part
    in the first broadcast."""
    from llmtailor.distributed.coordinator import CoordinationError, StoreCoordinator

    def broadcast(tensor, group=None, group_src=None, async_op=False):
        options = dist.BroadcastOptions()
        options.rootRank = group_src
        return group.broadcast([tensor], options)

    _over_the_group(monkeypatch)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    store, *groups = _gloo_group("paired", 10, 2)
    coordinators = [StoreCoordinator.over(store, 0, 2, timeout=0.5), StoreCoordinator.over(store, 1, 2, timeout=1)]
    plans = [ReadPlan(coordinators[rank], {"a": 8, "b": 8, "c": 8}, group=groups[rank]) for rank in range(2)]
    cpu = torch.device("cpu")
    with pytest.raises(CoordinationError, match="the broadcast of a from rank 1, its reader, failed"):
        plans[0]._broadcast(torch.zeros(2), "a", 1, cpu)

    def next_ones(rank: int) -> list:
        if rank == 0:
            return plans[0]._broadcast(torch.zeros(2), "b", 1, cpu).tolist()
        return [plans[1]._broadcast(torch.full((2,), value), item, 1, cpu).tolist() for item, value in (("b", 7.0), ("c", 9.0))]

    outcomes = on_threads(2, next_ones)
    assert isinstance(outcomes[0], CoordinationError), outcomes  # it took [9.0, 9.0], c's, for b
    assert str(outcomes[0]).startswith("rank 0: this process group is unusable: a wait on this process group timed "
                                       "out before (the broadcast of a from rank 1)"), outcomes
    assert "make a new process group" in str(outcomes[0])
    with pytest.raises(CoordinationError, match="this process group is unusable"):
        list(plans[0].fetch(lambda item: [torch.zeros(2)], lambda item: [(torch.float32, [2])]))


def test_a_rank_that_disagrees_on_an_item_s_size_takes_its_bytes_so_its_reader_is_not_left_waiting(monkeypatch):
    """A rank that found a reader sent an item of another size than it expects (the ranks
    disagree on what the composite holds) raised at once without receiving the item's tensors,
    so its reader sat in its sends to it until the timeout (30 s here). It takes the bytes the
    head lists into memory of the plan's own and stops as a rank whose ``into`` failed does:
    its reader's plan ends (here: every item taken, or ``PeerStopped`` naming rank 1), and a
    next plan on the same group takes none of this one's messages. Two ranks of a real gloo
    group, each on a thread of this process."""
    from llmtailor.distributed.coordinator import CoordinationError, PeerStopped, StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("disagree", 60, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=30) for rank in range(2)]
    items, candidates = {"a": 64, "b": 64}, {"a": [0], "b": [1]}

    def plan(rank: int, value: float, shapes: dict[str, list[int]]) -> dict[str, list[float]]:
        fetching = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates).fetch(
            lambda item: [torch.full(shapes[item], value), torch.full((2,), value)],
            lambda item: [(torch.float32, shapes[item]), (torch.float32, [2])])
        return {item: sorted({v for t in tensors for v in t.tolist()}) for item, tensors in fetching}

    whole = {"a": [16], "b": [16]}
    outcomes = on_threads(2, lambda rank: plan(rank, 1.0, whole if rank == 0 else {"a": [8], "b": [16]}))
    assert isinstance(outcomes[1], CoordinationError), outcomes
    assert str(outcomes[1]) == ("rank 0 sent 72 bytes of a, this rank expected 40: the ranks disagree on what the "
                                "composite holds"), outcomes
    assert (outcomes[0] == {"a": [1.0], "b": [1.0]} or isinstance(outcomes[0], PeerStopped)
            and str(outcomes[0]).startswith("rank 1 stopped taking the items")), outcomes  # not a timeout
    outcomes = on_threads(2, lambda rank: plan(rank, 2.0, whole))
    assert outcomes == [{"a": [2.0], "b": [2.0]}] * 2, outcomes

    def split(rank: int, value: float) -> dict[str, list[float]]:  # a's 72 bytes as 64 + 8 on rank 0, 40 + 32 on rank 1
        shapes = [[16], [2]] if rank == 0 else [[10], [8]]
        fetching = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates).fetch(
            lambda item: [torch.full(shape, value) for shape in (shapes if item == "a" else [[16], [2]])],
            lambda item: [(torch.float32, shape) for shape in (shapes if item == "a" else [[16], [2]])])
        return {item: sorted({v for t in tensors for v in t.tolist()}) for item, tensors in fetching}

    outcomes = on_threads(2, lambda rank: split(rank, 3.0))  # as many bytes, split otherwise: a disagreement too
    assert isinstance(outcomes[1], CoordinationError) and str(outcomes[1]) == (
        "rank 0 sent the 72 bytes of a as tensors of [64, 8] bytes, this rank expected tensors of [40, 32] bytes: the "
        "ranks disagree on what the composite holds"), outcomes
    assert (outcomes[0] == {"a": [3.0], "b": [3.0]} or isinstance(outcomes[0], PeerStopped)
            and str(outcomes[0]).startswith("rank 1 stopped taking the items")), outcomes
    assert on_threads(2, lambda rank: plan(rank, 4.0, whole)) == [{"a": [4.0], "b": [4.0]}] * 2


def test_a_rank_whose_meanwhile_raises_or_that_is_interrupted_waiting_fails_the_others_promptly(monkeypatch):
    """``fetch``'s ``meanwhile`` (the ranks' exchange of what they hold) raising on one rank
    only, or an interrupt (Ctrl-C) while a rank waits for its messages in ``fetch`` itself, ended
    that rank's plan at once, and the others waited for its messages until the timeout (30 s
    here). The rank goes on to the end of the plan as one whose caller stopped, then raises what
    stopped it; the others raise ``PeerStopped`` naming it; a next plan on the group serves
    every rank. Two ranks of a real gloo group, each on a thread of this process."""
    import threading

    from llmtailor.distributed import read_plan
    from llmtailor.distributed.coordinator import PeerStopped, StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("meanwhile", 60, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=30) for rank in range(2)]
    items, candidates = {"a": 64, "b": 64}, {"a": [0], "b": [1]}
    interrupted, real_wait = threading.Event(), read_plan.wait

    def wait(futures, **how):
        if threading.current_thread().name == "rank-1" and not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt
        return real_wait(futures, **how)

    def plan(rank: int, meanwhile=None) -> list[str]:
        threading.current_thread().name = f"rank-{rank}"
        fetching = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates).fetch(
            lambda item: [torch.zeros(16)], lambda item: [(torch.float32, [16])], meanwhile)
        return sorted(item for item, _ in fetching)

    def failing() -> None:
        raise KeyError("rank 1's exchange failed")

    outcomes = on_threads(2, lambda rank: plan(rank, failing if rank == 1 else None))
    assert isinstance(outcomes[1], KeyError), outcomes
    assert isinstance(outcomes[0], PeerStopped) and str(outcomes[0]).startswith("rank 1 stopped"), outcomes
    monkeypatch.setattr(read_plan, "wait", wait)
    outcomes = on_threads(2, plan)
    assert isinstance(outcomes[1], KeyboardInterrupt), outcomes
    assert isinstance(outcomes[0], PeerStopped) and str(outcomes[0]).startswith("rank 1 stopped"), outcomes
    assert on_threads(2, plan) == [["a", "b"]] * 2


def test_a_plan_ended_at_once_by_a_second_interrupt_leaves_its_group_refusing_on_that_rank(monkeypatch):
    """A second interrupt (Ctrl-C twice) while a rank waits for its messages in ``fetch`` ends its
    plan at once: its receipts and sends still posted stay in gloo, where they would pair with the
    group's next messages (a reader left in its sends, another plan's bytes). Every later plan on
    the group then refuses on that rank at once, saying why. Before: its next plan posted its
    messages on the group all the same (and waited for its peer until the timeout). Two ranks of
    a real gloo group, each on a thread of this process."""
    import threading

    from llmtailor.distributed import read_plan
    from llmtailor.distributed.coordinator import CoordinationError, StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("twice", 60, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=2) for rank in range(2)]
    items, candidates = {"a": 64, "b": 64}, {"a": [0], "b": [1]}
    interrupts, real_wait = [], read_plan.wait

    def wait(futures, **how):
        if threading.current_thread().name == "rank-1" and len(interrupts) < 2:
            interrupts.append(1)
            raise KeyboardInterrupt
        return real_wait(futures, **how)

    def plan(rank: int) -> list[str]:
        threading.current_thread().name = f"rank-{rank}"
        fetching = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates).fetch(
            lambda item: [torch.zeros(16)], lambda item: [(torch.float32, [16])])
        return sorted(item for item, _ in fetching)

    monkeypatch.setattr(read_plan, "wait", wait)
    outcomes = on_threads(2, plan)
    assert isinstance(outcomes[1], KeyboardInterrupt) and len(interrupts) == 2, outcomes
    with pytest.raises(CoordinationError, match=r"^rank 1: this process group is unusable: a wait on this process group "
                                                r"failed before \(a read plan ended at once by a second interrupt\)"):
        plan(1)


def test_a_rank_that_disagrees_on_an_item_of_many_tensors_takes_all_its_bytes(monkeypatch):
    """As above, for an item of more tensors than its head can list the sizes of (600: an MoE
    layer's unit): the rank raised at once without receiving any of it, so its reader sat in its
    sends until the timeout, and their unreceived messages carried the tags the next plan on the
    group uses. The reader sends the sizes after the head; the rank that disagrees takes them,
    then the bytes, and the next plan on the group takes none of this one's messages. Two ranks
    of a real gloo group, each on a thread of this process."""
    from llmtailor.distributed.coordinator import CoordinationError, PeerStopped, StoreCoordinator

    _over_the_group(monkeypatch)
    store, *groups = _gloo_group("disagree-many", 60, 2)
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=30) for rank in range(2)]
    items, candidates = {"a": 64, "b": 64}, {"a": [0], "b": [1]}
    many = 600

    def plan(rank: int, value: float, first: list[int]) -> dict[str, list[float]]:
        shapes = {"a": [first] + [[2]] * (many - 1), "b": [[16]]}
        fetching = ReadPlan(coordinators[rank], items, group=groups[rank], candidates=candidates).fetch(
            lambda item: [torch.full(shape, value) for shape in shapes[item]],
            lambda item: [(torch.float32, shape) for shape in shapes[item]])
        return {item: sorted({v for t in tensors for v in t.tolist()}) for item, tensors in fetching}

    outcomes = on_threads(2, lambda rank: plan(rank, 1.0, [2] if rank == 0 else [1]))
    assert isinstance(outcomes[1], CoordinationError), outcomes
    assert str(outcomes[1]) == (f"rank 0 sent {8 * many} bytes of a, this rank expected {8 * many - 4}: the ranks "
                                "disagree on what the composite holds"), outcomes
    assert (outcomes[0] == {"a": [1.0], "b": [1.0]} or isinstance(outcomes[0], PeerStopped)
            and str(outcomes[0]).startswith("rank 1 stopped taking the items")), outcomes  # not a timeout
    outcomes = on_threads(2, lambda rank: plan(rank, 2.0, [2]))
    assert outcomes == [{"a": [2.0], "b": [2.0]}] * 2, outcomes
