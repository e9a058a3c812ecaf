"""A local save publishes nothing before it is durable: every file and directory of a snapshot
is fsynced before the rename that publishes the snapshot, the new ``latest`` before the rename
that replaces it, each renamed entry's directory after its rename and before the save returns
(docs/format.md); ``latest`` names a snapshot whose rename is not durable only where a crash
then resolves it to the snapshot's parent (the run's newest). And it makes no more waits on the
disk than that rule needs: a small save's time is its fsyncs (bench/RESULTS.md, issue 33), so
their number is pinned here.

Every fsync and rename of a save is recorded (``os.fsync``, ``os.rename``, ``os.replace``
patched): an fsync as it returns, with the path of its descriptor; a rename as it begins."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
from helpers import assert_bitwise, failing_fsync_of, tiny, train, unit_versions

from llmtailor import Full, Tailor
from llmtailor.constants import (GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, LATEST_FILE, MANIFEST_FILE, PACKS_DIR, TMP_DIR,
                                 pack_filename, snapshot_dirname)
from llmtailor.store.run import Run
from llmtailor.store.storage import local_durable
from llmtailor.store.storage.local_lock import LEASE_FILE


class Recorder:
    """The fsyncs (as they return) and renames (as they begin) of this process, in order."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, ...]] = []
        self.lock = threading.Lock()
        real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

        def fsync(fd):
            number = fd if isinstance(fd, int) else fd.fileno()
            path, size = os.readlink(f"/proc/self/fd/{number}"), os.fstat(number).st_size
            real_fsync(fd)
            self.add("fsync", path, threading.current_thread().name, size)

        def renaming(real):
            def rename(src, dst, *args, **kwargs):
                self.add("rename", os.path.realpath(src), os.path.realpath(dst))
                return real(src, dst, *args, **kwargs)
            return rename

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", renaming(real_rename))
        monkeypatch.setattr(os, "replace", renaming(real_replace))

    def add(self, *event: str) -> None:
        with self.lock:
            self.events.append(event)

    def fsyncs(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "fsync"]

    def rename_of(self, dst: Path) -> int:
        found = [i for i, e in enumerate(self.events) if e[0] == "rename" and e[2] == str(dst)]
        assert len(found) == 1, (dst, self.events)
        return found[0]

    def synced(self, path: Path | str, after: int = -1, before: int | None = None, size: int | None = None) -> bool:
        """Whether ``path`` was fsynced (returned) between events ``after`` and ``before``
        (with ``size``: once it held that many bytes; an fsync of an unfinished file does not count)."""
        end = len(self.events) if before is None else before
        return any(e[:2] == ("fsync", str(path)) and (size is None or e[3] == size) for e in self.events[after + 1 : end])


def _saved_once(tmp_path, tokens) -> tuple[Path, Tailor]:
    """A tiny model's Tailor (``Full``, ``keep=1``) that saved step 1, and its run's root."""
    model, optimizer, scheduler = tiny(layers=2)
    train(model, optimizer, scheduler, tokens, [0])
    root = Path(os.path.realpath(tmp_path)) / "run"
    tailor = Tailor(root, model, optimizer, scheduler, policy=Full(), keep=1, track_drift=False)
    tailor.save(1)
    return root, tailor


def _saved_twice(tmp_path, tokens, monkeypatch) -> tuple[Recorder, Path, Tailor]:
    """A tiny model saved at steps 1 and 2 with ``keep=1`` (the second save removes the first:
    retention's rename too); the recorder holds the events of the second save only. Every
    staged file has its write-out started after its first bytes (``WRITE_OUT_FROM``: an fsync
    of an unfinished file, which must not stand for the fsync of the whole)."""
    from llmtailor.store.storage import local_durable

    root, tailor = _saved_once(tmp_path, tokens)
    recorder = Recorder(monkeypatch)
    monkeypatch.setattr(local_durable, "WRITE_OUT_FROM", 1, raising=False)
    tailor.save(2)
    Run(root).storage.commits.wait_purged()  # retention's removal, on the purger's thread
    monkeypatch.undo()
    return recorder, root, tailor


def test_a_local_save_publishes_each_file_and_directory_only_once_it_is_durable(tmp_path, tokens, monkeypatch):
    recorder, root, tailor = _saved_twice(tmp_path, tokens, monkeypatch)
    try:
        snapshots = root / "snapshots"
        final = snapshots / snapshot_dirname(2)
        published = recorder.rename_of(final)
        staging = Path(recorder.events[published][1])
        for directory, dirs, files in os.walk(final):
            staged = staging / Path(directory).relative_to(final)
            assert recorder.synced(staged, before=published), f"{staged} not fsynced before the snapshot's rename"
            for name in files:
                if name == LEASE_FILE:  # empty, made with the staging directory: its entry is the directory's
                    continue
                assert recorder.synced(staged / name, before=published, size=(Path(directory) / name).stat().st_size), \
                    f"{staged / name} not fsynced whole before the rename"
        latest = recorder.rename_of(root / LATEST_FILE)
        new_latest = recorder.events[latest][1]
        assert recorder.synced(new_latest, before=latest), "latest's new file was not fsynced before its rename"
        # The parent (step 1) is the run's newest snapshot: both renames made durable together,
        # once both are done (a pointer durable first stands for step 1 after a crash:
        # test_a_latest_naming_a_snapshot_whose_rename_was_lost_stands_for_the_newest_committed_one).
        discarded = [i for i, e in enumerate(recorder.events) if e[0] == "rename" and e[1] == str(snapshots / snapshot_dirname(1))]
        assert len(discarded) == 1, recorder.events
        assert published < latest < discarded[0], recorder.events
        assert recorder.synced(snapshots, after=latest, before=discarded[0]), "the snapshot's rename was not made durable"
        assert recorder.synced(root, after=latest, before=discarded[0]), \
            "retention removed a snapshot before latest's replacement was durable"
        assert recorder.synced(snapshots, after=discarded[0]), "retention's rename was not made durable"
    finally:
        tailor.close()


