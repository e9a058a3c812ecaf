"""The read plan: at a restore, each byte leaves the store once per job.

Ranks that need the same bytes (DDP replicas: every rank needs every unit whole) agree on one
reader per item (a unit's tensors, say): ``balance`` spreads the items over the group's ranks by
bytes, the same on every rank from the composite's index alone, so agreeing takes no message.
The reader reads its items through the store's own checked reads (every file against its
checksum) and sends each to the others of the group point to point (gloo on CPU) as soon as it
has it; the others receive it instead of fetching it again. An item is a few messages to each
rank: a head (``_HEAD``: whether the read succeeded, and the tensors' sizes), then its large
tensors one by one, straight from and into the live tensors, and its small ones in one message
(``ReadPlan.fetch``). Each rank takes the items as they come
in (``ReadPlan.fetch``), so no rank waits for a slow read while others' items are in; the
readers read in turns (``ReadPlan.turns``) ordered by when each, reading its own items smallest
first, is expected to have them, and the ranks wait for items in that order, a few at a time.

Failures reach every rank of the group, so none is left waiting for a message: a reader whose
read fails sends the failure in place of the bytes (every rank raises it, naming the reader and
the item: an IntegrityError when the reader found damaged or missing data) at the end of the
plan, which every rank goes through to the end (``fetch``: every rank has every item's message,
so all raise the first failed item of the turns; ``deliver``, where the ranks are sent only the
parts they want: one collective there says which item failed first); a rank that died or hangs
makes the sends and receives with it fail on the others (gloo notices a lost connection at once)
or time out after the coordinator's timeout, naming it; the exchange that ends a restore
(``Coordinator.agree``) then names the rank that no longer answers.

Invariant: every rank of the group builds its ``ReadPlan`` from the same items in the same
order and calls ``fetch`` once, with the same tensor specs per item.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, TypeVar

import torch

from llmtailor.distributed.coordinator import CoordinationError, Coordinator, PeerStopped, describe_error, spoil, usable
from llmtailor.distributed.progress import advance, carried
from llmtailor.errors import IntegrityError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
Spec = tuple[torch.dtype, list[int]]
"""``(dtype, shape)`` of one tensor of an item."""
Slice = tuple[int, int]
"""``(offset, length)``: bytes of one item (``ReadPlan.deliver``)."""

ALIGN = 16  # each tensor's bytes start at a multiple of this in a packed buffer (any dtype views it)
_SENT, _DAMAGED, _FAILED, _SKIPPED = 0, 1, 2, 3  # what a reader announces before the payload
_HEAD = 16  # an item's message's first bytes (``fetch``, ``deliver``): its reader's status and how many bytes follow (two int64)
_ROOM = 4 << 10  # bytes after the head every item's broadcast has at least: room for a failed read's error
_AHEAD = 2  # items a rank reads ahead (``deliver``), or has read and not yet delivered to every rank (``fetch``): memory
_WINDOW = 4  # items of others a rank of ``fetch`` waits for at a time (receive buffers posted)
_WINDOW_BYTES = 512 << 20  # and their bytes at most, but for the first
_TOGETHER_UNDER = 64 << 10
"""An item's tensors under this many bytes go to each rank in one message (``fetch``), copied into
it by the reader and out of it by the others: a message costs gloo's and Python's work on both
ranks, more than copying this much (a Llama layer's unit with AdamW state has 36 tensors, 15 of
them norms and step counters of a few bytes; the bench's DDP restore made 676 sends and
receives on its 3 ranks, 440 so). Larger ones go alone, from and into the live tensors'
memory, no copy: at 1 MiB (the bench's 720 KB projections joined too) the copies cost more than
the messages they saved (bench/RESULTS.md, session 58)."""


_SLACK = 32
"""``balance``'s ``together`` lets a rank take 1/this more bytes than the bound to read an item with
the others of its object (as ``store.units.TOGETHER_GAP`` lets a read take in bytes between two ranges)."""


def balance(sizes: dict[K, int], world: int, candidates: Mapping[K, Collection[int]] | None = None,
            together: Mapping[K, Hashable] | None = None) -> dict[K, int]:
    """Item -> rank, balancing bytes: items by size, largest first (equal sizes in the given
    order), each to the rank with the fewest bytes so far (ties to the lowest rank) among its
    ``candidates`` (those that can read it: the ranks whose node holds its files, in a node-local
    tier), every rank for an item without any. The one rule for who writes which unit at a save
    and who reads which at a restore, so every provider balances alike; deterministic, so every
    rank computes the same without a message.

    ``together``: item -> the object it is read from (a pack file holding several units), where
    a reader reads the items of one object it has together, in one request (``Run.reading_together``):
    an item then goes to a rank that has an item of its object already (the fewest bytes of those
    first) while that rank's bytes stay within the fair share (all bytes / ``world``) or the most
    bytes a rank had once the greedy rule gave it an item, whichever is more, and 1/``_SLACK`` of
    it (a unit's norm of a few KB joins the rank reading its pack even where that rank has the
    most: a request costs more than reading that much more); else as above. Bytes an item took
    by joining never raise that bound: each join would let the next one in, and a pack of many
    units each under 1/``_SLACK`` of a fair share (a deep model's layers) would all go to one or
    two ranks. So an object's items are on as few readers as the balance allows (before, a
    pack's equal layers went round the ranks, each rank a request of it), and no item joins a
    rank past that bound."""
    load = [0] * world
    owners: dict[K, int] = {}
    order = list(sizes)
    position = {item: at for at, item in enumerate(order)}
    fair = sum(sizes.values()) / max(world, 1)
    readers: dict[Hashable, set[int]] = {}  # object -> the ranks given an item of it so far
    chosen = 0  # the most bytes of a rank the greedy rule gave an item to (joins not counted: ``together``)
    for item in sorted(order, key=lambda i: (-sizes[i], position[i])):
        allowed = sorted(set((candidates or {}).get(item) or ())) or range(world)
        rank = min(allowed, key=lambda r: (load[r], r))
        joined: list[int] = []
        if together is not None and together.get(item) is not None:
            bound = max(fair, chosen) * (1 + 1 / _SLACK)
            joined = [r for r in allowed if r in readers.get(together[item], ()) and load[r] + sizes[item] <= bound]
            if joined:
                rank = min(joined, key=lambda r: (load[r], r))
            readers.setdefault(together[item], set()).add(rank)
        load[rank] += sizes[item]
        owners[item] = rank
        if not joined:
            chosen = max(chosen, load[rank])
    return owners


def nbytes(specs: list[Spec]) -> int:
    """Bytes of the tensors of ``specs`` (no padding)."""
    return sum(_size(dtype, shape) for dtype, shape in specs)


class ReadPlan:
    """Who reads which item for a group of ranks that each need all of them (module docstring).

    ``items``: name (what an error calls it, e.g. ``unit 'layer.1' of step 4``) -> bytes, in an
    order every rank shares; ``ranks``: the group's global ranks (all of the job's by default)
    and ``group`` its process group (None: the default one); ``candidates``: item -> the global
    ranks that can read it (``balance``; none given: any rank of the group); ``together``: item
    -> the object its reader reads it from with the others of that object it reads (``balance``)."""

    def __init__(self, coordinator: Coordinator, items: dict[str, int], ranks: list[int] | None = None, group: Any = None,
                 candidates: Mapping[str, Collection[int]] | None = None, together: Mapping[str, Hashable] | None = None):
        self.coordinator = coordinator
        self.ranks = list(range(coordinator.world_size)) if ranks is None else list(ranks)
        self.group = group
        positions = {item: [self.ranks.index(r) for r in allowed if r in self.ranks]
                     for item, allowed in (candidates or {}).items()}
        owners = balance(items, len(self.ranks), positions, together)
        self.readers = {item: self.ranks[owners[item]] for item in items}
        """Item -> the global rank that reads it from the store, in the items' order."""
        self.sizes = dict(items)

    def turns(self) -> list[str]:
        """The items in the order ``fetch`` goes through them: by when their reader, reading its
        own items one after another smallest first, has read them (its bytes so far: the same
        on every rank), ties in the items' order. The group's first broadcast is then of an
        item read early (not a reader's largest, which every rank would wait for with nothing
        sent meanwhile), and each reader's items come up in the order it reads them."""
        position = {item: at for at, item in enumerate(self.readers)}
        read, done = dict.fromkeys(self.ranks, 0), {}
        for item in sorted(self.readers, key=lambda i: (self.sizes[i], position[i])):
            read[self.readers[item]] += self.sizes[item]
            done[item] = read[self.readers[item]]
        return sorted(self.readers, key=lambda i: (done[i], position[i]))

    def mine(self) -> list[str]:
        """The items this rank reads from the store."""
        return [item for item, reader in self.readers.items() if reader == self.coordinator.rank]

    def fetch(self, read: Callable[[str], list[torch.Tensor]], specs: Callable[[str], list[Spec]],
              meanwhile: Callable[[], Any] | None = None,
              into: Callable[[str], list[torch.Tensor | None]] | None = None) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """Every item's tensors, on every rank of the group, each as it comes in: ``read(item)``
        on its reader (checked reads; its tensors as ``specs(item)`` says), received from it
        elsewhere, straight into the memory of ``into(item)``'s tensors where given (a live
        tensor of that dtype and shape, contiguous, on the group's device; None: a new one).
        Raises, on every rank alike, what the reader's read raised (module docstring).

        A reader sends each item to every other rank of the group point to point as soon as it
        has read it: a head (``_HEAD``: its status and bytes, with room for a failed read's
        error), then each tensor of ``_TOGETHER_UNDER`` bytes on from where the read left it,
        received straight where it goes (no copy), the smaller ones together in one message
        (``_Body``: copied in and out, fewer messages); each rank takes the items in the order
        they come in, not in turns: no rank waits for an item whose read is
        slow while others are in, and the readers' sends run side by side. A rank reads its own
        items on a thread of its own in the plan's turns (``turns``), one after another: the
        first two queued as the plan starts (``_ReadAhead``), so the second is read as soon as
        the first is in, not once this rank's loop has taken the first (which waits for
        ``meanwhile``, an exchange of the ranks); each next one queued once fewer than
        ``_AHEAD`` of its items are read and not yet delivered to every rank (memory: at most
        that many items of its own being sent, and two read ahead), so the ranks' reads overlap
        one another and the sends (``read`` must allow it: the store's reads do). It waits for
        the items of others in the same turns, up to ``_WINDOW`` (and ``_WINDOW_BYTES``) at a
        time, at least one.

        Failures: a read that fails is sent to every rank in place of the item's bytes; once a
        rank knows of one it reads nothing more (its items not yet read are sent as skipped) and
        takes no more items, but goes on to the end of the plan, so that every message is sent
        and received and none is left for a later plan to meet; there every rank raises the
        first failed read in the plan's turns, naming its reader (every rank has had every
        item's head, so all raise the same). A rank lost fails its peers' sends and receives
        (gloo notices a lost connection at once), or they time out after the coordinator's
        timeout, naming it. Once this has raised (or the caller stopped it), no message of the
        plan writes into ``into``'s tensors: the receipts posted into them are waited for first
        (within the timeout). A caller that stops taking the items on one rank (an error of its
        own, an interrupt: it closes the iterator), or whose ``into`` raises, does not leave the
        others waiting for that rank's messages until the timeout (nor does one that finds a reader
        sent an item of another size than it expects: it takes the bytes its head lists and raises
        that the ranks disagree): the plan goes on there to its end without it, the items not yet sent going out unread and what comes in received into
        memory of the plan's own; the others, once told so by an item's head, read nothing more
        and raise ``PeerStopped`` naming that rank, which raises its own error (``into``'s) or
        none (the caller's stands). ``meanwhile``: called once this rank's first reads have started,
        before any message (the ranks' exchange a restore makes before it reads, then beside
        them); what it raises (or an interrupt while this rank waits for messages) stops this rank
        as a caller that stops does, and is raised once the plan is drained."""
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        usable(self.group, self.coordinator)  # no plan on a group whose wait timed out (``spoil``)
        me, turns = self.coordinator.rank, self.turns()
        tags = {item: at for at, item in enumerate(self.readers)}
        sized = {item: nbytes(specs(item)) for item in self.readers}  # each item's bytes, summed once (not at each wait)
        failing = _Failing(self.coordinator, None)
        own = [item for item in turns if self.readers[item] == me]
        others = collections.deque(item for item in turns if self.readers[item] != me)
        failed: dict[str, tuple[int, int, str]] = {}  # item -> (reader, status, message): reads that failed
        skipped: dict[str, int] = {}  # item sent unread -> the rank whose caller stopped (its reader's, or one it learned of)
        stopped = False  # this rank's caller stopped taking the items: the plan is drained to its end, nothing yielded
        refused: BaseException | None = None  # why this rank stopped (``into``, ``meanwhile``, an interrupt): raised
        # once the plan is drained (as stopped)

        def read_checked(item: str) -> list[torch.Tensor]:
            return _checked(failing.guard(read)(item), specs(item))

        with contextlib.closing(_ReadAhead(list(own), read_checked, 1, 2)) as mine:
            if meanwhile is not None:
                try:
                    meanwhile()
                except (Exception, KeyboardInterrupt) as err:  # on this rank alone, maybe: the others would wait
                    # for its messages until the timeout, so the plan goes on to its end without the caller
                    stopped, refused = True, err
                    failing.known()
            waits = ThreadPoolExecutor(max_workers=_WINDOW + _AHEAD, thread_name_prefix="llmtailor-wait")
            pending: dict[Future, tuple[str, str, Any]] = {}  # a wait -> (kind, item, what it holds)
            receiving = sending = 0
            try:
                while True:
                    room = _WINDOW_BYTES - sum(sized[item] for kind, item, _ in pending.values() if kind != "read")
                    while others and receiving < _WINDOW and (receiving == 0 or sized[others[0]] <= room):
                        item = others.popleft()
                        head = torch.empty(_HEAD + _ROOM, dtype=torch.uint8, device=device)
                        work = self._receive_into(item, self.readers[item], head, tags[item])
                        pending[waits.submit(self._wait, item, self.readers[item], work, "receipt")] = ("head", item, head)
                        receiving, room = receiving + 1, room - sized[item]
                    if own and sending < _AHEAD and not any(kind == "read" for kind, _, _ in pending.values()):
                        pending[next(mine)] = ("read", own[0], None)
                    if not pending:
                        break
                    try:
                        done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    except KeyboardInterrupt as err:  # as a caller that stops (a second one ends the plan at once)
                        if stopped:  # what it posted stays in gloo, to pair with the group's next messages
                            spoil(self.group, err, "a read plan ended at once by a second interrupt", self.coordinator)
                            raise
                        stopped, refused = True, err
                        failing.known()
                        continue
                    for future in [f for f in pending if f in done]:  # in the order they were started
                        kind, item, held = pending.pop(future)
                        advance()
                        tensors = None
                        if kind == "read":
                            own.pop(0)
                            origin = me if stopped else next(iter(skipped.values()), None)
                            tensors, parts = self._sent_read(item, future, specs(item), failed, failing, origin)
                            if stopped and tensors is not None:  # its bytes go to no one: sent unread
                                tensors, parts = None, [_skipped_head(origin)]
                            parts, works = [part.to(device) for part in parts], []
                            try:
                                for rank in (rank for rank in self.ranks if rank != me):
                                    works += [(rank, self._send_to(item, rank, part, tags[item], device)) for part in parts]
                            finally:  # those posted before one was refused (a lost rank) kept: gloo drops a send whose
                                # work is freed, and a live rank that has the head waits for the rest
                                pending[waits.submit(self._wait_all, item, works, "send")] = ("send", item, None)
                                sending += 1
                        elif kind == "send":
                            future.result()
                            sending -= 1
                        elif kind == "head":
                            future.result()
                            drained = False  # the sizes after the head taken already (``_drain``)
                            try:
                                targets = self._targets(item, held, specs(item), None if stopped else into, device,
                                                        failed, skipped, failing)
                            except _Disagreed as err:  # the reader's bytes are taken all the same (its sends
                                # end), and this rank stops here, as where ``into`` failed
                                stopped, refused = True, refused or err
                                failing.known()
                                targets, drained = self._drain(item, held, tags[item], device), True
                            except Exception as err:  # ``into`` failed (the caller's code): this rank stops here
                                if stopped or isinstance(err, CoordinationError):
                                    raise
                                stopped, refused = True, err
                                failing.known()
                                targets = self._targets(item, held, specs(item), None, device, failed, skipped, failing)
                            if targets is None:
                                receiving -= 1
                                continue
                            reader = self.readers[item]
                            works = [(reader, (self._receive_into(item, reader, message, tags[item]), message))
                                     for message in [*_sizes(held, drained), *targets.messages]]
                            pending[waits.submit(self._wait_all, item, works, "receipt")] = ("body", item, targets)
                        else:
                            future.result()
                            receiving -= 1
                            tensors = held.arrived()
                        if tensors is not None and not failed and not stopped:
                            try:
                                yield item, tensors
                            except GeneratorExit:  # the caller stopped (its own error, an interrupt): the others
                                # would wait for its messages until the timeout, so the plan goes on to its end
                                # here without it: this rank's items not yet sent go out unread (the others
                                # then read nothing more and raise, naming it), and what comes in is
                                # received into memory of the plan's own, no longer the caller's
                                stopped = True
                                failing.known()
            finally:
                if pending:  # failing, or the caller stopped
                    # A receipt posted into the caller's tensors (``into``'s) cannot be taken back (gloo
                    # has no cancel): each is waited for to its end before this raises, its bytes in or
                    # the receipt dead (its reader lost, or the timeout: gloo then closes the group's
                    # connections), so no byte of this plan lands in a live tensor once it has raised.
                    # Prompt: a body is asked for once its head is in, its reader's sends posted with
                    # the head. The waits of heads and sends (this plan's own buffers) end behind it.
                    wait([future for future, (kind, _, _) in pending.items() if kind == "body"])
                    waits.shutdown(wait=False)
                else:
                    waits.shutdown(wait=True)
        if refused is not None:
            raise refused
        if stopped:
            return
        if failed:
            item = next(item for item in turns if item in failed)
            raise self._failure(item, *failed[item])
        if skipped:  # sent unread with no read failed: its reader's caller stopped
            item = next(item for item in turns if item in skipped)
            raise PeerStopped(f"rank {skipped[item]} stopped taking the items of the read plan part-way (its own error "
                              f"says why), so {item} was sent unread: this rank did not receive every item")

    def _sent_read(self, item: str, reading: Future, shapes: list[Spec], failed: dict[str, tuple[int, int, str]],
                   failing: _Failing, origin: int | None) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        """A reader's item (``fetch``): its tensors and the messages that send them (the head, then
        each tensor's bytes), or, where its read failed or was skipped, None and the head that
        says so (noted in ``failed``)."""
        head = torch.zeros(_HEAD + _ROOM, dtype=torch.uint8)
        try:
            tensors = reading.result()
        except ReadSkipped:
            return None, [_skipped_head(origin)]
        except Exception as err:  # sent to the others in place of the bytes, then raised here too at the end
            status, text = _refusal(err, _HEAD + _ROOM)
            failed[item] = (self.coordinator.rank, status, text.decode(errors="replace"))
            failing.known()
            _put_head(head, status, len(text))
            if text:
                head[_HEAD : _HEAD + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            return None, [head]
        _put_head(head, _SENT, nbytes(shapes))
        sent = [_bytes_of(t) for t in tensors if t.numel()]
        # How many tensors follow and each one's bytes, so that a rank that disagrees on them
        # still takes their messages (``_Disagreed``, ``_messages``); where they do not fit, minus
        # how many, and their bytes in a message of their own after the head (``_sizes``).
        sizes = torch.tensor([len(part) for part in sent], dtype=torch.int64)
        if len(sent) < _ROOM // 8:
            head[_HEAD : _HEAD + 8 * (1 + len(sent))].view(torch.int64)[:] = torch.cat([torch.tensor([len(sent)]), sizes])
            return tensors, [head, *_joined(sent)]
        head[_HEAD : _HEAD + 8].view(torch.int64)[0] = -len(sent)
        return tensors, [head, _bytes_of(sizes), *_joined(sent)]

    def _targets(self, item: str, head: torch.Tensor, shapes: list[Spec], into: Callable[[str], list[torch.Tensor | None]] | None,
                 device: torch.device, failed: dict[str, tuple[int, int, str]], skipped: dict[str, int],
                 failing: _Failing) -> _Body | None:
        """Where an item's messages are received once its head is in (``fetch``): its tensors,
        ``into``'s where their memory takes the bytes as they are, new ones elsewhere (``_Body``);
        None where its reader's read failed (noted in ``failed``) or it sent the item unread (a
        failure known: this rank then reads nothing more either; where a rank's caller stopped,
        noted in ``skipped`` with that rank)."""
        reader = self.readers[item]
        status, length = head[:_HEAD].cpu().view(torch.int64).tolist()
        if status == _SKIPPED:
            if length:  # a caller stopped: which rank's
                skipped[item] = length - 1
            failing.known()
            return None
        if status != _SENT:
            failed[item] = (reader, status, bytes(head[_HEAD : _HEAD + length].cpu().numpy()).decode(errors="replace"))
            failing.known()
            return None
        if length != nbytes(shapes):
            raise _Disagreed(f"rank {reader} sent {length} bytes of {item}, this rank expected "
                             f"{nbytes(shapes)}: the ranks disagree on what the composite holds")
        # As many bytes, split otherwise: the head lists each tensor's bytes (or, for many, how many)
        count, expected = _listed(head), [size for dtype, shape in shapes if (size := _size(dtype, shape))]
        sent = head[_HEAD + 8 : _HEAD + 8 * (1 + count)].cpu().view(torch.int64).tolist() if count >= 0 else -count
        if sent != (wanted := expected if count >= 0 else len(expected)):
            def split(what: list[int] | int) -> str:
                return f"{what} tensors" if isinstance(what, int) else f"tensors of {what} bytes"

            raise _Disagreed(f"rank {reader} sent the {length} bytes of {item} as {split(sent)}, this rank expected "
                             f"{split(wanted)}: the ranks disagree on what the composite holds")
        given = into(item) if into is not None else [None] * len(shapes)
        return _Body([(live, True) if _takes(live, dtype, shape, device) else (torch.empty(shape, dtype=dtype, device=device), False)
                      for live, (dtype, shape) in zip(given, shapes, strict=True)], device)

    def _drain(self, item: str, head: torch.Tensor, tag: int, device: torch.device) -> _Body:
        """Memory of the plan's own to receive the messages of an item this rank disagrees on
        (``_Disagreed``), so that its reader's sends end and the plan goes on without this rank's
        caller: their tensors' sizes as its reader listed them (``_sent_read``), in its head or,
        for an item of too many tensors for it, in the message after it (received here)."""
        count = _listed(head)
        if count >= 0:
            sizes = head[_HEAD + 8 : _HEAD + 8 * (1 + count)].cpu().view(torch.int64).tolist()
        else:
            listed, reader = torch.empty(-count, dtype=torch.int64, device=device), self.readers[item]
            self._wait(item, reader, self._receive_into(item, reader, _bytes_of(listed), tag), "receipt")
            sizes = listed.cpu().tolist()
        return _Body([(torch.empty(size, dtype=torch.uint8, device=device), False) for size in sizes], device)

    def _wait_all(self, item: str, works: list[tuple[int, tuple[Any, torch.Tensor]]], what: str) -> None:
        """Wait for the sends or receives of one item (``fetch``), naming the first peer that fails."""
        for rank, work in works:
            self._wait(item, rank, work, what)

    def deliver(self, read: Callable[[str], torch.Tensor], wanted: Callable[[str], dict[int, list[Slice]]],
                threads: int = _AHEAD, tag: str | None = None,
                into: Callable[[str], dict[Slice, torch.Tensor]] | None = None) -> Iterator[tuple[str, Callable[[], dict[Slice, memoryview]]]]:
        """Every item in plan order, each with a function that waits for the slices of its bytes
        this rank wants and returns them (slice -> its bytes; none where it wants none). An
        item is one byte tensor, ``read(item)`` on its reader; ``wanted(item)``: global rank ->
        the slices ``(offset, length)`` of the item it wants, the same on every rank. Its reader
        sends each other rank only the slices that rank wants (point to point: a head saying
        whether its read succeeded, then each slice straight from the bytes read, no packed
        copy; received at aligned offsets of one buffer, where the caller may use them in
        place), not the whole item to the whole group: a rank receives what it uses, and waits
        only for its own reads and the items it wants, never for the group at each item.
        ``into(item)``: slices of an item this rank is sent -> the memory each is received in
        (a contiguous uint8 CPU tensor of its length: a live tensor's, no buffer and no copy
        after); they are then returned as views of that memory. Over a GPU group (nccl) it is
        not used. What lands there is as the reader sent it: zeros where its read failed (the
        function raises), unchecked bytes otherwise (the caller checks them where they are).

        Failures: a read that fails is sent as such to the ranks wanting part of the item (their
        function raises ``ReadRefused``), and every rank goes on to the end of the plan, so no
        rank is left waiting for a message; there one collective tells every rank the first
        item (in plan order) whose read failed, and every rank raises its reader's error (the
        read plan's rule: the same error, naming the reader, on every rank). A rank lost while
        bytes are in flight fails the send or receive on its peers, or they time out after the
        coordinator's timeout. Once a rank knows the restore fails (its own read failed, it was
        sent a failed item, or, with a ``tag``, some rank posted a failed read under it in the
        job's store), it reads nothing more from the store: its items not yet read go out as
        failed too (``ReadSkipped``: the ranks still meet at every message, and the error raised
        is still the first real failure's), so a failed restore does not read the rest of the
        composite first. Each rank reads its items on up to ``threads`` threads,
        ``threads`` items ahead (``read`` must allow it), and sends without waiting for the
        receivers: reads, sends and receives overlap. Before it returns (or raises), every send
        of this rank has completed, and every receipt it posted was waited for (by the caller,
        or at the end: ``_Receipt``), so none is left in flight. A caller that stops taking the
        items on one rank (it closes the iterator) does not leave the others in their sends to
        it and the collective at the end until the timeout: the plan goes on there to its end
        without it, as a failed one does, and the others raise ``PeerStopped`` naming it (where
        no read failed)."""
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        usable(self.group, self.coordinator)
        sending, failed = [], None  # failed: (index, item, error) of this rank's first read that failed
        stopped = False  # this rank's caller stopped taking the items: the plan is drained to its end (``fetch``)
        receipts: list[_Receipt] = []  # those posted and not yet waited for (some maybe)
        failing = _Failing(self.coordinator, tag)
        with contextlib.closing(_ReadAhead(self.mine(), failing.guard(read), threads, threads)) as mine:
            try:
                for index, (item, reader) in enumerate(self.readers.items()):
                    slices = wanted(item)
                    advance()
                    if reader != self.coordinator.rank:
                        receipts = [r for r in receipts if not r.waited]  # the caller's waited: their buffers its own
                        receipts.append(self._receive_slices(item, reader, slices.get(self.coordinator.rank, []), index, device,
                                                             {} if into is None or device.type != "cpu" else into(item)))
                        if not stopped:
                            try:
                                yield item, failing.watch(receipts[-1])
                            except GeneratorExit:  # as where this rank reads the item (below)
                                stopped = True
                                failing.known()
                        if stopped:  # waited for here: no buffer for the rest of the plan at once
                            receipts[-1].settle()
                        continue
                    try:
                        data = next(mine).result()
                    except ReadSkipped:  # the restore fails already: sent as refused, not a failure of its own
                        data = None
                    except Exception as err:  # sent as refused to the ranks wanting it; raised at the end on every rank
                        failed, data = failed or (index, item, err), None
                        failing.known()
                    for rank, parts in slices.items():
                        if rank != reader and parts:
                            sending.append((item, self._send_slices(item, rank, data, parts, index, device)))
                    while len(sending) > threads * max(1, len(self.ranks) - 1):  # bounded memory: the oldest sends done
                        self._wait_all(*sending.pop(0), "send")
                    if not stopped:
                        try:
                            yield item, (functools.partial(_refused, item, reader) if data is None
                                         else functools.partial(_slices, memoryview(data.numpy()),
                                                                [(part, part) for part in slices.get(reader, [])]))
                        except GeneratorExit:  # the caller stopped (its own error, an interrupt): the plan goes on
                            # to its end without it, as a failed one does (it reads nothing more, nor do the ranks
                            # it posts that to under ``tag``), so no rank waits for its messages until the timeout
                            stopped = True
                            failing.known()
                while sending:
                    self._wait_all(*sending.pop(0), "send")
                try:
                    self._settle(failed, stopped, device)
                except Exception:
                    if not stopped:  # stopped: the caller's own error stands (the others raise this)
                        raise
            finally:  # a failure, or the caller stopped: no send left from freed memory (the reads: ``_ReadAhead``)
                for sent in sending:
                    try:
                        self._wait_all(*sent, "send")
                    except CoordinationError:  # failing already, with the error that stopped it
                        pass
                for receipt in receipts:  # nor a receipt dropped unwaited (``_Receipt``)
                    receipt.settle()

    def _settle(self, failed: tuple[int, str, Exception] | None, stopped: bool, device: torch.device) -> None:
        """The end of ``deliver``: one collective finds the first item whose read failed on any
        rank (``failed``: this rank's first, as ``(tag, item, error)``); its reader broadcasts
        its error, which every rank raises. Where none failed, the same collective finds a rank
        whose caller ``stopped`` part-way: every rank raises ``PeerStopped`` naming it. Nothing
        more when every read succeeded and no rank stopped."""
        import torch.distributed as dist

        first = torch.tensor([failed[0] if failed is not None else len(self.readers),
                              self.ranks.index(self.coordinator.rank) if stopped else len(self.ranks)], dtype=torch.int64).to(device)
        usable(self.group, self.coordinator)
        try:
            work = dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.coordinator.timeout))
        except Exception as err:  # gloo's error for a lost peer or a timeout
            elsewhere = spoil(self.group, err, "the exchange of failed reads at the end of a read plan", self.coordinator)
            raise CoordinationError(f"the ranks' exchange of failed reads at the end of the read plan failed: a rank of the "
                                    f"group died, or is stuck past the {self.coordinator.timeout:g} s timeout "
                                    f"({describe_error(err)}){elsewhere}") from None
        tag, stopper = first.cpu().tolist()
        if tag == len(self.readers):
            if stopper < len(self.ranks):
                raise PeerStopped(f"rank {self.ranks[stopper]} stopped taking the items of the read plan part-way (its own "
                                  f"error says why): this rank did not receive every item")
            return
        item, reader = list(self.readers.items())[tag]
        if reader == self.coordinator.rank:
            assert failed is not None and failed[0] == tag
            raise self._refuse(item, failed[2], device)
        status, length = self._broadcast(torch.zeros(2, dtype=torch.int64), item, reader, device).tolist()
        message = self._broadcast(torch.empty(length, dtype=torch.uint8), item, reader, device)
        raise self._failure(item, reader, status, bytes(message.numpy()).decode(errors="replace"))

    def _send_slices(self, item: str, rank: int, data: torch.Tensor | None, parts: list[Slice], tag: int,
                     device: torch.device) -> list[tuple[int, tuple[Any, torch.Tensor]]]:
        """Send ``rank`` the ``parts`` of an item it wants (``deliver``): a head (``_HEAD``: sent,
        or refused where ``data``, the item's bytes as read, is None: a failed or skipped read),
        then each part straight from where the read left it (no copy; zeros where refused, so
        the receiver's posted receipts are met all the same). The sends' works, for ``_wait_all``."""
        head = torch.zeros(_HEAD, dtype=torch.uint8)
        _put_head(head, _SENT if data is not None else _FAILED, sum(n for _, n in parts))
        if data is None:
            data = torch.zeros(max(n for _, n in parts), dtype=torch.uint8)
            parts = [(0, n) for _, n in parts]
        works = []
        for payload in [head, *(data[offset : offset + length] for offset, length in parts)]:
            works.append((rank, self._send_to(item, rank, payload, tag, device)))
        return works

    def _receive_slices(self, item: str, reader: int, parts: list[Slice], tag: int,
                        device: torch.device, into: dict[Slice, torch.Tensor] | None = None) -> _Receipt:
        """Post the receipts of the ``parts`` of an item this rank wants from its ``reader``
        (``_send_slices``: the head, then each part, into one buffer at aligned offsets, so the
        bytes of a part can be used where they land; a part ``into`` gives memory for, of its
        length, into that memory instead); a function that waits for them all and returns each
        part's bytes, or raises ``ReadRefused`` where the read failed."""
        if not parts:
            return _Receipt(dict, posted=False)
        into = {part: memory for part, memory in (into or {}).items() if part in parts and memory.numel() == part[1]}
        placed = _packed_slices([part for part in parts if part not in into])
        head = torch.empty(_HEAD, dtype=torch.uint8, device=device)
        buffer = torch.empty(placed[-1][1][0] + placed[-1][1][1] if placed else 0, dtype=torch.uint8, device=device)
        works = [(reader, self._receive_into(item, reader, head, tag))]
        at_place = dict(placed)
        for part in parts:  # in the order they are sent
            memory = into.get(part)
            if memory is None:
                at, length = at_place[part]
                memory = buffer[at : at + length]
            works.append((reader, (self._receive_into(item, reader, memory, tag), memory)))

        def wait() -> dict[Slice, memoryview]:
            self._wait_all(item, works, "receipt")
            if head.cpu().view(torch.int64)[0].item() != _SENT:
                _refused(item, reader)
            return {**_slices(memoryview(buffer.cpu().numpy()), placed),
                    **{part: memoryview(memory.numpy()) for part, memory in into.items()}}

        return _Receipt(wait)

    def _send_to(self, item: str, rank: int, payload: torch.Tensor, tag: int, device: torch.device) -> tuple[Any, torch.Tensor]:
        import torch.distributed as dist

        moved = payload.to(device)
        try:
            return dist.isend(moved, dst=rank, group=self.group, tag=tag), moved
        except Exception as err:  # gloo refuses to post on a connection a lost peer reset: name the peer
            raise self._lost(item, rank, "send", err) from None

    def _receive_into(self, item: str, rank: int, buffer: torch.Tensor, tag: int) -> Any:
        """Post the receipt of one message of ``item`` from ``rank`` into ``buffer``; its work."""
        import torch.distributed as dist

        try:
            return dist.irecv(buffer, src=rank, group=self.group, tag=tag)
        except Exception as err:  # gloo refuses to post on a connection a lost peer reset: name the peer
            raise self._lost(item, rank, "receipt", err) from None

    def _wait(self, item: str, peer: int, work: Any, what: str) -> None:
        """Wait for one send or receive of ``deliver``'s (``work``; a send's payload beside it,
        kept alive until done), within the coordinator's timeout, naming the peer."""
        work = work[0] if isinstance(work, tuple) else work
        try:
            work.wait(timeout=timedelta(seconds=self.coordinator.timeout))
        except Exception as err:  # gloo's error for a lost peer or a timeout: name the peer
            lost = self._lost(item, peer, what, err)
            if any(word in str(err).lower() for word in ("timed out", "timeout")):  # gloo's "Timed out waiting ...",
                # or "Application timeout caused pair closure" (another wait's timeout closed the group)
                spoil(self.group, err, f"the {what} of {item} from or to rank {peer}", self.coordinator)
            raise lost from None

    def _lost(self, item: str, peer: int, what: str, err: Exception) -> CoordinationError:
        try:
            usable(self.group, self.coordinator)
            closed = ""
        except CoordinationError as refused:  # an earlier plan's wait (a failed restore attempt's) timed out on it
            closed = f"; {refused}"
        return CoordinationError(f"the {what} of {item} between rank {self.coordinator.rank} and rank {peer} failed: "
                                 f"a rank died, or is stuck past the {self.coordinator.timeout:g} s timeout "
                                 f"({describe_error(err)}){closed}")

    # -- one item ------------------------------------------------------------------------------

    def _refuse(self, item: str, err: Exception, device: torch.device) -> Exception:
        """Broadcast this reader's failed read of ``item`` to the group in place of its status
        (``deliver``); the error to raise here, as the others raise it."""
        status, message = _refusal(err)
        self._broadcast(torch.tensor([status, len(message)], dtype=torch.int64), item, self.coordinator.rank, device)
        self._broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), item, self.coordinator.rank, device)
        return self._failure(item, self.coordinator.rank, status, message.decode())

    def _broadcast(self, tensor: torch.Tensor, item: str, reader: int, device: torch.device) -> torch.Tensor:
        """``tensor`` from ``reader`` to the group, within the coordinator's timeout."""
        import torch.distributed as dist

        moved = tensor.to(device)
        usable(self.group, self.coordinator)  # a collective that timed out before would pair with this one
        try:
            work = dist.broadcast(moved, group=self.group, group_src=self.ranks.index(reader), async_op=True)
            work.wait(timeout=timedelta(seconds=self.coordinator.timeout))
        except Exception as err:  # gloo's error for a lost peer or a timeout: name the reader
            elsewhere = spoil(self.group, err, f"the broadcast of {item} from rank {reader}", self.coordinator)
            # Which rank is gone the collective does not say (a lost peer may be another receiver):
            # the ranks' exchange that follows a restore names those that no longer answer.
            raise CoordinationError(f"the broadcast of {item} from rank {reader}, its reader, failed: a rank of the group "
                                    f"died, or is stuck past the {self.coordinator.timeout:g} s timeout "
                                    f"({describe_error(err)}){elsewhere}") from None
        return moved.cpu()

    @staticmethod
    def _failure(item: str, reader: int, status: int, message: str) -> Exception:
        text = f"rank {reader} read {item} and refused it: {message}"
        return IntegrityError(text) if status == _DAMAGED else CoordinationError(text)


