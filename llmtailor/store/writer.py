"""Writing a snapshot: staged state in, one committed directory out.

Staging (``store/staged.py``: what to write) is separate from persisting (``persist``: writing
and committing it). A synchronous save stages references to the live tensors and persists at
once, one unit in memory at a time (small units wait for their pack file: ``_Pack``); an async save stages copies in reusable host buffers and
persists them on a background thread (``llmtailor/async_stager.py``). Both go through ``persist``.

The commit protocol, for any number of ranks (``llmtailor.distributed.coordinator`` carries the
messages; one process is a world of one) and any storage (``store.storage``: a local directory
or an object store, each rank writing straight to it, so no filesystem is shared between nodes):

1. the leader (rank 0) opens the snapshot's staging place (``store.commit.SnapshotCommit``: a
   private directory under ``.tmp/`` locally; on an object store the final prefix itself) and
   announces it;
2. every rank writes its part there — its pieces of the units it holds (a large unit's in a file
   of its own, its small units' together in a pack file), its own global state
   (RNG, user extras), the leader also the shared global state — makes every file durable
   (fsyncs on helper threads while the next is written; an upload completed), and reports the
   file entries and checksums, or its failure (the leader's own files stay in flight until
   its commit);
3. once every rank has reported success (and the async save before this one, if still in
   flight, has committed: ``staged.InTurn``), the leader writes the unit indexes (one file, a
   line per unit), then the manifest last, only if absent (on an object store that write is
   the commit, once its own files and the indexes are uploaded), commits the staging place
   (locally: the manifest, the staged directories and ``latest``'s new file fsynced together,
   beside its own files' and the indexes' fsyncs still in flight; once all are durable, atomic
   rename into ``snapshots/``, fsync), replaces the ``latest``
   pointer atomically (its rename after the snapshot's is durable), and announces the outcome.

A failure on any rank, or a rank that does not report in time, makes the save raise on every
rank; the leader removes what was staged, and every earlier snapshot and the previous composite
stay as they were. The leader's word settles the save: a rank that gives up waiting for it
claims the save's gate first, and the leader passes that gate just before it commits
(``_gated``, ``_outcome``). A crash at any instant has the same effect (what a crash leaves is never
read: no manifest, no snapshot; the next writer or ``gc`` removes it).
"""

from __future__ import annotations

import collections
import errno
import functools
import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import ValidationError

from llmtailor.constants import (
    GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, MANIFEST_FILE, PACK_FILE_BYTES, PACK_UNIT_BYTES, SCHEMA_VERSION,
    pack_filename, rank_state_files, unit_filename,
)
from llmtailor.distributed.coordinator import CoordinationError, Coordinator, LocalCoordinator, gate_tag
from llmtailor.errors import StorageError, TailorError, describe_os_error, describe_validation
from llmtailor.layouts import name_units
from llmtailor.store import Progress, dtypes
from llmtailor.store.checked import write_bytes_to
from llmtailor.store.commit import SnapshotCommit, StagedFiles
from llmtailor.store.keys import piece_key
from llmtailor.store.manifest import FileEntry, Manifest, UnitEntry, UnitRef, dtype_name, first_overlap, parse_manifest
from llmtailor.store.run import Run
from llmtailor.store.staged import ChunkPart, PersistResult, RankPart, StagedSnapshot, StagedUnit, TensorPart, UnitPart
from llmtailor.store.tensor_files import checksum, stream_tensors

if TYPE_CHECKING:
    import torch


def counting(progress: Progress | None, total: int) -> Callable[[str, int], None]:
    """Adapt a ``progress(unit, done, total)`` callback (the CLI's bars) to ``persist``'s
    ``on_unit(unit, bytes)``."""
    done = 0

    def on_unit(unit: str, _bytes: int) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(unit, done, total)

    return on_unit


