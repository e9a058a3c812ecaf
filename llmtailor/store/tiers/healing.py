"""A node-local tier's recovery carried out (planned in ``recovery.py``), collectively: each
node's leader lists its copy (``held_here``); rank 0 plans; the files a node lacks travel from
the leader of a node holding them to its own leader over the courier (``Courier.stream``: read
straight into the buffer sent, checked and written while the next file travels), each checked
against the checksum its manifest or index records before it is written, and committed into
that node's copy (``Receiving``): a snapshot the node lacked with the snapshot commit protocol
(its files staged, the manifest last, then the rename), a file missing from a snapshot it holds
written into place. Nothing is committed on any node unless every file it receives checks out.

``recover`` (before a restore) and ``clear_unwhole`` (at a writer's start) are the whole of it:
``survey`` gathers the holdings; ``heal`` moves and commits; ``clear`` removes from every node
what ``recovery.clearing`` names. Each is collective over the job's ranks (every rank calls it,
in the same order); what happens on a node is done by its leader.

A sender reads the snapshot it sends from under a read lease, as every reader of a node's copy
does (the restore that follows, a collective promotion's uploads: ``collective.py``): nothing of
this writer removes snapshots from a node's copy while it heals (its retention runs after a
save's commit, settled before a restore; ``llmtailor gc`` needs the node's writer lock), but the
lease makes that hold whoever else runs retention there. A snapshot gone all the same is sent
as nothing, which its receiver refuses (``Receiving``): never a part in half. A lease that
cannot be taken (its file refused: a full disk) is logged and the snapshot sent all the same,
its receivers checking every file as always: they wait for this stream, and would otherwise
wait until their timeout.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

from llmtailor.constants import MANIFEST_FILE, RANKS_DIR, writer_rank
from llmtailor.distributed.coordinator import CoordinationError, Coordinator
from llmtailor.distributed.courier import Courier
from llmtailor.distributed.nodes import Nodes
from llmtailor.distributed.progress import Scope, carried, within
from llmtailor.errors import IntegrityError, NodeTierError, TailorError
from llmtailor.store.catalog import ReadLeases
from llmtailor.store.checked import closed, write_to
from llmtailor.store.commit import SnapshotCommit
from llmtailor.store.manifest import Manifest, parse_manifest
from llmtailor.store.retention import discard_snapshots
from llmtailor.store.run import Run
from llmtailor.store.storage.base import Sink
from llmtailor.store.tensor_files import checksum
from llmtailor.store.tiers.recovery import (
    Held, Holdings, NodeChoice, Transfer, choose_on_nodes, clearing, healing, of_json, served_by,
)

_log = logging.getLogger(__name__)


def recover(run: Run, nodes: Nodes, courier: Courier, coordinator: Coordinator,
            step: int | None) -> tuple[NodeChoice, dict[int, list[int]], Healing | None]:
    """Collective, before a restore: the composite the node-local tier at ``run`` offers (of
    ``step``, default the newest whole one: ``recovery.choose_on_nodes``), every node's copy of
    it made whole first (``Healing``); which nodes' copies served which node (``served_by``);
    and the healing still under way, or None. Where rank 0's node receives files (rank 0 chooses
    from its own copy), or a node of several ranks receives files of a snapshot it holds
    (``committed_first``), the healing ends (on every rank) before this returns, and one that
    failed offers nothing, saying why (the restore goes to the next tier). Otherwise it runs on
    beside the restore, which reads each file as it arrives (``UnitReader.coming``; on a node of
    several ranks, its other ranks each file its leader received and staged: ``NodePosts``) and
    takes its outcome before the ranks agree (``Tailor.restore``: a failure there passes the
    tier over as this would have: the same healing is the same on every rank)."""
    round_ = coordinator.new_round()
    holdings = survey(run, nodes, coordinator, f"{round_}/held")

    def plan() -> dict[str, Any]:
        assert holdings is not None  # rank 0's
        choice = choose_on_nodes(holdings, nodes.node_of, step)
        return {"choice": choice, "moves": healing(holdings, choice.step) if choice.step is not None else []}

    planned = coordinator.broadcast(f"{round_}/plan", plan if coordinator.is_leader else None)
    chosen, skipped = planned["choice"]
    choice = NodeChoice(chosen, {int(s): why for s, why in skipped.items()})
    moves = [Transfer(*move) for move in planned["moves"]]
    if not moves:
        return choice, {}, None
    settled = settled_first(moves, nodes)
    under_way = Healing(run, moves, nodes, courier, coordinator.rank,
                        None if settled else NodePosts(coordinator, f"{round_}/staged"))
    if not settled:
        return choice, served_by(moves), under_way
    try:
        settle(under_way, coordinator, f"{round_}/healed")
    except IntegrityError as err:
        return passed_over(choice, str(err)), {}, None
    return choice, served_by(moves), None


def settled_first(moves: list[Transfer], nodes: Nodes) -> bool:
    """Whether a healing of ``moves`` ends before the restore: where rank 0's node receives
    (rank 0 chooses from its copy), or a node whose copy must be committed first does
    (``committed_first``)."""
    receiving = {move.dest for move in moves}
    return nodes.node_of_rank(0) in receiving or any(committed_first(moves, nodes, node) for node in receiving)


def committed_first(moves: list[Transfer], nodes: Nodes, node: int) -> bool:
    """Whether what ``node`` receives in a healing is committed into its copy before the restore
    reads it: where the node runs several ranks (only its leader receives) and a snapshot it
    receives files of is one it holds already (they are written into place: its other ranks read
    them from the copy). A snapshot new there is staged whole (``Receiving``): its other ranks
    read each file from where it is staged once the leader posted it (``NodePosts``,
    ``_Following``)."""
    return followed(nodes, node) and any(move.dest == node and not _new_there(moves, node, move.step) for move in moves)


def followed(nodes: Nodes, node: int) -> bool:
    """Whether ``node``'s other ranks read what its leader receives in a healing (it runs several
    ranks): its leader writes each file as it arrives and posts it (``NodePosts``). A node of one
    rank, the one reader, reads what arrived, and commits its copy once the restore ended
    (``Receiving._commit_later``). Stated here only: ``Healing`` and ``Receiving`` both ask."""
    return len(nodes.ranks_of(node)) > 1


def _new_there(moves: list[Transfer], node: int, step: int) -> bool:
    """Whether the snapshot of ``step`` is new on ``node`` (its manifest is among what it
    receives: ``recovery.healing`` moves none to a node that holds the snapshot committed)."""
    return any(move.dest == node and move.step == step and move.path == MANIFEST_FILE for move in moves)


def passed_over(choice: NodeChoice, why: str) -> NodeChoice:
    """``choice`` withdrawn: its composite passed over, ``why`` (a healing of it failed)."""
    return NodeChoice(None, {**choice.skipped, **({choice.step: f"node-local tier: {why}"} if choice.step is not None else {})})


def clear_unwhole(run: Run, nodes: Nodes, coordinator: Coordinator) -> dict[int, list[int]]:
    """Collective, at a writer's start: remove from every node's copy the snapshots above the
    newest composite whole across the nodes (``recovery.clearing``: a crash between the nodes'
    local commits or during replication left them); returns what each node removed."""
    round_ = coordinator.new_round()
    holdings = survey(run, nodes, coordinator, f"{round_}/held")
    planned = coordinator.broadcast(f"{round_}/doomed",
                                    (lambda: clearing(holdings, nodes.node_of)) if coordinator.is_leader else None)
    doomed = {int(node): steps for node, steps in planned.items()}
    clear(run, doomed, nodes, coordinator, f"{round_}/cleared")
    return doomed


def held_here(run: Run) -> dict[int, Held]:
    """What this node's copy holds (``recovery.Held``) of each committed snapshot; one whose
    manifest or indexes cannot be read counts as not held here."""
    run.settle_commits()  # what a healing left committing here (a failure kept for the next save to raise)
    held = {}
    with run.listed():
        for step in run.steps():
            try:
                held[step] = _held(run, step)
            except TailorError:
                continue
    return held


def _held(run: Run, step: int) -> Held:
    manifest = run.manifest(step)
    raw = bytes(run.storage.read(f"{run.snapshot_key(step)}/{MANIFEST_FILE}"))
    prefix = f"{run.snapshot_key(step)}/"
    present = {key[len(prefix):]: size for key, size in run.storage.walk(run.snapshot_key(step))}
    files = {entry.path: [entry.bytes, entry.xxh3_64] for entry in run.stored_files(step)}
    needs = sorted(run.needs(run.resolve(step)))
    return Held([len(raw), checksum(raw)], manifest.notes.get("nodes"), needs, files, present)


def leads(nodes: Nodes, rank: int) -> bool:
    """Whether ``rank`` is its node's leader (it acts for the node's copy)."""
    return nodes.leader_of(nodes.node_of_rank(rank)) == rank


def survey(run: Run, nodes: Nodes, coordinator: Coordinator, tag: str) -> Holdings | None:
    """Collective: every node's holdings (``held_here`` on each leader), on rank 0; None elsewhere.
    A node whose copy is empty holds nothing (its replacement starts so)."""
    mine = held_here(run) if leads(nodes, coordinator.rank) else None
    listed = coordinator.gather(tag, mine)
    if listed is None:
        return None
    found = {str(nodes.node_of_rank(rank)): held for rank, held in enumerate(listed) if held is not None}
    return of_json({**{str(node): {} for node in range(nodes.count)}, **found})


def heal(run: Run, moves: list[Transfer], nodes: Nodes, courier: Courier, coordinator: Coordinator,
         tag: str) -> None:
    """Collective: carry out ``moves`` (every rank holds the same list), to the end
    (``Healing``, then ``settle``). Every rank raises IntegrityError naming the node and file
    when any node's part failed (what a node had not committed is left as it was)."""
    settle(Healing(run, moves, nodes, courier, coordinator.rank), coordinator, tag)


