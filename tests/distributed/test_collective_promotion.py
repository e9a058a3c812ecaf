"""Collective promotion from a node-local tier to an object store (moto's S3 server on loopback):
two launches as ``torchrun --nnodes 2``, each node with its own memory directory and TMPDIR, each
holding only its own parts (``replicas=1``). Every node uploads its own parts of each promoted
composite, rank 0 the files of no rank and the commit; a node SIGKILLed in the middle of a
promotion leaves no composite in the bucket that is not whole, and the next writer clears what
the promotion left. The runs are made by the ``nodes_on_s3`` fixture (conftest.py): the crash in
a launch of its own, the relaunch after it and the held follower's run in turn in one launch
(shared with test_object_store_nodes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import set_environment, staged_only  # noqa: E402

from llmtailor.constants import snapshot_dirname, writer_rank  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_node_killed_mid_promotion_leaves_nothing_visible_and_the_next_writer_clears(nodes_on_s3, monkeypatch):
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
    nodes = nodes_on_s3
    url, endpoint, killed = nodes.urls["killed"], nodes.endpoint, nodes.killed
    set_environment(monkeypatch, endpoint)
    assert killed["failure"] is None, killed["failure"]
    held = killed["held"]
    assert held[0] == held[1] == [held[0][-1] - 1, held[0][-1]], held  # one order on both: a composite and its carrier
    assert killed["steps"] == [1] and killed["latest"] == 1 and killed["problems"] == []  # only what is whole
    # The parts uploaded, invisible: the composite's and its carrier's (Parity's composite of c needs c - 1).
    assert killed["staged"] == [snapshot_dirname(step) for step in held[0]]

    results = nodes.results("promote", "killed")  # the relaunch with every node's memory lost: from the bucket, at step 1
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


def test_a_follower_keeps_what_it_uploads_from_its_own_retention(nodes_on_s3, monkeypatch):
    """``keep=1`` on each node, node 1 taking its first order (the composite of step ``c``) up,
    before it leases anything, only once its own saves committed ``c + 2`` and ran its node's
    retention, which alone would remove step ``c`` there: every node's retention spares what
    rank 0's promoter reads or may choose next (each save's commit says what), so the promotion
    commits the composite ordered, nothing is superseded, every tier verifies, and once the run
    closes each node keeps its newest composite only (nothing spared any more)."""
    nodes = nodes_on_s3
    url = nodes.urls["held"]
    set_environment(monkeypatch, nodes.endpoint)
    results = nodes.results("promote", "held")
    held = json.loads((nodes.own("held", 1) / "held.json").read_text())
    assert held["reached"], held  # node 1's retention ran past the composite while its order waited
    assert results[0]["promoted"][0] == held["staging"][-1] and results[0]["promoted"][-1] == 6
    assert results[0]["superseded"] == []
    run = Run(url)
    assert run.latest_step() == 6 and run.verify() == [] and staged_only(nodes.endpoint, url) == []
    for node in range(2):
        memory = Run(nodes.memory("held", node))
        assert memory.steps() == [5, 6] and memory.verify() == []  # Parity's composite of 6 needs 5


def test_a_script_that_ends_without_close_commits_and_promotes_on_every_node(nodes_on_s3, monkeypatch):
    """Async saves at steps 1..4 into a node-local tier (``replicas=2``) in front of the bucket, in
    two runs of one script that ends without ``close()`` (the launch's last job, promote_job.py's
    ``unclosed``): ``between`` (no promotion due at its last save) and ``due`` (one due at every
    save: its last one's at exit), node 1 serving that last order only once its interpreter began
    to exit and its saves committed (``HOLD_EXIT``); the script's last line is
    ``dist.destroy_process_group()``, ``due``'s last save still to send its copies to the partner
    node (held until the group is destroyed). Every save committed in both nodes' copies,
    each promotion due is whole in the bucket and nothing of a partial one lies there, every lock
    released, no failure said, and node 1's copy and the bucket restore their newest composite bit
    for bit. Before:
    node 1's uploader, a daemon thread, died with its interpreter; rank 0 waited out the timeout
    three times and failed the promotion of step 4 (the bucket stayed at step 3), and the kept
    writer's lock stayed in the bucket ('Exception ignored in: WriterLock.__del__ ... ImportError').
    Before (a1b9c61), with the group destroyed: the courier's sends and receives looked its group up in
    the registry ``destroy_process_group()`` empties ('Group ... is not registered'): step 4 NOT saved,
    node 0's copy of ``due`` at step 3 (``assert (3 == 4)``)."""
    import sys

    from helpers import tiny
    from objectstore import keys

    from llmtailor import Tailor

    nodes, url = nodes_on_s3, nodes_on_s3.urls["unclosed"]
    assert [r["saved"] for r in nodes.results("unclosed", "unclosed")] == [[1, 2, 3, 4]] * 2
    set_environment(monkeypatch, nodes.endpoint)  # this process reads the bucket
    sys.path.insert(0, str(Path(__file__).parent))
    import torch_job

    for variant, promoted in (("between", 1), ("due", 4)):
        home = f"{url}/{variant}"
        tiers = [nodes.memory("unclosed", node) / variant for node in range(2)]
        for copy in tiers:
            assert Run(copy).latest_step() == 4 and Run(copy).verify() == [], copy
        assert Run(home).latest_step() == promoted and Run(home).verify() == []
        assert staged_only(nodes.endpoint, home) == []
        assert [k for k in keys(nodes.endpoint, url.split("/")[2]) if k.endswith("/.lock")] == []
        for where in (tiers[1], home):  # node 1's copy holds the whole composite too (replicas=2)
            model, optimizer, scheduler = tiny(seed=11)
            assert Tailor(where, model, optimizer, scheduler, read_only=True).restore().step == Run(where).latest_step()
            assert torch_job.compare_with_composite(nodes.own("unclosed", 0) / variant, where, model, optimizer) == []
    said = "\n".join(nodes.outputs)
    assert "NOT saved" not in said and "Exception ignored" not in said
    assert [line for line in said.splitlines() if "unclosed" in line and ("WARNING" in line or "ERROR" in line)] == []


def test_writers_dropped_without_close_leave_no_uploader_running_and_nothing_for_the_exit(nodes_on_s3, monkeypatch):
    """A sweep: four writers in turn, each with a node-local tier promoted at every save, the
    first closed, the others dropped without ``close()`` once they saved (promote_job.py's ``dropped``). Rank 0's dropped
    writer tells node 1's uploader that no order follows once its promotion in flight ended,
    and that uploader ends: once the promotions in flight ended, no thread of any of them runs
    on (uploader, promoter, lock renewal) and the exit keeps nothing of them (``runtime._UNCLOSED``),
    on either node; every promotion came whole to the bucket. Before: rank 0 kept each dropped
    writer's crew (and its store client) until the exit, node 1 each one's uploader thread, idle
    (``assert [(0, 3), (3, 3)] == [(0, 0), (0, 0)]``: uploaders alive and writers kept, by node)."""
    nodes = nodes_on_s3
    results = nodes.results("dropped", "dropped")
    assert [(r["uploaders"], r["unclosed"], r["threads"]) for r in results] == [(0, 0, [])] * 2, results
    set_environment(monkeypatch, nodes.endpoint)
    for i in range(4):
        home = Run(f"{nodes.urls['dropped']}/{i}")
        assert home.latest_step() == 1 and home.verify() == []


def test_a_closed_writer_kept_by_the_script_and_dropped_ones_hold_no_connection(nodes_on_s3):
    """The same sweep's first writer is closed and kept to the end (a script's global); the
    others are dropped unclosed, no cycle collected meanwhile (promote_job.py's ``dropped``).
    Once closed, a writer holds no connection: its courier's gloo group (a socket per peer and
    lane, and their threads) and its coordinator's idle clients of the job's store are let
    go; a dropped one's go with it, node 1's too (its uploader and its entry for the exit no
    longer hold each other, nor the coordinator). The writers after the closed one saved and
    promoted (``test_writers_dropped_...``). Before: ``assert [[9, 5], [10, 16]] == [[0, 0], [0, 0]]``
    (connections more than before the first writer, once it was closed and at the end, by node)."""
    results = nodes_on_s3.results("dropped", "dropped")
    assert [r["connections"] for r in results] == [[0, 0], [0, 0]], results
