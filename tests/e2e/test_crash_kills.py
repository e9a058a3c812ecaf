"""SIGKILL a real training process at random instants (fixed seed, also while async saves persist
in the background), with the loop of ``bench/crash_test.py``: after every kill the store verifies, has no partial snapshot
outside ``.tmp/``, names the largest committed step as latest and restores it; a Full run
resumed through every kill ends bitwise equal to an uninterrupted one (one uninterrupted run,
with sync saves, serves both Full loops: async saves must not change what training computes).

Each loop kills twice: a fresh job, then a job resumed after a kill, before a last resume runs to
the end. More kills repeat the same shape at other instants (``bench/crash_test.py --kills 50``
is the place for many). Each job is forked from an interpreter that imported it (tests/e2e/conftest.py:
a process of its own, killed and waited for as one started fresh, without a fresh one's start and
imports, which were most of a kill's cost)."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

CRASH_TEST = Path(__file__).parents[2] / "bench" / "crash_test.py"
KILLS = 2
STEPS = 18  # crash_test.default_steps(KILLS), for each loop: one reference serves both Full loops


def crash_test_module():
    """bench/crash_test.py, imported from its path (bench/ is not a package)."""
    if "crash_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("crash_test", CRASH_TEST)
        module = importlib.util.module_from_spec(spec)
        sys.modules["crash_test"] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["crash_test"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, example_jobs):
    """An uninterrupted Full run of ``STEPS`` steps (read only by the loops: its losses and final
    weights' digest; its 1 GiB of snapshots removed once they are read)."""
    workdir = tmp_path_factory.mktemp("reference")
    result = crash_test_module().reference_run(workdir, steps=STEPS, launch=example_jobs)
    shutil.rmtree(workdir)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("policy, kills, async_save", [("full", KILLS, False), ("parity", KILLS, False), ("full", KILLS, True)])
def test_store_survives_sigkills_during_saves(disk_path, request, example_jobs, policy, kills, async_save):
    """On the disk (``disk_path``): a save there takes about 60% of a step, so kills land inside
    saves as often as ``bench/crash_test.py`` has them (in memory a save is a copy)."""
    crash_test, full = crash_test_module(), policy == "full"
    assert crash_test.default_steps(kills) <= STEPS
    report = crash_test.crash_loop(
        disk_path, kills=kills, policy=policy, seed=5, steps=STEPS if full else None, async_save=async_save,
        reference=request.getfixturevalue("reference") if full else None, log=lambda line: None, launch=example_jobs,
    )
    assert report.problems == []
    assert report.kills == kills
    if full:
        assert report.digest_match and report.steps_compared > 0 and report.loss_mismatches == 0
