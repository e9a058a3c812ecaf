"""Every interpreter started (``start``) or forked (``fork``) while ``$LLMT_PROC_LOG`` is set,
one tab-separated line each (kind, pid, the test, argv), for counting the processes of a test
run (``run.sh``)."""

import os
import sys

_LOG = os.environ.get("LLMT_PROC_LOG")


def _write(kind: str) -> None:
    try:
        with open(_LOG, "a") as f:
            f.write(f"{kind}\t{os.getpid()}\t{os.environ.get('PYTEST_CURRENT_TEST', '-')}\t{' '.join(sys.argv)[:160]}\n")
    except OSError:
        pass


if _LOG:
    _write("start")
    os.register_at_fork(after_in_child=lambda: _write("fork"))
