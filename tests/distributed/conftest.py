"""One launch of two "nodes" (each a launch as ``torchrun --nnodes 2`` on loopback with its own
directories and TMPDIR; the runs' homes on moto's S3 server) runs, in turn, the jobs of several
test files (promote_job.py): test_collective_promotion.py's relaunch after its crash, its held
follower's run and its script that ends without ``close()`` (the launch's last job), and
test_object_store_nodes.py's save. The crash it follows has a launch of its
own (the test kills its nodes), and what that test checks between the two launches is recorded
then."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import FORK_SERVERS, LAUNCH_WAIT, end_launches, node_launches, wait_launches

JOB = Path(__file__).with_name("promote_job.py")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The fork servers the node launches started (``helpers.node_launches``) serve every test of
    this directory (their start, torch's and llmtailor's imports, paid once, not once a module),
    and end after its last one (the next test elsewhere, or none): their memory freed. A rank is
    forked from a server that only imported (forked_nodes.py), whichever test came before."""
    try:
        return (yield)
    finally:
        if nextitem is None or Path(__file__).parent not in nextitem.path.parents:
            FORK_SERVERS.stop()


@dataclass
class NodesOnS3:
    """The runs of the shared launch: ``own(name, node)`` is each run's directory on a node (its
    job's ``DIR``, its memory tier in ``memory``), ``urls`` each run's home; ``killed`` what the
    crash left, recorded before the relaunch (or the crash's ``failure``)."""

    root: Path
    endpoint: str
    urls: dict[str, str]
    killed: dict = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    returncodes: list[int | None] = field(default_factory=list)

    def own(self, name: str, node: int) -> Path:
        return self.root / name / f"node{node}"

    def memory(self, name: str, node: int) -> Path:
        return self.own(name, node) / "memory"

    def job(self, scenario: str, name: str, node: int, **settings: str) -> list[str]:
        """``name``'s job line on ``node``: a promotion's ``NODE_DIR`` and ``RUN_HOME``, or the
        ``RUN_ROOT`` of torch_job.py's ``fsdp-url``."""
        where = {"RUN_ROOT": self.urls[name]} if scenario == "fsdp-url" else \
            {"NODE_DIR": self.memory(name, node), "RUN_HOME": self.urls[name]}
        settings = {**where, **settings}
        return [scenario, "fsdp", self.own(name, node), *(f"{key}={value}" for key, value in settings.items())]

    def env(self, node: int, tmp: str) -> dict[str, str]:
        from objectstore import environment

        (self.root / tmp / f"node{node}").mkdir(parents=True, exist_ok=True)
        return {**os.environ, **environment(self.endpoint), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TMPDIR": str(self.root / tmp / f"node{node}")}

    def results(self, scenario: str, name: str) -> list[dict]:
        """Each node's result of ``name``'s job, once the shared launch ended well."""
        assert self.returncodes == [0, 0], "\n\n".join(out[-5000:] for out in self.outputs)
        return [json.loads((self.own(name, n) / f"result-{scenario}-{n}.json").read_text()) for n in range(2)]


def crash_mid_promotion(nodes: NodesOnS3) -> None:
    """The ``killed`` run: both nodes uploaded their parts of a promotion and stop there
    (``HOLD_AT``; ``keep=2``, its retention sparing what is ordered); node 1 is SIGKILLed, then node 0 (as torchrun
    elastic would end the survivors). Records what each node held and what the bucket shows then
    in ``nodes.killed``, then wipes every node's memory (lost with the nodes)."""
    from objectstore import set_environment, staged_only

    from llmtailor.store.run import Run

    launches = node_launches(JOB, lambda n: nodes.job("promote", "killed", n, HOLD_AT="3"),
                             lambda n: nodes.env(n, "tmp-killed"), own_session=True)
    markers = [nodes.own("killed", node) / "holding" for node in range(2)]
    deadline = time.monotonic() + LAUNCH_WAIT  # the bound on a hang, not a timing asserted
    while not all(marker.exists() for marker in markers):  # the event: both nodes mid-promotion
        if any(p.poll() is not None for p in launches) or time.monotonic() > deadline:
            # A node that ended (or none that got there): the other may hold for good, so end both.
            nodes.killed["failure"] = "the nodes did not both stop mid-promotion; each node's output:\n\n" + \
                "\n\n".join(f"node {n}: {tail}" for n, tail in enumerate(end_launches(launches)))
            return
        time.sleep(0.1)
    for node in (1, 0):  # node 1 first: the node lost; then the survivors
        os.kill(json.loads(markers[node].read_text())["pid"], signal.SIGKILL)  # its worker: a session of its own
        os.killpg(launches[node].pid, signal.SIGKILL)  # the node (as torchrun's agent)
        wait_launches([launches[node]])
    with pytest.MonkeyPatch.context() as monkeypatch:
        set_environment(monkeypatch, nodes.endpoint)  # this process reads the bucket
        run = Run(nodes.urls["killed"])
        nodes.killed.update(held=[json.loads(marker.read_text())["staging"] for marker in markers],
                            steps=run.steps(), latest=run.latest_step(), problems=run.verify(),
                            staged=staged_only(nodes.endpoint, nodes.urls["killed"]), failure=None)
    for node in range(2):  # every node's memory lost with it
        shutil.rmtree(nodes.memory("killed", node), ignore_errors=True)


@pytest.fixture(scope="session")
def nodes_on_s3(tmp_path_factory) -> NodesOnS3:
    """The crash, then one launch of the two nodes running in turn: the relaunch of the ``killed``
    run (every node's memory lost: it resumes from the bucket), the ``held`` run (``KEEP=1``, node
    1 holding its first order: ``HOLD_FOLLOWER``) and the ``fsdp`` run (torch_job.py's
    ``fsdp-url``, saved straight to its URL), the ``dropped`` runs (four writers, the first closed and kept,
    the others dropped without ``close()``), then the ``unclosed`` runs (a script that ends without
    ``close()``, node 1 serving the promotion due at its last save only as it exits: ``HOLD_EXIT``).
    Each test reads its run's results and the launch's outcome (``results``)."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    from objectstore import moto_process, new_bucket

    with moto_process() as endpoint:
        urls = {"killed": f"s3://{new_bucket(endpoint)}/jobs/killed", "held": f"s3://{new_bucket(endpoint)}/jobs/held",
                "fsdp": f"s3://{new_bucket(endpoint)}/jobs/fsdp", "dropped": f"s3://{new_bucket(endpoint)}/jobs/dropped",
                "unclosed": f"s3://{new_bucket(endpoint)}/jobs/unclosed"}
        nodes = NodesOnS3(tmp_path_factory.mktemp("nodes_on_s3"), endpoint, urls)
        crash_mid_promotion(nodes)
        relaunch = [] if nodes.killed["failure"] else [("promote", "killed", {})]
        turns = [*relaunch, ("promote", "held", {"KEEP": "1", "HOLD_FOLLOWER": "2"}), ("fsdp-url", "fsdp", {}),
                 ("dropped", "dropped", {}), ("unclosed", "unclosed", {"HOLD_EXIT": "4"})]  # last: it ends with the process
        launches = node_launches(JOB, lambda n: [arg for scenario, name, settings in turns
                                                 for arg in nodes.job(scenario, name, n, **settings)],
                                 lambda n: nodes.env(n, "tmp"))
        nodes.outputs = [err for _, err in wait_launches(launches)]
        nodes.returncodes = [p.returncode for p in launches]
        return nodes