class _ReadAhead:
    """The future of ``read(item)`` for each of ``items`` in their order (this rank's items in
    the order the caller goes through the plan, taking each as its turn comes: ``next``): the
    one read-ahead of ``fetch`` and ``deliver``. The first ``depth`` reads start at once, on
    ``workers`` threads, not when the caller reaches this rank's first item (every rank's reads
    then run side by side from the plan's start: a rank whose first item comes late in the plan
    does not begin reading only once the items before it were read and sent); each later one
    starts as an item is taken, before it is used, so this rank's reads overlap one another and
    what the caller does with the items (at most ``depth`` read and not taken: the memory
    bound). ``close`` cancels the reads not yet started and waits for those running: no read
    goes on behind its caller's back."""

    def __init__(self, items: Iterable[str], read: Callable[[str], T], workers: int, depth: int):
        self._queue, self._ahead, self._read, self._depth = iter(items), collections.deque(), read, depth
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmtailor-read")
        self._top_up()

    def _top_up(self) -> None:
        while len(self._ahead) < self._depth and (item := next(self._queue, None)) is not None:
            self._ahead.append(self._pool.submit(carried(self._read), item))

    def __iter__(self) -> Iterator[Future[T]]:
        return self

    def __next__(self) -> Future[T]:
        if not self._ahead:
            raise StopIteration
        taken = self._ahead.popleft()
        self._top_up()
        return taken

    def close(self) -> None:
        for reading in self._ahead:
            reading.cancel()
        self._pool.shutdown(wait=True)


