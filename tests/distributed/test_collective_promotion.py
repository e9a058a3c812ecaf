"""Collective promotion from a node-local tier to an object store (moto's S3 server on loopback):
two ``torchrun --nnodes 2`` launches, each node with its own memory directory and TMPDIR, each
holding only its own parts (``replicas=1``). Every node uploads its own parts of each promoted
composite, rank 0 the files of no rank and the commit; a node SIGKILLed in the middle of a
promotion leaves no composite in the bucket that is not whole, and the next writer clears what
the promotion left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import LAUNCH_WAIT, end_launches, free_port, wait_launches

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import environment, keys, moto_process, new_bucket  # noqa: E402

from llmtailor.constants import MANIFEST_FILE, snapshot_dirname, writer_rank  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402

JOB = Path(__file__).with_name("promote_job.py")
pytestmark = pytest.mark.slow


def start_nodes(tmp_path: Path, url: str, endpoint: str, both: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """The two launches (each in a session of its own, so a test can kill a whole node);
    ``both``: more environment for each."""
    base = {**os.environ, **environment(endpoint), "RUN_HOME": url, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port, launches = free_port(), []
    for node in range(2):
        own = tmp_path / f"node{node}"
        (own / "tmp").mkdir(parents=True, exist_ok=True)
        env = {**base, "TMPDIR": str(own / "tmp"), "NODE_DIR": str(own / "memory"), **(both or {})}
        launches.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), str(JOB), str(own)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        ))
    return launches


def finished(launches: list[subprocess.Popen]) -> list[tuple[str, str]]:
    outputs = wait_launches(launches)
    assert [p.returncode for p in launches] == [0, 0], "\n\n".join(err[-4000:] for _, err in outputs)
    return outputs


def staged_only(endpoint: str, url: str) -> list[str]:
    """Snapshot prefixes in the bucket that hold objects but no manifest (a promotion's staging)."""
    bucket, prefix = url.split("/")[2], "/".join(url.split("/")[3:]) + "/snapshots/"
    found = keys(endpoint, bucket, prefix)
    snapshots = {key[len(prefix):].split("/")[0] for key in found}
    return sorted(s for s in snapshots if f"{prefix}{s}/{MANIFEST_FILE}" not in found)


def test_a_node_killed_mid_promotion_leaves_nothing_visible_and_the_next_writer_clears(tmp_path, monkeypatch):
    """Both nodes uploaded their parts of the promotion after step 1's (of the composite of step 3,
    or a later one where the promoter fell behind the saves) and stop there (so rank 0 cannot tidy
    up: the crash is the whole story); node 1 is SIGKILLed, then node 0 (as torchrun elastic would
    end the survivors). Node 1 takes that order up only once its own saves are done (the job's
    ``HOLD_AT``), each followed by its retention (``keep=2``), which spares the composite ordered
    however late its order is taken up. The bucket shows step 1 only, whole; the parts of the composite
    held and of its carrier lie there without a manifest. A relaunch with every node's memory lost resumes from the bucket,
    its writer clears them, and its own promotions commit: each node uploaded its own rank's
    parts of every composite it promoted, never another's, rank 0 also the files of no rank (one
    launch checks the collective promotion of a run and the recovery from the crash: a launch
    costs about 25 s of CPU here, two nodes importing torch and transformers)."""
    with moto_process() as endpoint:
        url = f"s3://{new_bucket(endpoint)}/jobs/killed"
        for name, value in environment(endpoint).items():
            monkeypatch.setenv(name, value)
        launches = start_nodes(tmp_path, url, endpoint, both={"HOLD_AT": "3"})
        markers = [tmp_path / f"node{node}" / "holding" for node in range(2)]
        deadline = time.monotonic() + LAUNCH_WAIT  # the bound on a hang, not a timing asserted
        while not all(marker.exists() for marker in markers):  # the event: both nodes mid-promotion
            if any(p.poll() is not None for p in launches) or time.monotonic() > deadline:
                # A node that ended (or none that got there): the other may hold for good, so end both.
                pytest.fail("the nodes did not both stop mid-promotion; each node's output:\n\n"
                            + "\n\n".join(f"node {n}: {tail}" for n, tail in enumerate(end_launches(launches))))
            time.sleep(0.1)
        for node in (1, 0):  # node 1 first: the node lost; then the survivors
            os.kill(json.loads(markers[node].read_text())["pid"], signal.SIGKILL)  # its worker: a session of its own
            os.killpg(launches[node].pid, signal.SIGKILL)  # its torchrun agent
            wait_launches([launches[node]])
        held = [json.loads(marker.read_text())["staging"] for marker in markers]
        assert held[0] == held[1] == [held[0][-1] - 1, held[0][-1]], held  # one order on both: a composite and its carrier
        run = Run(url)
        assert run.steps() == [1] and run.latest_step() == 1 and run.verify() == []  # only what is whole
        # The parts uploaded, invisible: the composite's and its carrier's (Parity's composite of c needs c - 1).
        assert staged_only(endpoint, url) == [snapshot_dirname(step) for step in held[0]]

        for node in range(2):  # a relaunch with every node's memory lost: from the bucket, at step 1
            subprocess.run(["rm", "-rf", str(tmp_path / f"node{node}" / "memory")], check=True)
        finished(start_nodes(tmp_path, url, endpoint))
        results = [json.loads((tmp_path / f"node{r}" / f"result-{r}.json").read_text()) for r in range(2)]
        assert results[0]["start"] == 2 and results[0]["promoted"][-1] == 7
        assert staged_only(endpoint, url) == [] and Run(url).verify() == [] and Run(url).latest_step() == 7
        # Each node sent its own rank's parts, never another's; rank 0 also the files of no rank;
        # together, every file of the steps this launch saved (2..7), each sent once.
        owners = [{writer_rank(f.split(":", 1)[1]) for f in result["uploaded"]} for result in results]
        assert owners == [{0, None}, {1}]
        run = Run(url)
        promoted = {f"{step}:{entry.path}" for step in run.steps() if step >= 2 for entry in run.stored_files(step)}
        assert set(results[0]["uploaded"]) | set(results[1]["uploaded"]) == promoted
        assert not set(results[0]["uploaded"]) & set(results[1]["uploaded"])


def test_a_follower_keeps_what_it_uploads_from_its_own_retention(tmp_path, monkeypatch):
    """``keep=1`` on each node, node 1 taking its first order (the composite of step ``c``) up,
    before it leases anything, only once its own saves committed ``c + 2`` and ran its node's
    retention, which alone would remove step ``c`` there: every node's retention spares what
    rank 0's promoter reads or may choose next (each save's commit says what), so the promotion
    commits the composite ordered, nothing is superseded, every tier verifies, and once the run
    closes each node keeps its newest composite only (nothing spared any more)."""
    with moto_process() as endpoint:
        url = f"s3://{new_bucket(endpoint)}/jobs/held"
        for name, value in environment(endpoint).items():
            monkeypatch.setenv(name, value)
        finished(start_nodes(tmp_path, url, endpoint, both={"KEEP": "1", "HOLD_FOLLOWER": "2"}))
        held = json.loads((tmp_path / "node1" / "held.json").read_text())
        assert held["reached"], held  # node 1's retention ran past the composite while its order waited
        results = [json.loads((tmp_path / f"node{r}" / f"result-{r}.json").read_text()) for r in range(2)]
        assert results[0]["promoted"][0] == held["staging"][-1] and results[0]["promoted"][-1] == 6
        assert results[0]["superseded"] == []
        run = Run(url)
        assert run.latest_step() == 6 and run.verify() == [] and staged_only(endpoint, url) == []
        for node in range(2):
            memory = Run(tmp_path / f"node{node}" / "memory")
            assert memory.steps() == [5, 6] and memory.verify() == []  # Parity's composite of 6 needs 5
