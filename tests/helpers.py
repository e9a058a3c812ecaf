"""Shared test helpers: tiny real models, a few real training steps, state fingerprints.

Importable from any test as ``helpers`` (pytest's ``pythonpath`` includes tests/)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from forked_nodes import ForkServers, node_command
from llmtailor.training_example import (
    TinyConfig,
    batch_at,
    build_model,
    build_optimizer,
)


def tiny(layers: int = 4, hidden: int = 32, family: str = "llama", tie: bool = False, seed: int = 0):
    """A tiny causal LM with HF-style AdamW groups and a LambdaLR schedule."""
    config = TinyConfig(
        hidden_size=hidden, layers=layers, heads=4, kv_heads=2, intermediate_size=2 * hidden,
        seq_len=32, tie_embeddings=tie, family=family,
    )
    model = build_model(config, seed=seed)
    optimizer, scheduler = build_optimizer(model, total_steps=50)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, tokens, steps, batch_size: int = 2, seq_len: int = 32) -> list[float]:
    losses = []
    for step in steps:
        batch = batch_at(tokens, step, batch_size, seq_len)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def unit_versions(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Clone of every parameter's weight and optimizer state, by parameter name."""
    out = {}
    for name, param in model.named_parameters():
        entry = {"weight": param.detach().clone()}
        for key, value in optimizer.state.get(param, {}).items():
            entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        out[name] = entry
    return out


# The documented bound (docs/training-loops.md, "Drift and Adaptive"): relative error of the sampled drift estimate vs
# the exact drift, for units whose tensors are larger than the sample.
WEIGHT_BOUND, MOMENTS_BOUND = 0.25, 0.6


def exact_drift(before: dict, now: dict, kind: str) -> float:
    """Exact relative L2 drift of a unit's tensors (by tensor key) of one kind, as
    ``llmtailor.drift`` defines it."""
    keys = [k for k in before if (k.startswith("weight/") if kind == "weight" else k.startswith("optim/") and not k.endswith("/step"))]
    diff = sum((now[k].double() - before[k].double()).square().sum() for k in keys)
    ref = sum(before[k].double().square().sum() for k in keys)
    return float((diff / ref) ** 0.5)


def assert_bitwise(actual: dict, expected: dict, where: str = "") -> None:
    assert actual.keys() == expected.keys(), f"{where}: keys differ"
    for name in expected:
        assert actual[name].keys() == expected[name].keys(), f"{where}{name}: state keys differ"
        for key, value in expected[name].items():
            got = actual[name][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), f"{where}{name}/{key} differs"
            else:
                assert got == value, f"{where}{name}/{key} differs"


