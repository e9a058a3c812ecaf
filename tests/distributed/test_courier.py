"""The courier and the placement rule: which nodes hold a node's parts (pure), and files sent
between real processes over the courier's own gloo group (including from a thread other than
the one that made it, as an async save does, a peer that dies, and one that stalls past the
timeout).

The processes are the ranks of one launch of this file (``main``), forked from it once it
imported torch and llmtailor (``forked_jobs.rank_launch``): one interpreter a launch, where
``mp.spawn`` started one a rank (each imported torch, llmtailor and this module again). What a
forked rank does not see that a spawned one would: peers each with a ``str`` hash seed of its
own (the courier's order comes from dicts and lists; its one set holds ranks, ints, unseeded)."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from forked_jobs import rank_launch

from llmtailor.distributed.coordinator import CoordinationError, make_coordinator
from llmtailor.distributed.courier import Courier
from llmtailor.constants import writer_rank
from llmtailor.distributed.nodes import Nodes, own_node_id
from llmtailor.errors import ConfigError


def test_each_nodes_parts_go_to_the_nodes_a_jump_apart_and_each_node_knows_whose_it_holds():
    nodes = Nodes((0, 0, 1, 1, 2, 2, 3, 3))
    assert nodes.count == 4 and nodes.ranks_of(2) == [4, 5] and nodes.leader_of(3) == 6
    assert nodes.holders(1, 2) == [1, 2] and nodes.holders(3, 2) == [3, 0]
    assert nodes.holders(0, 2, jump=2) == [0, 2] and nodes.holders(1, 3) == [1, 2, 3]
    for replicas, jump in [(1, 1), (2, 1), (2, 2), (3, 1), (4, 3)]:
        for node in range(4):  # held_by is the inverse of holders
            assert all(node in nodes.holders(owner, replicas, jump) for owner in nodes.held_by(node, replicas, jump))
            assert sum(node in nodes.holders(o, replicas, jump) for o in range(4)) == replicas
    assert nodes.partner_ranks(3, 2) == [5] and nodes.source_ranks(5, 2) == [3]
    assert nodes.partner_ranks(6, 3, jump=1) == [0, 2] and nodes.source_ranks(0, 3) == [6, 4]


def test_a_placement_that_puts_two_copies_on_one_node_or_uneven_nodes_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="replicas=3 with jump=1 on 2 node"):
        Nodes((0, 1)).holders(0, 3)
    with pytest.raises(ConfigError, match="jump=2 on 4 node"):
        Nodes((0, 1, 2, 3)).holders(1, 3, jump=2)  # 1, 3, 1
    with pytest.raises(ConfigError, match="node 0: 2, node 1: 1"):
        Nodes((0, 0, 1)).partner_ranks(0, 2)
    with pytest.raises(ConfigError, match="0..N-1"):
        Nodes((0, 2))


def test_the_node_comes_from_torchruns_group_rank_then_the_local_world_size(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "3")
    assert own_node_id(7) == "node-3"
    monkeypatch.delenv("GROUP_RANK")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert own_node_id(9) == "node-2"


def test_each_file_of_a_snapshot_is_its_writers_part_or_no_ranks():
    assert writer_rank("units/layer.3.rank-00002.safetensors") == 2
    assert writer_rank("units/rank-7.rank-00001.safetensors") == 1  # a unit named like a rank file
    assert writer_rank("packs/rank-00011.0.safetensors") == 11
    assert writer_rank("ranks/rank-00004.json") == 4 and writer_rank("ranks/rank-00004.safetensors") == 4
    assert [writer_rank(p) for p in ["global.json", "global.safetensors", "manifest.json", "index/layer.0.json",
                                     "units/layer.0.safetensors"]] == [None] * 5


def _exchange(courier: Courier, rank: int, world: int, out: str, mode: str) -> None:
    if mode == "dies" and rank == 1:
        os._exit(0)  # a peer lost before it sends
    mine = [(f"units/u.rank-{rank:05d}.safetensors", bytes([rank]) * (1000 + rank)), ("ranks/empty.json", b"")]
    partner, source = (rank + 1) % world, (rank - 1) % world
    got: dict = {}

    def run() -> None:  # on another thread, as an async save does
        try:
            got["files"] = courier.exchange({partner: mine}, [source])
        except CoordinationError as err:
            got["error"] = str(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    Path(out, f"{rank}.txt").write_text(repr(got) + f"\nsent={courier.sent_bytes}")


def _stream(courier: Courier, rank: int, world: int, out: str) -> None:
    from llmtailor.distributed import courier as courier_module

    courier_module.PIECE = 1000  # a file of several messages, on lanes in turn
    mine = {f"packs/rank-{rank:05d}.0.safetensors": _pieces(rank), "ranks/empty.json": b"", "manifest.json": b"{}"}
    partner, source = (rank + 1) % world, (rank - 1) % world

    def fill(dst: int, name: str, into: memoryview) -> None:
        into[:] = mine[name]

    got: list = []
    courier.stream({partner: [(name, len(content)) for name, content in mine.items()]}, fill, [source],
                   lambda src, name, content: got.append((src, name, bytes(content))))
    Path(out, f"{rank}.txt").write_text(repr(got) + f"\nsent={courier.sent_bytes}\nlanes={courier.lanes}")


def _dies_mid_stream(courier: Courier, rank: int, out: str) -> None:
    """Rank 2 streams rank 0 three files of five pieces each (on the lanes in turn) and dies as
    it reads the second; what rank 0 was handed and how its stream ended, into ``out/0.txt``
    (rank 1 takes no part)."""
    from llmtailor.distributed import courier as courier_module

    courier_module.PIECE = 1000
    files = [(f"packs/rank-00002.{n}.safetensors", bytes([n + 1]) * 5000) for n in range(3)]

    def fill(dst: int, name: str, into: memoryview) -> None:
        if name == files[1][0]:
            os._exit(0)  # the first file's pieces posted, not necessarily sent
        into[:] = dict(files)[name]

    got: list = []
    try:
        courier.stream({0: [(name, len(content)) for name, content in files]} if rank == 2 else {}, fill,
                       [2] if rank == 0 else [], lambda src, name, content: got.append((name, bytes(content))))
        said = "ended"
    except CoordinationError as err:
        said = str(err)
    Path(out, f"{rank}.txt").write_text(repr((got, said, files[0])))


def _held_files(src: int) -> list[tuple[str, bytes]]:
    """What holder ``src`` (rank 0 or 1) streams rank 2 in ``_two_holders``: three files of three pieces."""
    return [(f"packs/rank-{src:05d}.{n}.safetensors", bytes([16 * n + src]) * 2500) for n in range(3)]


def _two_holders(courier: Courier, rank: int, out: str) -> None:
    """A node rebuilt from two holders: ranks 0 and 1 each stream rank 2 three files, and rank 0
    holds its last one until rank 2 has taken rank 1's last (the event, through ``out``; at
    most three timeouts, the bound on a hang). A gloo send completes only once its receive is
    posted, and each sender waits for its sends within the courier's timeout: rank 1's must not
    wait for rank 0's stream to end. What each rank was handed, how its stream ended and (rank
    0) whether rank 1's files were taken first, into ``out/<rank>.txt``."""
    from llmtailor.distributed import courier as courier_module

    courier_module.PIECE = 1000
    taken, held, got = Path(out, "taken-1"), [], []
    mine = dict(_held_files(rank)) if rank < 2 else {}

    def fill(dst: int, name: str, into: memoryview) -> None:
        if rank == 0 and name == _held_files(0)[-1][0]:
            deadline = time.monotonic() + 3 * courier.timeout
            while not taken.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            held.append(taken.exists())
        into[:] = mine[name]

    def take(src: int, name: str, content: memoryview) -> None:
        got.append((src, name, bytes(content)))
        if (src, name) == (1, _held_files(1)[-1][0]):
            taken.write_text("")

    try:
        courier.stream({2: [(name, len(content)) for name, content in mine.items()]} if rank < 2 else {}, fill,
                       [0, 1] if rank == 2 else [], take)
        said = "ended"
    except CoordinationError as err:
        said = str(err)
    Path(out, f"{rank}.txt").write_text(repr((got, said, held)))


