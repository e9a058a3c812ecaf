"""Collective promotion and the node copies' own retention, the two nodes as threads over one c10d
``HashStore`` (the real processes: tests/distributed/test_collective_promotion.py). A follower
reads what it was ordered to upload under a read lease, so its node's retention cannot remove
it mid-upload; a snapshot its copy dropped before the order reached it is reported gone, and
rank 0 fails the promotion as a source that moved on, leaving nothing in the shared tier."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest
from helpers import failing_fsync_of, stop, stopped_store, tiny, train
from torch.distributed import HashStore

from llmtailor import Full, Run, Tailor
from llmtailor.distributed.coordinator import StoreCoordinator
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import SnapshotNotFoundError
from llmtailor.store.retention import discard_snapshots
from llmtailor.store.tiers import collective
from llmtailor.store.tiers.levels import Level


@pytest.fixture
def copies(tmp_path, tokens):
    """Node 0's and node 1's copies of a run holding steps 1 and 2 (Full: each composite its
    own snapshot), and an empty shared tier."""
    model, opt, sched = tiny()
    tailor = Tailor(tmp_path / "node0", model, opt, sched, policy=Full())
    for step in (1, 2):
        train(model, opt, sched, tokens, [step])
        tailor.save(step)
    tailor.close()
    shutil.copytree(tmp_path / "node0", tmp_path / "node1")
    return Run(tmp_path / "node0"), Run(tmp_path / "node1"), Level.of(Run(tmp_path / "shared"), None, None)


def promote_together(source: Run, follower_copy: Run, target: Level, step: int) -> tuple[object, list]:
    """``Crew.promote`` of ``step`` by node 0 (rank 0) with node 1's uploader following: what
    rank 0's promotion returned or raised, and what node 1 reported."""
    store, reports = HashStore(), []
    leader, follower = (StoreCoordinator.over(store, rank, 2, timeout=30) for rank in range(2))
    uploader = collective.NodeUploader(follower_copy, target.run, 1, follower)
    serve = uploader._serve
    uploader._serve = lambda order: reports.append(serve(order)) or reports[-1]
    uploader.start()
    crew = collective.Crew(Nodes((0, 1)), leader)
    target.take()
    try:
        outcome = crew.promote(source, target, step)
    except SnapshotNotFoundError as err:
        outcome = err
    finally:
        crew.stop()
        uploader.join()
        target.lock.release()
    return outcome, reports


class _JoinsCounted(threading.Event):
    """An uploader's ``_stopped`` that releases ``looks`` at each of its waits on the thread
    named "close" (``NodeUploader.join``'s looks)."""

    def __init__(self, looks: threading.Semaphore):
        super().__init__()
        self.looks = looks

    def wait(self, timeout=None):
        done = super().wait(timeout)
        if threading.current_thread().name == "close":
            self.looks.release()
        return done


def test_a_follower_whose_copy_dropped_the_composite_reports_it_gone(copies):
    """Node 1's retention removed step 1 before the order reached it: it says so without reading
    anything, and rank 0 fails the promotion with SnapshotNotFoundError (the promoter passes over
    it to the newer composite), the shared tier left empty, no staging place left there."""
    node0, node1, shared = copies
    discard_snapshots(node1, [1])
    outcome, reports = promote_together(node0, node1, shared, 1)
    assert reports == [{"gone": [1]}]
    assert isinstance(outcome, SnapshotNotFoundError) and "node(s) 1: step(s) [1]" in str(outcome), outcome
    assert Run(shared.run.root).steps() == [] and not list((shared.run.root / ".tmp").glob("*"))


