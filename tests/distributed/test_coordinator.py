"""The coordinator's messages between ranks, the ranks as threads over one c10d ``HashStore``."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import HashStore

from llmtailor.distributed.coordinator import CoordinationError, PeerStopped, StoreCoordinator
from llmtailor.errors import IntegrityError, PromotionError, TailorError

from helpers import on_threads, progressing, relayed, stop, stopped_store


def on_every_rank(world_size, work):
    """``work(coordinator)`` on each rank (a thread), over one store: each rank's result or error."""
    store = HashStore()
    return on_threads(world_size, lambda rank: work(StoreCoordinator.over(store, rank, world_size, timeout=60)))


def test_a_promotion_failure_reaches_every_rank_as_itself():
    """Rank 0 raises a promotion failure inside the save's first message (``Tiers.before_save``):
    every rank raises a PromotionError with its message, so ranks that catch it train on in step;
    any other failure of rank 0 is a CoordinationError elsewhere."""
    def failing(error):
        def compute():
            raise error
        return lambda coordinator: coordinator.broadcast("r1/open", compute if coordinator.is_leader else None)

    outcomes = on_every_rank(3, failing(PromotionError("promoting step 1 from mem to disk failed 3 times")))
    assert [type(o) for o in outcomes] == [PromotionError] * 3
    assert {str(o) for o in outcomes} == {"promoting step 1 from mem to disk failed 3 times"}
    outcomes = on_every_rank(2, failing(TailorError("the lock was lost")))
    assert [type(o) for o in outcomes] == [TailorError, CoordinationError]
    assert str(outcomes[1]) == "rank 0 failed: the lock was lost"


def test_a_rank_that_failed_because_another_stopped_takes_that_one_s_kind_of_failure():
    """A restore's ranks agree on one failure: an IntegrityError only where every failed rank's
    was one (a fallback attempt then follows). A rank that failed only because another stopped
    part-way (``PeerStopped``, the read plan's) counts as that one's kind: damage found on rank
    0 while its peers learn that it stopped is still damage (it was a CoordinationError)."""
    def agree(errors):
        return lambda coordinator: coordinator.agree("r1/loaded/0", 5, errors[coordinator.rank], True)[0]

    stopped = PeerStopped("rank 0 stopped taking the items of the read plan part-way")
    outcomes = on_every_rank(3, agree([IntegrityError("unit 'a' is damaged"), stopped, None]))
    assert [type(o) for o in outcomes] == [IntegrityError] * 3, outcomes
    assert "rank 0: unit 'a' is damaged; rank 1: rank 0 stopped" in str(outcomes[0])
    outcomes = on_every_rank(3, agree([KeyError("a bug"), stopped, None]))
    assert [type(o) for o in outcomes] == [CoordinationError] * 3, outcomes


def test_a_broadcast_reaches_every_rank():
    outcomes = on_every_rank(3, lambda c: c.broadcast("r1/open", (lambda: {"staging": "s"}) if c.is_leader else None))
    assert outcomes == [{"staging": "s"}] * 3


def test_posts_reach_the_rank_that_collects_them_and_a_silent_rank_is_named():
    """Point to point (collective promotion's orders and reports): rank 0 collects what ranks 1
    and 2 posted; a rank that posts nothing is named once the timeout has passed."""
    store = HashStore()
    ranks = [StoreCoordinator.over(store, rank, 3, timeout=1) for rank in range(3)]
    assert ranks[1].poll("promotion/1/node/1") == (False, None)
    ranks[1].post("promotion/1/node/1", {"bytes": 5})
    ranks[2].post("promotion/1/node/2", {"error": "disk"})
    assert ranks[0].collect({1: "promotion/1/node/1", 2: "promotion/1/node/2"}, "their part") == {
        1: {"bytes": 5}, 2: {"error": "disk"}}
    with pytest.raises(CoordinationError, match=r"rank\(s\) \[2\] did not report their part of promotion 2 within 1 s"):
        ranks[1].post("promotion/2/node/1", {"bytes": 5})
        ranks[0].collect({1: "promotion/2/node/1", 2: "promotion/2/node/2"}, "their part of promotion 2")


