"""The node-scoped commit: a snapshot committed into a node-local tier, where each node has a
copy of the tier of its own (``Tier(scope="node", replicas=K, jump=j)``) and no store is shared.

Beside the shared recipe (``writer.persist``: every rank writes into one store, its leader
commits there), this one commits one copy per node, collectively (every rank calls it for the
same snapshot; ``persist`` takes it when the run's placement is node-local, ``NodePlacement``):

1. each node's leader (its lowest rank) opens the snapshot's staging place in its node's copy
   (``SnapshotCommit.begin``) and tells the other ranks of its node its name; no message
   between nodes: a node whose copy cannot be written (read-only, full) says so in step 3's
   report, and rank 0 makes every rank raise, naming the node and why (``NodeTierError``);
2. every rank writes its part into its node's staging (``writer.write_part``, as a shared save
   does), then, once the ranks it sends to and receives from say they wrote theirs (``_ready``),
   sends its files to its partner ranks (``Nodes.partner_ranks``: the rank of the
   same index on each other holder node) over the courier; rank 0 also sends the global files
   to each node that holds none of its parts. Each receiver writes what it received into its
   own node's staging, durably, and reports each file as it arrived (size and checksum);
3. rank 0 gathers every report; only once every rank's every file has its ``K`` copies with
   the checksum its writer reported (and every node the global files), and the async save
   before this one (if still in flight) has committed, does it build the unit indexes and the
   manifest (``notes["nodes"]``: the placement) and announce them;
4. each node's leader writes the indexes, then the manifest (only if absent: the same bytes on
   every node), commits its staging (an atomic rename) and points its ``latest`` at it; every
   rank learns how every node fared, and what rank 0 says every node's retention after this
   save spares (``spare``: the composites its promoter may read, ``Tiers.may_promote``; taken once
   rank 0's copy committed, so after the save before had ended there). When a node failed, the
   nodes that committed remove their copy again (the previous composite stays the newest
   everywhere) and every rank raises.

Every rank is inside ``Coordinator.working`` throughout: a rank waiting for another (its
node's leader, a partner, rank 0, a node's commit) waits on while that one advances (writes,
receives, fsyncs), past the timeout; one that shows no progress for the timeout is named.

A failure anywhere before step 4 abandons every node's staging and raises on every rank; every
earlier snapshot stays as it was. A crash between two nodes' renames can leave the snapshot on
some nodes only: restore decides collectively (node tiers' recovery) and never reads it unless
every file is held by a live node.

The on-disk contract: on node n the tier is an ordinary run directory; a snapshot there holds the
manifest, every unit index, the global files and the parts of every node in ``Nodes.held_by(n)``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

from llmtailor.constants import MANIFEST_FILE, writer_rank
from llmtailor.distributed.coordinator import ALIKE, CoordinationError, Coordinator, describe_error, gate_tag
from llmtailor.distributed.courier import Courier, Packed, unpacked
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import IntegrityError, NodeTierError, TailorError
from llmtailor.store.checked import write_bytes_to
from llmtailor.store.commit import SnapshotCommit, StagedFiles, replace_latest
from llmtailor.store.manifest import FileEntry, parse_manifest
from llmtailor.store.retention import discard_snapshots
from llmtailor.store.run import Run
from llmtailor.store.staged import InTurn, PersistResult, RankPart, StagedSnapshot
from llmtailor.store.storage.base import Sink
from llmtailor.store.tensor_files import checksum
from llmtailor.store.writer import attempt_part, friendly, index_files, write_files


@dataclass(frozen=True)
class NodePlacement:
    """Where a node-local tier keeps each node's parts: the job's nodes, ``replicas`` copies of
    each node's parts on the nodes ``jump`` apart (``Nodes.holders``), and the courier that
    carries the copies."""

    nodes: Nodes
    replicas: int
    jump: int
    courier: Courier

    def record(self) -> dict[str, Any]:
        """What a manifest records of the placement (``notes["nodes"]``)."""
        return {**self.nodes.record(), "replicas": self.replicas, "jump": self.jump}

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is its node's leader (it commits that node's copy)."""
        return self.nodes.leader_of(self.nodes.node_of_rank(rank)) == rank

    def leader(self, rank: int) -> int:
        return self.nodes.leader_of(self.nodes.node_of_rank(rank))

    def partners(self, rank: int) -> list[int]:
        return self.nodes.partner_ranks(rank, self.replicas, self.jump)

    def sources(self, rank: int) -> list[int]:
        """The ranks whose files ``rank`` receives: those it keeps copies of, and rank 0 (the
        global files) where its node leads one that holds none of rank 0's parts."""
        extra = [0] if rank in self.global_receivers() else []
        return [*self.nodes.source_ranks(rank, self.replicas, self.jump), *extra]

    def global_receivers(self) -> list[int]:
        """The leaders of the nodes that hold none of rank 0's parts: rank 0 sends them the
        global files (every node holds those)."""
        holders = self.nodes.holders(self.nodes.node_of_rank(0), self.replicas, self.jump)
        return [self.nodes.leader_of(node) for node in range(self.nodes.count) if node not in holders]