def test_a_follower_holds_what_it_uploads_against_its_own_retention(copies, monkeypatch):
    """Node 1's retention runs while its upload of step 1 is under way: it leaves step 1 in
    place (held), and the promotion commits it whole."""
    node0, node1, shared = copies
    upload, retained = collective.upload, []

    def retention_meanwhile(source, dst, staging, node):
        if node == 1:  # this node's saves moved on: its keep=1 retention drops step 1
            retained.append(discard_snapshots(Run(node1.root), [1]))
        return upload(source, dst, staging, node)

    monkeypatch.setattr(collective, "upload", retention_meanwhile)
    outcome, reports = promote_together(node0, node1, shared, 1)
    assert [outcome.in_use for outcome in retained] == [[1]] and 1 in node1.steps()
    assert outcome == ([1], Run(node0.root).manifest(1).total_bytes()) and "bytes" in reports[0]
    assert Run(shared.run.root).steps() == [1] and Run(shared.run.root).verify() == []


def test_a_collective_promotion_at_interpreter_exit_commits(copies, monkeypatch):
    """A script that ends without ``close()`` promotes what is due from threads that outlive the
    interpreter's refusal of new pool work (``concurrent.futures`` stops taking any once the main
    thread ended; set here as it is then): each node's upload runs all the same, one file after
    another, and the promotion commits (before: RuntimeError "cannot schedule new futures after
    interpreter shutdown", the promotion failed)."""
    import concurrent.futures.thread

    node0, node1, shared = copies
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    outcome, reports = promote_together(node0, node1, shared, 2)
    assert outcome == ([2], Run(node0.root).manifest(2).total_bytes()) and "bytes" in reports[0], (outcome, reports)
    assert Run(shared.run.root).steps() == [2] and Run(shared.run.root).verify() == []


def test_a_follower_whose_report_finds_the_jobs_store_gone_stops_saying_so_not_with_a_thread_error(monkeypatch, caplog):
    """Rank 0 (hosting the job's store) dies while node 1's uploader serves its order: the post
    of its report fails. The uploader logs that it stops, naming the store, and ends (``join``
    gives up as for any rank 0 that went silent), where torch's network error killed its thread."""
    import datetime
    import gc
    import logging

    from torch.distributed import TCPStore

    server = [TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)]
    client = TCPStore("127.0.0.1", server[0].port, 2, False, timeout=datetime.timedelta(seconds=30))
    leader, follower = StoreCoordinator.over(server[0], 0, 2, timeout=30), StoreCoordinator.over(client, 1, 2, timeout=30)
    uploader = collective.NodeUploader(None, None, 1, follower)

    def serve(order):  # rank 0 dies as node 1 uploads; node 1's client has met the loss once it reports
        server.clear()
        leader._store = None
        gc.collect()
        with pytest.raises(Exception):
            client.check(["anything"])
        return {"bytes": 0}

    uploader._serve = serve
    died: list = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    with caplog.at_level(logging.WARNING, logger=collective.__name__):
        uploader.start()
        leader.post(collective.order_tag(1), {"staging": {}})
        uploader._thread.join(120)
    assert not uploader._thread.is_alive() and died == []
    assert "node 1's uploader could not report on promotion 1 and stops: the job's store went away while this rank " \
           "posted 'promotion/1/node/1'" in caplog.text, caplog.text


def test_an_idle_follower_whose_jobs_store_goes_away_stops_saying_so(monkeypatch, caplog):
    """Node 1's uploader waits for rank 0's next order, none due (promotions may be far apart),
    when rank 0, hosting the job's store, dies. No order can come: the uploader's thread ends,
    logging why (awaited here: the thread's end; its coordinator's timeout is an hour), and
    ``join`` returns at once. Before: it asked the dead store again every 0.2 s for as long as
    its process lived (the thread still alive after the bound below; only ``join``, at a close,
    gave up on it, after the timeout)."""
    import datetime
    import gc
    import logging

    from torch.distributed import TCPStore

    server = [TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)]
    # The client's own timeout bounds how long its wait on a store that died may take to say so.
    client = TCPStore("127.0.0.1", server[0].port, 2, False, timeout=datetime.timedelta(seconds=5))
    leader = StoreCoordinator.over(server[0], 0, 2, timeout=3600)
    uploader, waiting = watched_uploader(client, 3600)
    died: list = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    with caplog.at_level(logging.WARNING, logger=collective.__name__):
        uploader.start()
        assert waiting.wait(60)  # idle: waiting for order 1
        server.clear()  # rank 0 dies, and the store with it
        leader._store = None
        gc.collect()
        uploader._thread.join(120)  # a bound on a hang
        assert not uploader._thread.is_alive(), "the idle uploader still polls the store that went away"
        uploader.join()
    assert died == []
    assert "node 1's uploader stops waiting for promotion order 1: the job's store went away" in caplog.text, caplog.text