def settle(under_way: Healing, coordinator: Coordinator, tag: str) -> None:
    """Collective: wait for every rank's part of a healing (``Healing.outcome``); every rank
    raises IntegrityError naming the node and file when any node's part failed. A node's part
    may outlast the timeout (a large copy to receive and write): the others wait on while it
    advances (``Coordinator.working``: its writes and fsyncs), one silent for the timeout is named."""
    with coordinator.working(under_way.progress):
        outcome = under_way.outcome()
    failures = [why for why in coordinator.exchange(tag, outcome) if why]
    if failures:
        raise IntegrityError(f"healing the node-local tier failed: {'; '.join(failures)}")


class Healing:
    """This rank's part of carrying out ``moves`` (every rank holds the same list): on a node's
    leader, one stream, leader to leader, of every snapshot's files (``Courier.stream``: each
    file read, sent, checked and written while the next one travels), on a thread of its own (the
    courier's group is its own: ``courier.py``), so that the caller goes on (the restore that
    follows reads each file as it arrives: the files go in the order it reads them,
    ``_sending``). Each leader checks what it receives and commits it into its copy, a
    ``Receiving`` per snapshot. Before the thread starts, every file this node receives is
    registered as coming (``UnitReader.coming``: a read of it waits for it, and raises where it
    failed) and a snapshot new here as being committed (``Catalog.commit_coming``); on the sending
    node, every file it sends (its own restore takes the bytes it checked as they went out:
    ``_Sender``). A failure of one snapshot's receiving leaves every other unwritten too (their
    readers raise it). ``outcome`` waits for the end. With ``posts``, a node of several ranks
    (``followed``): its leader posts each file it received, checked and staged, or the failure
    that stops it, then the end; each of its other ranks registers those files as coming, read
    from where they are staged once posted (``_Following``), and takes the end as its outcome."""

    def __init__(self, run: Run, moves: list[Transfer], nodes: Nodes, courier: Courier, rank: int,
                 posts: NodePosts | None = None):
        self.error: str | None = None
        """The first failure of this node's receiving (the node, the file and its sender)."""
        self.progress = Scope()
        """The healing's progress (its stream's, writes' and fsyncs'), which a wait for it shows
        as its own (``settle``, ``Tiers.settle_healing``: ``Coordinator.working``)."""
        self._failure: BaseException | None = None
        """A stream's own failure (a peer died, a timeout: ``CoordinationError``), raised by ``outcome``."""
        node = self._node = nodes.node_of_rank(rank)
        these = moves if leads(nodes, rank) else []
        received = [move for move in moves if move.dest == node]
        self._posts = posts if posts is not None and received and followed(nodes, node) else None
        self._following = (_Following(run, received, self._posts, nodes.leader_of(node))
                           if self._posts is not None and not these else None)
        self._receiving: dict[int, Receiving] = {}
        self._senders: dict[int, _Sender] = {}
        kept = Kept()  # the node's bound over every snapshot it receives, the newest's files kept first
        try:
            for step in sorted({move.step for move in these}, reverse=True):
                self._senders[step] = _Sender(run, step, [m for m in these if m.step == step], node)
                self._receiving[step] = Receiving(run, step, [m for m in these if m.step == step and m.dest == node],
                                                  nodes, kept=kept, posts=self._posts)
            self._outgoing, self._sources = _sending(these, node, nodes)
            with within(self.progress):
                work = carried(self._run)
            self._thread = threading.Thread(target=work, args=(run, courier), name="llmtailor-healing", daemon=True)
            self._thread.start()
        except BaseException as err:  # no stream: what was registered as coming or committing is let go
            self._failure = err
            self._settle()
            for receiving in self._receiving.values():
                receiving.withdraw()
            raise

    def _run(self, run: Run, courier: Courier) -> None:
        try:
            with ReadLeases(run) as leases:
                for step, sender in self._senders.items():
                    if sender.records:  # read under a lease (module docstring); one gone goes out as nothing: refused
                        try:
                            leases.take(step)
                        except (TailorError, OSError) as err:  # sent all the same: its receivers wait for the stream
                            _log.warning("llmtailor: healing sends step %d without a read lease: %s", step, err)
                if self._outgoing or self._sources:
                    courier.stream(self._outgoing, self._fill, self._sources, self._take, self._hand_over, self._land)
            for receiving in self._receiving.values():
                self.error = receiving.finish() or self.error
        except BaseException as err:  # the stream failed: every file not in yet fails its reader with it
            self._failure = err
        finally:
            self._settle()

    def _settle(self) -> None:
        """The stream ended (``_failure``: how it failed): every snapshot's receiving finished or
        abandoned, and every file of it and of each sender settled for its readers."""
        for step, sender in self._senders.items():
            try:
                if step in self._receiving:
                    self._receiving[step].abandon(self._failure)
            except BaseException as err:  # each snapshot's readers settled all the same (``finish``)
                self._failure = self._failure or err
            finally:
                sender.settle()
        if self._posts is not None and self._receiving:  # the node's other ranks take it as their outcome
            error = self.error or next((r.error for r in self._receiving.values() if r.error is not None), None)
            self._posts.end(self._node, error, self._failure)

    def _fill(self, dst: int, name: str, into: memoryview) -> Any:
        step, path = _unnamed(name)
        return self._senders[step].fill(dst, path, into)

    def _land(self, rank: int, name: str, size: int) -> memoryview | None:
        step, path = _unnamed(name)
        receiving = self._receiving.get(step)
        return receiving.land(rank, path, size) if receiving is not None else None

    def _take(self, rank: int, name: str, content: memoryview) -> None:
        step, path = _unnamed(name)
        receiving = self._receiving.get(step) or next(iter(self._receiving.values()))  # not asked for: refused there
        receiving.take(rank, path, content)
        if receiving.error is not None:  # nothing more written, of any snapshot
            for other in self._receiving.values():
                other.fail(receiving.error)

    def _hand_over(self) -> None:
        for sender in self._senders.values():
            sender.hand_over()

    def outcome(self) -> str | None:
        """Wait for the end: the first failure of this node's receiving, or None; a stream's own
        failure (``CoordinationError`` naming the rank) raised."""
        self._thread.join()
        if self._following is not None:
            self.error = self._following.outcome()
        for receiving in self._receiving.values():
            receiving.withdraw()
        if self._failure is not None:
            raise self._failure
        return self.error


