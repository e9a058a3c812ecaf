"""The pieces a distributed restore fetches once in the job (``store.shared_ranges``): the union
of every rank's byte ranges of a file, ranges less than ``GAP`` apart joined, cut into requests
of ``PART`` bytes (a short last one joined to the one before), consecutive small groups fetched
together; the tests of the whole, with real processes and a real S3 server, are
in tests/distributed/test_read_once.py."""

from __future__ import annotations

import threading

from llmtailor.store.fetch import PART
from llmtailor.store.shared_ranges import GAP, _batches, _by_file, _cut, _pieces, _within


def covered(pieces: list[tuple[str, int, int]], key: str) -> set[int]:
    return {at for k, start, length in pieces if k == key for at in range(start, start + length)}


def test_the_boxes_of_three_ranks_in_one_file_are_fetched_in_one_request_each_byte_once():
    # Three ranks' boxes of a file, overlapping where two ranks share a page, with small gaps:
    # one request in all (before: one request per box per rank, six here).
    ranks = [[("f", 0, 4000), ("f", 4096, 4000)], [("f", 3000, 2000), ("f", 8200, 1000)], [("f", 9300, 700)]]
    pieces = _pieces(r for boxes in ranks for r in boxes)
    assert pieces == [("f", 0, 10000)]
    assert sum(length for _, _, length in pieces) == len(covered(pieces, "f"))