def test_a_rank_waiting_for_a_message_holds_no_other_threads_store_calls():
    """Over a real TCPStore: while rank 1's background thread waits (blocked in the store's own
    ``wait``) for rank 0's part of an exchange, rank 1's other thread still posts and reads
    through the same coordinator; rank 0 answers only once it has read that post."""
    import datetime

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=30))
    ranks = [StoreCoordinator.over(store, rank, 2, timeout=30) for rank, store in enumerate((server, client))]
    waited: list = []
    waiting = threading.Thread(target=lambda: waited.append(ranks[1].exchange("r1/committed", "one")))
    waiting.start()
    ranks[1].post("aside", {"from": "the training thread"})  # the shared client is free while the other waits
    assert ranks[1].poll("aside") == (True, {"from": "the training thread"})
    assert ranks[0].collect({1: "aside"}, "the aside") == {1: {"from": "the training thread"}}
    assert ranks[0].exchange("r1/committed", "zero") == ["zero", "one"]
    waiting.join(60)
    assert waited == [["zero", "one"]]


class Uncloneable:
    """A store of one's own that cannot be cloned (a custom c10d store): the calls the coordinator makes."""

    def __init__(self):
        self.inner = HashStore()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def clone(self):
        raise NotImplementedError("clone")


def test_a_store_that_cannot_be_cloned_is_waited_on_by_looking_and_a_silent_rank_is_still_named():
    store = Uncloneable()
    # The exchange that ends well waits as long as the other thread may take to post on a busy
    # machine; only the silent rank's wait is short (its 1 s is what the message says).
    ranks = [StoreCoordinator.over(store, rank, 2, timeout=120) for rank in range(2)]
    answered: list = []
    other = threading.Thread(target=lambda: answered.append(ranks[1].exchange("r1/committed", "one")))
    other.start()
    assert ranks[0].exchange("r1/committed", "zero") == ["zero", "one"]
    other.join(60)
    assert answered == [["zero", "one"]]
    ranks[0].timeout = 1
    with pytest.raises(CoordinationError, match=r"rank\(s\) \[1\] did not report on 'r2/committed' within 1 s"):
        ranks[0].exchange("r2/committed", "zero")


