"""The tests' own waiting for launches of real processes (``helpers.wait_launches``): every
launch's output read while any runs, and a launch that does not end failing the test within the
bound, every launch ended."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import wait_launches


def _launch(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_launch_waiting_for_another_that_writes_more_than_a_pipe_holds_ends(tmp_path):
    """Two nodes of one job: the first waits for the second, which writes 200 kB (its ranks'
    tracebacks, say) before it does its part. Read one launch to its end before the next, the
    second stays held on its full pipe and neither ends (the bound here: 30 s)."""
    flag = tmp_path / "second-done"
    first = _launch(f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.05)\nprint('first done')")
    second = _launch(f"import sys\nsys.stdout.write('x' * 200000)\nsys.stdout.flush()\nopen({str(flag)!r}, 'w').close()")
    (out_first, _), (out_second, _) = wait_launches([first, second], timeout=30)
    assert (out_first, len(out_second)) == ("first done\n", 200000)
    assert (first.returncode, second.returncode) == (0, 0)


def test_a_launch_that_does_not_end_fails_the_test_with_every_launch_ended():
    ended = _launch("print('ended')")
    stuck = _launch("import time\nprint('stuck', flush=True)\ntime.sleep(3600)")
    with pytest.raises(AssertionError, match=r"(?s)launch 1 did not end within 5 s.*launch 0: ended.*launch 1: stuck"):
        wait_launches([ended, stuck], timeout=5)
    assert stuck.poll() is not None


def test_a_failed_rank_launch_never_signals_a_rank_it_already_reaped(tmp_path):
    """``forked_jobs.rank_launch``: rank 0 fails once every rank runs; the launch sends the others
    SIGTERM (rank 1 dies of it and is reaped; rank 2 ignores it) and SIGKILLs what is left once the
    grace is over (shortened here). Only rank 2 is left then: a SIGKILL to rank 1's pid, reaped
    and free for any process of the machine to take, may kill a stranger. Before: 'SIGKILL sent
    to rank 1's pid after it was reaped'. Every kill and reap of the launch is logged."""
    from pathlib import Path

    script = tmp_path / "job.py"
    script.write_text(f"""import os, signal, time
def main():
    rank, here = int(os.environ["RANK"]), {str(tmp_path)!r}
    if rank == 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(here, f"pid-{{rank}}"), "w").write(str(os.getpid()))
    if rank == 0:
        while not all(os.path.exists(os.path.join(here, f"pid-{{r}}")) for r in (1, 2)):
            time.sleep(0.01)
        raise SystemExit(3)
    while True:
        time.sleep(1)
""")
    tests = Path(__file__).resolve().parent
    launch = _launch(f"""import os, sys
sys.path.insert(0, {str(tests)!r})
import forked_jobs
forked_jobs._TERM_GRACE = 2.0
real_kill, real_wait = os.kill, os.wait
def kill(pid, signum):
    print("kill", pid, int(signum), flush=True)
    real_kill(pid, signum)
def wait():
    pid, status = real_wait()
    print("reaped", pid, flush=True)
    return pid, status
os.kill, os.wait = kill, wait
forked_jobs.launch_ranks(3, 0, None, {str(script)!r}, [])
""")
    [(out, err)] = wait_launches([launch], timeout=120)
    assert launch.returncode == 1, err[-3000:]
    pids = {rank: int((tmp_path / f"pid-{rank}").read_text()) for rank in range(3)}
    events = [line.split() for line in out.splitlines() if line.startswith(("kill ", "reaped "))]
    assert ["kill", str(pids[2]), "9"] in events, events
    reaped: set[str] = set()
    for event in events:
        if event[0] == "reaped":
            reaped.add(event[1])
        else:
            assert event[1] not in reaped, f"SIGKILL sent to rank 1's pid after it was reaped: {events} {pids}"
