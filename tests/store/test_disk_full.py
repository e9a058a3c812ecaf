"""Disk full: a save that runs out of space fails clearly and leaves the run as it was.

Each case mounts a small tmpfs (root only; skipped with the reason otherwise), saves step 1
into a run on it, then writes a ballast file that leaves exactly enough free pages for the
files the second save writes before the file under test, and one page less than that file
needs. ENOSPC therefore strikes inside that file — a unit file, global.safetensors,
global.json, the manifest, or the ``latest`` pointer after the commit — and a spy on the
writer checks that it did. The sizes come from a twin run on ordinary disk that makes the
same two saves first.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from helpers import assert_bitwise, tiny, train, tree_digest, unit_versions


from llmtailor import Full, Tailor
from llmtailor.constants import GLOBAL_JSON, GLOBAL_TENSORS, LATEST_FILE, MANIFEST_FILE, TMP_DIR
from llmtailor.errors import TailorError
from llmtailor.store.storage.local_durable import replace_text_atomically
from llmtailor.store.run import Run
from llmtailor.store.storage import local_commit
from llmtailor.store.storage.local import LocalSink, LocalStorage

PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs allocates whole pages


def pages(size: int) -> int:
    return -(-size // PAGE)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def leave_free(mount: Path, free: int) -> Path:
    """Fill the file system with a ballast file until exactly ``free`` bytes are left."""
    ballast = mount / "ballast"
    with open(ballast, "ab") as out:
        out.write(bytes(free_bytes(mount) - free))
    assert free_bytes(mount) == free
    return ballast


def written_in_order(run: Path, step: int) -> list[tuple[str, int]]:
    """(path, bytes) of a snapshot's files in the order a save writes them: the unit files,
    global.safetensors and global.json, indexes.json (the manifest's files); the manifest
    itself comes last."""
    reader = Run(run)
    manifest = reader.manifest(step)
    size = (reader.snapshot_dir(step) / MANIFEST_FILE).stat().st_size
    # Each file once: a pack file is listed by every unit it holds.
    units = list(dict.fromkeys((f.path, f.bytes) for unit in manifest.units for f in reader.unit_entry(step, unit).files))
    # From schema 6 the index file is among the manifest's files (written after the global state's).
    indexes = [(ref.index.path, ref.index.bytes) for ref in manifest.units.values() if ref.index_at is None]
    return units + [(f.path, f.bytes) for f in manifest.files] + indexes + [(MANIFEST_FILE, size)]


class WriteSpy:
    """Which file a save was writing when it ran out of space (through the local storage's
    sinks and small-file writes)."""

    def __init__(self, monkeypatch):
        self.failed: list[str] = []
        for name in ("write", "close"):
            monkeypatch.setattr(LocalSink, name, self._wrap(getattr(LocalSink, name), lambda sink, *a: sink.path))
        for name in ("put", "replace"):
            monkeypatch.setattr(LocalStorage, name, self._wrap(getattr(LocalStorage, name), lambda storage, key, *a: key))
        monkeypatch.setattr(local_commit, "create_file", self._wrap(local_commit.create_file, lambda path, *a: path))  # the manifest
        # latest's new file, written by the commit once the manifest is
        monkeypatch.setattr(local_commit, "create_replacement", self._wrap(local_commit.create_replacement, lambda path, *a: path))

    def _wrap(self, write, name_of):
        def spy(*args, **kwargs):
            try:
                return write(*args, **kwargs)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    self.failed.append(Path(name_of(*args)).name)
                raise

        return spy


# Which file of the second snapshot runs out of space, given the files in the order written.
CASES = {
    "first unit file": lambda files: files[0][0],
    "last unit file": lambda files: [p for p, _ in files if p.startswith(("units/", "packs/"))][-1],
    "global tensors": lambda files: GLOBAL_TENSORS,
    "global json": lambda files: GLOBAL_JSON,
    "manifest": lambda files: MANIFEST_FILE,
}


def two_saves(mount: Path, tmp_path: Path, tokens):
    """A run on the small file system with step 1 saved, a twin run on ordinary disk with steps
    1 and 2 saved, and the tailor ready to save step 2 on the small one."""
    model, optimizer, scheduler = tiny(layers=2, hidden=16)
    run = mount / "run"
    tailor = Tailor(run, model, optimizer, scheduler, policy=Full())
    twin = Tailor(tmp_path / "twin", model, optimizer, scheduler, policy=Full())
    train(model, optimizer, scheduler, tokens, [1])
    tailor.save(1)
    twin.save(1)
    saved_at_1 = unit_versions(model, optimizer)
    train(model, optimizer, scheduler, tokens, [2])
    twin.save(2)
    files = written_in_order(tmp_path / "twin", 2)
    return run, tailor, files, saved_at_1


def assert_run_as_before(run: Path, before: dict[str, str], saved_at_1) -> None:
    assert tree_digest(run) == before  # every file of step 1 byte-identical, `latest` too
    assert list((run / TMP_DIR).iterdir()) == []
    assert Run(run).steps() == [1] and Run(run).latest_step() == 1
    assert (run / LATEST_FILE).read_text() == "step-00000001\n"
    assert Run(run).verify() == []
    model, optimizer, scheduler = tiny(layers=2, hidden=16, seed=5)
    assert Tailor(run, model, optimizer, scheduler).restore().step == 1
    assert_bitwise(unit_versions(model, optimizer), saved_at_1)


@pytest.mark.parametrize("case", CASES)
def test_a_save_that_runs_out_of_space_fails_clearly_and_touches_nothing(small_fs, tmp_path, tokens, monkeypatch, case):
    run, tailor, files, saved_at_1 = two_saves(small_fs, tmp_path, tokens)
    target = CASES[case](files)
    before_target = [size for path, size in files[: [p for p, _ in files].index(target)]]
    ballast = leave_free(small_fs, (sum(pages(s) for s in before_target) + pages(dict(files)[target]) - 1) * PAGE)
    before = tree_digest(run)
    spy = WriteSpy(monkeypatch)

    with pytest.raises(TailorError) as err:
        tailor.save(2)

    assert spy.failed[:1] == [Path(target).name], f"ran out of space in {spy.failed}, not in {target}"
    assert "no space left" in str(err.value).lower() and str(run) in str(err.value)
    assert_run_as_before(run, before, saved_at_1)
    # Space freed, the same tailor saves step 2 as if nothing had happened.
    ballast.unlink()
    tailor.save(2)
    tailor.close()
    assert Run(run).steps() == [1, 2] and Run(run).verify() == []


def test_no_space_for_the_latest_pointer_after_the_commit(small_fs, tmp_path, tokens, monkeypatch):
    run, tailor, files, _ = two_saves(small_fs, tmp_path, tokens)
    leave_free(small_fs, sum(pages(size) for _, size in files) * PAGE)
    step_1 = tree_digest(run / "snapshots/step-00000001")
    spy = WriteSpy(monkeypatch)

    with pytest.raises(Exception) as err:
        tailor.save(2)
    tailor.close()

    assert spy.failed == [LATEST_FILE]
    # Step 2 is committed; `latest` is not updated, and its parent chain still finds step 2.
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(f".{LATEST_FILE}")) == []
    assert tree_digest(run / "snapshots/step-00000001") == step_1
    assert Run(run).verify() == [] and Run(run).latest_step() == 2
    model, optimizer, scheduler = tiny(layers=2, hidden=16, seed=5)
    assert Tailor(run, model, optimizer, scheduler).restore().step == 2
    assert isinstance(err.value, TailorError), f"{type(err.value).__name__}: {err.value}"
    assert "no space left" in str(err.value).lower() and str(run) in str(err.value)


def test_replacing_a_file_on_a_full_disk_keeps_the_old_one_and_leaves_no_temp_file(small_fs):
    pointer = small_fs / LATEST_FILE
    replace_text_atomically(pointer, "step-00000001\n")
    leave_free(small_fs, 0)
    with pytest.raises(OSError) as err:
        replace_text_atomically(pointer, "step-00000002\n")
    assert err.value.errno == errno.ENOSPC
    assert pointer.read_text() == "step-00000001\n"
    assert sorted(p.name for p in small_fs.iterdir()) == ["ballast", LATEST_FILE]
