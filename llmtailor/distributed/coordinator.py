"""The commit coordinator: who writes what, and has everyone finished?

A save at world size N is one snapshot written by N ranks into one shared temporary
directory. The coordinator carries the few small messages that need: the leader (rank 0)
announces the temporary directory, every rank reports its part (its file entries and
checksums) or its failure, and the leader announces the outcome. Only the leader writes the
manifest, and only once every rank has reported success.

``LocalCoordinator`` serves one process. ``StoreCoordinator`` carries the messages through
torch.distributed's own key-value store (the ``c10d`` store the process group was set up
with), not through collectives, so it works from a background thread (async saves) while the
training thread runs its own collectives, and every wait has a deadline: a rank that died or
hangs makes the others fail with an error naming it, never hang. The deadline is on silence,
not on total time: a rank inside ``Coordinator.working`` (a restore's load, a save's part)
shows its progress (``advance``: the reads and copies call it) in the store, and a rank waiting
for it waits on while that progress advances; a rank that shows none for the timeout is lost.
Every call to the store has a deadline too (``Deadlined``): a store that stops answering (its
host partitioned or stopped: torch's client then waits for ever, whatever its own timeout) is a
CoordinationError after the timeout, naming the store and the call.

Invariant: each message tag is used once per coordinator (tags carry the save's sequence
number), and every rank of a job creates its coordinators in the same order, so the same tag
means the same save on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch

from llmtailor.distributed.progress import Scope, within
from llmtailor.errors import IntegrityError, NodeTierError, PromotionError, TailorError

T = TypeVar("T")
DEFAULT_TIMEOUT = 600.0
_instances = itertools.count()
_POLL = 0.05
"""The longest pause between two looks while a coordinator without a store of its own waits for
posts (``Coordinator.collect``); ``StoreCoordinator`` blocks in the store's ``wait`` instead."""
_FIRST_POLL = 0.001
"""The first pause: the pauses double from this up to ``_POLL``."""
_LOOKS = 4
"""Looks at the progress of the ranks waited for per timeout (``StoreCoordinator._wait_all``), and
beats a rank at work posts per timeout at most (``StoreCoordinator.working``)."""
_WAITED = 4
"""Timeouts for which a block's wait on the system under way (``progress.waiting``: one fsync on a
slow disk) shows it live without a piece of work ending (``StoreCoordinator._beat``); a wait
longer than that (a hung disk) is silence, and the ranks waiting for it give up a timeout later."""
_RELAY = 1 << 32
"""What a rank adds to its beat for the progress of the ranks it waits for (``_wait_all``), beside
the 1 it adds for its own: a waiter tells the two apart, so a relay never answers a relay."""
_GO = "go"
"""What the committing party claims a commit's gate with (``Coordinator.claim_gate``)."""
_lanes = threading.local()
"""The lane of the block of work the calling thread is in (``Coordinator.working``): its waits
watch that lane's beats and relay into it (``StoreCoordinator._wait_all``)."""
_unusable: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Process group -> the wait on it that timed out or failed on this rank (``spoil``, ``usable``)."""

ALIKE: tuple[type[TailorError], ...] = (PromotionError, NodeTierError)
"""Errors of the leader's ``broadcast`` that concern the job, not the leader (a promotion failure
rank 0 met, a node whose tier could not be written): every follower raises the same type with
the same message, so ranks that handle it alike (catch it and train on) stay in step."""


def pauses(longest: float = _POLL) -> Iterator[float]:
    """The pauses between looks while waiting: ``_FIRST_POLL``, doubling, then ``longest`` on."""
    pause = min(_FIRST_POLL, longest)
    while True:
        yield pause
        pause = min(2 * pause, longest)


class CoordinationError(TailorError):
    """Another rank failed, died or did not answer in time; the save or restore was abandoned."""


def spoil(group: Any, err: BaseException, what: str, coordinator: Coordinator) -> str:
    """A wait of this rank on ``group`` (None: the default group) failed with ``err`` while it
    did ``what``: a collective whose wait timed out stays pending in gloo, where it pairs with the
    group's next collective (that one then takes another's data, or hangs), and a message's
    timeout closes the group's connections. Every later use of the group here refuses (``usable``).
    The rank also says so where every rank of the group looks (``Coordinator.spoiled``, the job's
    store): their next use of the group refuses too, naming this rank and why, where it timed out
    with a message that said nothing of either. Returns, for this rank's own error, what another
    rank said there first ('' where none did: ``_elsewhere``)."""
    timed_out = any(word in str(err).lower() for word in ("timed out", "timeout"))
    why = f"{'timed out' if timed_out else 'failed'} ({what}: {first_line(err)})"
    if (key := _group_key(group)) is not None:  # None: no group (a test's faked collective)
        _unusable.setdefault(key, f"{'timed out' if timed_out else 'failed'} before ({what})")
    name = _group_name(group)
    first = None if name is None else coordinator.spoiled(name, {"rank": coordinator.rank, "why": why})
    return _elsewhere(first, coordinator.rank)


def usable(group: Any, coordinator: Coordinator) -> None:
    """Raise CoordinationError where a wait on ``group`` failed on this rank before, or on
    another rank of the group that said so (``spoil``)."""
    key, name = _group_key(group), _group_name(group)
    before = None if key is None else _unusable.get(key)
    if before is not None:
        why = f"a wait on this process group {before}"
    elif name is not None and (said := coordinator.spoiled(name)) is not None and said["rank"] != coordinator.rank:
        why = f"the wait of rank {said['rank']} on this process group {said['why']}"
    else:
        return
    raise CoordinationError(f"rank {coordinator.rank}: this process group is unusable: {why}, and gloo may still hold "
                            "what it waited for (a collective would pair with this one: another's data, or a hang): "
                            "make a new process group (and a new Tailor on it), or restart the job")


def _elsewhere(said: dict[str, Any] | None, rank: int) -> str:
    """What another rank said of the group it spoiled (``spoil``), to end this rank's error with."""
    if said is None or said["rank"] == rank:
        return ""
    return f"; the wait of rank {said['rank']} on this process group {said['why']}"