def persist_on_nodes(run: Run, staged: StagedSnapshot, placement: NodePlacement, coord: Coordinator,
                     on_unit: Callable[[str, int], None] | None = None, prepare: Callable[[], None] | None = None,
                     confirm: Callable[[], None] | None = None,
                     spare: Callable[[], list[int]] | None = None) -> PersistResult:
    """Write this rank's share of ``staged`` into its node's copy of ``run``, send the copies,
    and commit the snapshot on every node (module docstring). A node's leader calls
    ``prepare()`` (taking its copy's writer lock) before anything is written there, and
    ``confirm()`` just before its manifest; rank 0 calls ``spare()`` once its copy committed,
    and every rank returns its answer (``PersistResult.spare``)."""
    start = time.perf_counter()
    round_ = staged.round or coord.new_round()
    # Every rank waits for others here (its node's leader opening, its partners' copies, rank 0's
    # word, every node's commit) while they write, send, fsync and commit, for longer than the
    # timeout where the parts are large or a disk slow: each shows its progress, and the others
    # wait on while it advances (``Coordinator.working``); one silent for the timeout is named. The
    # round's own lane: the next save's part, written meanwhile (``InTurn``), is no sign of this one.
    with coord.working(lane=round_):
        leads = placement.leads(coord.rank)
        opened = _open(run, staged, placement, coord, round_, prepare)
        snapshot = SnapshotCommit(run, staged.step, opened["staging"]) if "staging" in opened else None
        # A leader's received copies and the unit indexes stay in flight (their fsyncs running) until
        # its commit, which drains them beside the manifest's (``SnapshotCommit.commit``'s ``pending``,
        # as the shared writer's leader does). Another rank's are durable before it reports them.
        with snapshot.files() if leads and snapshot is not None else nullcontext() as files:
            try:
                part = attempt_part(snapshot, staged, coord.rank, on_unit) if snapshot is not None else None
                try:  # a rank whose part failed still takes part in the exchange (sending nothing): no peer waits on it
                    _ready(placement, coord, round_, staged.step)
                    copies = _replicate(snapshot, part if isinstance(part, RankPart) else None, placement, coord.rank,
                                        staged.turn, files)
                    report: Any = {"part": part.to_message(), "copies": copies} if isinstance(part, RankPart) else part
                except BaseException as err:
                    report = friendly(err, run, staged.step)
                plan = _announce(staged, placement, coord, round_, report if snapshot is not None else {"unopened": opened})
                assert isinstance(part, RankPart) and snapshot is not None  # a failed part or open was raised in step 3
            except BaseException:
                if leads and snapshot is not None:
                    snapshot.abandon()
                raise
            gate = None if coord.is_leader else _gate(coord, round_, placement, staged.step)
            committed = _commit_node(snapshot, plan, confirm, staged.turn, files, gate) if leads else None
        if committed is not None and coord.is_leader and spare is not None:
            committed["spare"] = spare()
        outcome, spared = _settle(snapshot, staged, placement, coord, round_, committed)
    manifest = plan["manifest"].encode()
    run.remember(parse_manifest(manifest, run.where(staged.step, MANIFEST_FILE), staged.step))
    return PersistResult(path=run.snapshot_dir(staged.step), bytes=plan["bytes"], seconds=time.perf_counter() - start,
                         unit_bytes=part.unit_bytes, rank_bytes=part.bytes, unconfirmed=outcome, spare=spared)