def _pieces(rank: int) -> bytes:
    """2500 bytes, each 1000-byte piece of them different (a piece out of place shows)."""
    return b"".join(bytes([16 * piece + rank]) * 1000 for piece in range(3))[:2500]


def _stall(rank: int, out: str) -> None:
    """Ranks 0 and 1 exchange three times (rank 2 only opens the couriers, collectively): on a
    courier with a short timeout, the first exchange's rank 1 stalls until rank 0's has timed
    out, then the second with other bytes of the same sizes; the third on a fresh courier. The
    couriers post on the job's coordinator when they break (``Courier.board``). What each got
    (the bytes right or not) or raised, into ``out/<rank>.txt``."""
    board = make_coordinator(20)
    stalling, fresh = Courier.open(timeout=20, board=board), Courier.open(timeout=20, board=board)
    stalling.timeout = 2  # its waits only: the group itself is made with time to spare
    if rank == 2:  # leaves once the others said how they fared (its exit must not cut their group)
        while not all(Path(out, f"{r}.txt").exists() for r in (0, 1)):
            time.sleep(0.05)
        return
    peer, timed_out, said = 1 - rank, Path(out, "timed-out"), []

    def files(n: int, of: int) -> list:
        return [(f"units/u.rank-{of:05d}.safetensors", bytes([16 * n + of]) * 100)]

    for n, courier in ((1, stalling), (2, stalling), (3, fresh)):
        while n == 1 and rank == 1 and not timed_out.exists():
            time.sleep(0.05)
        try:
            got = courier.exchange({peer: files(n, rank)}, [peer])
            said.append(("got", n, "right" if got == {peer: files(n, peer)} else f"wrong: {got!r}"[:200]))
        except Exception as err:  # what the courier raises; anything else is named
            said.append(("error", n, str(err) if isinstance(err, CoordinationError) else f"{type(err).__name__}: {err}"))
        if n == 1 and rank == 0:
            timed_out.write_text("")
    Path(out, f"{rank}.txt").write_text(repr(said))


