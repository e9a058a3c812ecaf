"""Two "nodes" with no shared filesystem save an FSDP2 run to s3:// (moto's S3 server on
loopback): two launches as ``torchrun --nnodes 2`` (``helpers.node_launches``), each with its own local directories, every rank
uploading its own parts straight to the run's URL and the commit coordinated through
torch.distributed's store. Then the run is restored from the server alone, at another world size
(3 ranks) and in one plain process, every tensor equal to the version its composite names."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import launches_ended_well, node_launches, tiny, wait_launches

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import environment, keys, set_environment  # noqa: E402

from llmtailor import Tailor  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402

JOB = Path(__file__).with_name("torch_job.py")
pytestmark = pytest.mark.slow


def test_two_nodes_save_to_s3_and_a_third_world_size_and_one_process_restore_from_it(nodes_on_s3, monkeypatch):
    """The two nodes' save is ``fsdp-url`` in the launch the ``nodes_on_s3`` fixture (conftest.py)
    shares with test_collective_promotion.py; the 3-rank restore is a launch of its own."""
    nodes, url = nodes_on_s3, nodes_on_s3.urls["fsdp"]
    endpoint = nodes.endpoint
    set_environment(monkeypatch, endpoint)  # this process reads the bucket too
    base = {**os.environ, **environment(endpoint), "RUN_ROOT": url, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    results = nodes.results("fsdp-url", "fsdp")
    assert all(result["restored"] == 8 for result in results)
    assert results[0]["mismatches"] == [] and results[1]["mismatches"] is None  # node 1 has no versions to compare
    # Each node wrote its own parts straight to the bucket; nothing went through a shared directory.
    stored = keys(endpoint, url.split("/")[2], "jobs/fsdp/parity/snapshots/step-00000008/")
    assert any("rank-00000" in k for k in stored) and any("rank-00001" in k for k in stored)
    assert not any(p.name != "tmp" for p in nodes.own("fsdp", 1).iterdir() if p.is_dir())
    run = Run(f"{url}/parity")
    assert run.verify() == [] and run.manifest(8).world_size == 2

    # Another world size (3 ranks on one node), reading the node-0 versions to compare.
    three = node_launches(JOB, lambda _: ["fsdp-restore", nodes.own("fsdp", 0)], lambda _: base, nodes=1, per_node=3)
    launches_ended_well(three, [err for _, err in wait_launches(three)])
    for rank in range(3):
        result = json.loads((nodes.own("fsdp", 0) / f"result-fsdp-restore-{rank}.json").read_text())
        assert result["restored"] == 8 and result["mismatches"] == [], result

    # One plain process.
    sys.path.insert(0, str(JOB.parent))
    import torch_job

    model, optimizer, scheduler = tiny(seed=11)
    report = Tailor(f"{url}/parity", model, optimizer, scheduler, read_only=True).restore()
    assert report.step == 8 and report.saved_world_size == 2
    assert torch_job.compare_with_composite(nodes.own("fsdp", 0), f"{url}/parity", model, optimizer) == []