def _open(run: Run, staged: StagedSnapshot, placement: NodePlacement, coord: Coordinator, round_: str,
          prepare: Callable[[], None] | None) -> dict[str, Any]:
    """Step 1, within each node: its leader opens the staging place in its node's copy and
    posts ``{"staging": name}`` (or ``{"error": why, "alike": ...}``) for the other ranks of
    its node, which wait for it; every rank returns its node's. No round between nodes: a node
    that could not open says so in step 3 (``_unopened``), where every rank meets anyway."""
    node = placement.nodes.node_of_rank(coord.rank)
    leader, tag = placement.leader(coord.rank), f"{round_}/open/{node}"
    if coord.rank != leader:
        return coord.collect({leader: tag}, f"the staging place of step {staged.step} on node {node}")[leader]
    try:
        if prepare is not None:
            prepare()
        mine = {"staging": SnapshotCommit.begin(run, staged.step, staged.world_size).staging}
    except BaseException as err:
        mine = {"error": describe_error(friendly(err, run, staged.step, written=False)),
                "alike": type(err).__name__ if isinstance(err, ALIKE) else None}
    if len(placement.nodes.ranks_of(node)) > 1:
        coord.post(tag, mine)
    return mine


def _unopened(step: int, placement: NodePlacement, reports: list[Any]) -> None:
    """On rank 0, in step 3: raise when a node could not open its staging place (its ranks
    report ``{"unopened": ...}``), a promotion failure met there as itself (every rank raises
    it alike), else a NodeTierError naming each node and why."""
    failed = {placement.nodes.node_of_rank(rank): r["unopened"] for rank, r in enumerate(reports)
              if isinstance(r, dict) and "unopened" in r}
    if not failed:
        return
    alike = {kind.__name__: kind for kind in ALIKE}
    for opened in failed.values():
        if opened.get("alike") in alike:
            raise alike[opened["alike"]](opened["error"])
    where = "; ".join(f"node {node}: {o['error']}" for node, o in sorted(failed.items()))
    raise NodeTierError(f"step {step} was not saved: the node-local tier could not be written on "
                        f"node(s) {sorted(failed)} ({where}); earlier snapshots are intact on every node")


def _ready(placement: NodePlacement, coord: Coordinator, round_: str, step: int) -> None:
    """Before step 2's copies: this rank says its part is written, and waits until each rank it
    sends to or receives from says so too. The courier's messages are waited for within the
    timeout, whatever the peer does meanwhile, so a rank whose part was small (a DDP rank's
    state) waited there for a partner writing a large one (a DDP rank 0's every unit) and failed
    past the timeout, live as the partner was: here it waits on while the partner advances
    (``working``), and the copies start once both sides are at them."""
    peers = {*placement.partners(coord.rank), *placement.sources(coord.rank)}
    if coord.rank == 0:
        peers.update(placement.global_receivers())
    peers.discard(coord.rank)
    coord.post(f"{round_}/ready/{coord.rank}", True)
    if peers:
        coord.collect({peer: f"{round_}/ready/{peer}" for peer in sorted(peers)}, f"that its part of step {step} is written")


def files_of(part: RankPart) -> list[FileEntry]:
    """Every file a rank's part wrote (unit files and packs once each, global and rank state)."""
    files = {unit.file.path: unit.file for unit in part.units.values() if unit.file is not None}
    files.update({file.path: file for file in part.files})
    return list(files.values())