def persist(
    run: Run,
    staged: StagedSnapshot,
    on_unit: Callable[[str, int], None] | None = None,
    coordinator: Coordinator | None = None,
    prepare: Callable[[], None] | None = None,
    confirm: Callable[[], None] | None = None,
) -> PersistResult:
    """Write this rank's share of ``staged`` into ``run`` and commit the snapshot with the other
    ranks (module docstring). Collective: every rank calls it for the same snapshot. The
    leader calls ``prepare()`` (taking the run's writer lock, say) before anything is written,
    and ``confirm()`` (that it still holds the lock) just before the manifest; if either
    raises, the save fails on every rank."""
    coord = coordinator or LocalCoordinator()
    start = time.perf_counter()
    round_ = staged.round or coord.new_round()

    def begin() -> str:
        try:
            if prepare is not None:
                prepare()
            return SnapshotCommit.begin(run, staged.step, staged.world_size).staging
        except BaseException as err:
            raise friendly(err, run, staged.step, written=False) from None

    snapshot = SnapshotCommit(run, staged.step, coord.broadcast(f"{round_}/open", begin if coord.is_leader else None))
    if coord.is_leader:
        # The leader's own files stay in flight (their fsyncs running) until its commit: the
        # unit indexes join them, and the commit waits for them all before it commits anything.
        with snapshot.files() as files, coord.working(lane=round_):  # its round's: the next save's is no sign of it
            part = attempt_part(snapshot, staged, coord.rank, on_unit, files)

            def gather() -> list[RankPart]:
                # The leader keeps its own part as it is (it reports only success or failure): a
                # round trip through a message (a dump and a validation of every chunk) would check
                # nothing that the validation of the merged indexes does not check again.
                own = {} if isinstance(part, RankPart) else part
                reports = coord.gather(f"{round_}/parts", own) or []
                return [part if rank == coord.rank else RankPart.from_message(m) for rank, m in enumerate(reports)]

            outcome = coord.broadcast(f"{round_}/outcome", functools.partial(_commit, snapshot, staged, gather, confirm, files, _gated(coord, round_, staged.step)))
    else:
        with coord.working(lane=round_):  # the others wait on while its writes go on (a large part, a slow store)
            part = attempt_part(snapshot, staged, coord.rank, on_unit)
            coord.gather(f"{round_}/parts", part.to_message() if isinstance(part, RankPart) else part)  # re-raises this rank's own failure, once reported
            outcome = _outcome(coord, round_, staged.step)
    assert isinstance(part, RankPart)  # a failed part was raised by the gather
    # The manifest just committed, as written: the run's catalog keeps it, so the lineage and
    # the next save read no manifest back (a HEAD and a GET on an object store); the leader kept
    # the one it built and validated (``_commit``), the others parse what it sent.
    if not coord.is_leader:
        run.remember(parse_manifest(outcome["manifest"].encode(), run.where(staged.step, MANIFEST_FILE), staged.step))
    return PersistResult(
        path=run.snapshot_dir(staged.step) if run.is_local else run.where(staged.step),
        bytes=outcome["bytes"],
        seconds=time.perf_counter() - start,
        unit_bytes=part.unit_bytes,
        rank_bytes=part.bytes,
        unconfirmed=outcome["unconfirmed"],
    )


def _gated(coord: Coordinator, round_: str, step: int) -> Callable[[], None] | None:
    """The save's gate (``Coordinator.claim_gate``), passed by rank 0 just before its commit
    publishes the snapshot, everything else durable (``SnapshotCommit.commit``'s ``publish``),
    unless a rank gave up waiting for its outcome first (``_outcome``): then it raises, and
    nothing is committed. A world of one has none."""
    if coord.world_size == 1:
        return None
    return functools.partial(coord.claim_gate, gate_tag(round_), lambda rank: CoordinationError(
        f"step {step} was not committed: rank {rank} gave up waiting for rank 0's commit first"))


