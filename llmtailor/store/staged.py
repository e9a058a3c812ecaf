"""The staging contract: what a provider hands the store to write, and what each rank reports
back to the leader once its part of a snapshot is written.

``Piece``, ``StagedUnit`` and ``StagedSnapshot`` are what providers, the drift tracker and the
async stager produce; ``persist`` (``store/writer.py``) consumes them. ``RankPart`` is a rank's
report: it travels as JSON through the commit coordinator (``to_message`` / ``from_message``)
and is validated on arrival like any file we read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from llmtailor.errors import TailorError
from llmtailor.store.manifest import FileEntry


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place change made through the tensor,
    not by one made through ``.data``), or None where it has none: an inference-mode tensor
    (made under ``torch.inference_mode()``) keeps no counter, and reading it raises."""
    try:
        return tensor._version
    except RuntimeError:
        return None


@dataclass(frozen=True)
class Piece:
    """A box of one unit tensor as this rank holds it: ``tensor`` (any device) is the part of
    the global tensor of shape ``global_shape`` whose corner is ``offsets``."""

    key: str
    """``weight/<param>``, ``optim/<param>/<state key>`` or ``master/<param>``."""
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    stable: bool = True
    """False for a tensor that may change outside the optimizer step (a buffer updated in
    forward): an async save copies it before ``save`` returns."""
    cover_xxh3: str | None = None
    """A frozen whole weight's sampled checksum (``frozen.fingerprints``: its covering sample),
    recorded in its chunk: a restore checks a live tensor against it instead of reading the
    whole tensor."""

    @classmethod
    def whole(cls, key: str, tensor: torch.Tensor, stable: bool = True) -> Piece:
        return cls(key, tensor, (0,) * tensor.dim(), tuple(tensor.shape), stable)

    @property
    def is_whole(self) -> bool:
        return tuple(self.tensor.shape) == self.global_shape


@dataclass
class StagedUnit:
    """What one rank writes of one unit: its pieces (live references for a synchronous save)
    and the optimizer state values that are not tensors, by parameter name."""

    unit: str
    pieces: list[Piece]
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)
    """Frozen tensors not written: tensor key -> step of the snapshot that holds it."""
    base: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Frozen tensors not written: tensor key -> where the base directory holds it (``BaseRef``)."""

    @classmethod
    def whole(cls, unit: str, tensors: dict[str, torch.Tensor], values: dict[str, dict[str, Any]] | None = None) -> StagedUnit:
        """A unit of whole tensors by key (one process holds all of it)."""
        return cls(unit, [Piece.whole(key, t) for key, t in tensors.items()], values or {})


@dataclass
class StagedSnapshot:
    """One rank's share of a snapshot. Everything but ``units`` and the encoded state is the
    same on every rank."""

    step: int
    parent: int | None
    save_index: int
    policy: str
    layout: dict[str, Any]
    units: Iterable[StagedUnit]
    """Iterated once, in order: a generator stages one unit at a time (bounded memory)."""
    composite: dict[str, int]
    global_doc: Any
    """The leader's shared global state and its own RNG and extras, encoded (``codec.encode``,
    so it is a copy taken at staging time, or by the writer: ``encode``); None on other ranks."""
    global_tensors: dict[str, torch.Tensor] | None
    rank_doc: Any = None
    """Ranks >= 1: their own RNG states and extras, encoded."""
    rank_tensors: dict[str, torch.Tensor] | None = None
    rank_states: dict[int, tuple[Any, dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Other ranks' own states, encoded, that this rank writes for them: an import of a checkpoint
    of several processes, written by one (``outputs/run.RunSink``)."""
    world_size: int = 1
    provider: str = "local"
    notes: dict[str, Any] = field(default_factory=dict)
    decision: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] | None = None
    """The base model directory frozen tensors are kept from (``BaseDir``), if any."""
    holds: list[str] | None = None
    """The units this rank holds (a pipeline stage's); None: every unit of ``layout``."""
    error: BaseException | None = None
    """A failure met while staging on this rank: persisting reports it to the other ranks (so
    the save fails everywhere, promptly) instead of writing."""
    round: str | None = None
    """The coordinator round its messages are tagged with, drawn where the save was made (the
    training thread, in the same order on every rank); None: ``persist`` draws one."""
    turn: InTurn = field(default_factory=lambda: InTurn())
    """Its place behind the save before it, while that one is still in flight (``InTurn``)."""
    encode: Callable[[], tuple[Any, Any, Any, Any]] | None = None
    """Where the encoded state is left to the writer (``encoded``): what encodes it, as
    ``(global_doc, global_tensors, rank_doc, rank_tensors)``."""

    def encoded(self) -> None:
        """Encode the state now if it was left to the writer (``encode``, called once): a
        synchronous save of one process encodes it once its units are written, so that its
        CPU runs while their bytes go to the disk rather than before they start (bench/RESULTS.md,
        issue 33, session 51). What it raises fails the save, nothing committed."""
        encode, self.encode = self.encode, None
        if encode is not None:
            self.global_doc, self.global_tensors, self.rank_doc, self.rank_tensors = encode()

    def encoded_now(self, keep_failure: bool) -> StagedSnapshot:
        """This share with its state encoded now, at staging time (a copy: ``encoded``). A
        TailorError is raised unless ``keep_failure`` (one process: refused before anything is
        written); with it (several ranks), kept as ``error``: the save must fail on every rank,
        and persisting reports it."""
        try:
            self.encoded()
        except TailorError as err:
            if not keep_failure:
                raise
            self.error = err
        return self