def _replicate(snapshot: SnapshotCommit | None, part: RankPart | None, placement: NodePlacement,
               rank: int, turn: InTurn, into: StagedFiles | None = None) -> dict[str, list[Any]]:
    """Step 2's copies: this rank's files to its partner ranks (the global files also to the
    nodes holding none of rank 0's parts; nothing where its ``part`` failed), and the files of
    the ranks it keeps copies of, written into this node's staging, durable (or into the batch
    ``into``, durable once it is drained: the leader's, drained by its commit). Returns, by source
    rank, each file received as it arrived (its size and checksum), for rank 0 to check against
    what its writer wrote.

    What is sent is this node's staged files as written there, mapped, not copied
    (``held_files``): the bytes its writer checksummed, which each receiver checks again before
    rank 0 commits (``check_copies``); what arrives lands in the staged file that keeps it, mapped
    (``_Landing``). A save at every step copies its part once, on the receiving side (the socket's
    copy into the file), on the CPUs that train."""
    files, unread = files_of(part) if part is not None else [], None
    try:
        mine = held_files(snapshot, files)
        shared = _only(mine, {f.path for f in files if writer_rank(f.path) is None}) if rank == 0 else mine
    except (TailorError, OSError) as err:  # still in the exchange, sending nothing: no partner waits on this rank
        unread, mine = err, held_files(snapshot, [])
        shared = mine
    outgoing = {partner: mine for partner in placement.partners(rank)}
    if rank == 0:
        outgoing.update({leader: shared for leader in placement.global_receivers()})
    # this node could not open the snapshot (None): what arrives has nowhere to go; a leader's
    # copies land in its batch ``into``, durable once its commit drains it
    staged = nullcontext(into) if into is not None else snapshot.files() if snapshot is not None else nullcontext()
    with staged as create:  # durable when the block ends
        landing = _Landing(create)
        try:
            turn.exchange_turn()  # the courier's exchanges in the saves' order, on every rank
            try:
                received = placement.courier.exchange_packed(outgoing, placement.sources(rank), into=landing.into)
            finally:
                turn.exchanged.set()
            if unread is not None:
                raise unread
            return {str(source): landing.keep(source, packed) for source, packed in received.items()} if create else {}
        except BaseException:
            landing.abort()
            raise


class _Landing:
    """Where the copies a rank receives land (``_replicate``): each file in its node's staging,
    straight into the file's mapping where the storage maps it (``Sink.space``: the courier
    receives into it, no buffer then written out: a fifth of a save's background work at every
    step, issue 32), else in fresh memory, written once it is whole (a storage that does not
    map, a file whose space could not be taken: its write then fails as it would). Each is
    reported (``keep``) as it lies where it landed: its size and checksum."""

    def __init__(self, create: StagedFiles | None):
        self.create = create
        self.open: dict[tuple[int, str], tuple[Sink, bool]] = {}
        """The sinks made and not yet closed, by source and path, and whether each is mapped."""
        self.failed: BaseException | None = None

    def into(self, source: int, listing: list[tuple[str, int]]) -> list[Any] | None:
        """The courier's ``into``: never raises (what fails is raised by ``keep``)."""
        import torch

        if self.create is None or self.failed is not None:
            return None
        buffers = []
        try:
            for path, size in listing:
                sink = self.create(path)
                try:
                    view = sink.space(size)
                except OSError:  # written once it arrived, as without a mapping: its write says why
                    view = None
                self.open[(source, path)] = (sink, view is not None or not size)  # an empty one: nothing to write
                buffers.append(torch.frombuffer(view, dtype=torch.uint8) if view is not None
                               else torch.empty(size, dtype=torch.uint8))
        except BaseException as err:
            self.failed = err
            return None
        return buffers

    def keep(self, source: int, packed: Packed) -> list[dict[str, Any]]:
        """The entries of ``source``'s files, each closed where it landed (written, if not mapped)."""
        if self.failed is not None:
            raise self.failed
        entries = []
        for path, content in unpacked(packed):
            sink, mapped = self.open.pop((source, path), None) or (self.create(path), False)
            if not mapped:
                entries.append(write_bytes_to(sink, content, path).model_dump(mode="json"))
                continue
            try:
                entry = FileEntry(path=path, bytes=len(content), xxh3_64=checksum(content))
                sink.close()
            except BaseException:
                sink.abort()
                raise
            entries.append(entry.model_dump(mode="json"))
        return entries

    def abort(self) -> None:
        """Drop every file made and not closed (the save failed)."""
        for sink, _ in self.open.values():
            with contextlib.suppress(Exception):
                sink.abort()
        self.open = {}


