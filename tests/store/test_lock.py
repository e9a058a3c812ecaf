"""One writer per run: a second process gets a clear error; a killed writer leaves no stale lock."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import tiny

from llmtailor import Tailor
from llmtailor.errors import TailorError

SECOND_WRITER = textwrap.dedent(
    """
    import sys, torch
    from llmtailor import Tailor
    from llmtailor.errors import TailorError
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    try:
        # The lock lives as long as the Tailor (refused here, or at save); each writer after the first
        # saves a lineage of its own (fresh_start: it restores nothing).
        tailor = Tailor(sys.argv[1], model, fresh_start=True)
        tailor.save(int(sys.argv[2]))
    except TailorError as err:
        print(err)
        sys.exit(3)
    if len(sys.argv) > 3:  # hold the lock until killed, beside a child forked (a DataLoader worker's)
        import os
        child = os.fork()
        if child == 0:  # lives on after its parent died, until the test closes the pipe
            sys.stdin.read()
            os._exit(0)
        print("saved", child, flush=True)
        sys.stdin.read()
    """
)


def writer(run, step, *extra, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-c", SECOND_WRITER, str(run), str(step), *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


@pytest.mark.slow
def test_a_second_writer_process_is_refused_and_a_killed_one_leaves_no_lock(tmp_path):
    """Also while a child the killed writer had forked (a DataLoader worker that outlives it for
    a while) still lives: the copy of the lock's descriptor the fork gave it is closed in the
    child, so the kernel's lock went with the writer (before: the third writer was refused, "being
    written by another writer (pid <the killed writer>"))."""
    holder = writer(tmp_path, 1, "hold")
    said, child = holder.stdout.readline().split()
    assert said == "saved"
    try:
        second = writer(tmp_path, 2)
        out, err = second.communicate(timeout=300)
        assert second.returncode == 3, err
        assert f"{tmp_path} is being written by another writer (pid {holder.pid} on" in out

        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        os.kill(int(child), 0)  # the child lives on
        third = writer(tmp_path, 2)
        out, err = third.communicate(timeout=300)
        assert third.returncode == 0, out + err
    finally:
        holder.kill()
        holder.stdin.close()  # the child's end
        os.kill(int(child), signal.SIGKILL)


@pytest.mark.slow
def test_a_writer_paused_for_long_keeps_a_local_run_no_other_writer_takes_it_over(tmp_path):
    """A local run's lock is the kernel's ``flock``, held by its holder as long as it lives,
    paused (SIGSTOP) however long: no other writer takes it over, so a paused writer that goes on
    never meets a successor's snapshots (on an object store the lease is taken over once
    unrenewed for its ttl: tests/store/test_object_store.py, ``paused_past_its_lease``)."""
    holder = writer(tmp_path, 1, "hold")
    said, child = holder.stdout.readline().split()
    assert said == "saved"
    try:
        holder.send_signal(signal.SIGSTOP)
        with pytest.raises(TailorError, match=rf"being written by another writer \(pid {holder.pid} on "):
            Tailor(tmp_path, *tiny()).save(2)
        holder.send_signal(signal.SIGCONT)
    finally:
        holder.kill()
        holder.stdin.close()
        os.kill(int(child), signal.SIGKILL)


def test_a_second_writer_in_the_same_process_is_refused(tmp_path):
    first = Tailor(tmp_path, *tiny())
    first.save(1)
    with pytest.raises(TailorError, match="one writer at a time"):
        Tailor(tmp_path, *tiny()).save(2)
    first.close()
    second = Tailor(tmp_path, *tiny())
    second.restore()
    second.save(2)


def test_a_writer_refuses_a_directory_that_is_not_a_run_before_touching_it(tmp_path):
    """WriterLock (every writer's, and gc's) creates or deletes nothing in a non-run: a
    directory that is something else keeps its own .tmp/ and gets no .lock."""
    from llmtailor.store.lock import WriterLock

    checkpoint = tmp_path / "checkpoint-5"
    (checkpoint / ".tmp").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    before = sorted(p.name for p in checkpoint.rglob("*"))
    with pytest.raises(TailorError, match=r"checkpoint-5: is a Hugging Face Trainer checkpoint .* refusing to write into it"):
        Tailor(checkpoint, *tiny()).save(1)
    with pytest.raises(TailorError, match="refusing to clean it"):
        WriterLock(checkpoint, new_run=False).acquire()
    assert sorted(p.name for p in checkpoint.rglob("*")) == before
    # A missing or empty directory becomes a run; gc's lock wants a run already.
    with pytest.raises(TailorError, match="no such run directory"):
        WriterLock(tmp_path / "new", new_run=False).acquire()
    assert not (tmp_path / "new").exists()
    Tailor(tmp_path / "new", *tiny()).save(1)


BUILT_ONLY = textwrap.dedent(
    """
    import sys, torch
    from llmtailor import Tailor
    tailor = Tailor(sys.argv[1], torch.nn.Sequential(torch.nn.Linear(2, 2)))  # built, not saved yet
    print("built", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.slow
def test_a_second_trainer_is_refused_when_its_tailor_is_built_not_at_its_first_save(tmp_path):
    """The first trainer has built its Tailor and is training toward its first save: a second
    one on the run fails before it spends any compute. A read-only Tailor (an evaluation job)
    may still restore beside the writer, and refuses to save."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    Tailor(tmp_path, model).save(1)
    holder = subprocess.Popen([sys.executable, "-c", BUILT_ONLY, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "built"
        with pytest.raises(TailorError, match=rf"being written by another writer \(pid {holder.pid} on"):
            Tailor(tmp_path, torch.nn.Sequential(torch.nn.Linear(2, 2)))
        reader = Tailor(tmp_path, torch.nn.Sequential(torch.nn.Linear(2, 2)), read_only=True)
        assert reader.restore().step == 1
        with pytest.raises(TailorError, match="read_only=True"):
            reader.save(2)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_lock_not_held_confirms_no_commit(tmp_path):
    """A commit's ``confirm`` (``WriterLock.check_held``) refuses a lock never taken or released
    (a promotion still running once its writer let the lock go); before, only a lock held and
    then lost was refused."""
    from llmtailor.store.lock import WriterLock

    lock = WriterLock(tmp_path / "run")
    with pytest.raises(TailorError, match="does not hold the run's lock"):
        lock.check_held()
    lock.acquire()
    lock.check_held()
    lock.release()
    with pytest.raises(TailorError, match="does not hold the run's lock"):
        lock.check_held()


FORKED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[2])
    from helpers import tiny
    from llmtailor import Tailor
    with Tailor(f"{sys.argv[1]}/parent", *tiny()) as tailor:
        tailor.save(1)
        tailor.save(2)  # replaces latest: the old one's file removed on the purger's thread
    child = os.fork()  # a multiprocessing worker of a sweep (the fork start method), a writer of its own run
    if child == 0:
        with Tailor(f"{sys.argv[1]}/child", *tiny(), keep=1) as tailor:
            tailor.save(1)
            tailor.save(2)
        os._exit(0)
    """
)
CHILD_OUTCOME = textwrap.dedent(
    """
    for _ in range(1200):  # a guard against a hang, not a timing: the child's work takes a second
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            print(f"child exit {os.waitstatus_to_exitcode(status)}")
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        print("child hung")
    """
)


@pytest.mark.slow
def test_a_forked_child_writes_and_closes_a_run_of_its_own(tmp_path):
    """A process forked after its parent saved (its purger thread running) saves a run of its own,
    with retention, and closes. Before, the child inherited the parent's purger as it was: no
    thread of its own to remove what its saves handed over (the old ``latest``, the snapshots its
    retention discarded), so its ``close`` waited for them for ever."""
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", FORKED_WRITER + CHILD_OUTCOME, str(tmp_path), str(Path(__file__).parents[1])],
                          capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "child exit 0", done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / "child/snapshots").iterdir()) == ["step-00000002"]
    assert not any((tmp_path / "child/.tmp").iterdir()) and not any((tmp_path / "child/.trash").iterdir())


def test_a_forked_child_drops_its_copy_of_a_lock_whatever_a_parent_thread_held(tmp_path):
    """A fork lands while a parent thread takes or lets go of a writer lock (a promoter's claim,
    ``close``'s release): the child's copy of that lock, dropped or taken, uses a mutex of its own,
    never the copy the fork made held (with no thread to let it go)."""
    script = textwrap.dedent(f"""
        import os, time
        from llmtailor.store.lock import WriterLock
        from llmtailor.errors import TailorError

        lock = WriterLock({str(tmp_path / "run")!r})
        lock.acquire()
        lock._mutex.acquire()  # held as the fork lands, as a parent thread's claim or release holds it
        child = os.fork()
        if child == 0:
            assert not lock.held
            try:
                lock.acquire()  # the parent holds the run: refused, not hung
            except TailorError:
                pass
            lock.release()
            os._exit(0)
        lock._mutex.release()
    """) + CHILD_OUTCOME
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "child exit 0", done.stdout + done.stderr


def test_a_holder_whose_lock_file_names_this_process_is_refused_all_the_same(tmp_path):
    """Whether this process holds a run's lock is told by its own registry, not by the name the
    lock file records: another process holds the ``flock`` here while the file names this one
    ("pid P on HOST": a trainer in another pid namespace under the same hostname, such as a
    container on the host's network; or a new holder not yet past writing its own name over its
    predecessor's, a dead process whose pid this one now has). A Tailor that may only look (a
    read-only copy: ``WriterLock.refuse_if_held``) is refused. Before: not refused, taken for
    another Tailor of this process (``DID NOT RAISE``)."""
    from llmtailor.store.lock import WriterLock
    from llmtailor.store.storage.strategies import this_process

    import torch

    Tailor(tmp_path, torch.nn.Sequential(torch.nn.Linear(2, 2))).close()
    (tmp_path / ".lock").write_text(this_process() + "\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
                               "print('held', flush=True); sys.stdin.read()", str(tmp_path / ".lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TailorError, match=rf"being written by another writer \({this_process()}\)"):
            WriterLock(tmp_path).refuse_if_held()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    WriterLock(tmp_path).refuse_if_held()  # released: nothing to refuse


def test_a_writer_whose_start_fails_clearing_leftovers_leaves_a_new_location_as_it_found_it(tmp_path, monkeypatch):
    """A Tailor built on a missing directory takes the run's lock (creating the directory and its
    .lock), then clearing crashed writers' leftovers fails: the Tailor raises, and the location
    is as it was, no directory made (as before session 59's doubt59, whose fix lets the lock go
    inside ``acquire`` when clearing fails: the Tailor's own ``abandon`` then found nothing held
    to remove). The next writer, clearing well, makes the run. BEFORE (15e7ecd): the directory
    made, holding a ``.lock``, after the Tailor raised."""
    import torch

    from llmtailor.store.storage.local_commit import LocalCommits

    def failing(self):
        raise OSError(5, "Input/output error")

    root = tmp_path / "new" / "run"
    with monkeypatch.context() as patch:
        patch.setattr(LocalCommits, "clear_leftovers", failing)
        with pytest.raises(OSError, match="Input/output error"):
            Tailor(root, torch.nn.Linear(2, 2))
    assert not (tmp_path / "new").exists(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with Tailor(root, torch.nn.Linear(2, 2)) as tailor:
        tailor.save(1)
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == ["step-00000001"]