def _courier_job(rank: int, world: int, init: str, out: str, mode: str) -> None:
    """``mode`` "ok": a file exchange (into ``out/exchange``), then a stream over a courier of its
    own (into ``out/stream``), then exchanges after a timeout (``_stall``, into ``out/stall``), in
    the same processes (a start costs seconds of CPU: torch and llmtailor imported in each);
    "dies": an exchange where rank 1 dies first."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    courier = Courier.open(timeout=20 if mode == "ok" else 5)
    # Every rank's courier made before rank 1 dies ("dies"): its group is whole on rank 1's side a
    # moment before rank 0's connections finish, and a rank that left then fails rank 0's open
    # (rightly, "a rank of the job died before it"), not the exchange this job is about.
    dist.barrier()
    _exchange(courier, rank, world, str(Path(out, "exchange")), mode)
    if mode == "ok":
        # Each rank's environment asks for its own count of lanes: rank 0's is the job's (``LANES_ENV``)
        os.environ.update({"LLMTAILOR_COURIER_LANES": ["2", "3", "4"][rank]})
        streaming = Courier.open(timeout=20)
        del os.environ["LLMTAILOR_COURIER_LANES"]
        _stream(streaming, rank, world, str(Path(out, "stream")))
        dying, holders = Courier.open(timeout=20), Courier.open(timeout=20)
        _stall(rank, str(Path(out, "stall")))
        _two_holders(holders, rank, str(Path(out, "holders")))
        _dies_mid_stream(dying, rank, str(Path(out, "died")))
        # Leave at once: a group whose exchange timed out may hold messages never taken, which
        # tearing it down could wait on.
        os._exit(0)


def main() -> None:
    """A rank of ``spawn_courier_job``'s launch: ``python test_courier.py OUT MODE`` with torchrun's
    ``RANK`` and ``WORLD_SIZE`` (``forked_jobs.rank_launch``); the group's rendezvous in ``OUT/store``."""
    out, mode = sys.argv[1:]
    _courier_job(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), f"file://{Path(out, 'store')}", out, mode)


def spawn_courier_job(out: Path, mode: str) -> Path:
    """The courier's job at 3 ranks (``mode`` "ok") or 2 ("dies"); every rank must exit 0."""
    from helpers import run_launch

    world = 3 if mode == "ok" else 2
    for part in ("exchange", "stream", "stall", "holders", "died"):
        (out / part).mkdir(parents=True)
    status, stdout, stderr = run_launch([*rank_launch(world), __file__, out, mode], {**os.environ, "OMP_NUM_THREADS": "1"})
    assert status == 0, f"the courier's launch ({mode}) exited with {status}:\n{stdout[-2000:]}{stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def courier_run(tmp_path_factory) -> Path:
    """One world-3 run of the courier: the exchange, then the stream (both tests read it)."""
    return spawn_courier_job(tmp_path_factory.mktemp("courier"), "ok")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "dies"])