def held_files(snapshot: SnapshotCommit | None, files: list[FileEntry]) -> Packed:
    """The staged ``files`` as this node holds them, one tensor per file, as ``exchange_packed``
    sends them: a read-only use of the file's mapping where the storage maps files (a node-local
    tier: no copy; the pages are the page cache's, or the memory tier's own), else the file read
    into a buffer. A file whose size is not the one written raises IntegrityError (its part
    fails: the bytes its partners check must be all the bytes this node holds). Nothing here
    writes through a mapping, and nothing truncates a staged file while its snapshot is saved."""
    import torch

    contents = []
    for f in files:
        key = snapshot.key(f.path)
        mapped = snapshot.run.storage.mapped(key) if f.bytes else None
        size = len(mapped) if mapped is not None else snapshot.run.storage.size(key)
        if size != f.bytes:
            raise IntegrityError(f"{snapshot.run.storage.where(key)}: {size} bytes stored, {f.bytes} written")
        if mapped is not None:
            contents.append(torch.frombuffer(mapped, dtype=torch.uint8))
            continue
        content = torch.empty(f.bytes, dtype=torch.uint8)
        if f.bytes:
            snapshot.run.storage.read_into(key, 0, memoryview(content.numpy()))
        contents.append(content)
    return [(f.path, f.bytes) for f in files], contents


def _only(packed: Packed, paths: set[str]) -> Packed:
    """The files of ``packed`` named in ``paths`` (the same tensors, no copy)."""
    kept = [(named, content) for named, content in zip(*packed) if named[0] in paths]
    return [named for named, _ in kept], [content for _, content in kept]


def _announce(staged: StagedSnapshot, placement: NodePlacement, coord: Coordinator, round_: str,
              report: Any) -> dict[str, Any]:
    """Step 3: every rank's report to rank 0 (a failure re-raised on the rank that failed);
    rank 0's indexes and manifest (or its failure) to every rank."""
    if not coord.is_leader:
        coord.gather(f"{round_}/parts", report)
        return coord.broadcast(f"{round_}/indexes", None, patience=2.0)
    gather = functools.partial(coord.gather, f"{round_}/parts", report)
    return coord.broadcast(f"{round_}/indexes", functools.partial(_index, staged, placement, gather))


def _index(staged: StagedSnapshot, placement: NodePlacement, gather: Callable[[], list[Any] | None]) -> dict[str, Any]:
    """Rank 0's step 3, once ``gather()`` has every report: every copy checked, then the unit
    indexes and the manifest (recording the placement), as every node will write them."""
    reports = gather() or []
    staged.turn.parent_committed()  # an async save in flight before this one: committed on every node first
    _unopened(staged.step, placement, reports)
    parts = [RankPart.from_message(report["part"]) for report in reports]
    check_copies(staged.step, placement, parts, [report["copies"] for report in reports])
    indexes, manifest = index_files(replace(staged, notes={**staged.notes, "nodes": placement.record()}), parts)
    encoded = manifest.dumps()
    return {"indexes": {path: data.decode() for path, data in indexes.items()}, "manifest": encoded,
            "bytes": manifest.total_bytes() + len(encoded.encode())}


def check_copies(step: int, placement: NodePlacement, parts: list[RankPart], copies: list[dict[str, list[Any]]]) -> None:
    """Refuse to commit unless every rank's every file arrived at each of its partner ranks (and
    the global files at every node) as its writer wrote it: the same size and checksum."""
    wanted = [(rank, partner, files_of(part)) for rank, part in enumerate(parts) for partner in placement.partners(rank)]
    shared = [f for f in files_of(parts[0]) if writer_rank(f.path) is None]
    wanted += [(0, leader, shared) for leader in placement.global_receivers()]
    for rank, partner, files in wanted:
        arrived = {entry["path"]: (entry["bytes"], entry["xxh3_64"]) for entry in copies[partner].get(str(rank), [])}
        for file in files:
            if arrived.get(file.path) != (file.bytes, file.xxh3_64):
                raise TailorError(
                    f"step {step} was not committed: rank {partner} (node {placement.nodes.node_of_rank(partner)}) "
                    f"holds no copy of {file.path} of rank {rank} as written ({file.bytes} bytes, xxh3 {file.xxh3_64}; "
                    f"it got {arrived.get(file.path) or 'nothing'})")


