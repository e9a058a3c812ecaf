"""Several one-process jobs of one job script in one launch: the script's imports (torch,
transformers, Lightning, ...) are paid once, and each job runs in a process forked from the
launch before it does anything else, so it starts as a fresh process would: its own memory, pid,
exit status and output files. A job that SIGKILLs itself ends only its own process (status -9,
as alone), and the next job starts from the same imported, untouched state.

    python forked_jobs.py SCRIPT JOBS.json STATUS.json

JOBS.json is a list of ``{"args": [...], "out": PATH, "err": PATH}``: a job's command line after
SCRIPT and the files its stdout and stderr go to. The jobs run one after another, in the list's
order (a job may resume what an earlier one wrote), but a job marked ``"together": true`` starts
without waiting for those before it (independent jobs: the launch waits for them all at the end,
or before the next job not so marked). STATUS.json gets each job's exit status as
``subprocess`` reports one (0, 1, -9 for SIGKILL). The script is imported as a module (its
``main()`` is each job), with its directory first on ``sys.path`` as ``python SCRIPT`` has it,
and the modules its ``PRELOAD`` names are imported before the first fork. Nothing of llmtailor
is imported here: a job can still check that it imports none.

What the jobs of one launch share that separate interpreters would not: those imports, and
Python's ``str`` hash seed.

    python forked_jobs.py --ranks N --port PORT [--statuses STATUS.json] SCRIPT ARGS...

(``rank_launch``) starts the N ranks of one job as ``torchrun --standalone`` would, each a process
forked from the launch once it imported SCRIPT (its own imports, llmtailor's among them, and its
``PRELOAD``): the agent's interpreter and each rank's start and imports are paid once (torch_job.py's
ranks took 10-16 s of CPU each on the project's VM in session 53, about 10 s of it their imports,
and torchrun's agent 3-5 s). For tests of what the ranks do, not of torchrun: the tests of
torchrun keep torchrun; the node launches (``--nnodes``, ``helpers.node_launches``) fork their
ranks from a server per rank (forked_nodes.py: their seeds differ). The ranks of one launch share their
``str`` hash seed (torchrun's each draw their own): a set of names iterated in another order on
each rank is not seen there."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finished:
    """One job of a launch: its exit status, its output and the file its result goes to."""

    name: str
    status: int | None
    stdout: str
    stderr: str
    result_file: Path
    killed: int = -9  # the status of a job SIGKILLed: a launcher of several ranks exits 1 instead

    def result(self, crash: bool = False) -> dict:
        """What ``helpers.run_job`` returns for the job: the JSON it wrote to its result file,
        with its stdout; ``crash=True``: it must have been SIGKILLed."""
        said = f"job {self.name!r} exited with {self.status}:\n{self.stderr[-3000:]}"
        if crash:
            assert self.status == self.killed, said
            return {}
        assert self.status == 0, said
        return {**json.loads(self.result_file.read_text()), "stdout": self.stdout}


def run_jobs(script: Path, jobs: dict[str, tuple[list[str], Path]], work: Path,
             together: bool = False) -> dict[str, Finished]:
    """Run ``jobs`` (name -> (command line after ``script``, its result file)) in order, each
    forked from one launch of this file (``together``: all at once, for jobs that touch nothing
    of one another's: on an idle machine they take its cores as separate processes would); their
    logs and statuses go to ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    listed = [{"args": [str(a) for a in args], "out": str(work / f"{name}.out"), "err": str(work / f"{name}.err"),
               "together": together} for name, (args, _) in jobs.items()]
    (work / "jobs.json").write_text(json.dumps(listed))
    status_file = work / "status.json"
    status_file.unlink(missing_ok=True)
    from helpers import run_launch  # only where a test runs jobs: nothing of llmtailor in a launch of this file

    returncode, _, launch_stderr = run_launch([sys.executable, __file__, script, work / "jobs.json", status_file],
                                              {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    statuses = json.loads(status_file.read_text()) if status_file.is_file() else []
    finished = {}
    for i, (name, (_, result)) in enumerate(jobs.items()):
        out, err = Path(listed[i]["out"]), Path(listed[i]["err"])
        status = statuses[i] if i < len(statuses) else None
        stderr = err.read_text() if err.is_file() else f"not run: the launch exited with {returncode}:\n" \
                                                         f"{launch_stderr[-3000:]}"
        finished[name] = Finished(name, status, out.read_text() if out.is_file() else "", stderr, result)
    return finished


def launched(command: list[str], name: str, result: Path, env: dict[str, str] | None = None) -> Finished:
    """A job launched on its own (``command``: a launcher of several ranks and the job's command
    line; ``env``: its environment, this process's by default), as ``Finished``; a rank
    SIGKILLed makes the launcher stop the others and exit 1."""
    from helpers import run_launch

    status, stdout, stderr = run_launch(command, {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1",
                                                  "DS_ACCELERATOR": "cpu"})
    return Finished(name, status, stdout, stderr, result, killed=1)


def rank_launch(ranks: int, statuses: Path | None = None) -> list[str]:
    """The command line that starts ``ranks`` ranks of a job script (its path and arguments after
    it) as ``torchrun --standalone --nproc_per_node=ranks`` does, forked from one launch (module
    docstring): each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_PORT``...; every rank on one node) and runs the script's ``main()``, exiting as the
    script would. A rank that fails makes the launch end the others (SIGTERM) and exit 1, as
    torchrun's agent does; with ``statuses``, every rank runs to its end (as processes started by
    hand) and the file gets each rank's exit status, the launch exiting 0. A script whose command
    line holds several jobs (``hf_job.py``'s ``--then``) runs its ``launch()`` in place of ``main()``."""
    from helpers import free_port

    return [sys.executable, __file__, "--ranks", str(ranks), "--port", str(free_port()),
            *(["--statuses", str(statuses)] if statuses is not None else [])]


def served_launch(servers, ranks: int, port: int | None = None) -> list[str]:
    """``rank_launch``'s twin for a test module's fork server (``servers``, a
    forked_nodes.ForkServers that imported the job's modules once for every launch of the
    module): the command line of a one-node launch (forked_nodes.node_command: torchrun's
    environment and agent store) whose ``ranks`` ranks are all forked from that one server, on
    ``port`` (a free one by default), before the script and its arguments."""
    from forked_nodes import node_command
    from helpers import free_port

    [address] = servers.addresses(1)
    return node_command([address] * ranks, 1, 0, ranks, "127.0.0.1", free_port() if port is None else port)


def run_in_turn(launcher: list[str], script: Path, jobs: dict[str, tuple[list[str], Path]],
                ranks: int, env: dict[str, str] | None = None) -> dict[str, Finished]:
    """Run ``jobs`` (as ``run_jobs``) one after another in one launch of ``ranks`` ranks
    (``launcher``, e.g. torchrun; ``env``: its environment, this process's by default):
    ``script`` takes their command lines separated by ``--then``
    and prints ``job N done on rank R`` as each ends. A job is done (status 0) once every rank
    said so; the first that is not gets the launch's status (a launcher exits 1 when a rank was
    SIGKILLed), and those after it None (not run). The output of every job is the launch's."""
    command = [*launcher, str(script)]
    for number, (args, _) in enumerate(jobs.values()):
        command += [*(["--then"] if number else []), *map(str, args)]
    from helpers import run_launch

    returncode, stdout, stderr = run_launch(command, {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1",
                                                      "DS_ACCELERATOR": "cpu"})
    finished, status = {}, 0
    for number, (name, (_, result)) in enumerate(jobs.items()):
        if status == 0:
            said = all(f"job {number} done on rank {rank}\n" in stdout for rank in range(ranks))
            status = 0 if said else returncode or None  # None: the launch ended well without it
        else:
            status = None
        finished[name] = Finished(name, status, stdout, stderr, result, killed=1)
    return finished


def _run(module, script: str, job: dict) -> int:
    """In the forked process: the job's output to its files, its command line, its ``main()``."""
    for fd, path in ((1, job["out"]), (2, job["err"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [script, *job["args"]]
    try:
        module.main()
        return 0
    except SystemExit as done:  # as the interpreter reports it
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _imported(script: str):
    """``script`` imported as its module (its directory first on ``sys.path``, as ``python
    SCRIPT`` has it), then the modules its ``PRELOAD`` names."""
    sys.path.insert(0, str(Path(script).resolve().parent))
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for name in getattr(module, "PRELOAD", ()):
        importlib.import_module(name)
    return module


_TERM_GRACE = 30.0
"""Seconds the ranks of a failed launch have to end after SIGTERM before they are SIGKILLed."""


def launch_ranks(ranks: int, port: int, statuses_file: str | None, script: str, args: list[str]) -> None:
    """``rank_launch``'s launch: fork the ranks, wait for them; this process's exit status is the
    launch's."""
    module = _imported(script)
    sys.argv = [script, *args]
    common = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "ROLE_WORLD_SIZE": str(ranks),
              "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    running: dict[int, int] = {}
    for rank in range(ranks):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # The rank: in a session of its own, as torchrun starts each (where the kernel shares
            # the CPU by session, a busy machine gives it a session's share, as it gives torchrun's),
            # main() and then the interpreter's own exit (its threads joined, its atexit handlers
            # run; an exception printed, status 1), as a fresh ``python SCRIPT`` process.
            os.setsid()
            os.environ.update(common, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            getattr(module, "launch", module.main)()
            sys.exit(0)
        running[pid] = rank
    # Ended (``helpers.end_launches``: SIGTERM), the launch ends its ranks, as torchrun's agent does.
    signal.signal(signal.SIGTERM, lambda *_: _signal_all(list(running), signal.SIGTERM))
    statuses: list[int | None] = [None] * ranks
    failed = False
    while running:
        pid, status = os.wait()
        statuses[running.pop(pid)] = code = os.waitstatus_to_exitcode(status)
        if code != 0 and statuses_file is None and not failed:  # as torchrun's agent: end the others
            failed = True
            _signal_all(list(running), signal.SIGTERM)
            # The ranks still running when the grace is over, not those running now: a pid reaped
            # meanwhile is free for any process of the machine to take.
            threading.Timer(_TERM_GRACE, lambda: _signal_all(list(running), signal.SIGKILL)).start()
    if statuses_file is not None:
        Path(statuses_file).write_text(json.dumps(statuses))
    os._exit(1 if failed else 0)  # the timer's thread not waited for


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main(script: str, jobs_file: str, status_file: str) -> None:
    module = _imported(script)
    assert not [m for m in sys.modules if m.startswith("llmtailor")], "the launch imported llmtailor"
    jobs = json.loads(Path(jobs_file).read_text())
    statuses, running = [None] * len(jobs), {}

    def wait_running() -> None:
        while running:
            pid, status = os.wait()
            statuses[running.pop(pid)] = os.waitstatus_to_exitcode(status)

    for number, job in enumerate(jobs):
        if not job.get("together"):
            wait_running()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_run(module, script, job))  # as the jobs end themselves (helpers' ``leave``)
        running[pid] = number
    wait_running()
    Path(status_file).write_text(json.dumps(statuses))


if __name__ == "__main__":
    if sys.argv[1] == "--ranks":  # --ranks N --port PORT [--statuses FILE] SCRIPT ARGS...
        _, _, ranks, _, port, *rest = sys.argv
        statuses = rest[1] if rest[0] == "--statuses" else None
        rest = rest[2:] if statuses else rest
        launch_ranks(int(ranks), int(port), statuses, rest[0], rest[1:])
    else:
        main(*sys.argv[1:])