def _group_name(group: Any) -> str | None:
    """The name every rank of ``group`` knows it by (torch.distributed's), or None (no group:
    torch.distributed not set up, or one it does not know, a test's)."""
    return getattr(_group_key(group), "group_name", None)


def _group_key(group: Any) -> Any:
    import torch.distributed as dist

    return group if group is not None else dist.group.WORLD


_GRACE = 2.0
"""Seconds a store call may take past the coordinator's timeout before it is given up on
(``Deadlined``): a loaded machine's slow answer is not taken for a store that stopped answering."""
_given_up: dict[int, list[Any]] = {}
"""id(a store client) -> [the client, the calls on it given up on and not answered yet]: while
one is, the client is not asked again (``Deadlined``). The client is held here, so its id is not
reused meanwhile."""
_given_up_lock = threading.Lock()


def _fresh_lock_in_the_child() -> None:
    """A forked child's own lock of the calls given up on: a thread of the parent that held it at
    the fork (giving a call up, or one returning) is not in the child to release it, and the
    child's first call given up on would wait for it for ever. The calls the parent gave up on
    stay given up on in the child (none of them returns there: no thread of theirs is in it), so
    the child never asks a client whose connection holds a request left unanswered."""
    global _given_up_lock
    _given_up_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_the_child)


class Unanswered(Exception):
    """A call to the job's store that did not answer within its deadline (``Deadlined``); the
    coordinator raises it as a CoordinationError saying what the rank was doing (``_reaching``)."""


class _Asker:
    """A daemon thread that makes the store calls handed to it, one at a time, while the thread
    that handed one waits for the answer up to a deadline (``Deadlined``). Idle ones wait in
    ``_askers``; one whose call was given up on is never handed another: it ends once that call
    returns (never, where the store never answers: the one thread a stuck call costs). So does one
    whose caller stopped waiting for another reason (Ctrl-C's KeyboardInterrupt, any
    BaseException), its answer dropped; its client is not given up on: the next call asks it."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._given_up: Any = None
        self._left = False
        """Set when the caller stopped waiting (not given up on): the call's answer is dropped."""
        threading.Thread(target=self._serve, name="llmtailor-store-call", daemon=True).start()

    def _serve(self) -> None:
        while (asked := self._calls.get()) is not None:  # None: the caller left (``ask``)
            call, args = asked
            try:
                answer = (True, call(*args))
            except BaseException as err:
                answer = (False, err)
            del call, args, asked  # an idle asker holds no store: one dropped by its owners goes (its server stops)
            with self._lock:
                if self._given_up is not None:  # nobody waits for it: the client may be asked again
                    _answered(self._given_up)
                    return
                if self._left:
                    return
                self._answers.put(answer)
                del answer

    def ask(self, store: Any, call: Callable[..., Any], args: tuple[Any, ...], limit: float) -> tuple[bool, Any] | None:
        """``(True, call(*args))`` or ``(False, what it raised)``; None where it did not return
        within ``limit`` seconds: it is given up on (``store``: the client it is a call of)."""
        self._calls.put((call, args))
        try:
            return self._answers.get(timeout=limit)
        except queue.Empty:
            with self._lock:
                if not self._answers.empty():  # it answered just now
                    return self._answers.get()
                self._given_up = store
                with _given_up_lock:
                    _given_up.setdefault(id(store), [store, 0])[1] += 1
            return None
        except BaseException:  # the caller's own (Ctrl-C): nobody takes the answer, nor hands it another call
            with self._lock:
                self._left = True
            self._calls.put(None)  # its thread ends: once the call returns, or at once where it has
            raise


_askers: list[_Asker] = []
"""The idle ``_Asker``s of this process: as many as calls were made at once, at most."""
os.register_at_fork(after_in_child=_askers.clear)  # their threads are not in a forked child