def test_a_save_after_the_newest_snapshot_makes_its_rename_and_latests_durable_in_one_wait(tmp_path, tokens, monkeypatch):
    """A small save's time is its waits on the disk one after another (bench/RESULTS.md, issue
    33, session 50): when the parent is the run's newest snapshot, the fsyncs of ``snapshots/``
    (the snapshot's rename) and of the run's directory (``latest``'s) wait for each other here
    (a barrier): one after the other, they never meet and the save fails. Still 11 fsyncs."""
    root, tailor = _saved_once(tmp_path, tokens)
    with tailor:
        together, real, calls = threading.Barrier(2, timeout=30), os.fsync, []

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            calls.append(path)
            if path in (str(root), str(root / "snapshots")) and threading.current_thread().name != "llmtailor-purge":
                together.wait()
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        tailor.save(2)
        tailor.run.storage.commits.wait_purged()
        monkeypatch.undo()
    assert len(calls) == 11, calls
    assert Run(root).latest_step() == 2


def test_a_latest_that_cannot_be_replaced_after_the_newest_snapshot_leaves_the_snapshot_committed_durably(tmp_path, tokens, monkeypatch):
    """When the two renames are to be made durable together and ``latest``'s replace fails (no
    space), the snapshot's own rename is still made durable before the save reports the
    pointer's failure; ``latest`` still names step 1 and step 2 is found through its parent."""
    import errno

    from llmtailor.errors import TailorError

    root, tailor = _saved_once(tmp_path, tokens)
    with tailor:
        recorder = Recorder(monkeypatch)
        recorded = os.replace

        def replace(src, dst, *args, **kwargs):
            if Path(dst).name == LATEST_FILE:
                raise OSError(errno.ENOSPC, "No space left on device")
            return recorded(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(TailorError, match="no space left"):
            tailor.save(2)
        monkeypatch.undo()
    published = recorder.rename_of(root / "snapshots" / snapshot_dirname(2))
    assert recorder.synced(root / "snapshots", after=published)
    assert (root / LATEST_FILE).read_text().strip() == snapshot_dirname(1)
    assert Run(root).latest_step() == 2 and not [p for p in (root / TMP_DIR).iterdir() if p.name.startswith(".")]


def test_a_save_whose_parent_is_not_the_newest_snapshot_is_durable_before_latest_names_it(tmp_path, tokens, monkeypatch):
    """A save branching off an older snapshot (step 3 from step 1, step 2 the run's newest): a
    ``latest`` durable before its rename would stand for step 2 after a crash, not for the
    parent, so here the snapshot's rename is made durable first, then ``latest`` replaced and
    its directory fsynced."""
    model, optimizer, scheduler = tiny(layers=2)
    train(model, optimizer, scheduler, tokens, [0])
    root = Path(os.path.realpath(tmp_path)) / "run"
    with Tailor(root, model, optimizer, scheduler, policy=Full(), track_drift=False) as tailor:
        tailor.save(1)
        tailor.save(2)
        assert tailor.restore(1).step == 1
        recorder = Recorder(monkeypatch)
        tailor.save(3)
        monkeypatch.undo()
    snapshots = root / "snapshots"
    published, latest = recorder.rename_of(snapshots / snapshot_dirname(3)), recorder.rename_of(root / LATEST_FILE)
    assert recorder.synced(snapshots, after=published, before=latest), "latest named a snapshot whose rename was not durable"
    assert recorder.synced(root, after=latest)
    assert Run(root).manifest(3).parent == 1 and Run(root).latest_step() == 3


def test_a_latest_naming_a_snapshot_whose_rename_was_lost_stands_for_the_newest_committed_one(tmp_path, tokens):
    """What a power loss can leave when a save's two renames are made durable together (its
    parent the run's newest snapshot): ``latest`` naming step 2, whose directory is still in
    ``.tmp/`` (its rename lost). The run's composite is then step 1's, the one before that save:
    restore loads it bitwise, and the next writer saves step 2 again and commits it."""
    model, optimizer, scheduler = tiny(layers=2)
    root = tmp_path / "run"
    with Tailor(root, model, optimizer, scheduler, policy=Full(), track_drift=False) as tailor:
        train(model, optimizer, scheduler, tokens, [1])
        tailor.save(1)
        expected = unit_versions(model, optimizer)
        train(model, optimizer, scheduler, tokens, [2])
        tailor.save(2)
    (root / TMP_DIR).mkdir(exist_ok=True)
    os.rename(root / "snapshots" / snapshot_dirname(2), root / TMP_DIR / f"{snapshot_dirname(2)}.1.0badc0de")
    assert (root / LATEST_FILE).read_text().strip() == snapshot_dirname(2)
    assert Run(root).latest_step() == 1
    fresh = tiny(layers=2, seed=3)
    with Tailor(root, *fresh, policy=Full(), track_drift=False) as tailor:
        assert tailor.restore().step == 1
        assert_bitwise(unit_versions(fresh[0], fresh[1]), expected)
        tailor.save(2)
    assert Run(root).latest_step() == 2 and Run(root).manifest(2).parent == 1


def test_retention_makes_its_rename_durable_on_the_purgers_thread_before_removing_anything(tmp_path, tokens, monkeypatch):
    """A save with ``keep`` returns once its own snapshot and ``latest`` are durable: the
    snapshot retention discards is renamed into ``.trash/`` and its parent fsynced on the
    purger's thread, before any of its files is removed (a crash before that fsync brings the
    old snapshot back whole: one composite more than ``keep``, until the next writer's
    retention). That fsync was the last of a small save's chain (bench/RESULTS.md, issue 33,
    session 46). Every fsync of ``snapshots/`` and every removal of a trash directory is
    recorded with its thread."""
    root, tailor = _saved_once(tmp_path, tokens)
    with tailor:
        recorder = Recorder(monkeypatch)
        real_rmtree = local_durable.shutil.rmtree

        def rmtree(path, *args, **kwargs):
            recorder.add("rmtree", os.path.realpath(path))
            return real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(local_durable.shutil, "rmtree", rmtree)
        tailor.save(2)
        tailor.run.storage.commits.wait_purged()
        monkeypatch.undo()
    snapshots = root / "snapshots"
    discarded = [i for i, e in enumerate(recorder.events) if e[0] == "rename" and e[1] == str(snapshots / snapshot_dirname(1))]
    removed = [i for i, e in enumerate(recorder.events) if e[0] == "rmtree"]
    assert len(discarded) == 1 and len(removed) == 1, recorder.events
    synced = [e[2] for e in recorder.events[discarded[0] + 1 : removed[0]] if e[:2] == ("fsync", str(snapshots))]
    assert synced == ["llmtailor-purge"]


def test_a_small_local_save_makes_its_staged_files_manifest_and_directories_durable_together(tmp_path, tokens, monkeypatch):
    """A small save's time is its fsyncs one after another (bench/RESULTS.md, issue 33): the
    leader's staged files (its pack, global state files, and the unit indexes), the manifest,
    the staged directories (``packs/`` and the snapshot's own) and ``latest``'s new file (written
    once the manifest is: its rename still follows the snapshot's, session 46) are fsynced at
    once, one wait on the disk (session 48; before, the staged files, then the rest). Each of
    those fsyncs waits here until all eight are in flight (a barrier): two groups one after
    the other never fill it, and the save fails. Nothing is renamed before all are durable
    (``test_a_local_save_publishes_each_file_and_directory_only_once_it_is_durable``). And no
    fsync is added: 11 in all, as before (the rule above needs each)."""
    root, tailor = _saved_once(tmp_path, tokens)
    with tailor:
        together, met = threading.Barrier(8, timeout=30), []
        real, calls = os.fsync, []

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            calls.append(path)
            if f"/{TMP_DIR}/" in path:  # staged, or latest's new file
                met.append(Path(path).name)
                together.wait()  # BrokenBarrierError (the save fails) unless all are in flight together
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        tailor.save(2)
        tailor.run.storage.commits.wait_purged()  # retention's removal, on the purger's thread
        monkeypatch.undo()
    files = [GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, Path(pack_filename(0, 0)).name, PACKS_DIR, MANIFEST_FILE]
    rest = [name for name in met if name not in files]
    assert len(met) == 8 and set(files) <= set(met)
    assert sorted(name.split(".")[0] for name in rest) == ["", snapshot_dirname(2)]  # latest's new file, the snapshot's
    assert len(calls) == 11, calls


def test_a_local_save_leaves_its_manifest_and_small_files_in_the_page_cache(tmp_path, tokens, monkeypatch):
    """What a commit fsyncs last (the manifest, the directories: ``fsync_together``) is what the
    next restore reads first, and a small file costs the page cache little: neither is dropped
    once durable, only files of ``CACHED_UNDER`` bytes or more (a save's cache footprint stays
    about one unit). Dropped, a one-process LoRA restore read them all back from the disk
    (bench/RESULTS.md, issue 33, session 45). Here the bound is set to the pack's size: the pack
    is the one large file. Every ``posix_fadvise`` of the second save is recorded."""
    from llmtailor.store.storage import local_durable

    root, tailor = _saved_once(tmp_path, tokens)
    with tailor:
        pack = root / "snapshots" / snapshot_dirname(1) / pack_filename(0, 0)
        monkeypatch.setattr(local_durable, "CACHED_UNDER", pack.stat().st_size, raising=False)
        real, dropped = os.posix_fadvise, []

        def fadvise(fd, offset, length, advice):
            if advice == os.POSIX_FADV_DONTNEED:
                dropped.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
            real(fd, offset, length, advice)

        monkeypatch.setattr(os, "posix_fadvise", fadvise)
        tailor.save(2)
        monkeypatch.undo()
    assert sorted(name for name in dropped if name != pack.name) == []
    assert dropped == [pack.name]


def test_the_old_latest_file_loses_its_last_link_on_the_purgers_thread_not_the_saves(tmp_path, tokens, monkeypatch):
    """Dropping a file's last link waited about 4 ms on this project's ext4 (a replace over the
    old ``latest`` file 2.7-4 ms, over a second link of it 0.05 ms), the longest step of a small
    save's commit after its fsyncs (bench/RESULTS.md, issue 33, session 47). So the old pointer's
    file is linked into ``.tmp/`` before the replace and unlinked there on the purger's thread;
    nothing of it is left once the purges are done. Recorded: the old file's link count as the
    replace of ``latest`` begins, and every unlink with its thread."""
    model, optimizer, scheduler = tiny(layers=2)
    train(model, optimizer, scheduler, tokens, [0])
    root = Path(os.path.realpath(tmp_path)) / "run"
    with Tailor(root, model, optimizer, scheduler, policy=Full(), keep=2, track_drift=False) as tailor:
        tailor.save(1)
        links, unlinked = [], []
        real_replace, real_unlink = os.replace, os.unlink

        def replace(src, dst, *args, **kwargs):
            if Path(dst) == root / LATEST_FILE:
                links.append(os.stat(dst).st_nlink)
            return real_replace(src, dst, *args, **kwargs)

        def unlink(path, *args, **kwargs):
            unlinked.append((Path(path).parent.name, threading.current_thread().name))
            return real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "unlink", unlink)
        tailor.save(2)
        tailor.run.storage.commits.wait_purged()
        monkeypatch.undo()
        assert links == [2]
        assert unlinked == [(TMP_DIR, "llmtailor-purge")]
        assert not list((root / TMP_DIR).iterdir())
        assert (root / LATEST_FILE).read_text().strip() == snapshot_dirname(2)
    assert Run(root).latest_step() == 2


