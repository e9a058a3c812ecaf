"""A restore's small files read once per job: the manifests, unit indexes and global state of the
composite a distributed restore loads, which every rank needs whole, leave the store once.

Rank 0 leases the composite and resolves it (reading the manifests of every snapshot it needs,
``Catalog.lease``) and sends those manifests to the other ranks through the coordinator
(``share_manifests``); they lease the composite from them (leases and existence checks, no
manifest read), or from an object store take no lease: rank 0's covers every rank's reads, all
done before the ranks agree the restore succeeded and rank 0 lets it go. Knowing every file's
size and checksum from the manifests, the ranks then read the composite's unit indexes and
global state files once in the job between them, each by one
rank checked against its checksum and broadcast to the others (``share_small_files``, a
``distributed.read_plan``); the bytes wait in the run's ``UnitReader.received`` for the
restore's own reads, which check them again and parse them as if read.

Failures reach every rank: a lease or manifest read that fails on rank 0 is sent in place of the
manifests and raised on every rank (of the same kind: damage, a missing snapshot, a storage
error, so ranks passing over damaged composites stay in step) naming rank 0; a small file found
damaged by its reader is refused on every rank naming that reader (the read plan's rule).

Invariant: every rank of the job calls ``share_manifests`` then ``share_small_files`` for the
same composite, in the same order, with the same tags.
"""

from __future__ import annotations

from llmtailor.constants import GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, MANIFEST_FILE
from llmtailor.distributed.coordinator import CoordinationError, Coordinator, describe_error
from llmtailor.distributed.read_plan import ReadPlan, balance
from llmtailor.errors import DamagedFileError, IntegrityError, SnapshotNotFoundError, StorageError
from llmtailor.store.catalog import Composite, LeasedComposite, ReadLeases
from llmtailor.store.manifest import FileEntry, parse_manifest
from llmtailor.store.run import Run
from llmtailor.store.units import INDEXES_READ_WHOLE

_KINDS = {kind.__name__: kind for kind in (DamagedFileError, IntegrityError, SnapshotNotFoundError, StorageError)}
"""The failures of rank 0's lease that other ranks raise as their own kind (else a CoordinationError)."""


def share_manifests(run: Run, step: int, leased: LeasedComposite | None, coordinator: Coordinator,
                    tag: str, covered: bool = False) -> LeasedComposite:
    """The composite of ``step`` leased on this rank (``leased``: the lease rank 0 took choosing
    it, if any). One process leases it itself. In a job, rank 0 leases and resolves it and sends
    the manifests of every snapshot it needs; the others keep them as read (``Catalog.remember``)
    and lease from them, or, ``covered``, take no lease of their own: rank 0's covers their
    reads (one store every rank reads, an object store's, and every read of the restore done
    before rank 0 lets its lease go: ``Tailor.restore``), which saves each of them a reader
    lease's four requests and its delete. Raises on every rank what failed on rank 0 (module
    docstring); no lease is held then."""
    if coordinator.world_size == 1:
        return leased or run.lease(step)
    if coordinator.is_leader:
        lease, failure, sent = leased, None, {}
        try:
            lease = lease or run.lease(step)
            sent = {"manifests": {s: run.manifest(s).model_dump_json() for s in run.needs(lease.composite)}}
        except BaseException as err:  # sent in place of the manifests, then raised here too
            failure, sent = err, {"failed": describe_error(err), "kind": type(err).__name__}
            if lease is not None:
                lease.close()
        coordinator.broadcast(f"{tag}/manifests", lambda: sent)
        if failure is not None:
            raise failure
        return lease
    sent = coordinator.broadcast(f"{tag}/manifests", None)
    if "failed" in sent:
        kind = _KINDS.get(sent["kind"], CoordinationError)
        raise kind(f"rank 0 could not read the composite of step {step}: {sent['failed']}")
    for source, text in sent["manifests"].items():
        where = run.storage.where(f"{run.snapshot_key(int(source))}/{MANIFEST_FILE}")
        run.remember(parse_manifest(text.encode(), where, int(source)))
    return LeasedComposite(run.resolve(step), ReadLeases(run)) if covered else run.lease(step)


def share_small_files(run: Run, composite: Composite, coordinator: Coordinator) -> None:
    """The unit indexes and global state files of ``composite`` (``small_files``), read once in
    the job between the ranks and sent to the others (module docstring), into
    ``run.units.received`` on every rank. Nothing in one process (it reads them as it goes).
    The files go in one item per rank (``balance``: each rank's share of the bytes), so a
    restore pays one broadcast per rank for them, not one per file."""
    run.units.received.clear()
    if coordinator.world_size == 1:
        return
    import torch  # a restore of a distributed job: torch is loaded already

    files = small_files(run, composite)
    owners = balance({name: entry.bytes for name, (_, entry) in files.items()}, coordinator.world_size)
    shares = [[name for name in files if owners[name] == rank] for rank in range(coordinator.world_size)]
    shares = [share for share in shares if share]
    items = {f"the unit indexes and global state of step {composite.step} (part {k + 1} of {len(shares)})": share
             for k, share in enumerate(shares)}
    plan = ReadPlan(coordinator, {item: sum(files[name][1].bytes for name in share) for item, share in items.items()})

    def read(item: str) -> list[torch.Tensor]:
        return [torch.frombuffer(bytearray(run.units.read_small(*files[name])), dtype=torch.uint8)
                if files[name][1].bytes else torch.empty(0, dtype=torch.uint8) for name in items[item]]

    def specs(item: str) -> list[tuple[torch.dtype, list[int]]]:
        return [(torch.uint8, [files[name][1].bytes]) for name in items[item]]

    for item, tensors in plan.fetch(read, specs):
        for name, data in zip(items[item], tensors):
            run.units.received[files[name][0]] = data.numpy().tobytes()


def small_files(run: Run, composite: Composite) -> dict[str, tuple[str, FileEntry]]:
    """Its name -> ``(key, entry)`` of each small file a restore of ``composite``
    reads on every rank: the index of every unit version it reads (and of the versions they keep
    frozen tensors from; from schema 6 the snapshot's one index file, when a reader reads it
    whole: ``UnitReader._index_line``) and its step's global state files, sorted by key (the same
    on every rank: it follows from the manifests alone)."""
    found: dict[str, tuple[str, FileEntry]] = {}
    for source, units in run.needs(composite).items():
        manifest = run.manifest(source)
        for unit in units:
            ref = manifest.units.get(unit)
            if ref is not None and ref.index_at is None:
                found[f"the index of unit {unit!r} of step {source}"] = (f"{run.snapshot_key(source)}/{ref.index.path}", ref.index)
            elif ref is not None and manifest.file_entry(INDEXES_FILE).bytes <= INDEXES_READ_WHOLE:
                found[f"the unit indexes of step {source}"] = (f"{run.snapshot_key(source)}/{INDEXES_FILE}",
                                                               manifest.file_entry(INDEXES_FILE))
    listed = {entry.path: entry for entry in run.manifest(composite.step).files}
    for path in (GLOBAL_JSON, GLOBAL_TENSORS):
        if path in listed:
            found[f"the global state file {path} of step {composite.step}"] = (f"{run.snapshot_key(composite.step)}/{path}",
                                                                            listed[path])
    return dict(sorted(found.items(), key=lambda item: item[1][0]))

