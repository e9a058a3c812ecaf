"""Byte ranges of a remote run's files fetched once per job, in large requests, and sent to the
ranks that need them: a distributed restore whose ranks each need parts of the same files
(FSDP2 shards restored at another world size: each rank's boxes are byte ranges of every file
that holds a chunk they overlap).

Read one box at a time, a rank pays a request per box, and an object store a round trip per
request whatever its size (``Storage.remote``): a Llama of 4 layers restored from 2 ranks to 3
made 160-280 ranged GETs on each rank. Here the ranks say which ranges they need, group by
group (a unit's: a group is loaded once its bytes are in), and exchange them
(``Coordinator.exchange``). Consecutive small groups are fetched together, in batches of at
most a part and a half per file (``_batches``: a pack's layer shards, a few MB each, are then a
request for two, not one each), so a rank holds one batch's bytes at a time besides the reads
ahead. The union of every rank's ranges of a file in a batch, ranges less than ``GAP`` bytes
apart joined, is cut into pieces of a part, the storage's request size (``fetch.part_bytes``:
16 MiB from an object store; a short last one joined to the one before: up to a part and a
half, ``_pieces``); each piece is one item of a read plan
(``distributed.read_plan``): fetched by one rank (balanced by bytes, two read ahead on two
threads) in one request, and sent to each rank that needs part of it, only the parts its
ranges cover (``ReadPlan.deliver``, point to point: a rank receives about what it uses, not
every piece); each rank uses its parts where they were received (a range cut over two
pieces is copied together). A rank's box whose live target takes its bytes as they are
(FSDP2's shards: ``read_once``'s ``landing``) is sent apart from the page margins around it
and received straight into the target: no buffer and no copy for those bytes. A file is then fetched in about its size
/ a part's requests in all, each byte once (plus what the joined gaps hold). A batch's groups
are loaded on a thread of its own while the next batch's pieces are read and sent.

Checks: none here. The reads that take the bytes (``ChunkReader``, its ``received``) check
them as if they had fetched them themselves, on every rank that uses them.

Failures: a fetch that fails on its reader (a missing or truncated file, the store's error) is
raised on every rank, naming the reader, once every rank went through the plan (the read plan's
rule); a rank sent a failed piece loads nothing more, and no rank reads more from the store once
it knows of a failed read (``ReadPlan.deliver``: the reader posts it in the job's store). A group
whose load fails on a rank (a checksum mismatch) is remembered there; the rank goes on taking
part in the sending of the rest, loading nothing more, and raises it after the last, so no rank
is left waiting for it (the restore's closing exchange then fails every rank).

The files' headers, which say where each chunk's bytes begin (every rank needs them to say its
ranges), are read once in the job too (``share_headers``): each by one of the ranks that need
it, its size checked against the manifest, and sent to the others through the coordinator.

Invariant: every rank of the job calls ``share_headers`` then ``read_once`` once per restore,
with the same tags.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from llmtailor.distributed.coordinator import CoordinationError, Coordinator, describe_error
from llmtailor.distributed.progress import carried
from llmtailor.distributed.read_plan import ALIGN, ReadPlan, ReadRefused, balance
from llmtailor.errors import IntegrityError
from llmtailor.store.checked import stored_header
from llmtailor.store.manifest import FileEntry
from llmtailor.store.fetch import PART, fetch_into, part_bytes, part_cuts
from llmtailor.store.storage import Storage

if TYPE_CHECKING:
    import torch

Range = tuple[str, int, int]
"""``(key, start, length)``: bytes of one file of the storage."""

LANDS_FROM = 1 << 20
"""A box smaller than this is not received into its live target (``read_once``'s ``landing``)
but with its page margins in one message, then copied there: cut from its margins it costs two
messages more (gloo's per message work on both ranks), more than copying this much (the
bench's FSDP2 restore, 2 to 3 ranks, every box landed: 2.3x the messages, more CPU on every rank;
bench/RESULTS.md, session 57)."""

GAP = 64 << 10
"""Ranges of a file closer than this are fetched as one (the bytes between them with them):
a request costs more than reading this much more."""


def share_headers(coordinator: Coordinator, storage: Storage, files: dict[str, FileEntry],
                  tag: str, known: dict[str, int] | None = None) -> dict[str, tuple[int, dict]]:
    """``stored_header`` of each of ``files`` (key -> manifest entry: the safetensors files of
    ``storage`` this rank reads), each read by one of the ranks that need it (balanced by count:
    a header costs its requests) and sent to the others (module docstring); ``known``: key ->
    bytes of the file's tensor data this rank knows of (``stored_header``: its header is then
    read in one request). A read that fails is raised on every rank needing the file, naming
    the reader (an IntegrityError where it found the file damaged or missing); the others go on."""
    listed = coordinator.exchange(f"{tag}/files", sorted(files))
    needing: dict[str, list[int]] = {}
    for rank, keys in enumerate(listed):
        for key in keys:
            needing.setdefault(key, []).append(rank)
    owners = balance(dict.fromkeys(needing, 1), coordinator.world_size, needing)
    mine = {}
    for key in (k for k, owner in owners.items() if owner == coordinator.rank):
        try:
            mine[key] = list(stored_header(storage, key, files[key], known=(known or {}).get(key)))
        except Exception as err:  # sent to the others in place of the header, then raised below
            mine[key] = {"failed": describe_error(err), "damaged": isinstance(err, IntegrityError)}
    headers = {}
    for rank, sent in enumerate(coordinator.exchange(f"{tag}/headers", mine)):
        for key, header in sent.items():
            if key not in files:
                continue
            if isinstance(header, dict):
                kind = IntegrityError if header["damaged"] else CoordinationError
                raise kind(f"rank {rank} read the header of {storage.where(key)} and refused it: {header['failed']}")
            headers[key] = (header[0], header[1])
    return headers


def read_once(coordinator: Coordinator, storage: Storage, needs: dict[str, list[Range]],
              load: Callable[[str, dict[Range, bytearray | memoryview | list[memoryview]]], None], tag: str,
              landing: dict[Range, tuple[tuple[int, int], torch.Tensor]] | None = None) -> None:
    """Fetch the ranges of ``storage``'s files every rank needs, each once in the job (module
    docstring), and call ``load(group, bytes by range)`` for each of this rank's groups
    (``needs``: group -> the ranges of it this rank needs), in the order the ranks first name
    them, once every byte of the group is in. Raises what a fetch or a load raised (module
    docstring).

    ``landing``: range of ``needs`` -> ``((start, length), memory)``: the bytes of a box inside
    it go straight into ``memory`` (contiguous uint8: the box's live target), no buffer, no
    copy after: asked for as margin | box | margin, the box sent apart and received there;
    ``load`` is given the range as the list of its slices' bytes (boxes of ``LANDS_FROM`` bytes
    on). They land before ``load`` checks them: a damaged range is refused, its box left as it came."""
    import torch  # a distributed restore: torch is loaded already

    cut, everyone, aparts, landing = _said(coordinator, needs, landing or {}, f"{tag}/ranges")
    groups = list(dict.fromkeys(group for ranks in everyone for group in ranks))
    batches = _batches(groups, everyone, part_bytes(storage))
    pieces = _named_pieces(batches, everyone, storage)
    last = {batch: name for name, (batch, _) in pieces.items()}
    by_rank = {batch: [_by_file((r for group in batch for r in ranks.get(group, ())), aparts[rank])
                       for rank, ranks in enumerate(everyone)] for batch in batches}  # sorted once
    by_key = _by_key(targets := {(r[0], *box): memory for r, (box, memory) in landing.items()})  # by the box's range
    waiting = _Groups(groups, {group: [s for r in cuts.values() for s in r] for group, cuts in cut.items()},
                      _joined_load(load, cut, landing), targets)
    plan = ReadPlan(coordinator, {name: piece[2] for name, (_, piece) in pieces.items()})

    def read(name: str) -> torch.Tensor:
        key, start, length = pieces[name][1]
        fetch_into(storage, key, start, [buffer := _scratch(length)])
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def wanted(name: str) -> dict[int, list[tuple[int, int]]]:
        batch, piece = pieces[name]
        return {rank: _within(piece, ranges) for rank, ranges in enumerate(by_rank[batch])}

    def into(name: str) -> dict[tuple[int, int], torch.Tensor]:
        return _landing_slices(pieces[name][1], wanted(name).get(coordinator.rank, ()), by_key) if targets else {}

    received: list[tuple[tuple[str, ...], Range, Callable[[], dict]]] = []  # the pieces of the batch being sent
    loading: Future | None = None  # the batch before it, its bytes awaited and loaded on a thread
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtailor-load") as loader:
        try:
            for name, slices in plan.deliver(read, wanted, tag=tag, into=into):
                batch = pieces[name][0]
                received.append((batch, pieces[name][1], slices))
                if last[batch] == name:  # all asked for: loaded while the next batch's pieces go
                    if loading is not None:  # one batch loading at a time: memory for two batches' bytes
                        loading.result()
                    loading, received = loader.submit(carried(_arrive_and_load), waiting, batch, received), []
            if loading is not None:
                loading.result()
        except BaseException:
            _settle(received)
            if loading is not None:
                wait([loading])
            raise
    waiting.load_through(None)
    _give_back_heap()


def _arrive_and_load(waiting: _Groups, batch: tuple[str, ...], received: list[tuple[tuple[str, ...], Range, Callable[[], dict]]]) -> None:
    """Wait for each piece of ``batch`` (its groups) this rank is sent, copy its parts into place,
    then load this rank's groups through the batch's last."""
    try:
        while received:
            _, piece, arrived = received[0]
            try:
                parts = arrived()
                for group in batch:
                    waiting.take(group, piece, parts)
            except ReadRefused as err:  # its reader's error is raised at the end of the plan, on every rank
                waiting.failure = waiting.failure or err
            received.pop(0)
    except BaseException:
        _settle(received[1:])
        raise
    waiting.load_through(batch[-1])


def _named_pieces(batches: list[tuple[str, ...]], everyone: list[dict[str, list]],
                  storage: Storage) -> dict[str, tuple[tuple[str, ...], Range]]:
    """Each batch's pieces (``_pieces`` of every rank's ranges of its groups), by a name saying
    which bytes of which file they are, with their batch."""
    pieces: dict[str, tuple[tuple[str, ...], Range]] = {}
    for batch in batches:
        for piece in _pieces((tuple(r) for ranks in everyone for group in batch for r in ranks.get(group, ())), part_bytes(storage)):
            name = f"bytes {piece[1]}-{piece[1] + piece[2]} of {storage.where(piece[0])}"
            pieces[name if name not in pieces else f"{name} (for {batch[-1]})"] = (batch, piece)
    return pieces


def _said(coordinator: Coordinator, needs: dict[str, list[Range]], landing: dict[Range, tuple[tuple[int, int], Any]],
          tag: str) -> tuple[dict[str, dict[Range, list[Range]]], list[dict[str, list]], list[set[Range]], dict[Range, Any]]:
    """This rank's ranges as asked for (``_cut``: group -> range -> its slices), what every rank
    asks for, exchanged: its groups' slices, and those sent apart (its landing boxes), and this
    rank's ``landing`` kept: its boxes of ``LANDS_FROM`` bytes on."""
    landing = {r: (box, memory) for r, (box, memory) in landing.items() if box[1] >= LANDS_FROM}
    cut = {group: {r: _cut(r, landing[r][0] if r in landing else None) for r in ranges} for group, ranges in needs.items()}
    said = coordinator.exchange(tag, {"needs": {group: [list(s) for r in cuts.values() for s in r] for group, cuts in cut.items()},
                                      "apart": sorted({(r[0], *landing[r][0]) for r in landing})})
    return cut, [rank["needs"] for rank in said], [{tuple(r) for r in rank["apart"]} for rank in said], landing