def test_an_old_latest_link_a_crash_left_in_tmp_changes_no_answer_and_the_next_writer_clears_it(tmp_path, tokens):
    """A writer killed between linking the old ``latest`` into ``.tmp/`` and the purger's unlink
    leaves that link (and the ``latest`` of either side of the replace): ``verify``, ``inspect``
    and restore answer as without it, and the next writer removes it when it takes the lock."""
    from typer.testing import CliRunner

    from llmtailor.cli import app

    model, optimizer, scheduler = tiny(layers=2)
    root = tmp_path / "run"
    with Tailor(root, model, optimizer, scheduler, policy=Full()) as tailor:
        for step in (1, 2):
            train(model, optimizer, scheduler, tokens, [step])
            tailor.save(step)
    (root / LATEST_FILE).write_text(snapshot_dirname(1) + "\n")  # the replace lost too: the old pointer
    os.link(root / LATEST_FILE, root / TMP_DIR / f"{LATEST_FILE}.0badc0de")
    runner = CliRunner()
    verified, inspected = runner.invoke(app, ["verify", str(root)]), runner.invoke(app, ["inspect", str(root)])
    assert verified.exit_code == 0 and inspected.exit_code == 0, verified.output + inspected.output
    fresh = tiny(layers=2, seed=3)
    with Tailor(root, *fresh, policy=Full()) as tailor:
        assert not (root / TMP_DIR).exists() or not any((root / TMP_DIR).iterdir())
        assert tailor.restore().step == 2
    assert_bitwise(unit_versions(fresh[0], fresh[1]), unit_versions(model, optimizer))


