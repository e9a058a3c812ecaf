"""A node-local tier's recovery carried out (planned in ``recovery.py``), collectively: each
node's leader lists its copy (``held_here``); rank 0 plans; the files a node lacks travel from
the leader of a node holding them to its own leader over the courier (``Courier.exchange``),
each checked against the checksum its manifest or index records before it is kept
(``received``), and committed into that node's copy (``keep``): a snapshot the node lacked with
the snapshot commit protocol (its files staged, the manifest last, then the rename), a file
missing from a snapshot it holds written into place. Nothing is committed on any node unless
every file it receives checks out.

``recover`` (before a restore) and ``clear_unwhole`` (at a writer's start) are the whole of it:
``survey`` gathers the holdings; ``heal`` moves and commits; ``clear`` removes from every node
what ``recovery.clearing`` names. Each is collective over the job's ranks (every rank calls it,
in the same order); what happens on a node is done by its leader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmtailor.constants import MANIFEST_FILE, writer_rank
from llmtailor.distributed.coordinator import Coordinator
from llmtailor.distributed.courier import Courier, Files
from llmtailor.distributed.nodes import Nodes
from llmtailor.errors import IntegrityError, TailorError
from llmtailor.store.checked import write_bytes_to
from llmtailor.store.commit import SnapshotCommit
from llmtailor.store.retention import discard_snapshots
from llmtailor.store.run import Run
from llmtailor.store.tensor_files import checksum
from llmtailor.store.tiers.recovery import (
    Held, Holdings, NodeChoice, Transfer, choose_on_nodes, clearing, healing, of_json, served_by,
)


def recover(run: Run, nodes: Nodes, courier: Courier, coordinator: Coordinator,
            step: int | None) -> tuple[NodeChoice, dict[int, list[int]]]:
    """Collective, before a restore: the composite the node-local tier at ``run`` offers (of
    ``step``, default the newest whole one: ``recovery.choose_on_nodes``), every node's copy of
    it made whole first (``heal``); and which nodes' copies served which node (``served_by``).
    A healing that fails offers nothing, saying why (the restore goes to the next tier)."""
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
    if moves:
        try:
            heal(run, moves, nodes, courier, coordinator, f"{round_}/healed")
        except IntegrityError as err:
            return NodeChoice(None, {**choice.skipped, chosen: f"node-local tier: {err}"}), {}
    return choice, served_by(moves)


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
    """Collective: carry out ``moves`` (every rank holds the same list): one exchange per
    snapshot, leader to leader; each leader checks what it received and commits it into its
    copy (``keep``). Every rank raises IntegrityError naming the node and file when any node's
    part failed (what a node had not committed is left as it was)."""
    rank, error = coordinator.rank, None
    node = nodes.node_of_rank(rank)
    for step in sorted({move.step for move in moves}, reverse=True):
        these = [move for move in moves if move.step == step]
        outgoing, sources = _sending(run, these, node, nodes) if leads(nodes, rank) else ({}, [])
        received = courier.exchange(outgoing, sources)
        if error is None and leads(nodes, rank):
            error = _kept_or_error(run, step, [m for m in these if m.dest == node], received, nodes)
    failures = [why for why in coordinator.exchange(tag, error) if why]
    if failures:
        raise IntegrityError(f"healing the node-local tier failed: {'; '.join(failures)}")


def _sending(run: Run, moves: list[Transfer], node: int, nodes: Nodes) -> tuple[dict[int, Files], list[int]]:
    """This leader's side of one exchange: the files it sends, by destination leader, and the
    leaders it receives from. A file it cannot read goes out empty (its receiver reports it)."""
    outgoing: dict[int, Files] = {}
    for move in moves:
        if move.source == node:
            outgoing.setdefault(nodes.leader_of(move.dest), []).append((move.path, _read(run, move)))
    sources = sorted({nodes.leader_of(move.source) for move in moves if move.dest == node})
    return outgoing, sources


def _read(run: Run, move: Transfer) -> bytes:
    try:
        return bytes(run.storage.read(f"{run.snapshot_key(move.step)}/{move.path}"))
    except (TailorError, OSError):
        return b""


def _kept_or_error(run: Run, step: int, moves: list[Transfer], received: dict[int, Files], nodes: Nodes) -> str | None:
    try:
        keep(run, step, received_files(moves, received, nodes))
    except (TailorError, OSError) as err:
        return f"node {moves[0].dest if moves else '?'}: {err}"
    return None


def received_files(moves: list[Transfer], received: dict[int, Files], nodes: Nodes) -> dict[str, bytes]:
    """The files of one snapshot this node was sent, by path, each checked against its move's
    size and checksum: IntegrityError naming the file and the node that sent it otherwise."""
    by_sender = {(nodes.node_of_rank(rank), path): content for rank, files in received.items() for path, content in files}
    kept = {}
    for move in moves:
        content = by_sender.get((move.source, move.path))
        if content is None or len(content) != move.bytes or checksum(content) != move.xxh3:
            got = "nothing" if content is None else f"{len(content)} bytes, xxh3 {checksum(content)}"
            raise IntegrityError(f"step {move.step}: {move.path} from node {move.source}: got {got}, expected "
                                 f"{move.bytes} bytes, xxh3 {move.xxh3}")
        kept[move.path] = content
    return kept


def keep(run: Run, step: int, files: dict[str, bytes]) -> None:
    """Commit ``files`` (checked) of the snapshot of ``step`` into this node's copy: a snapshot
    not committed here with its manifest last (``SnapshotCommit``); into one committed here,
    each file written into place (its manifest is already there)."""
    if not files:
        return
    if step in run.steps():
        with run.storage.batch() as batch:
            for path, content in files.items():
                write_bytes_to(batch.create(f"{run.snapshot_key(step)}/{path}"), content, path)
        return
    if MANIFEST_FILE not in files:
        raise IntegrityError(f"step {step}: its manifest did not arrive, so it cannot be committed here")
    snapshot = SnapshotCommit.begin(run, step)
    with snapshot.abandoned_on_failure():
        with snapshot.files() as create:  # the parts first, then indexes and global files
            for path in sorted(files, key=lambda path: (writer_rank(path) is None, path)):
                if path != MANIFEST_FILE:
                    write_bytes_to(create(path), files[path], path)
        snapshot.commit(files[MANIFEST_FILE])
    run.forget([step])


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
