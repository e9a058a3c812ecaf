"""A run's units, read: the unit indexes (checked against the manifest, cached, and merged with
the frozen tensors a version keeps from older snapshots or the base model directory) and the
tensors and values they name, each file checked against its checksum and each tensor against
the index's dtype and shape before it is used; and the global and per-rank state of a snapshot.
The run's catalog (``catalog.py``: manifests, composites) says which snapshot holds what.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from llmtailor.constants import GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, STATEFUL_KEY, is_pack, rank_state_files
from llmtailor.errors import DamagedFileError, IntegrityError, TailorError, UnsupportedLayoutError
from llmtailor.store.catalog import Catalog, Composite
from llmtailor.store.checked import (check_header, check_stored, check_stored_header, checked_landed, checked_parts,
                                     checked_tensors, fetch_stored_tensors, fetch_whole, fetch_whole_into, read_checked_tensors,
                                     read_recorded, read_stored, read_stored_parts)
from llmtailor.store.fetch import fetch
from llmtailor.store.tensor_files import checksum, decode_tensors
from llmtailor.store.manifest import Chunk, FileEntry, TensorEntry, UnitEntry, load_unit_entry
from llmtailor.store.storage import Storage, open_storage

if TYPE_CHECKING:
    import torch

_UNIT_CACHE = 512
"""Unit indexes kept in memory (each is small; a run can hold thousands). A restore of a
composite looks each unit's index up several times, stored and merged, with those of the
snapshots it keeps frozen tensors from: at 64 a 32-layer LoRA's working set (about 100) was
evicted before it was used again, and read and validated some 300 times a restore."""
_PACK_HEADERS = 8
"""Pack-file headers kept (``UnitReader.read``): a pack holds every small unit of a rank, so its
header is read and validated once for all of them, not once per unit."""
INDEXES_READ_WHOLE = 4 << 20
"""An ``INDEXES_FILE`` of at most this many bytes is read whole, once for all its units (one read,
one GET); a larger one (thousands of units or ranks) by each unit's line."""
_INDEXES_KEPT = 8
_STATE_KEPT = 64 << 20  # bytes of state tensors (RNG states, extras) kept for a second reader
TOGETHER_BYTES = 256 << 20
"""A pack file of at most this many bytes is read once for the several units of it a process
reads next (``UnitReader.reading_together``): its bytes are held until the last of them is read."""
TOGETHER_GAP = 32
"""... and only where the tensor data of it none of them wants (another rank's units) is at most
1/``TOGETHER_GAP`` of its data: bytes fetched that another rank fetches too, bounded."""


