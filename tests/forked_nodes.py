"""The "nodes" of a multi-node job on this machine (``helpers.node_launches``) as ``torchrun --nnodes
N --node_rank i`` starts them, each rank forked from an interpreter that imported torch and
llmtailor once for every launch of a test module: the imports and the interpreter starts of
torchrun's agents and of their ranks are what the node tests spent most of their CPU on (113 of
the 161 interpreter starts session 54 counted in the suite; on the project's VM an agent took
about 4 s of CPU, node_recovery_job.py's imports 5 s more in each rank).

    python forked_nodes.py --forks ADDRESS PRELOAD...          (a "fork server", ``ForkServers``)
    python forked_nodes.py --node ADDRESSES NNODES NODE_RANK PER_NODE HOST PORT SCRIPT ARGS...

A node is what the test starts (a ``subprocess.Popen``, with the node's environment, output and
session): a small process importing nothing but the standard library, which stands for torchrun's
agent. It asks a fork server for each of its ranks, handing it its environment, working directory
and standard streams; the server forks the rank, which runs ``SCRIPT`` as ``python SCRIPT ARGS``
does (``runpy``: as ``__main__``, ending with the interpreter's own exit) with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``TORCHELASTIC_*``...). What torchrun's agents do that the tests depend on, the node does too:

- Node 0 hosts the job's TCPStore in a process of its own (``TORCHELASTIC_USE_AGENT_STORE``: the
  ranks are its clients), so the store outlives a rank 0 that is killed, and it waits for every
  node's ranks to end before it goes (torchrun's exit barrier).
- A rank that fails makes the node end the others (SIGTERM, SIGKILL after a grace) and exit 1; a
  node sent SIGTERM ends its ranks first.
- A node that is killed (SIGKILL, its process group or the node alone) takes its ranks with it:
  each rank, and node 0's store, is signalled (SIGIO, whose default action ends the process) as
  the node's end of its connection closes. (torchrun's ranks, in sessions of their own, outlived
  a SIGKILLed agent; the tests killed them by pid.)
- Each rank has its own session, pid, environment (its node's TMPDIR, memory directory...),
  working directory and output, and a ``str`` hash seed of its own among the ranks of a launch:
  rank r is forked from the r-th server, each an interpreter of its own (the ranks of one launch
  iterate a set of names in different orders, as torchrun's do). The generators that a fresh
  interpreter seeds from the OS (``random``, numpy's) are reseeded in each rank.

The servers serve every test of tests/distributed/ and end after its last one (its conftest.py):
a server only imports and forks, so what a rank starts from does not depend on the tests before."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from forked_jobs import _TERM_GRACE, _signal_all  # a node ends its ranks as rank_launch's launch does

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.nn.parallel", "llmtailor",
           "llmtailor.distributed.courier", "llmtailor.store.tiers.collective", "llmtailor.store.node_commit",
           "torch_job", "node_recovery_job", "boto3", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.configuration_qwen2", "llmtailor.cli", "llmtailor.providers.fsdp",
           "llmtailor.store.reader", "llmtailor.store.shared_ranges", "test_readme")
"""What each fork server imports before its first fork: what the node jobs (tests/distributed/)
import, most of their imports' cost (boto3: an S3 run's commit checks for uploads left), and what
their ranks import lazily: transformers' Llama (the first ``tiny()`` of a rank, about 3 s of CPU on
the project's VM, with torch's DTensor and dynamo modules it pulls in: 765 of the 961 modules a rank
of test_torchrun's 2-rank launch imported after its fork), the restore's readers, the CLI
(typer, rich) and test_readme (pytest: the pipeline scenarios' documented blocks)."""

_EXIT_BARRIER = 300.0
"""Seconds node 0 waits, once its ranks ended, for the other nodes' (torchrun's exit barrier)."""


class ForkServers:
    """The fork servers of this process's node launches (one per rank of the widest launch, started
    on first use), each importing ``preload`` in this process's environment and ``env``
    (one thread per rank by default, as the node launches set it): ``addresses(ranks)`` those the
    ranks of a launch are forked from; ``stop`` ends them."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, env: dict[str, str] | None = None):
        self._servers: list[tuple[subprocess.Popen, str]] = []
        self._preload, self._env = preload, {"OMP_NUM_THREADS": "1"} if env is None else env

    def addresses(self, ranks: int) -> list[str]:
        while len(self._servers) < ranks:
            address = f"llmtailor-forks-{os.getpid()}-{len(self._servers)}-{os.urandom(4).hex()}"
            server = subprocess.Popen([sys.executable, __file__, "--forks", address, *self._preload],
                                      env={**os.environ, **self._env, "PYTHONUNBUFFERED": "1"},
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            self._servers.append((server, address))
        return [address for _, address in self._servers[:ranks]]

    def stop(self) -> None:
        """End every server (their ranks ended with their launches) and reap them."""
        for server, _ in self._servers:
            server.terminate()
        for server, _ in self._servers:
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        self._servers.clear()


class Forked:
    """One process forked by the fork server at ``address`` running ``argv`` (a script and its
    arguments, as ``python SCRIPT ARGS``) with this process's environment and directory, its
    output to ``stdout`` and ``stderr`` (open files): as much of ``subprocess.Popen`` as a test
    that starts, polls, kills and waits for a job uses. ``pid`` is the job's own (a SIGKILL lands
    in the job, not in a launcher); ``poll`` and ``wait`` give its exit status once the server
    reaped it, so the job has ended when they do (what it wrote is all there). Closing this end
    (``close``, or this process's end) ends the job (SIGIO, ``_forked``)."""

    def __init__(self, address: str, argv: list, stdout, stderr):
        with open(os.devnull) as stdin:
            self._conn = _connect(address, patience=_LISTENING_WAIT)
            _send(self._conn, {"kind": "rank", "argv": [str(arg) for arg in argv], "cwd": os.getcwd(),
                               "env": dict(os.environ)}, [stdin.fileno(), stdout.fileno(), stderr.fileno()])
        self._lines = _Lines(self._conn)
        message, _ = self._lines.next()
        if message is None or "pid" not in message:
            raise RuntimeError(f"the fork server at {address} forked nothing for {argv}")
        self.pid, self.args, self.returncode = message["pid"], argv, None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            message, _ = self._lines.next()
            self.returncode = message["status"] if message else 1  # no status: its server ended (and it)
            self._conn.close()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """End the job if it still runs (SIGKILL) and wait for its end."""
        if self.returncode is None:
            self.kill()
            self.wait()


def node_command(addresses: list[str], nnodes: int, node_rank: int, per_node: int, host: str, port: int,
                 statuses: Path | None = None) -> list[str]:
    """The command line of node ``node_rank`` (before the script and its arguments); with
    ``statuses``, every rank runs to its end (none is ended when another fails, as processes
    started by hand) and the file gets the node's ranks' exit statuses, the node exiting 0."""
    return [sys.executable, __file__, "--node", ",".join(addresses), str(nnodes), str(node_rank), str(per_node),
            host, str(port), *(["--statuses", str(statuses)] if statuses is not None else [])]


# --- the wire: one JSON object a line, a request's standard streams passed with it ---

def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = (json.dumps(message) + "\n").encode()
    if fds:
        socket.send_fds(conn, [data], list(fds))
    else:
        conn.sendall(data)


class _Lines:
    def __init__(self, conn: socket.socket):
        self.conn, self.buffer = conn, b""

    def next(self, fds: int = 0) -> tuple[dict | None, list[int]]:
        """The next message (None at the end of the connection) and the descriptors sent with it."""
        received: list[int] = []
        while b"\n" not in self.buffer:
            if fds:
                data, got, _, _ = socket.recv_fds(self.conn, 1 << 16, fds)
                received += got
            else:
                data = self.conn.recv(1 << 16)
            if not data:
                return None, received
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line), received


