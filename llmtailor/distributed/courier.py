"""Files between ranks over torch.distributed: the copies a node-local tier keeps on partner
nodes, and the parts a replacement node receives back from them.

``Courier`` owns a gloo process group of its own, made once on the training thread when the
Tailor is built (``open``, collective), so that its point-to-point sends can run on the async
save's background thread while the training thread runs collectives on the job's default
group. One exchange at a time per courier (a save or a restore, never both: a restore settles
the save in flight first). Its sends and receives go through the group object itself, not
torch's registry of groups, so that a save still sending its copies when the script calls
``destroy_process_group()`` (its usual last line) sends them all the same (the group lives as
long as the courier).

An exchange is pairwise: each rank sends each destination one message (the names and sizes of
its files, then each file's bytes) and receives one from each source, into one buffer, with
matching calls on both sides. Nothing here checks the bytes: the receiver checks them against the
checksums it already knows (the file entries of the snapshot) before it keeps them.

Invariant: for every pair (a, b), ``b in outgoing`` on rank a exactly when ``a in sources`` on
rank b, in the same exchange; every rank of the job calls ``exchange`` the same number of times.

A failed exchange breaks the courier for good (``Courier.broken``). An exchange that timed out
or failed half-way leaves receives posted on the group (the sizes asked of every source at
once) and sends not taken: a later exchange on the same group could take a message of the
failed one (a later save's copy filled with an earlier save's bytes, or waiting on a message
that was consumed). So a rank whose exchange failed never touches the group again: every later
exchange (``exchange``, ``exchange_packed``, ``stream``) raises CoordinationError at once,
saying why. With a ``board`` (the job's coordinator), the rank posts why there as it breaks,
and every rank's courier looks there before each exchange (one look at the job's store): the
other ranks then refuse at once too, naming it, where they would wait for its messages until
the timeout (every save or healing needs every rank's exchange: the job's saves fail on every
rank, at once). Nothing rebuilds the group in place (that is collective, on the training
thread): a new ``Courier.open`` on every rank (a new Tailor, or the job restarted) gives a fresh one.

A courier lets its group go at ``close`` (its Tailor closed): the group's connections to every
peer and its threads end with it, once no exchange runs; a closed courier refuses every
exchange. A courier dropped unclosed (its Tailor dropped) takes its group with it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from llmtailor.distributed.coordinator import (DEFAULT_TIMEOUT, CoordinationError, Coordinator, Unanswered, ask_within,
                                               first_line)
from llmtailor.distributed.progress import carried
from llmtailor.errors import ConfigError

Files = list[tuple[str, bytes]]
"""Named byte strings: ``(relpath, content)``."""
Packed = tuple[list[tuple[str, int]], torch.Tensor | list[torch.Tensor]]
"""Named files: ``[(relpath, size), ...]`` in order, and their contents, back to back in one
uint8 tensor, or (a sender's, ``exchange_packed``) one uint8 tensor per file: each sent as it is,
say a mapping of the file (no copy). Received files are always back to back in one tensor
(``unpacked`` views each in place)."""

Into = Callable[[int, list[tuple[str, int]]], "list[torch.Tensor] | None"]
"""Where a receiver wants a source's files to land (``exchange_packed``): given the source and
its listing, one buffer per file, or None for one fresh buffer."""

Land = Callable[[int, str, int], "memoryview | None"]
"""Where a receiver wants a streamed file to land (``Courier.stream``): given the source, the
file's name and size, a writable buffer of that size (the mapping of the file it is kept in,
say), or None for a fresh buffer. Called as the file's receives are posted, on the thread that
receives from that source; must not raise."""

_SIZES, _NAMES, _BYTES = 1, 2, 3  # message tags: each pair's messages of one kind stay in order
_LANE_TAGS = 4
"""A stream's pieces on several lanes take tags ``_LANE_TAGS * lanes + k`` (``Courier._lane``):
above the others, each on lane k."""
PIECE = 8 << 20
"""Most bytes of one message of a streamed file (``Courier.stream``)."""
WINDOW = 256 << 20
"""Most bytes of a stream's files whose receives are posted ahead of the file handed over
(``Courier.stream``): their buffers are the receiver's memory in flight."""
LANES = 4
"""Connections between each pair of ranks in a courier's group (gloo devices: a socket and a
thread each): a stream's pieces go round them in turn, so that what receiving costs (the copies
out of the sockets, the faults of fresh memory) runs on as many threads. Fewer in a large job
(at most ``SOCKETS`` in all per rank): gloo connects every pair of every device at once. Set
per job by ``LANES_ENV`` (``_agreed_lanes``)."""
LANES_ENV = "LLMTAILOR_COURIER_LANES"
"""An environment variable: the lanes of the job's couriers (``LANES`` when unset), 1 to
``MOST_LANES``. Rank 0's value is the job's: every rank must make its group with the same count
(a piece's tag names its lane, ``_lane``), so each courier's rank 0 posts its count in the job's
store before the group is made and every rank takes that one, whatever its own environment says."""
MOST_LANES = 64
SOCKETS = 256
LATE = 1.0
"""Seconds a wait for a peer's first message of an exchange is given at least, once the
exchange's timeout has run out (``Courier._exchange_packed``): a live peer's, in by then, is
taken; a hung peer's costs no more than this."""
_opened = itertools.count()
"""Couriers opened by this process, in the order every rank opens them (collectively): the
number names a courier's posts on its board."""