def test_a_staged_file_whose_fsync_fails_commits_nothing_though_the_manifest_was_written_beside_it(tmp_path, tokens, monkeypatch):
    """The manifest is written, and fsynced, while the staged files' fsyncs are still in flight
    (session 48): when one of those fails (here the pack's), nothing is renamed, the save fails
    naming the file, what was staged is removed (``latest``'s new file too) and the previous
    composite stays the run's."""
    import errno

    from llmtailor.errors import StorageError

    root, tailor = _saved_once(tmp_path, tokens)
    with tailor:
        recorder = Recorder(monkeypatch)
        recorded = os.fsync

        def fsync(fd):
            if Path(os.readlink(f"/proc/self/fd/{fd}")).name == Path(pack_filename(0, 0)).name:
                raise OSError(errno.EIO, "injected fsync failure")
            recorded(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(StorageError, match=r"safetensors durable failed: injected fsync failure"):
            tailor.save(2)
        monkeypatch.undo()
        assert [e for e in recorder.events if e[0] == "rename"] == []
        assert any(e[1].endswith(f"/{MANIFEST_FILE}") for e in recorder.events if e[0] == "fsync")  # written beside the pack's
        assert Run(root).steps() == [1] and Run(root).latest_step() == 1
        assert os.listdir(root / TMP_DIR) == []


def test_a_pack_has_its_write_out_started_on_a_helper_thread_before_its_last_byte(tmp_path, tokens, monkeypatch):
    """A small save's pack is handed to an fsync thread once it holds ``WRITE_OUT_FROM`` bytes
    (here half the pack), while the rest is written, and again once closed: the disk works
    while the save writes its last MiBs and does the rest (bench/RESULTS.md, issue 33, session
    48). Each hand-over of the pack is recorded with the file's size then, and each fsync."""
    from llmtailor.store.storage import local_durable

    name = pack_filename(0, 0)
    root, tailor = _saved_once(tmp_path, tokens)
    with tailor:
        size = (root / "snapshots" / snapshot_dirname(1) / name).stat().st_size
        monkeypatch.setattr(local_durable, "WRITE_OUT_FROM", size // 2, raising=False)
        recorder, real_submit = Recorder(monkeypatch), local_durable.Syncer.submit

        def submit(self, path, fd, *args, **kwargs):
            recorder.add("submit", str(path), threading.current_thread().name, os.fstat(fd).st_size)
            return real_submit(self, path, fd, *args, **kwargs)

        monkeypatch.setattr(local_durable.Syncer, "submit", submit)
        tailor.save(2)
        monkeypatch.undo()
    handed = [e[3] for e in recorder.events if e[0] == "submit" and e[1].endswith(f"/{name}")]
    assert len(handed) == 2 and size // 2 <= handed[0] < size and handed[1] == size
    synced = [e for e in recorder.events if e[0] == "fsync" and e[1].endswith(f"/{name}")]
    assert [e[2] for e in synced] == ["llmtailor-fsync"] * 2 and size in [e[3] for e in synced]


@pytest.mark.parametrize("failing", ["early write-out", "manifest"])
def test_an_fsync_failing_beside_the_manifests_commits_nothing_and_is_raised(tmp_path, tokens, monkeypatch, failing):
    """The commit fsyncs the manifest beside the staged files' write-outs still in flight
    (``fsync_together(beside=drain)``; each file's write-out started early, ``WRITE_OUT_FROM``):
    a staged file's early fsync failing (EIO), or the manifest's, fails the save saying so;
    nothing is renamed into place, ``latest`` still names step 1, and the next save commits."""
    import errno

    from llmtailor.store.storage import local_durable

    root, tailor = _saved_once(tmp_path, tokens)
    try:
        monkeypatch.setattr(local_durable, "WRITE_OUT_FROM", 1, raising=False)
        real_fsync, failed = os.fsync, []

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
            staged = f"/{TMP_DIR}/" in path and snapshot_dirname(2) in path
            if not failed and staged and (path.endswith(MANIFEST_FILE) if failing == "manifest" else f"/{PACKS_DIR}/" in path):
                failed.append(path)
                raise OSError(errno.EIO, "Input/output error")
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(Exception, match="Input/output error"):
            tailor.save(2)
            tailor.wait()
        monkeypatch.undo()
        assert failed, "no fsync failed: the test did not reach the commit"
        assert Run(root).steps() == [1] and not (root / "snapshots" / snapshot_dirname(2)).exists()
        assert (root / LATEST_FILE).read_text().strip().endswith(snapshot_dirname(1))
        tailor.save(3)
        tailor.wait()
        assert Run(root).steps() == [3]
    finally:
        tailor.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["snapshots", "run"])
def test_a_failed_fsync_after_both_renames_reports_the_save_committed_and_what_may_not_be_durable(tmp_path, tokens, monkeypatch,
                                                                                                    where, blocking):
    """The one-wait commit (its parent the run's newest snapshot) renames the snapshot and
    ``latest``, then fsyncs ``snapshots/`` and the run's directory together; here one of those
    fsyncs fails (EIO). The snapshot is visible and whole (its files and manifest were durable
    before its rename), ``latest`` names it: the save is committed. It raises a TailorError that
    says so and says what may not be durable, and the Tailor agrees with the disk: its lineage
    extends step 2 (a retry of save(2) is refused as not after step 2, step 3's parent is 2),
    a restore right after takes step 2 bitwise, and retention waits for the next save (``keep=1``:
    step 1 stays until step 3 commits). Before: "... the partial snapshot was removed and earlier
    snapshots are intact" (a StorageError, the Tailor back at step 1: its retry of save(2) refused
    as "already exists", step 3's parent 1) for ``snapshots/``; for the run's directory, "its
    latest pointer could not be updated" while ``latest`` named step 2."""
    from llmtailor.errors import ConfigError, TailorError

    model, optimizer, scheduler = tiny(layers=2)
    train(model, optimizer, scheduler, tokens, [0])
    root = Path(os.path.realpath(tmp_path)) / "run"
    tailor = Tailor(root, model, optimizer, scheduler, policy=Full(), keep=1, track_drift=False, async_save=not blocking)
    try:
        tailor.save(1)
        tailor.wait()
        saved = unit_versions(model, optimizer)
        directory = root / "snapshots" if where == "snapshots" else root
        failed = failing_fsync_of(monkeypatch, directory, root / "snapshots" / snapshot_dirname(2))
        said = (r"its name in snapshots/ could not be made durable \(.*Input/output error\): a crash of the machine"
                if where == "snapshots" else
                r"latest names it, but that could not be made durable \(.*Input/output error\): a crash of the machine "
                r"may bring back the latest before it")
        with pytest.raises(TailorError, match=rf"^step 2 was saved and committed in {root}, but {said}.*a restore "
                                              r"finds step 2 now$") as raised:
            tailor.save(2, blocking=blocking)
            tailor.wait()
        monkeypatch.undo()
        assert failed == [str(directory)] and raised.type is TailorError
        assert (root / LATEST_FILE).read_text().strip() == snapshot_dirname(2)
        assert Run(root).steps() == [1, 2] and Run(root).latest_step() == 2 and Run(root).verify() == []
        assert tailor.lineage.parent == 2
        with pytest.raises(ConfigError, match="step 2 is not after the previous snapshot's step 2"):
            tailor.save(2)
        fresh = tiny(layers=2, seed=3)
        with Tailor(root, *fresh, read_only=True) as reader:
            assert reader.restore().step == 2
        assert_bitwise(unit_versions(fresh[0], fresh[1]), saved)
        train(model, optimizer, scheduler, tokens, [3])
        tailor.save(3)
        tailor.wait()
        tailor.run.storage.commits.wait_purged()
        assert Run(root).steps() == [3] and Run(root).manifest(3).parent == 2
    finally:
        tailor.close()


@pytest.mark.parametrize("then", ["writable", "read-only"])
def test_a_failed_fsync_after_a_branching_saves_rename_leaves_latest_and_says_what_restore_finds(tmp_path, tokens, monkeypatch,
                                                                                                  then):
    """A save branching off an older composite (step 3 from step 1, step 2 the run's newest)
    renames its snapshot, then fsyncs ``snapshots/`` before ``latest`` may name it; that fsync
    fails (EIO). The snapshot is committed (the Tailor's lineage extends it, restore(3) loads it)
    and ``latest`` is left naming step 2, the newest composite a restore takes meanwhile, as the
    TailorError says. Before: "the partial snapshot was removed" (a StorageError), the Tailor
    back at step 1. ``read-only``: the filesystem then refuses every change (EROFS: ext4
    remounts read-only once its journal fails), so the new ``latest`` file left unused in
    ``.tmp/`` cannot be removed: the same (it is a leftover the next writer clears). Before:
    "StorageError: ... .tmp/.latest.N.tmp: read-only file system while saving step 3 ...; the
    partial snapshot was removed and earlier snapshots are intact", step 3 in ``snapshots/``."""
    import errno
    import pathlib

    from llmtailor.errors import StorageError, TailorError

    model, optimizer, scheduler = tiny(layers=2)
    root = Path(os.path.realpath(tmp_path)) / "run"
    with Tailor(root, model, optimizer, scheduler, policy=Full(), track_drift=False) as tailor:
        tailor.save(1)
        tailor.save(2)
        assert tailor.restore(1).step == 1
        saved = unit_versions(model, optimizer)
        failed = failing_fsync_of(monkeypatch, root / "snapshots", root / "snapshots" / snapshot_dirname(3))
        real_unlink = pathlib.Path.unlink

        def unlink(path, *args, **kwargs):
            if failed and then == "read-only" and path.parent == root / TMP_DIR:
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "unlink", unlink)
        with pytest.raises(TailorError, match=r"^step 3 was saved and committed in .*, but its name in snapshots/ could not "
                                              r"be made durable \(Input/output error\).*; its latest pointer was left as it "
                                              r"was .*restore\(3\) loads it\), and a restore of the newest composite finds "
                                              r"step 2 now$") as raised:
            tailor.save(3)
        monkeypatch.undo()
        assert failed and not isinstance(raised.value, StorageError) and tailor.lineage.parent == 3
        assert (root / LATEST_FILE).read_text().strip() == snapshot_dirname(2)
        assert Run(root).latest_step() == 2 and Run(root).manifest(3).parent == 1 and Run(root).verify() == []
        fresh = tiny(layers=2, seed=3)
        with Tailor(root, *fresh, read_only=True) as reader:
            assert reader.restore(3).step == 3
        assert_bitwise(unit_versions(fresh[0], fresh[1]), saved)
        tailor.save(4)
    assert Run(root).latest_step() == 4 and Run(root).manifest(4).parent == 3