class _Receipt:
    """The receipts of one item's parts posted by a rank of ``deliver`` (``_receive_slices``):
    called, waits for them and returns each part's bytes (or raises), waiting once whoever calls
    first, on any thread: a later call gives the same outcome (gloo's second wait on a receipt
    that is in sits until the timeout, then closes the group's connections). ``settle``, as
    ``deliver`` ends: waits for them if the caller did not yet, errors aside (within the timeout:
    its reader goes on to the end of the plan, or is lost): a receipt dropped unwaited leaves
    gloo's connection to its reader stuck once its message comes in (every later message on
    it, a fallback attempt's, waits out the timeout). The caller may still take them after
    (``shared_ranges``' loader takes the last batch's pieces on a thread of its own)."""

    def __init__(self, wait: Callable[[], dict[Slice, memoryview]], posted: bool = True):
        self._wait, self.waited = wait, not posted  # none posted (no part wanted): nothing to wait for
        self._lock = threading.Lock()
        self._outcome: tuple[dict[Slice, memoryview] | None, Exception | None] | None = None

    def __call__(self) -> dict[Slice, memoryview]:
        with self._lock:
            if self._outcome is None:
                self.waited = True
                try:
                    self._outcome = self._wait(), None
                except Exception as err:  # raised to every caller (a BaseException: no outcome, raised as it is)
                    self._outcome = None, err
        parts, error = self._outcome
        if error is not None:
            raise error
        return parts

    def settle(self) -> None:
        if not self.waited:
            with contextlib.suppress(Exception):
                self()