HOST_STORE = """
import datetime, sys, time
from torch.distributed import TCPStore
server = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
print(server.port, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_rank_waiting_when_the_process_hosting_the_store_dies_gets_a_coordination_error():
    """The job's TCPStore hosted by another process (rank 0's, as ``init_process_group`` over
    ``MASTER_ADDR`` sets it up), SIGKILLed: rank 1's waits, one on the client its earlier wait
    kept and one that needs a new client, each end in a CoordinationError naming rank 0 and the
    store, not a torch network error (nor a new client's connect retried for the store's own
    timeout)."""
    import datetime
    import signal
    import subprocess
    import sys

    from torch.distributed import TCPStore

    host = subprocess.Popen([sys.executable, "-c", HOST_STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=20))
        rank = StoreCoordinator.over(client, 1, 2, timeout=5)
        rank.post("mine", 1)
        assert rank.collect({1: "mine"}, "its own post") == {1: 1}  # a wait that ended well: its client is kept
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    for tag in ("r1/indexes", "r2/indexes"):  # the kept client's wait, then a new client's
        with pytest.raises(CoordinationError, match=r"store went away while this rank waited for rank\(s\) \[0\]"):
            rank.broadcast(tag, None)
    # Every other call through the store, on the client that met the loss (a courier's look at
    # its board, a collective promotion's report, a rank's part of a restore's exchange or of a
    # survey), names it too, saying what this rank was doing, where torch's network error went out.
    calls = {"posted 'promotion/1/node/1'": lambda: rank.post("promotion/1/node/1", {"bytes": 5}),
             "looked for 'courier/0/broken'": lambda: rank.poll("courier/0/broken"),
             "reported on 'r3/loaded/0'": lambda: rank.exchange("r3/loaded/0", {"error": None}),
             "reported on 'r4/held'": lambda: rank.gather("r4/held", {}),
             "announced 'r5/plan'": lambda: StoreCoordinator.over(client, 0, 2, timeout=5).broadcast("r5/plan", dict)}
    for doing, call in calls.items():
        with pytest.raises(CoordinationError, match=rf"^the job's store went away while this rank {re.escape(doing)}: "
                                                    r"the process hosting it \(rank 0's, or the launcher's\) died"):
            call()
    # A rank reporting its own failure raises that, not the store's.
    with pytest.raises(ValueError, match="its own"):
        rank.gather("r6/held", ValueError("its own"))


class Watched:
    """A client of a store (``underlying_store``, as torch's PrefixStore names it) that says
    when a rank asks it for an ``add`` (a beat)."""

    def __init__(self, store):
        self.underlying_store, self.added = store, threading.Event()

    def __getattr__(self, name):
        return getattr(self.underlying_store, name)

    def add(self, key, amount):
        self.added.set()
        return self.underlying_store.add(key, amount)


def ends_a_block_of_work(coordinator, watched):
    """A block of work (``working``) whose rank showed progress: its beat thread asks the store
    (``watched``), and the block ends (it waits for that thread) once it has."""
    from llmtailor.distributed.progress import advance

    with coordinator.working():
        advance()
        assert watched.added.wait(60)


STOPPED_CALLS = {
    "exchange": (1, lambda c, _: c.exchange("r1/loaded", {"touched": False})),
    "leader's gather": (0, lambda c, _: c.gather("r1/held", {})),
    "follower's broadcast (a close's raise_failure)": (1, lambda c, _: c.broadcast("r1/promotion", None)),
    "wait on a kept client (a collect)": (1, lambda c, _: c.collect({0: "order/1"}, "order 1")),
    "look at a beat": (1, lambda c, _: c.beat(0)),
    "a block's beat": (1, ends_a_block_of_work),
}


@pytest.mark.slow
@pytest.mark.parametrize("call", list(STOPPED_CALLS))
def test_every_call_on_a_jobs_store_that_stops_answering_ends_within_the_deadline(call):
    """The job's real TCPStore served by a process that stops (SIGSTOP: its host partitioned;
    the kernel still takes the bytes, nothing answers): torch's client calls on it never return,
    whatever its own timeout (1 s here). Each kind of call of the coordinator (timeout 1 s)
    returns or raises within its deadline: a CoordinationError naming the store, the call and
    what the rank was doing; a block of work's beat gives up on its own, and the block ends. (A
    ``set`` alone, a leader's broadcast, returns: torch's client sends it and waits for no answer.)
    Watched for 30 s (10 x the deadline: a bound on a hang). Before: each was still blocked."""
    rank, work = STOPPED_CALLS[call]
    with stopped_store() as (client, server):
        coordinator = StoreCoordinator.over(watched := Watched(client), rank, 2, timeout=1)
        if call == "wait on a kept client (a collect)":
            coordinator._waiters.append(coordinator._clone())
        stop(server)
        outcome = []
        calling = threading.Thread(target=lambda: outcome.append(_outcome_of(work, coordinator, watched)), daemon=True)
        calling.start()
        calling.join(30)
        assert not calling.is_alive(), f"{call}: still blocked on the store that stopped answering"
    if call == "a block's beat":
        assert outcome == [None]
        return
    assert isinstance(outcome[0], CoordinationError), outcome
    assert re.search(rf"^rank {rank}: the job's store \(TCPStore at 127.0.0.1:{client.port}\) did not answer "
                     r"\w+ .* within 3 s \(what was asked may still take effect there if it answers again\), while "
                     r"this rank .*: its host is stopped or cut off from this one", str(outcome[0])), outcome[0]


def _outcome_of(work, coordinator, watched):
    try:
        return work(coordinator, watched)
    except Exception as err:
        return err


@pytest.mark.slow
def test_a_client_given_up_on_is_not_asked_again_until_its_call_returns():
    """A call on a store that stopped answering given up on keeps its own thread, and nothing
    more: the next calls on that client are refused at once (each would otherwise queue behind
    it in torch's client, holding a thread of its own), saying so; once the store answers again
    (SIGCONT) and that call returned, the client is asked again."""
    with stopped_store() as (client, server):
        coordinator = StoreCoordinator.over(client, 1, 2, timeout=1)
        coordinator.post("before", 1)
        stop(server)
        with pytest.raises(CoordinationError, match="did not answer compare_set 'llmtailor/0/r1/gate'"):
            coordinator.claim("r1/gate", "go")
        threads = threading.active_count()
        for tag in ("r1/a", "r1/b"):
            refused = rf"not asked again until it does\); set 'llmtailor/0/{tag}' not asked"
            with pytest.raises(CoordinationError, match=r"has not answered a call of this rank for 3 s or more \(it is " + refused):
                coordinator.post(tag, 1)
        assert threading.active_count() == threads
        os.kill(server, signal.SIGCONT)
        for _ in range(600):  # until the stuck call returned (the store answers again)
            try:
                assert coordinator.poll("before") == (True, 1)
                break
            except CoordinationError:
                time.sleep(0.1)
        assert coordinator.poll("r1/gate") == (True, "go")  # the call given up on took effect late
        assert coordinator.poll("r1/a") == (False, None)  # one refused did not


class Held:
    """A store whose ``check`` answers only once ``release`` is set (a store that stopped
    answering, in one process), saying when it is asked (``asked``)."""

    def __init__(self):
        self.asked, self.release = threading.Event(), threading.Event()

    def check(self, keys):
        self.asked.set()
        self.release.wait(60)
        return False


class Interrupted(BaseException):
    """What a signal's handler raises in the main thread, as Ctrl-C's KeyboardInterrupt does."""


def _store_callers() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "llmtailor-store-call"}


def test_a_store_call_whose_caller_is_interrupted_ends_its_thread_and_the_client_is_asked_again(monkeypatch):
    """Ctrl-C (a KeyboardInterrupt, or any BaseException) in the thread waiting for a store call's
    answer (``Deadlined``): the thread making the call (an ``_Asker``) ends once the call returns,
    its answer dropped, and the client is not taken for one that stopped answering: the next call
    asks it. Before: that thread lived on for the process's life, idle, out of the pool, holding
    the answer nobody took (a thread lost per interrupt)."""
    from llmtailor.distributed import coordinator as coordinator_module

    assert threading.current_thread() is threading.main_thread()  # where a signal's handler runs
    monkeypatch.setattr(coordinator_module, "_askers", [])  # the call's thread a fresh one
    held, main = Held(), threading.get_ident()

    def interrupt(*_):
        raise Interrupted

    coordinator, before = StoreCoordinator.over(held, 1, 2, timeout=60), _store_callers()
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=lambda: held.asked.wait(60) and signal.pthread_kill(main, signal.SIGUSR1), daemon=True).start()
        with pytest.raises(Interrupted):
            coordinator.poll("r1/a")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    (asker,) = _store_callers() - before
    held.release.set()
    asker.join(30)
    assert not asker.is_alive(), "the thread of the interrupted call lives on"
    assert coordinator.poll("r1/a") == (False, None)


def test_a_forked_child_gives_up_on_a_store_call_though_a_thread_of_its_parent_was_giving_up_on_one():
    """A fork (a DataLoader's worker, a launcher's rank) while another thread of the parent held
    the lock of the calls given up on (``Deadlined``: it gives one up, or one returns): the child's
    copy of that lock stayed held, nobody in the child to release it, and the child's first call
    given up on (a store that stopped answering) hung on it for ever. The child's first call given
    up on is a CoordinationError, within its deadline."""
    from llmtailor.distributed import coordinator as coordinator_module

    held = Held()
    with coordinator_module._given_up_lock:  # as a thread of the parent giving up on a call at the fork
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                StoreCoordinator.over(held, 1, 2, timeout=0.1).poll("r1/a")
            except CoordinationError as err:
                code = 0 if "did not answer check ['llmtailor/0/r1/a'] within 2.1 s" in str(err) else 2
            finally:
                os._exit(code)
    for _ in range(300):  # 30 s: 14 x the deadline, a bound on a hang
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung giving up on its store call")
    held.release.set()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_free_port_for_a_launch_lies_outside_the_kernels_ports_for_outgoing_connections():
    """``helpers.free_port`` (a launch's rendezvous, a test server): a port bound as 0 comes from
    the range outgoing connections take theirs from, where one of the many a busy machine's
    ranks open could take it before the launch's store binds it ("address already in use").
    Below that range, and a store binds it."""
    import datetime

    from torch.distributed import TCPStore

    from helpers import free_port

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low, high = map(int, ranges.read_text().split()) if ranges.exists() else (32768, 60999)
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high, (port, low, high)
    server = TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    assert server.port == port


def test_a_saves_all_reduce_that_gloo_fails_names_the_rank_and_what_it_was_doing():
    """A save's one collective (the units' drift and the frozen news, summed over the ranks on
    the training thread) with a peer gone: gloo's error for the lost connection went out of
    ``save`` bare, where a rank lost later in a save is a CoordinationError. Over a coordinator of
    its own (one process), the job's collective faked as gloo fails it."""
    import torch

    class Gloo:
        @staticmethod
        def get_backend(group=None) -> str:
            return "gloo"

        @staticmethod
        def all_reduce(tensor, group=None):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:404: "
                               "Connection reset by peer")

    rank = StoreCoordinator.over(HashStore(), 1, 2, timeout=5)
    rank._dist = Gloo
    with pytest.raises(CoordinationError, match=r"^rank 1: the ranks' all-reduce at a save failed: a rank died or its "
                                                r"connection failed \(RuntimeError: .*Connection reset by peer\)$"):
        rank.all_reduce_sum(torch.zeros(3, dtype=torch.float64))