def test_a_restore_after_an_async_save_whose_commit_was_unconfirmed_restores_and_the_next_call_says_it(tmp_path, tokens,
                                                                                                       monkeypatch):
    """An async save of step 2 is committed but its rename's fsync fails (EIO), and the next call
    is a restore, which settles the saves in flight without raising their outcome ("a failure in
    flight stays for the next save / wait / close"): the restore loads what it was asked for, and
    what the save could not confirm is raised by the next call that reports (here ``wait``), once.
    Before: ``restore(1)`` raised the save's "step 2 was saved and committed ..." and loaded nothing,
    an error of a save where a restore was asked for, not saying the restore was not made."""
    from llmtailor.errors import TailorError

    model, optimizer, scheduler = tiny(layers=2)
    train(model, optimizer, scheduler, tokens, [0])
    root = Path(os.path.realpath(tmp_path)) / "run"
    with Tailor(root, model, optimizer, scheduler, policy=Full(), track_drift=False, async_save=True) as tailor:
        tailor.save(1)
        tailor.wait()
        saved = unit_versions(model, optimizer)
        train(model, optimizer, scheduler, tokens, [1])
        failed = failing_fsync_of(monkeypatch, root / "snapshots", root / "snapshots" / snapshot_dirname(2))
        tailor.save(2)
        assert tailor.restore(1).step == 1
        monkeypatch.undo()
        assert failed and Run(root).latest_step() == 2
        assert_bitwise(unit_versions(model, optimizer), saved)
        with pytest.raises(TailorError, match=r"^step 2 was saved and committed in .*, but its name in snapshots/ could not "
                                              r"be made durable"):
            tailor.wait()
        tailor.wait()  # said once