class _Body:
    """Where the messages of an item's tensors are received (``fetch``): ``targets``, each tensor
    with whether it is a live one (``into``'s), each received into its own memory; those under
    ``_TOGETHER_UNDER`` bytes as their reader sends them (``_joined``), in one message, then
    copied out to the live ones (``arrived``), the others left as views of it (no copy)."""

    def __init__(self, targets: list[tuple[torch.Tensor, bool]], device: torch.device):
        sizes = [t.numel() * t.element_size() for t, _ in targets]
        sent = [index for index, size in enumerate(sizes) if size]
        placed, length = _together([sizes[index] for index in sent])
        joined = torch.empty(length, dtype=torch.uint8, device=device)
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a live tensor, its bytes in ``joined``)
        for at, index in ((at, sent[k]) for k, at in placed.items()):
            tensor, live = targets[index]
            received = joined[at : at + sizes[index]]
            if live:
                self.copies.append((tensor, received))
            else:
                targets[index] = (received.view(tensor.dtype).reshape(tensor.shape), False)
        self.targets = targets
        self.messages = ([joined] if placed else []) + [_bytes_of(targets[index][0]) for k, index in enumerate(sent) if k not in placed]
        """What is received, in the order the reader sends it."""

    def arrived(self) -> list[torch.Tensor]:
        """The item's tensors, once every message is in."""
        for tensor, received in self.copies:
            _bytes_of(tensor).copy_(received)
        return [t if live else t.cpu() for t, live in self.targets]