def _keep(lock: threading.Lock, cache: dict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """``cache[key] = value``, its oldest entries dropped first to keep at most ``limit``, under
    ``lock``: a reader's threads (a restore's pool, the units of a pack read together) share its
    caches, and two dropping the oldest at once dropped one entry twice (a KeyError) or met the
    other's insertion mid-look (a RuntimeError)."""
    with lock:
        if key not in cache:
            while len(cache) >= limit:
                del cache[next(iter(cache))]
        cache[key] = value


class UnitReader:
    """The unit read path of a run (module docstring), over its ``catalog``. Unit indexes and
    base-directory storages are cached; tensor bytes are read per unit."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self._units: dict[tuple, UnitEntry] = {}
        self._bases: dict[str, Storage] = {}
        self._state: tuple[tuple[int, str], bytes, bytearray] | None = None
        """The state files read last (``_state_files``)."""
        self._state_lock = threading.Lock()
        self._pack_headers: dict[tuple[str, str], tuple[int, dict[str, dict]]] = {}
        self._pack_sizes: dict[tuple[int, str], int] = {}
        """``(step, pack path)`` -> bytes of tensor data the pack holds (``_pack_data``), once known."""
        self.received: dict[str, bytes] = {}
        """Key -> bytes of small files (unit indexes, global state) another rank read for the
        restore under way and sent to this one (``store.shared_reads``): read from here, checked
        again, instead of from the store; emptied when that restore ends."""
        self._indexes: dict[int, bytes] = {}
        """Whole ``INDEXES_FILE``s read, by step (``_index_line``: each line checked as it is used)."""
        self._together: dict[tuple[str, str, int], _Together] = {}
        """Pack files read once for several units (``reading_together``), by where, checksum and size."""
        self._together_lock = threading.Lock()
        self._kept_lock = threading.Lock()
        """Held while an entry goes into ``_units``, ``_pack_headers`` or ``_indexes`` (``_keep``)."""
        self.arrived: dict[str, tuple[int, str, memoryview]] = {}
        """Key -> ``(size, xxh3, bytes)`` of whole files of the run this process received and
        checked against that size and checksum as they arrived, then wrote (a node-local tier's
        healing: ``tiers.healing.Receiving``), or, on the node that sent them, its own files as
        mapped while they were sent, once a read checked them (``unchecked``), kept for the restore
        that follows: a read of such a file whose entry records the same size and checksum takes
        these very bytes (``arrival``) instead of reading the file back and hashing it a second
        time. Emptied when that restore ends (``Tailor``), and for a snapshot forgotten (``forget``).
        The bytes must be private to this process (a fresh buffer, a copy-on-write mapping): the
        restore may hand them on as live tensors, which training then writes into; a shared
        mapping of a committed file would then change under its recorded checksum."""
        self.unchecked: dict[str, tuple[int, str, memoryview]] = {}
        """Key -> ``(size, xxh3, bytes)`` as ``arrived``, of this node's own files as mapped while a
        healing sent them (``tiers.healing._Sender``), not checked yet: the first read of one
        checks those bytes against that size and checksum (``arrival``) and takes them as
        ``arrived``'s where they match, else reads the file; one this restore never reads is
        never hashed. Emptied with ``arrived``."""
        self._unchecked_lock = threading.Lock()
        self._checking: dict[str, threading.Lock] = {}
        """Key -> held while a reader checks ``unchecked``'s bytes of it (``_checked``)."""
        self.coming: dict[str, Future[None]] = {}
        """Key -> the arrival of a file a healing still moves (``tiers.healing``: its stream runs
        beside the restore that follows): a read of it waits for it first (``arrival``), then
        takes what ``arrived`` holds of it, or reads it as any other file; where the healing
        failed, the wait raises its error (the file and the node that sent it, or the stream's
        failure naming the rank), so nothing that did not arrive whole and checked is read. On a
        node of several ranks, its other ranks' entries wait for the leader's word that it wrote
        the file, then check it where it lies and hand it over (``tiers.healing._Staged``: a
        ``result`` of its own). Emptied when that restore ends (``Tailor``)."""

    def forget(self, steps: list[int]) -> None:
        """Drop cached indexes of snapshots that were removed."""
        self._units = {k: v for k, v in self._units.items() if k[0] not in steps}
        self._indexes = {k: v for k, v in self._indexes.items() if k not in steps}
        if self._state is not None and self._state[0][0] in steps:
            self._state = None
        self._pack_headers.clear()
        self._pack_sizes = {k: v for k, v in self._pack_sizes.items() if k[0] not in steps}
        self.received.clear()
        prefixes = tuple(f"{self.catalog.snapshot_key(step)}/" for step in steps)
        with self._unchecked_lock:  # first: a check of one under way keeps nothing once it ends (``_checked``)
            for key in [key for key in self._checking if key.startswith(prefixes)]:
                del self._checking[key]
        for held in (self.arrived, self.unchecked):  # in place: a restore empties these dicts; a copy
            for key in [key for key in list(held) if key.startswith(prefixes)]:  # of the keys (others add
                held.pop(key, None)  # and take entries on the courier's and the readers' threads)

    def arrival(self, storage: Storage, key: str, entry: FileEntry) -> memoryview | None:
        """The bytes of the run's file ``key`` as they arrived here, checked then against the
        size and checksum ``entry`` records (``arrived``), or None (read it from ``storage``);
        a file still ``coming`` waited for first."""
        if storage is not self.catalog.storage:
            return None
        coming = self.coming.get(key)
        if coming is not None:
            coming.result()  # arrived (or it never will: the healing's error raised)
        kept = self.arrived.get(key)
        if kept is None and (key in self.unchecked or key in self._checking):  # checked here, or by a reader now
            kept = self._checked(key)
        return kept[2] if kept is not None and kept[:2] == (entry.bytes, entry.xxh3_64) else None

    def _checked(self, key: str) -> tuple[int, str, memoryview] | None:
        """``unchecked``'s bytes of ``key`` checked once, by whichever reader comes first (the
        others of that file wait for it; readers of other files do not): then ``arrived``'s
        where they match their size and checksum; None where they do not. A check that ends
        after the restore it served ended (``clear_arrivals``), or its snapshot was forgotten
        (``forget``), keeps nothing: the next restore would take its bytes unhashed, and this one
        may have handed them on as live tensors that training wrote into since."""
        with self._unchecked_lock:
            one = self._checking.setdefault(key, threading.Lock())
        with one:
            with self._unchecked_lock:
                sent = self.unchecked.pop(key, None)
            matches = False
            with contextlib.suppress(TailorError, OSError, ValueError):  # not checked: the file is read, and checked there
                matches = sent is not None and len(sent[2]) == sent[0] and checksum(sent[2]) == sent[1]
            with self._unchecked_lock:
                if matches and self._checking.get(key) is one:
                    self.arrived[key] = sent
            return self.arrived.get(key)

    def clear_arrivals(self) -> None:
        """What healings handed over (``arrived``, ``unchecked``) dropped: the restore it served
        ended. ``_checking`` first: a check under way keeps nothing once it ends (``_checked``)."""
        with self._unchecked_lock:
            self._checking.clear()
            self.unchecked.clear()
        self.arrived.clear()

    def entry(self, step: int, unit: str) -> UnitEntry:
        """The index of ``unit`` as saved at ``step`` (its files, tensors and chunks), checked
        against the manifest's checksum; frozen tensors it keeps from older snapshots or the
        base model directory merged in (their files tagged with their ``origin``). Reads small
        files only; no tensor byte."""
        key = (step, unit, "merged")
        found = self._units.get(key)
        if found is None:  # the entry made here is returned: another thread may drop it from the cache at once
            stored = self.stored_entry(step, unit)
            found = self._merged(stored) if stored.kept or stored.base else stored
            self._cache(key, found)
        return found

    def stored_entry(self, step: int, unit: str) -> UnitEntry:
        """The index file of ``unit`` at ``step`` as written (only what it holds itself)."""
        key = (step, unit)
        found = self._units.get(key)
        if found is None:
            manifest = self.catalog.manifest(step)
            ref = manifest.units.get(unit)
            if ref is None:
                raise IntegrityError(f"snapshot {step} holds no unit {unit!r} although a composite names it")
            where = f"{self.catalog.snapshot_key(step)}/{ref.index.path}"
            raw = self.read_small(where, ref.index) if ref.index_at is None else self._index_line(step, unit)
            found = load_unit_entry(bytes(raw), self.catalog.storage.where(where), unit, step)
            self._cache(key, found)
        return found

    def _index_line(self, step: int, unit: str) -> bytes:
        """The line of ``INDEXES_FILE`` that is ``unit``'s index at ``step`` (schema 6), checked
        against its size and checksum in the manifest: sliced from the whole file, read once for
        every unit of a snapshot, when small; else read by its range alone. Each line is checked
        alone, so damage to one unit's line leaves the others readable (``verify`` checks the
        whole file against its own checksum)."""
        manifest = self.catalog.manifest(step)
        ref, whole = manifest.units[unit], manifest.file_entry(INDEXES_FILE)
        where = f"{self.catalog.snapshot_key(step)}/{INDEXES_FILE}"
        start, end = ref.index_at, ref.index_at + ref.index.bytes
        arrived = self.arrival(self.catalog.storage, where, whole)
        if arrived is not None:
            line = bytes(arrived[start:end])
        elif whole.bytes <= INDEXES_READ_WHOLE:
            indexes = self._indexes.get(step)
            if indexes is None:
                indexes = bytes(self.received.get(where) or read_recorded(self.catalog.storage, where))
                _keep(self._kept_lock, self._indexes, step, indexes, _INDEXES_KEPT)
            line = indexes[start:end]
        else:
            line = bytes(read_recorded(self.catalog.storage, where, start, end - start))
        if len(line) != ref.index.bytes or checksum(line) != ref.index.xxh3_64:
            raise DamagedFileError(f"{self.catalog.storage.where(where)}: the index of unit {unit!r} (bytes {start} to "
                                 f"{end}) does not match its checksum (file is corrupted)")
        return line

    def read_small(self, key: str, entry: FileEntry) -> bytearray:
        """The checked bytes of the run's small file ``key`` (``arrived`` here, ``received`` from
        another rank, or read)."""
        arrived = self.arrival(self.catalog.storage, key, entry)
        if arrived is not None:
            return bytearray(arrived)
        if key in self.received:
            return check_stored(bytearray(self.received[key]), entry, self.catalog.storage.where(key))
        return read_stored(self.catalog.storage, key, entry)

    def _pack_header(self, storage: Storage, key: str, file: FileEntry,
                     shapes: dict[str, tuple[str, list[int]]], step: int) -> tuple[int, dict[str, dict]]:
        """A pack file's ``(offset of the data, header)``, checked against ``shapes``: read and
        parsed once for every unit in it, its size checked then (in the same request where the
        indexes at hand say how many data bytes it holds, ``_pack_data``: from an object store
        one round trip, not a HEAD per unit and two GETs). Each tensor read from it is checked
        against its own checksum, and a read past a shortened file fails as truncated: a kept
        header is not checked against the file again, and is kept for an entry of the same path,
        checksum and size only (an index that says another size is checked anew, and refused)."""
        kept = (storage.where(key), file.xxh3_64, file.bytes)  # a header kept was sized against these bytes
        header = self._pack_headers.get(kept)
        if header is not None:
            check_header(header[1], storage.where(key), shapes)
        else:
            header = check_stored_header(storage, key, file, shapes, self._pack_data(step, file.path) if storage.remote else None)
        _keep(self._kept_lock, self._pack_headers, kept, header, _PACK_HEADERS)
        return header

    @contextlib.contextmanager
    def reading_together(self, reads: list[tuple[int, str, Collection[str]]],
                         into: Mapping[tuple[int, str], dict[str, torch.Tensor]] | None = None) -> Iterator[None]:
        """Within it, the units of ``reads`` (``(step, unit, tensor keys skipped)``: those this
        process reads next, as a rank of a read plan reads its items, on any thread) read from
        a pack file of a remote store that holds tensors of several of them read it together:
        the byte ranges they want of it, in file order, are cut into spans of adjacent ranges,
        a span taking in the bytes between two ranges (tensors of other ranks' units) only
        while those stay within 1/``TOGETHER_GAP`` of the bytes it is wanted for; each span is
        fetched once, when the first unit with a tensor in it is read, and let go when the last
        has taken its own (or this exits); each tensor is checked against its own checksum as it
        is taken (a damaged one is named with its unit). A pack whose data they want all of but
        such a gap is one span with its header: its size, header and data come in the same
        requests (``fetch_whole``), the tensors of ``into`` (``(step, unit)`` -> live tensors by
        key, as ``read``'s ``into``) landing in their memory (``fetch_whole_into``), each then
        checked there; else its header is read first, as for one unit. Spans are of
        at most ``TOGETHER_BYTES``. Before, a rank reading three layers of its pack asked for
        its header, then for each layer, one request after another (and an S3 emulator reads
        the whole object for each). Reads the units' indexes (a restore has them at hand)."""
        planned: dict[tuple[str, str, int], _Together] = {}
        for step, unit, skip in reads:
            entry = self.entry(step, unit)
            targets = _targets(entry, [t for t in entry.tensors if t.key not in skip], (into or {}).get((step, unit)) or {})
            for tensor in entry.tensors:
                for chunk in tensor.chunks if tensor.key not in skip else ():
                    file = entry.files[chunk.file]
                    if not is_pack(file.path) or file.origin == "base":
                        continue
                    storage, key = self.file_location(step, file)
                    if not storage.remote:
                        continue
                    together = planned.setdefault((storage.where(key), file.xxh3_64, file.bytes),
                                                  _Together(file.origin if file.origin is not None else step, file.path))
                    together.expected[tensor.chunk_key(chunk)] = (tensor.dtype, chunk.shape)
                    together.wanted[tensor.chunk_key(chunk)] = math.prod(chunk.shape) * tensor.torch_dtype.itemsize
                    together.owner[tensor.chunk_key(chunk)] = (step, unit)
                    if tensor.chunk_key(chunk) in targets.get(chunk.file, {}):
                        together.into[tensor.chunk_key(chunk)] = targets[chunk.file][tensor.chunk_key(chunk)]
        kept = {where: together for where, together in planned.items() if len(set(together.owner.values())) > 1}
        for where, together in kept.items():
            together.pending = set(together.expected)
            data = self._pack_data(together.step, together.path)
            if data is not None and where[2] <= TOGETHER_BYTES and (data - sum(together.wanted.values())) * TOGETHER_GAP <= data:
                together.whole = True
        with self._together_lock:
            self._together = kept
        try:
            yield
        finally:
            with self._together_lock:
                self._together = {}

    def _from_together(self, storage: Storage, key: str, file: FileEntry, shapes: dict[str, tuple[str, list[int]]],
                       sums: dict[str, str], user: tuple[int, str]) -> dict[str, torch.Tensor] | None:
        """The tensors ``sums`` of the unit ``user`` (``(step, unit)``) from the spans of the pack
        ``file`` read together (``reading_together``), each fetched here if this is its first
        reader, else waited for: the live tensors they landed in where the pack was read whole
        with ``reading_together``'s ``into``, else views of the span's bytes (whatever the caller
        would read into: a span holds several units' tensors); None where that pack is not read so."""
        where = (storage.where(key), file.xxh3_64, file.bytes)
        with self._together_lock:
            together = self._together.get(where)
            if together is None or not sums or any(together.owner.get(name) != user for name in sums):
                return None
            if not together.pending.issuperset(sums):  # read already: again, as any unit is
                return None
            together.pending.difference_update(sums)
        # The spans, and where the pack's data starts and its header: once, for every unit.
        header, spans = _once(self._together_lock, together, "spans", lambda: self._cut_spans(storage, key, file, together))
        check_header(header[1], where[0], shapes)
        out = {}
        for span in {id(span): span for name in sums for span in spans if name in span.names}.values():
            data = _once(self._together_lock, span, "data", lambda: fetch(storage, key, span.start, span.end - span.start))
            names = {name: sums[name] for name in sums if name in span.names}
            out.update(checked_landed(data, names, where[0]) if isinstance(data, dict)  # landed (``fetch_whole_into``)
                       else checked_parts(data, (header[0] - span.start, header[1]), names, where[0]))
            with self._together_lock:
                span.left.difference_update(sums)
                if not span.left:  # its last unit has its tensors: the bytes go with theirs
                    span.data = None
        return out

    def _cut_spans(self, storage: Storage, key: str, file: FileEntry,
                   together: _Together) -> tuple[tuple[int, dict[str, dict]], list[_Span]]:
        """The header of a pack read together and the spans its wanted ranges are cut into
        (``reading_together``): one, header and all, fetched here, where the pack is read whole."""
        if together.whole:
            span = _Span(0, file.bytes, set(together.expected))
            header, data = (fetch_whole_into(storage, key, file, together.expected, together.into) if together.into
                            else fetch_whole(storage, key, file)[::-1])
            check_header(header[1], storage.where(key), together.expected)
            span.data = Future()
            span.data.set_result(data)
            return header, [span]
        header = self._pack_header(storage, key, file, together.expected, together.step)
        offset, parsed = header
        spans: list[_Span] = []
        gaps = 0
        for begin, end, name in sorted((*parsed[name]["data_offsets"], name) for name in together.expected):
            last = spans[-1] if spans else None
            gap = begin - last.end + offset if last is not None else 0
            if (last is not None and gap >= 0 and end + offset - last.start <= TOGETHER_BYTES
                    and (gaps + gap) * TOGETHER_GAP <= last.wanted + end - begin):
                last.add(name, end + offset, end - begin)
                gaps += gap
            else:
                spans.append(_Span(begin + offset, end + offset, {name}))
                spans[-1].wanted, gaps = end - begin, 0
        return header, spans

    def _whole_pack(self, storage: Storage, file: FileEntry, step: int, wanted: int) -> bool:
        """Whether the pack ``file`` (of a unit saved at ``step``) is read as a unit file is, whole
        (``fetch_stored_tensors``: its header and checksum checked, a byte landing in a live
        tensor only once the header is), where its header would be read first: from a remote
        store, when it holds no tensor data but the ``wanted`` bytes (a pack of one unit, say):
        its header and data then come in one request, not two round trips, and no byte is read
        that is not wanted."""
        return storage.remote and self._pack_data(file.origin if file.origin is not None else step, file.path) == wanted

    def _pack_data(self, step: int, path: str) -> int | None:
        """Bytes of tensor data the pack ``path`` of the snapshot of ``step`` holds, from the
        indexes of every unit of that snapshot when all are parsed already (a restore of its
        units has them), so the rest of the pack is its length word and header alone; None
        where one is not (no index is read for this)."""
        if (step, path) in self._pack_sizes:
            return self._pack_sizes[step, path]
        total = 0
        for unit in self.catalog.manifest(step).units:
            stored = self._units.get((step, unit))
            if stored is None:
                return None
            for tensor in stored.tensors:
                itemsize = tensor.torch_dtype.itemsize
                for chunk in tensor.chunks:
                    if stored.files[chunk.file].path == path:
                        total += math.prod(chunk.shape) * itemsize
        self._pack_sizes[step, path] = total
        return total

    def stored_files(self, step: int) -> list[FileEntry]:
        """Every file the snapshot of ``step`` holds itself but its manifest, each once: its
        global state and rank files, its unit indexes and the unit files they list (a pack file
        that several units' indexes list, once; not what a unit keeps from older snapshots or
        the base directory). Reads the indexes, checked."""
        manifest = self.catalog.manifest(step)
        files = {entry.path: entry for entry in manifest.files}  # INDEXES_FILE among them, from schema 6
        for unit, ref in manifest.units.items():
            if ref.index_at is None:
                files.setdefault(ref.index.path, ref.index)
            for entry in self.stored_entry(step, unit).files:
                files.setdefault(entry.path, entry)  # a promotion copies each file once, not once per unit
        return list(files.values())

    def _cache(self, key: tuple, entry: UnitEntry) -> None:
        _keep(self._kept_lock, self._units, key, entry, _UNIT_CACHE)

    def _merged(self, stored: UnitEntry) -> UnitEntry:
        """``stored`` with the tensors it keeps: each from the index of the snapshot that wrote
        it (which must hold it itself), or from the base directory. Each file they lie in is
        listed once (a pack file holding many of them: one position, so a read of them checks
        its header once and reads adjacent tensors as one range)."""
        files = list(stored.files)
        tensors = list(stored.tensors)
        holders: dict[int, list[str]] = {}
        for tensor_key, holder in stored.kept.items():
            holders.setdefault(holder, []).append(tensor_key)
        for holder, keys in sorted(holders.items()):
            source = self.stored_entry(holder, stored.unit)
            by_key = {t.key: t for t in source.tensors}
            position: dict[int, int] = {}  # the file's position in source -> in the merged view
            for tensor_key in keys:
                held = by_key.get(tensor_key)
                if held is None:
                    raise IntegrityError(f"snapshot {stored.step} keeps {tensor_key!r} of unit {stored.unit!r} from step "
                                         f"{holder}, which does not hold it")
                chunks = []
                for chunk in held.chunks:
                    if chunk.file not in position:
                        files.append(source.files[chunk.file].model_copy(update={"origin": holder}))
                        position[chunk.file] = len(files) - 1
                    chunks.append(chunk.model_copy(update={"file": position[chunk.file]}))
                tensors.append(held.model_copy(update={"chunks": chunks}))
        if stored.base:
            base = self.catalog.manifest(stored.step).base
            listed = {f.path: f for f in (base.files if base is not None else [])}
            base_position: dict[str, int] = {}  # a base file's path -> its position in the merged view
            for tensor_key, ref in stored.base.items():
                if ref.file not in listed:
                    raise IntegrityError(f"snapshot {stored.step}: {tensor_key!r} is kept from base file {ref.file!r}, "
                                         "which its manifest does not list")
                if ref.file not in base_position:
                    files.append(listed[ref.file].model_copy(update={"origin": "base"}))
                    base_position[ref.file] = len(files) - 1
                whole = Chunk(file=base_position[ref.file], offsets=[0] * len(ref.shape), shape=list(ref.shape),
                              xxh3_64=ref.xxh3_64, sample_xxh3=ref.sample_xxh3, cover_xxh3=ref.cover_xxh3)
                tensors.append(TensorEntry(key=tensor_key, dtype=ref.dtype, shape=list(ref.shape),
                                           chunks=[whole.model_copy(update={"stored_as": ref.name})]))
        return stored.model_copy(update={"files": files, "tensors": tensors})

    def base_ref(self, step: int, unit: str, key: str) -> dict[str, Any]:
        """Where the version of ``unit`` at ``step`` keeps tensor ``key`` from the base model
        directory (a ``BaseRef`` as JSON)."""
        ref = self.stored_entry(step, unit).base.get(key)
        if ref is None:
            raise IntegrityError(f"snapshot {step}: unit {unit!r} keeps no {key!r} from the base directory")
        return ref.model_dump(mode="json")

    def check_base(self, composite: Composite) -> None:
        """The base model directory the composite keeps tensors from is there, every file of
        it at its recorded size (a cheap check before a restore; each tensor read from it is
        checked against its checksum). DamagedFileError naming the file otherwise (``verify``
        checks the base files too)."""
        bases = {self.catalog.manifest(s).base.path: s for s in self.catalog.needs(composite) if self.catalog.manifest(s).base}
        for step in bases.values():
            storage = self.base_storage(step)
            for file in self.catalog.manifest(step).base.files:
                try:
                    size = storage.size(file.path)
                except TailorError as err:
                    raise IntegrityError(str(err)) from None
                if size is None:
                    raise DamagedFileError(f"{storage.where(file.path)}: file is missing (the base model directory the "
                                           "run keeps frozen tensors from)")
                if size != file.bytes:
                    raise DamagedFileError(f"{storage.where(file.path)}: {size} bytes, the run recorded {file.bytes} "
                                           "(the base model changed)")

    def base_storage(self, step: int) -> Storage:
        """The storage of the base model directory the snapshot of ``step`` keeps tensors from
        (its files resolve inside it)."""
        base = self.catalog.manifest(step).base
        if base is None:
            raise IntegrityError(f"snapshot {step} keeps a base file but names no base directory")
        if base.path not in self._bases:
            self._bases[base.path] = open_storage(base.path)
        return self._bases[base.path]

    def file_location(self, step: int, file: FileEntry) -> tuple[Storage, str]:
        """Where a file of a unit's merged view (saved at ``step``) lies: the storage and key
        (the run's, or the base directory's for a base file)."""
        if file.origin == "base":
            return self.base_storage(step), file.path
        return self.catalog.storage, f"{self.catalog.snapshot_key(step if file.origin is None else file.origin)}/{file.path}"

    def read(self, step: int, unit: str, skip: set[str] = frozenset(),
             into: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Tensors (by key, but those in ``skip``) and non-tensor optimizer values of ``unit`` as
        saved at ``step``.

        Every snapshot file is checked against its checksum; every tensor against the index's
        dtype and shape; a tensor of a pack file, or kept from the base directory, is read alone
        (its byte range) and checked against its own checksum (the file holds other units).
        Chunks are assembled into the global tensor.

        ``into``: live tensors (by key) to read a tensor stored whole (one chunk) of a snapshot
        file straight into, no staging copy, where ``readable_into`` says their memory takes it;
        those returned are then these. When this raises, damaged bytes may have landed in them."""
        entry = self.entry(step, unit)
        expected: dict[int, dict[str, tuple[str, list[int], str]]] = {}
        wanted_bytes: dict[int, int] = {}  # file position -> bytes of the chunks wanted from it
        wanted = [t for t in entry.tensors if t.key not in skip]
        targets = _targets(entry, wanted, into or {})
        for tensor in wanted:
            for chunk in tensor.chunks:
                expected.setdefault(chunk.file, {})[tensor.chunk_key(chunk)] = (tensor.dtype, chunk.shape, chunk.xxh3_64)
                wanted_bytes[chunk.file] = wanted_bytes.get(chunk.file, 0) + math.prod(chunk.shape) * tensor.torch_dtype.itemsize
        places = {position: self.file_location(step, entry.files[position]) for position in expected}
        loaded = {}
        for position in sorted(expected):
            storage, key = places[position]
            file, shapes = entry.files[position], {k: v[:2] for k, v in expected[position].items()}
            sums = {k: v[2] for k, v in expected[position].items()}
            arrived = self.arrival(storage, key, file)
            if arrived is not None:  # checked whole as it arrived: its header and tensors from those bytes
                loaded[position] = checked_tensors(arrived, storage.where(key), shapes, targets.get(position))
            elif file.origin == "base":  # a large file of which a few tensors are wanted: those alone
                check_stored_header(storage, key, file, shapes)
                loaded[position] = read_checked_tensors(storage, key, sums)
            elif (together := self._from_together(storage, key, file, shapes, sums, (step, unit))) is not None:
                loaded[position] = together
            elif is_pack(file.path) and not self._whole_pack(storage, file, step, wanted_bytes[position]):
                # a rank's small units together: this unit's tensors alone
                pack = self._pack_header(storage, key, file, shapes, file.origin if file.origin is not None else step)
                loaded[position] = read_stored_parts(storage, key, pack, sums, targets.get(position))
            else:  # each byte read once; every file's checksum and header checked before any tensor is used
                loaded[position] = fetch_stored_tensors(storage, key, file, shapes, targets.get(position))
        names = {position: storage.where(key) for position, (storage, key) in places.items()}
        tensors = {t.key: _assemble(t, entry, loaded, names) for t in wanted}
        return tensors, {name: dict(values) for name, values in entry.values.items()}

    def read_global(self, step: int) -> dict[str, Any]:
        """The global state saved at ``step``: what all ranks share (step, optimizer groups, LR
        scheduler, model config) and rank 0's own RNG states, extras and stateful objects' states."""
        return self._read_state(step, GLOBAL_JSON, GLOBAL_TENSORS)

    def stage_states(self, step: int,
                     shared: dict[str, Any] | None = None) -> list[tuple[list[str], dict[str, Any]]] | None:
        """The global state of each pipeline stage saved at ``step``, as ``(units, state)`` in
        stage order (optimizer groups, optimizer class, LR scheduler: each stage's leader saved
        its own, rank 0's in the global state), or None for a run not saved by stages.
        ``shared``: the global state of ``step`` when already read. IntegrityError where a
        stage's is missing."""
        shared = self.read_global(step) if shared is None else shared
        saved = shared.get("stages")
        if saved is None:
            return None
        states = []
        for stage in saved:
            leader = stage["ranks"][0]
            state = shared if leader == 0 else (self.read_rank_state(step, leader) or {}).get("stage")
            if not isinstance(state, dict):
                raise IntegrityError(f"the snapshot of step {step} lacks the global state of the pipeline stage "
                                     f"of rank {leader} (units {stage['units'][:3]}...)")
            states.append((list(stage["units"]), state))
        return states

    def whole_global(self, step: int) -> dict[str, Any]:
        """The global state of ``step`` for the whole model (an export's): ``read_global``'s, and
        for a run saved by pipeline stages their optimizer groups merged, group i of every
        stage into one (its parameters in stage order, which is the model's), and their one
        LR scheduler. UnsupportedLayoutError, one line, where the stages' groups (count or
        hyperparameters) or schedulers differ: no one optimizer of the whole model is then known."""
        shared = self.read_global(step)
        states = self.stage_states(step, shared)
        if states is None:
            return shared
        where = f"the snapshot of step {step} (saved by {len(states)} pipeline stages)"
        schedulers = [state.get("lr_scheduler") for _, state in states]
        if any(s != schedulers[0] for s in schedulers[1:]):
            raise UnsupportedLayoutError(f"{where}: the stages' LR schedulers differ; an export holds one scheduler")
        stage_groups = [state.get("optimizer_groups") for _, state in states]
        return {**shared, "lr_scheduler": schedulers[0], "optimizer_groups": merged_groups(stage_groups, where)}

    def read_rank_state(self, step: int, rank: int, shared: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Rank ``rank``'s own RNG states, extras and stateful objects' states as saved at
        ``step`` (rank 0: from the global state; ``shared``: that state when already read and
        decoded, whose other keys its reader used, so it is not decoded again), or None when no
        rank of that number took part in the save."""
        if rank == 0:
            state = self.read_global(step) if shared is None else shared
            return {key: state.get(key) for key in ("rng", "extra", STATEFUL_KEY)}
        doc, tensors = rank_state_files(rank)
        if not any(entry.path == doc for entry in self.catalog.manifest(step).files):
            return None
        return self._read_state(step, doc, tensors)

    def _read_state(self, step: int, doc_path: str, tensors_path: str) -> dict[str, Any]:
        from llmtailor.store import codec  # imports torch, which reading a layout does not need

        where = self.catalog.where(step, doc_path)
        raw, data = self._state_files(step, doc_path, tensors_path)
        try:
            doc = json.loads(bytes(raw))
        except (ValueError, RecursionError) as err:
            raise IntegrityError(f"{where}: not valid JSON ({err})") from None
        tensors = decode_tensors(data, self.catalog.where(step, tensors_path))
        state = codec.decode(doc, tensors, where=where)
        if not isinstance(state, dict):
            raise IntegrityError(f"{where}: expected an object at the top level")
        return state


    def _state_files(self, step: int, doc_path: str, tensors_path: str) -> tuple[bytes, bytearray]:
        """The checked bytes of a snapshot's state files (its JSON and its tensors), each read
        once (the two asked side by side: ``Storage.together``): the newest pair read is kept, up to ``_STATE_KEPT`` bytes (a restore reads rank 0's state for its checks and
        again for its RNG and extras) and decoded afresh by each caller, so none shares
        another's objects. A committed snapshot's files never change; ``forget`` drops them."""
        key = (step, doc_path)
        with self._state_lock:  # read once where two threads ask (a restore reads a rank's own beside its units)
            return self._state_files_once(key, step, doc_path, tensors_path)

    def _state_files_once(self, key: tuple[int, str], step: int, doc_path: str, tensors_path: str) -> tuple[bytes, bytearray]:
        if self._state is None or self._state[0] != key:
            manifest = self.catalog.manifest(step)
            snapshot = self.catalog.snapshot_key(step)
            # Side by side from an object store: one round trip (a rank's own state is a restore's last read).
            raw, data = self.catalog.storage.together(
                lambda: bytes(self.read_small(f"{snapshot}/{doc_path}", manifest.file_entry(doc_path))),
                lambda: self.read_small(f"{snapshot}/{tensors_path}", manifest.file_entry(tensors_path)))
            if len(data) > _STATE_KEPT:
                return raw, data  # large extras: not held beyond their use
            self._state = (key, raw, data)
        return self._state[1], bytearray(self._state[2])


def _once(lock: threading.Lock, holder: Any, name: str, compute: Callable[[], Any]) -> Any:
    """The result of the future ``holder.<name>``: where it is None, one is set in its place
    under ``lock`` and ``compute()`` fills it here (the first caller), the others wait for it;
    what ``compute`` raised is raised to each (``reading_together``'s spans and their bytes)."""
    with lock:
        future, first = getattr(holder, name), False
        if future is None:
            future, first = Future(), True
            setattr(holder, name, future)
    if first:
        try:
            future.set_result(compute())
        except BaseException as err:  # each of its readers raises it
            future.set_exception(err)
    return future.result()


class _Together:
    """A pack file read together for several units (``UnitReader.reading_together``): the
    snapshot and path it was written at, the tensors they want of it (name -> dtype and
    shape, its bytes, and the unit ``(step, unit)`` it is of), whether it is read whole, and
    once its first unit is read, its header and spans."""

    __slots__ = ("step", "path", "expected", "wanted", "owner", "into", "pending", "whole", "spans")

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path
        self.expected: dict[str, tuple[str, list[int]]] = {}
        self.wanted: dict[str, int] = {}
        self.owner: dict[str, tuple[int, str]] = {}
        self.into: dict[str, torch.Tensor] = {}
        """Live tensors the read whole lands them in, by name (``reading_together``'s ``into``)."""
        self.pending: set[str] = set()
        """The tensors not yet taken by their unit's read."""
        self.whole = False
        self.spans: Future | None = None


class _Span:
    """Bytes ``start`` to ``end`` of a pack read together, fetched in one go for its tensors
    ``names``, ``left`` those not yet taken; ``data``: its bytes once fetching began, until the
    last is taken."""

    __slots__ = ("start", "end", "names", "left", "wanted", "data")

    def __init__(self, start: int, end: int, names: set[str]):
        self.start, self.end, self.names, self.left, self.wanted = start, end, names, set(names), 0
        self.data: Future | None = None

    def add(self, name: str, end: int, length: int) -> None:
        self.end, self.wanted = end, self.wanted + length
        self.names.add(name)
        self.left.add(name)


def _targets(entry: UnitEntry, wanted: list[TensorEntry],
             into: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Of ``into`` (live tensors by key), those a ``wanted`` tensor of ``entry`` stored whole in
    one file of the run (not the base directory) can be read straight into (``readable_into``),
    by file position and name in the file; a memory two keys share (tied weights) is read into
    once."""
    from llmtailor.store.tensor_files import readable_into

    targets: dict[int, dict[str, torch.Tensor]] = {}
    seen: set[int] = set()
    for tensor in wanted:
        live = into.get(tensor.key)
        if live is None or len(tensor.chunks) != 1 or entry.files[tensor.chunks[0].file].origin == "base":
            continue
        chunk = tensor.chunks[0]
        if chunk.shape != tensor.shape or not readable_into(live, tensor.torch_dtype, tensor.shape):
            continue
        if live.numel() and live.data_ptr() in seen:
            continue
        seen.add(live.data_ptr())
        targets.setdefault(chunk.file, {})[tensor.chunk_key(chunk)] = live
    return targets


def _assemble(
    entry: TensorEntry, unit: UnitEntry, loaded: dict[int, dict[str, torch.Tensor]], paths: dict[int, str]
) -> torch.Tensor:
    pieces = []
    for chunk in entry.chunks:
        tensors, path, key = loaded[chunk.file], paths[chunk.file], entry.chunk_key(chunk)
        if key not in tensors:
            raise IntegrityError(f"{path}: tensor {key!r} is missing")
        piece = tensors[key]
        if piece.dtype != entry.torch_dtype or list(piece.shape) != chunk.shape:
            raise IntegrityError(
                f"{path}: tensor {key!r} is {piece.dtype} {list(piece.shape)}, index says {entry.dtype} {chunk.shape}"
            )
        pieces.append((chunk, piece))
    if len(pieces) == 1 and pieces[0][0].shape == entry.shape:
        return pieces[0][1]
    import torch  # the pieces are tensors: torch is loaded already

    whole = torch.empty(entry.shape, dtype=entry.torch_dtype)
    for chunk, piece in pieces:
        index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
        whole[index] = piece
    return whole


def merged_groups(stage_groups: list[list[dict[str, Any]] | None], where: str) -> list[dict[str, Any]] | None:
    """Pipeline stages' optimizer groups (``params`` as names) as one optimizer's: group i of
    every stage merged, its parameters in stage order, when every stage has as many groups with
    the same hyperparameters (each stage built its optimizer by one rule); None when no stage
    saved an optimizer. UnsupportedLayoutError naming ``where`` otherwise."""
    if all(groups is None for groups in stage_groups):
        return None

    def hyper(group: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in group.items() if key != "params"}

    first = stage_groups[0] or []
    for number, groups in enumerate(stage_groups[1:], start=1):
        if groups is None or len(groups) != len(first) or any(hyper(a) != hyper(b) for a, b in zip(groups, first)):
            raise UnsupportedLayoutError(
                f"{where}: stage {number}'s optimizer groups are not stage 0's ({len(groups or [])} vs {len(first)} "
                "groups, or other hyperparameters); an export holds one optimizer, its groups merged from the stages' "
                "like groups")
    return [{**hyper(group), "params": [name for groups in stage_groups for name in groups[index]["params"]]}
            for index, group in enumerate(first)]