def _outcome(coord: Coordinator, round_: str, step: int) -> dict[str, Any]:
    """A follower's wait for rank 0's outcome, on while rank 0's commit advances. Rank 0 silent
    for twice the timeout is given up on: this rank claims the save's gate first (``_gated``), so
    rank 0 never commits it, and raises; where rank 0 passed its gate first, it commits (or did):
    this rank waits on for its word, once more, and says the step may be committed without it."""
    tag = f"{round_}/outcome"
    try:
        return coord.broadcast(tag, None, patience=2.0)
    except CoordinationError as silent:
        if _announced(coord, tag, silent):
            return coord.broadcast(tag, None)  # its word: an outcome announced since this rank stopped waiting, or its failure
        if coord.give_up_gate(gate_tag(round_)):
            raise CoordinationError(f"{silent}; rank {coord.rank} gave up on rank 0's commit of step {step}, which "
                                    "never commits it") from None
    try:  # rank 0 passed its gate: the snapshot is published unless that commit fails
        return coord.broadcast(tag, None, patience=2.0)
    except CoordinationError as late:
        if _announced(coord, tag, late):
            return coord.broadcast(tag, None)
        raise CoordinationError(f"{late}; rank 0 passed the last step before committing step {step}: it is committed "
                                "unless that commit failed, and rank 0 says which") from None


def _announced(coord: Coordinator, tag: str, silent: CoordinationError) -> bool:
    """Whether rank 0 announced ``tag`` (its failure, which ``silent`` said; or its outcome, just
    after this rank stopped waiting for it); ``silent`` raised where the store cannot be reached
    (gone with rank 0's process)."""
    try:
        return coord.poll(tag)[0]
    except CoordinationError:
        raise silent from None


def _commit(snapshot: SnapshotCommit, staged: StagedSnapshot, gather: Callable[[], list[RankPart]],
            confirm: Callable[[], None] | None, files: StagedFiles,
            publish: Callable[[], None] | None = None) -> dict[str, Any]:
    """The leader's step 3 (module docstring), once ``gather()`` has every rank's part (it
    raises when any rank failed): the unit indexes, written into ``files`` (the leader's own
    files' batch, still in flight), then the manifest and the commit, which drains that batch
    before it commits anything (``SnapshotCommit.commit``'s ``pending``), and passes ``publish``
    (the save's gate) just before it publishes; what was staged is removed on any failure. Returns the outcome the leader announces,
    once the run's catalog keeps the manifest committed, as built (its bytes are its dump)."""
    run = snapshot.run
    try:
        with snapshot.abandoned_on_failure():
            parts = gather()
            staged.turn.parent_committed()  # an async save in flight before this one: committed first
            indexes, manifest = index_files(staged, parts)
            write_files(snapshot, indexes, files)
            # The manifest is written last, only if absent: without one there is no snapshot. The
            # leader's files and the indexes are durable before it is committed (``pending``:
            # locally their fsyncs and the manifest's run side by side, one wait on the disk).
            encoded = manifest.dumps().encode()
            unconfirmed = snapshot.commit(encoded, confirm, latest=True, pending=files,  # ``latest`` replaced once committed
                                            parent=manifest.parent, publish=publish)
    except BaseException as err:
        raise friendly(err, run, staged.step) from None
    run.remember(manifest)
    return {"bytes": manifest.total_bytes() + len(encoded), "unconfirmed": unconfirmed, "manifest": encoded.decode()}


def attempt_part(snapshot: SnapshotCommit, staged: StagedSnapshot, rank: int,
                 on_unit: Callable[[str, int], None] | None, files: StagedFiles | None = None) -> RankPart | BaseException:
    """This rank's part written (``write_part``), or what failed (a staging error included), as
    the error to report (``friendly``): reported to the leader, never raised here."""
    try:
        if staged.error is not None:
            raise staged.error
        return write_part(snapshot, staged, rank, on_unit, files)
    except BaseException as err:
        return friendly(err, snapshot.run, staged.step)


