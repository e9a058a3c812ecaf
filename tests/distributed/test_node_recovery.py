"""Recovery of a node-local tier after a node loss, with real processes: each "node" is a
launch on loopback as ``torchrun --nnodes 2 --node_rank i`` (``helpers.node_launches``) with its own memory directory and TMPDIR
(no directory shared between nodes); the run's home is an ``s3://`` URL on moto's server.
Parity saves at every step, async, ``replicas=2`` (node_recovery_job.py). Each run is killed in
a launch of its own; the relaunches after the kills run the runs of several tests in turn (one
start-up for all), and what a test checks between two launches is recorded, or copied, then.

- A node SIGKILLed mid-training, its memory wiped, every node relaunched: the job resumes from
  memory, the replaced node's files sent by its partner (the report says which), every tensor
  equal to its composite version; then every node's memory wiped: it resumes from the object
  store, composite-exact, and says why the node-local tier was passed over. And, from memory
  only, with 2 ranks on each node: the replacement's second rank restores too (its leader
  alone receives the node's files).
- A node SIGKILLed while it sends its files of a save to its partner: no copy shows that save;
  every copy verifies; the job resumes from the save before; then node 0's memory (rank 0's)
  wiped: the job resumes from node 1's copy.
- Without replicas, a node SIGKILLed as it commits its copy of a save the other node committed:
  the next writer's start removes that save from every copy (it is not whole across the nodes);
  ``latest_step`` answers the save before on every rank. With replicas and the next save in
  flight, the same kill leaves that save whole in the other node's copy: the job resumes from it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import launches_ended_well, node_launches, wait_launches

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import environment, moto_process, new_bucket  # noqa: E402

from llmtailor.store.run import Run  # noqa: E402
from llmtailor.store.tiers.healing import held_here  # noqa: E402
from llmtailor.store.tiers.recovery import composite_problem, snapshot_problem  # noqa: E402

JOB = Path(__file__).with_name("node_recovery_job.py")
NODES = 2
pytestmark = pytest.mark.slow


class Job:
    """The nodes of one run on loopback: ``launch`` starts every node, ``results`` waits for them;
    ``together`` launches the nodes once for a turn of each of several runs."""

    def __init__(self, tmp_path: Path, endpoint: str, kind: str, nodes: int = NODES, per_node: int = 1):
        self.tmp_path, self.kind, self.nodes, self.per_node = tmp_path, kind, nodes, per_node
        self.env = {**os.environ, **environment(endpoint), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "RUN_HOME": f"s3://{new_bucket(endpoint)}/jobs/{kind}"}
        self.launches: list[subprocess.Popen] = []

    def own(self, node: int) -> Path:
        return self.tmp_path / f"node{node}"

    def memory(self, node: int) -> Path:
        return self.own(node) / "memory"

    def args(self, scenario: str, node: int, **env: str) -> list[str]:
        """This run's job on ``node`` (``node_recovery_job.py``'s arguments), with its own settings."""
        settings = {"RUN_HOME": self.env["RUN_HOME"], "NODE_DIR": str(self.memory(node)), **env}
        return [scenario, self.kind, str(self.own(node)), *(f"{name}={value}" for name, value in settings.items())]

    def launch(self, scenario: str, **env: str) -> None:
        together([(self, scenario, env)])

    def ranks(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def results(self, scenario: str) -> list[dict]:
        """Each rank's result (in rank order; a rank writes it in its node's directory)."""
        outputs = [out for out, _ in wait_launches(self.launches)]
        launches_ended_well(self.launches, outputs)
        return [json.loads((self.own(n) / f"result-{scenario}-{r}.json").read_text())
                for n in range(self.nodes) for r in self.ranks(n)]

    def lose(self, node: int) -> None:
        """Once ``node``'s ranks killed themselves (its launch ends), SIGKILL what is left of the
        others (their ranks by pid, then their launches): every node is down."""
        (out, err), = wait_launches([self.launches[node]])
        assert f"exited with {-signal.SIGKILL}" in out + (err or ""), f"node {node} was to kill itself; it ended so:\n{out}{err or ''}"
        for other in range(self.nodes):
            for rank in self.ranks(other):
                pid = self.own(other) / f"pid-{rank}"
                if other != node and pid.exists():
                    try:
                        os.kill(int(pid.read_text()), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                pid.unlink(missing_ok=True)
            self.launches[other].kill()
            wait_launches([self.launches[other]])

    def wipe(self, node: int) -> None:
        shutil.rmtree(self.memory(node), ignore_errors=True)

    def keep_copies(self, name: str) -> None:
        """A copy of every node's memory as it is now, at ``own(node)/name`` (for ``copies_whole``
        once a later launch has changed the memory)."""
        for node in range(self.nodes):
            if self.memory(node).exists():
                shutil.copytree(self.memory(node), self.own(node) / name, symlinks=True)

    def copies_whole(self, verify: bool = True, name: str = "memory") -> None:
        """Every snapshot in every node's copy (``own(node)/name``) is whole across the nodes
        (older ones kept only for what a newer composite reads included), the newest composite
        too, and (``verify``: each copy whole alone, with 2 copies on 2 nodes) each copy verifies."""
        copies = [self.own(n) / name for n in range(self.nodes)]
        holdings = {n: held_here(Run(copies[n])) for n in range(self.nodes)}
        for held in holdings.values():
            for step in held:
                assert snapshot_problem(holdings, step) is None, step
        assert composite_problem(holdings, max(s for held in holdings.values() for s in held)) is None
        for n in range(self.nodes if verify else 0):
            assert Run(copies[n]).verify() == [], n


def together(turns: list[tuple[Job, str, dict[str, str]]]) -> None:
    """One launch of the nodes (every run of ``turns`` has as many) running, in turn, each run's
    ``(job, scenario, env)``; each job's ``results`` waits for it."""
    first = turns[0][0]

    def env_of(node: int) -> dict[str, str]:
        (first.own(node) / "tmp").mkdir(parents=True, exist_ok=True)
        return {**first.env, "TMPDIR": str(first.own(node) / "tmp")}

    launches = node_launches(JOB, lambda node: [arg for job, scenario, env in turns for arg in job.args(scenario, node, **env)],
                             env_of, first.nodes, first.per_node, merged=True)
    for job, _, _ in turns:
        assert (job.nodes, job.per_node) == (first.nodes, first.per_node)
        job.launches = launches