def _promoting(tmp_path, policy, promote_every: int, keep: int | None = None) -> tuple[Tailor, tuple, Path, Path]:
    """A Tailor of a tiny model saving to a memory tier promoted to the run directory every
    ``promote_every`` steps (``keep``: the run directory's); it, the model, optimizer and
    scheduler, the run directory, the tier."""
    from llmtailor import Tier

    root = Path(os.path.realpath(tmp_path))
    home, memory, trained = root / "home", root / "memory", tiny(layers=2)
    return (Tailor(home, *trained, policy=policy, keep=keep, track_drift=False,
                   tiers=[Tier(memory, promote_every=promote_every)]), trained, home, memory)


def _promotion_whose_fsync_fails(monkeypatch, tailor: Tailor, trained: tuple, tokens, home: Path, step: int,
                                 said: str) -> None:
    """Step ``step`` trained (``trained``: the model, optimizer and scheduler) and saved while the
    fsync of ``home``'s ``snapshots/`` fails once step 2 is renamed in there (its promotion's
    commit): ``wait(promoted=True)`` raises one PromotionError matching ``said``, and the fsync
    that failed was that one."""
    from llmtailor import PromotionError

    failed = failing_fsync_of(monkeypatch, home / "snapshots", home / "snapshots" / snapshot_dirname(2))
    train(*trained, tokens, [step])
    tailor.save(step)
    with pytest.raises(PromotionError, match=said):
        tailor.wait(promoted=True)
    monkeypatch.undo()
    assert failed == [str(home / "snapshots")]