def _by_key(targets: dict[Range, torch.Tensor]) -> dict[str, list[tuple[Range, torch.Tensor]]]:
    """``targets`` by file key."""
    by_key: dict[str, list[tuple[Range, torch.Tensor]]] = {}
    for r, memory in targets.items():
        by_key.setdefault(r[0], []).append((r, memory))
    return by_key


def _landing_slices(piece: Range, parts: Iterable[tuple[int, int]],
                    targets: dict[str, list[tuple[Range, torch.Tensor]]]) -> dict[tuple[int, int], torch.Tensor]:
    """The ``parts`` of ``piece`` (``(offset in the piece, length)``, those this rank is sent)
    that lie inside a box it lands (``targets``: by file, its boxes' ranges and memory), each
    with the part of that memory it is: ``ReadPlan.deliver``'s ``into``."""
    key, start, _ = piece
    found = {}
    for offset, length in parts:
        for (k, s, n), memory in targets.get(key, ()):
            if s <= start + offset and start + offset + length <= s + n:
                found[(offset, length)] = memory[start + offset - s : start + offset + length - s]
                break
    return found


def _settle(received: list[tuple[tuple[str, ...], Range, Callable[[], dict]]]) -> None:
    """Wait for the receipts still pending when the restore failed (no bytes land in memory
    freed behind them), each as far as it goes: the error raised is the one that stopped it."""
    for _, _, arrived in received:
        try:
            arrived()
        except Exception:  # the restore is failing already, with its own error
            pass