def test_a_rank_whose_collective_fails_tells_the_other_ranks_of_its_group_why_and_they_name_it():
    """A rank whose collective timed out or failed marks the group unusable (``spoil``), on that
    rank only: another rank's next collective on the group went in and timed out in turn, with a
    message that named neither the rank nor why, and one already waiting there said nothing of it
    either. The rank says why in the job's store, under the group's name: the others refuse at
    once, naming it and why, and one whose own wait fails meanwhile ends its error with it. Two
    ranks' coordinators over one store, each with its own object for the group (as in two
    processes) and the job's collective faked as gloo failing it."""
    import torch

    class Group:  # one rank's object for a process group torch.distributed knows by this name
        group_name = "3"

    class Gloo:
        def __init__(self, meanwhile=lambda: None):
            self.meanwhile = meanwhile

        @staticmethod
        def get_backend(group=None) -> str:
            return "gloo"

        def all_reduce(self, tensor, group=None):
            self.meanwhile()
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                               "1000ms for recv operation to complete")

    def rank(number: int, store, meanwhile=lambda: None) -> StoreCoordinator:
        coordinator = StoreCoordinator.over(store, number, 3, timeout=1)
        coordinator._dist, coordinator._group = Gloo(meanwhile), Group()
        return coordinator

    store = HashStore()
    zero, one = rank(0, store), rank(1, store)
    with pytest.raises(CoordinationError, match="Timed out waiting"):
        zero.all_reduce_sum(torch.zeros(1))
    with pytest.raises(CoordinationError) as refused:
        one.all_reduce_sum(torch.zeros(1))
    assert str(refused.value).startswith(
        "rank 1: this process group is unusable: the wait of rank 0 on this process group timed out (the ranks' "
        "all-reduce at a save: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting"), refused.value

    store = HashStore()
    zero = rank(0, store)
    waiting = rank(2, store, meanwhile=lambda: pytest.raises(CoordinationError, zero.all_reduce_sum, torch.zeros(1)))
    with pytest.raises(CoordinationError) as failed:  # rank 0's wait fails while rank 2's waits
        waiting.all_reduce_sum(torch.zeros(1))
    assert str(failed.value).startswith("rank 2: the ranks' all-reduce at a save failed"), failed.value
    assert str(failed.value).endswith("; the wait of rank 0 on this process group timed out (the ranks' all-reduce at a "
                                      "save: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                                      "waiting 1000ms for recv operation to complete)"), failed.value


