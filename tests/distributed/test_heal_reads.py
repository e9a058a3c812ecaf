"""A node healed from its partner's memory restores from the bytes it received, with real
processes (heal_reads_job.py: each "node" a ``torchrun --nnodes 2 --node_rank i`` launch on
loopback with its own memory directory and TMPDIR; the run's home on moto's S3 server; the DDP
and the FSDP2 run in turn in each launch): every
file healed into the lost node's copy was checked against its checksum as it arrived, so its
restore takes those bytes (``UnitReader.arrived``) and (DDP) reads none of its parts back from its
copy to check them a second time; nor does the sending node (DDP), which checked the files it sent
as they went out (from its copy's mapping) and takes those bytes; the restored state equals the
composite's, on both nodes (DDP, and FSDP2, whose chunks checked whole come from the bytes
received too: ``ChunkReader``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import node_launches, wait_launches

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import environment, moto_process, new_bucket  # noqa: E402

from llmtailor.constants import writer_rank  # noqa: E402

JOB = Path(__file__).with_name("heal_reads_job.py")
pytestmark = pytest.mark.slow


def launch(tmp_path: Path, env: dict[str, str], jobs: list[tuple[str, str, dict[str, str]]]) -> None:
    """Both nodes of the job running, in turn, each ``(scenario, kind, settings)`` to the end (one
    launch: the runs share its start-up), each kind in ``tmp_path/<kind>``."""

    def args(node: int) -> list[str]:
        return [arg for scenario, kind, settings in jobs
                for arg in (scenario, kind, str(own(tmp_path, kind, node)), f"NODE_DIR={memory(tmp_path, kind, node)}",
                            *(f"{name}={value}" for name, value in settings.items()))]

    def env_of(node: int) -> dict[str, str]:
        (tmp_path / f"tmp{node}").mkdir(parents=True, exist_ok=True)
        return {**env, "TMPDIR": str(tmp_path / f"tmp{node}")}

    launches = node_launches(JOB, args, env_of, merged=True)
    outputs = [out for out, _ in wait_launches(launches)]
    assert [p.returncode for p in launches] == [0, 0], "\n\n".join(out[-5000:] for out in outputs)


def own(tmp_path: Path, kind: str, node: int) -> Path:
    return tmp_path / kind / f"node{node}"


def memory(tmp_path: Path, kind: str, node: int) -> Path:
    return own(tmp_path, kind, node) / "memory"


KINDS = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def healed(tmp_path_factory) -> Path:
    """Both kinds' runs trained to 3 in one launch, node 1's memory wiped (node 1 replaced: its
    memory is empty), then both resumed in one launch; each kind's results in ``<dir>/<kind>``."""
    tmp_path = tmp_path_factory.mktemp("heal")
    with moto_process() as endpoint:
        env = {**os.environ, **environment(endpoint), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        homes = {kind: f"s3://{new_bucket(endpoint)}/jobs/{kind}" for kind in KINDS}
        launch(tmp_path, env, [("train", kind, {"RUN_HOME": homes[kind], "LAST": "3"}) for kind in KINDS])
        for kind in KINDS:
            shutil.rmtree(memory(tmp_path, kind, 1))
        launch(tmp_path, env, [("resume", kind, {"RUN_HOME": homes[kind]}) for kind in KINDS])
    return tmp_path


def parts(keys: list[str]) -> list[str]:
    """The keys of ``keys`` that are parts (files a rank wrote)."""
    return [key for key in keys if writer_rank(key.split("/", 2)[-1]) is not None]


@pytest.mark.parametrize("kind", KINDS)
def test_a_healed_node_restores_from_the_bytes_it_received_not_from_reading_them_back(healed, kind):
    first, second = [json.loads((own(healed, kind, n) / f"result-resume-{n}.json").read_text()) for n in range(2)]

    assert first["restored"] == second["restored"] == 3 and first["served_by"] == {"1": [0]}
    assert second["tier"] == str(memory(healed, kind, 1))  # from memory, node 1's copy healed
    healed_parts = [path for path in second["held"] if path.startswith("snapshots/") and writer_rank(path.split("/", 2)[2]) is not None]
    assert healed_parts  # node 1's copy holds parts again: its own and node 0's
    assert first["mismatches"] == [] and first["digest"] == second["digest"]  # equal to the composite on both nodes
    assert parts(first["mapped"]) and second["mapped"] == []  # node 0 sends from its own copy's mapping
    if kind == "ddp":  # FSDP2's ranges are fetched once in the job (shared_ranges), from the copy; checked from the bytes
        assert parts(second["read"]) == []  # none read back: the restore took the bytes checked on arrival
        assert parts(first["read"]) == []  # nor by the sender: it took those it checked while they went out