def watched_uploader(client, timeout: float) -> tuple[collective.NodeUploader, threading.Event]:
    """Node 1's uploader over ``client`` (a client of the job's store; the coordinator's
    ``timeout``), and an event set once it waits for an order (its coordinator's ``collect``)."""
    uploader = collective.NodeUploader(None, None, 1, StoreCoordinator.over(client, 1, 2, timeout=timeout))
    waiting, collect = threading.Event(), uploader.coordinator.collect

    def collect_seen(tags, what):
        waiting.set()
        return collect(tags, what)

    uploader.coordinator.collect = collect_seen
    return uploader, waiting


@pytest.mark.parametrize("failure", ["gone", "timed out", "client"])
def test_a_follower_whose_look_at_the_jobs_store_or_report_fails_once_serves_on(failure):
    """Node 1's uploader waits for an order when one look at the job's store fails (a hiccup: a
    connection reset, a busy machine), its wait's and the look after it, and its report's post
    fails once too: the store answers again after. The uploader serves on: order 1 is served and
    reported, and it stops when rank 0 says so (awaited: its thread's end). The failure as the
    coordinator names a store gone, or as torch's client raises it (a store's timeout, its
    RuntimeError). Before: a failed look stopped its uploads for the rest of the job (its thread
    ended with order 1 unserved: no report); so did a failed post; and a look that raised other
    than the coordinator's error ended its thread with it."""
    from torch.distributed import DistStoreError

    from llmtailor.distributed.coordinator import CoordinationError

    store = HashStore()
    leader, follower = StoreCoordinator.over(store, 0, 2, timeout=3600), StoreCoordinator.over(store, 1, 2, timeout=3600)
    uploader = collective.NodeUploader(None, None, 1, follower)
    uploader._serve = lambda order: {"bytes": 0}
    hiccups: list[str] = []

    def once(name):
        call = getattr(follower, name)

        def hiccup(*args):
            if name not in hiccups:
                hiccups.append(name)
                raise {"gone": CoordinationError(f"the job's store went away while this rank {name}ed: Connection reset"),
                       "timed out": DistStoreError("Socket Timeout"),
                       "client": RuntimeError("Connection reset by peer")}[failure]
            return call(*args)

        return hiccup

    follower.collect, follower.poll, follower.post = once("collect"), once("poll"), once("post")
    leader.post(collective.order_tag(1), {"staging": {}})
    leader.post(collective.order_tag(2), {"stop": True})
    died: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(threading, "excepthook", died.append)
        uploader.start()
        uploader._thread.join(120)  # a bound on a hang
    assert died == [] and hiccups == ["collect", "poll", "post"] and not uploader._thread.is_alive()
    assert leader.poll(collective.report_tag(1, 1)) == (True, {"bytes": 0}), "one failed look or post stopped the uploader"