def _scratch(length: int) -> memoryview:
    """``length`` bytes of memory a restore's bytes pass through on their way to the live
    tensors (a piece as read, a range cut over two pieces): from torch's allocator, not a fresh
    mapping (``fetch.new_buffer``), so the memory of a batch already loaded serves the next one,
    its pages already in (a fresh mapping's are faulted in, zeroed and unmapped again: on the
    project's VM about 1 ms of CPU per MB, several times the copy through it)."""
    import torch

    return memoryview(torch.empty(length, dtype=torch.uint8).numpy())


def _give_back_heap() -> None:
    """Return to the system the heap memory the restore's ``_scratch`` buffers left free, once
    none is held: glibc keeps it in its arenas otherwise (after a first batch it raises its mmap
    threshold, so later buffers of MBs come from the heap and stay there when freed), and the
    process holds several times the bytes of one batch after the restore (bench/scratch_heap.py:
    567 MiB against 230 MiB after six batches of 16 x 8 MiB; 10-25 ms of CPU a trim there).
    Nothing where the C library has no ``malloc_trim`` (not glibc)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None)


def _aligned(data: memoryview) -> bool:
    """Whether ``data`` begins at an address aligned for any dtype (a tensor of any dtype may view
    it), as ``ReadPlan.deliver`` receives each part (``ALIGN``)."""
    return len(data) == 0 or _address(data) % ALIGN == 0


def _address(data: memoryview) -> int | None:
    """Where ``data``'s bytes begin in memory (None: it has none)."""
    import torch

    return torch.frombuffer(data, dtype=torch.uint8).data_ptr() if len(data) else None