def test_files_reach_their_partner_from_a_background_thread_and_a_dead_peer_is_named(tmp_path, mode, request):
    world = 3 if mode == "ok" else 2
    out = (request.getfixturevalue("courier_run") if mode == "ok" else spawn_courier_job(tmp_path, mode)) / "exchange"
    if mode == "ok":
        for rank in range(world):
            source = (rank - 1) % world
            got = eval(Path(out, f"{rank}.txt").read_text().split("\nsent=")[0])
            assert got == {"files": {source: [(f"units/u.rank-{source:05d}.safetensors", bytes([source]) * (1000 + source)),
                                              ("ranks/empty.json", b"")]}}
            assert Path(out, f"{rank}.txt").read_text().endswith(f"sent={1000 + rank}")
    else:
        said = Path(out, "0.txt").read_text()
        # Named whichever of its posts or waits finds the peer gone first (with several
        # connections per pair, a send or receive can be refused as it is posted).
        assert re.search(r"(receiving files from|sending files to) rank 1 failed", said), said


@pytest.mark.slow
def test_streamed_files_reach_their_partner_whole_in_order_in_pieces_every_rank_sending_and_receiving(courier_run):
    """Each file's pieces go round the group's lanes (a connection each), and come back in place."""
    world = 3
    out = courier_run / "stream"
    for rank in range(world):
        source = (rank - 1) % world
        said, sent = Path(out, f"{rank}.txt").read_text().split("\nsent=")
        assert eval(said) == [(source, f"packs/rank-{source:05d}.0.safetensors", _pieces(source)),
                              (source, "ranks/empty.json", b""), (source, "manifest.json", b"{}")]
        assert sent.split("\nlanes=") == ["2502", "2"]  # rank 0's count, on every rank (``_courier_job``)


@pytest.mark.slow
def test_a_node_rebuilt_from_two_holders_receives_both_streams_at_once_so_neither_holder_waits_for_the_other(courier_run):
    """Before, the receiver took its sources one after the other: rank 1's sends waited for rank
    0's whole stream, and timed out wherever it took longer than the timeout (here it never ends
    before rank 1's files are taken: both streams failed on the timeout)."""
    said = {rank: eval(Path(courier_run, "holders", f"{rank}.txt").read_text()) for rank in range(3)}
    assert said[0] == ([], "ended", [True]) and said[1] == ([], "ended", []), said
    got, ended, _ = said[2]
    assert ended == "ended", ended
    for src in (0, 1):  # each holder's files whole, in its order
        assert [(name, content) for s, name, content in got if s == src] == _held_files(src)
    assert len(got) == 6


@pytest.mark.slow
def test_a_sender_that_dies_mid_stream_fails_the_receivers_stream_naming_it_and_hands_over_only_whole_files(courier_run):
    got, said, first = eval(Path(courier_run, "died", "0.txt").read_text())
    assert "receiving files from rank 2 failed" in said and got in ([], [first]), (said, got)


@pytest.mark.slow
def test_after_an_exchange_timed_out_the_courier_refuses_every_later_one_and_a_fresh_one_works(courier_run):
    """A timed-out exchange leaves receives posted on the courier's group: a later exchange
    over it could take the failed one's bytes. The rank whose exchange failed refuses every
    later one at once, saying so; so does its peer, which learns it from the job's store (it
    would otherwise wait for the broken rank's messages until its timeout), never taking stale
    bytes; a courier opened anew carries the right bytes."""
    said = {rank: eval(Path(courier_run, "stall", f"{rank}.txt").read_text()) for rank in (0, 1)}
    first, second, third = said[0]
    assert first[:2] == ("error", 1) and "receiving files from rank 1 failed or timed out" in first[2]
    assert second[:2] == ("error", 2) and "this courier is broken since an exchange failed" in second[2], second
    assert third == ("got", 3, "right")
    for n in (1, 2):  # rank 1 comes to its first exchange once rank 0's has failed
        assert said[1][n - 1][:2] == ("error", n), said[1]
        assert "rank 1: this courier is broken since an exchange of rank 0 (every exchange needs it) failed (receiving " \
               "files from rank 1 failed or timed out" in said[1][n - 1][2], said[1]
    assert said[1][2] == ("got", 3, "right"), said[1]  # never stale bytes