def write_part(snapshot: SnapshotCommit, staged: StagedSnapshot, rank: int,
                on_unit: Callable[[str, int], None] | None, files: StagedFiles | None = None) -> RankPart:
    """Write this rank's files; return its report for the leader's indexes and manifest: per
    unit, its file entry, its tensors' chunks and non-tensor values; the files of its global
    state; its bytes per unit. A unit of fewer than ``PACK_UNIT_BYTES`` goes into this rank's
    pack file (``_Pack``), a larger one into a file of its own. ``files``: the batch to write
    them into, left in flight (the leader's: its commit drains it); else every file is durable
    when this returns, before the part is reported (the commit depends on it). The leader's
    own part (``files`` given) is never sent: its chunks are not built as messages (``_Chunk``)."""
    own = files is not None
    # Locally each file's fsync runs on helper threads while the next file is written.
    with (nullcontext(files) if files is not None else snapshot.files()) as create:
        units: dict[str, UnitPart] = {}
        files: list[FileEntry] = []
        unit_bytes: dict[str, int] = {}
        pack = _Pack(create, rank)

        def record(written: list[_Written]) -> None:
            for done in written:
                units[done.unit.unit] = _unit_part(done, own)
                unit_bytes[done.unit.unit] = done.bytes
                if on_unit:
                    on_unit(done.unit.unit, done.bytes)

        for staged_unit in staged.units:
            tensors = _unit_tensors(staged_unit)
            if 0 < _data_bytes(tensors) < PACK_UNIT_BYTES:
                record(pack.add(staged_unit, tensors))
                continue
            relpath = unit_filename(staged_unit.unit, rank, staged.world_size)
            pages: dict[str, dict[str, Any]] = {}
            file, sums = stream_tensors(create(relpath), tensors, relpath, pages=pages) if tensors else (None, {})
            record([_Written(staged_unit, list(tensors), file, sums, pages, file.bytes if file is not None else 0)])
        record(pack.flush())
        staged.encoded()
        if staged.global_doc is not None:
            files.append(stream_tensors(create(GLOBAL_TENSORS), staged.global_tensors or {}, GLOBAL_TENSORS)[0])
            files.append(write_bytes_to(create(GLOBAL_JSON), json.dumps(staged.global_doc).encode(), GLOBAL_JSON))
        own = {rank: (staged.rank_doc, staged.rank_tensors)} if staged.rank_doc is not None else {}
        for state_rank, (doc, tensors) in {**own, **staged.rank_states}.items():
            doc_path, tensor_path = rank_state_files(state_rank)
            files.append(stream_tensors(create(tensor_path), tensors or {}, tensor_path)[0])
            files.append(write_bytes_to(create(doc_path), json.dumps(doc).encode(), doc_path))
    return RankPart(units=units, files=files, unit_bytes=unit_bytes, holds=list(staged.layout["units"]) if staged.holds is None else list(staged.holds))


def _unit_tensors(staged_unit: StagedUnit) -> dict[str, torch.Tensor]:
    """The unit's pieces by their key in a file (``piece_key``), in the order of its pieces."""
    tensors = {piece_key(p.key, p.offsets, p.is_whole): p.tensor.detach().contiguous() for p in staged_unit.pieces}
    if len(tensors) != len(staged_unit.pieces):
        raise TailorError(f"unit {staged_unit.unit!r}: two pieces of one tensor at the same offsets")
    return tensors


def _data_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class _Written:
    """A unit this rank has written: its file (its own, or a pack file), the checksums and page
    checksums of its pieces (by key in that file), and its share of the file's bytes."""

    unit: StagedUnit
    keys: list[str]
    """Its pieces' keys in the file, in the order of ``unit.pieces``."""
    file: FileEntry | None
    sums: dict[str, str]
    pages: dict[str, dict[str, Any]]
    bytes: int


class _Chunk(NamedTuple):
    """A chunk of the leader's own part, as ``index_files`` reads it (``ChunkPart``'s fields)."""

    offsets: list[int]
    shape: list[int]
    xxh3_64: str
    cover_xxh3: str | None = None
    page_bytes: int | None = None
    pages: list[str] | None = None


class _Tensor(NamedTuple):
    """A tensor of the leader's own part, as ``index_files`` reads it (``TensorPart``'s fields)."""

    key: str
    dtype: str
    shape: list[int]
    chunks: list[_Chunk]