def _commit_node(snapshot: SnapshotCommit, plan: dict[str, Any], confirm: Callable[[], None] | None,
                 turn: InTurn, files: StagedFiles, gate: Callable[[], None] | None = None) -> dict[str, Any]:
    """Step 4 on a node's leader: the indexes, written into ``files`` (its batch still in
    flight: its received copies), the manifest last, the commit and ``latest``, once the async
    save before this one (if still in flight) has ended on this node (its retention done). The
    commit drains ``files`` before it commits anything, and passes ``gate`` (``_gate``: a node
    but rank 0's) once all of it is durable, just before its rename. Returns
    ``{"unconfirmed": ...}``, or ``{"error": ...}`` with what was staged removed (every rank
    learns it in ``_settle``)."""
    try:
        with snapshot.abandoned_on_failure():
            turn.parent_committed()
            write_files(snapshot, {path: text.encode() for path, text in plan["indexes"].items()}, files)
            # ``latest`` replaced once committed, as the writer's own commit does (one recipe)
            unconfirmed = snapshot.commit(plan["manifest"].encode(), confirm, latest=True, pending=files, publish=gate)
    except BaseException as err:
        return {"error": describe_error(friendly(err, snapshot.run, snapshot.step))}
    return {"unconfirmed": unconfirmed}


def _gate(coord: Coordinator, round_: str, placement: NodePlacement, step: int) -> Callable[[], None]:
    """The node's gate (``Coordinator.claim_gate``), passed by a node's leader (not rank 0's)
    just before its commit publishes the snapshot, unless rank 0 gave up on this node's commit
    first (``_verdict``): then it raises, and nothing is committed here."""
    node = placement.nodes.node_of_rank(coord.rank)
    return functools.partial(coord.claim_gate, gate_tag(round_, node), lambda rank: TailorError(
        f"step {step} was not committed on node {node}: rank {rank} gave up waiting for its commit first"))