def _faked_group(files: list[tuple[str, bytes]], piece: int | None = None, announced: int | None = None,
                 posted: list[int] | None = None):
    """A courier's group in one process whose ``recv`` fills each posted receive at once from
    the messages a peer sending ``files`` would send (each file in pieces of ``piece`` bytes, or
    whole; its sizes message announcing ``announced``, else the number of files, as a stream's
    does), noting each file receive's bytes in ``posted``."""
    import json

    import torch

    from llmtailor.distributed import courier as courier_module

    names = json.dumps([[name, len(content)] for name, content in files]).encode()
    wire = {courier_module._SIZES: [torch.tensor([len(names), len(files) if announced is None else announced])],
            courier_module._NAMES: [torch.frombuffer(bytearray(names), dtype=torch.uint8)],
            courier_module._BYTES: [torch.frombuffer(bytearray(content[at:at + (piece or len(content))]), dtype=torch.uint8)
                                    for _, content in files for at in range(0, len(content), piece or len(content))]}

    class Done:
        def wait(self, timeout=None) -> bool:
            return True

    class Group:
        def recv(self, tensors, src, tag):
            tensors[0].copy_(wire[tag].pop(0))
            if posted is not None:
                posted.append(tensors[0].numel() if tag == courier_module._BYTES else 0)
            return Done()

    group = Group()
    group.wire = wire  # what is left of the peer's messages
    return group


def test_a_stream_posts_the_receives_of_the_next_files_before_it_hands_one_over(monkeypatch):
    """The receiving side of ``Courier.stream`` (in one process, the group's ``recv`` faked: each
    posted receive is filled at once from the messages the peer would send): the receives of
    every file within ``WINDOW`` bytes are posted before the first file is handed to ``take``,
    so the sender never waits for the receiver's checks; past the window, files are handed
    over oldest first before more is posted; each file whole, in order."""
    from llmtailor.distributed import courier as courier_module

    files = [(f"units/u{i}.safetensors", bytes([i]) * 3000) for i in range(4)]
    posted: list[int] = []

    def received() -> list:
        """What ``take`` got: (name, content, bytes of file receives posted by then)."""
        posted.clear()
        seen: list = []
        Courier(_faked_group(files, 1000, posted=posted), 1)._receive_streams([0], lambda src, name, content: seen.append((name, bytes(content), sum(posted))))
        assert [(name, content) for name, content, _ in seen] == files
        return [at for _, _, at in seen]

    monkeypatch.setattr(courier_module, "PIECE", 1000)
    assert received() == [12000] * 4  # every file's receives posted before the first was handed over
    monkeypatch.setattr(courier_module, "WINDOW", 6000)
    assert received() == [6000, 9000, 12000, 12000]  # at most the window ahead of the file handed over


def test_a_streamed_file_lands_where_land_asks_and_elsewhere_in_a_fresh_buffer(monkeypatch):
    """``Courier.stream``'s ``land`` (the receiving side in one process, the group's ``recv``
    faked as above): a file lands in the buffer ``land`` gives for it (a healed file's mapping:
    nothing copied after), piece by piece, and ``take`` is handed that memory; where ``land``
    gives none, or a buffer of another size, the file lands in a fresh buffer."""
    import torch

    from llmtailor.distributed import courier as courier_module

    monkeypatch.setattr(courier_module, "PIECE", 1000)
    files = [(f"units/u{i}.safetensors", bytes([i + 1]) * 2500) for i in range(3)]
    places = {files[0][0]: bytearray(2500), files[2][0]: bytearray(10)}  # the last: not its size
    asked, seen = [], []

    def land(src: int, name: str, size: int) -> memoryview | None:
        asked.append((src, name, size))
        return memoryview(places[name]) if name in places else None

    Courier(_faked_group(files, 1000), 1)._receive_streams([0], lambda src, name, content: seen.append((name, content)), land)
    assert asked == [(0, name, len(content)) for name, content in files]
    assert [(name, bytes(content)) for name, content in seen] == files
    assert bytes(places[files[0][0]]) == files[0][1] and bytes(places[files[2][0]]) == bytes(10)
    landed = torch.frombuffer(places[files[0][0]], dtype=torch.uint8)
    assert torch.frombuffer(seen[0][1], dtype=torch.uint8).data_ptr() == landed.data_ptr()  # that memory, no copy


