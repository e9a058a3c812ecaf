"""Links out of a run are not followed: a unit file or a snapshot directory that resolves
outside the run is refused by verify and restore, naming the path; the run root itself may be
a link."""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import parity_run, assert_bitwise, tiny, tree_digest, unit_versions
from helpers import unit_file as file_holding
from typer.testing import CliRunner

from llmtailor import Tailor
from llmtailor.cli import app
from llmtailor.errors import IntegrityError
from llmtailor.store.reader import ChunkReader
from llmtailor.store.run import Run
from llmtailor.store.storage.local_lock import LEASE_FILE

runner = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokens):
    """Parity saves at steps 1..3."""
    return parity_run(tmp_path_factory.mktemp("links") / "run", tokens, 3)


@pytest.fixture
def run_dir(saved, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def _link_out(path, outside):
    """Move ``path`` to ``outside`` and leave a symlink to it: the bytes are the same."""
    shutil.move(path, outside)
    os.symlink(outside, path)


def test_a_unit_file_linked_outside_the_run_is_refused(run_dir, tmp_path):
    unit_file = file_holding(run_dir, 3, "layer.0")
    _link_out(unit_file, tmp_path / "elsewhere.safetensors")
    result = runner.invoke(app, ["verify", str(run_dir)])
    assert result.exit_code == 1
    assert f"{unit_file}: resolves to {tmp_path / 'elsewhere.safetensors'}, outside the run" in result.output
    with pytest.raises(IntegrityError, match=f"{unit_file}: resolves to .*, outside the run"):
        Tailor(run_dir, *tiny(seed=2)).restore()
    # The ranged reader (FSDP2, DeepSpeed, merge sources) refuses it too.
    run = Run(run_dir)
    entry = run.unit_entry(3, "layer.0")
    tensor = entry.tensors[0]
    with pytest.raises(IntegrityError, match="outside the run"):
        ChunkReader(run).read_region(3, entry, tensor, (0,) * len(tensor.shape), tuple(tensor.shape))


def test_a_snapshot_directory_linked_outside_the_run_is_refused_and_nothing_is_created_there(run_dir, tmp_path):
    snapshot = run_dir / "snapshots/step-00000002"
    outside = tmp_path / "step-2-elsewhere"
    _link_out(snapshot, outside)
    (outside / LEASE_FILE).unlink(missing_ok=True)
    result = runner.invoke(app, ["verify", str(run_dir)])
    assert result.exit_code == 1 and f"{snapshot}: resolves to {outside}, outside the run" in result.output
    with pytest.raises(IntegrityError, match=f"{snapshot}: resolves to {outside}, outside the run"):
        Tailor(run_dir, *tiny(seed=2)).restore()  # the composite of 3 needs step 2
    assert not (outside / LEASE_FILE).exists()


def test_a_run_reached_through_a_link_and_links_inside_it_are_fine(saved, run_dir, tmp_path):
    inside = run_dir / "spare.safetensors"  # a unit file linked to a place inside the run
    unit_file = file_holding(run_dir, 3, "layer.0")
    _link_out(unit_file, inside)
    link = tmp_path / "run-link"
    os.symlink(run_dir, link)
    assert runner.invoke(app, ["verify", str(link)]).exit_code == 0
    model, opt, sched = tiny(seed=2)
    assert Tailor(link, model, opt, sched).restore().step == 3
    twin, twin_opt, twin_sched = tiny(seed=2)
    Tailor(saved, twin, twin_opt, twin_sched).restore()  # the same composite, by the plain path
    assert_bitwise(unit_versions(model, opt), unit_versions(twin, twin_opt))


def test_retention_and_the_pointers_replace_remove_links_never_what_they_point_to(run_dir, tmp_path):
    """A run whose ``latest`` is a link to a file elsewhere and whose snapshot retention discards is
    a link to a directory elsewhere: a save with ``keep=1`` replaces the one and removes the other
    as links, leaving the files they point to as they were. Before, the purger resolved both: the
    pointer's replace deleted the file ``latest`` pointed to (since the old pointer was kept linked
    in ``.tmp/`` for the purger, session 47), and retention the whole directory outside the run."""
    from llmtailor import Parity
    from llmtailor.store.storage.local_commit import _PURGER

    pointer, snapshot = tmp_path / "pointer-elsewhere", tmp_path / "step-1-elsewhere"
    _link_out(run_dir / "latest", pointer)
    _link_out(run_dir / "snapshots/step-00000001", snapshot)  # the composite of 3 does not need it
    before = {"pointer": pointer.read_bytes(), **{f"step-1/{k}": v for k, v in tree_digest(snapshot).items()}}
    tailor = Tailor(run_dir, *tiny(seed=2), policy=Parity(), keep=1)
    assert tailor.restore().step == 3
    tailor.save(4)
    _PURGER.wait(run_dir)
    tailor.close()
    assert pointer.exists() and snapshot.exists(), (pointer.exists(), snapshot.exists())
    assert {"pointer": pointer.read_bytes(), **{f"step-1/{k}": v for k, v in tree_digest(snapshot).items()}} == before
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == ["step-00000003", "step-00000004"]
    assert (run_dir / "latest").read_text() == "step-00000004\n" and not (run_dir / "latest").is_symlink()
    assert not any((run_dir / ".trash").iterdir()) and not any((run_dir / ".tmp").iterdir())