def test_a_report_after_a_serve_longer_than_the_timeout_is_no_silence_of_rank_0(monkeypatch, caplog):
    """Node 1 served an order for longer than the timeout (rank 0 waited on: it was serving);
    while its report is on its way, its close's ``join`` looks (awaited: that look). Rank 0 was
    last heard as the serving ended, so ``join`` waits on and returns once rank 0 said stop.
    Before: it counted the silence from the order's arrival, gave up during the report's post
    and logged a false "heard nothing from rank 0". The uploader's clock is the test's."""
    import logging
    import types

    clock = [0.0]
    monkeypatch.setattr(collective, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    store = HashStore()
    leader, follower = StoreCoordinator.over(store, 0, 2, timeout=3600), StoreCoordinator.over(store, 1, 2, timeout=3600)
    uploader = collective.NodeUploader(None, None, 1, follower)

    def serve(order):  # two hours
        clock[0] += 2 * 3600
        return {"bytes": 0}

    uploader._serve = serve
    posting, looks, looked = threading.Event(), threading.Semaphore(0), threading.Semaphore(0)

    class Watched(threading.Event):  # join's looks (the waits of the thread named "close")
        def wait(self, timeout=None):
            done = super().wait(timeout)
            if threading.current_thread().name == "close":
                (looked if posting.is_set() else looks).release()
            return done

    uploader._stopped = Watched()
    post = follower.post

    def report(tag, value):  # held until join looked while the report is on its way
        posting.set()
        assert looked.acquire(timeout=60)
        post(tag, value)

    follower.post = report
    ended: list = []

    def close():
        try:
            uploader.join()
        finally:
            ended.append(uploader._stopped.is_set())
            looked.release()

    with caplog.at_level(logging.WARNING, logger=collective.__name__):
        uploader.start()
        joining = threading.Thread(target=close, name="close", daemon=True)
        joining.start()
        assert looks.acquire(timeout=60)  # join looks: its silence counted from before the order
        leader.post(collective.order_tag(1), {"staging": {}})
        assert leader.collect({1: collective.report_tag(1, 1)}, "node 1's part") == {1: {"bytes": 0}}
        leader.post(collective.order_tag(2), {"stop": True})
        joining.join(120)
    assert ended == [True] and "heard nothing" not in caplog.text, caplog.text


def test_a_close_after_rank_0_was_silent_longer_than_the_timeout_still_serves_the_last_order():
    """Promotions far apart: rank 0 last ordered one longer ago than the timeout. A follower's
    close waits for its uploader (``join``) while rank 0's close orders the promotion of the
    last composite: that silence before the close is no sign of rank 0's death, so ``join`` looks
    again and again (awaited here: its second look) and returns once the order was served and
    rank 0 said stop. Before: it returned at its first look ("heard nothing from rank 0 for
    3600 s; it stops"), and the process could exit before its part was uploaded: the second
    look never came."""
    store = HashStore()
    leader, follower = StoreCoordinator.over(store, 0, 2, timeout=3600), StoreCoordinator.over(store, 1, 2, timeout=3600)
    uploader = collective.NodeUploader(None, None, 1, follower)
    uploader._serve = lambda order: {"bytes": 0}
    looks = threading.Semaphore(0)

    uploader._stopped = _JoinsCounted(looks)
    uploader._heard -= 2 * 3600  # rank 0's last order, two hours ago
    uploader.start()
    served: list = []

    def close():
        uploader.join()
        served.append(leader.poll(collective.report_tag(1, 1))[0])

    joining = threading.Thread(target=close, name="close", daemon=True)
    joining.start()
    assert looks.acquire(timeout=60) and looks.acquire(timeout=60), "join gave up at its first look"
    leader.post(collective.order_tag(1), {"staging": {}})
    assert leader.collect({1: collective.report_tag(1, 1)}, "node 1's part") == {1: {"bytes": 0}}
    leader.post(collective.order_tag(2), {"stop": True})
    joining.join(120)
    assert not joining.is_alive() and served == [True]


def test_a_follower_that_stopped_on_its_own_is_not_waited_for_until_the_timeout():
    """An uploader whose thread ended without rank 0's stop (its report found the job's store
    gone: it logs that it stops) is not waited for by ``join`` (a close, or the exit's
    ``_Unclosed.finish``) for the coordinator's whole timeout, as if it might still serve an
    order: ``join`` returns once the thread ended. The timeout here is an hour; the wait below
    a bound on a hang."""
    from llmtailor.distributed.coordinator import CoordinationError

    store = HashStore()
    leader, follower = StoreCoordinator.over(store, 0, 2, timeout=3600), StoreCoordinator.over(store, 1, 2, timeout=3600)
    uploader = collective.NodeUploader(None, None, 1, follower)
    uploader._serve = lambda order: {"bytes": 0}

    def gone(tag, value):
        raise CoordinationError(f"the job's store went away while this rank posted {tag!r}")

    follower.post = gone
    uploader.start()
    leader.post(collective.order_tag(1), {"staging": {}})
    uploader._thread.join(120)
    assert not uploader._thread.is_alive()
    joined = threading.Thread(target=uploader.join, daemon=True)
    joined.start()
    joined.join(60)
    assert not joined.is_alive(), "join waited on for an uploader whose thread had ended"


@pytest.mark.parametrize("order", ["dropped first", "ended first"])
def test_a_dropped_writers_entry_goes_once_its_uploader_stopped_on_its_own(order):
    """A node leader's writer dropped without ``close()`` (a sweep's, a notebook's) whose uploader
    stops on its own, not told by rank 0 (its report found the job's store gone: it logs that it
    stops), before or after the writer went: the exit keeps nothing of it (``runtime._UNCLOSED``),
    nor of its uploader (its coordinator, that one's client of the job's store, its runs). Before:
    the entry stayed until the process exited, holding the uploader and all it holds (one per
    dropped writer of a long job): ``assert 1 == 0``."""
    import gc

    from llmtailor.distributed.coordinator import CoordinationError
    from llmtailor.store.tiers import runtime

    class Writer:  # what ``_Unclosed`` watches of a dropped writer: its tiers (no promoter on a node leader)
        pass

    store = HashStore()
    leader, follower = StoreCoordinator.over(store, 0, 2, timeout=3600), StoreCoordinator.over(store, 1, 2, timeout=3600)
    uploader = collective.NodeUploader(None, None, 1, follower)
    uploader._serve = lambda order: {"bytes": 0}
    go = threading.Event()

    def gone(tag, value):
        go.wait(60)  # its report waits until the test's writer is dropped (or not)
        raise CoordinationError(f"the job's store went away while this rank posted {tag!r}")

    follower.post = gone
    writer = Writer()
    kept = len(runtime._UNCLOSED)
    unclosed = runtime._Unclosed(writer, None, uploader)
    runtime._UNCLOSED[unclosed] = None
    try:
        uploader.start()
        leader.post(collective.order_tag(1), {"staging": {}})
        if order == "ended first":
            go.set()
            uploader._thread.join(120)
            assert not uploader._thread.is_alive()
        del writer
        gc.collect()
        go.set()
        uploader._thread.join(120)
        assert not uploader._thread.is_alive()
        assert len(runtime._UNCLOSED) == kept and unclosed.uploader is None
    finally:
        runtime._UNCLOSED.pop(unclosed, None)


def test_a_collective_promotion_whose_fsync_fails_after_its_rename_is_committed_and_says_so(copies, monkeypatch):
    """Rank 0 commits the composite both nodes uploaded into the shared tier; the fsync of that
    tier's ``snapshots/`` after the rename fails (EIO). The snapshot is visible and whole there:
    the promotion raises what says so (``PromotedUnconfirmed``: the promoter counts it promoted,
    reports it, never retries it), with what it copied; nothing staged is left, and ``latest`` is
    left as it was (none yet). Before: the OSError of the fsync, as if nothing had been committed
    (the promoter's retry then found step 2 there and skipped it)."""
    import os
    from pathlib import Path

    from llmtailor.constants import LATEST_FILE
    from llmtailor.errors import TailorError

    node0, node1, shared = copies
    root = Path(os.path.realpath(shared.run.root))
    failed = failing_fsync_of(monkeypatch, root / "snapshots", root / "snapshots" / "step-00000002")
    with pytest.raises(TailorError, match=rf"^promoting step 2 to {shared.name}: step 2 was promoted and committed in "
                                          r".*, but its name in snapshots/ could not be made durable \(Input/output "
                                          r"error\).*latest was left as it was") as raised:
        promote_together(node0, node1, shared, 2)
    monkeypatch.undo()
    assert failed == [str(root / "snapshots")]
    assert (raised.value.whole, raised.value.copied, raised.value.bytes) == (True, [2], Run(node0.root).manifest(2).total_bytes())
    assert Run(root).steps() == [2] and Run(root).verify() == [] and not (root / LATEST_FILE).exists()
    assert not list((root / ".tmp").glob("*"))


def test_the_ranks_wait_on_while_rank_0s_last_promotion_at_close_goes_on_past_the_timeout(tmp_path):
    """Two ranks (threads over one c10d store, timeout 1 s) close a writer with a second tier:
    rank 0 promotes the last composite (``Tiers.close``: its promoter's ``finish``), which here
    goes on past the timeout, advancing (a large upload: until rank 1 saw it ``_LOOKS + 2``
    times); rank 1 waits for rank 0's word on the promotion (``raise_failure``) and gets it.
    Before, rank 0's close showed no progress: rank 1 raised that rank 0 did not announce it
    while rank 0 went on and promoted (a close failed on every other rank whenever the last
    promotion took longer than the timeout)."""
    from helpers import progressing

    from llmtailor.distributed.coordinator import _LOOKS

    store, gave_up = HashStore(), []
    promotion = lambda coord: progressing(store, [1], _LOOKS + 2, gave_up)  # noqa: E731
    assert close_two_ranks(tmp_path, store, promotion, gave_up) == [None, None]


def close_two_ranks(tmp_path, store, promotion, gave_up: list, beside=None) -> list:
    """Two ranks (threads over one c10d ``store``, timeout 1 s) close a writer with a second
    tier, rank 0's last promotion being ``promotion(its coordinator)``, and wait for rank 0's
    word on it (``raise_failure``); ``beside(rank 1's coordinator)`` runs on a thread of rank 1
    meanwhile. A rank that raised is added to ``gave_up``. Each rank's outcome."""
    from helpers import on_threads

    from llmtailor.store.tiers.config import Tier
    from llmtailor.store.tiers.promote import Promoter
    from llmtailor.store.tiers.runtime import Tiers

    def close(rank: int):
        coord = StoreCoordinator.over(store, rank, 2, timeout=1)
        tiers = Tiers(tmp_path / "home", [Tier(location=str(tmp_path / "fast"))])
        if rank == 0:
            tiers.promoter = Promoter(tiers.levels, [1, None])
            tiers.promoter._pass = lambda target, final: promotion(coord)
        elif beside is not None:
            meanwhile = threading.Thread(target=beside, args=(coord,), daemon=True)
            meanwhile.start()
        try:
            tiers.close(coord)
            tiers.raise_failure(coord)
        except Exception:
            gave_up.append(rank)
            raise
        finally:
            if rank == 1 and beside is not None:
                meanwhile.join(120)

    return on_threads(2, close)


def test_the_ranks_wait_on_while_rank_0s_last_promotion_at_close_waits_for_node_1s_upload_past_the_timeout(tmp_path):
    """Rank 0's last promotion at close (``Tiers.close``) waits for node 1's part of it
    (``Crew._await_nodes``), which goes on past the timeout, advancing (node 1's uploader inside
    ``working`` in its lane, until rank 1's close saw rank 0 live ``_LOOKS + 2`` times); rank 1
    waits for rank 0's word on the promotion (``raise_failure``) and gets it: rank 0's wait
    relays node 1's progress into the lane of its own work (its close's), where the ranks waiting
    for rank 0 look. Before, the relay went into the uploader's lane, where no rank looks at rank
    0: rank 1 raised that rank 0 did not announce 'r1/promotion' while rank 0 went on and promoted.
    Two ranks as threads over one c10d store, timeout 1 s."""
    from helpers import relayed

    from llmtailor.distributed.coordinator import _LOOKS
    from llmtailor.distributed.progress import advance

    store, gave_up = HashStore(), []

    def upload(coord):  # node 1's part of promotion 1: advancing until rank 0 relayed it where rank 1 looks
        with coord.working(lane=collective._LANE):
            while relayed(store, 0) < _LOOKS + 2 and not gave_up:
                advance()
                threading.Event().wait(0.01)
        coord.post(collective.report_tag(1, 1), {"bytes": 1})

    promotion = lambda coord: collective.Crew(Nodes((0, 1)), coord)._await_nodes(1)  # noqa: E731
    assert close_two_ranks(tmp_path, store, promotion, gave_up, beside=upload) == [None, None]


def test_a_followers_close_waits_on_while_rank_0s_close_advances_past_the_timeout(caplog):
    """Node 1's close waits for rank 0's stop (``NodeUploader.join``, timeout 1 s) while rank 0's
    close goes on past the timeout, advancing inside ``Coordinator.working`` (its last
    promotion: node 0 uploading most of it, as a DDP rank 0 wrote every unit), and sends node 1
    no order meanwhile: node 1 waits on (here until its join looked 3 timeouts' worth) and
    stops when rank 0 says so. Before, it gave up after the timeout, logging a false "heard
    nothing from rank 0", and its process could exit before rank 0's last order reached it."""
    import logging

    from llmtailor.distributed.progress import advance

    store = HashStore()
    leader, follower = StoreCoordinator.over(store, 0, 2, timeout=1), StoreCoordinator.over(store, 1, 2, timeout=1)
    uploader = collective.NodeUploader(None, None, 1, follower)
    looks, joined = threading.Semaphore(0), threading.Event()

    uploader._stopped = _JoinsCounted(looks)

    def close():
        try:
            uploader.join()
        finally:
            joined.set()

    with caplog.at_level(logging.WARNING, logger=collective.__name__):
        uploader.start()
        joining = threading.Thread(target=close, name="close", daemon=True)
        joining.start()
        with leader.working():  # rank 0's close: its last promotion advancing
            for _ in range(round(3 / collective.IDLE_WAIT)):
                while not looks.acquire(timeout=0.01):
                    advance()
                    if joined.is_set():
                        break
        stopped_early = joined.is_set()
        leader.post(collective.order_tag(1), {"stop": True})
        joining.join(120)
    assert not stopped_early and "heard nothing" not in caplog.text, caplog.text


def test_a_followers_close_gives_up_after_the_timeout_on_a_jobs_store_that_stops_answering(caplog):
    """Rank 0's host stops answering (partitioned; here the process serving the job's real
    TCPStore stopped with SIGSTOP) while node 1's uploader waits for an order and its close waits
    for rank 0's stop (``NodeUploader.join``, timeout 1 s). torch's client calls on that store
    never return, whatever its own timeout; the coordinator's give up after its timeout: ``join``
    gives up, saying so, as it promises for a silent rank 0, and the uploader's wait for an order
    gives up too, then its looks, and it stops on its own, saying so, the store still stopped.
    Before left58's fix, ``join`` never returned (it looked at rank 0's beat itself); before this
    one, the uploader's wait never returned (still blocked after the bounds below, bounds on a hang)."""
    import logging

    with stopped_store() as (client, server), caplog.at_level(logging.WARNING, logger=collective.__name__):
        uploader, waiting = watched_uploader(client, 1)
        uploader.start()
        assert waiting.wait(60)  # idle: waiting for order 1
        stop(server)
        joining = threading.Thread(target=uploader.join, name="close", daemon=True)
        joining.start()
        joining.join(60)
        assert not joining.is_alive(), "join still waits on the store that stopped answering"
        assert "node 1's uploader heard nothing from rank 0 for 1 s; it stops" in caplog.text, caplog.text
        uploader._thread.join(60)
        assert not uploader._thread.is_alive(), "the uploader still waits on the store that stopped answering"
    assert "node 1's uploader stops waiting for promotion order 1: rank 1: the job's store (TCPStore at" in caplog.text, \
        caplog.text