def test_ranges_far_apart_stay_apart_and_large_ones_are_cut_into_parts_a_short_last_one_joined_to_the_one_before():
    """A request costs a round trip whatever its size: a range of two parts and 5 bytes is two
    requests (the 5 bytes with the second part), not three; a last piece of half a part or more
    stays a piece of its own."""
    ranges = [("a", 0, 100), ("a", 100 + GAP + 1, 100), ("b", 0, 2 * PART + 5), ("c", 0, 2 * PART + PART // 2)]
    assert _pieces(ranges) == [("a", 0, 100), ("a", 100 + GAP + 1, 100),
                               ("b", 0, PART), ("b", PART, PART + 5),
                               ("c", 0, PART), ("c", PART, PART), ("c", 2 * PART, PART // 2)]


def test_empty_ranges_ask_for_nothing():
    assert _pieces([("a", 10, 0)]) == []


def test_each_rank_is_sent_only_the_parts_of_a_piece_its_ranges_cover():
    # The piece joins three ranks' ranges of file f (and a gap); each rank gets its own parts,
    # as offsets in the piece, touching or overlapping ranges joined, other files' left out.
    # A rank's ranges are sorted once per group (``_by_file``), not once per piece.
    piece = ("f", 1000, 9000)
    assert _within(piece, _by_file([("f", 0, 1500), ("f", 1500, 500), ("g", 1000, 100)])) == [(0, 1000)]
    assert _within(piece, _by_file([("f", 8200, 5000), ("f", 3000, 2000), ("f", 4000, 100)])) == [(2000, 2000), (7200, 1800)]
    assert _within(piece, _by_file([("f", 20000, 10), ("f", 500, 400)])) == []
    assert _by_file([("f", 9, 1), ("g", 0, 2), ("f", 3, 4)]) == {"f": [(3, 4, False), (9, 1, False)], "g": [(0, 2, False)]}


def test_a_box_received_into_its_live_target_is_sent_apart_from_the_margins_it_touches():
    # A rank's span cut margin | box | margin (``_cut``), the box sent apart (it lands in its live
    # target): not joined to the margins it touches; overlapping ranges are still joined, and a
    # box with no margin on one side, or all of its span, is one part on its own.
    piece = ("f", 1000, 9000)
    margin_box_margin = _cut(("f", 2000, 3000), (2500, 1000))
    assert margin_box_margin == [("f", 2000, 500), ("f", 2500, 1000), ("f", 3500, 1500)]
    apart = {("f", 2500, 1000)}
    assert _within(piece, _by_file(margin_box_margin, apart)) == [(1000, 500), (1500, 1000), (2500, 1500)]
    assert _within(piece, _by_file(margin_box_margin)) == [(1000, 3000)]  # none apart: one part, as before
    assert _cut(("f", 2000, 3000), (2000, 3000)) == [("f", 2000, 3000)]
    assert _cut(("f", 2000, 3000), (2000, 1000)) == [("f", 2000, 1000), ("f", 3000, 2000)]
    assert _within(piece, _by_file(_cut(("f", 2000, 3000), (2000, 1000)), {("f", 2000, 1000)})) == [(1000, 1000), (2000, 2000)]
    # a box cut by the piece's end: the part inside the piece, apart still
    assert _within(("f", 1000, 2000), _by_file(margin_box_margin, apart)) == [(1000, 500), (1500, 500)]


def test_consecutive_small_groups_are_fetched_together_up_to_a_part_and_a_half_per_file():
    """A 2-rank FSDP2 save restored at 3: each layer is a shard of a few MB in each rank's pack,
    fetched as a request per layer per pack. Two layers side by side in a file are one request
    (their pieces joined), while no file's bytes of a batch reach a part and a half; a group
    larger than that is a batch alone."""
    half = PART // 2
    layer = {"layer.0": 0, "layer.1": 1, "layer.2": 2, "norm": 3}
    ranks = [{group: [["p0", at * half, half // 2], ["p1", at * half, half // 2]] for group, at in layer.items()},
             {group: [["p0", at * half + half // 2, half // 2], ["p1", at * half + half // 2, half // 2]]
              for group, at in layer.items()},
             {"embed": [["p0", 8 * half, 2 * PART]]}]
    assert _batches(["embed", *layer], ranks) == [("embed",), ("layer.0", "layer.1"), ("layer.2", "norm")]
    batch = [r for ranks_ in ranks for group in ("layer.0", "layer.1") for r in ranks_.get(group, ())]
    assert _pieces(tuple(r) for r in batch) == [("p0", 0, PART), ("p1", 0, PART)]


def test_a_range_sent_whole_is_used_where_it_was_received_one_cut_over_two_pieces_is_put_together():
    """A rank's ranges of a group, as the pieces it is sent come in (``_Groups.take``): a range
    lying whole in a part it received (at an aligned address) is loaded from the received bytes
    themselves, not copied into a buffer of its own first; a range cut over two pieces is put
    together from both; every range loaded holds the file's bytes."""
    import torch

    from llmtailor.store.shared_ranges import _Groups

    file = bytes(range(200)) * 2
    needs = {"g": [("f", 0, 32), ("f", 32, 48), ("f", 96, 16)]}
    loaded: dict[str, dict] = {}
    groups = _Groups(["g"], needs, lambda group, received: loaded.update({group: dict(received)}))
    first, second = torch.frombuffer(bytearray(file[0:64]), dtype=torch.uint8), torch.empty(48, dtype=torch.uint8)
    second.copy_(torch.frombuffer(bytearray(file[64:112]), dtype=torch.uint8))
    groups.take("g", ("f", 0, 64), {(0, 64): memoryview(first.numpy())})
    groups.take("g", ("f", 64, 48), {(0, 48): memoryview(second.numpy())})
    groups.load_through(None)
    assert {r: bytes(data) for r, data in loaded["g"].items()} == {r: file[r[1] : r[1] + r[2]] for r in needs["g"]}
    addresses = {r: torch.frombuffer(data, dtype=torch.uint8).data_ptr() for r, data in loaded["g"].items()}
    assert [addresses[("f", 0, 32)], addresses[("f", 96, 16)]] == [first.data_ptr(), second.data_ptr() + 32]
    assert addresses[("f", 32, 48)] not in range(first.data_ptr(), first.data_ptr() + 64)  # put together elsewhere


def test_a_range_at_an_odd_offset_of_a_part_is_copied_aligned_and_an_empty_one_is_empty():
    """Odd sizes (``_Groups.take``): a range lying whole in a received part but starting at an
    offset that is no multiple of ``ALIGN`` (a float32 tensor after 6 bytes of another) is
    copied into a buffer of its own, whose start any dtype may view; a range of a zero-size
    tensor is loaded empty; every range holds the file's bytes."""
    import torch

    from llmtailor.distributed.read_plan import ALIGN
    from llmtailor.store.shared_ranges import _Groups

    file = bytes(range(256))
    needs = {"g": [("f", 0, 6), ("f", 6, 40), ("f", 46, 0), ("f", 48, 13)]}
    loaded: dict[str, dict] = {}
    groups = _Groups(["g"], needs, lambda group, received: loaded.update({group: dict(received)}))
    part = torch.frombuffer(bytearray(file[0:64]), dtype=torch.uint8)
    assert part.data_ptr() % ALIGN == 0
    groups.take("g", ("f", 0, 64), {(0, 64): memoryview(part.numpy())})
    groups.load_through(None)
    assert {r: bytes(data) for r, data in loaded["g"].items()} == {r: file[r[1] : r[1] + r[2]] for r in needs["g"]}
    odd = loaded["g"][("f", 6, 40)]
    assert torch.frombuffer(odd, dtype=torch.uint8).data_ptr() % ALIGN == 0
    assert torch.frombuffer(odd, dtype=torch.uint8)[:4].view(torch.float32).numel() == 1


def test_a_batch_loaded_after_the_read_plan_ended_takes_its_bytes_without_waiting_again(tmp_path, monkeypatch):
    """The last batch's pieces are loaded on the loader's thread while the read plan ends
    (``read_once``), whose end waits for the receipts its caller had not waited for yet
    (``ReadPlan.deliver``): a loader that came to them later waited for each a second time,
    which gloo sits out until the timeout (30 s here) and then closes the group, failing the
    restore. Here the loader starts the last batch once the plan ended on both ranks (a slow
    load before it, say); every rank loads its ranges' bytes. Two ranks of a real gloo group,
    each on a thread of this process, their coordinators over one store."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import HashStore

    from helpers import on_threads
    from llmtailor.distributed.coordinator import StoreCoordinator
    from llmtailor.distributed.read_plan import ReadPlan
    from llmtailor.store import shared_ranges
    from llmtailor.store.storage.local import LocalStorage

    (tmp_path / "f").write_bytes(bytes(range(256)) * 16)
    store = HashStore()
    groups = on_threads(2, lambda rank: dist.ProcessGroupGloo(dist.PrefixStore("late-loader", store), rank, 2,
                                                              timedelta(seconds=30)))
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=30) for rank in range(2)]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None, tag=0: group.send([tensor], dst, tag))
    monkeypatch.setattr(dist, "irecv", lambda tensor, src, group=None, tag=0: group.recv([tensor], src, tag))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op, group, async_op: group.allreduce([tensor], _options(dist, op)))
    ended = [threading.Event() for _ in range(2)]

    class OnGroup(ReadPlan):
        def __init__(self, coordinator, items):
            super().__init__(coordinator, items, group=groups[coordinator.rank])

        def deliver(self, *args, **kwargs):
            yield from super().deliver(*args, **kwargs)
            ended[self.coordinator.rank].set()

    def late(waiting, batch, received):
        for event in ended:
            assert event.wait(60)
        return arrive_and_load(waiting, batch, received)

    arrive_and_load = shared_ranges._arrive_and_load
    monkeypatch.setattr(shared_ranges, "ReadPlan", OnGroup)
    monkeypatch.setattr(shared_ranges, "_arrive_and_load", late)
    needs = [{"g0": [("f", 0, 2048)]}, {"g1": [("f", 2048, 2048)]}]
    loaded: list[dict] = [{}, {}]
    gave_back: list[int] = []  # how many ranks had loaded each time a rank gave its heap back
    monkeypatch.setattr(shared_ranges, "_give_back_heap", lambda: gave_back.append(sum(map(bool, loaded))))

    def run(rank: int) -> None:
        shared_ranges.read_once(coordinators[rank], LocalStorage(tmp_path), needs[rank],
                                lambda group, received: loaded[rank].update({r: bytes(d) for r, d in received.items()}),
                                "late-loader")

    assert on_threads(2, run) == [None, None]
    file = (tmp_path / "f").read_bytes()
    assert loaded == [{r: file[r[1] : r[1] + r[2]] for group in mine.values() for r in group} for mine in needs]
    assert len(gave_back) == 2 and min(gave_back) >= 1  # once per rank, after its own load


def test_the_heap_memory_a_restores_scratch_buffers_left_free_goes_back_to_the_system():
    """Buffers of MBs taken on four threads in batches, as a restore's pieces are
    (``shared_ranges._scratch``), then dropped: glibc keeps the freed memory in its arenas
    (bench/scratch_heap.py); ``_give_back_heap``, called at the end of ``read_once``, returns it.
    In a fresh process, whose heap holds nothing else."""
    import subprocess
    import sys

    script = '''
import gc
from concurrent.futures import ThreadPoolExecutor
from llmtailor.store import shared_ranges

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

def one(_):
    buffer = shared_ranges._scratch(8 << 20)
    buffer[::4096] = b"\\1" * len(buffer[::4096])
    return buffer

start, pool = rss(), ThreadPoolExecutor(4)
for _ in range(6):
    held = list(pool.map(one, range(16)))
    del held
    gc.collect()
shared_ranges._give_back_heap()
print(rss() - start)
'''
    grown = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert grown < 48, f"{grown} MiB more than at the start after the scratch buffers were freed"


def _options(dist, op):
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return options


def test_boxes_that_land_are_received_straight_into_their_live_targets_and_loaded_as_their_slices(tmp_path, monkeypatch):
    """``read_once``'s ``landing``: a rank's box (here one with a margin on each side, and one
    that is all of its span) is received straight into the memory given for it (its live
    target), not into a buffer to be copied from; the reader's own box is put there from its
    read. ``load`` is given each such range as the list of its slices' bytes in order (the box's
    slice that memory), which together are the file's bytes of the range. Two ranks of a real
    gloo group, each on a thread of this process."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import HashStore

    from helpers import on_threads
    from llmtailor.distributed.coordinator import StoreCoordinator
    from llmtailor.distributed.read_plan import ReadPlan
    from llmtailor.store import shared_ranges
    from llmtailor.store.storage.local import LocalStorage

    file = bytes(range(251)) * 40  # an odd length: 10040 bytes
    (tmp_path / "f").write_bytes(file)
    store = HashStore()
    groups = on_threads(2, lambda rank: dist.ProcessGroupGloo(dist.PrefixStore("landing", store), rank, 2,
                                                              timedelta(seconds=30)))
    coordinators = [StoreCoordinator.over(store, rank, 2, timeout=30) for rank in range(2)]
    received_into: list[list[int]] = [[], []]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None, tag=0: group.send([tensor], dst, tag))

    def irecv(tensor, src, group=None, tag=0):
        received_into[1 - src].append(tensor.data_ptr())
        return group.recv([tensor], src, tag)

    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op, group, async_op: group.allreduce([tensor], _options(dist, op)))

    class OnGroup(ReadPlan):
        def __init__(self, coordinator, items):
            super().__init__(coordinator, items, group=groups[coordinator.rank])

    monkeypatch.setattr(shared_ranges, "ReadPlan", OnGroup)
    monkeypatch.setattr(shared_ranges, "LANDS_FROM", 1000)  # the boxes here are of 2003 and 5037 bytes
    spans = [("f", 0, 4099), ("f", 5003, 5037)]
    boxes = [(1001, 2003), (5003, 5037)]  # odd sizes; the second is its whole span
    targets = [torch.zeros(n, dtype=torch.uint8) for _, n in boxes]
    loaded: list[dict] = [{}, {}]

    def run(rank: int) -> None:
        shared_ranges.read_once(coordinators[rank], LocalStorage(tmp_path), {f"g{rank}": [spans[rank]]},
                                lambda group, got: loaded[rank].update(got), "landing",
                                landing={spans[rank]: (boxes[rank], targets[rank])})

    assert on_threads(2, run) == [None, None]
    for rank in range(2):
        (key, start, length), (at, n) = spans[rank], boxes[rank]
        assert bytes(targets[rank].numpy()) == file[at : at + n]
        slices = loaded[rank][spans[rank]]
        assert isinstance(slices, list) and b"".join(bytes(s) for s in slices) == file[start : start + length]
        [box] = [s for s in slices if torch.frombuffer(s, dtype=torch.uint8).data_ptr() == targets[rank].data_ptr()]
        assert len(box) == n
    receivers = [rank for rank in range(2) if len(received_into[rank]) > 1]  # more than the head: sent its parts
    assert len(receivers) == 1, received_into  # one piece, one reader
    assert targets[receivers[0]].data_ptr() in received_into[receivers[0]], "received into a buffer, then copied"