def _unit_part(written: _Written, own: bool = False) -> UnitPart:
    """A written unit as this rank reports it: its file and its own chunks (the leader validates
    the merged entries, coverage included). Its chunks and tensors are built unvalidated: the
    report is validated where it arrives (``RankPart.from_message``), and a LoRA's thousands of
    pieces made validating them twice a fixed cost of every save. The leader's ``own`` part is
    never sent: its chunks are validated once, in the merged indexes, and built as plain tuples
    of the same fields (``_Chunk``, ``_Tensor``), not as models: pydantic's ``model_construct``,
    twice per chunk, was a fixed cost of every save too (bench/RESULTS.md, issue 33, session 47)."""
    chunk_of, tensor_of = (_Chunk, _Tensor) if own else (ChunkPart.model_construct, TensorPart.model_construct)
    staged_unit = written.unit
    entries = [tensor_of(key=p.key, dtype=dtype_name(p.tensor.dtype), shape=list(p.global_shape),
                         chunks=[chunk_of(offsets=list(p.offsets), shape=list(p.tensor.shape), xxh3_64=written.sums[key],
                                          cover_xxh3=p.cover_xxh3, **written.pages.get(key, {}))])
               for p, key in zip(staged_unit.pieces, written.keys)]
    if own:  # tuples, not models: never dumped as a message (``persist`` keeps the leader's part as it is)
        return UnitPart.model_construct(file=written.file, tensors=entries, values=staged_unit.values,
                                        kept=staged_unit.kept, base=staged_unit.base)
    return UnitPart(file=written.file, tensors=entries, values=staged_unit.values, kept=staged_unit.kept, base=staged_unit.base)


class _Pack:
    """A rank's small units, written together into one pack file (``pack_filename``): one file
    made durable, not one per unit. Units wait (their tensors referenced: live tensors in a
    synchronous save, staged copies in an async one) until ``flush``, or until they reach
    ``PACK_FILE_BYTES``; each unit's index then names the pack file, and reads its own tensors'
    ranges of it (``UnitReader.read``). A tensor key is unique across units (a parameter
    belongs to one unit), so a pack file holds each under its own key."""

    def __init__(self, create: Callable[[str], Any], rank: int):
        self.create, self.rank, self.number = create, rank, 0
        self.waiting: list[tuple[StagedUnit, dict[str, torch.Tensor]]] = []
        self.bytes = 0

    def add(self, staged_unit: StagedUnit, tensors: dict[str, torch.Tensor]) -> list[_Written]:
        self.waiting.append((staged_unit, tensors))
        self.bytes += _data_bytes(tensors)
        return self.flush() if self.bytes >= PACK_FILE_BYTES else []

    def flush(self) -> list[_Written]:
        """Write the waiting units' pack file; each unit's share of its bytes is its tensors'
        bytes, the first unit's also the header (so the shares add up to the file)."""
        if not self.waiting:
            return []
        merged: dict[str, torch.Tensor] = {}
        for staged_unit, tensors in self.waiting:
            clash = merged.keys() & tensors.keys()
            if clash:
                raise TailorError(f"unit {staged_unit.unit!r} holds {sorted(clash)[0]!r}, which another unit holds too")
            merged.update(tensors)
        relpath = pack_filename(self.rank, self.number)
        pages: dict[str, dict[str, Any]] = {}
        groups = {key: number for number, (_, tensors) in enumerate(self.waiting) for key in tensors}
        file, sums = stream_tensors(self.create(relpath), merged, relpath, pages=pages, groups=groups)
        header = file.bytes - self.bytes
        written = [_Written(staged_unit, list(tensors), file, sums, pages, _data_bytes(tensors) + (header if i == 0 else 0))
                   for i, (staged_unit, tensors) in enumerate(self.waiting)]
        self.waiting, self.bytes, self.number = [], 0, self.number + 1
        return written