def _answered(store: Any) -> None:
    """A call on ``store`` given up on returned: one fewer holds the client."""
    with _given_up_lock:
        held = _given_up[id(store)]
        held[1] -= 1
        if not held[1]:
            del _given_up[id(store)]


def ask_within(store: Any, call: Callable[..., T], args: tuple[Any, ...], timeout: float, what: str) -> T:
    """``call(*args)``, a call on the job's c10d ``store`` (or one that asks it, a gloo group's
    rendezvous), on a thread of its own (an idle ``_Asker``) while this thread waits for its
    answer up to ``timeout`` + ``_GRACE`` seconds: its value, or what it raised; past that
    ``Unanswered`` naming the store and ``what``, and the call given up on (``Deadlined``):
    ``store`` is not asked again until that call returns (``Unanswered`` at once)."""
    limit = timeout + _GRACE
    if (held := _given_up.get(id(store))) is not None and held[0] is store:
        raise Unanswered(f"the job's store ({_where(store)}) has not answered a call of this rank for {limit:g} s "
                         f"or more (it is not asked again until it does); {what} not asked")
    try:
        asker = _askers.pop()  # atomic: several threads ask at once
    except IndexError:
        asker = _Asker()
    answer = asker.ask(store, call, args, limit)
    if answer is None:
        raise Unanswered(f"the job's store ({_where(store)}) did not answer {what} within {limit:g} s "
                         "(what was asked may still take effect there if it answers again)")
    _askers.append(asker)
    ok, value = answer
    if not ok:
        raise value
    return value


