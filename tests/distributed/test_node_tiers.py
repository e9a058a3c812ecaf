"""Node-local tiers (``Tier(scope="node", replicas=2)``) on two "nodes": two launches on loopback
as ``torchrun --nnodes 2`` (``helpers.node_launches``), each with its own memory directory and TMPDIR; the only directory they
share is the durable run directory. Each node's copy holds its own parts and its partner's, the
manifests are byte-identical, and a fresh launch at the same placement restores every tensor
equal to its composite version from its own node's copy. A node whose tier cannot be written, or
is full, fails the writer / the save on every rank, clearly, and loses nothing. An async save
staged behind one that fails on one node is lost with it on every node, and the next save
extends the last committed one. And the node launches themselves start each rank as torchrun
would, and end a node with its ranks (forked_nodes.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import LAUNCH_WAIT, launches_ended_well, node_launches, wait_launches

from llmtailor.constants import MANIFEST_FILE, writer_rank
from llmtailor.store.run import Run

JOB = Path(__file__).with_name("torch_job.py")
LAUNCH_JOB = Path(__file__).with_name("node_launch_job.py")
pytestmark = pytest.mark.slow


def launch(tmp_path: Path, scenario: str | list[str], per_node: int, **per_node_env: list[str]) -> list[dict]:
    """Two "nodes" of ``per_node`` ranks each run ``scenario`` (or several in turn, in one launch):
    node i in ``tmp_path/node<i>`` (its own TMPDIR and ``NODE_DIR``), ``RUN_HOME`` shared;
    ``per_node_env``: a value per node. Each rank's result (of the first scenario), by global rank."""
    scenarios = [scenario] if isinstance(scenario, str) else scenario
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUN_HOME": str(tmp_path / "home")}

    def env_of(node: int) -> dict[str, str]:
        own = tmp_path / f"node{node}"
        (own / "tmp").mkdir(parents=True, exist_ok=True)
        return {**base, "TMPDIR": str(own / "tmp"), "NODE_DIR": str(own / "memory"),
                **{name: values[node] for name, values in per_node_env.items()}}

    launches = node_launches(JOB, lambda node: [arg for name in scenarios for arg in (name, str(tmp_path / f"node{node}"))],
                             env_of, per_node=per_node)
    outputs = wait_launches(launches)
    launches_ended_well(launches, [err for _, err in outputs])
    return results_of(tmp_path, scenarios[0], per_node)


def results_of(tmp_path: Path, scenario: str, per_node: int = 2) -> list[dict]:
    """Each rank's result of ``scenario`` (on 2 nodes of ``per_node`` ranks), by global rank."""
    return [json.loads((tmp_path / f"node{rank // per_node}" / f"result-{scenario}-{rank}.json").read_text())
            for rank in range(2 * per_node)]