def _verdict(step: int, placement: NodePlacement, coord: Coordinator, round_: str,
             committed: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's step 4: how every node's commit went (``committed``: its own node's), the same
    word for every rank (``_settle``). Each other node's leader's report is waited for while it
    advances (``collect``); one silent for the timeout is given up on: rank 0 claims its gate
    (``Coordinator.give_up_gate``), so it never commits the snapshot, and the save fails on every rank; where
    the node passed its gate first, it commits (or did), and the save counts as committed there,
    unconfirmed. ``{"failed": why, "silent": bool}`` or ``{"unconfirmed": {node: why}, "spare": ...}``."""
    nodes = placement.nodes
    leaders = {nodes.leader_of(node): f"{round_}/committed/{node}" for node in range(1, nodes.count)}
    outcomes, silent = {0: committed}, None
    try:
        outcomes.update(coord.collect(leaders, f"on its commit of step {step}"))
    except CoordinationError as err:
        silent = str(err)
        for rank, tag in leaders.items():
            posted, said = coord.poll(tag)
            if not posted and not coord.give_up_gate(gate_tag(round_, nodes.node_of_rank(rank))):
                posted, said = coord.poll(tag)  # past its gate: it commits there (or did)
                if not posted:
                    posted, said = True, {"unconfirmed": f"its commit was not confirmed within {coord.timeout:g} s "
                                                         "(the snapshot is published there unless that commit fails)"}
            if posted:
                outcomes[rank] = said
    failed = {nodes.node_of_rank(rank): o["error"] for rank, o in outcomes.items() if "error" in o}
    abandoned = sorted(nodes.node_of_rank(rank) for rank in set(leaders) - set(outcomes))
    if failed or abandoned:
        where = "; ".join(f"node {node}: {why}" for node, why in sorted(failed.items()))
        gave_up = f"{silent}; rank 0 gave up on the commit of node(s) {abandoned}, which never commit it; " if abandoned else ""
        return {"failed": f"{gave_up}step {step} was not saved: node(s) {sorted([*failed, *abandoned])} could not commit "
                          f"it{f' ({where})' if where else ''}", "silent": bool(abandoned),
                "committed": sorted(nodes.node_of_rank(rank) for rank in outcomes if "error" not in outcomes[rank])}
    return {"unconfirmed": {str(nodes.node_of_rank(rank)): o["unconfirmed"] for rank, o in outcomes.items()},
            "spare": committed.get("spare", [])}


def _settle(snapshot: SnapshotCommit, staged: StagedSnapshot, placement: NodePlacement, coord: Coordinator,
            round_: str, committed: dict[str, Any] | None) -> tuple[str | None, tuple[int, ...]]:
    """Step 4's outcome on every rank, rank 0's word (``_verdict``): each other node's leader
    reports how its commit went (``committed``: this rank's node's, on its leader), rank 0 says
    how the save went. When a node failed (or rank 0 gave up on it), the nodes that committed
    remove their copy again and every rank raises alike, naming each failed node and why, and
    which node kept its copy (``_undo``).
    Returns what each node's commit could not confirm once committed (``PersistResult.unconfirmed``:
    the same on every rank, so every rank raises it alike) and rank 0's ``spare``. A rank that
    loses rank 0 here keeps its node's copy as it is (a crash between the nodes' commits)."""
    node = placement.nodes.node_of_rank(coord.rank)
    if committed is not None and not coord.is_leader:
        coord.post(f"{round_}/committed/{node}", committed)
    assert committed is not None or not coord.is_leader  # rank 0 leads node 0
    verdict = coord.broadcast(f"{round_}/settled", functools.partial(_verdict, staged.step, placement, coord, round_,
                                                                      committed) if coord.is_leader else None, patience=2.0)
    if "failed" in verdict:
        undone = _undo(snapshot.run, staged, placement, coord, round_, verdict["committed"], committed)
        raise (CoordinationError if verdict["silent"] else TailorError)(f"{verdict['failed']}; {undone}")
    unconfirmed = {int(n): why for n, why in verdict["unconfirmed"].items()}
    return "; ".join(f"node {n}: {why}" for n, why in sorted(unconfirmed.items()) if why) or None, tuple(verdict["spare"])


def _undo(run: Run, staged: StagedSnapshot, placement: NodePlacement, coord: Coordinator, round_: str,
          committed: list[int], mine: dict[str, Any] | None) -> str:
    """A save that failed on some node: each node of ``committed`` (rank 0's word) removes its
    copy again (``_uncommit``, on its leader: ``mine``, how its own commit went; one that failed
    after rank 0 gave up waiting for it holds no copy) and says how that went; every rank returns the
    same account of every such node for its error. A node whose copy stayed is named on every
    rank, not only on its own (the others would otherwise say its copy was removed, where it is
    that node's newest composite); a node whose leader does not say within the timeout is named
    as one that did not say."""
    nodes = placement.nodes
    node, tags = nodes.node_of_rank(coord.rank), {nodes.leader_of(n): f"{round_}/undone/{n}" for n in committed}
    if coord.rank in tags:
        assert mine is not None  # a node's leader
        try:
            undone = _uncommit(run, staged, node) if "error" not in mine else \
                f"node {node} holds no copy (its commit failed: {mine['error']})"
        except Exception as err:  # said on every rank, as a copy kept
            undone = f"node {node} may keep its copy of step {staged.step} in {run.root}: removing it failed ({describe_error(err)})"
        coord.post(tags[coord.rank], undone)
    said: dict[int, Any] = {}
    try:
        said = coord.collect(tags, f"whether it removed its copy of step {staged.step}") if tags else {}
    except CoordinationError:  # the ones that did say, then (none where the job's store is gone)
        with contextlib.suppress(CoordinationError):
            said = {rank: value for rank, tag in tags.items() for posted, value in [coord.poll(tag)] if posted}
    removed = [n for n in committed if nodes.leader_of(n) in said and said[nodes.leader_of(n)] is None]
    unsaid = [n for n in committed if nodes.leader_of(n) not in said]
    account = [f"node(s) {removed} removed their copy"] if removed else []
    account += [said[nodes.leader_of(n)] for n in committed if said.get(nodes.leader_of(n)) is not None]
    if unsaid:
        account.append(f"node(s) {unsaid} did not say within {coord.timeout:g} s whether they removed their copy")
    return "; ".join([*account, "every earlier snapshot is intact"])


def _uncommit(run: Run, staged: StagedSnapshot, node: int) -> str | None:
    """Remove this node's copy of a snapshot another node could not commit, and point
    ``latest`` back at its parent (the newest composite is the same on every node again).
    Where the copy could not be removed (a reader holds it, the disk refused the rename), it
    stays committed there, this node's newest composite (``latest`` is followed forward to it):
    returns that, and why, for every rank's error to say (``_undo``), not that it removed it."""
    outcome = discard_snapshots(run, [staged.step])
    if staged.step not in outcome.deleted:
        why = "; ".join(outcome.problems) or "a reader holds it"
        return f"node {node} kept its copy of step {staged.step} in {run.root}, committed ({why})"
    if staged.parent is not None:
        replace_latest(run, staged.parent)
    return None