_LISTENING_WAIT = 300.0
"""Seconds a node waits for a fork server to listen (it starts as the node does): a bound, no timing."""


def _connect(address: str, patience: float = 0.0) -> socket.socket:
    """A connection to ``address``; one not listening yet is tried again for ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect("\0" + address)
            return conn
        except ConnectionRefusedError:
            conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# --- a fork server ---

def serve(address: str, preload: list[str]) -> dict:
    """Listen at ``address`` (before the imports: a node may ask at once, it waits), import
    ``preload`` (and the modules the ``PRELOAD`` of each names), then fork a process for each request. In the server this returns only to exit
    (its parent gone, or SIGTERM); in a forked process, it returns the request."""
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind("\0" + address)
    listening.listen(64)
    import importlib

    sys.path.append(str(Path(__file__).parent / "distributed"))  # the node jobs, for ``preload``
    for name in preload:
        for also in getattr(importlib.import_module(name), "PRELOAD", ()):  # a job's own list (forked_jobs' too)
            importlib.import_module(also)
    import gc

    gc.freeze()  # the imports' objects out of the collector's sight: a fork's collections copy none of their pages
    parent, stopping = os.getppid(), []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    children: dict[int, socket.socket] = {}  # each forked process's connection to its node
    while not stopping and os.getppid() == parent:
        ready, _, _ = select.select([listening], [], [], 0.1)
        if ready:
            conn, _ = listening.accept()
            request, fds = _Lines(conn).next(fds=3)
            if request is None or len(fds) != 3:
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                listening.close()
                for other in children.values():
                    other.close()
                return {**request, "conn": conn, "fds": fds}
            for fd in fds:
                os.close(fd)  # the node's streams: only the rank holds them now (their readers see its end)
            children[pid] = conn
            try:
                _send(conn, {"pid": pid})
            except OSError:
                pass
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, 0)  # no signal to a pid the kernel may hand out again
                _send(conn, {"status": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
            conn.close()
    for pid in children:  # the server ends: what it forked ends with it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)  # nothing to flush or finalize: the interpreter's exit would only take its time


def _forked(request: dict) -> None:
    """In the forked process: tied to its node's end of the connection (SIGIO once it closes),
    then its session, streams, directory, environment and seeds, as a fresh process's."""
    conn: socket.socket = request["conn"]
    os.setsid()
    fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(conn.fileno(), fcntl.F_SETFL, fcntl.fcntl(conn.fileno(), fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([conn], [], [], 0)[0] and not conn.recv(1, socket.MSG_PEEK):
        os._exit(1)  # the node ended before the signal was armed
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import random
    import tempfile

    random.seed()
    tempfile.tempdir = None  # TMPDIR read again: the node's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _rank(request: dict) -> None:
    """Run the rank's script as ``python SCRIPT ARGS`` would: its directory first on ``sys.path``,
    as ``__main__``; its exit (status, exception) is the interpreter's."""
    import runpy

    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")


def _store(request: dict) -> None:
    """Node 0's store: the job's TCPStore, as torchrun's agent hosts it, and its exit barrier:
    a node whose ranks ended connects to ``request["barrier"]`` and says so; node 0 waits there
    for every node. Ends with node 0 (SIGIO)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    conn: socket.socket = request["conn"]
    store = TCPStore(request["host"], request["port"], is_master=True, wait_for_workers=False,  # noqa: F841 (held)
                     timeout=timedelta(seconds=1800))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind("\0" + request["barrier"])
    listening.listen(64)
    _send(conn, {"ready": True})
    done: set[int] = set()
    waiting: list[socket.socket] = []
    while True:
        arrived, _ = listening.accept()
        message, _ = _Lines(arrived).next()
        if message is None:
            arrived.close()
            continue
        done.add(message["done"])
        waiting.append(arrived)
        if len(done) == request["nnodes"]:
            for other in waiting:
                try:
                    _send(other, {"all": True})
                except OSError:
                    pass
            waiting.clear()


# --- a node ---

def node(addresses: list[str], nnodes: int, node_rank: int, per_node: int, host: str, port: int,
         script: str, args: list[str], statuses: str | None = None) -> None:
    """Start the node's ranks (and node 0's store), wait for them as torchrun's agent does, exit
    with its status (``statuses``: ``node_command``'s)."""
    world = nnodes * per_node
    barrier = f"llmtailor-barrier-{host}-{port}"
    common = {"LOCAL_WORLD_SIZE": str(per_node), "WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
              "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes), "ROLE_NAME": "default",
              "MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
              "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
              "TORCHELASTIC_USE_AGENT_STORE": "True",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    store = None
    if node_rank == 0:
        store = _ask(addresses[0], {"kind": "store", "host": host, "port": port, "barrier": barrier, "nnodes": nnodes})
        message = {}
        while message is not None and "ready" not in message:  # its pid from the server comes first, or after
            message, _ = store[1].next()
            if message is not None and "status" in message:
                message = None
        if message is None:
            sys.exit(f"node 0: the job's store did not start on {host}:{port}")
    ranks: dict[int, tuple[socket.socket, _Lines, int]] = {}  # local rank -> connection, its lines, pid
    for local in range(per_node):
        rank = node_rank * per_node + local
        env = {**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(local), "ROLE_RANK": str(rank)}
        conn, lines = _ask(addresses[rank], {"kind": "rank", "argv": [script, *args], "env": env})
        ranks[local] = (conn, lines, lines.next()[0]["pid"])
    pids = [pid for _, _, pid in ranks.values()]
    ending = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: (ending.set(), _signal_all(pids, signal.SIGTERM),
                                              threading.Timer(_TERM_GRACE, _signal_all, (pids, signal.SIGKILL)).start()))
    failed = False
    waiting, codes = dict(ranks), [None] * per_node
    while waiting:
        ready, _, _ = select.select([conn for conn, _, _ in waiting.values()], [], [])
        for local in [local for local, (conn, _, _) in waiting.items() if conn in ready]:
            message, _ = waiting.pop(local)[1].next()
            codes[local] = code = message["status"] if message else 1
            if code != 0 and not failed and statuses is None:
                failed = True
                print(f"node {node_rank}: rank {node_rank * per_node + local} exited with {code}; ending the node's ranks",
                      file=sys.stderr, flush=True)
                live = [pid for _, _, pid in waiting.values()]
                _signal_all(live, signal.SIGTERM)
                threading.Timer(_TERM_GRACE, _signal_all, (live, signal.SIGKILL)).start()
    if statuses is not None:
        Path(statuses).write_text(json.dumps(codes))
    if not failed and not ending.is_set():
        _exit_barrier(barrier, node_rank, wait=node_rank == 0)
    os._exit(1 if failed or ending.is_set() else 0)  # a grace timer not waited for; node 0's store ends with it


def _ask(address: str, request: dict) -> tuple[socket.socket, _Lines]:
    """Ask the fork server at ``address`` for a process: its connection (held for as long as the
    process should live) and its messages."""
    conn = _connect(address, patience=_LISTENING_WAIT)
    _send(conn, {**request, "cwd": os.getcwd(), "env": request.get("env", dict(os.environ))}, [0, 1, 2])
    return conn, _Lines(conn)


def _exit_barrier(barrier: str, node_rank: int, wait: bool) -> None:
    """Tell node 0's store this node's ranks ended; node 0 (``wait``) waits for every node's."""
    try:
        conn = _connect(barrier)
        _send(conn, {"done": node_rank})
        if wait:
            conn.settimeout(_EXIT_BARRIER)
            _Lines(conn).next()
        conn.close()
    except OSError:  # node 0 gone, or a node that never came: no barrier to wait at
        pass


def main() -> None:
    if sys.argv[1] == "--forks":
        request = serve(sys.argv[2], sys.argv[3:])
        _forked(request)
        (_store if request["kind"] == "store" else _rank)(request)
    else:  # --node ADDRESSES NNODES NODE_RANK PER_NODE HOST PORT [--statuses FILE] SCRIPT ARGS...
        _, _, addresses, nnodes, node_rank, per_node, host, port, *rest = sys.argv
        statuses = rest[1] if rest[0] == "--statuses" else None
        script, *args = rest[2:] if statuses else rest
        node(addresses.split(","), int(nnodes), int(node_rank), int(per_node), host, int(port), script, args, statuses)


if __name__ == "__main__":
    main()