def test_a_packed_exchange_whose_sizes_disagree_takes_the_peers_bytes_before_it_fails():
    """The receiving side of ``Courier.exchange_packed`` (in one process, the group's ``recv``
    faked as above): a peer whose announced total disagrees with its files' listed sizes is
    refused, naming both, once every message it sent was taken, so its sends end at once (it
    then fails on the courier's board) instead of waiting for receives never posted until its
    timeout."""
    from llmtailor.distributed import courier as courier_module

    files = [("units/u.rank-00000.safetensors", bytes([7]) * 3000), ("ranks/rank-00000.json", b"{}")]
    group = _faked_group(files, announced=2999)
    with pytest.raises(CoordinationError, match="rank 0 sent 2999 bytes for files announced as 3002 bytes"):
        Courier(group, 1).exchange_packed({}, [0])
    assert group.wire[courier_module._BYTES] == []  # every message of the peer taken


def test_a_send_or_receive_refused_as_it_is_posted_names_the_peer():
    """With several connections per pair, gloo can refuse a send or receive as it is posted (that
    connection to the dead rank already closed), before any wait: the error still names the rank
    (it said "an exchange of files failed: a peer died", naming none, in one CI run)."""

    class Gone:
        def send(self, tensors, peer, tag):
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:5000")

        recv = send

    with pytest.raises(CoordinationError, match=r"sending files to rank 1 failed: the rank died .*Connection closed"):
        Courier(Gone(), rank=0, timeout=1).exchange({1: [("units/u.safetensors", b"x")]}, [])
    with pytest.raises(CoordinationError, match=r"receiving files from rank 2 failed: the rank died .*Connection closed"):
        Courier(Gone(), rank=0, timeout=1).exchange({}, [2])


@pytest.mark.parametrize("found", ["waiting", "posting", "posting a receive"])
def test_a_packed_exchange_with_one_dead_peer_names_it_once_the_live_peers_messages_are_taken(found):
    """Rank 0 exchanges with ranks 1 and 2 (in one process, the group faked as above); rank 1 is
    dead (gloo fails the waits of its receives, or refuses a send to it, or the first receive
    from it, as it is posted: the connection closed). The exchange fails naming rank 1, once
    rank 2's files were taken and rank 0's sends to rank 2 waited for: a live sender's sends
    wait for receives posted, and a live receiver for sends kept, so neither is left to its
    timeout (nor blames rank 0, which is alive) where the dead rank is found at once."""
    import json

    import torch

    from llmtailor.distributed import courier as courier_module

    files = [("units/u.rank-00002.safetensors", bytes([2]) * 3000), ("ranks/rank-00002.json", b"{}")]
    names = json.dumps([[name, len(content)] for name, content in files]).encode()
    wire = {courier_module._SIZES: [torch.tensor([len(names), 3002])],
            courier_module._NAMES: [torch.frombuffer(bytearray(names), dtype=torch.uint8)],
            courier_module._BYTES: [torch.frombuffer(bytearray(content), dtype=torch.uint8) for _, content in files]}
    waited: list[int] = []

    class Done:
        def __init__(self, peer: int):
            self.peer = peer

        def wait(self, timeout=None) -> bool:
            waited.append(self.peer)
            return True

    class Dead:
        def wait(self, timeout=None) -> bool:
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:5001")

    class Group:
        def recv(self, tensors, src, tag):
            if src == 1 and found == "posting a receive":
                raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:5001")
            if src == 1:
                return Dead()
            tensors[0].copy_(wire[tag].pop(0))
            return Done(src)

        def send(self, tensors, dst, tag):
            if dst == 1 and found == "posting":
                raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:5001")
            return Done(dst)

    mine = [("units/u.rank-00000.safetensors", b"x" * 10)]
    with pytest.raises(CoordinationError, match=r"files (from|to) rank 1 failed.*Connection closed") as raised:
        Courier(Group(), 0, timeout=1).exchange({1: mine, 2: mine}, [1, 2])
    assert "rank 2" not in str(raised.value)
    assert [len(messages) for messages in wire.values()] == [0, 0, 0]  # rank 2's every message taken
    assert waited.count(2) == 2 + 2 + 3  # rank 2's sizes, names and 2 files received; rank 0's 3 sends to it


