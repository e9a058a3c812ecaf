"""Fixtures of every test, and where the tests' temporary directories live.

``tmp_path`` and ``tmp_path_factory`` directories are made in host memory (``/dev/shm``, a tmpfs)
where it has room (``MEMORY_TEMP_FREE``), else where pytest puts them (``TMPDIR``): the suite's
saves make each file durable with fsync and its snapshot directory too, as users' saves do (the
same calls, in the same order: tests/store/test_durable_order.py records them), but on a tmpfs an
fsync returns at once, where on the disk it waits for the journal (5-15 ms each on the project's
VM, a few thousand a test file). ``pytest --basetemp DIR`` or ``PYTEST_DEBUG_TEMPROOT=DIR`` (e.g.
a disk's directory) choose another place. A test whose check needs the disk's time (the SIGKILL
loop, whose kills should land inside saves) asks for ``disk_path``. Passed tests' directories are
removed as they pass (``tmp_path_retention_policy = "failed"``, pyproject.toml): memory holds the
failed ones' and the module-scoped fixtures' only."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from llmtailor.training_example import corpus_tokens

MEMORY_TEMP = Path("/dev/shm")
MEMORY_TEMP_FREE = 8 << 30
"""Bytes ``MEMORY_TEMP`` must have free to take the tests' directories: the suite holds the
module-scoped fixtures' runs there (0.25 GiB for tests/cli, distributed and e2e, session 49) and
one test's at a time (the crash test's reference run, 1 GiB, the largest)."""

if os.environ.get("PYTEST_XDIST_WORKER"):
    # A pytest-xdist worker starts with COLUMNS=80 and LINES=24 in its environment (not the
    # controller's): the CLI's console (rich) fixes its width from COLUMNS when it is built, at
    # import, so the tests that give each command its width (CliRunner's env, tests/cli) would
    # all get 80 columns. A process started from a terminal or a pipe has neither set.
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)

DISK_TEMP = Path(tempfile.gettempdir())
"""The temporary directory of this process (``TMPDIR``), on the disk here, before the tests'
directories move to memory."""


def _is_tmpfs(path: Path) -> bool:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(fields[1] == str(path) and fields[2] == "tmpfs" for fields in (line.split() for line in mounts)
               if len(fields) > 2)


def pytest_configure(config):
    """The tests' temporary directories in memory (module docstring), unless a place was chosen."""
    if config.option.basetemp or os.environ.get("PYTEST_DEBUG_TEMPROOT"):
        return
    if _is_tmpfs(MEMORY_TEMP) and os.access(MEMORY_TEMP, os.W_OK) and \
            shutil.disk_usage(MEMORY_TEMP).free >= MEMORY_TEMP_FREE:
        os.environ["PYTEST_DEBUG_TEMPROOT"] = str(MEMORY_TEMP)  # read once, by the first tmp_path


LAUNCHES = ("tests/distributed/", "tests/e2e/", "tests/integrations/")
"""The directories whose tests start multi-process launches (torchrun, forked ranks, several jobs at
once): each launch takes both cores of the project's VM, and their directories' fork servers
(conftest.py there) serve each directory's tests in turn."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n 2 --dist loadfile`` (``make test``): each test file is a unit a worker takes whole
    (its module fixtures set up once), and the ``LAUNCHES`` directories together are one unit: their
    launches run one at a time, on one worker, in collection order (each directory's fork servers
    started once), while the other worker takes the other files. Units go out largest first
    (pytest-xdist's ``--loadscope-reorder``), so the launches start at once. Other ``--dist``
    modes are pytest-xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "launches" if nodeid.startswith(LAUNCHES) else super()._split_scope(nodeid)

    return Scheduling(config, log)


@pytest.fixture
def disk_path():
    """A fresh directory on the disk (``TMPDIR``), removed afterwards: for a test whose check needs
    a save to take the disk's time (``tmp_path`` may be in memory: module docstring)."""
    with tempfile.TemporaryDirectory(dir=DISK_TEMP, prefix="llmtailor-disk-") as where:
        yield Path(where)


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    """The real corpus (pydoc_data.topics) as byte tokens."""
    return corpus_tokens()


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or f'exit status {result.returncode}'}")
    try:
        yield mount
    finally:
        # A failed test may still hold the run's lock file open: detach the mount lazily then.
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount)], check=True)
