"""The read plan: at a restore, each byte leaves the store once per job.

Ranks that need the same bytes (DDP replicas: every rank needs every unit whole) agree on one
reader per item (a unit's tensors, say): ``balance`` spreads the items over the group's ranks by
bytes, the same on every rank from the composite's index alone, so agreeing takes no message.
The reader reads its items through the store's own checked reads (every file against its
checksum) and broadcasts each, packed into one byte buffer, within the group (gloo on CPU); the
others receive it instead of fetching it again.

Failures reach every rank of the group at the same item, so none is left waiting in a
collective: a reader whose read fails broadcasts the failure in place of the bytes (every rank
raises it, naming the reader and the item: an IntegrityError when the reader found damaged or
missing data); a rank that died or hangs makes the broadcast fail on the others (gloo notices a
lost connection at once) or time out after the coordinator's timeout; the exchange that ends a
restore (``Coordinator.agree``) then names the rank that no longer answers.

Invariant: every rank of the group builds its ``ReadPlan`` from the same items in the same
order and calls ``fetch`` once, with the same tensor specs per item.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import torch

from llmtailor.distributed.coordinator import CoordinationError, Coordinator, describe_error
from llmtailor.errors import IntegrityError

K = TypeVar("K", bound=Hashable)
Spec = tuple[torch.dtype, list[int]]
"""``(dtype, shape)`` of one tensor of an item."""

_ALIGN = 16  # each tensor's bytes start at a multiple of this in a packed buffer (any dtype views it)
_SENT, _DAMAGED, _FAILED = 0, 1, 2  # what a reader announces before the payload
_AHEAD = 2  # items a rank reads ahead of their turn (memory: at most this many packed items waiting)


def balance(sizes: dict[K, int], world: int, candidates: Mapping[K, Collection[int]] | None = None) -> dict[K, int]:
    """Item -> rank, balancing bytes: items by size, largest first (equal sizes in the given
    order), each to the rank with the fewest bytes so far (ties to the lowest rank) among its
    ``candidates`` (those that can read it: the ranks whose node holds its files, in a node-local
    tier), every rank for an item without any. The one rule for who writes which unit at a save
    and who reads which at a restore, so every provider balances alike; deterministic, so every
    rank computes the same without a message."""
    load = [0] * world
    owners: dict[K, int] = {}
    order = list(sizes)
    position = {item: at for at, item in enumerate(order)}
    for item in sorted(order, key=lambda i: (-sizes[i], position[i])):
        allowed = sorted(set((candidates or {}).get(item) or ())) or range(world)
        rank = min(allowed, key=lambda r: (load[r], r))
        load[rank] += sizes[item]
        owners[item] = rank
    return owners


def nbytes(specs: list[Spec]) -> int:
    """Bytes of the tensors of ``specs`` (no padding)."""
    return sum(_size(dtype, shape) for dtype, shape in specs)


class ReadPlan:
    """Who reads which item for a group of ranks that each need all of them (module docstring).

    ``items``: name (what an error calls it, e.g. ``unit 'layer.1' of step 4``) -> bytes, in an
    order every rank shares; ``ranks``: the group's global ranks (all of the job's by default)
    and ``group`` its process group (None: the default one); ``candidates``: item -> the global
    ranks that can read it (``balance``; none given: any rank of the group)."""

    def __init__(self, coordinator: Coordinator, items: dict[str, int], ranks: list[int] | None = None, group: Any = None,
                 candidates: Mapping[str, Collection[int]] | None = None):
        self.coordinator = coordinator
        self.ranks = list(range(coordinator.world_size)) if ranks is None else list(ranks)
        self.group = group
        positions = {item: [self.ranks.index(r) for r in allowed if r in self.ranks]
                     for item, allowed in (candidates or {}).items()}
        owners = balance(items, len(self.ranks), positions)
        self.readers = {item: self.ranks[owners[item]] for item in items}
        """Item -> the global rank that reads it from the store, in the items' order."""

    def mine(self) -> list[str]:
        """The items this rank reads from the store."""
        return [item for item, reader in self.readers.items() if reader == self.coordinator.rank]

    def fetch(self, read: Callable[[str], list[torch.Tensor]], specs: Callable[[str], list[Spec]]) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """Every item's tensors, in plan order, on every rank of the group: ``read(item)`` on its
        reader (checked reads; its tensors as ``specs(item)`` says), received from it elsewhere.
        Raises, on every rank alike, what the reader's read raised (module docstring).

        A rank reads its own items on a thread of its own, up to ``_AHEAD`` items ahead of their
        turn, so the ranks' reads overlap one another and the broadcasts (``read`` must allow
        it: the store's reads do)."""
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        queue, ahead = iter(self.mine()), {}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtailor-read") as pool:

            def top_up() -> None:
                while len(ahead) < _AHEAD and (item := next(queue, None)) is not None:
                    ahead[item] = pool.submit(_read_packed, read, item, specs(item))

            try:
                top_up()
                for item, reader in self.readers.items():
                    if reader == self.coordinator.rank:
                        reading = ahead.pop(item)
                        top_up()
                        tensors = self._send(item, reading, device)
                    else:
                        tensors = self._receive(item, reader, specs(item), device)
                    yield item, tensors
            finally:  # a failure, or the caller stopped: no read goes on behind its back
                for reading in ahead.values():
                    reading.cancel()

    # -- one item ------------------------------------------------------------------------------

    def _send(self, item: str, reading: Future, device: torch.device) -> list[torch.Tensor]:
        try:
            tensors, payload = reading.result()
        except Exception as err:  # sent to the others in place of the bytes, then raised here too
            status = _DAMAGED if isinstance(err, IntegrityError) else _FAILED
            message = describe_error(err).encode()
            self._broadcast(torch.tensor([status, len(message)], dtype=torch.int64), item, self.coordinator.rank, device)
            self._broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), item, self.coordinator.rank, device)
            raise self._failure(item, self.coordinator.rank, status, message.decode()) from None
        self._broadcast(torch.tensor([_SENT, payload.numel()], dtype=torch.int64), item, self.coordinator.rank, device)
        self._broadcast(payload, item, self.coordinator.rank, device)
        return tensors

    def _receive(self, item: str, reader: int, shapes: list[Spec], device: torch.device) -> list[torch.Tensor]:
        status, length = self._broadcast(torch.zeros(2, dtype=torch.int64), item, reader, device).tolist()
        payload = self._broadcast(torch.empty(length, dtype=torch.uint8), item, reader, device)
        if status != _SENT:
            raise self._failure(item, reader, status, bytes(payload.numpy()).decode(errors="replace"))
        if length != _packed_size(shapes):
            raise CoordinationError(f"rank {reader} sent {length} bytes of {item}, this rank expected "
                                    f"{_packed_size(shapes)}: the ranks disagree on what the composite holds")
        return unpack(payload, shapes)

    def _broadcast(self, tensor: torch.Tensor, item: str, reader: int, device: torch.device) -> torch.Tensor:
        """``tensor`` from ``reader`` to the group, within the coordinator's timeout."""
        import torch.distributed as dist

        moved = tensor.to(device)
        try:
            work = dist.broadcast(moved, group=self.group, group_src=self.ranks.index(reader), async_op=True)
            work.wait(timeout=timedelta(seconds=self.coordinator.timeout))
        except Exception as err:  # gloo's error for a lost peer or a timeout: name the reader
            # Which rank is gone the collective does not say (a lost peer may be another receiver):
            # the ranks' exchange that follows a restore names those that no longer answer.
            raise CoordinationError(f"the broadcast of {item} from rank {reader}, its reader, failed: a rank of the group "
                                    f"died, or is stuck past the {self.coordinator.timeout:g} s timeout "
                                    f"({describe_error(err)})") from None
        return moved.cpu()

    @staticmethod
    def _failure(item: str, reader: int, status: int, message: str) -> Exception:
        text = f"rank {reader} read {item} and refused it: {message}"
        return IntegrityError(text) if status == _DAMAGED else CoordinationError(text)


def _read_packed(read: Callable[[str], list[torch.Tensor]], item: str, specs: list[Spec]) -> tuple[list[torch.Tensor], torch.Tensor]:
    tensors = read(item)
    return tensors, pack(tensors, specs)


def pack(tensors: list[torch.Tensor], specs: list[Spec]) -> torch.Tensor:
    """The bytes of ``tensors`` (as ``specs`` says they are) in one 1-D uint8 tensor, each at
    an offset aligned for any dtype (``unpack`` takes them back)."""
    out = torch.empty(_packed_size(specs), dtype=torch.uint8)
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
        at += -(-_size(dtype, shape) // _ALIGN) * _ALIGN
    return offsets


def _packed_size(specs: list[Spec]) -> int:
    return sum(-(-_size(dtype, shape) // _ALIGN) * _ALIGN for dtype, shape in specs)


def balance_over(sizes: dict[str, int], ranks: tuple[int, ...]) -> dict[str, int]:
    """Unit -> one of ``ranks`` (a stage's), balancing bytes as ``balance`` does over their positions."""
    return {unit: ranks[position] for unit, position in balance(sizes, len(ranks)).items()}