def _loading(store, coordinator, waiters: list[int], looks: int, stuck: bool = False) -> None:
    """A rank's long load (``working``): progress until every rank of ``waiters`` saw it ``looks``
    more times, or a waiter gave up (``progressing``); then, where ``stuck``, no progress until
    every waiter gave up (a rank hung part-way)."""
    with coordinator.working():
        progressing(store, waiters, looks, gave_up)
        while stuck and len(gave_up) < len(waiters):
            time.sleep(0.01)


gave_up: list[int] = []
"""The ranks whose wait gave up (``test_a_rank_whose_load_goes_on...``)."""


def test_a_rank_whose_load_goes_on_past_the_timeout_keeps_the_others_waiting_and_one_stuck_is_named():
    """The exchange that closes a restore (``agree``) waited for the slowest rank's whole load
    within the timeout, so a live rank loading a large composite from a slow store for longer
    failed every rank. A rank inside ``working`` that makes progress keeps the others waiting
    (here past 1.5 x the timeout: each waiter saw its progress 6 times, 4 looks a timeout); one
    that stops making progress there is named once it has shown none for the timeout, as one
    that never showed any is. The
    save's alike: the leader gathers the parts while a rank writes its part past the timeout,
    and the other waits on for the leader's outcome (its beat relays the writer's progress, past
    its patience of 2 x the timeout); and a collective promotion's, where rank 0 collects the
    report of a node uploading its part. Ranks as threads over one store, timeout 1 s."""
    from llmtailor.distributed.coordinator import _LOOKS

    store = HashStore()
    ranks = [StoreCoordinator.over(store, rank, 3, timeout=1) for rank in range(3)]
    gave_up.clear()

    def restore(rank: int, tag: str, stuck: bool = False):
        if rank == 2:
            _loading(store, ranks[2], [0, 1], 1 if stuck else _LOOKS + 2, stuck)
        try:
            return ranks[rank].agree(tag, 4, None, True)
        except CoordinationError:
            gave_up.append(rank)
            raise

    assert on_threads(3, lambda rank: restore(rank, "r1/loaded/0")) == [(None, False)] * 3
    outcomes = on_threads(3, lambda rank: restore(rank, "r2/loaded/0", stuck=True))
    for outcome in outcomes[:2]:
        assert isinstance(outcome, CoordinationError), outcomes
        assert re.match(r"rank\(s\) \[2\] did not report on 'r2/loaded/0' within 1 s of its last sign of progress",
                        str(outcome)), outcomes

    def save(rank: int):
        if rank == 2:
            _loading(store, ranks[2], [0], 2 * _LOOKS + 2)
        coordinator = ranks[rank]
        if rank == 0:
            return coordinator.broadcast("r3/outcome", lambda: coordinator.gather("r3/parts", rank))
        coordinator.gather("r3/parts", rank)
        return coordinator.broadcast("r3/outcome", None, patience=2.0)

    gave_up.clear()
    assert on_threads(3, save) == [[0, 1, 2]] * 3

    def promote(rank: int):  # rank 0 collects a node leader's report on its part of a promotion
        if rank == 1:
            _loading(store, ranks[1], [0], _LOOKS + 2)
            ranks[1].post("promotion/1/node/1", {"bytes": 1})
        return ranks[0].collect({1: "promotion/1/node/1"}, "their part of promotion 1") if rank == 0 else None

    assert on_threads(2, promote) == [{1: {"bytes": 1}}, None]


