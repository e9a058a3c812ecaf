"""Read once, send to the rest: a 3-rank DDP job restoring from an object store (moto's S3
server on loopback) fetches each byte of its composite once in total, not once per rank; the
ranks that did not read a unit get it over torch.distributed from the one that did; so are the
composite's manifests, unit indexes and global state. A corrupted unit file, and a corrupted
global.json, are each found by their one reader and the restore refused on every rank, naming that
reader (one launch, ``torch_job.py ddp-read-once``, covers these); a reader killed mid-restore
fails the others within the timeout, naming it. The restores from the object store share two
launches (3 and 4 ranks), each scenario with a run of its own in one bucket. Each launch is one
node (``helpers.node_launches``), its ranks forked from the fork servers, each with a hash seed of
its own; the reader killed runs its ranks to their ends (``statuses_of``)."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from helpers import node_launches, tiny, train, wait_launches
from safetensors.torch import save_file

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import environment, moto_process, new_bucket  # noqa: E402

from llmtailor import Full, Tailor  # noqa: E402
from llmtailor.store.keys import optim_key, weight_key  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402

JOB = Path(__file__).with_name("torch_job.py")
pytestmark = pytest.mark.slow
RANKS = 3


def composite_files(run: Run) -> dict[str, tuple[int, int]]:
    """Object key -> (bytes, header bytes) of every data file the composite's units are read from
    (a pack file holds several units: every rank reading one of them reads its header)."""
    composite = run.resolve()
    files = {}
    for unit, step in composite.sources.items():
        entry = run.unit_entry(step, unit)
        for file in entry.files:
            storage, key = run.file_location(step, file)
            files[key] = (file.bytes, 8 + int.from_bytes(storage.read_range(key, 0, 8), "little"))
    return files


def assert_each_tensor_byte_fetched_once(fetched: list[dict[str, int]], data: dict[str, tuple[int, int]]) -> None:
    """Over every rank, each file's bytes fetched at most once, its header once per rank reading
    it (before the read plan every rank fetched every file whole: 3x)."""
    for key, (size, header) in data.items():
        readers = [f[key] for f in fetched if f.get(key)]
        assert sum(readers) <= size - header + len(readers) * header, (key, size, header, readers)


def metadata(key: str) -> bool:
    """Whether ``key`` is one of a snapshot's small files every rank needs: its manifest, global
    state or a unit index (not a rank's own state, not a data file)."""
    return f"/{key}".count("/snapshots/") == 1 and key.endswith(
        ("/manifest.json", "/global.json", "/global.safetensors", "/indexes.json"))


def assert_metadata_fetched_once(results: list[dict]) -> None:
    """Over every rank, each manifest, unit index and global state file fetched by one rank in
    one read (before, every rank read each of them), and read at all (the restore needs them)."""
    keys = {key for result in results for key in result["fetched"] if metadata(key)}
    assert any(k.endswith("/global.json") for k in keys) and any(k.endswith("/indexes.json") for k in keys), keys
    for key in keys:
        reads = [result["reads"].get(key, 0) for result in results]
        assert sum(reads) == 1, (key, reads)


def launch(ranks: int, jobs: list[tuple[str, Path]], url: str) -> None:
    """One launch of ``torch_job.py`` at ``ranks`` ranks running the ``(scenario, dir)`` jobs in
    turn, ``$RUN_ROOT`` at ``url``: one node (``helpers.node_launches``, its ranks forked from the
    fork servers)."""
    [node] = node_launches(JOB, lambda _: [arg for job in jobs for arg in job],
                           lambda _: {**os.environ, "RUN_ROOT": url, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                           nodes=1, per_node=ranks, own_session=True)
    [(stdout, stderr)] = wait_launches([node], timeout=1800)
    assert node.returncode == 0, f"launch of {[scenario for scenario, _ in jobs]}: " + stdout[-3000:] + stderr[-6000:]


def save_whole(url: str, out: Path, tokens) -> None:
    """A one-process Full save of step 1 at ``url/single``, its tensors in ``out/versions/single.safetensors``."""
    model, optimizer, scheduler = tiny()
    train(model, optimizer, scheduler, tokens, [1])
    with Tailor(f"{url}/single", model, optimizer, scheduler, policy=Full()) as tailor:
        tailor.save(1)
    values = {weight_key(n): p.detach().clone() for n, p in model.named_parameters()}
    values.update({optim_key(n, k): v.clone() for n, p in model.named_parameters() for k, v in optimizer.state[p].items()})
    (out / "versions").mkdir()
    save_file(values, str(out / "versions" / "single.safetensors"))


@pytest.fixture(scope="module")
def on_s3(tmp_path_factory, tokens) -> dict[str, tuple[list[dict], dict[str, int]]]:
    """The restores of the tests below, from one bucket of moto's server (``$RUN_ROOT``; this
    process reads it too): a one-process save and a 2-rank FSDP2 save made first, then one
    3-rank launch (``ddp-read-once``, ``fsdp-read-once``) and one 4-rank launch
    (``hsdp-read-once``, ``pipeline-ddp-read-once``), each scenario in a directory of its own
    and its run named after its kind (``single`` for the pipeline's). By scenario: every rank's
    result, and the data files of the composite of its run by key, with their bytes."""
    three, four = ("ddp-read-once", "fsdp-read-once", "fetch-as-they-come"), ("hsdp-read-once", "pipeline-ddp-read-once")
    dirs = {scenario: tmp_path_factory.mktemp(scenario) for scenario in (*three, *four)}
    runs = {"pipeline-ddp-read-once": "single"}
    with moto_process() as endpoint, pytest.MonkeyPatch.context() as monkeypatch:
        url = f"s3://{new_bucket(endpoint)}/jobs"
        for name, value in environment(endpoint).items():  # this process reads the bucket too
            monkeypatch.setenv(name, value)
        save_whole(url, dirs["pipeline-ddp-read-once"], tokens)
        launch(2, [("fsdp-read-once-save", dirs["fsdp-read-once"])], url)
        launch(RANKS, [(scenario, dirs[scenario]) for scenario in three], url)
        launch(4, [(scenario, dirs[scenario]) for scenario in four], url)
        return {scenario: ([json.loads((out / f"result-{scenario}-{r}.json").read_text())
                            for r in range(RANKS if scenario in three else 4)],
                           composite_files(Run(f"{url}/{runs.get(scenario, scenario.split('-')[0])}"))
                           if scenario != "fetch-as-they-come" else {})
                for scenario, out in dirs.items()}


def test_a_three_rank_ddp_restore_fetches_each_byte_once_and_a_corrupted_file_is_refused_everywhere(on_s3):
    results, data = on_s3["ddp-read-once"]
    corrupted = results[0]["corrupted"]

    for result in results:
        assert result["restored"] == 4 and result["mismatches"] == []
    # Each byte of the composite's data files was fetched once in all (headers once per reader),
    # and the reading was spread over the ranks.
    fetched = [result["fetched"] for result in results]
    assert_each_tensor_byte_fetched_once(fetched, data)
    assert sum(f.get(key, 0) for f in fetched for key in data) <= 1.05 * sum(size for size, _ in data.values())
    assert sum(1 for f in fetched if any(f.get(key) for key in data)) > 1
    # So was each manifest, unit index and global state file (every rank read each of them before).
    assert_metadata_fetched_once(results)
    # One message per item of the read plans (the small files' shares, the units) to each rank that
    # did not read it, point to point, and no broadcast: the reader's status goes in the item's
    # own message, not in one before it (two per item).
    assert [result["plan_receipts"] for result in results] == [result["plan_items"] - result["plan_own"] for result in results]
    assert [result["broadcasts"] for result in results] == [0] * RANKS
    assert all(result["plan_items"] > 0 for result in results)
    # Rank 0's reader lease on the composite covers every rank's reads (all done before the ranks
    # agree the restore succeeded): the others take none (each took one per snapshot: four
    # requests and a delete).
    assert results[0]["leases"] > 0 and [result["leases"] for result in results[1:]] == [0] * (RANKS - 1)

    # The corrupted unit: read by one rank, whose name every rank's refusal carries, the same.
    refusals = {result["refused"] for result in results}
    (refused,) = refusals
    assert refused is not None and refused.startswith("IntegrityError: restore of step 4 failed on rank(s) [0, 1, 2]")
    reader = int(refused.split(" read unit 'layer.1'")[0].rsplit("rank ", 1)[1])
    assert results[reader]["fetched_corrupt"].get(corrupted) and "checksum mismatch" in refused, refused
    # With fallback, the damaged composite's attempt fails (after the others' units were received
    # into the live tensors) and step 2's is loaded whole on every rank: no tensor keeps a byte of
    # the failed attempt, nor of the fresh model.
    assert [result["fallback"]["restored"] for result in results] == [2] * RANKS
    assert [result["fallback"]["skipped"] for result in results] == [[4]] * RANKS
    assert [result["fallback"]["mismatches"] for result in results] == [[]] * RANKS

    # A corrupted global.json (read before any unit): found by its one reader, named by every rank.
    corrupted = results[0]["corrupted_global"]
    (refused,) = {result["refused_global"] for result in results}
    assert refused is not None and refused.startswith("IntegrityError: restore of step 4 failed on rank(s) [0, 1, 2]")
    assert "global.json" in refused and "checksum mismatch" in refused, refused
    reader = int(refused.split(" read ")[0].rsplit("rank ", 1)[1])
    assert [bool(result["fetched_global"].get(corrupted)) for result in results] == [r == reader for r in range(RANKS)]


def test_a_rank_takes_the_items_of_a_read_plan_as_they_come_not_in_turns_into_the_tensors_given(on_s3):
    """Item c's turn is first (the smallest), but its reader, rank 2, reads it only once it has
    been sent a and b: in turns every rank would wait for c and rank 2 for the others (its read
    would give up after the plan's timeout, 120 s). Each rank takes the items as their readers send them, so rank 2's
    read goes on as soon as the others are in, and every rank has every item's bytes."""
    results, _ = on_s3["fetch-as-they-come"]
    assert results[0]["readers"] == {"a": 0, "b": 1, "c": 2}
    assert results[2]["waited"] == [True]
    assert sorted(results[2]["order"][:2]) == ["a", "b"] and results[2]["order"][2] == "c"
    for result in results:
        assert sorted(result["order"]) == ["a", "b", "c"]
        assert result["values"] == {"a": [97.0], "b": [98.0], "c": [99.0]}
    # Received straight into the tensor given for it (no new memory, no copy), but where that
    # cannot take the bytes as they are (b's, a strided view): then into a new one.
    assert [result["landed"] for result in results] == [{"b": False, "c": True}, {"a": True, "c": True},
                                                        {"a": True, "b": False}]


def test_a_two_by_two_hsdp_restore_fetches_each_byte_once(on_s3):
    """2 replicas x 2 shards: each replica group reads each unit once between its two ranks; the
    two groups hold different shards, so the composite's bytes are fetched once in all (its
    plain tensors, the step counters, once per group: a few bytes)."""
    results, data = on_s3["hsdp-read-once"]
    for result in results:
        assert result["restored"] == 4 and result["mismatches"] == []
    fetched = [result["fetched"] for result in results]
    assert sum(f.get(key, 0) for f in fetched for key in data) <= 1.05 * sum(size for size, _ in data.values())
    assert all(any(f.get(key) for key in data) for f in fetched)  # every rank read its share
    assert_metadata_fetched_once(results)
    assert [result["plan_receipts"] for result in results] == [result["plan_items"] - result["plan_own"] for result in results]
    assert [result["broadcasts"] for result in results] == [0] * 4
    assert results[0]["leases"] > 0 and [result["leases"] for result in results[1:]] == [0, 0, 0]


def test_the_data_ranks_of_each_pipeline_stage_read_its_units_once_between_them(on_s3):
    """Two pipeline stages, each DDP over two data ranks (its own process group), restore a
    one-process save (``save_whole``): each stage's units are read once between its two ranks, so each byte of
    the composite once in all (before, both data ranks of a stage read all of its units)."""
    results, data = on_s3["pipeline-ddp-read-once"]
    for result in results:
        assert result["restored"] == 1 and result["compared"] > 0 and result["mismatches"] == []
    fetched = [result["fetched"] for result in results]
    assert_each_tensor_byte_fetched_once(fetched, data)
    assert all(any(f.get(key) for key in data) for f in fetched)  # every data rank read its share
    assert_metadata_fetched_once(results)


def test_an_fsdp2_restore_at_three_ranks_of_a_save_at_two_fetches_each_file_in_few_requests_each_byte_once(on_s3):
    """Restored at 3 ranks, a 2-rank FSDP2 save's shards are boxes of every file's chunks: each
    rank used to fetch each box it needs in a request of its own (one per tensor per file, and
    the pages around a box's ends fetched by both ranks sharing them). Now the ranges every rank
    needs are fetched once in the job, in requests of at most ``fetch.PART`` bytes per unit of a
    file, and sent to the ranks that need them: a file's requests are its header's (one in the
    job, its size with it: it was a HEAD and two GETs) and one per unit it holds (the tiny
    model's units are all under ``PART``)."""
    results, data = on_s3["fsdp-read-once"]  # saved at 2 ranks (``fsdp-read-once-save``) first
    for result in results:
        assert result["restored"] == 4 and result["mismatches"] == []
    fetched = [result["fetched"] for result in results]
    assert_each_tensor_byte_fetched_once(fetched, data)
    for key, units in results[0]["units_of_files"].items():
        requests = sum(result["reads"].get(key, 0) + result["looks"].get(key, 0) for result in results)
        assert requests <= 1 + units, (key, requests, units)
    # Each rank is sent only the bytes of its own ranges (at most), not every piece fetched:
    # broadcast to every rank, each received about (world - 1) / world of the unit data.
    for result in results:
        assert 0 < result["ranges_received"] <= result["ranges_needed"], (result["ranges_received"], result["ranges_needed"])
    # One collective per rank in all (the closing one, saying which read failed first, if any), not
    # a status broadcast per piece: a rank waits for its own reads and the pieces it wants, not for
    # the group at every piece.
    assert [result["collectives"] for result in results] == [1] * RANKS
    # A corrupted chunk: found by the ranks whose boxes hold the byte (on the bytes received),
    # and the restore refused on every rank, none left waiting in a broadcast.
    (refused,) = {result["refused"] for result in results}
    assert refused is not None and refused.startswith("IntegrityError: restore of step 4 failed on rank(s) [")
    assert "checksum mismatch" in refused and results[0]["corrupted"] in refused, refused
    # A piece whose fetch fails on its reader (rank 1): the same error on every rank, naming it.
    (refused,) = {result["refused_read"] for result in results}
    assert refused is not None and refused.startswith("IntegrityError: restore of step 4 failed on rank(s) [0, 1, 2]")
    assert "rank 1 read bytes " in refused and "injected damage" in refused, refused


def test_a_reader_killed_during_a_restore_fails_every_other_rank_within_the_timeout_naming_it(tmp_path):
    """Three ranks each run to its end (``statuses_of``: torchrun would kill the survivors itself);
    rank 1 dies as it begins reading its first unit, which ranks 0 and 2 wait to receive from it."""
    statuses = tmp_path / "statuses.json"
    [launch] = node_launches(JOB, lambda _: ["read-kill", tmp_path], lambda _: {**os.environ, "OMP_NUM_THREADS": "1"},
                             nodes=1, per_node=3, own_session=True, statuses_of=lambda _: statuses)
    [(_, stderr)] = wait_launches([launch])
    assert launch.returncode == 0, stderr[-3000:]
    codes = json.loads(statuses.read_text())
    assert codes[1] == -signal.SIGKILL, (codes, stderr[-3000:])
    for survivor in (0, 2):
        assert codes[survivor] == 0, (codes, stderr[-3000:])
        outcome = json.loads((tmp_path / f"result-read-kill-{survivor}.json").read_text())["outcome"]
        # Every survivor gave up on rank 1 at the timeout at the latest (how many seconds that
        # took on a busy machine is not asserted), its error naming rank 1, and the message of
        # the read plan it was waiting for from rank 1 (or sending it) when it was lost.
        assert outcome.startswith("CoordinationError: rank(s) [1] did not report on "), outcome
        assert re.search(rf"rank {survivor} failed: the (receipt|send) of unit '[^']+' of step \d between rank {survivor} "
                         r"and rank 1 failed", outcome) and "within 10 s" in outcome, outcome