@pytest.fixture(scope="module")
def endpoint():
    with moto_process() as url, pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in environment(url).items():
            monkeypatch.setenv(name, value)
        yield url


def lose_a_node(job: Job, lost: int) -> None:
    """Node ``lost`` SIGKILLed after the save of step 3 was handed over, its memory wiped."""
    job.launch("train", LAST="3", KILL_NODE=str(lost), KILL_AT="3", KILL_IN="training")
    job.lose(lost)
    job.wipe(lost)


def check_lost_then_every_node(job: Job, first: list[dict], second: list[dict], served_by: dict[str, list[int]]) -> None:
    """After ``lose_a_node``, the first resume came from memory (``check_lost``); after every
    node's memory was wiped, the second resume came from the object store, composite-exact.
    Each Parity composite from 2 on reads two snapshots (its own and the one before): as few
    steps as show that, each launch costs mostly its start."""
    check_lost(job, first, served_by)
    ranks = job.nodes * job.per_node
    assert [r["restored"] for r in second] == [4] * ranks
    assert second[0]["tier"] == job.env["RUN_HOME"] and second[0]["served_by"] == {}
    assert second[0]["mismatches"] == []


def check_lost(job: Job, first: list[dict], served_by: dict[str, list[int]]) -> None:
    """After ``lose_a_node``, the resume came from memory, each rank from its own node's copy
    (``served_by``: the nodes whose copies rebuilt the lost node's), composite-exact, then saved
    up to 4; every copy whole and verified."""
    restored, ranks = first[0]["restored"], job.nodes * job.per_node
    assert restored in (2, 3)  # 3 was in flight when the node died: committed on every node, or on none
    assert [r["latest"] for r in first] == [restored] * ranks and [r["restored"] for r in first] == [restored] * ranks
    # from memory, each rank its own node's copy
    assert [r["tier"] for r in first] == [str(job.memory(n)) for n in range(job.nodes) for _ in job.ranks(n)]
    assert [r["served_by"] for r in first] == [served_by] * ranks
    # rank 0 compares every tensor (each rank's shard gathered) with its version; the others' versions lie on node 0
    assert [r["mismatches"] for r in first] == [[]] * job.per_node + [None] * (ranks - job.per_node)
    assert first[0]["promoted"][-1] == 4
    healed_copy_verified_after_training(job, first)
    job.copies_whole(name="first")