def test_a_collect_waits_on_the_progress_of_the_ranks_not_yet_answered_only():
    """Rank 0 collects the reports of ranks 1 and 2 (a collective promotion's nodes). Rank 1
    reports, then goes on working (its next save's part, say: its beat moves); rank 2 never
    answers and never shows progress. Rank 0 gives up on rank 2 after the timeout of silence,
    naming it, and does not take rank 1's progress, an answered rank's, for a sign of rank 2's.
    Before: it waited on for as long as rank 1 worked (here until it had relayed rank 1's
    progress 2 x _LOOKS + 2 times, past twice the timeout), then said "within 1 s of its last
    sign of progress" of a rank that never showed any. Ranks as threads over one store, timeout 1 s."""
    from llmtailor.distributed.coordinator import _LOOKS

    store = HashStore()
    ranks = [StoreCoordinator.over(store, rank, 3, timeout=1) for rank in range(3)]
    gave_up.clear()
    tags = {1: "promotion/1/node/1", 2: "promotion/1/node/2"}

    def rank(number: int):
        if number == 1:
            ranks[1].post(tags[1], {"bytes": 1})
            _loading(store, ranks[1], [0], 2 * _LOOKS + 2)
        elif number == 0:
            try:
                return ranks[0].collect(tags, "their part of promotion 1")
            except CoordinationError:
                gave_up.append(0)
                raise
        return None

    outcome = on_threads(3, rank)[0]
    assert isinstance(outcome, CoordinationError), outcome
    assert re.match(r"rank\(s\) \[2\] did not report their part of promotion 1 within 1 s: a rank died", str(outcome)), outcome
    assert relayed(store, 0) == 0

    # An exchange: rank 1 loads (rank 0 waits on, seeing it), then answers; rank 2 never does. The
    # error names rank 2 without a sign of progress it never showed (before: "of its last sign
    # of progress", rank 1's).
    def restore(number: int):
        if number == 2:
            return None
        if number == 1:
            _loading(store, ranks[1], [0], 2)
        return ranks[number].exchange("r1/loaded/0", number)

    gave_up.clear()
    outcome = on_threads(3, restore)[0]
    assert re.match(r"rank\(s\) \[2\] did not report on 'r1/loaded/0' within 1 s: a rank died", str(outcome)), outcome