class Deadlined:
    """A client of the job's c10d store (``store``) whose every call returns or raises within
    the coordinator's timeout (``owner.timeout``, plus ``_GRACE``), on a store that stopped
    answering too: each call runs on a thread of its own (an idle ``_Asker``) while the calling
    thread waits for its answer with that deadline, and raises ``Unanswered`` (naming the store
    and the call) past it. torch's TCPStore client waits for ever for the answer to a request
    sent to a server that stopped answering (its host partitioned, or its process stopped: the
    kernel still takes the bytes), whatever its own timeout (measured, torch 2.13: ``add``,
    ``check``, ``get``, ``set``, a clone's ``wait``).

    A call given up on keeps its thread until it returns (never, where the store never answers
    again) and nothing else: while it is out, the client is not asked again (its calls would
    queue behind it in torch's client, each holding a thread): ``Unanswered`` at once. Once it
    returns (the store answers again), its answer is dropped and the client is asked again.
    What cannot be undone: its request may have reached the store, or reach it once it answers
    again, after this rank raised. A late ``set`` of a report or an announcement is as if this
    rank had reported and then failed (the others may go on with it: a save's leader may commit
    with this rank's part, which was durable before its report); a late ``add`` to a beat makes a
    waiter wait one look longer; a late claim (``compare_set``: a commit's gate) is as if this
    party had claimed and then failed: a committer's late ``go`` is a gate passed by a commit that
    then failed, which the waiting parties already count as unconfirmed, never as failed, and a
    waiter's late give-up is one that won, so the committer refuses to publish; a late
    ``delete_key`` deletes a report already read (each tag is used once). The error says so: what
    was asked may still take effect there."""

    def __init__(self, store: Any, owner: Coordinator) -> None:
        # The owner held weakly: a coordinator dropped unclosed goes with its clients at once, no
        # cycle to collect first (each client a connection).
        self.store, self._owner = store, weakref.ref(owner)

    def _ask(self, op: str, *args: Any) -> Any:
        owner = self._owner()
        timeout = DEFAULT_TIMEOUT if owner is None else owner.timeout
        return ask_within(self.store, getattr(self.store, op), args, timeout, f"{op} {_keys(args)}")

    def add(self, key: str, amount: int) -> int:
        return self._ask("add", key, amount)

    def get(self, key: str) -> bytes:
        return self._ask("get", key)

    def set(self, key: str, value: str) -> None:
        self._ask("set", key, value)

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._ask("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._ask("delete_key", key)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._ask("wait", keys, timeout)

    def clone(self) -> Deadlined:
        clone = copy.copy(self)  # the same owner
        clone.store = self._ask("clone")
        return clone


def _where(store: Any) -> str:
    """A store as its error names it: its type, and its server's address where it has one (a
    TCPStore under the process group's prefixes)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    address = f" at {store.host}:{store.port}" if hasattr(store, "host") and hasattr(store, "port") else ""
    return type(store).__name__ + address


def _keys(args: tuple[Any, ...]) -> str:
    """The key(s) of a store call, as its error names them."""
    return repr(args[0]) if args else "(no key)"


class PeerStopped(CoordinationError):
    """Another rank stopped part-way through what the ranks do together (a read plan), for a
    reason of its own that it reports itself: this rank's failure follows from it (``agree``
    judges the restore's failure by that rank's error, not by this one)."""


class Coordinator(ABC):
    """Messages between the ranks of one job (see the module docstring)."""

    rank: int = 0
    world_size: int = 1
    timeout: float = DEFAULT_TIMEOUT

    _rounds: int = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def new_round(self) -> str:
        """A fresh tag prefix for one exchange (a save, a restore): each rank calls it once per
        exchange, in the same order, so equal prefixes mean the same exchange."""
        self._rounds += 1
        return self.round

    @property
    def round(self) -> str:
        """The tag prefix of the exchange under way (the last ``new_round``): what runs inside a
        save or restore tags its own messages with it."""
        return f"r{self._rounds}"

    @abstractmethod
    def broadcast(self, tag: str, compute: Callable[[], T] | None, patience: float = 1.0) -> T:
        """The leader's ``compute()`` (JSON-able), on every rank. Followers pass None and wait
        up to ``patience`` x the timeout. If the leader's ``compute`` raises, the leader
        re-raises it and every follower raises a CoordinationError carrying its message (one of
        ``ALIKE``: that error itself)."""

    @abstractmethod
    def gather(self, tag: str, value: Any) -> list[Any] | None:
        """On the leader: every rank's ``value`` (JSON-able), in rank order; None on followers.
        A rank passes an exception as its value to report a failure: the leader then raises
        a CoordinationError naming the failed ranks and their messages; so it does when a rank
        does not report within the timeout."""

    @abstractmethod
    def exchange(self, tag: str, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order, on every rank: each rank learns
        how every other fared (a restore's reads, say) before any of them goes on into a
        collective. A rank that does not report within the timeout makes every other raise a
        CoordinationError naming it and carrying the failures the others did report."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over the ranks (a collective: call from the training thread, on
        every rank, in the same order)."""
        return tensor

    def let_go(self) -> None:
        """The connections this coordinator keeps idle for its next waits let go (its Tailor
        closed); a later wait opens what it needs."""

    def beat(self, rank: int, lane: str = "") -> int:
        """``rank``'s beat in ``lane``: it changes while that rank's blocks of ``lane`` advance
        (``working``), so a look from any thread tells a live rank from a silent one. One process: 0."""
        return 0

    def spoiled(self, group: str, why: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """What the first rank whose wait on the process group named ``group`` failed said
        (``spoil``: ``{"rank": ..., "why": ...}``), ``why`` posted first where given and none
        was; None where none was, or where it cannot be told. One process: nobody to tell."""
        return why

    @contextmanager
    def working(self, *also: Scope, lane: str | None = None) -> Iterator[None]:
        """A block of long work of this rank (a restore's load, a save's part) that the others
        may wait for longer than the timeout: while this block's work makes progress (``advance``
        on this thread, or on those it hands work to: ``progress.carried``), the ranks waiting
        for this one wait on; no progress for the timeout, and they give up. ``also``: the
        progress (``progress.Scope``) of background work of this process the block waits for (a
        healing's writes), which counts as the block's own. ``lane``: where the block's beats
        go, for the waits of that ``lane``: the waits made inside the block (``current_lane``),
        or a ``collect`` naming it. Two blocks of one rank that may run at once never share a
        lane, or one's progress is taken for the other's: a node's uploader (a lane of its own)
        beside the training thread's blocks; a save's (its round's lane: the next save's part
        is written while this one commits, ``InTurn``). None: the lane of the block this one is
        in (``current_lane``): a block nested in a save's (a healed copy settled as the save
        opens) beats where the save's waits look.
        One process: nobody waits."""
        before = current_lane()
        _lanes.name = before if lane is None else lane
        try:
            yield
        finally:
            _lanes.name = before

    # -- point to point, from any thread: a few ranks' work outside the saves' rounds --------

    @abstractmethod
    def post(self, tag: str, value: Any) -> None:
        """Leave ``value`` (JSON-able) under ``tag`` for the rank(s) that ask (``poll``,
        ``collect``); tags of one's own, each posted once."""

    @abstractmethod
    def poll(self, tag: str) -> tuple[bool, Any]:
        """``(True, value)`` when ``tag`` was posted, else ``(False, None)``; never waits."""

    def claim(self, tag: str, value: Any) -> Any:
        """Post ``value`` under ``tag`` unless a value was posted there first (by any rank);
        returns the one that stays: of two ranks claiming one tag, exactly one wins."""
        posted, first = self.poll(tag)
        if posted:
            return first
        self.post(tag, value)
        return value

    def claim_gate(self, tag: str, refused: Callable[[int], BaseException]) -> None:
        """The committing party, just before its commit publishes a snapshot (everything else
        durable): it passes the commit's gate ``tag`` (``gate_tag``), unless a party waiting for
        that commit gave up first (``give_up_gate``), and then raises ``refused(the rank that gave
        up)``: nothing may be published. Of the two claims exactly one wins, so no rank reports
        failed a commit that published after it stopped waiting."""
        if (said := self.claim(tag, _GO)) != _GO:
            raise refused(said["gave_up"])

    def give_up_gate(self, tag: str) -> bool:
        """A party giving up on the commit behind the gate ``tag`` claims it for this rank: True
        where it won (that commit never publishes: ``claim_gate`` raises), False where the
        committing party passed it first (its commit publishes, or did)."""
        return self.claim(tag, {"gave_up": self.rank}) != _GO

    def collect(self, tags: dict[int, str], what: str, lane: str | None = None) -> dict[int, Any]:
        """What each rank of ``tags`` (rank -> its tag) posted, waiting up to the timeout: a
        CoordinationError naming the ranks that did not post ``what`` in time (silent that long:
        their blocks of ``lane`` showed no progress, ``working``; None: the lane of the calling
        thread's block, ``current_lane``)."""
        deadline, found, waits = time.monotonic() + self.timeout, {}, pauses()
        while True:
            for rank, tag in tags.items():
                if rank not in found:
                    posted, value = self.poll(tag)
                    if posted:
                        found[rank] = value
            if len(found) == len(tags):
                return found
            if time.monotonic() >= deadline:
                missing = sorted(set(tags) - set(found))
                raise CoordinationError(f"rank(s) {missing} did not report {what} within {self.timeout:g} s: a rank "
                                        "died or is stuck (timeout: Tailor(..., timeout=...))")
            time.sleep(next(waits))

    def agree(self, tag: str, step: int, error: BaseException | None, touched: bool) -> tuple[BaseException | None, bool]:
        """After every rank read its part of a restore (``error``: how its read failed, if it
        did; ``touched``: whether it changed its live state): the error every rank must raise,
        or None when every read succeeded, and whether any rank's live state was touched (the
        job's state is then a mix). The same error type on every rank, so ranks handling it
        alike stay in step, naming each failed rank and its error. One process keeps its own
        error (an IntegrityError after touching says so)."""
        mine = {"touched": touched, "error": None if error is None else describe_error(error),
                "integrity": None if isinstance(error, PeerStopped) else isinstance(error, IntegrityError)}
        outcomes = self.exchange(tag, mine)
        failed = {rank: o for rank, o in enumerate(outcomes) if o["error"] is not None}
        partly = bool(failed) and any(o["touched"] for o in outcomes)
        if not failed:
            return None, False
        advice = "restore(fallback=True) loads the newest composite that verifies"
        if self.world_size == 1:
            assert error is not None
            if isinstance(error, IntegrityError) and touched:
                return IntegrityError(f"{error}. Nothing was written to disk; the live model may be partly restored. {advice}"), partly
            return error, partly
        # A rank that failed because another stopped (``PeerStopped``) follows that one's kind.
        kind = (IntegrityError if any(o["integrity"] for o in failed.values())
                and all(o["integrity"] is not False for o in failed.values()) else CoordinationError)
        where = "; ".join(f"rank {rank}: {o['error']}" for rank, o in failed.items())
        state = "the live model and optimizer may be partly restored on every rank" if partly else "no rank's live state was changed"
        return kind(f"restore of step {step} failed on rank(s) {sorted(failed)} ({where}); {state}; nothing was written "
                    f"to disk. {advice}"), partly


class LocalCoordinator(Coordinator):
    """One process: every message is to itself."""

    def __init__(self) -> None:
        self._posts: dict[str, Any] = {}

    def post(self, tag: str, value: Any) -> None:
        self._posts[tag] = value

    def poll(self, tag: str) -> tuple[bool, Any]:
        return (True, self._posts[tag]) if tag in self._posts else (False, None)

    def broadcast(self, tag: str, compute: Callable[[], T] | None, patience: float = 1.0) -> T:
        assert compute is not None, "the leader computes what it broadcasts"
        return compute()

    def gather(self, tag: str, value: Any) -> list[Any] | None:
        if isinstance(value, BaseException):
            raise value
        return [value]

    def exchange(self, tag: str, value: Any) -> list[Any]:
        return [value]


class StoreCoordinator(Coordinator):
    """Ranks of a torch.distributed job, talking through its c10d store with deadlines."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, group: Any = None):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = float(timeout)
        # The store the process group was set up with; every rank reaches the same one.
        self._store = Deadlined(distributed_c10d._get_default_store(), self)
        self._prefix = f"llmtailor/{next(_instances)}/"
        self._waiters: list[Any] = []

    def let_go(self) -> None:
        self._waiters.clear()  # its own clients of the store (``_wait_for``): each a connection

    @contextmanager
    def working(self, *also: Scope, lane: str | None = None) -> Iterator[None]:
        lane = current_lane() if lane is None else lane
        stop, scope = threading.Event(), Scope()
        beating = threading.Thread(target=self._beat, args=(stop, (scope, *also), lane), name="llmtailor-beat", daemon=True)
        beating.start()
        try:
            with within(scope), super().working(lane=lane):
                yield
        finally:
            stop.set()
            beating.join()

    def spoiled(self, group: str, why: dict[str, Any] | None = None) -> dict[str, Any] | None:
        # Under this coordinator's prefix (the same on every rank): a process group made again under
        # the same name on the same store (destroyed, set up again) is not refused for its forerunner.
        key = f"{self._prefix}spoiled/{group}"
        try:
            if why is not None:
                return json.loads(self._store.compare_set(key, "", json.dumps(why)))  # the first one stays
            return json.loads(self._store.get(key)) if self._store.check([key]) else None
        except Exception:  # a store gone, or one that cannot compare: the ranks' own waits fail as before
            return why

    def _beat(self, stop: threading.Event, scopes: tuple[Scope, ...], lane: str) -> None:
        """Post this rank's beat (``_beats``) each ``timeout / _LOOKS`` in which the work of
        ``scopes`` advanced (the block's own: another block's work is no sign of it), or waited
        on the system (an fsync under way, begun less than ``_WAITED`` timeouts ago)."""
        seen = sum(scope.ticks for scope in scopes)
        while not stop.wait(self.timeout / _LOOKS):
            since = min((s for scope in scopes if (s := scope.waited_since()) is not None), default=None)
            waits = since is not None and time.monotonic() - since < _WAITED * self.timeout
            if (now := sum(scope.ticks for scope in scopes)) != seen or waits:
                seen = now
                with contextlib.suppress(Exception):  # a store gone: the waits say so
                    self._store.add(self._beat_key(self.rank, lane), 1)

    def beat(self, rank: int, lane: str = "") -> int:
        with self._reaching(f"looked at rank {rank}'s progress"):
            return self._store.add(self._beat_key(rank, lane), 0)

    def _beat_key(self, rank: int, lane: str = "") -> str:
        return f"{self._prefix}beat/{rank}" + (f"/{lane}" if lane else "")

    def _beats(self, ranks: list[int], lane: str) -> dict[int, int]:
        """Each rank's beat in ``lane``: its own progress (``working``) plus ``_RELAY`` for each
        time a wait of its saw the progress of a rank it waited for."""
        return {rank: self._store.add(self._beat_key(rank, lane), 0) for rank in ranks}

    @classmethod
    def over(cls, store: Any, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT, prefix: str = "llmtailor/0/") -> StoreCoordinator:
        """A coordinator of ``rank`` among ``world_size`` over a c10d ``store`` of one's own (a
        test's ranks as threads over one ``HashStore``); every rank passes the same ``prefix``."""
        coordinator = cls.__new__(cls)
        coordinator.rank, coordinator.world_size, coordinator.timeout = rank, world_size, float(timeout)
        coordinator._dist, coordinator._group, coordinator._prefix = None, None, prefix
        coordinator._store = Deadlined(store, coordinator)
        coordinator._waiters = []
        return coordinator

    def broadcast(self, tag: str, compute: Callable[[], T] | None, patience: float = 1.0) -> T:
        key = self._prefix + tag
        if self.is_leader:
            assert compute is not None, "the leader computes what it broadcasts"
            try:
                value = compute()
            except BaseException as err:
                alike = type(err).__name__ if isinstance(err, ALIKE) else None
                with contextlib.suppress(CoordinationError):  # a store gone: this rank's own error says more
                    self._set(key, {"error": describe_error(err), "alike": alike}, f"announced {tag!r}")
                raise
            self._set(key, {"ok": value}, f"announced {tag!r}")
            return value
        message = self._wait_one(key, f"the leader (rank 0) did not announce {tag!r}", patience)
        if "error" in message:
            alike = {kind.__name__: kind for kind in ALIKE}.get(message.get("alike"))
            raise alike(message["error"]) if alike else CoordinationError(f"rank 0 failed: {message['error']}")
        return message["ok"]

    def gather(self, tag: str, value: Any) -> list[Any] | None:
        key = f"{self._prefix}{tag}/"
        message = {"error": describe_error(value)} if isinstance(value, BaseException) else {"ok": value}
        try:
            self._set(key + str(self.rank), message, f"reported on {tag!r}")
        except CoordinationError:
            if isinstance(value, BaseException):  # a store gone: this rank's own failure says more
                raise value from None
            raise
        if not self.is_leader:
            if isinstance(value, BaseException):
                raise value
            return None
        keys = [key + str(r) for r in range(self.world_size)]
        self._wait_all(keys, lambda missing: f"rank(s) {missing} did not report on {tag!r}")
        with self._reaching(f"read the reports on {tag!r}"):
            messages = [json.loads(self._store.get(k)) for k in keys]
            for k in keys:
                self._store.delete_key(k)
        failed = {r: m["error"] for r, m in enumerate(messages) if "error" in m}
        if failed:
            if isinstance(value, BaseException) and len(failed) == 1:
                raise value
            raise CoordinationError("; ".join(f"rank {r} failed: {why}" for r, why in failed.items()))
        return [m["ok"] for m in messages]

    def exchange(self, tag: str, value: Any) -> list[Any]:
        key = f"{self._prefix}{tag}/"
        self._set(key + str(self.rank), value, f"reported on {tag!r}")
        keys = [key + str(r) for r in range(self.world_size)]

        def describe(missing: list[int]) -> str:
            # What the ranks that did answer said, so a rank's own failure is not hidden
            # behind the silence of another.
            reported = {r: json.loads(self._store.get(k)) for r, k in enumerate(keys) if r not in missing}
            failed = "; ".join(f"rank {r} failed: {v['error']}" for r, v in reported.items()
                               if isinstance(v, dict) and v.get("error"))
            return f"rank(s) {missing} did not report on {tag!r}" + (f" ({failed})" if failed else "")

        self._wait_all(keys, describe)
        with self._reaching(f"read the reports on {tag!r}"):
            return [json.loads(self._store.get(k)) for k in keys]

    def post(self, tag: str, value: Any) -> None:
        self._set(self._prefix + tag, value, f"posted {tag!r}")

    def poll(self, tag: str) -> tuple[bool, Any]:
        key = self._prefix + tag
        with self._reaching(f"looked for {tag!r}"):
            return (True, json.loads(self._store.get(key))) if self._store.check([key]) else (False, None)

    def claim(self, tag: str, value: Any) -> Any:
        with self._reaching(f"claimed {tag!r}"):
            return json.loads(self._store.compare_set(self._prefix + tag, "", json.dumps(value)))

    def collect(self, tags: dict[int, str], what: str, lane: str | None = None) -> dict[int, Any]:
        keys = {rank: self._prefix + tag for rank, tag in tags.items()}
        by_key = {key: rank for rank, key in keys.items()}

        def describe(missing: list[int]) -> str:
            return f"rank(s) {sorted(missing)} did not report {what}"

        self._wait_all(list(keys.values()), lambda _: describe(
            [by_key[k] for k in keys.values() if not self._store.check([k])]), ranks=list(keys), lane=lane)
        with self._reaching(f"read what rank(s) {sorted(tags)} posted"):
            return {rank: json.loads(self._store.get(key)) for rank, key in keys.items()}

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        nccl = self._dist.get_backend(self._group) == "nccl"
        reduced = tensor.to(torch.device("cuda", torch.cuda.current_device()) if nccl else tensor.device)
        usable(self._group, self)
        try:
            self._dist.all_reduce(reduced, group=self._group)
        except RuntimeError as err:  # gloo's (or NCCL's) error for a lost peer: which one, the collective does not say
            elsewhere = spoil(self._group, err, "the ranks' all-reduce at a save", self)
            raise CoordinationError(f"rank {self.rank}: the ranks' all-reduce at a save failed: a rank died or its "
                                    f"connection failed ({describe_error(err)}){elsewhere}") from None
        return reduced.to(tensor.device)

    # -- waiting with a deadline ---------------------------------------------------------------

    def _wait_one(self, key: str, what: str, patience: float = 1.0) -> dict[str, Any]:
        self._wait_all([key], lambda missing: what, patience)
        with self._reaching("read what rank 0 announced"):
            return json.loads(self._store.get(key))

    def _set(self, key: str, value: Any, what: str) -> None:
        """``value`` (JSON) under ``key`` in the job's store, this rank doing ``what`` (``_reaching``)."""
        with self._reaching(what):
            self._store.set(key, json.dumps(value))

    @contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """A block of store calls: a store that went away (the process hosting it died, rank 0's
        or the launcher's), or that stopped answering (``Deadlined``), is a CoordinationError
        saying what this rank was doing, as every wait's is (``_wait_all``), not torch's network
        error."""
        try:
            yield
        except self._dist_errors()[1] as err:
            raise _gone(what, err) from None
        except Unanswered as err:
            raise CoordinationError(f"rank {self.rank}: {err}, while this rank {what}: its host is stopped or cut off "
                                    "from this one (timeout: Tailor(..., timeout=...))") from None

    def _wait_all(self, keys: list[str], describe: Callable[[list[int]], str], patience: float = 1.0,
                  ranks: list[int] | None = None, lane: str | None = None) -> None:
        """Wait until every key is set, or raise CoordinationError naming the ranks that are
        not, once none of them showed progress for ``patience`` x ``timeout`` seconds (their
        beats: ``working``; or the beat they relay for the ranks they wait for in turn, the
        leader's gather under its broadcast, one step, never a relay of a relay); each
        ``timeout / _LOOKS`` it looks (``ranks``: the rank of each key, where its name does not end
        with it; only those of the keys not set yet are looked at; ``lane``: whose beats,
        ``working``; None: the lane of the calling thread's block). The relay goes into the lane
        of the calling thread's block, where the ranks waiting for this one look, whichever lane
        it watches (rank 0's wait for the nodes' uploads, in their lane, relays into its close's:
        into theirs no rank looks at rank 0). Blocks in the store's own ``wait`` (woken
        when the last key is set: no polling, nothing to oversleep), on a client of the waiting
        thread's own (``Store.clone``): a wait on the shared client would hold it, and with it
        every other thread's store calls (the training thread's), for as long as it waits. The
        idle clients are kept for the next wait (``_waiters``: a save's thread is new each save).
        A store that cannot be cloned (a custom one) is polled with growing pauses (``pauses``).
        A store that went away (the process hosting it died) is a CoordinationError too, naming
        ``ranks`` (default: those of the keys), whichever client met it."""
        relay = current_lane()
        lane = relay if lane is None else lane
        limit = self.timeout * patience
        silent_until, seen, shown = time.monotonic() + limit, None, set()
        owner = dict(zip(keys, ranks or _ranks_of(keys), strict=True))
        with self._reaching(f"waited for rank(s) {sorted(set(owner.values()))}"):
            while not self._wait_for(keys, max(0.001, min(self.timeout / _LOOKS, silent_until - time.monotonic()))):
                pending = [k for k in keys if not self._store.check([k])]
                if not pending:
                    return
                beats = self._beats(sorted({owner[k] for k in pending}), lane)  # an answered rank's progress is no sign of the others
                moved = seen is not None and [r for r, beat in beats.items() if beat != seen.get(r)]
                if moved:  # live: waited for on, and shown to the ranks waiting for this one
                    silent_until = time.monotonic() + limit
                    shown.update(moved)
                    if any((beats[r] - seen.get(r, 0)) % _RELAY for r in moved):
                        self._store.add(self._beat_key(self.rank, relay), _RELAY)
                elif time.monotonic() >= silent_until:  # ``describe`` may read what the other ranks reported
                    since = " of its last sign of progress" if shown & {owner[k] for k in pending} else ""
                    raise CoordinationError(f"{describe(_ranks_of(pending))} within {limit:g} s{since}: a rank died or "
                                            f"is stuck (timeout: Tailor(..., timeout=...))")
                seen = beats

    def _wait_for(self, keys: list[str], limit: float) -> bool:
        """Block until every key is set (True) or ``limit`` seconds passed (False: the caller
        looks which are not); a store that went away raises DistNetworkError."""
        try:
            waiter = self._waiters.pop()  # atomic: a save's thread and the training thread may both wait
        except IndexError:
            # A look through the shared client first: it fails at once where the store is gone,
            # where a new client's connect would retry for the store's own timeout (minutes).
            if self._store.check(keys):
                return True
            waiter = self._clone()
        deadline = time.monotonic() + limit
        try:
            if waiter is not None:
                waiter.wait(keys, timedelta(seconds=limit))
                self._waiters.append(waiter)  # only a client whose wait ended well: a timed-out one may get a late answer
                return True
            for pause in pauses():
                if self._store.check(keys) or time.monotonic() >= deadline:
                    break
                time.sleep(pause)
        except self._dist_errors()[0]:
            pass
        return False

    def _clone(self) -> Any:
        """A client of the store of its own, or None where the store cannot be cloned."""
        try:
            return self._store.clone()
        except (RuntimeError, NotImplementedError):
            return None

    @staticmethod
    def _dist_errors() -> tuple[type[BaseException], type[BaseException]]:
        """torch's errors of a store: a wait that timed out, a store that cannot be reached."""
        from torch.distributed import DistNetworkError, DistStoreError

        return DistStoreError, DistNetworkError


def _gone(what: str, err: BaseException) -> CoordinationError:
    """The job's store went away while this rank did ``what`` (``StoreCoordinator._reaching``)."""
    return CoordinationError(f"the job's store went away while this rank {what}: the process hosting it (rank 0's, "
                             f"or the launcher's) died ({first_line(err)})")


def _ranks_of(keys: list[str]) -> list[int]:
    """The ranks whose messages ``keys`` are (a key ``.../<rank>``; 0, the leader, otherwise)."""
    return [int(k.rsplit("/", 1)[1]) if k.rsplit("/", 1)[1].isdigit() else 0 for k in keys]


def gate_tag(round_: str, node: int | None = None) -> str:
    """The key of a commit's gate (``Coordinator.claim_gate``): a shared save's (its round's), or
    one node's commit of a save into its own copy (``node``)."""
    return f"{round_}/gate" if node is None else f"{round_}/gate/{node}"


def current_lane() -> str:
    """The lane of the block of work (``Coordinator.working``) the calling thread is in ("": none,
    or the default lane)."""
    return getattr(_lanes, "name", "")


def make_coordinator(timeout: float = DEFAULT_TIMEOUT) -> Coordinator:
    """A StoreCoordinator inside an initialised torch.distributed job of several ranks, else a
    LocalCoordinator."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return StoreCoordinator(timeout)
    return LocalCoordinator()


def first_line(err: BaseException) -> str:
    """What an error says in its first line (its type's name where it says nothing)."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def describe_error(err: BaseException) -> str:
    """An error as one line for another rank: a TailorError's own message, else its type too."""
    return str(err) if isinstance(err, TailorError) else f"{type(err).__name__}: {err}"


__all__ = [
    "CoordinationError",
    "Coordinator",
    "DEFAULT_TIMEOUT",
    "LocalCoordinator",
    "StoreCoordinator",
    "Unanswered",
    "ask_within",
    "current_lane",
    "describe_error",
    "first_line",
    "gate_tag",
    "make_coordinator",
    "spoil",
    "usable",
]