@pytest.mark.parametrize("kind, per_node", [("fsdp", 1), ("ddp", 2)])
def test_each_node_keeps_its_parts_and_its_partners_and_a_fresh_launch_restores_every_tensor(request, tmp_path, kind, per_node):
    if kind == "ddp":  # saved by the launch shared with the tests below
        tmp_path = request.getfixturevalue("two_ddp_nodes")
        saved = results_of(tmp_path, "nodes-ddp", per_node)
    else:
        saved = launch(tmp_path, f"nodes-{kind}", per_node)
    world = 2 * per_node
    copies = [Run(tmp_path / f"node{node}" / "memory") for node in range(2)]
    # keep=2 on each node alike: the composites of 3 and 4, and 2, which that of 3 needs; what a
    # save's retention passed over while node 0's promoter read it, close() removed.
    assert copies[0].steps() == copies[1].steps() == [2, 3, 4]
    for copy in copies:
        assert copy.verify() == []  # every file of every rank is here: its own parts and its partner's
        for step in copy.steps():
            ranks = {writer_rank(f.path) for unit in copy.manifest(step).units
                     for f in copy.unit_entry(step, unit).files} | {writer_rank(f.path) for f in copy.manifest(step).files}
            assert set(range(world)) <= ranks
    for step in (2, 3, 4):
        written = [(copy.snapshot_dir(step) / MANIFEST_FILE).read_bytes() for copy in copies]
        assert written[0] == written[1]
    node_of = [rank // per_node for rank in range(world)]
    assert copies[0].manifest(4).notes["nodes"] == {"node_of": node_of, "replicas": 2, "jump": 1}
    home = Run(tmp_path / "home")
    assert 4 in home.steps() and home.verify() == []  # promoted from node 0's copy at close
    assert saved[0]["promoted"][-1] == 4 and all(result["sent"] > 0 for result in saved)

    restored = launch(tmp_path, f"nodes-restore-{kind}", per_node)
    composite = copies[0].resolve(4)
    data = {f"{copies[0].snapshot_key(source if f.origin is None else f.origin)}/{f.path}"
            for unit, source in composite.sources.items()
            for f in copies[0].unit_entry(source, unit).files if f.origin != "base"}
    for rank, result in enumerate(restored):
        assert result["restored"] == 4 and result["extra"] == {"rank": rank}
        assert result["tier"] == str(tmp_path / f"node{node_of[rank]}" / "memory")  # its own node's copy
        if kind == "ddp":  # each node holds every unit: each rank reads them all from its own memory, none sent
            assert data <= set(result["read"]), sorted(data - set(result["read"]))
    assert restored[0]["mismatches"] == []  # rank 0 compares every tensor, whole (node 0 holds the versions)


@pytest.fixture(scope="module")
def two_ddp_nodes(tmp_path_factory) -> Path:
    """One launch of 2 nodes of 2 DDP ranks for the DDP case of the test above and the tests
    below: ``nodes-ddp``, ``nodes-single-ddp``, then ``nodes-pipelined`` (each with a node-local
    tier and a run directory of its own)."""
    tmp_path = tmp_path_factory.mktemp("nodes")
    launch(tmp_path, ["nodes-ddp", "nodes-single-ddp", "nodes-pipelined"], 2)
    return tmp_path


def test_with_one_replica_each_node_holds_its_own_parts_and_each_unit_is_read_where_it_is(two_ddp_nodes):
    """replicas=1 on 2 nodes of 2 DDP ranks: a node's copy holds only its own ranks' parts (its
    verify says the others are held on other nodes, not missing); the
    restore at the same placement has each unit read by a rank whose node holds its files, and
    every tensor equals its composite version (without the read plan's candidates rank 0 was
    given node 1's unit: "packs/rank-00002.0.safetensors: file is missing")."""
    tmp_path = two_ddp_nodes
    results = results_of(tmp_path, "nodes-single-ddp")
    copies = [Run(tmp_path / f"node{node}" / "single") for node in range(2)]
    for node, copy in enumerate(copies):
        files = {f.path for unit in copy.manifest(4).units for f in copy.unit_entry(4, unit).files}
        present = {path for path in files if (copy.snapshot_dir(4) / path).is_file()}
        assert {writer_rank(path) for path in present} <= {2 * node, 2 * node + 1, None} and present
        check = copy.check()  # the other node's files are held there, not missing
        assert check.problems == [] and check.checked == [1, 2, 3, 4]
        assert f"of the parts of node(s) [{1 - node}] are held on other nodes (this is node {node}'s copy" in check.notes[-1]
    for rank, result in enumerate(results):
        assert result["restored"] == 4 and result["extra"] == {"rank": rank}
        assert result["tier"] == str(tmp_path / f"node{rank // 2}" / "single")
    assert results[0]["mismatches"] == []


def test_a_save_staged_behind_one_that_fails_on_a_node_is_lost_with_it_everywhere(two_ddp_nodes):
    """Async saves into a node-local tier with replicas=2, two in flight: step 3 fails on node 1
    alone (in the background) while step 4 is saved behind it. Every rank raises one error
    naming step 3 and saying step 4 was not saved; neither is committed on any node (``latest``
    2); the next save extends step 2 (parent and save index); 6 and 7, both in flight at
    ``close()``, are committed in order on both nodes; restores of 2 and of 7 give every tensor's
    composite version."""
    tmp_path = two_ddp_nodes
    results = results_of(tmp_path, "nodes-pipelined")
    for result in results:
        failure = result["failure"] or ""
        assert "the async save of step 3 failed" in failure and "step 4" in failure, result
        assert "newest composite is still step 2" in failure, result
        assert result["latest"] == 2 and result["held"] == [1, 2], result
        assert result["steps"] == [1, 2, 5, 6, 7], result
        assert result["lineage"] == {"5": [2, 2], "6": [5, 3], "7": [6, 4]}, result
        assert result["restored 2"] == 2 and result["restored 7"] == 7
    assert results[0]["mismatches 2"] == [] and results[0]["mismatches 7"] == []
    for node in range(2):
        copy = Run(tmp_path / f"node{node}" / "pipelined")
        assert copy.verify() == [] and not any((Path(copy.root) / ".tmp").glob("*"))
    assert (Run(tmp_path / "node0" / "pipelined").snapshot_dir(7) / MANIFEST_FILE).read_bytes() == \
        (Run(tmp_path / "node1" / "pipelined").snapshot_dir(7) / MANIFEST_FILE).read_bytes()


def test_a_node_whose_tier_cannot_be_written_or_is_full_fails_every_rank_and_loses_nothing(tmp_path, small_fs):
    (tmp_path / "a-file").write_text("not a directory")
    full = small_fs / "memory"
    results = launch(tmp_path, "nodes-refused", 1,
                     UNWRITABLE_DIR=[str(tmp_path / "node0" / "fine"), str(tmp_path / "a-file" / "memory")],
                     FULL_DIR=[str(tmp_path / "node0" / "memory"), str(full)], FILL=["", "1"])
    for result in results:
        assert result["unwritable"].startswith("ConfigError: the node-local tier cannot be written on node(s) [1]: "
                                               "node 1: "), result
        assert str(tmp_path / "a-file") in result["unwritable"]
        assert "step 2" in result["full"] and "no space left" in result["full"], result
        assert result["restored"] == 1 and result["tier"] in (str(tmp_path / "node0" / "memory"), str(full))
    assert results[0]["mismatches"] == []
    # Nothing of the refused writer stayed anywhere; nothing of the failed save either.
    assert not (tmp_path / "unwritable").exists() and not (tmp_path / "node0" / "fine" / ".lock").exists()
    for copy in (Run(tmp_path / "node0" / "memory"), Run(full)):
        assert copy.steps() == [1] and copy.verify() == []
        assert not any((Path(copy.root) / ".tmp").glob("*"))


def test_the_node_launches_start_each_rank_as_torchrun_would_and_a_node_ends_with_its_ranks(tmp_path):
    """What the node tests depend on in their launches (``helpers.node_launches``: forked_nodes.py,
    in place of torchrun's agents), on 2 nodes of 2 ranks, with the fork servers of the tests above.
    Each rank gets torchrun's variables (node 0 hosting the store: its ranks meet through it), its
    node's TMPDIR and environment, a pid and session of its own, and a ``str`` hash seed and
    ``random`` state of its own. A rank that fails ends its node (its other rank ended, the node's
    status 1) and leaves the other node running; a node SIGKILLed as a whole (its process group)
    takes its ranks with it; with ``statuses_of`` each rank runs to its end."""
    def env_of(node: int) -> dict[str, str]:
        (tmp_path / f"node{node}" / "tmp").mkdir(parents=True, exist_ok=True)
        return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / f"node{node}" / "tmp"),
                "NODE_DIR": str(tmp_path / f"node{node}" / "memory")}

    def said(scenario: str, rank: int) -> dict:
        return json.loads((tmp_path / scenario / f"rank-{rank}.json").read_text())

    launches = node_launches(LAUNCH_JOB, lambda node: ["report", tmp_path / "report"], env_of, per_node=2)
    launches_ended_well(launches, [err for _, err in wait_launches(launches)])
    ranks = [said("report", rank) for rank in range(4)]
    for rank, seen in enumerate(ranks):
        node = rank // 2
        assert seen["env"] == {
            "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "GROUP_RANK": str(node), "ROLE_RANK": str(rank),
            "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ranks[0]["env"]["MASTER_PORT"],
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "NODE_DIR": str(tmp_path / f"node{node}" / "memory")}, rank
        assert seen["tmp"] == str(tmp_path / f"node{node}" / "tmp")
    for key in ("pid", "session", "random") + (("hash",) if "PYTHONHASHSEED" not in os.environ else ()):
        assert len({seen[key] for seen in ranks}) == 4, key

    launches = node_launches(LAUNCH_JOB, lambda node: ["fail", tmp_path / "fail"], env_of, per_node=2, own_session=True)
    wait_launches([launches[0]])  # rank 1 exited 3: node 0 ends rank 0
    assert launches[0].returncode == 1
    held = tmp_path / "fail" / "rank-2.json", tmp_path / "fail" / "rank-3.json"
    deadline = time.monotonic() + LAUNCH_WAIT  # the event: node 1's ranks started (a bound on a hang)
    while not all(path.exists() for path in held) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launches[1].poll() is None  # node 1 runs on
    os.killpg(launches[1].pid, signal.SIGKILL)
    wait_launches([launches[1]])
    pids = [said("fail", rank)["pid"] for rank in (0, 2, 3)]
    deadline = time.monotonic() + 120  # the event: they ended (a bound on a hang, no timing)
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)

    # With ``statuses_of``, a rank that fails ends no other: each runs to its end, and the node says
    # how each ended (the launches of the tests of a killed rank).
    statuses = tmp_path / "outlive.json"
    [launch] = node_launches(LAUNCH_JOB, lambda node: ["outlive", tmp_path / "outlive"], env_of, nodes=1, per_node=2,
                             statuses_of=lambda node: statuses)
    launches_ended_well([launch], [err for _, err in wait_launches([launch])])
    assert json.loads(statuses.read_text()) == [0, 3]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