def write_files(snapshot: SnapshotCommit, files: dict[str, bytes], into: StagedFiles | None = None) -> None:
    """Write small files (the unit indexes) into the staged snapshot, durable on return; or
    into the batch ``into``, durable once it is drained."""
    with (nullcontext(into) if into is not None else snapshot.files()) as create:  # durable before the manifest names them
        for relpath, data in files.items():
            write_bytes_to(create(relpath), data, relpath)


def index_files(staged: StagedSnapshot, parts: list[RankPart]) -> tuple[dict[str, bytes], Manifest]:
    """The units' indexes from every rank's part, one line each of one file (``INDEXES_FILE``:
    relpath -> its bytes), and the manifest naming them (its ``notes`` are ``staged.notes``).
    The chunks of a tensor from all ranks are checked for agreement on dtype and global shape;
    the index's own validation then checks that they cover the tensor. Nothing is written.

    Each index is built as it is written (the compact form of schema 6: ``UnitEntry.dumps``),
    validated as it is (unless valid by construction: ``_built_whole``) and encoded as it is: no
    chunk is dumped out of its report's model and no index out of its own (a fixed cost per chunk
    of every save: bench/RESULTS.md, issue 33)."""
    merged: dict[str, dict[str, Any]] = {}
    boxes: dict[tuple[str, str], list[tuple[int, list[int], list[int]]]] = {}  # (unit, tensor key) -> each chunk's (rank, offsets, shape)
    files: list[FileEntry] = []
    for rank, part in enumerate(parts):
        files += part.files
        for unit, entry in part.units.items():
            target = merged.setdefault(unit, {"files": [], "tensors": {}, "values": {}, "kept": {}, "base": {}})
            target["kept"].update(entry.kept)
            target["base"].update(entry.base)
            position = len(target["files"])
            if entry.file is not None:
                target["files"].append({"path": entry.file.path, "bytes": entry.file.bytes, "xxh3_64": entry.file.xxh3_64})
            for tensor in entry.tensors:
                chunks = [_chunk_line(chunk, position, tensor.shape) for chunk in tensor.chunks]
                boxes.setdefault((unit, tensor.key), []).extend((rank, c.offsets, c.shape) for c in tensor.chunks)
                held = target["tensors"].get(tensor.key)
                if held is None:
                    target["tensors"][tensor.key] = {"key": tensor.key, "dtype": tensor.dtype, "shape": tensor.shape,
                                                     "chunks": chunks}
                elif (held["dtype"], held["shape"]) != (tensor.dtype, tensor.shape):
                    raise TailorError(
                        f"unit {unit!r}: rank {rank} has {tensor.key} as {tensor.dtype} {tensor.shape}, "
                        f"another rank as {held['dtype']} {held['shape']}"
                    )
                else:
                    held["chunks"] += chunks
            for name, plain in entry.values.items():
                target["values"].setdefault(name, {}).update(plain)
    _check_whole(staged, parts, set(merged))
    refs, data = _index_lines(staged, merged, boxes, parts)
    indexes = {INDEXES_FILE: data} if data else {}
    if data:  # written by the caller (``write_files``), durable before the manifest names it
        files.append(FileEntry(path=INDEXES_FILE, bytes=len(data), xxh3_64=checksum(data)))
    return indexes, Manifest(
        schema_version=SCHEMA_VERSION,
        step=staged.step,
        parent=staged.parent,
        save_index=staged.save_index,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        world_size=staged.world_size,
        provider=staged.provider,
        notes=staged.notes,
        policy=staged.policy,
        decision=staged.decision,
        layout=staged.layout,
        units=refs,
        composite=staged.composite,
        files=files,
        base=staged.base,
    )


def _chunk_line(chunk: ChunkPart | _Chunk, position: int, shape: list[int]) -> dict[str, Any]:
    """A reported chunk as its index line holds it (``Chunk``'s compact form, in its field
    order): its file's position unless the first, its box unless the whole tensor of ``shape``,
    its page checksums if any, its sampled checksum if any."""
    line: dict[str, Any] = {"file": position} if position else {}
    if chunk.shape != shape or any(chunk.offsets):
        line["offsets"], line["shape"] = chunk.offsets, chunk.shape
    line["xxh3_64"] = chunk.xxh3_64
    if chunk.page_bytes is not None or chunk.pages is not None:  # one without the other: refused by validation
        line["page_bytes"], line["pages"] = chunk.page_bytes, chunk.pages
    if chunk.cover_xxh3 is not None:
        line["cover_xxh3"] = chunk.cover_xxh3
    return line


