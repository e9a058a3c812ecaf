"""A node healed from its partner's memory restores from the bytes it received, with real
processes (heal_reads_job.py: each "node" a ``torchrun --nnodes 2 --node_rank i`` launch on
loopback with its own memory directory and TMPDIR; the run's home on moto's S3 server): every
file healed into the lost node's copy was checked against its checksum as it arrived, so its
restore takes those bytes (``UnitReader.arrived``) and (DDP) reads none of its parts back from its
copy to check them a second time; the restored state equals the composite's, on both nodes (DDP,
and FSDP2, whose chunks checked whole come from the bytes received too: ``ChunkReader``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, wait_launches

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import environment, moto_process, new_bucket  # noqa: E402

from llmtailor.constants import writer_rank  # noqa: E402

JOB = Path(__file__).with_name("heal_reads_job.py")
pytestmark = pytest.mark.slow


def launch(tmp_path: Path, env: dict[str, str], scenario: str, kind: str, **extra: str) -> list[dict]:
    """Both nodes of the job running ``scenario``, to the end: each node's result."""
    port, launches = free_port(), []
    for node in range(2):
        own = tmp_path / f"node{node}"
        (own / "tmp").mkdir(parents=True, exist_ok=True)
        launches.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(JOB), scenario, kind, str(own)],
            env={**env, **extra, "NODE_DIR": str(own / "memory"), "TMPDIR": str(own / "tmp")},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [out for out, _ in wait_launches(launches)]
    assert [p.returncode for p in launches] == [0, 0], "\n\n".join(out[-5000:] for out in outputs)
    return [json.loads((tmp_path / f"node{n}" / f"result-{scenario}-{n}.json").read_text()) for n in range(2)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_healed_node_restores_from_the_bytes_it_received_not_from_reading_them_back(tmp_path, kind):
    with moto_process() as endpoint:
        env = {**os.environ, **environment(endpoint), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "RUN_HOME": f"s3://{new_bucket(endpoint)}/jobs/{kind}"}
        launch(tmp_path, env, "train", kind, LAST="3")
        shutil.rmtree(tmp_path / "node1" / "memory")  # node 1 replaced: its memory is empty
        first, second = launch(tmp_path, env, "resume", kind)

    assert first["restored"] == second["restored"] == 3 and first["served_by"] == {"1": [0]}
    assert second["tier"] == str(tmp_path / "node1" / "memory")  # from memory, node 1's copy healed
    healed = [path for path in second["held"] if path.startswith("snapshots/") and writer_rank(path.split("/", 2)[2]) is not None]
    assert healed  # node 1's copy holds parts again: its own and node 0's
    assert first["mismatches"] == [] and first["digest"] == second["digest"]  # equal to the composite on both nodes
    assert any(writer_rank(key.split("/", 2)[-1]) is not None for key in first["read"])  # node 0 reads its own copy
    if kind == "ddp":  # FSDP2's ranges are fetched once in the job (shared_ranges), from the copy; checked from the bytes
        parts_read = [key for key in second["read"] if writer_rank(key.split("/", 2)[-1]) is not None]
        assert parts_read == []  # none read back: the restore took the bytes checked on arrival