def healed_copy_verified_after_training(job: Job, first: list[dict]) -> None:
    """Each node's copy, the replacement's healed one included, verified by its leader once the
    first step trained after the restore (into the optimizer's state the restore made, with no
    live tensor to land in) and that step's save committed (``verified_after_training``): the
    restore was handed bytes of its own, not the healed copy's."""
    leaders = [r % job.per_node == 0 for r in range(job.nodes * job.per_node)]
    assert [r["verified after training"] for r in first] == [[] if leader else None for leader in leaders]


def wipe_every_node(job: Job) -> None:
    for node in range(job.nodes):
        job.wipe(node)


def check_resumed_in_memory(job: Job, first: list[dict], held: list[list[int]], restored: int, last: int) -> None:
    """A resume after a kill, on 2 nodes: each node's copy held ``held`` once its writer started;
    every rank restored ``restored`` from its own node's memory (node 1's copy rebuilt from node
    0's), every tensor equal to its version; its saves up to ``last`` promoted. Every copy whole
    and verified, nothing staged left; the object store at ``last``, verified."""
    assert [r["held_at_start"] for r in first] == held
    assert [r["latest"] for r in first] == [restored] * NODES and [r["restored"] for r in first] == [restored] * NODES
    assert [r["tier"] for r in first] == [str(job.memory(n)) for n in range(NODES)]
    assert first[0]["served_by"] == {"1": [0]} and first[0]["mismatches"] == []
    assert first[0]["promoted"][-1] == last
    healed_copy_verified_after_training(job, first)
    job.copies_whole()
    assert all(not any((job.memory(n) / ".tmp").iterdir()) for n in range(NODES) if (job.memory(n) / ".tmp").exists())
    assert Run(job.env["RUN_HOME"]).latest_step() == last and Run(job.env["RUN_HOME"]).verify() == []


def node_0_commits(job: Job, step: int) -> bool:
    """Wait for node 0's own commit of ``step`` (the event; no timing asserted) while node 1 is
    down: whether it came."""
    wait_launches([job.launches[1]])
    committed = job.memory(0) / "snapshots" / f"step-{step:08d}" / "manifest.json"
    deadline = time.monotonic() + 600
    while not committed.exists() and time.monotonic() < deadline and job.launches[0].poll() is None:
        time.sleep(0.2)
    return committed.exists()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, endpoint) -> dict[str, tuple[Job, dict]]:
    """The runs of the 2-node tests below, each killed in a launch of its own, then their resumes
    (and the writer's start of ``commit``) in shared launches: by name, the run and what its test
    checks (``seen``: what was looked at between launches)."""
    runs = {"lost": Job(tmp_path_factory.mktemp("lost"), endpoint, "fsdp"),
            "replication": Job(tmp_path_factory.mktemp("replication"), endpoint, "ddp"),
            "commit": Job(tmp_path_factory.mktemp("commit"), endpoint, "fsdp"),
            "in flight": Job(tmp_path_factory.mktemp("in_flight"), endpoint, "fsdp")}
    seen: dict[str, dict] = {name: {} for name in runs}
    lose_a_node(runs["lost"], lost=1)

    job = runs["replication"]
    job.launch("train", LAST="6", KILL_NODE="1", KILL_AT="3", KILL_IN="replication")
    job.lose(1)
    seen["replication"]["steps after the kill"] = [Run(job.memory(n)).steps() for n in range(NODES)]

    job = runs["commit"]
    job.launch("train", LAST="6", KILL_NODE="1", KILL_AT="3", KILL_IN="commit", REPLICAS="1")
    seen["commit"]["node 0 committed 3"] = node_0_commits(job, 3)
    job.lose(1)
    seen["commit"]["node 1's steps"] = Run(job.memory(1)).steps()

    job = runs["in flight"]
    job.launch("train", LAST="6", KILL_NODE="1", KILL_AT="3", KILL_IN="commit", IN_FLIGHT="2")
    seen["in flight"]["node 0 committed 3"] = node_0_commits(job, 3)
    job.lose(1)
    seen["in flight"]["steps after the kill"] = [Run(job.memory(n)).steps() for n in range(NODES)] + [
        Run(job.env["RUN_HOME"]).steps()]
    job.keep_copies("killed")

    together([(runs["lost"], "resume", {"LAST": "4"}), (runs["replication"], "resume", {"LAST": "4"}),
              (runs["commit"], "start", {"REPLICAS": "1"}),
              (runs["in flight"], "resume", {"LAST": "5", "IN_FLIGHT": "2"})])
    seen["commit"]["start"] = runs["commit"].results("start")
    seen["in flight"]["first"] = runs["in flight"].results("resume")
    for name in ("lost", "replication"):
        seen[name]["first"] = runs[name].results("resume")
        runs[name].keep_copies("first")
    wipe_every_node(runs["lost"])
    runs["replication"].wipe(0)  # rank 0's node: it holds nothing now
    together([(runs["lost"], "resume", {}), (runs["replication"], "resume", {})])
    for name in ("lost", "replication"):
        seen[name]["second"] = runs[name].results("resume")
    return {name: (runs[name], seen[name]) for name in runs}


