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