def _index_lines(staged: StagedSnapshot, merged: dict[str, dict[str, Any]],
                 boxes: dict[tuple[str, str], list[tuple[int, list[int], list[int]]]],
                 parts: list[RankPart]) -> tuple[dict[str, UnitRef], bytes]:
    """Each unit's manifest line and the bytes of ``INDEXES_FILE``: the units' indexes as its
    lines, in layout order."""
    # The units the leader's own part alone holds tensors of (its own tensors are ``_Tensor``s, never sent).
    entries = [(unit, entry) for part in parts for unit, entry in part.units.items()]
    writers = collections.Counter(unit for unit, _ in entries)
    own = {unit for unit, entry in entries if writers[unit] == 1 and entry.tensors and all(isinstance(t, _Tensor) for t in entry.tensors)}
    refs, lines = {}, []
    at = 0
    for unit in [u for u in staged.composite if u in merged]:  # layout order
        index = _unit_index(staged.step, unit, merged[unit], boxes, validate=unit not in own or not _built_whole(merged[unit]))
        line = (json.dumps(index, separators=(",", ":")) + "\n").encode()
        lines.append(line)
        # A unit's bytes are its share of its files (a pack file is shared): they add up to the snapshot's.
        refs[unit] = UnitRef(index=FileEntry(path=INDEXES_FILE, bytes=len(line), xxh3_64=checksum(line)), index_at=at,
                             bytes=sum(part.unit_bytes.get(unit, 0) for part in parts), kept=sorted(set(index["kept"].values())))
        at += len(line)
    return refs, b"".join(lines)


def _unit_index(step: int, unit: str, content: dict[str, Any],
                boxes: dict[tuple[str, str], list[tuple[int, list[int], list[int]]]], validate: bool = True) -> dict[str, Any]:
    """The index of ``unit`` from the ranks' merged ``content``, as written, once validated
    (``UnitEntry``: what a reader's validation of the line accepts); a TailorError in one line if
    two ranks wrote the same elements of a tensor or the index is otherwise invalid (never a
    raw ValidationError). ``validate=False``: an index valid by construction (``_built_whole``),
    validated where it is read, not here."""
    for key in content["tensors"]:
        _check_written_once(step, unit, key, boxes[unit, key])
    index = {"unit": unit, "step": step, "files": content["files"], "tensors": list(content["tensors"].values()),
             "values": content["values"], "kept": content["kept"], "base": content["base"]}
    if not validate:
        return index
    try:
        UnitEntry.model_validate(index)
    except ValidationError as err:
        raise TailorError(f"step {step} was not committed: the index of unit {unit!r} the ranks reported is invalid: "
                          f"{describe_validation(err)}") from None
    return index


def _built_whole(content: dict[str, Any]) -> bool:
    """Whether a unit's merged index, built by this process from its own part alone, is valid by
    construction, so that validating it as a ``UnitEntry`` at save checks nothing a reader's
    validation of the written line does not (~0.7 ms of a small save's main thread, per save:
    bench/RESULTS.md, issue 33, session 49): the files it wrote and listed, every tensor of a
    known dtype in one chunk that is the whole tensor in the first file, its checksums and page
    checksums its own hexdigests (``stream_tensors``), its optimizer values JSON already
    (``codec.plain_value``) under names and keys that are strings (JSON would turn another key
    into one), nothing kept from elsewhere (whose steps and keys validation checks)."""
    if not content["files"] or content["kept"] or content["base"]:
        return False
    if not all(type(name) is str and type(plain) is dict and all(type(key) is str for key in plain)
               for name, plain in content["values"].items()):
        return False
    for tensor in content["tensors"].values():
        if tensor["dtype"] not in dtypes.NAMES or len(tensor["chunks"]) != 1:
            return False
        chunk = tensor["chunks"][0]
        if "file" in chunk or "offsets" in chunk or ("pages" in chunk and (chunk["pages"] is None or chunk["page_bytes"] is None)):
            return False
    return True