def test_a_lost_node_resumes_from_its_partners_memory_then_all_lost_from_the_object_store(two_nodes):
    job, seen = two_nodes["lost"]
    check_lost_then_every_node(job, seen["first"], seen["second"], served_by={"1": [0]})  # node 1's copy: node 0's replica


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory, endpoint) -> dict[str, tuple[Job, list[list[dict]]]]:
    """The FSDP2 and the DDP run on 3 nodes, each losing node 2 in a launch of its own, then
    both resumed in turn in each relaunch: by kind, the run and the results of both resumes."""
    runs = {kind: Job(tmp_path_factory.mktemp(kind), endpoint, kind, nodes=3) for kind in ("fsdp", "ddp")}
    for job in runs.values():
        lose_a_node(job, lost=2)
    together([(job, "resume", {"LAST": "4"}) for job in runs.values()])
    first = {kind: job.results("resume") for kind, job in runs.items()}
    for job in runs.values():
        job.keep_copies("first")
        wipe_every_node(job)
    together([(job, "resume", {}) for job in runs.values()])
    return {kind: (job, [first[kind], job.results("resume")]) for kind, job in runs.items()}


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_three_nodes_with_two_replicas_a_lost_node_is_rebuilt_from_two_holders_then_all_lost_from_the_object_store(
        three_nodes, kind):
    """3 nodes, ``replicas=2``: no node holds every part (node n holds n's and n-1's). Node 2, lost,
    held its own parts (also on node 0) and node 1's (also on node 1): its copy is rebuilt from
    both. FSDP2: its per-parameter ``step`` tensors, written by one rank, reach every node's ranks;
    DDP: each rank writes its share of the replicated state, read back at 3 ranks."""
    job, (first, second) = three_nodes[kind]
    check_lost_then_every_node(job, first, second, served_by={"2": [0, 1]})


def test_a_lost_node_of_two_ranks_is_replaced_from_its_partners_memory_every_rank_composite_exact(tmp_path, endpoint):
    """2 nodes of 2 ranks each (FSDP2 over 4 ranks: each rank's own shards and state), node 1
    (ranks 2 and 3) SIGKILLed and its memory wiped: the replacement's copy is rebuilt from node
    0's replica, its leader alone receiving it; its second rank (rank 3) reads each file its
    leader received and wrote as it arrives, not once the healing ended: rank 0 holds the last
    file of its stream until rank 3 has taken a file of that healing for its restore
    (``HOLD_LAST``: the events, no timing), then sends it. Every rank restores from its own
    node's copy, every tensor equal to its composite version."""
    job = Job(tmp_path, endpoint, "fsdp", per_node=2)
    lose_a_node(job, lost=1)
    job.launch("resume", LAST="4", HOLD_LAST="1", TIMEOUT="300")
    first = job.results("resume")
    job.keep_copies("first")
    assert first[0]["held"]["taken first"], first[0]["held"]
    assert first[3]["taken"].startswith("snapshots/step-")  # a file of the composite, from its leader
    check_lost(job, first, served_by={"1": [0]})