def test_a_block_stuck_inside_working_shows_no_progress_while_another_thread_of_its_rank_advances():
    """Rank 1's node uploader hangs in one request inside ``working`` (a collective promotion's
    part), while its training thread goes on saving (its own ``working``, advancing). Rank 0
    collects rank 1's report: it gives up after the timeout of silence, naming rank 1, and never
    saw its progress. Before: progress was the process's, so the training thread's beat showed the
    hung upload live, and rank 0 waited on for as long as rank 1 trained (here until it had relayed
    it _LOOKS + 2 times). A pool's thread working for the upload (``progress.carried``) counts for
    it. Ranks as threads over one store, timeout 1 s."""
    from concurrent.futures import ThreadPoolExecutor

    from llmtailor.distributed.coordinator import _LOOKS

    store = HashStore()
    ranks = [StoreCoordinator.over(store, rank, 2, timeout=1) for rank in range(2)]
    gave_up.clear()
    hung = threading.Event()

    from llmtailor.store.tiers.collective import _LANE

    def upload():  # rank 1's uploader: hung in one request, inside ``working`` (its lane's, as collective's)
        with ranks[1].working(lane=_LANE):
            hung.wait()
        ranks[1].post("promotion/1/node/1", {"bytes": 1})

    def rank(number: int):
        if number == 0:
            try:
                return ranks[0].collect({1: "promotion/1/node/1"}, "their part of promotion 1", lane=_LANE)
            except CoordinationError:
                gave_up.append(0)
                raise
            finally:
                hung.set()
        uploader = threading.Thread(target=upload)
        uploader.start()
        _loading(store, ranks[1], [0], _LOOKS + 2)  # the training thread's saves
        uploader.join()
        return None

    outcome = on_threads(2, rank)[0]
    assert isinstance(outcome, CoordinationError), outcome
    assert re.match(r"rank\(s\) \[1\] did not report their part of promotion 1 within 1 s: a rank died", str(outcome)), outcome
    assert relayed(store, 0) == 0

    # Work handed to a pool's thread counts for the block that handed it over, and only for it.
    from llmtailor.distributed.progress import Scope, advance, carried, within

    with within(scope := Scope()), ThreadPoolExecutor(1) as pool:
        pool.submit(carried(advance)).result()
        pool.submit(advance).result()
    assert scope.ticks == 1


def test_one_fsync_longer_than_the_timeout_keeps_the_others_waiting_and_one_hung_is_named(tmp_path, monkeypatch):
    """Rank 1 makes one file durable inside ``working`` (a commit's fsync, on the storage's fsync
    threads), and that one fsync outlasts the timeout (a slow disk): rank 0 waits on (here until
    it saw rank 1 live _LOOKS + 2 times, 1.5 x the timeout) and gets its report. Before, only an
    fsync that ended was progress, so rank 0 called rank 1 dead after the timeout. An fsync that
    hangs (until rank 0 gave up) shows rank 1 live for ``_WAITED`` timeouts only: rank 0 then
    names it. Ranks as threads over one store, timeout 1 s."""
    import os

    import llmtailor.store.commit  # noqa: F401 - the storage's progress hooks (``report_progress``)
    from llmtailor.distributed.coordinator import _LOOKS
    from llmtailor.store.storage import local_durable

    store = HashStore()
    ranks = [StoreCoordinator.over(store, rank, 2, timeout=1) for rank in range(2)]
    real, looks = os.fsync, []

    def fsync(fd):  # one slow fsync: until rank 0 saw rank 1 live ``looks[0]`` times, or gave up
        before = relayed(store, 0)
        while (not looks or relayed(store, 0) - before < looks[0]) and not gave_up:
            time.sleep(0.01)
        real(fd)

    monkeypatch.setattr(local_durable.os, "fsync", fsync)
    path = tmp_path / "part.bin"
    path.write_bytes(b"written")

    def rank(number: int, tag: str):
        if number == 0:
            try:
                return ranks[0].collect({1: tag}, "its part")
            except CoordinationError:
                gave_up.append(0)
                raise
        with ranks[1].working(), local_durable.Syncer() as syncer:
            syncer.submit(path, os.open(path, os.O_RDONLY))
        ranks[1].post(tag, "durable")
        return None

    gave_up.clear()
    looks.append(_LOOKS + 2)
    assert on_threads(2, lambda number: rank(number, "part/1")) == [{1: "durable"}, None]
    looks.clear()  # hung: until rank 0 gave up
    outcome = on_threads(2, lambda number: rank(number, "part/2"))[0]
    assert isinstance(outcome, CoordinationError), outcome
    assert re.match(r"rank\(s\) \[1\] did not report its part within 1 s of its last sign of progress", str(outcome)), outcome