class Courier:
    """Sends named byte strings between the ranks of a job (module docstring)."""

    def __init__(self, group: object, rank: int, timeout: float = DEFAULT_TIMEOUT, board: Coordinator | None = None,
                 number: int = 0, lanes: int = 1):
        self.group, self.rank, self.timeout = group, rank, float(timeout)
        self.lanes = lanes
        """The group's connections per pair of ranks (``LANES``): a stream's pieces go round them."""
        self.sent_bytes = 0
        """Bytes of file content this rank has sent so far (names and sizes not counted)."""
        self.broken: str | None = None
        """Why an exchange of this courier (or, seen on the ``board``, of another rank's) failed,
        once one did: every later one refuses (module docstring)."""
        self._broken_on = rank
        """The rank whose exchange broke it."""
        self.board, self._broken_tag = board, f"courier/{number}/broken"
        self.closed = False
        """Set by ``close``: the group let go, every later exchange refused."""
        self._busy = False
        """Whether an exchange runs (``close`` then leaves the group to its end)."""
        self._lock = threading.Lock()

    def close(self) -> None:
        """Let the group go (its sockets and threads end with it: module docstring), now, or
        where an exchange still runs (a save in flight on its thread), as that one ends; every
        later exchange refuses. Not collective: each peer's end of a connection closes as the
        peer closes its own courier (or exits)."""
        with self._lock:
            self.closed = True
            if not self._busy:
                self.group = None

    @classmethod
    def open(cls, timeout: float = DEFAULT_TIMEOUT, board: Coordinator | None = None) -> Courier:
        """Collective on every rank of the job (training thread): a courier with a gloo group of
        its own, whatever backend training uses; ``board``: where the ranks' couriers say they
        broke (module docstring). CoordinationError when a rank does not come within ``timeout``
        (it died before, or is stuck), or the job's store does not answer within it (``Deadlined``:
        every call on it is deadlined, gloo's rendezvous included)."""
        import torch.distributed as dist

        number, world = next(_opened), dist.get_world_size()
        try:
            lanes = max(1, min(_agreed_lanes(f"llmtailor/courier/{number}", timeout), SOCKETS // max(1, world - 1)))
            group = _gloo_group(f"llmtailor/courier/{number}", lanes, timeout)
        except RuntimeError as err:  # gloo's rendezvous on the job's store timed out, or a peer's connection failed
            raise CoordinationError(f"rank {dist.get_rank()}: the courier's gloo group could not be made within "
                                    f"{timeout:g} s: a rank of the job died before it, or is stuck "
                                    f"({type(err).__name__}: {first_line(err)})") from None
        except Unanswered as err:
            raise CoordinationError(f"rank {dist.get_rank()}: {err}, while this rank made the courier's gloo group: "
                                    "its host is stopped or cut off from this one (timeout: Tailor(..., timeout=...))"
                                    ) from None
        # Every rank of the job is in the group, in the job's order: a peer's rank in the job is
        # its rank in the group, which the group's own send and receive take (``_send``).
        if (group.rank(), group.size()) != (dist.get_rank(), world):
            raise CoordinationError(f"the courier's group has rank {group.rank()} of {group.size()}, the job "
                                    f"rank {dist.get_rank()} of {world}")
        return cls(group, dist.get_rank(), timeout, board, number, lanes)

    def exchange(self, outgoing: dict[int, Files], sources: Sequence[int]) -> dict[int, Files]:
        """Send ``outgoing[dst]`` to each rank ``dst``; return what each rank of ``sources`` sent
        here. CoordinationError naming the peer when one died, hung past the timeout, or sent
        what it did not announce; at once when an earlier exchange failed (``broken``)."""
        received = self.exchange_packed({dst: packed(files) for dst, files in outgoing.items()}, sources)
        return {src: [(name, bytes(content)) for name, content in unpacked(files)] for src, files in received.items()}

    def stream(self, outgoing: dict[int, list[tuple[str, int]]], fill: Callable[[int, str, memoryview], Any],
               sources: Sequence[int], take: Callable[[int, str, memoryview], None],
               meanwhile: Callable[[], None] | None = None, land: Land | None = None) -> None:
        """Files sent one after another, each in a buffer of its own (large transfers: a node's
        parts healed from its partner), so that reading, sending, checking and writing overlap:
        to each rank ``dst`` the files ``outgoing[dst]`` lists (``(name, size)``: announced
        first), each read by ``fill(dst, name, view)`` just before it goes (while the one before
        is on its way), or sent from the buffer ``fill`` returns instead (of the file's size: a
        mapped file, no copy); from every rank of ``sources`` at once, each file handed to ``take(src,
        name, view)`` once it is whole (while the next arrives). A ``fill`` that cannot read its
        file leaves the view as it is (the receiver's check against its checksum refuses it);
        ``meanwhile``, when given, runs once every file's sends are posted, while they travel
        (before this rank's receives: its sources' sends wait for it), so that what the sender
        does with the files it sends for its own use (say, checking them) never holds up a send.
        ``land``, when given, says where each received file lands (``Land``: say the mapping of
        the file it is kept in, so that no buffer is then written out), else a fresh buffer.
        ``fill``, ``take``, ``meanwhile`` and ``land`` record their failures instead of raising
        (a raise leaves the peers waiting until the timeout). Errors as ``exchange``."""
        with self._exchanging():
            self._stream(outgoing, fill, sources, take, meanwhile, land)

    def _stream(self, outgoing: dict[int, list[tuple[str, int]]], fill: Callable[[int, str, memoryview], Any],
                sources: Sequence[int], take: Callable[[int, str, memoryview], None],
                meanwhile: Callable[[], None] | None, land: Land | None) -> None:
        sends = []
        for dst, listing in outgoing.items():
            names = json.dumps([[name, size] for name, size in listing]).encode()
            sends.append((dst, self._send(torch.tensor([len(names), len(listing)], dtype=torch.int64), dst, _SIZES)))
            sends.append((dst, self._send(_as_tensor(names), dst, _NAMES)))
        for dst, listing in outgoing.items():
            pieces = 0  # this destination's, going round the lanes (``_lane``)
            for name, size in listing:
                content = torch.empty(size, dtype=torch.uint8)  # its pages untouched unless ``fill`` writes them
                given = fill(dst, name, memoryview(content.numpy()))
                if given is not None and size:
                    content = torch.frombuffer(given, dtype=torch.uint8)
                for at in range(0, size, PIECE):
                    sends.append((dst, self._send(content[at:at + PIECE], dst, self._lane(pieces))))
                    pieces += 1
                self.sent_bytes += size
        if meanwhile is not None:
            meanwhile()
        self._receive_streams(sources, take, land)
        for dst, work in sends:
            self._wait(work, f"sending files to rank {dst}")

    def _receive_streams(self, sources: Sequence[int], take: Callable[[int, str, memoryview], None],
                         land: Land | None = None) -> None:
        """``stream``'s receiving side: every source's files received at once, each source on a
        thread of its own (one source: on this one), ``WINDOW`` shared out between them; ``take``
        called for one file at a time. Not one source after the other: a gloo send completes only
        once its receiver posted the receive, and each sender waits for its sends within the
        timeout, so a source whose stream waited for another's to end (a node rebuilt from two
        holders) would time out wherever the first holder's stream takes longer than the timeout,
        however live every rank is. The first failure is raised once every source's stream ended."""
        if len(sources) <= 1:
            for src in sources:
                self._receive_streamed(src, take, WINDOW, land)
            return
        one_at_a_time = threading.Lock()

        def taking(src: int, name: str, content: memoryview) -> None:
            with one_at_a_time:
                take(src, name, content)

        with ThreadPoolExecutor(len(sources), thread_name_prefix="llmtailor-stream") as pool:
            streams = [pool.submit(carried(self._receive_streamed), src, taking, WINDOW // len(sources), land) for src in sources]
        failures = [stream.exception() for stream in streams if stream.exception() is not None]
        if failures:
            raise failures[0]

    def _receive_streamed(self, src: int, take: Callable[[int, str, memoryview], None], window: int,
                          land: Land | None) -> None:
        """One source's stream: the receives of the next files are posted ahead, up to
        ``window`` bytes (at least the next file), each into where ``land`` asks (else a fresh
        buffer), while ``take`` handles each file in turn, so the peer's sends never wait for a
        receive to be posted nor for a ``take``."""
        what = f"receiving files from rank {src}"
        header = torch.zeros(2, dtype=torch.int64)
        self._wait(self._receive(header, src, _SIZES), what)
        names = torch.empty(int(header[0]), dtype=torch.uint8)
        self._wait(self._receive(names, src, _NAMES), what)
        listing = [(name, int(size)) for name, size in json.loads(names.numpy().tobytes())]
        if len(listing) != int(header[1]):
            raise CoordinationError(f"rank {src} announced {int(header[1])} files and listed {len(listing)}")
        pending: collections.deque[tuple[str, torch.Tensor, list]] = collections.deque()
        posted = 0  # bytes of the pending files
        pieces = 0  # as the sender counts them (``_lane``)
        for name, size in listing:
            while pending and posted + size > window:
                posted -= pending[0][1].numel()
                self._hand_over(src, *pending.popleft(), take)
            landing = land(src, name, size) if land is not None and size else None
            content = (torch.frombuffer(landing, dtype=torch.uint8) if landing is not None and len(landing) == size
                       else torch.empty(size, dtype=torch.uint8))
            works = []
            for at in range(0, size, PIECE):
                works.append(self._receive(content[at:at + PIECE], src, self._lane(pieces)))
                pieces += 1
            pending.append((name, content, works))
            posted += size
        while pending:
            self._hand_over(src, *pending.popleft(), take)

    def _hand_over(self, src: int, name: str, content: torch.Tensor, works: list,
                   take: Callable[[int, str, memoryview], None]) -> None:
        for work in works:
            self._wait(work, f"receiving files from rank {src}")
        take(src, name, memoryview(content.numpy()))

    def exchange_packed(self, outgoing: dict[int, Packed], sources: Sequence[int],
                        into: Into | None = None) -> dict[int, Packed]:
        """``exchange`` without a copy on either side (large transfers: a save's copies to its
        partner ranks): each destination's files come already packed (``Packed``: one tensor,
        or one per file, such as the file's mapping), each source's are returned as they arrived,
        back to back in one tensor (``unpacked`` views them), or, with ``into``, each where
        ``into(src, listing)`` asked for it: one uint8 tensor per listed file, of its size
        (the file's own mapping, say: no copy of it after), returned as the source's
        ``Packed`` (None: one fresh buffer, as without ``into``). ``into`` must not raise (a
        raise breaks the courier). The same messages as ``exchange``; its errors."""
        with self._exchanging():
            return self._exchange_packed(outgoing, sources, into)

    @contextmanager
    def _exchanging(self) -> Iterator[None]:
        """One exchange: refused at once when an earlier one failed, here or (``board``) on
        another rank; any failure of this one breaks the courier (module docstring)."""
        if self.broken is None and self.board is not None:
            posted, why = False, None
            with contextlib.suppress(CoordinationError, RuntimeError):  # a store gone: the exchange itself fails, saying so
                posted, why = self.board.poll(self._broken_tag)
            if posted:
                self.broken, self._broken_on = why["why"], why["rank"]
        if self.broken is not None:
            where = "" if self._broken_on == self.rank else f" of rank {self._broken_on} (every exchange needs it)"
            raise CoordinationError(f"rank {self.rank}: this courier is broken since an exchange{where} failed "
                                    f"({self.broken}); its group may still hold that exchange's messages, so nothing "
                                    "more is sent over it: make the Tailor again on every rank, or restart the job")
        with self._lock:
            if self.closed:
                raise CoordinationError(f"rank {self.rank}: this courier is closed (its Tailor was closed): make a new "
                                        "Tailor to save or restore again")
            self._busy = True
        try:
            yield
        except BaseException as err:
            self.broken, self._broken_on = first_line(err), self.rank
            if self.board is not None:  # the other ranks refuse at once, not after waiting for this one
                with contextlib.suppress(Exception):  # a store gone: they time out as before
                    self.board.post(self._broken_tag, {"rank": self.rank, "why": self.broken})
            if isinstance(err, RuntimeError) and not isinstance(err, CoordinationError):  # gloo's, at a send or receive
                raise CoordinationError(f"rank {self.rank}: an exchange of files failed: a peer died or its connection "
                                        f"failed ({self.broken})") from None
            raise
        finally:
            with self._lock:
                self._busy = False
                if self.closed:  # closed meanwhile (``close``): let go now that nothing runs on it
                    self.group = None

    def _exchange_packed(self, outgoing: dict[int, Packed], sources: Sequence[int],
                         into: Into | None) -> dict[int, Packed]:
        # A peer that fails (dead, hung, or sending what it did not announce) is noted and the
        # exchange goes on with the others, failing at its end, naming it: a live peer's sends
        # wait for this rank's receives, and its receives for this rank's sends kept, so a live
        # peer is not left to its timeout (nor to blame this rank) where the dead one is found
        # at once. A rank failed already is not waited for again. Each peer's first message
        # (its sizes, either way) is posted as the exchange begins, and a live peer's goes at
        # its own start: each is given the timeout from then, not from when its wait begins, so
        # several hung peers cost one timeout in all, not one each (``LATE``).
        failed: dict[int, CoordinationError] = {}
        by = time.monotonic() + self.timeout
        sends = []
        for dst, (listing, payload) in outgoing.items():
            sends += _noting(failed, dst, self._post_sends, dst, listing, payload) or []
        try:
            received = self._receive_packed(sources, failed, by, into)
        finally:  # this rank's sends kept to their end, also where receiving raised: gloo drops a send whose work is freed
            first = set()
            for dst, work in sends:
                if dst not in failed:
                    _noting(failed, dst, self._wait, work, f"sending files to rank {dst}", None if dst in first else by)
                    first.add(dst)
        if failed:
            raise CoordinationError("; ".join(str(err) for err in failed.values()))
        return received

    def _post_sends(self, dst: int, listing: list[tuple[str, int]], payload: torch.Tensor | list[torch.Tensor]) -> list:
        """The sends of one destination's files posted (``exchange_packed``): ``[(dst, work)]``."""
        names = json.dumps([[name, size] for name, size in listing]).encode()
        contents = _per_file(listing, payload)
        total = sum(content.numel() for content in contents)
        sizes = torch.tensor([len(names), total], dtype=torch.int64)
        sends = [(dst, self._send(sizes, dst, _SIZES)), (dst, self._send(_as_tensor(names), dst, _NAMES))]
        sends += [(dst, self._send(content, dst, _BYTES)) for content in contents if content.numel()]
        self.sent_bytes += total
        return sends

    def _receive_packed(self, sources: Sequence[int], failed: dict[int, CoordinationError], by: float,
                        into: Into | None) -> dict[int, Packed]:
        """Each source's files, back to back in one buffer: every source's sizes asked for at
        once, then, as each one's come, its names, then each of its files' bytes into its place
        in the buffer (one wait per message that must come before the next can be asked for,
        not one per message). A source that fails is noted in ``failed`` (by rank), the others'
        messages still taken (``_exchange_packed``); what is returned then is partial."""
        headers = {src: torch.zeros(2, dtype=torch.int64) for src in sources}
        # A receive refused as it is posted (a dead source's connection closed) is that source's
        # failure: the others' are still asked for and taken.
        asked = {src: _noting(failed, src, self._receive, sizes, src, _SIZES) for src, sizes in headers.items()}
        coming = {}
        try:
            for src, sizes in headers.items():
                coming[src] = None if src in failed else _noting(failed, src, self._post_packed, src, sizes, asked[src], by, into)
        finally:  # a receipt posted (into ``into``'s buffers, say) cannot be taken back: each is waited for to its
            # end (in, or dead: its sender lost, or gloo's timeout closing the group) before this returns or raises
            for src, posted in coming.items():
                for work in posted[2] if posted is not None else []:
                    _noting(failed, src, self._wait, work, f"receiving files from rank {src}")
                    if src in failed:  # that connection is closed: none of its receipts can land
                        break
        return {src: (posted[0], posted[1]) for src, posted in coming.items() if posted is not None}

    def _post_packed(self, src: int, sizes: torch.Tensor, asked: Any,
                     by: float, into: Into | None
                     ) -> tuple[list[tuple[str, int]], torch.Tensor | list[torch.Tensor], list]:
        """``_receive_packed`` for one source: its sizes (asked for ``by`` then), its names, then
        the receives of its files posted (into one fresh buffer, or where ``into`` asks)."""
        what = f"receiving files from rank {src}"
        self._wait(asked, what, by)
        names = torch.empty(int(sizes[0]), dtype=torch.uint8)
        self._wait(self._receive(names, src, _NAMES), what)
        listed = [(name, int(size)) for name, size in json.loads(names.numpy().tobytes())]
        total = sum(size for _, size in listed)
        payload = into(src, listed) if into is not None else None
        if payload is None:
            payload = torch.empty(total, dtype=torch.uint8)
        works = [self._receive(content, src, _BYTES) for content in _per_file(listed, payload) if content.numel()]
        if total != int(sizes[1]):
            for work in works:  # its files taken first: the peer's sends end now, not at its timeout
                self._wait(work, what)
            raise CoordinationError(f"rank {src} sent {int(sizes[1])} bytes for files announced as "
                                    f"{total} bytes")
        return listed, payload, works

    def _lane(self, piece: int) -> int:
        """The tag of a stream's ``piece``-th piece between two ranks: ``_BYTES`` on one lane;
        else the lanes in turn (gloo takes the connection of tag t from the group's device
        t % lanes, and keeps each tag's messages between two ranks in order)."""
        return _BYTES if self.lanes == 1 else _LANE_TAGS * self.lanes + piece % self.lanes

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """``tensor`` posted to rank ``dst``: on the group object itself, not ``dist.isend``, which
        looks the group up in torch's registry, emptied by ``destroy_process_group()`` (a script's
        last line, a save still sending its copies). Its ranks are the job's (``open``)."""
        try:
            return self.group.send([tensor], dst, tag)
        except RuntimeError as err:  # refused as it is posted: the connection to that rank is gone
            raise _lost(f"sending files to rank {dst}", err) from None

    def _receive(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """A receive into ``tensor`` from rank ``src`` posted (on the group object, as ``_send``)."""
        try:
            return self.group.recv([tensor], src, tag)
        except RuntimeError as err:
            raise _lost(f"receiving files from rank {src}", err) from None

    def _wait(self, work: object, what: str, by: float | None = None) -> None:
        """Wait for ``work``: the timeout, or until ``by`` (``time.monotonic``) where given, but
        ``LATE`` at least."""
        timeout = self.timeout if by is None else min(self.timeout, max(by - time.monotonic(), LATE))
        try:
            work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as err:
            raise CoordinationError(f"{what} failed or timed out after {self.timeout:g} s: the rank died or is stuck "
                                    f"({first_line(err)})") from None


def _noting(failed: dict[int, CoordinationError], peer: int, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None with its CoordinationError noted as ``peer``'s in ``failed`` (its first)."""
    try:
        return call(*args)
    except CoordinationError as err:
        failed.setdefault(peer, err)
        return None


def _lost(what: str, err: RuntimeError) -> CoordinationError:
    """A send or receive that gloo refused as it was posted (one of the group's connections to
    that rank closed: the rank died), naming the rank (``what``)."""
    return CoordinationError(f"{what} failed: the rank died or its connection failed "
                             f"({first_line(err)})")


def _agreed_lanes(prefix: str, timeout: float) -> int:
    """Collective: the lanes of a courier's group, rank 0's (``LANES_ENV``), posted under
    ``prefix`` in the job's store; ConfigError on every rank where rank 0's value is not one.
    RuntimeError where rank 0 does not post it within ``timeout``; ``Unanswered`` where the store
    does not answer (``ask_within``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    job = distributed_c10d._get_default_store()  # the client the coordinator's calls are deadlined on too
    store = dist.PrefixStore(prefix, job)
    if dist.get_rank() == 0:
        given = os.environ.get(LANES_ENV, "").strip() or str(LANES)
        agreed = given if given.isascii() and given.isdigit() and 1 <= int(given) <= MOST_LANES else (
            f"{LANES_ENV}={given!r} on rank 0: give a whole number of lanes from 1 to {MOST_LANES}")
        ask_within(job, store.set, ("lanes", agreed), timeout, f"set of the count of lanes ({prefix!r})")
    else:
        ask_within(job, store.wait, (["lanes"], timedelta(seconds=timeout)), timeout,
                   f"wait for rank 0's count of lanes ({prefix!r})")
        answer = ask_within(job, store.get, ("lanes",), timeout, f"get of rank 0's count of lanes ({prefix!r})")
        agreed = answer.decode()
    if not agreed.isdigit():
        raise ConfigError(agreed)
    return int(agreed)


def _gloo_group(prefix: str, lanes: int, timeout: float) -> Any:
    """Collective: a gloo group of every rank of the job, in its order, with ``lanes`` devices
    (``LANES``), rendezvous under ``prefix`` in the job's store (deadlined: ``ask_within``; gloo's
    own timeout bounds a rendezvous with a rank that does not come, not one with a store that
    stopped answering). Each device as gloo makes its default one: on the interfaces
    ``GLOO_SOCKET_IFNAME`` lists (in turn), else the host's."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    gloo = dist.ProcessGroupGloo
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    options = gloo._Options()
    options._devices = [gloo.create_device(interface=interfaces[lane % len(interfaces)]) if interfaces
                        else gloo.create_default_device() for lane in range(lanes)]
    options._timeout = timedelta(seconds=timeout)
    job = distributed_c10d._get_default_store()
    store = dist.PrefixStore(prefix, job)
    return ask_within(job, gloo, (store, dist.get_rank(), dist.get_world_size(), options), timeout,
                      f"the rendezvous of the courier's gloo group ({prefix!r})")


def packed(files: Files) -> Packed:
    """``files`` packed in one tensor (one copy), as ``exchange_packed`` sends them."""
    return [(name, len(content)) for name, content in files], _as_tensor(b"".join(content for _, content in files))


def unpacked(packed: Packed) -> list[tuple[str, memoryview]]:
    """Each file of ``packed`` as a view of its bytes in the tensor (no copy)."""
    listing, payload = packed
    return [(name, memoryview(content.numpy()) if content.numel() else memoryview(b""))
            for (name, _), content in zip(listing, _per_file(listing, payload))]


def _per_file(listing: list[tuple[str, int]], payload: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """Each listed file's bytes as a tensor of its own: views of one payload (no copy), or the
    payload's own tensors, one per file; CoordinationError when they are not the sizes listed
    (nothing is sent that differs from what the receiver is told to expect)."""
    if isinstance(payload, torch.Tensor):
        if sum(size for _, size in listing) != payload.numel():
            raise CoordinationError(f"{payload.numel()} bytes packed for files listed as {sum(s for _, s in listing)} bytes")
        return list(payload.split([size for _, size in listing])) if listing else []
    if [content.numel() for content in payload] != [size for _, size in listing]:
        raise CoordinationError(f"files of {[c.numel() for c in payload]} bytes for files listed as "
                                f"{[size for _, size in listing]} bytes")
    return list(payload)


def _as_tensor(content: bytes) -> torch.Tensor:
    """``content`` as a uint8 tensor (one copy: torch keeps no reference to immutable bytes)."""
    return torch.frombuffer(bytearray(content), dtype=torch.uint8) if content else torch.empty(0, dtype=torch.uint8)