def _check_written_once(step: int, unit: str, key: str, chunks: list[tuple[int, list[int], list[int]]]) -> None:
    """Refuse a tensor two of whose chunks share elements (two ranks holding the same shard,
    each writing it), naming the tensor, the ranks and the chunks."""
    if len(chunks) < 2:  # a single-process save's every tensor
        return
    boxes = [(offsets, shape) for _, offsets, shape in chunks]
    pair = first_overlap(boxes)
    if pair is None:
        return
    (a, b) = pair
    raise TailorError(
        f"step {step} was not committed: tensor {key!r} of unit {unit!r} was written twice in part: rank "
        f"{chunks[a][0]} wrote its chunk at {boxes[a][0]} of shape {boxes[a][1]}, rank {chunks[b][0]} its chunk at "
        f"{boxes[b][0]} of shape {boxes[b][1]} (the ranks hold copies of one shard, and each wrote it)"
    )


def _check_whole(staged: StagedSnapshot, parts: list[RankPart], written: set[str]) -> None:
    """Refuse to commit a snapshot that lacks part of the model: its composite must name exactly
    the units of its layout, every unit some rank holds or wrote, and this step for every unit
    some rank wrote; every unit of its layout some rank must hold (the ranks' units together are
    the layout: pipeline stages), and every unit it names at this step some rank must have written."""
    layout, composite = list(staged.layout["units"]), staged.composite
    problems = []
    unnamed = [u for u in layout if u not in composite]
    if unnamed:
        problems.append(f"its composite names no version of units [{name_units(unnamed)}] that its layout holds")
    foreign = [u for u in composite if u not in layout]
    if foreign:
        problems.append(f"its composite names units [{name_units(foreign)}] that its layout lacks")
    unheld = [[u for u in part.holds if u not in composite] for part in parts]
    problems += [f"rank(s) {ranks} hold units [{name_units(units)}] that its composite does not name" for units, ranks in _by_rank(unheld)]
    stray = [[u for u in part.units if composite.get(u) != staged.step] for part in parts]
    problems += [f"rank(s) {ranks} wrote units [{name_units(units)}] that its composite does not name at this step"
                 for units, ranks in _by_rank(stray)]
    held = {u for part in parts for u in part.holds}
    orphans = [u for u in layout if u not in held]
    if orphans:
        problems.append(f"no rank holds units [{name_units(orphans)}] of its layout")
    missing = [u for u, step in composite.items() if step == staged.step and u not in written]
    if missing:
        problems.append(f"no rank wrote units [{name_units(missing)}]")
    if problems:
        raise TailorError(f"step {staged.step} was not committed, as it would lack part of the model: {'; '.join(problems)}")


def _by_rank(units_of_rank: list[list[str]]) -> list[tuple[list[str], list[int]]]:
    """The non-empty unit lists of ``units_of_rank`` (indexed by rank), each with the ranks that have it."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, units in enumerate(units_of_rank):
        if units:
            groups.setdefault(tuple(units), []).append(rank)
    return [(list(units), ranks) for units, ranks in groups.items()]


def friendly(err: BaseException, run: Run, step: int, written: bool = True) -> BaseException:
    """An OS error met while saving, as one TailorError naming the path and the reason (and
    what became of the save); any other error as it is."""
    if not isinstance(err, OSError) or isinstance(err, TailorError):  # a StorageError says it already
        return err
    aftermath = "the partial snapshot was removed" if written else f"step {step} was not saved"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(
            f"no space left on the device of {run.root} while saving step {step}; "
            f"{aftermath} and earlier snapshots are intact", err
        )
    return StorageError(
        f"{describe_os_error(err, run.root)} while saving step {step} to {run.root}; "
        f"{aftermath} and earlier snapshots are intact", err
    )