def one_long_call_inside_working(call) -> list:
    """Ranks 0 and 1 as threads over one store (timeout 1 s): rank 1 runs ``call(slow)`` inside
    ``working`` and then posts its part, where ``slow()`` is one long step of it (until rank 0 saw
    rank 1 live ``_LOOKS + 2`` times, or gave up); rank 0 collects rank 1's part. The outcomes."""
    from llmtailor.distributed.coordinator import _LOOKS

    store = HashStore()
    ranks = [StoreCoordinator.over(store, rank, 2, timeout=1) for rank in range(2)]
    stopped = []

    def slow(*_, **__):
        before = relayed(store, 0)
        while relayed(store, 0) - before < _LOOKS + 2 and not stopped:
            time.sleep(0.01)
        return 0

    def rank(number: int):
        if number == 0:
            try:
                return ranks[0].collect({1: "part"}, "its part")
            finally:
                stopped.append(0)
        with ranks[1].working():
            call(slow)
        ranks[1].post("part", "done")
        return None

    return on_threads(2, rank)


@pytest.mark.parametrize("durable", ["directory", "file", "replaced", "put"])
def test_an_fsync_outside_a_syncer_longer_than_the_timeout_keeps_the_others_waiting(tmp_path, monkeypatch, durable):
    """Rank 1, inside ``working``, makes a name or a small file durable on its own thread, not
    through a ``Syncer`` (a commit's rename: its directory's fsync; ``latest`` or a node's record
    replaced; a file put whole), and that one fsync outlasts the timeout (a slow disk): rank 0
    waits on, as for a ``Syncer``'s fsync (the test above). Before, only the fsyncs of
    ``make_durable`` showed the rank live: rank 0 called rank 1 dead after the timeout.
    Ranks as threads over one store, timeout 1 s."""
    import os

    import llmtailor.store.commit  # noqa: F401 - the storage's progress hooks (``report_progress``)
    from llmtailor.store.storage import local_durable
    from llmtailor.store.storage.local import LocalStorage

    (tmp_path / "kept.json").write_text("{}")
    make_durable = {"directory": lambda: local_durable.fsync_dir(tmp_path),
                    "file": lambda: local_durable.fsync_file(tmp_path / "kept.json"),
                    "replaced": lambda: local_durable.replace_text_atomically(tmp_path / "kept.json", "{1}"),
                    "put": lambda: LocalStorage(tmp_path).put("put.json", b"{}")}[durable]

    def call(slow):  # one slow fsync
        real = os.fsync
        monkeypatch.setattr(local_durable.os, "fsync", lambda fd: (slow(), real(fd)))
        make_durable()

    assert one_long_call_inside_working(call) == [{1: "done"}, None]


@pytest.mark.parametrize("removal", ["abandon", "purge", "object abandon", "object purge", "object manifest"])
def test_a_removal_or_a_manifest_write_longer_than_the_timeout_keeps_the_others_waiting(tmp_path, monkeypatch, removal):
    """Rank 1, inside ``working``, removes a snapshot's files (an abandoned save's staging, a
    synchronous purge; locally a ``shutil.rmtree``, on an object store a LIST and DELETEs) or
    writes a manifest to an object store (its client retrying a 503 for up to 2 minutes), and that
    one call outlasts the timeout (a slow disk, a throttling store): rank 0 waits on, as for a long
    fsync (the tests above). Before, a removal or a store's answer was no progress: rank 0 called
    rank 1 dead after the timeout. Ranks as threads over one store, timeout 1 s."""
    import shutil
    import types

    import llmtailor.store.commit  # noqa: F401 - the storage's progress hooks (``report_progress``)
    from llmtailor.store.storage.local_commit import LocalCommits
    from llmtailor.store.storage.object_commit import ObjectCommits

    def call(slow):
        class Store:  # an object store whose every call but the slow one answers at once
            def where(self, key):
                return key

            def size(self, key):
                return None

            remove_tree = put = remove = staticmethod(slow)

        real_rmtree = shutil.rmtree
        monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: (slow(), real_rmtree(*args, **kwargs))[1])
        (tmp_path / "snapshots" / "step-00000001").mkdir(parents=True)
        unfenced = types.SimpleNamespace(confirm_writer=lambda: None)  # a writer that holds its lease (object_lock: Fenced)
        local, remote = LocalCommits(tmp_path), ObjectCommits(Store(), unfenced)
        {"abandon": lambda: local.abandon("snapshots/step-00000001"),
         "purge": lambda: local.purge(local.discard("snapshots/step-00000001")),
         "object abandon": lambda: remote.abandon("snapshots/step-00000001"),
         "object purge": lambda: remote.purge(".trash/step-00000001"),
         "object manifest": lambda: remote.commit("snapshots/step-00000001", "snapshots/step-00000001", b"{}")}[removal]()

    assert one_long_call_inside_working(call) == [{1: "done"}, None]