def tree_digest(root: Path) -> dict[str, str]:
    """Path -> sha256 of every file below ``root``: to show nothing on disk changed."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def parity_run(path: Path, tokens, steps: int):
    """A run of a tiny model saved with Parity at steps 1..``steps`` (step 1 full, then odd and
    even layers in turn); returns ``path``."""
    from llmtailor import Parity, Tailor

    model, opt, sched = tiny()
    with Tailor(path, model, opt, sched, policy=Parity()) as tailor:
        for step in range(1, steps + 1):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    return path


def run_job(script: Path, args: list[str], result: Path, *, crash: bool = False, nproc: int = 1,
            launcher: list[str] | None = None) -> dict:
    """Run a job script as a fresh process (``nproc`` > 1: under torchrun, or ``launcher``, ``args``
    going to every rank) and return the JSON its rank 0 wrote to ``result``, with its stdout.
    ``crash=True``: it must have been SIGKILLed (a launcher then stops every rank and exits 1)."""
    if launcher is None and nproc > 1:
        launcher = standalone_launch(nproc)
    launch = [*(launcher or [sys.executable]), str(script)]
    status, stdout, stderr = run_launch([*launch, *args], {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    if crash:
        assert status == (-9 if launcher is None else 1), stderr[-3000:]
        return {}
    assert status == 0, stderr[-3000:]
    return {**json.loads(result.read_text()), "stdout": stdout}


def run_launch(command: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """``command`` run to its end: its exit status, stdout and stderr. One still running
    ``LAUNCH_WAIT`` seconds on fails the test with every process of it ended (``wait_launches``:
    a bound on a hang, not a timing; a launcher of several ranks is stopped so that it stops
    them, where a timeout's SIGKILL to it alone left its ranks running)."""
    launch = subprocess.Popen([str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    ((stdout, stderr),) = wait_launches([launch])
    return launch.returncode, stdout, stderr


def assert_composite_loaded(run, composite, live: dict[str, torch.Tensor]) -> None:
    """Every tensor of every unit ``composite`` names (``weight/...``, ``optim/...``) equals, bit
    for bit, its key in ``live`` (a job's dump of its model and optimizer after a resume)."""
    checked = 0
    for unit, source in composite.sources.items():
        tensors, _ = run.read_unit(source, unit)
        for key, tensor in tensors.items():
            assert torch.equal(live[key], tensor), f"{key} (from step {source})"
            checked += 1
    assert checked >= len([k for k in live if k.startswith("optim/")]) > 0



def assert_same_training_state(run, reference, step: int) -> None:
    """The composite of ``step`` in ``run`` holds, bit for bit, what ``reference``'s holds: every
    unit's weights and optimizer state, the optimizer groups, the LR scheduler and each rank's RNG
    streams (the same job trained once uninterrupted, once interrupted and resumed)."""
    mine, theirs = run.resolve(step), reference.resolve(step)
    assert mine.sources.keys() == theirs.sources.keys()
    for unit in theirs.sources:
        got, got_values = run.read_unit(mine.sources[unit], unit)
        want, want_values = reference.read_unit(theirs.sources[unit], unit)
        assert got.keys() == want.keys() and got_values == want_values, f"{unit} at step {step}"
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), f"{key} differs at step {step}"
    shared, expected = run.read_global(step), reference.read_global(step)
    for key in ("optimizer_groups", "lr_scheduler"):
        assert_same_tree(shared[key], expected[key], f"{key} at step {step}")
    for rank in range(reference.manifest(step).world_size):
        assert_same_tree(run.read_rank_state(step, rank)["rng"], reference.read_rank_state(step, rank)["rng"],
                         f"rank {rank}'s RNG streams at step {step}")



def assert_same_tree(a, b, where=""):
    """Two decoded state trees (dicts, lists, tuples, tensors, numpy arrays, scalars) are equal,
    tensors and arrays bit for bit with their dtypes; ``where`` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b) and a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def on_threads(count: int, work) -> list:
    """``work(rank)`` for ranks 0 to ``count - 1``, each on a thread of its own (ranks as threads,
    their coordinators over one c10d store): each rank's result, or what it raised."""
    outcomes: list = [None] * count

    def run(rank: int) -> None:
        try:
            outcomes[rank] = work(rank)
        except BaseException as err:  # what the rank raised is its outcome
            outcomes[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outcomes


def free_port() -> int:
    """A TCP port free on loopback now (for a launcher's rendezvous, a test server), below the
    range the kernel takes the local ports of outgoing connections from (``ip_local_port_range``;
    a port bound as 0 comes from there): every rank's gloo connections, store clients and HTTP
    clients on a busy machine take ports there, and one could take the port a server is about
    to bind (its launch then fails: "address already in use"). Below it, only another server
    asking for that very port can; one already there is passed over."""
    low = _outgoing_ports()[0]
    if low > 20000:
        for _ in range(100):
            port = random.SystemRandom().randrange(10000, low)  # not the seeded module generator
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _outgoing_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def standalone_launch(nproc: int) -> list[str]:
    """The command line that starts ``nproc`` ranks on this machine (``torchrun --standalone``),
    before the script and its arguments; ``node_launches`` starts several "nodes"."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def node_launches(script: Path, args_of, env_of, nodes: int = 2, per_node: int = 1, *, merged: bool = False,
                  own_session: bool = False, statuses_of=None) -> list[subprocess.Popen]:
    """``nodes`` "nodes" on loopback, each started as ``torchrun --nnodes N --node_rank i`` starts
    one, ``per_node`` ranks running ``script`` with ``args_of(node)`` in the environment
    ``env_of(node)`` (its own directories, TMPDIR...), meeting on one free port; each rank forked
    from an interpreter that imported torch and llmtailor once (forked_nodes.py: what the tests
    depend on in torchrun's agents, it keeps). Their output is piped (stderr into stdout with
    ``merged``); ``own_session``: each launch in a session of its own, so that a test can kill a
    whole node; ``statuses_of(node)``: the file of each node's ranks' exit statuses, every rank
    running to its end (``forked_nodes.node_command``). Wait for them with ``wait_launches``."""
    port, addresses = free_port(), FORK_SERVERS.addresses(nodes * per_node)
    return [subprocess.Popen(
        [*node_command(addresses, nodes, node, per_node, "127.0.0.1", port, statuses_of and statuses_of(node)),
         str(script), *map(str, args_of(node))],
        env=env_of(node), stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True,
        start_new_session=own_session,
    ) for node in range(nodes)]


FORK_SERVERS = ForkServers()
"""The fork servers of ``node_launches`` (forked_nodes.py), ended after the last test of
tests/distributed/ (its conftest.py)."""


LAUNCH_WAIT = 1200.0
"""Seconds a test waits for launches of real processes (``wait_launches``) before it ends them
and fails: the bound on a hang, never a timing asserted."""


def wait_launches(launches: list[subprocess.Popen], timeout: float = LAUNCH_WAIT) -> list[tuple[str, str | None]]:
    """Each launch's ``(stdout, stderr)`` once every one has ended (stderr None where the launch
    merged it into stdout). A launch still running ``timeout`` seconds on (a rank holds or waits
    for one that died) fails the test, every launch ended (``end_launches``), with what each wrote."""
    # Every launch's pipes read in turn, a short while each, not one launch to its end before the
    # next: a launch waiting for another (two nodes of one job) never ends while that one is held
    # writing into a full pipe nobody reads (64 KiB: its ranks' tracebacks and warnings).
    deadline, outputs = time.monotonic() + timeout, {}
    while len(outputs) < len(launches):
        for i, launch in enumerate(launches):
            if i in outputs:
                continue
            try:
                outputs[i] = launch.communicate(timeout=_READ_TURN)  # output read before a timeout is kept
            except subprocess.TimeoutExpired:
                if time.monotonic() < deadline:
                    continue
                left = [n for n in range(len(launches)) if n not in outputs]
                ended = dict(zip(left, end_launches([launches[n] for n in left])))
                tails = [_tail(*outputs[n]) if n in outputs else ended[n] for n in range(len(launches))]
                raise AssertionError(f"launch {i} did not end within {timeout:g} s; every launch ended, their output:\n\n"
                                     + "\n\n".join(f"launch {n}: {tail}" for n, tail in enumerate(tails))) from None
    return [outputs[i] for i in range(len(launches))]


def launches_ended_well(launches: list[subprocess.Popen], outputs: list[str]) -> None:
    """Fail the test unless every launch (ended, ``outputs`` its text) exited 0: the message holds
    each failed launch's tail, then, last (where a short view of a long log shows it), each one's
    final error lines (its ranks' exceptions)."""
    codes = [launch.returncode for launch in launches]
    failed = [n for n, code in enumerate(codes) if code != 0]
    if not failed:
        return
    import pytest  # here only: the job scripts that import this module (their ranks) need not pay for it

    tails = "\n\n".join(f"launch {n}: {_tail(outputs[n], None)}" for n in failed)
    errors = "\n".join(f"launch {n} (exit {codes[n]}): {line}" for n in failed for line in _error_lines(outputs[n]))
    pytest.fail(f"{tails}\n\nexit codes {codes}; the failed launches' errors:\n{errors or '(none printed)'}", pytrace=False)


def _error_lines(output: str, most: int = 4) -> list[str]:
    """The last ``most`` distinct lines of ``output`` that name an exception (``SomeError: ...``)."""
    found: list[str] = []
    for line in reversed(output.splitlines()):
        text = line.split("]:", 1)[-1].strip()  # torchrun's "[rank0]:" prefix
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Stopped)\b", text) and text[:300] not in found:
            found.append(text[:300])
            if len(found) == most:
                break
    return found[::-1]


_READ_TURN = 0.5
"""Seconds ``wait_launches`` reads one launch's pipes before it turns to the next."""


def end_launches(launches: list[subprocess.Popen], grace: float = 60.0) -> list[str]:
    """End each launch still running and return the tail of what each wrote (stdout, then
    stderr), for a failure's message, in bounded time; call it on launches not waited for yet.
    Each is sent SIGTERM first: a torchrun agent then ends its workers, each of which runs in a
    session of its own (a SIGKILL to the agent alone would leave them running, holding the pipes
    open); what is left ``grace`` seconds on is SIGKILLed (the launch's process group where it
    runs in a session of its own), and what a surviving worker still holds open is not waited for."""
    for launch in launches:
        if launch.poll() is None:
            launch.terminate()
    tails = []
    for launch in launches:
        try:
            out, err = launch.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            _kill(launch)
            try:
                out, err = launch.communicate(timeout=grace)
            except subprocess.TimeoutExpired as late:  # what came before a surviving worker went quiet
                out, err = late.output, late.stderr
        tails.append(_tail(out, err))
    return tails


def _kill(launch: subprocess.Popen) -> None:
    try:
        if os.getpgid(launch.pid) == launch.pid:  # a session of its own: its whole group
            os.killpg(launch.pid, signal.SIGKILL)
        else:
            launch.kill()
    except ProcessLookupError:
        pass


def _tail(out: str | bytes | None, err: str | bytes | None, chars: int = 5000) -> str:
    def text(part: str | bytes) -> str:
        return part.decode(errors="replace") if isinstance(part, bytes) else part

    return "\n".join(text(part)[-chars:] for part in (out, err) if part)


def read_unit_index(snapshot: Path, unit: str) -> dict:
    """The index of ``unit`` in the snapshot directory ``snapshot``, as JSON, every chunk with
    its file, offsets and shape: its line of the snapshot's ``indexes.json`` (schema 6), or its
    own file (before)."""
    from llmtailor.constants import MANIFEST_FILE

    ref = json.loads((snapshot / MANIFEST_FILE).read_text())["units"][unit]
    raw = (snapshot / ref["index"]["path"]).read_bytes()
    if "index_at" in ref:
        raw = raw[ref["index_at"]:ref["index_at"] + ref["index"]["bytes"]]
    index = json.loads(raw)
    for tensor in index["tensors"]:  # schema 6 omits a chunk's defaults: spelled out here
        for chunk in tensor["chunks"]:
            chunk.setdefault("file", 0)
            if "offsets" not in chunk and "shape" not in chunk:
                chunk.update(offsets=[0] * len(tensor["shape"]), shape=list(tensor["shape"]))
    return index


def unit_index_lines(manifest: dict, raw: bytes) -> dict[str, bytes]:
    """The lines of a schema-6 snapshot's ``indexes.json`` (``raw``), by unit, in file order."""
    refs = manifest["units"]
    return {u: raw[refs[u]["index_at"]:refs[u]["index_at"] + refs[u]["index"]["bytes"]]
            for u in sorted(refs, key=lambda u: refs[u]["index_at"])}


def indexes_rewritten(manifest: dict, raw: bytes, lines: dict[str, bytes], rehash: bool = True) -> bytes:
    """A schema-6 snapshot's ``indexes.json`` (``raw``) with the lines of ``lines`` (by unit)
    replaced; with ``rehash``, ``manifest`` (JSON, changed in place) records every line's new
    place, size and checksum and the file's, so every checksum still holds."""
    import xxhash

    def entry(data: bytes) -> dict:
        return {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}

    refs = manifest["units"]
    texts = {**unit_index_lines(manifest, raw), **lines}
    whole = b"".join(texts.values())
    if rehash:
        at = 0
        for unit, text in texts.items():
            refs[unit].update(index_at=at, index={**refs[unit]["index"], **entry(text)})
            at += len(text)
        path = next(iter(refs.values()))["index"]["path"]
        next(f for f in manifest["files"] if f["path"] == path).update(entry(whole))
    return whole


def forge_unit_index(snapshot: Path, unit: str, index: dict) -> None:
    """Replace the index of ``unit`` in ``snapshot`` with ``index``, recording the new sizes and
    checksums in the manifest (of the unit's line and of ``indexes.json``, in schema 6; of its
    own index file before), so every checksum still holds."""
    import xxhash

    from llmtailor.constants import MANIFEST_FILE

    manifest = json.loads((snapshot / MANIFEST_FILE).read_text())
    ref = manifest["units"][unit]
    text = json.dumps(index, separators=(",", ":")).encode()
    path = snapshot / ref["index"]["path"]
    if "index_at" not in ref:
        path.write_bytes(text)
        ref["index"].update(bytes=len(text), xxh3_64=xxhash.xxh3_64_hexdigest(text))
    else:
        path.write_bytes(indexes_rewritten(manifest, path.read_bytes(), {unit: text + b"\n"}))
    (snapshot / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


def drop_from_unit_index(run_dir: Path, step: int, unit: str, key: str) -> None:
    """Forge the snapshot of ``step`` so that its version of ``unit`` lacks the tensor ``key``:
    the key leaves the unit's index (its file keeps the bytes), and the manifest records the
    index's new size and checksum, so every checksum still holds."""
    from llmtailor.store.run import Run

    snapshot = Run(run_dir).snapshot_dir(step)
    index = read_unit_index(snapshot, unit)
    kept = [t for t in index["tensors"] if t["key"] != key]
    assert len(kept) == len(index["tensors"]) - 1, f"{unit} at step {step} holds no {key}"
    index["tensors"] = kept
    forge_unit_index(snapshot, unit, index)


def unit_file(run_dir: Path, step: int, unit: str) -> Path:
    """The tensor file the snapshot of ``step`` holds ``unit`` in (as its index names it): the
    unit's own file, or the pack file it shares with the snapshot's other small units."""
    from llmtailor.store.run import Run

    snapshot = Run(run_dir).snapshot_dir(step)
    index = read_unit_index(snapshot, unit)
    return snapshot / index["files"][0]["path"]


def file_rank(path: str) -> int:
    """The rank that wrote a snapshot's tensor file: ``units/<unit>.rank-R.safetensors`` or the
    pack ``packs/rank-R.K.safetensors``."""
    return int(re.search(r"rank-(\d+)", path).group(1))


def unit_chunk_middle(run, step: int, unit: str, rank: int | None = None) -> tuple[object, str, int]:
    """``(storage, key, offset)``: the file holding the first chunk of ``unit`` at ``step`` (the
    first chunk ``rank`` wrote, if given) and where in it the middle of that chunk's bytes lies
    (in a pack file, the bytes of that unit, not of another's). ``run``: a ``Run``, local or not."""
    from llmtailor.store.keys import piece_key
    from llmtailor.store.tensor_files import parse_header

    entry = run.unit_entry(step, unit)
    tensor, chunk = next((t, c) for t in entry.tensors for c in t.chunks
                         if rank is None or file_rank(entry.files[c.file].path) == rank)
    storage, key = run.file_location(step, entry.files[chunk.file])
    start, header = parse_header(lambda at, length: bytes(storage.read_range(key, at, length)), storage.size(key),
                                 storage.where(key))
    begin, end = header[piece_key(tensor.key, chunk.offsets, chunk.shape == tensor.shape)]["data_offsets"]
    return storage, key, start + (begin + end) // 2


def flip_unit_byte(run_dir: Path, step: int, unit: str, rank: int | None = None) -> Path:
    """Flip one bit in the middle of the bytes of ``unit``'s first chunk (the first ``rank``
    wrote, if given) in its file (``unit_chunk_middle``) of a local run; return the file's path."""
    from llmtailor.store.run import Run

    run = Run(run_dir)
    _, key, at = unit_chunk_middle(run, step, unit, rank)
    path = run.root / key
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def snapshot_files(run, step: int) -> dict[str, bytes]:
    """Path (relative to the snapshot) -> bytes of every file of ``run``'s snapshot of ``step``."""
    root = run.snapshot_dir(step)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_snapshots(a, b, steps) -> None:
    """Runs ``a`` and ``b`` hold the same snapshots of ``steps``, file for file (the manifests
    equal but for their creation time)."""
    from llmtailor.constants import MANIFEST_FILE

    for step in steps:
        files_a, files_b = snapshot_files(a, step), snapshot_files(b, step)
        assert files_a.keys() == files_b.keys(), f"step {step}"
        for name in files_a:
            if name == MANIFEST_FILE:
                manifest_a, manifest_b = json.loads(files_a[name]), json.loads(files_b[name])
                manifest_a.pop("created"), manifest_b.pop("created")
                assert manifest_a == manifest_b, f"step {step}: {name}"
            else:
                assert files_a[name] == files_b[name], f"step {step}: {name}"


def save_bin(path: Path, model, shards: int = 1) -> None:
    """``model`` as transformers 4's ``save_pretrained(safe_serialization=False)`` wrote it (5
    writes safetensors only): ``torch.save`` of the whole state dict (tied names both in it, one
    storage), in ``shards`` files with their ``pytorch_model.bin.index.json`` when more than one."""
    model.config.save_pretrained(path)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return
    keys, weight_map = list(state), {}
    per = -(-len(keys) // shards)
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: state[k] for k in keys[i * per:(i + 1) * per]}, path / name)
        weight_map.update({k: name for k in keys[i * per:(i + 1) * per]})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def landed(packed, source, into):
    """What a courier's receive makes of ``source``'s ``packed`` files (``Courier.exchange_packed``):
    with an ``into`` that asks for buffers, the bytes copied into them, as gloo's receives
    would; else the packed files as they are."""
    from llmtailor.distributed.courier import unpacked

    buffers = into(source, packed[0]) if into is not None else None
    if buffers is None:
        return packed
    for buffer, (_, data) in zip(buffers, unpacked(packed)):
        if len(data):
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return packed[0], buffers


def relayed(store, rank: int, lane: str = "") -> int:
    """How many times a wait of ``rank`` (coordinators ``over`` ``store``) in ``lane`` saw a rank
    it waited for progress."""
    from llmtailor.distributed.coordinator import _RELAY

    return store.add(f"llmtailor/0/beat/{rank}" + (f"/{lane}" if lane else ""), 0) // _RELAY


def progressing(store, waiters: list[int], looks: int, gave_up: list[int], lane: str | None = None) -> None:
    """Long, live work of a rank (a large load, a slow disk): progress (``advance``) until every
    rank of ``waiters`` saw it ``looks`` more times (a wait that saw it waits on), or a rank gave
    up (``gave_up``); the rank shows it where it is inside ``Coordinator.working`` (to the waits
    of that block's lane: ``current_lane``; ``lane``: the waits of that lane, for work on a
    thread of its own that a block counts as its own, ``working(*also)``)."""
    from llmtailor.distributed.coordinator import current_lane
    from llmtailor.distributed.progress import advance

    lane = current_lane() if lane is None else lane
    before = {rank: relayed(store, rank, lane) for rank in waiters}
    while min(relayed(store, rank, lane) - before[rank] for rank in waiters) < looks and not gave_up:
        advance()
        time.sleep(0.01)


def failing_fsync_of(monkeypatch, directory: Path, once_renamed: Path) -> list[str]:
    """Make the first fsync of ``directory`` once ``once_renamed`` exists (after a commit's rename
    of it) fail with EIO, on the save's thread or a helper's but the purger's (retention's own);
    returns the list the failed fsync's path is appended to."""
    real, failed = os.fsync, []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        if (not failed and path == str(directory) and once_renamed.exists()
                and threading.current_thread().name != "llmtailor-purge"):
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return failed


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (``/proc``'s state ``T``): ``kill`` returns
    before every thread of it has stopped, and a request sent meanwhile could still be answered."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(1000):
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s of its SIGSTOP")


@contextmanager
def stopped_store(timeout: float = 1.0) -> Iterator[tuple[object, int]]:
    """A client (its own ``timeout``) of a real TCPStore served by a process of its own, and
    that process's id: ``os.kill(pid, signal.SIGSTOP)`` makes the store stop answering as one on
    a partitioned host does (the kernel still takes the bytes; no answer, no reset). Its server
    goes on (SIGCONT) and ends as the block ends."""
    import datetime

    from torch.distributed import TCPStore

    server = subprocess.Popen([sys.executable, "-c", "import datetime, sys, torch.distributed as d\n"
                               "s = d.TCPStore('127.0.0.1', 0, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False)\n"
                               "print(s.port, flush=True)\nsys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(server.stdout.readline())
        yield TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=timeout)), server.pid
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