def _batches(groups: list[str], everyone: list[dict[str, list]], part: int = PART) -> list[tuple[str, ...]]:
    """``groups`` in order, consecutive ones together while each file's bytes of them (every
    rank's ranges, summed) stay under a part and a half (``part``: the storage's request size,
    ``fetch.part_bytes``): fetched together, a file's ranges of small groups (a 4.45 MB layer
    shard each, in a pack) are one request, not one each (a request costs a round trip whatever
    its size). A group larger than that is a batch alone."""
    batches: list[tuple[str, ...]] = []
    current: list[str] = []
    held: dict[str, int] = {}  # bytes of the current batch, by file
    for group in groups:
        sizes: dict[str, int] = {}
        for ranks in everyone:
            for key, _, length in ranks.get(group, ()):
                sizes[key] = sizes.get(key, 0) + length
        if current and any(held.get(key, 0) + n >= part + part // 2 for key, n in sizes.items()):
            batches.append(tuple(current))
            current, held = [], {}
        current.append(group)
        for key, n in sizes.items():
            held[key] = held.get(key, 0) + n
    if current:
        batches.append(tuple(current))
    return batches


def _by_file(ranges: Iterable[Iterable], apart: set[Range] = frozenset()) -> dict[str, list[tuple[int, int, bool]]]:
    """One rank's ranges of a group (``Range``s) as ``(start, length, whether it is sent
    apart)`` by file key, each file's sorted by start: what ``_within`` takes, made once per
    group, not once per piece. ``apart``: the rank's ranges sent apart from those they touch
    (boxes received into their live targets: ``read_once``'s ``landing``)."""
    by_key: dict[str, list[tuple[int, int, bool]]] = {}
    for key, start, length in ranges:
        by_key.setdefault(key, []).append((start, length, (key, start, length) in apart))
    return {key: sorted(spans) for key, spans in by_key.items()}


def _within(piece: Range, ranges: dict[str, list[tuple[int, int, bool]]]) -> list[tuple[int, int]]:
    """The parts of ``piece`` that ``ranges`` (one rank's, of a group, ``_by_file``) cover, as
    ``(offset in the piece, length)``, overlapping or touching ones joined (touching ones not
    where either is sent apart), in order."""
    key, start, length = piece
    parts: list[list] = []
    for s, n, alone in ranges.get(key, ()):
        if s >= start + length:  # sorted by start: no later range reaches into the piece
            break
        low, high = max(s, start), min(s + n, start + length)
        if low >= high:
            continue
        if parts and (low < parts[-1][1] or (low == parts[-1][1] and not alone and not parts[-1][2])):
            parts[-1][1], parts[-1][2] = max(parts[-1][1], high), False
        else:
            parts.append([low, high, alone])
    return [(low - start, high - low) for low, high, _ in parts]


def _cut(span: Range, box: tuple[int, int] | None) -> list[Range]:
    """``span`` as the ranges asked for: itself, or with a ``box`` inside it (``read_once``'s
    ``landing``), the margin before it, the box and the margin after it (empty ones left out)."""
    if box is None:
        return [span]
    key, start, length = span
    at, n = box
    assert start <= at and at + n <= start + length, (span, box)
    return [r for r in ((key, start, at - start), (key, at, n), (key, at + n, start + length - at - n)) if r[2] > 0]


def _joined_load(load: Callable[[str, dict], None], cut: dict[str, dict[Range, list[Range]]],
                 landing: dict[Range, Any]) -> Callable[[str, dict], None]:
    """``load`` given each range of ``needs`` as ``read_once`` says: one with a box that lands
    (``landing``) as the list of its slices' bytes, even where the box is all of it."""
    def joined(group: str, got: dict[Range, bytearray | memoryview]) -> None:
        load(group, {span: [got[r] for r in ranges] if span in landing else got[span] for span, ranges in cut[group].items()})
    return joined


class _Groups:
    """This rank's groups in order, the bytes of each as they come in, each loaded once whole;
    the first failure of a load kept (module docstring) and raised after the last group."""

    def __init__(self, order: list[str], needs: dict[str, list[Range]], load: Callable[[str, dict[Range, bytearray | memoryview]], None],
                 targets: dict[Range, torch.Tensor] | None = None):
        self.order, self.needs, self.load = order, needs, load
        self.targets = targets or {}  # ranges received into their live targets (``read_once``'s ``landing``)
        self._files: dict[str, dict[str, list[Range]]] = {}
        self.next = 0
        self.received: dict[str, dict[Range, bytearray | memoryview]] = {}
        self.failure: BaseException | None = None

    def take(self, group: str, piece: Range, parts: dict[tuple[int, int], memoryview]) -> None:
        """Put the parts of ``piece`` this rank was sent (``(offset in the piece, length)`` -> its
        bytes; ``_within``: they cover this rank's ranges of ``group`` in the piece) in place: a
        range lying whole in one part, at an address aligned for any dtype, is that part's bytes
        where they were received (``ReadPlan.deliver`` receives each part at an aligned offset;
        a reader's own parts are views of its read), no copy; a range cut over two pieces (or
        misaligned) is copied together into a buffer of its own. A range with a live target
        (``targets``) is that target's memory: a part already received there is not copied
        (``ReadPlan.deliver``'s ``into``), one received elsewhere (a reader's own) is copied in."""
        if group not in self.needs or self.failure is not None or not parts:
            return
        held = self.received.setdefault(group, {})  # a group's bytes held from its first piece on: one group's at a time
        key, start, _ = piece
        placed = sorted(parts)  # disjoint (``_within``): the parts a range overlaps found by bisection
        starts = [start + offset for offset, _ in placed]
        for k, s, n in self._of_file(group, key):
            for offset, length in placed[max(0, bisect.bisect_right(starts, s) - 1) : bisect.bisect_left(starts, s + n)]:
                low, high = max(s, start + offset), min(s + n, start + offset + length)
                if low >= high:
                    continue
                bytes_ = parts[(offset, length)][low - start - offset : high - start - offset]
                target = self.targets.get((k, s, n))
                if target is not None:
                    held[(k, s, n)] = memoryview(target.numpy())
                    if _address(bytes_) != target.data_ptr() + (low - s):
                        held[(k, s, n)][low - s : high - s] = bytes_
                    continue
                if (k, s, n) not in held and (low, high) == (s, s + n) and _aligned(bytes_):
                    held[(k, s, n)] = bytes_
                    continue
                if (k, s, n) not in held:
                    held[(k, s, n)] = _scratch(n)
                memoryview(held[(k, s, n)])[low - s : high - s] = bytes_

    def _of_file(self, group: str, key: str) -> list[Range]:
        """This rank's ranges of ``group`` in file ``key``, each once (made once per group)."""
        if group not in self._files:
            self._files[group] = {}
            for r in dict.fromkeys(self.needs[group]):
                self._files[group].setdefault(r[0], []).append(r)
        return self._files[group].get(key, [])

    def load_through(self, group: str | None) -> None:
        """Load this rank's groups up to ``group`` (None: every one left), in order."""
        end = len(self.order) if group is None else self.order.index(group) + 1
        for name in self.order[self.next : end]:
            received = self.received.pop(name, {})
            if name in self.needs and self.failure is None:
                try:
                    self.load(name, {r: received[r] if r in received else _scratch(r[2]) for r in self.needs[name]})
                except BaseException as err:  # raised after the last broadcast (module docstring)
                    if isinstance(err, (KeyboardInterrupt, SystemExit)):
                        raise
                    self.failure = err  # dcp.load's CheckpointException is a BaseException
        self.next = max(self.next, end)
        if group is None and self.failure is not None:
            raise self.failure


def _pieces(ranges: Iterable[Range], part: int = PART) -> list[Range]:
    """The union of ``ranges``, per file: ranges overlapping or less than ``GAP`` bytes apart
    joined, each cut into pieces of ``part`` bytes (the storage's request size,
    ``fetch.part_bytes``), the last one joined to the one before when under half a part (a
    request costs a round trip whatever its size: ``fetch._joined``), so pieces are of up to a
    part and a half; sorted by key and start."""
    joined: list[list] = []
    for key, start, length in sorted(r for r in ranges if r[2] > 0):
        if joined and joined[-1][0] == key and start <= joined[-1][2] + GAP:
            joined[-1][2] = max(joined[-1][2], start + length)
        else:
            joined.append([key, start, start + length])
    pieces = []
    for key, start, end in joined:
        cuts = [start + cut for cut in part_cuts(end - start, part=part)]
        pieces += [(key, at, until - at) for at, until in zip(cuts, [*cuts[1:], end])]
    return pieces
