"""The e2e tests' training jobs (``python -m llmtailor.training_example ARGS``) forked from a fork
server that imported torch, transformers' Llama and llmtailor once for the directory
(tests/forked_nodes.py): each job a process of its own (its own pid, memory and output; a SIGKILL
lands in the job itself, and its end is known once it has ended), without a fresh interpreter's
start and imports (about 10 s of CPU a job on the project's VM, most of a crash test's time). The
jobs share the server's ``str`` hash seed, where fresh interpreters each drew their own."""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

import pytest
from forked_nodes import Forked, ForkServers

EXAMPLE_JOB = Path(__file__).with_name("example_job.py")
JOB_SERVER = ForkServers(preload=("torch", "transformers.models.llama.modeling_llama", "llmtailor",
                                  "llmtailor.training_example"), env={})
"""Its jobs run with this process's threads (no ``OMP_NUM_THREADS`` of its own), as they did as
fresh interpreters."""


class ExampleJobs:
    """``launch(command, stdout, stderr)`` (calling it): the job ``command`` (``python -m
    llmtailor.training_example ARGS``, as bench/crash_test.py's ``launch`` gets it, or ``python
    SCRIPT ARGS``) forked from the server (``forked_nodes.Forked``: polled, killed and waited for
    as a ``subprocess.Popen``); ``run(commands)`` runs jobs at once to their ends. Jobs still
    running at the end are killed (``close``)."""

    def __init__(self):
        self.started: list[Forked] = []

    def __call__(self, command: list, stdout, stderr) -> Forked:
        command = [str(part) for part in command]
        assert command[0] == sys.executable, command
        argv = [EXAMPLE_JOB, *command[3:]] if command[1:3] == ["-m", "llmtailor.training_example"] else command[1:]
        [address] = JOB_SERVER.addresses(1)
        self.started.append(Forked(address, argv, stdout, stderr))
        return self.started[-1]

    def run(self, commands: list[list], timeout: float = 600) -> list[tuple[int, str, str]]:
        """Each job's exit status, stdout and stderr, once every one ended; the jobs run at once
        (independent jobs). One still running ``timeout`` seconds on is killed (a hang)."""
        with contextlib.ExitStack() as files:
            outputs = [(files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
                       for _ in commands]
            jobs = [self(command, *output) for command, output in zip(commands, outputs)]
            deadline = time.monotonic() + timeout
            try:
                for job in jobs:
                    job.wait(max(0.0, deadline - time.monotonic()))
            finally:
                for job in jobs:
                    job.close()
            for output in outputs:
                for file in output:
                    file.seek(0)
            return [(job.returncode, stdout.read(), stderr.read()) for job, (stdout, stderr) in zip(jobs, outputs)]

    def close(self) -> None:
        for job in self.started:
            job.close()


@pytest.fixture(scope="session")
def example_jobs():
    """The directory's ``ExampleJobs``."""
    jobs = ExampleJobs()
    yield jobs
    jobs.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The server ends after the directory's last test (the next test elsewhere, or none)."""
    try:
        return (yield)
    finally:
        if nextitem is None or Path(__file__).parent not in nextitem.path.parents:
            JOB_SERVER.stop()
