"""A node healed from its partner's memory restores from the bytes it received, with real
processes (heal_reads_job.py: each "node" a launch as ``torchrun --nnodes 2 --node_rank i`` on
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
from helpers import launches_ended_well, node_launches, wait_launches

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import environment, moto_process, new_bucket  # noqa: E402

from llmtailor.constants import TMP_DIR, writer_rank  # noqa: E402

JOB = Path(__file__).with_name("heal_reads_job.py")
pytestmark = pytest.mark.slow


def launch(tmp_path: Path, env: dict[str, str], jobs: list[tuple[str, str, dict[str, str], str]]) -> None:
    """Both nodes of the job running, in turn, each ``(scenario, kind, settings, run)`` to the end
    (one launch: the runs share its start-up), each run in ``tmp_path/<run>``."""

    def args(node: int) -> list[str]:
        return [arg for scenario, kind, settings, run in jobs
                for arg in (scenario, kind, str(own(tmp_path, run, node)), f"NODE_DIR={memory(tmp_path, run, node)}",
                            *(f"{name}={value}" for name, value in settings.items()))]

    def env_of(node: int) -> dict[str, str]:
        (tmp_path / f"tmp{node}").mkdir(parents=True, exist_ok=True)
        return {**env, "TMPDIR": str(tmp_path / f"tmp{node}")}

    launches = node_launches(JOB, args, env_of, merged=True)
    outputs = [out for out, _ in wait_launches(launches)]
    launches_ended_well(launches, outputs)


def own(tmp_path: Path, kind: str, node: int) -> Path:
    return tmp_path / kind / f"node{node}"


def memory(tmp_path: Path, kind: str, node: int) -> Path:
    return own(tmp_path, kind, node) / "memory"


KINDS = ("ddp", "fsdp")
RUNS = {**{kind: kind for kind in KINDS}, "damaged": "ddp"}
"""Each run of the launches (its directory) -> its kind. ``damaged``: node 0's copy of one of node
1's parts damaged before the resume (the healing beside the restore fails on node 1)."""


def damage_a_part_of_node_1(tmp_path: Path) -> str:
    """One byte of a part of node 1 (rank 1's) flipped in node 0's copy of the newest snapshot,
    its size kept (the choice sees it whole); its path."""
    newest = max((memory(tmp_path, "damaged", 0) / "snapshots").iterdir())
    part = next(path for path in sorted(newest.rglob("*rank-00001*.safetensors")))
    content = bytearray(part.read_bytes())
    content[len(content) // 2] ^= 1
    part.write_bytes(bytes(content))
    return str(part.relative_to(newest))


@pytest.fixture(scope="module")
def healed(tmp_path_factory) -> Path:
    """Every run trained to 3 in one launch, node 1's memory wiped (node 1 replaced: its memory
    is empty), then every run resumed in one launch; each run's results in ``<dir>/<run>``."""
    tmp_path = tmp_path_factory.mktemp("heal")
    with moto_process() as endpoint:
        env = {**os.environ, **environment(endpoint), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        homes = {run: f"s3://{new_bucket(endpoint)}/jobs/{run}" for run in RUNS}
        launch(tmp_path, env, [("train", kind, {"RUN_HOME": homes[run], "LAST": "3"}, run) for run, kind in RUNS.items()])
        for run in RUNS:
            shutil.rmtree(memory(tmp_path, run, 1))
        (tmp_path / "damaged.txt").write_text(damage_a_part_of_node_1(tmp_path))
        launch(tmp_path, env, [("resume", kind, {"RUN_HOME": homes[run]}, run) for run, kind in RUNS.items()])
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
    assert parts(first["mapped"])  # node 0 sends from its own copy's mapping
    # node 1 maps only the files it received, where they landed (its staging place; the restore is
    # handed private mappings of them): nothing of a committed copy, nothing read back
    assert second["mapped"] and [key for key in second["mapped"] if not key.startswith(f"{TMP_DIR}/")] == []
    if kind == "ddp":  # FSDP2's ranges are fetched once in the job (shared_ranges), from the copy; checked from the bytes
        assert parts(second["read"]) == []  # none read back: the restore took the bytes checked on arrival
        assert parts(first["read"]) == []  # nor by the sender: it took those it checked while they went out


def test_a_part_damaged_on_its_way_to_the_replacement_fails_the_healing_beside_the_restore_and_the_restore_takes_the_next_tier(
        healed):
    """The healing runs beside the restore (node 1 reads each file as it arrives); a part that
    does not check out on node 1 fails the reads of what did not arrive, and the ranks, taking
    the healing's outcome before they agree, pass the node-local tier over as one: every rank
    restores from the object store, composite-exact, saying which file failed and who sent it."""
    first, second = [json.loads((own(healed, "damaged", n) / f"result-resume-{n}.json").read_text()) for n in range(2)]
    damaged = (healed / "damaged.txt").read_text()
    assert first["tier"] == second["tier"] and first["tier"].startswith("s3://"), (first["tier"], second["tier"])
    assert first["restored"] == second["restored"] == 3
    assert first["mismatches"] == [] and first["digest"] == second["digest"]
    why = first["skipped"]["3"]
    assert "healing the node-local tier failed" in why and f"{damaged} from node 0: got" in why, why