@dataclass(eq=False)
class InTurn:
    """A snapshot's place among the async saves in flight (at most two: ``AsyncStager``). The
    next save is staged, written and sent while this one finishes, but what the ranks must do in
    one order stays in order: the courier's exchanges (one gloo group: the next save's starts once
    this one's returned, ``exchange_turn``) and the commits (the next save commits only once this
    one has ended, committed, with what follows a commit done: retention; a save staged behind
    one that was not committed is not committed either, ``parent_committed``). A synchronous save
    has no save before it: nothing to wait for."""

    step: int | None = None
    before: InTurn | None = None
    """The save in flight when this one was staged (dropped once this one ended)."""
    exchanged: threading.Event = field(default_factory=threading.Event)
    """Set once this save's courier exchange returned (or the save ended without one)."""
    ended: threading.Event = field(default_factory=threading.Event)
    committed: bool = False
    """Whether its persist committed the snapshot (set before ``ended``)."""

    def exchange_turn(self) -> None:
        """Wait until the save before has finished its courier exchange."""
        if self.before is not None:
            self.before.exchanged.wait()

    def parent_committed(self) -> None:
        """Wait until the save before has ended; TailorError when it was not committed (this
        one, extending it, must not be either)."""
        before = self.before
        if before is None:
            return
        before.ended.wait()
        if not before.committed:
            raise TailorError(f"step {self.step} was not committed: the save it extends, step {before.step}, "
                              "failed before it")

    def end(self, committed: bool) -> None:
        """This save ended (``committed``: its snapshot was): the next one may go on."""
        self.committed = committed
        self.before = None
        self.exchanged.set()
        self.ended.set()


@dataclass(frozen=True)
class PersistResult:
    path: Path
    bytes: int
    """Bytes of the whole snapshot, every rank's files and the manifest."""
    seconds: float
    unit_bytes: dict[str, int]
    """Bytes this rank wrote per unit."""
    rank_bytes: int
    """Bytes this rank wrote in all."""
    unconfirmed: str | None = None
    """Set when the snapshot was committed but what follows its commit failed: ``latest`` not
    replaced, or the durability of its name or of ``latest``'s not confirmed (the message:
    ``store.commit.describe_unconfirmed``). The save counts as committed all the same."""
    spare: tuple[int, ...] = ()
    """Composites the first tier's retention after this save spares beside its newest ``keep``,
    alike on every node of a node-local tier (rank 0's word: ``node_commit``)."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ChunkPart(_Message):
    """A chunk this rank wrote: its corner and extent in the global tensor, and the checksum
    of its bytes (the leader adds the file's position in the unit's index)."""

    offsets: list[int]
    shape: list[int]
    xxh3_64: str
    page_bytes: int | None = None
    pages: list[str] | None = None
    cover_xxh3: str | None = None


class TensorPart(_Message):
    key: str
    dtype: str
    shape: list[int]
    """The global shape."""
    chunks: list[ChunkPart]


class UnitPart(_Message):
    """What this rank wrote of one unit: its file, its tensors' chunks, its non-tensor values."""

    file: FileEntry | None
    """None where this rank wrote no tensor of the unit (all it holds of it is kept)."""
    tensors: list[TensorPart]
    values: dict[str, dict[str, Any]] = {}
    kept: dict[str, int] = {}
    base: dict[str, dict[str, Any]] = {}


class RankPart(_Message):
    """One rank's report of its part of a snapshot."""

    units: dict[str, UnitPart] = {}
    files: list[FileEntry] = []
    """Its global-state files."""
    unit_bytes: dict[str, int] = {}
    holds: list[str] = []
    """The units of this rank's layout (it holds its pieces of them): the leader commits only a
    snapshot whose composite names every unit some rank holds."""

    @property
    def bytes(self) -> int:
        """Bytes this rank wrote in all."""
        return sum(self.unit_bytes.values()) + sum(f.bytes for f in self.files)

    def to_message(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_message(cls, message: Any) -> RankPart:
        return cls.model_validate(message, strict=False)
