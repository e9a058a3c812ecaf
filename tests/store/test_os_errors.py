"""OS errors (permission denied, a read-only file system) are one line naming the path: exit 2
at the CLI, a TailorError in the library; a file that cannot be read is not "missing".

Real cases where this machine allows them: a read-only tmpfs (root only), and a process
without the capability to override file permissions (``setpriv``), since tests run as root
and root reads a ``chmod 000`` file. Each is skipped with the reason where unavailable."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import parity_run, tiny, tree_digest
from helpers import unit_file as file_holding
from typer.testing import CliRunner

from llmtailor import Parity, Tailor
from llmtailor.cli import app
from llmtailor.errors import IntegrityError, TailorError
from llmtailor.store.run import Run
from llmtailor.store.storage.local_lock import LEASE_FILE

runner = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokens):
    return parity_run(tmp_path_factory.mktemp("os-errors") / "run", tokens, 3)


def _mount(args: list[str]) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount here: {result.stderr.strip() or f'exit status {result.returncode}'}")


@pytest.fixture(params=["leased", "written before leases"])
def read_only_run(request, saved, tmp_path):
    """A copy of the run on a tmpfs remounted read-only; in the second case its snapshots hold
    no lease file (written before leases) and none can be created."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and the mount command")
    mount = tmp_path / "fs"
    mount.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)])
    try:
        shutil.copytree(saved, mount / "run")
        if request.param != "leased":
            for lease in (mount / "run").rglob(LEASE_FILE):
                lease.unlink()
        _mount(["-o", "remount,ro", str(mount)])
        yield mount / "run"
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_read_only_run_is_read_and_not_written(read_only_run, tmp_path):
    before = tree_digest(read_only_run)
    for args in (["verify"], ["inspect"], ["drift"]):
        result = runner.invoke(app, [*args, str(read_only_run)])
        assert result.exit_code == 0, result.output
    model, opt, sched = tiny(seed=1)
    tailor = Tailor(read_only_run, model, opt, sched, policy=Parity())
    assert tailor.restore().step == 3
    with pytest.raises(TailorError, match=f"cannot write to the run: {read_only_run}/.lock: read-only file system"):
        tailor.save(4)
    result = runner.invoke(app, ["gc", str(read_only_run), "--keep", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{read_only_run}/.lock: read-only file system" in result.output
    out = read_only_run.parent / "exported"
    result = runner.invoke(app, ["assemble", str(read_only_run), "-o", str(out)])
    assert result.exit_code == 2 and f"{out}: read-only file system" in result.output
    assert tree_digest(read_only_run) == before


# -- permission denied -------------------------------------------------------------------------

UNPRIVILEGED = textwrap.dedent(
    """
    import sys
    from typer.testing import CliRunner
    sys.path.insert(0, sys.argv[2])
    from helpers import tiny
    from llmtailor import Tailor
    from llmtailor.cli import app

    for args in (["verify", sys.argv[1]], ["inspect", sys.argv[1]]):
        result = CliRunner().invoke(app, args)
        print(f"exit {result.exit_code}:", result.output.replace(chr(10), " | "))
    try:
        Tailor(sys.argv[1], *tiny(seed=1)).restore()
        print("restored")
    except Exception as err:
        print(f"{type(err).__name__}: {err}")
    """
)


def _unprivileged(run: Path) -> list[str]:
    """Run UNPRIVILEGED as root without the capabilities that bypass file permissions."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to drop the permission-override capabilities")
    caps = "-dac_override,-dac_read_search"
    tests = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [setpriv, f"--inh-caps={caps}", f"--bounding-set={caps}", sys.executable, "-c", UNPRIVILEGED, str(run), tests],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_unit_file_that_cannot_be_read_is_permission_denied_not_missing(saved, tmp_path):
    """The shape that found it (root without its override, ``chmod 000`` on a unit file):
    verify and restore said the file was missing."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    unit = file_holding(run, 3, "layer.0")
    unit.chmod(0)
    verify, inspect, restore = _unprivileged(run)
    assert verify.startswith("exit 1:") and f"{unit}: permission denied" in verify and "missing" not in verify
    assert inspect.startswith("exit 0:")
    assert restore.startswith("IntegrityError:") and f"{unit}: permission denied" in restore and "missing" not in restore


def test_a_run_whose_snapshots_cannot_be_listed_is_one_line(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    (run / "snapshots").chmod(0)
    try:
        verify, inspect, restore = _unprivileged(run)
    finally:
        (run / "snapshots").chmod(0o755)
    for line in (verify, inspect):
        assert line.startswith("exit 2: error:") and f"{run}/snapshots: permission denied" in line
        assert "Traceback" not in line
    assert restore == f"StorageError: {run}/snapshots: permission denied"  # a TailorError and an OSError


def test_a_unit_file_that_cannot_be_opened_raises_permission_denied_in_the_library(saved, tmp_path, monkeypatch):
    """The library half, in process: the file is there but may not be read."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    unit = file_holding(run, 3, "layer.0")
    real_open = open

    def guarded_open(path, *args, **kwargs):
        if Path(path) == unit:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    with pytest.raises(IntegrityError, match=f"{unit}: permission denied"):
        Tailor(run, *tiny(seed=1)).restore()
    assert f"{unit}: permission denied" in Run(run).verify()


def test_a_save_that_meets_an_os_error_is_a_tailor_error_naming_the_path(tmp_path, monkeypatch):
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(TailorError, match=f"{file}: is a file, not a run directory"):
        Tailor(file, *tiny()).save(1)
    with pytest.raises(TailorError, match=f"cannot write to the run: {file}/run: a part of the path is a file"):
        Tailor(file / "run", *tiny()).save(1)
    run = tmp_path / "run"
    tailor = Tailor(run, *tiny())
    tailor.save(1)
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):  # the run's storage turned read-only since
        if self.is_relative_to(run / ".tmp"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(TailorError, match=rf"{run}/\.tmp/step-00000002\..*: read-only file system while saving step 2 to {run}; step 2 was not saved"):
        tailor.save(2)
    assert Run(run).steps() == [1]


def test_an_os_error_in_the_library_is_still_an_os_error(tmp_path):
    """Code that caught the raw OSError before still catches it (StorageError is both)."""
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(OSError) as caught:
        Tailor(file / "run", *tiny()).save(1)
    assert isinstance(caught.value, TailorError) and caught.value.errno == errno.ENOTDIR
    assert str(caught.value) == f"cannot write to the run: {file}/run: a part of the path is a file, not a directory"