def test_a_promotion_whose_fsync_fails_after_its_rename_counts_as_promoted_and_says_what_may_not_be_durable(
        tmp_path, tokens, monkeypatch):
    """A promotion (memory tier -> run directory) commits its snapshot there by the save's own
    recipe, without ``latest``; here the fsync of the run directory's ``snapshots/`` after that
    rename fails (EIO) on the promoter's thread. The snapshot is visible and whole: the promotion
    counts as done (``Promotion.copied``, no lag, what ``inspect`` shows), the run directory's
    ``latest`` is left naming step 1 (it names a composite only once that is durable; a restore
    finds step 2 through its parent link), its retention waits (``keep=1``: step 1 stays until
    the next promotion), and the next ``wait``/``save`` raises one PromotionError that says it was
    promoted and committed and what may not be durable; never retried. Before: the failure was
    taken for a failed promotion, whose retry found step 2 there and skipped it (copied nothing)
    and pointed ``latest`` at it, the fsync's failure said nowhere: 'DID NOT RAISE'."""
    from llmtailor.store.tiers import tier_states

    tailor, (model, optimizer, scheduler), home, memory = _promoting(tmp_path, Full(), promote_every=1, keep=1)
    try:
        tailor.save(1)
        tailor.wait(promoted=True)
        _promotion_whose_fsync_fails(monkeypatch, tailor, (model, optimizer, scheduler), tokens, home, 2,
                                     rf"^promoting step 2 to {home}: step 2 was promoted and committed in "
                                     rf"{home}, but its name in snapshots/ could not be made durable "
                                     r"\(Input/output error\): a crash of the machine .*a restore finds step 2 "
                                     rf"now\. {home}'s latest was left as it was")
        assert [(p.step, p.copied) for p in tailor.tiers.promotions] == [(1, [1]), (2, [2])]
        assert (home / LATEST_FILE).read_text().strip() == snapshot_dirname(1)
        assert Run(home).steps() == [1, 2] and Run(home).latest_step() == 2 and Run(home).verify() == []
        assert tailor.tiers.promoter.lag(1) == 0
        assert [(s.newest, s.lag) for s in tier_states(Run(memory))] == [(2, None), (2, 0)]
        tailor.wait(promoted=True)  # said once
        train(model, optimizer, scheduler, tokens, [3])
        tailor.save(3)
        tailor.wait(promoted=True)
        tailor.tiers.levels[-1].run.storage.commits.wait_purged()
        assert (home / LATEST_FILE).read_text().strip() == snapshot_dirname(3) and Run(home).steps() == [3]
    finally:
        tailor.close()


def test_a_promotion_whose_carriers_fsync_fails_stops_there_and_the_next_one_goes_on_from_it(tmp_path, tokens, monkeypatch):
    """Parity's composite of step 3 needs step 2, which the run directory lacks (``promote_every=2``:
    steps 1 and 3 are promoted), so its promotion commits step 2 there first, as a carrier; the
    fsync after that rename fails. The carrier is committed (visible, whole); the promotion stops
    there, nothing more committed, no composite counted as promoted there (the lag stays), and
    the failure says so; the promotion at close finds the carrier there and goes on from it.
    Before: the failure was a failed try, whose retry passed over the carrier and promoted the
    composite, the carrier's failure said nowhere: 'DID NOT RAISE'."""
    from llmtailor import Parity

    tailor, (model, optimizer, scheduler), home, memory = _promoting(tmp_path, Parity(), promote_every=2)
    try:
        for step in (1, 2):
            train(model, optimizer, scheduler, tokens, [step])
            tailor.save(step)
            tailor.wait(promoted=True)
        assert Run(home).steps() == [1]
        _promotion_whose_fsync_fails(monkeypatch, tailor, (model, optimizer, scheduler), tokens, home, 3,
                                     rf"^promoting step 3 to {home}: step 2 was promoted and committed in "
                                     r".*could not be made durable \(Input/output error\).*\. The composite of "
                                     r"step 3 it was copied for was not promoted \(nothing more was committed "
                                     rf"in {home}\); the next promotion there goes on from it$")
        assert Run(home).steps() == [1, 2] and Run(home).latest_step() == 1
        assert [p.step for p in tailor.tiers.promotions] == [1] and tailor.tiers.promoter.lag(1) == 2
    finally:
        tailor.close()
    assert [(p.step, p.copied) for p in tailor.tiers.promotions] == [(1, [1]), (3, [3])]
    assert Run(home).steps() == [1, 2, 3] and Run(home).latest_step() == 3 and Run(home).verify() == []


def test_a_healed_snapshot_whose_fsync_fails_after_its_rename_is_in_the_copy_and_logged_not_a_failed_healing(
        tmp_path, monkeypatch, caplog):
    """A node's copy healed from its partner commits the snapshot it received by the save's own
    recipe, without ``latest``; the fsync of the copy's ``snapshots/`` after that rename fails.
    The snapshot is in the copy, whole: the healing succeeded, and the log says what may not be
    durable. Before: the healing failed ('its healed copy could not be written: ... Input/output
    error', raised by every save of the node until a restore) while the copy held the snapshot."""
    import logging

    from store.test_node_recovery import move_in_process, node_one_wiped

    from llmtailor.distributed.nodes import Nodes
    from llmtailor.store.tiers.recovery import healing

    copies, runs, held = node_one_wiped(Path(os.path.realpath(tmp_path)))
    failed = failing_fsync_of(monkeypatch, copies[1] / "snapshots", copies[1] / "snapshots" / snapshot_dirname(2))
    with caplog.at_level(logging.WARNING):
        move_in_process(runs, healing(held, 2), Nodes((0, 1)))
    monkeypatch.undo()
    assert failed == [str(copies[1] / "snapshots")]
    assert Run(copies[1]).steps() == [2] and Run(copies[1]).resolve().step == 2 and runs[1].steps() == [2]
    assert re.search(rf"node 1: step 2 was healed and committed in {copies[1]}, but its name in snapshots/ could not be "
                     r"made durable \(Input/output error\)", caplog.text), caplog.text


def _save_2_unconfirmed(monkeypatch, tailor, trained, root: Path, tokens) -> None:
    """Step 2 trained (``trained``: the model, optimizer and scheduler) and saved by ``tailor`` into ``root``, the fsync after its rename into
    ``snapshots/`` failing: committed, its name not confirmed durable."""
    from llmtailor.errors import TailorError

    train(*trained, tokens, [2])
    failed = failing_fsync_of(monkeypatch, root / "snapshots", root / "snapshots" / snapshot_dirname(2))
    with pytest.raises(TailorError, match="its name in snapshots/ could not be made durable"):
        tailor.save(2)
    monkeypatch.undo()
    assert failed