def _together(sizes: list[int]) -> tuple[dict[int, int], int]:
    """Of the bytes of an item's tensors as sent (``fetch``: none empty), those sent in one message,
    the ones under ``_TOGETHER_UNDER`` bytes: index -> its offset there (aligned for any dtype),
    and that message's length."""
    placed, at = {}, 0
    for index, size in enumerate(sizes):
        if size < _TOGETHER_UNDER:
            placed[index], at = at, at + -(-size // ALIGN) * ALIGN
    return placed, at


def _joined(sent: list[torch.Tensor]) -> list[torch.Tensor]:
    """The messages of an item's tensors' bytes (``_sent_read``): the small ones copied into one
    (``_together``), first; each larger one as it is (no copy)."""
    placed, length = _together([len(part) for part in sent])
    if not placed:
        return sent
    joined = torch.empty(length, dtype=torch.uint8, device=sent[0].device)
    for index, at in placed.items():
        joined[at : at + len(sent[index])] = sent[index]
    return [joined, *(part for index, part in enumerate(sent) if index not in placed)]


class _Disagreed(CoordinationError):
    """A reader sent an item of another size than this rank expects (``fetch``'s ``_targets``):
    the rank takes its messages all the same (``_drain``) and stops."""


def _listed(head: torch.Tensor) -> int:
    """How many tensors' sizes a sent item's head lists (``_sent_read``); minus that many where
    they follow in a message of their own."""
    return int(head[_HEAD : _HEAD + 8].cpu().view(torch.int64)[0])


def _sizes(head: torch.Tensor, drained: bool) -> list[torch.Tensor]:
    """Memory for the message of a sent item's tensors' sizes that follows its head where the
    head could not list them (``_sent_read``), to receive before the tensors; none where the
    head lists them, or where ``_drain`` took it."""
    count = _listed(head)
    return [] if drained or count >= 0 else [torch.empty(-count, dtype=torch.int64, device=head.device)]


class ReadRefused(Exception):
    """An item ``deliver`` gave a rank whose reader's read failed: the rank loads nothing of it;
    the reader's error itself is raised on every rank at the end of the plan."""


class ReadSkipped(Exception):
    """An item ``deliver``'s reader did not read: the restore was known to fail (``_Failing``)."""


class _Failing:
    """What one rank's ``deliver`` knows of a failed read in the plan, to read nothing more once
    it does (``deliver``): its own reads' failures and the failed items it is sent (``known``),
    and with a ``tag``, the post any rank leaves in the job's store (``Coordinator.post``) at
    its first failed read, looked for before each read (one look at the store per item)."""

    def __init__(self, coordinator: Coordinator, tag: str | None):
        self.coordinator, self.tag = coordinator, None if tag is None else f"{tag}/failed"
        self._known = threading.Event()

    def known(self) -> None:
        """A read failed, here or on the reader of an item this rank was sent."""
        if not self._known.is_set() and self.tag is not None:
            with contextlib.suppress(Exception):  # a store gone: the others read on and learn it at the end
                self.coordinator.post(self.tag, self.coordinator.rank)
        self._known.set()

    def failed(self) -> bool:
        if not self._known.is_set() and self.tag is not None:
            with contextlib.suppress(Exception):
                if self.coordinator.poll(self.tag)[0]:
                    self._known.set()
        return self._known.is_set()

    def guard(self, read: Callable[[str], T]) -> Callable[[str], T]:
        """``read``, skipped (``ReadSkipped``) once a failure is known."""
        def guarded(item: str) -> T:
            if self.failed():
                raise ReadSkipped(item)
            return read(item)
        return guarded

    def watch(self, receipt: Callable[[], dict[Slice, memoryview]]) -> Callable[[], dict[Slice, memoryview]]:
        """``receipt`` (``_receive_slices``'s), noting a failed item as a known failure."""
        def watched() -> dict[Slice, memoryview]:
            try:
                return receipt()
            except ReadRefused:
                self.known()
                raise
        return watched


def _refused(item: str, reader: int) -> dict[Slice, memoryview]:
    raise ReadRefused(f"rank {reader} could not read {item}")


def _packed_slices(parts: list[Slice]) -> list[tuple[Slice, Slice]]:
    """Each of ``parts`` with where ``_receive_slices`` puts it in its buffer: ``(part, (offset
    in the buffer, length))``, one after another, each at an offset aligned for any dtype."""
    placed, at = [], 0
    for offset, length in parts:
        placed.append(((offset, length), (at, length)))
        at += -(-length // ALIGN) * ALIGN
    return placed


def _slices(view: memoryview, placed: list[tuple[Slice, Slice]]) -> dict[Slice, memoryview]:
    """Slice -> its bytes, for each ``(slice, where its bytes are in view)`` of ``placed``."""
    return {part: view[at : at + length] for part, (at, length) in placed}


def _checked(tensors: list[torch.Tensor], specs: list[Spec]) -> list[torch.Tensor]:
    """``tensors`` as read (``fetch``), each contiguous, once checked against ``specs``."""
    if len(tensors) != len(specs):
        raise IntegrityError(f"{len(tensors)} tensors read, the index says {len(specs)}")
    for tensor, (dtype, shape) in zip(tensors, specs):
        if tensor.dtype != dtype or list(tensor.shape) != list(shape):
            raise IntegrityError(f"a tensor read is {tensor.dtype} {list(tensor.shape)}, the index says {dtype} {list(shape)}")
    return [tensor.detach().contiguous() for tensor in tensors]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a 1-D uint8 view of its memory (what is sent or received)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def _takes(live: torch.Tensor | None, dtype: torch.dtype, shape: list[int], device: torch.device) -> bool:
    """Whether ``live`` can receive an item's tensor of ``dtype`` and ``shape`` straight into its memory."""
    return (live is not None and live.dtype == dtype and list(live.shape) == list(shape) and live.device == device
            and live.is_contiguous() and not live.is_inference())


def _skipped_head(origin: int | None) -> torch.Tensor:
    """The head of an item its reader sends unread (``fetch``): the rank whose caller stopped
    where that is why (``origin``; its length field, one more than the rank), else none."""
    head = torch.zeros(_HEAD + _ROOM, dtype=torch.uint8)
    _put_head(head, _SKIPPED, 0 if origin is None else origin + 1)
    return head


def _put_head(message: torch.Tensor, status: int, length: int) -> None:
    message[:_HEAD].view(torch.int64)[:] = torch.tensor([status, length], dtype=torch.int64)


def _refusal(err: Exception, room: int | None = None) -> tuple[int, bytes]:
    """A failed read as the reader announces it: its status (damaged, or failed) and its error,
    cut to ``room`` bytes where given (every rank then raises the same text)."""
    message = describe_error(err).encode()
    return (_DAMAGED if isinstance(err, IntegrityError) else _FAILED), message if room is None else message[:room - _HEAD]


def pack(tensors: list[torch.Tensor], specs: list[Spec], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of ``tensors`` (as ``specs`` says they are) in one 1-D uint8 tensor (``out``,
    ``_packed_size(specs)`` bytes, where given), each at an offset aligned for any dtype
    (``unpack`` takes them back)."""
    out = torch.empty(_packed_size(specs), dtype=torch.uint8) if out is None else out
    for tensor, offset, (dtype, shape) in zip(tensors, _offsets(specs), specs, strict=True):
        if tensor.dtype != dtype or list(tensor.shape) != list(shape):
            raise IntegrityError(f"a tensor read is {tensor.dtype} {list(tensor.shape)}, the index says {dtype} {list(shape)}")
        size = _size(dtype, shape)
        if size:
            out[offset : offset + size] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return out


def unpack(buffer: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """The tensors ``pack`` put in ``buffer``: views of it, no copy."""
    return [buffer[offset : offset + _size(dtype, shape)].view(dtype).reshape(shape)
            for offset, (dtype, shape) in zip(_offsets(specs), specs)]


def _size(dtype: torch.dtype, shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * dtype.itemsize


def _offsets(specs: list[Spec]) -> list[int]:
    offsets, at = [], 0
    for dtype, shape in specs:
        offsets.append(at)
        at += -(-_size(dtype, shape) // ALIGN) * ALIGN
    return offsets


def _packed_size(specs: list[Spec]) -> int:
    return sum(-(-_size(dtype, shape) // ALIGN) * ALIGN for dtype, shape in specs)


def balance_over(sizes: dict[str, int], ranks: tuple[int, ...]) -> dict[str, int]:
    """Unit -> one of ``ranks`` (a stage's), balancing bytes as ``balance`` does over their positions."""
    return {unit: ranks[position] for unit, position in balance(sizes, len(ranks)).items()}