def test_a_node_killed_while_replicating_leaves_no_copy_of_that_save_and_rank_0s_node_heals_from_node_1(two_nodes):
    job, seen = two_nodes["replication"]
    assert all(3 not in steps for steps in seen["steps after the kill"])
    first = seen["first"]
    assert [r["restored"] for r in first] == [2, 2] and first[0]["served_by"] == {}
    assert first[0]["mismatches"] == []
    job.copies_whole(name="first")
    assert all(not any((job.own(n) / "first" / ".tmp").iterdir()) for n in range(NODES) if (job.own(n) / "first" / ".tmp").exists())

    second = seen["second"]  # after rank 0's node was wiped: it held nothing
    assert [r["restored"] for r in second] == [4, 4]
    assert second[0]["served_by"] == {"0": [1]} and second[0]["tier"] == str(job.memory(0))
    assert second[0]["mismatches"] == []


def test_a_node_killed_in_its_local_commit_leaves_a_save_the_next_writer_clears_from_every_node(two_nodes):
    job, seen = two_nodes["commit"]
    assert seen["node 0 committed 3"]
    assert 3 not in seen["node 1's steps"]
    started = seen["start"]
    assert [r["held_at_start"] for r in started] == [[1, 2], [1, 2]]  # step 3 cleared from node 0 by the writer's start
    assert [r["latest"] for r in started] == [2, 2]
    # close() leaves the newest composite, step 2, promoted (by the collective promotion: each node
    # uploads its own parts), not the cleared step 3; promoted before this start or by its close().
    assert started[0]["closed"] is None and Run(job.env["RUN_HOME"]).latest_step() == 2, started[0]
    assert Run(job.env["RUN_HOME"]).verify() == []
    job.copies_whole(verify=False)  # one copy of each part: a node's copy is not whole alone


def test_a_node_killed_in_its_commit_with_the_next_save_in_flight_resumes_from_the_other_nodes_commit(two_nodes):
    """``async_in_flight=2``, ``replicas=2``: node 1 SIGKILLed as it commits its copy of step 3, after
    rank 0 announced it (node 0 commits its own), with the save of 4 in flight behind it; node 0's
    launch killed too. No copy shows a composite that is not whole across the nodes (node 0's step
    3: it holds every part), none shows 4, the object store nothing above 2. The restart resumes
    from 3, the newest committed, from memory (node 1's copy rebuilt from node 0's), every tensor
    equal to its version, and saves and promotes on."""
    job, seen = two_nodes["in flight"]
    assert seen["node 0 committed 3"] and (job.own(1) / "staged-4").read_text() == "True"  # 4 was in flight
    node0, node1, home = seen["steps after the kill"]
    assert 3 in node0 and 3 not in node1 and 4 not in node0 + node1 and max(home, default=0) <= 2, seen
    job.copies_whole(name="killed")
    check_resumed_in_memory(job, seen["first"], held=[node0, node1], restored=3, last=5)


def test_a_node_killed_with_a_save_replicated_and_the_next_in_flight_resumes_from_the_newest_committed_everywhere(
        tmp_path, endpoint):
    """``async_in_flight=2``: node 1 SIGKILLed in the save of step 3 once its parts were replicated
    (step 2 of the node commit) and before it reported them, with the save of step 4 staged and in
    flight behind it; node 0's launch killed too, node 1's memory wiped. No node committed 3 (rank 0
    commits nothing it has not every report of) nor 4: the restart resumes from 2, from memory (node
    1's copy rebuilt from node 0's), every tensor equal to its version, and no tier shows 3 or 4 until
    the resumed job saves them again over what the killed one left staged."""
    job = Job(tmp_path, endpoint, "ddp")
    job.launch("train", LAST="6", KILL_NODE="1", KILL_AT="3", KILL_IN="announced", IN_FLIGHT="2")
    job.lose(1)
    assert (job.own(1) / "staged-4").read_text() == "True"  # the save of 4 was in flight when node 1 died
    tiers = [Run(job.memory(0)), Run(job.memory(1)), Run(job.env["RUN_HOME"])]
    assert [sorted({3, 4} & set(run.steps())) for run in tiers] == [[], [], []]
    job.wipe(1)

    job.launch("resume", LAST="4", IN_FLIGHT="2")
    check_resumed_in_memory(job, job.results("resume"), held=[[1, 2], []], restored=2, last=4)