def test_a_packed_exchange_with_several_hung_peers_waits_one_timeout_in_all_and_names_each(monkeypatch):
    """Rank 0 exchanges with ranks 1 and 2 (sources and destinations) and sends to rank 3 (in
    one process, the group faked as above): all three hung (alive, never in the exchange: each
    wait on them runs out its timeout, on a clock faked here). Every peer's first message was
    posted as the exchange began, so once one has run out the timeout, the others have had it
    too: the exchange fails after one timeout in all, not one per hung peer, naming each."""
    from datetime import timedelta

    from llmtailor.distributed import courier as courier_module

    clock = [0.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    class Hung:
        def wait(self, timeout: timedelta | None = None) -> bool:
            clock[0] += timeout.total_seconds()  # what the wait took
            raise RuntimeError(f"Timed out waiting {int(timeout.total_seconds() * 1000)}ms for the operation")

    class Group:
        def recv(self, tensors, src, tag):
            return Hung()

        send = recv

    monkeypatch.setattr(courier_module, "time", Clock, raising=False)
    mine = [("units/u.rank-00000.safetensors", b"x" * 10)]
    with pytest.raises(CoordinationError) as raised:
        Courier(Group(), 0, timeout=60).exchange({1: mine, 2: mine, 3: mine}, [1, 2])
    for peer in (1, 2, 3):
        assert f"rank {peer} failed or timed out" in str(raised.value)
    assert clock[0] <= 60 + 3 * courier_module.LATE, clock[0]


def test_a_closed_courier_lets_its_group_go_once_no_exchange_runs_and_refuses_every_later_one():
    """``Courier.close`` (its Tailor closed) lets the group go (its sockets and threads end with
    it): at once when idle; where an exchange runs (a save in flight on its thread), as that
    one ends, never under it. Every later exchange refuses, saying so; the courier is not broken
    by it. The group faked in one process: a send posted, waited for until released. Before:
    ``AttributeError: 'Courier' object has no attribute 'close'`` (a closed Tailor kept its group,
    a socket per peer and lane and their threads, for as long as the script kept the Tailor)."""
    import threading
    import weakref

    release, sending = threading.Event(), threading.Event()

    class Held:
        def wait(self, timeout=None) -> bool:
            return release.wait(60)

    class Group:
        def send(self, tensors, peer, tag):
            sending.set()
            return Held()

    courier = Courier(Group(), rank=0, timeout=60)
    group = weakref.ref(courier.group)
    exchanging = threading.Thread(target=courier.exchange, args=({1: [("units/u.safetensors", b"x")]}, []))
    exchanging.start()
    assert sending.wait(60)
    courier.close()
    assert group() is not None  # the exchange still runs on it
    release.set()
    exchanging.join(60)
    assert group() is None and courier.broken is None
    with pytest.raises(CoordinationError, match="rank 0: this courier is closed"):
        courier.exchange({1: [("units/u.safetensors", b"x")]}, [])
    idle = Courier(Group(), rank=0)
    group = weakref.ref(idle.group)
    idle.close()
    assert group() is None


def test_a_courier_whose_group_cannot_be_made_fails_as_a_coordination_error(monkeypatch):
    """``Courier.open`` is collective (the Tailor's start, a node-local tier): a rank of the job
    that died before it, or never comes, leaves gloo's rendezvous of the courier's group waiting
    on the job's store until the timeout, and torch's store error went out of the Tailor's
    constructor bare. One process in a job of one, told the job has two (rank 1 never comes)."""
    from torch.distributed import HashStore

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        with pytest.raises(CoordinationError, match=r"^rank 0: the courier's gloo group could not be made within 1 s: "
                                                    r"a rank of the job died before it, or is stuck \(.*timeout"):
            Courier.open(timeout=1)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_courier_whose_jobs_store_stops_answering_fails_within_its_deadline(monkeypatch, rank):
    """``Courier.open`` asks the job's store: rank 0 posts the count of lanes and the others wait
    for it (``_agreed_lanes``), then gloo's rendezvous of the group. A store that stops answering
    (SIGSTOP: its host partitioned; torch's client then waits for ever, whatever its own timeout)
    hung the Tailor's constructor for ever: rank 0 in gloo's rendezvous, the others in their wait
    for the count. Now a CoordinationError within timeout + 2 s naming the store and what the rank
    asked, as the coordinator's calls are (``Deadlined``). One process, in a job of one told the
    job has two; watched for 30 s (10 x the deadline: a bound on a hang)."""
    from helpers import stop, stopped_store

    with stopped_store() as (client, server):
        dist.init_process_group("gloo", store=client, rank=0, world_size=1)
        try:
            monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
            monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
            stop(server)
            outcome = []
            opening = threading.Thread(target=lambda: outcome.append(_opened(1)), daemon=True)
            opening.start()
            opening.join(30)
            assert not opening.is_alive(), f"rank {rank}: the courier's open still blocked on the store"
        finally:
            os.kill(server, signal.SIGCONT)
            monkeypatch.undo()
            dist.destroy_process_group()
    asked = "the rendezvous of the courier's gloo group" if rank == 0 else "wait for rank 0's count of lanes"
    assert isinstance(outcome[0], CoordinationError), outcome
    assert re.search(rf"^rank {rank}: the job's store \(TCPStore at 127.0.0.1:{client.port}\) did not answer "
                     rf"{asked} .* within 3 s \(what was asked may still take effect there if it answers again\), "
                     r"while this rank made the courier's gloo group: its host is stopped or cut off from this one",
                     str(outcome[0])), outcome[0]


def _opened(timeout: float) -> object:
    """``Courier.open(timeout)``'s courier, or what it raised."""
    try:
        return Courier.open(timeout=timeout)
    except Exception as err:
        return err


@pytest.mark.parametrize("given", ["0", "many", str(65), "²"])  # "²": a digit to str.isdigit, not to int()
def test_a_count_of_lanes_that_is_not_one_fails_the_courier_naming_the_setting(monkeypatch, given):
    """``LANES_ENV`` is checked on rank 0 and its verdict posted: every rank raises the same
    ConfigError (here, a job of one)."""
    from torch.distributed import HashStore

    monkeypatch.setenv("LLMTAILOR_COURIER_LANES", given)
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=rf"^LLMTAILOR_COURIER_LANES='{given}' on rank 0: give a whole number of "
                                              r"lanes from 1 to 64$"):
            Courier.open(timeout=5)
    finally:
        dist.destroy_process_group()