def _named(step: int, path: str) -> str:
    """A snapshot's file as a stream of several snapshots names it (``_unnamed`` back)."""
    return f"{step}:{path}"


def _unnamed(name: str) -> tuple[int, str]:
    step, _, path = name.partition(":")
    return (int(step), path) if step.isdigit() else (-1, name)


def _sending(moves: list[Transfer], node: int, nodes: Nodes) -> tuple[dict[int, list[tuple[str, int]]], list[int]]:
    """This leader's side of a stream: the files it sends (``_named``, size), by destination
    leader, in the order the restore that follows reads them (``UnitReader.coming``): every
    snapshot's manifest, unit indexes and global state first (its checks read them), then the
    parts, unit by unit (in the natural order of their names: ``layer.2`` before ``layer.10``),
    the ranks' own state last; and the leaders it receives from. (A receiver writes a manifest
    last whatever the order: ``Receiving``.)"""
    def order(move: Transfer) -> tuple:
        return (writer_rank(move.path) is not None, move.path.startswith(f"{RANKS_DIR}/"), move.path != MANIFEST_FILE,
                [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", move.path)], -move.step)

    outgoing: dict[int, list[tuple[str, int]]] = {}
    for move in sorted(moves, key=order):
        if move.source == node:
            outgoing.setdefault(nodes.leader_of(move.dest), []).append((_named(move.step, move.path), move.bytes))
    sources = sorted({nodes.leader_of(move.source) for move in moves if move.dest == node})
    return outgoing, sources


class _Sender:
    """``Courier.stream``'s ``fill`` and ``meanwhile`` on a sending node. ``fill``: the file of
    the snapshot of ``step`` mapped and sent from the mapping (``Storage.mapped``: no copy into
    fresh memory), else read straight into the buffer that is sent. A file that cannot be read,
    or is not of the size recorded, goes out as the buffer was: its receiver's check refuses it.
    Nothing is checked before it goes: what is sent is checked where it arrives, against the
    checksum its move records (``Receiving``), the record this node checks against too.
    ``hand_over`` (``meanwhile``), once every send is posted and while they travel: each mapped
    file (``moves``: this node, ``node``, sends those whose ``source`` it is) is handed to this
    node's own restore, which runs meanwhile, unchecked (``UnitReader.unchecked``): the first
    read of it checks those bytes against what its move records, then copies them into its live
    tensors instead of reading and checking the file; one that does not match is read as any
    other (and the check fails there); one that restore never reads (a partner's part) is never
    hashed here.
    Every file this node sends is registered as coming for that restore (``UnitReader.coming``)
    until then: ``settle`` releases what was not handed over (read as any other file). A small
    file of no rank's part (the manifest, unit indexes, global state: ``writer_rank`` None) is
    handed over (or released) as soon as it is filled, before the parts' sends are posted: those
    are that restore's first reads (``shared_reads.share_small_files``, whose broadcast every
    other rank waits for), and their checks cost next to nothing beside the parts' sends."""

    def __init__(self, run: Run, step: int, moves: list[Transfer], node: int):
        self.run, self.step = run, step
        self.records = {move.path: (move.bytes, move.xxh3) for move in moves if move.source == node}
        self.sent: dict[str, memoryview] = {}
        """Path -> the mapping a file of ``records`` was sent from (the first, if sent twice)."""
        self.coming = {path: Future() for path in self.records}
        for path, coming in self.coming.items():
            run.units.coming[self._key(path)] = coming

    def _key(self, path: str) -> str:
        return f"{self.run.snapshot_key(self.step)}/{path}"

    def fill(self, dst: int, path: str, into: memoryview) -> Any:
        given = self._filled(path, into)
        if writer_rank(path) is None:  # the restore's first reads: not held up by the parts' sends (class docstring)
            self._hand(path)
        return given

    def _filled(self, path: str, into: memoryview) -> Any:
        key = self._key(path)
        try:
            mapped = self.run.storage.mapped(key)
            if mapped is not None and len(mapped) == len(into):
                if self.records.get(path, (None,))[0] == len(mapped):
                    self.sent.setdefault(path, mapped)
                return mapped
            self.run.storage.read_into(key, 0, into)
        except (TailorError, OSError, ValueError):
            pass
        except Exception as err:  # unforeseen: logged, never raised (the stream would end here: its receivers wait)
            _log.warning("llmtailor: healing could not read %s to send it (its receiver refuses it): %r", key, err)
        return None

    def hand_over(self) -> None:
        for path in self.sent:
            self._hand(path)
        self.settle()

    def _hand(self, path: str) -> None:
        """The file ``path`` handed to this node's restore, unchecked, if sent from a mapping of
        the size its record says, then released (its readers go on: from those bytes where they
        check out, else reading it); once."""
        coming = self.coming.get(path)
        if coming is None or coming.done():
            return
        mapped = self.sent.get(path)
        if mapped is not None:  # checked by its first reader, if any (``UnitReader.arrival``)
            self.run.units.unchecked[self._key(path)] = (*self.records[path], memoryview(mapped))
        _resolve(coming)

    def settle(self) -> None:
        """Every file not handed over read as any other (its check where it is read)."""
        for coming in self.coming.values():
            _resolve(coming)


def _resolve(coming: Future, failure: BaseException | None = None) -> None:
    """A file's arrival (``UnitReader.coming``) settled: its readers go on, or raise ``failure``."""
    if not coming.done():
        if failure is None:
            coming.set_result(None)
        else:
            coming.set_exception(failure)


HAND_OVER_BYTES = 1 << 30
"""The most bytes of received files a node keeps in memory for the restore that follows a
healing, over every snapshot it receives (``Kept``: one per healing, shared by its
``Receiving`` objects); past it, files are read back from the node's copy: a node healing hundreds of
GB must not hold them twice in host memory."""


class Kept:
    """The bytes of received files a healing keeps in memory for its restore, over every
    snapshot its node receives: at most ``HAND_OVER_BYTES`` (as it is when made) in all."""

    def __init__(self) -> None:
        self.left = HAND_OVER_BYTES

    def take(self, size: int) -> bool:
        """Whether ``size`` more bytes may be kept (then counted)."""
        if size > self.left:
            return False
        self.left -= size
        return True


class Receiving:
    """The files of the snapshot of ``step`` this node's leader receives (``moves``: those
    whose ``dest`` is this node), each checked against its move's size and checksum as it
    arrives (``take``) and only then written: into the staging place of a snapshot not
    committed here (``SnapshotCommit``), into place in one committed here. ``finish`` commits
    the staged snapshot, its manifest last, once every file arrived and checked out, and
    abandons it otherwise: nothing unchecked is written, nothing of a snapshot is visible
    before all of it is. The first failure is kept (``error``), naming the file and the node
    that sent it; what arrives after it is not written (nor anything, given ``failed``: the
    failure of an earlier snapshot). Each file is registered as coming from the start
    (``UnitReader.coming``: the restore that follows runs meanwhile, and a read of it waits), and
    handed to that restore as soon as it checked out (``UnitReader.arrived``); where the
    receiving failed, every file not handed over yet fails its readers with that failure (the
    file and its sender, or the stream's own), and, once that restore took the outcome
    (``withdraw``), what was handed over is withdrawn. A snapshot new here counts as committed in
    this process from the start (``Catalog.commit_coming``), until a failure is withdrawn. Files are written on a thread of their own (``_writer``)
    while the next ones arrive; one not kept for the restore (past the node's bound, ``kept``:
    ``HAND_OVER_BYTES`` over every snapshot of its healing) waits for
    the writes before it, so what is not handed over is never held in memory more than one file
    at a time. A new snapshot handed over whole is committed on that thread too
    (``_commit_later``): the restore reads what arrived meanwhile, not the node's copy; its
    writes wait until that restore has ended (``Catalog.hold_back``, or anything that waits for
    the commit: a save, ``close``, a listing of the copy), so the restore has the CPUs to itself.
    Any other is committed by ``finish``, once its writes are done."""

    def __init__(self, run: Run, step: int, moves: list[Transfer], nodes: Nodes, failed: str | None = None,
                 kept: Kept | None = None, posts: NodePosts | None = None):
        self.run, self.step, self.nodes = run, step, nodes
        self._posts = posts
        """Where the node's other ranks learn of each file written (``NodePosts``), or None."""
        self._budget = kept if kept is not None else Kept()
        """What this node keeps in memory for the restore, this snapshot's files and the others'
        of the same healing (``HAND_OVER_BYTES``)."""
        self._whole = False
        """Whether every file of this snapshot is kept (its bytes counted in ``_budget`` at once)."""
        self.expected = {(move.source, move.path): move for move in moves}
        self.error: str | None = failed
        self._arrived: dict[tuple[int, str], memoryview | None] = {}
        """Each file that arrived and checked out, as it arrived (None: past ``HAND_OVER_BYTES``,
        not kept)."""
        self._manifest: bytes | None = None
        self._parsed: Manifest | None = None
        self._staged: SnapshotCommit | None = None
        self._files = ExitStack()
        self._landed: dict[tuple[int, str], Sink] = {}
        """Files received straight into their staged file (``land``), by source and path, until
        taken (then closed, or removed where they do not check out) or dropped (``finish``)."""
        self._landing = threading.Lock()
        self._dest = moves[0].dest if moves else None
        self._later = self._dest is not None and not followed(nodes, self._dest)
        """Whether a new snapshot handed over whole may be committed once the restore ended
        (``_commit_later``)."""
        self._writer: ThreadPoolExecutor | None = None
        """Writes the files as they arrive (a new snapshot handed over whole: then commits it)."""
        self._writes: list[Future[None]] = []
        self._gate: threading.Event | None = None
        """What ``_writer`` waits for before it writes a snapshot handed over whole: the end of
        the restore that reads what arrived (``Catalog.hold_back``)."""
        self._finished = False
        self._failure: BaseException | None = None
        """What failed the stream itself (``abandon``), for the readers of what did not arrive."""
        self._coming = {key: Future() for key in self.expected}
        """Each file's arrival, for the restore that reads it meanwhile (``UnitReader.coming``)."""
        self._committed: Future[None] | None = None
        """This snapshot counted as committed here while it arrives (``Catalog.commit_coming``)."""
        if moves:
            self.run.forget([step])  # what this process read of its copy before (survey) is no more
            new = step not in self.run.steps()
            if failed is None:
                self._guarded(lambda: self._open(new))
            if new:  # even where it cannot be staged: the restore beside it fails on that error, every rank alike
                self._committed = self.run.commit_coming(step)
        for (_, path), coming in self._coming.items():
            self.run.units.coming[self._key(path)] = coming

    def _open(self, new: bool) -> None:
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="llmtailor-heal")
        if not new:
            batch = self._files.enter_context(self.run.storage.batch())
            self._create = lambda path: batch.create(f"{self.run.snapshot_key(self.step)}/{path}")
            return
        if not any(path == MANIFEST_FILE for _, path in self.expected):
            raise IntegrityError(f"step {self.step}: its manifest is not among the files to receive, so it cannot be "
                                 "committed here")
        self._staged = SnapshotCommit.begin(self.run, self.step)
        self._create = self._files.enter_context(self._staged.files())
        self._whole = self._later and self._budget.take(sum(move.bytes for move in self.expected.values()))
        if self._whole:  # all of it handed over
            self._gate = self.run.hold_back()
            self._writer.submit(carried(self._gate.wait))  # opened at the latest as the restore ends (``Tailor.restore``)

    def _key(self, path: str) -> str:
        return f"{self.run.snapshot_key(self.step)}/{path}"

    def land(self, rank: int, path: str, size: int) -> memoryview | None:
        """``Courier.stream``'s ``land``: a file of a snapshot new here received straight into
        its staged file's mapping (``Sink.space``), so that no buffer is written out after it (a
        copy of every byte and the buffer's fresh memory less, issue 32); else None (a fresh
        buffer): the manifest (kept in memory, written last by the commit), a snapshot written
        into place (where nothing unchecked may land), a storage that does not map, a file whose
        space could not be taken (its write says why). What lands is checked there before
        anything uses it (``take``), and the restore is handed a private mapping of it, never
        this shared one (``_own``); one that does not check out, or is never taken, is removed
        (``_drop_landed``), as the whole staging place is where the snapshot is abandoned.
        Never raises (the courier's receiving thread)."""
        try:
            source = self.nodes.node_of_rank(rank)
            move = self.expected.get((source, path))
            if self._staged is None or path == MANIFEST_FILE or move is None or move.bytes != size:
                return None
            with self._landing:
                if self.error is not None or self._finished or (source, path) in self._landed:
                    return None
                sink = self._create(path)
                try:
                    view = sink.space(size)
                except BaseException:
                    sink.abort()
                    raise
                if view is None:
                    sink.abort()
                    return None
                self._landed[(source, path)] = sink
            return view
        except Exception:  # noqa: BLE001 - received into a fresh buffer instead; its write says what fails
            return None

    def _drop_landed(self) -> None:
        """Remove every file that landed and was not taken (the stream ended before it)."""
        with self._landing:
            landed, self._landed = self._landed, {}
        for sink in landed.values():
            with contextlib.suppress(Exception):
                sink.abort()

    def take(self, rank: int, path: str, content: memoryview) -> None:
        """``Courier.stream``'s ``take``: one file from ``rank``, checked, then written (and
        handed to the restore that reads it meanwhile)."""
        if self.error is None:
            try:
                self._guarded(lambda: self._keep(self.nodes.node_of_rank(rank), path, content))
            except Exception as err:  # unforeseen: kept as any failure, not raised (the stream goes on to its end)
                self._failure = self._failure or err
                self.error = f"node {self._dest}: step {self.step}: {path}: {type(err).__name__}: {err}"
        if self.error is not None:
            self._fail_coming()

    def _keep(self, source: int, path: str, content: memoryview) -> None:
        move = self.expected.get((source, path))
        if move is None:
            raise IntegrityError(f"step {self.step}: {path} from node {source} was not asked for")
        with self._landing:
            landed = self._landed.pop((source, path), None)
        try:
            handed = self._own(path, content, landed)
            if len(handed) != move.bytes or checksum(handed) != move.xxh3:
                raise IntegrityError(f"step {self.step}: {path} from node {source}: got {len(handed)} bytes, xxh3 "
                                     f"{checksum(handed)}, expected {move.bytes} bytes, xxh3 {move.xxh3}")
        except BaseException:
            if landed is not None:  # its unchecked bytes removed at once
                landed.abort()
            raise
        keep = self._whole or self._budget.take(len(content))
        if path == MANIFEST_FILE and self._staged is not None:
            self._manifest = bytes(content)  # written last, by the commit
            self._parsed = parse_manifest(self._manifest, self.run.where(self.step, MANIFEST_FILE), self.step)
            self.run.remember(self._parsed)  # known here from now: the restore reading meanwhile may ask for it
        else:
            if not keep and landed is None:  # not held for the restore: held no longer than the writes before it take
                self._written()
            self._writes.append(self._writer.submit(carried(self._write), path, landed if landed is not None else content))
        self._arrived[(source, path)] = handed if keep else None
        if keep:  # its readers take it now (one past the bound is read from the copy once committed: ``finish``)
            self.run.units.arrived[self._key(path)] = (move.bytes, move.xxh3, handed)
            _resolve(self._coming[(source, path)])

    def _own(self, path: str, content: memoryview, landed: Sink | None) -> memoryview:
        """The bytes of ``path`` as they arrived (``content``) that the restore may be handed
        (``UnitReader.arrived``: private to this process, since a tensor restored from them may
        be kept live and written into by training) and that are checked: a file that landed in
        its staged file (``land``) mapped again, privately (copy on write: ``Storage.mapped``),
        never its shared mapping, which is the healed copy; a file in a fresh buffer whose write
        waits for the restore's end (``_whole``) copied, since it is written from that buffer
        once training may have begun; any other as it is (written before the restore ends)."""
        if landed is not None:
            mapped = self.run.storage.mapped(self._staged.key(path))
            return memoryview(mapped if mapped is not None else b"")
        if self._whole and path != MANIFEST_FILE:
            return memoryview(bytearray(content))
        return content

    def _write(self, path: str, content: memoryview | Sink) -> None:
        """The file ``path`` written (``content``), or, where it landed in its file (``land``:
        its sink), that file made durable; then posted to the node's other ranks (``NodePosts``)."""
        if isinstance(content, Sink):
            closed(content)
        else:
            write_to(self._create(path), content)
        if self._posts is not None:  # checked before it was written: the node's other ranks read it now
            at = self._staged.key(path) if self._staged is not None else self._key(path)
            self._posts.file(self._dest, self.step, path, {"at": at})

    def finish(self) -> str | None:
        """Commit what arrived (class docstring) or abandon it; the failure, or None. A new
        snapshot whose every file arrived, checked, and is kept for the restore is committed
        in the background (``_commit_later``). Once only (``abandon`` after it does nothing)."""
        if self._finished:
            return self.error
        self._finished = True
        try:
            return self._finish()
        except BaseException as err:  # unforeseen (not a TailorError nor an OSError): nothing of it committed
            self._failure = self._failure or err
            self.error = self.error or f"node {self._dest}: step {self.step}: {type(err).__name__}: {err}"
            if self._gate is not None:
                self._gate.set()
            if self._writer is not None:
                self._writer.shutdown(wait=True)  # no write (nor commit) runs on as it is abandoned
            self._drop_landed()
            with contextlib.suppress(BaseException):
                self._files.close()
            if self._staged is not None:
                with contextlib.suppress(TailorError, OSError):
                    self._staged.abandon()
            raise
        finally:
            self._settle_coming()  # no reader waits for ever, whatever failed

    def _finish(self) -> str | None:
        missing = [move for key, move in self.expected.items() if key not in self._arrived]
        if self.error is None and missing:
            move = missing[0]
            self.error = (f"node {self._dest}: step {self.step}: {move.path} from node {move.source}: got nothing, "
                          f"expected {move.bytes} bytes, xxh3 {move.xxh3}")
        if self._writer is not None:
            whole = self._later and self._staged is not None and None not in self._arrived.values()  # all of it handed over
            if self.error is None and whole:
                self._guarded(self._commit_later)
                if self.error is None:
                    self._settle_coming()
                    return None
            if self._gate is not None:
                self._gate.set()  # nothing to hold back: committed below, or abandoned
            self._writer.shutdown(wait=True)  # every write done: committed below, or abandoned
            self._guarded(self._written)
        self._drop_landed()
        self._guarded(self._files.close)  # every file written is durable (or the error says why)
        if self._staged is not None:
            if self.error is None:
                self._guarded(self._commit_staged)
            if self.error is not None:
                self._staged.abandon()
        self._settle_coming()
        return self.error

    def abandon(self, failure: BaseException | None) -> None:
        """The stream ended, ``failure`` (None: it ended well): ``finish`` unless done, that
        failure (the stream's own) failing the readers of every file that did not arrive."""
        if not self._finished:
            self._failure = failure
            if failure is not None:
                self.error = self.error or f"node {self._dest}: step {self.step}: the stream failed: {failure}"
            self.finish()

    def fail(self, why: str) -> None:
        """Another snapshot's receiving of the same stream failed (``why``): nothing more of this
        one is written, and the readers of what is not in raise it."""
        if not self._finished and self.error is None:
            self.error = why
            self._fail_coming()

    def withdraw(self) -> None:
        """Once the restore that read beside it took its outcome (``Healing.outcome``): where it
        failed, what was handed over withdrawn and this snapshot no longer counted as committed
        here. Not before: until then that restore's reads fail on the healing's error, not on a
        snapshot gone half-way (a lease refused on one rank only would leave the ranks' collective
        reads out of step)."""
        if self.error is not None and self._finished:
            for key, content in self._arrived.items():
                if content is not None:
                    self.run.units.arrived.pop(self._key(key[1]), None)
            if self._committed is not None:
                self.run.not_coming(self.step, self._committed)

    def _fail_coming(self) -> None:
        """The receiving failed: the readers of every file not handed over raise that failure,
        at once (not when the stream ends)."""
        failure = self._failure or IntegrityError(f"healing the node-local tier failed: {self.error}")
        for coming in self._coming.values():
            _resolve(coming, failure)
        if self._posts is not None:  # the node's other ranks' readers too (what was posted written stands)
            self._posts.failed(self._dest, self.step, [path for _, path in self.expected], failure)

    def _settle_coming(self) -> None:
        """At the end: where it failed, every reader of what was not handed over failed; else
        every file readable (one not handed over: from the copy, committed now)."""
        if self.error is not None:
            self._fail_coming()
        for coming in [*self._coming.values(), *([self._committed] if self._committed is not None else [])]:
            _resolve(coming)

    def _commit_later(self) -> None:
        """``finish`` of a new snapshot, every file checked and in memory: its writes (under
        way on ``_writer``) and its commit, manifest last, finish on that thread while the
        restore reads the arrived bytes; the run counts it as committed meanwhile
        (``Catalog.commit_later``). A write or commit that fails there abandons the staged
        snapshot, is logged at once, and is raised by every save of this node until a restore
        heals its copy again, and by ``close`` (``Tiers.settle_healing``): never lost."""
        done = self._writer.submit(carried(self._commit_written))
        self._writer.shutdown(wait=False)  # the thread ends once the commit ran
        self.run.commit_later(self._parsed, done)  # as it arrived (``_keep``)

    def _written(self) -> None:
        """Raise the first failure of the background writes (all of them done)."""
        for write in self._writes:
            write.result()

    def _commit_written(self) -> None:
        """On ``_writer``, after every write: the commit, or the staged snapshot abandoned."""
        try:
            try:
                self._written()
            finally:
                self._files.close()
            self._commit_staged()
        except BaseException as err:
            self._staged.abandon()
            message = f"node {self._dest}: step {self.step}: its healed copy could not be written: {err}"
            _log.error("%s", message)
            raise NodeTierError(message) from err

    def _commit_staged(self) -> None:
        """The staged snapshot's commit. Once it is visible in the node's copy it counts as healed
        there, whatever fails after (``store.commit``: the fsync of its name): that is logged (a
        crash of this node's machine may lose it; the other nodes' copies hold its parts), not
        taken for a failed healing, which would refuse every save of a copy that holds it."""
        unconfirmed = self._staged.commit(self._manifest, what="healed")
        if unconfirmed is not None:
            _log.warning("llmtailor: node %d: %s", self._dest, unconfirmed)

    def _guarded(self, action: Callable[[], Any]) -> None:
        try:
            action()
        except (TailorError, OSError) as err:
            self.error = self.error or f"node {self._dest}: {err}"


class NodePosts:
    """What the leader of a node of several ranks (``followed``) tells its other ranks of a
    healing that runs beside the restore, through the job's coordinator (``Coordinator.post``,
    tags under ``tag``): each file it received, checked, and wrote (where: ``{"at": key}``), or
    the failure that stops it (``{"error", "kind"}``), once per file, the first post standing; and
    the end of its receiving (``end``: its failure, the stream's or a file's, or none). The other
    ranks wait for them (``wait``: up to the coordinator's timeout, a CoordinationError naming
    the leader past it)."""

    def __init__(self, coordinator: Coordinator, tag: str):
        self.coordinator, self.tag = coordinator, tag
        self._posted: set[str] = set()
        self._lock = threading.Lock()

    def file(self, node: int, step: int, path: str, value: dict[str, Any]) -> None:
        name = f"{node}/{_named(step, path)}"
        with self._lock:
            if name in self._posted:
                return
            self._posted.add(name)
        self._post(name, value)

    def failed(self, node: int, step: int, paths: list[str], failure: BaseException) -> None:
        """Every file of ``paths`` not posted yet fails its readers with ``failure``."""
        for path in paths:
            kind = IntegrityError if isinstance(failure, IntegrityError) else type(failure)  # a DamagedFileError too
            self.file(node, step, path, {"error": str(failure), "kind": kind.__name__})

    def end(self, node: int, error: str | None, failure: BaseException | None) -> None:
        self._post(f"{node}/end", {"error": error, "failure": None if failure is None else str(failure)})

    def _post(self, name: str, value: dict[str, Any]) -> None:
        try:
            self.coordinator.post(f"{self.tag}/{name}", value)
        except TailorError as err:  # the store gone: the node's other ranks fail waiting, naming this rank
            _log.warning("llmtailor: healing could not tell the node's other ranks %s: %s", name, err)

    def wait(self, leader: int, name: str, what: str) -> dict[str, Any]:
        return self.coordinator.collect({leader: f"{self.tag}/{name}"}, what)[leader]


class _Following:
    """A healing on a node of several ranks (``followed``), on one of its ranks other than its
    leader, which alone receives: each file the node receives (``moves``; every snapshot new
    there, staged whole: ``committed_first``) registered as coming (``UnitReader.coming``) as a
    ``_Staged``, read from where the leader wrote it once posted; each snapshot counted as
    committed in this process meanwhile (``Catalog.commit_coming``), its manifest known from
    rank 0's (``share_manifests``). ``outcome``: the leader's end (``NodePosts.end``), what was
    handed over withdrawn where it failed, as the leader's ``Receiving.withdraw``."""

    def __init__(self, run: Run, moves: list[Transfer], posts: NodePosts, leader: int):
        self.run, self._posts, self._leader = run, posts, leader
        self._node = moves[0].dest
        self._committed: dict[int, Future[None]] = {}
        for step in sorted({move.step for move in moves}):
            run.forget([step])
            self._committed[step] = run.commit_coming(step)
        self._keys = [f"{run.snapshot_key(move.step)}/{move.path}" for move in moves if move.path != MANIFEST_FILE]
        for key, move in zip(self._keys, [move for move in moves if move.path != MANIFEST_FILE]):
            run.units.coming[key] = _Staged(run, move, posts, leader)

    def outcome(self) -> str | None:
        """Wait for the leader's end: its receiving's failure, or None; the stream's own failure
        (a peer died: naming it) raised as a CoordinationError."""
        try:
            ended = self._posts.wait(self._leader, f"{self._node}/end",
                                     f"the end of node {self._node}'s healing (its leader, rank {self._leader})")
        except BaseException:  # no word from the leader: nothing of it counts here (a later save must not wait for it)
            self._settle(failed=True)
            raise
        self._settle(failed=bool(ended["failure"] or ended["error"]))
        if ended["failure"]:
            raise CoordinationError(ended["failure"])
        return ended["error"]

    def _settle(self, failed: bool) -> None:
        """Each snapshot settled as committed here (the leader committed it) or, ``failed``,
        withdrawn with what this rank was handed of it."""
        for step, committed in self._committed.items():
            if failed:
                self.run.not_coming(step, committed)
            _resolve(committed)
        if failed:
            for key in self._keys:
                self.run.units.arrived.pop(key, None)


class _Staged:
    """A file the node's leader receives, for this rank's restore (``UnitReader.coming``):
    ``result`` waits for the leader's post (``NodePosts``), then maps the file where the leader
    wrote it (or where the leader's commit moved it meanwhile), checks it against the size and
    checksum of its move, and hands it over (``UnitReader.arrived``), once; it raises the
    healing's failure the leader posted in its place (IntegrityError naming the file and its
    sender, or the stream's CoordinationError naming the dead rank), or a mismatch."""

    def __init__(self, run: Run, move: Transfer, posts: NodePosts, leader: int):
        self.run, self.move, self._posts, self._leader = run, move, posts, leader
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def result(self) -> None:
        with self._lock:
            if not self._done:
                try:
                    self._take()
                except BaseException as err:
                    self._error = err
                self._done = True
        if self._error is not None:
            raise self._error

    def _take(self) -> None:
        move, key = self.move, f"{self.run.snapshot_key(self.move.step)}/{self.move.path}"
        posted = self._posts.wait(self._leader, f"{move.dest}/{_named(move.step, move.path)}",
                                  f"step {move.step}: {move.path} received (node {move.dest}'s leader)")
        if "error" in posted:
            raise (IntegrityError if posted["kind"] == IntegrityError.__name__ else CoordinationError)(posted["error"])
        content = self._mapped(posted["at"], key)
        if len(content) != move.bytes or checksum(content) != move.xxh3:
            raise IntegrityError(f"{self.run.storage.where(key)}: as node {move.dest}'s leader received and wrote it: "
                                 f"{len(content)} bytes, xxh3 {checksum(content)}, expected {move.bytes} bytes, xxh3 {move.xxh3}")
        self.run.units.arrived[key] = (move.bytes, move.xxh3, content)

    def _mapped(self, at: str, key: str) -> memoryview:
        """The file as written at ``at`` (staged), or at ``key`` once the leader's commit moved it there."""
        storage = self.run.storage
        try:
            mapped = storage.mapped(at)
        except (TailorError, OSError):
            mapped = storage.mapped(key)  # committed meanwhile: the staged snapshot was renamed into place
        return memoryview(mapped if mapped is not None else b"")


def clear(run: Run, doomed: dict[int, list[int]], nodes: Nodes, coordinator: Coordinator, tag: str,
          remove: Callable[[Run, list[int]], Any] = discard_snapshots) -> None:
    """Collective: each node's leader removes from its copy the snapshots ``doomed`` names for
    its node (``recovery.clearing``), as retention removes them (crash-safe; a failure logged)."""
    if leads(nodes, coordinator.rank):
        steps = doomed.get(nodes.node_of_rank(coordinator.rank), [])
        if steps:
            remove(run, steps)
            run.forget(steps)
    coordinator.exchange(tag, None)  # every copy cleared before anything reads or writes one