def test_retention_after_a_save_whose_name_was_not_confirmed_durable_keeps_a_composite_that_does_not_need_it(
        tmp_path, tokens, monkeypatch):
    """Step 2's rename into ``snapshots/`` is not confirmed durable (the fsync after it fails); step
    3 (``Parity``: it rewrites the units step 2 did not) commits durably and needs step 2. With
    ``keep=1`` its retention keeps step 3's composite, steps 3 and 2; it must also keep step 1,
    the newest composite that needs no doubtful name: a power loss that loses step 2's name
    leaves step 3 unrestorable, and step 1 is then what ``restore(fallback=True)`` loads, bitwise
    (the loss is played here by moving step 2's directory away). Step 4 needs steps 4 and 3 only:
    its retention then lets steps 1 and 2 go."""
    from llmtailor import Parity

    model, optimizer, scheduler = tiny(layers=2)
    root = Path(os.path.realpath(tmp_path)) / "run"
    with Tailor(root, model, optimizer, scheduler, policy=Parity(), keep=1, track_drift=False) as tailor:
        train(model, optimizer, scheduler, tokens, [1])
        tailor.save(1)
        first = unit_versions(model, optimizer)
        _save_2_unconfirmed(monkeypatch, tailor, (model, optimizer, scheduler), root, tokens)
        train(model, optimizer, scheduler, tokens, [3])
        tailor.save(3)
        tailor.run.storage.commits.wait_purged()
        assert sorted(Run(root).needs(Run(root).resolve(3))) == [2, 3]
        assert Run(root).steps() == [1, 2, 3]
        lost = root / f"{snapshot_dirname(2)}.lost"
        os.rename(root / "snapshots" / snapshot_dirname(2), lost)
        fresh = tiny(layers=2, seed=3)
        with Tailor(root, *fresh, read_only=True) as reader:
            assert reader.restore(fallback=True).step == 1
        assert_bitwise(unit_versions(fresh[0], fresh[1]), first)
        os.rename(lost, root / "snapshots" / snapshot_dirname(2))
        train(model, optimizer, scheduler, tokens, [4])
        tailor.save(4)
        tailor.run.storage.commits.wait_purged()
        assert sorted(Run(root).needs(Run(root).resolve(4))) == [3, 4] and Run(root).steps() == [3, 4]


def test_a_slower_tiers_retention_after_a_promotion_whose_name_was_not_confirmed_durable_keeps_a_composite_without_it(
        tmp_path, tokens, monkeypatch):
    """The promotion of step 2 to the run directory (``keep=1``) commits it there, but the fsync
    after its rename fails; step 3's promotion (``Parity``: it needs step 2, which the run
    directory holds) copies step 3 only and commits durably. The run directory's retention then
    keeps step 1 too, the newest composite there that needs no doubtful name, at the promotion
    and at close; a power loss losing step 2's name leaves step 1 for ``restore(fallback=True)``."""
    from llmtailor import Parity

    tailor, (model, optimizer, scheduler), home, memory = _promoting(tmp_path, Parity(), promote_every=1, keep=1)
    try:
        train(model, optimizer, scheduler, tokens, [1])
        tailor.save(1)
        tailor.wait(promoted=True)
        _promotion_whose_fsync_fails(monkeypatch, tailor, (model, optimizer, scheduler), tokens, home, 2,
                                     r"^promoting step 2 to .*could not be made durable")
        train(model, optimizer, scheduler, tokens, [3])
        tailor.save(3)
        tailor.wait(promoted=True)
        assert [(p.step, p.copied) for p in tailor.tiers.promotions] == [(1, [1]), (2, [2]), (3, [3])]
        tailor.tiers.levels[-1].run.storage.commits.wait_purged()
        assert Run(home).steps() == [1, 2, 3] and sorted(Run(home).needs(Run(home).resolve(3))) == [2, 3]
    finally:
        tailor.close()
    assert Run(home).steps() == [1, 2, 3]
    os.rename(home / "snapshots" / snapshot_dirname(2), home / "lost")
    with Tailor(home, *tiny(layers=2, seed=3), read_only=True) as reader:
        assert reader.restore(fallback=True).step == 1



def test_a_name_not_confirmed_durable_stays_doubtful_for_the_next_writer_on_the_same_boot(tmp_path, tokens, monkeypatch):
    """As above, but the writer closes after step 2's save (its name not confirmed durable) and a
    new one (a restart of the job, the machine not restarted: the dirty name may still be lost
    by a crash) saves step 3 with ``keep=1``: its retention must keep step 1 too, as the writer
    that met the failed fsync would. Before: the doubt was that process's memory only, and the
    restarted writer's retention removed step 1 (steps [2, 3]), so a crash losing step 2's name
    left nothing restorable. The doubt is kept beside the run (``.doubtful``, with the boot's id:
    after the machine restarted, a name found there is durable)."""
    from llmtailor import Parity

    root = Path(os.path.realpath(tmp_path)) / "run"
    model, optimizer, scheduler = tiny(layers=2)
    with Tailor(root, model, optimizer, scheduler, policy=Parity(), keep=1, track_drift=False) as tailor:
        train(model, optimizer, scheduler, tokens, [1])
        tailor.save(1)
        _save_2_unconfirmed(monkeypatch, tailor, (model, optimizer, scheduler), root, tokens)
    assert Run(root).steps() == [1, 2]
    with Tailor(root, model, optimizer, scheduler, policy=Parity(), keep=1, track_drift=False) as tailor:
        assert tailor.restore().step == 2
        train(model, optimizer, scheduler, tokens, [3])
        tailor.save(3)
        tailor.run.storage.commits.wait_purged()
        assert sorted(Run(root).needs(Run(root).resolve(3))) == [2, 3]
        assert Run(root).steps() == [1, 2, 3]
        train(model, optimizer, scheduler, tokens, [4])
        tailor.save(4)
        tailor.run.storage.commits.wait_purged()
        assert Run(root).steps() == [3, 4]
    assert not (root / ".doubtful").exists()