def test_no_receipt_into_a_buffer_into_gave_outlives_a_packed_exchange_that_raised():
    """With ``into``, a source's files are received straight into the buffers it gives (the
    staged files' mappings, which the save lets go once the exchange raised); when a later
    source's failed otherwise than by a peer's error (its files, announced larger than memory,
    had no buffer: torch's allocation refused), the exchange raised with the earlier source's
    receipts still posted, their bytes landing in the let-go mapping after it, and its own
    sends dropped (gloo drops a send whose work is freed: a live receiver waited out the
    timeout). Every receipt and send posted is now waited for before the exchange returns or
    raises. In one process, the group faked: rank 1's files come in once waited for (or, still
    posted, when the test lets them land late)."""
    import json

    import torch

    from llmtailor.distributed import courier as courier_module

    def wire(content: bytes, total: int) -> dict[int, list[torch.Tensor]]:
        names = json.dumps([["units/u.safetensors", total]]).encode()
        return {courier_module._SIZES: [torch.tensor([len(names), total])],
                courier_module._NAMES: [torch.frombuffer(bytearray(names), dtype=torch.uint8)],
                courier_module._BYTES: [torch.frombuffer(bytearray(content), dtype=torch.uint8)]}

    wires = {1: wire(b"\x07" * 64, 64), 2: wire(b"\x00", 1 << 62)}
    posted = []

    class Receipt:
        def __init__(self, tensor, message):
            self.tensor, self.message, self.waited = tensor, message, False

        def land(self) -> None:
            if self.message is not None:
                self.tensor.copy_(self.message)
                self.message = None

        def wait(self, timeout=None) -> bool:
            self.land()
            self.waited = True
            return True

    class Group:
        def send(self, tensors, dst, tag):
            sent.append(Receipt(tensors[0], None))
            return sent[-1]

        def recv(self, tensors, src, tag):
            receipt = Receipt(tensors[0], wires[src][tag].pop(0))
            if tag == courier_module._BYTES:  # a file's bytes: on their way
                posted.append(receipt)
            else:
                receipt.land()
            return receipt

    mapping, sent = torch.zeros(64, dtype=torch.uint8), []
    mine = ([("units/u.rank-00000.safetensors", 8)], torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(CoordinationError, match="an exchange of files failed"):
        Courier(Group(), 0, timeout=1).exchange_packed({1: mine}, [1, 2], into=lambda src, listing: [mapping] if src == 1 else None)
    assert len(sent) == 3 and all(send.waited for send in sent)  # rank 0's own sends to rank 1 kept to their end
    at_raise = mapping.clone()
    for receipt in posted:  # what is still posted lands now, as a late message would
        receipt.land()
    assert torch.equal(mapping, at_raise), "a receipt into the mapping outlived the raise"
