"""What a restore from an object store asks of the server, counted at the server (moto behind a
recording layer, ``objectstore.faulty_moto``): each small request needed, none twice (issue 33:
on moto each costs 4-5 ms of its CPU whatever its size). And a run whose reader lease cannot be
written for want of rights is read without one only where the server said so, never because of
what its text holds."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import tiny, train

pytest.importorskip("obstore")
pytest.importorskip("moto")

from objectstore import client, faulty_moto, new_bucket, set_environment  # noqa: E402

from llmtailor import Full, Parity, Tailor  # noqa: E402
from llmtailor.errors import StorageError  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402
from llmtailor.store.storage.object_commit import tombstone  # noqa: E402

FAST_RETRY = {"max_retries": 2, "retry_timeout": 10.0, "backoff": {"init_backoff": 0.01, "max_backoff": 0.05, "base": 2.0}}


def small_requests(seen: list, run_prefix: str) -> Counter:
    """The requests in ``seen`` (``Faults.seen``) that are not a unit's data: ``(method, key)``,
    the key inside the run at ``run_prefix`` (``/bucket/run``), a reader lease's id folded; a
    listing as ``("LIST", "")`` (its prefix is in the query, which the record leaves out)."""
    counted: Counter = Counter()
    for method, path, _ in seen:
        key = path[len(run_prefix) + 1:] if path.startswith(f"{run_prefix}/") else ""
        if "/units/" in key or "/packs/" in key:
            continue
        if method == "GET" and not key:
            method = "LIST"
        if "/.readers/" in key:
            key = key.rsplit("/", 1)[0] + "/<id>"
        counted[method, key] += 1
    return counted


def saved(url: str, tokens, steps: tuple[int, ...] = (1, 2), policy=None) -> None:
    model, opt, sched = tiny()
    with Tailor(url, model, opt, sched, policy=policy or Full()) as tailor:
        for step in steps:
            train(model, opt, sched, tokens, [step])
            tailor.save(step)


def test_a_restore_asks_each_small_request_once_whatever_the_number_of_snapshots(tokens, monkeypatch):
    """A restore of a run of steps 1 to 3 (``latest`` names 3), counted at the server. Rank 0's
    choice: the listing of the snapshots (a LIST) and the pointer (a GET); the lease on step 3:
    its PUT, then the removal mark looked for and the manifest read (a GET, which is also the
    check that step 3 is committed), and its DELETE (a bulk one) at the end; the unit indexes and
    the global state, a GET each. BEFORE: every snapshot's manifest was also looked for while the
    run was listed, step 3's too, which its lease's GET makes needless, and steps 1 and 2's,
    which the composite does not need (a HEAD each: ``{('HEAD', 'snapshots/step-00000001/
    manifest.json'): 1, ...2..., ...3...}`` more, one per snapshot of the run). The same for a
    reader of the composite alone (``Run.reading``: ``export``, ``merge``, the CLI)."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        bucket = new_bucket(endpoint)
        url = f"s3://{bucket}/run"
        saved(url, tokens, (1, 2, 3))
        model, opt, sched = tiny()
        tailor = Tailor(url, model, opt, sched, read_only=True)
        faults.seen.clear()
        assert tailor.restore().step == 3
        restored = small_requests(faults.seen, f"/{bucket}/run")
        step3 = "snapshots/step-00000003"
        lease = {("PUT", f"{step3}/.readers/<id>"): 1, ("HEAD", f"{step3}/.removing"): 1,
                 ("GET", f"{step3}/manifest.json"): 1, ("POST", ""): 1}
        assert restored == Counter({("LIST", ""): 1, ("GET", "latest"): 1, **lease, ("GET", f"{step3}/indexes.json"): 1,
                                    ("GET", f"{step3}/global.json"): 1, ("GET", f"{step3}/global.safetensors"): 1}), restored
        tailor.close()

        faults.seen.clear()
        with Run(url).reading() as composite:
            assert composite.step == 3
        read = small_requests(faults.seen, f"/{bucket}/run")
        assert read == Counter({("LIST", ""): 1, ("GET", "latest"): 1, **lease}), read


def test_a_snapshot_newer_than_latest_is_looked_for_and_followed_and_an_older_one_the_composite_needs_is_leased(
        tokens, monkeypatch):
    """Parity saves of steps 1 to 3, then ``latest`` put back to name step 2 (a crash between the
    commit of 3 and the pointer's update): the restore looks for step 3's manifest (a HEAD: newer
    than the pointer), follows it (its parent is 2) and loads the composite of 3, leasing step 2,
    whose units it needs (its lease reads its manifest, not read nor looked for before), without
    looking for step 1's."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        bucket = new_bucket(endpoint)
        url = f"s3://{bucket}/run"
        saved(url, tokens, (1, 2, 3), Parity())
        client(endpoint).put_object(Bucket=bucket, Key="run/latest", Body=b"step-00000002")
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, read_only=True) as tailor:
            faults.seen.clear()
            report = tailor.restore()
        assert report.step == 3 and set(report.sources.values()) == {2, 3}
        asked = small_requests(faults.seen, f"/{bucket}/run")
        # Looked for while listing and by its lease (its manifest read in between, to follow it).
        assert asked["HEAD", "snapshots/step-00000003/manifest.json"] == 2
        # Step 2 leased before its manifest is read: the lease's GET reads it (BEFORE: a HEAD while
        # listing, its GET to find what it keeps, then a HEAD by its lease).
        step2 = "snapshots/step-00000002"
        assert (asked["PUT", f"{step2}/.readers/<id>"], asked["GET", f"{step2}/manifest.json"]) == (1, 1), asked
        assert asked["HEAD", f"{step2}/manifest.json"] == 0, asked
        assert not any("step-00000001" in key for _, key in asked), asked


@pytest.mark.parametrize("gone", ["removed", "tombstone"])
def test_a_pointer_to_a_snapshot_that_is_not_committed_restores_the_newest_committed_one(tokens, monkeypatch, gone):
    """``latest`` names step 2, whose manifest is gone (removed by hand) or a tombstone: the
    lease that looks for it (its manifest not looked for while listing) finds no snapshot, and
    the restore takes step 1, the newest committed, as ``latest_step`` says, looking for step 2's
    manifest in the listing that follows (a HEAD) and not leasing it again."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        bucket = new_bucket(endpoint)
        url = f"s3://{bucket}/run"
        saved(url, tokens)
        key = "run/snapshots/step-00000002/manifest.json"
        if gone == "removed":
            client(endpoint).delete_object(Bucket=bucket, Key=key)
        else:
            client(endpoint).put_object(Bucket=bucket, Key=key, Body=tombstone())
        assert Run(url).latest_step() == 1
        model, opt, sched = tiny()
        with Tailor(url, model, opt, sched, read_only=True) as tailor:
            faults.seen.clear()
            assert tailor.restore().step == 1
        asked = small_requests(faults.seen, f"/{bucket}/run")
        assert asked["PUT", "snapshots/step-00000002/.readers/<id>"] == 1
        assert asked["HEAD", "snapshots/step-00000002/manifest.json"] == 1
        assert asked["PUT", "snapshots/step-00000001/.readers/<id>"] == 1


def test_a_lease_refused_for_want_of_rights_reads_without_one_and_a_failure_whose_text_says_so_does_not(tokens, monkeypatch):
    """A reader lease's PUT answered 403 (read-only credentials) on a run: read without a lease
    (the snapshot's manifest there). The same PUT failing with a 503 every try on a run whose
    prefix reads "permission denied": the read fails, naming the lease's key, and is not read
    unleased (retention could remove what it reads). BEFORE: that read went on without a lease,
    the error's text matched "permission denied" (its key)."""
    with faulty_moto() as (endpoint, faults):
        set_environment(monkeypatch, endpoint)
        bucket = new_bucket(endpoint)
        for prefix, status in (("run", 403), ("permission denied/run", 503)):
            url = f"s3://{bucket}/{prefix}"
            saved(url, tokens)
            faults.rule = lambda method, key, status=status: status if method == "PUT" and "/.readers/" in key else None
            run = Run(url, {"retry_config": FAST_RETRY})
            if status == 403:
                with run.reading() as composite:
                    assert composite.step == 2
            else:
                with pytest.raises(StorageError, match=r"step-00000002/\.readers/[0-9a-f]{32}: .*HTTP 503"):
                    with run.reading():
                        pass
            faults.rule = lambda method, key: None
