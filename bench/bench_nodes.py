"""Two "nodes" saving at every step to node-local memory tiers with replicas on the partner node,
side by side with no checkpointing and with ``dcp.async_save`` every step; then recovery after
losing a node, from the partner's memory vs from the object store.

    .venv/bin/python bench/bench_nodes.py              # about 6 minutes
    .venv/bin/python bench/bench_nodes.py --quick      # smoke run, about 2 minutes

Two ``torchrun --nnodes 2 --node_rank i --nproc_per_node 1`` launches on loopback (each its own
memory directory under /dev/shm and its own TMPDIR; nothing shared but moto's S3 server, the
durable tier) train one DDP model (a Llama-style ``transformers.LlamaConfig``, fp32, never
downloaded; AdamW; real text from ``pydoc_data.topics``), training held to one thread per
rank (``torch.set_num_threads(1)``); with ``--device cuda`` both ranks train on the one GPU
(DDP over gloo), a GPU machine's premise: steps on the GPU, idle host cores for the saves. Every contender starts from the same weights and optimizer
state (reset between contenders), makes its set-up save and trains one step to settle, then
``--steps`` measured steps, each timed with the save call that follows it; ``--rounds`` repeats
the line-up, every other round reversed. The figure of merit is the measured steps' total time
against ``none``'s (target for ours: < 5% slower).

Contenders: ``none``; ``dcp.async_save`` (torch.distributed.checkpoint of the full state after
every step into each node's memory directory; at most one in flight; the newest two kept);
``ours nodes Parity`` (``Tailor(s3://..., async_save=True, async_in_flight=--in-flight, policy=Parity(), tiers=[Tier(<node's
/dev/shm dir>, scope="node", replicas=2, keep=2, promote_every=--every)])``: each save commits
once both nodes hold both nodes' parts; the durable tier is the S3 run, promoted in the
background). Network bytes per save: what this rank's courier sent against this node's parts x
(replicas - 1) (target: 1.00). Per node and contender, beside the wall times: the process's CPU
seconds per measured step, every thread (``getrusage``, up to the end of the last save's background
work), and the threads started per step; for ours, per save, the training thread's CPU inside
the save call (``time.thread_time``) and the background thread's; figures that move less with the
machine's load.

With ``LLMTAILOR_BENCH_SAVE_PROFILE=PATH`` in the environment, each node's launch profiles its
async saves on the threads that run them: the background thread's CPU per function
(``cProfile`` on ``time.thread_time``, every save of every round, summed) into
``PATH.<node>``, and the save calls on the training thread into ``PATH.<node>.calls``
(``python -m pstats PATH.0``, then ``sort tottime``, ``stats 20``).

Recovery: after the last round, the newest composite of ours is in both nodes' memory and in
S3. Node 1's memory is wiped and both launches restart (a fresh process's optimizer: no state
until the restore makes it, as in a relaunched job): a restore takes the composite from memory, node 1 receiving its parts from node 0 (``from memory``). Then both nodes' memory is
wiped and both restart: the same composite from S3 (``from S3``). ``--restores`` times each,
alternately; the restore's time is the slowest rank's ``Tailor.restore`` (a healed node's copy
is written and committed in the background meanwhile: the time until every node's copy is
committed is printed beside it). The two restored
states must be equal (a digest of every weight and optimizer tensor). After each restore, out of
its time, every rank trains a step and each node's leader verifies its node's copy (``Run.verify``):
a copy that fails (a healed one training wrote into) ends the bench before its figure is printed.
Target: from memory >= 5x faster. ``--lanes N`` (repeatable) adds this checkout's restore from
memory with the courier's lanes at N (``LLMTAILOR_COURIER_LANES``; the default is 4) to the
alternation, against this checkout's S3 restores: on a host with cores to spare, the stream's
lanes are what bounds the restore from memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHM = Path("/dev/shm")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step and rank")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the model trains (cuda: both nodes' ranks on the one GPU, DDP over gloo)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per contender and round")
    parser.add_argument("--every", type=int, default=10, help="promote_every of the node tier")
    parser.add_argument("--in-flight", type=int, default=2, choices=[1, 2], help="async_in_flight of ours")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks per node (each launch's --nproc_per_node; a real node runs 8): with 2, the "
                             "replacement node's second rank restores beside its leader, which alone receives")
    parser.add_argument("--restores", type=int, default=2, help="restore trials per way (0: the saves alone)")
    parser.add_argument("--quick", action="store_true", help="a small model, few steps")
    parser.add_argument("--only", choices=["recovery"],
                        help="recovery: train only ours (--steps steps, one round) to have a composite, no comparison")
    parser.add_argument("--against", type=Path, action="append", default=[],
                        help="another checkout whose llmtailor also restores, alternated with this one's (repeatable)")
    parser.add_argument("--lanes", type=int, action="append", default=[],
                        help="this checkout's restore from memory again with the courier's lanes at this count "
                             "(LLMTAILOR_COURIER_LANES), alternated with the others; its ratio against this "
                             "checkout's S3 restores (repeatable)")
    parser.add_argument("--profile", action="store_true", help="cProfile each restore; the top of it printed")
    parser.add_argument("--phases", action="store_true",
                        help="time each restore's phases per node (wall and thread CPU, calls), with byte and message counts")
    parser.add_argument("--worker", choices=["train", "restore"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.steps, args.rounds, args.restores, args.every = 2, 128, 6, 1, 1, 3
    if args.only == "recovery":
        args.rounds = 1
    return args


# -- the launcher ------------------------------------------------------------------------------


def launch(args: argparse.Namespace, role: str, root: Path, url: str, env: dict[str, str],
           code: Path = HERE.parent) -> list[dict]:
    """Both nodes' launches of this script as ``role``, importing llmtailor from ``code``; each
    rank's result, in rank order."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    forwarded = [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--vocab={args.vocab}", f"--seq={args.seq}",
                 f"--batch={args.batch}", f"--device={args.device}",
                 f"--steps={args.steps}", f"--every={args.every}", f"--rounds={args.rounds}", f"--in-flight={args.in_flight}",
                 f"--nproc-per-node={args.nproc_per_node}",
                 *(["--only=recovery"] if args.only else []), *(["--profile"] if args.profile else []),
                 *(["--phases"] if args.phases else [])]
    nodes = []
    for node in range(2):
        tmp = root / f"node{node}" / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", str(args.nproc_per_node), "--master_addr", "127.0.0.1", "--master_port", str(port), __file__,
             f"--worker={role}", f"--root={root}", f"--url={url}", *forwarded],
            env={**env, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{code}:{HERE}"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=3600)[0] for p in nodes]
    if any(p.returncode for p in nodes):
        raise SystemExit("a node failed:\n" + "\n\n".join(out[-3000:] for out in outputs))
    return [json.loads((root / f"node{node}" / f"{role}-{local}.json").read_text())
            for node in range(2) for local in range(args.nproc_per_node)]


def memory(node: int) -> Path:
    return SHM / f"llmtailor-bench-nodes-{os.getpid()}" / f"node{node}"


def main() -> None:
    args = arguments()
    if args.worker:
        return worker(args)
    import moto
    import torch

    from bench_object_store import new_bucket, start_server

    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs; Python {platform.python_version()}, torch "
          f"{torch.__version__}, moto {moto.__version__}; 2 launches x {args.nproc_per_node} rank(s), gloo, training at 1 thread"
          + (f" on {torch.cuda.get_device_name()} (both ranks)" if args.device == "cuda" else ""))
    server, endpoint = start_server()
    root = Path(os.environ.get("BENCH_OUT", HERE / "out")) / "nodes"
    shutil.rmtree(root, ignore_errors=True)
    try:
        url = f"s3://{new_bucket()}/nodes"
        env = {**os.environ, "LLMTAILOR_BENCH_SHM": str(memory(0).parent)}
        trained = launch(args, "train", root, url, env)
        if args.only is None:
            report_training(trained, args)
        print(f"\nstate: {trained[0]['params'] / 1e6:.1f} M parameters; weights + optimizer state {trained[0]['composite_bytes'] / 1e6:.1f} MB per rank")
        codes = {"": (HERE.parent, {}), **{f" [{path}]": (path, {}) for path in args.against},
                 **{f" [lanes {count}]": (HERE.parent, {"LLMTAILOR_COURIER_LANES": str(count)}) for count in args.lanes}}
        ways = {label: ("from memory",) if lanes else ("from memory", "from S3") for label, (_, lanes) in codes.items()}
        restores = {f"{way}{label}": [] for label in codes for way in ways[label]}
        digests: set[str] = set()
        kept = root / "memory-as-trained"  # each trial starts from the nodes' memory as training left it
        shutil.copytree(memory(0).parent, kept)
        for trial in range(args.restores):
            order = list(codes.items()) if trial % 2 == 0 else list(reversed(codes.items()))
            for way in ("from memory", "from S3"):
                for label, (code, lanes) in order:
                    if way not in ways[label]:
                        continue
                    shutil.rmtree(memory(0).parent, ignore_errors=True)
                    shutil.copytree(kept, memory(0).parent)
                    shutil.rmtree(memory(1), ignore_errors=True)  # node 1 lost: a replacement with empty memory
                    if way == "from S3":
                        shutil.rmtree(memory(0), ignore_errors=True)
                    results = launch(args, "restore", root, url, {**env, **lanes}, code)
                    name = f"{way}{label}"
                    corrupted = {rank: r["problems"] for rank, r in enumerate(results) if r.get("problems")}
                    if corrupted:  # no figure for a restore that left a node's copy failing its checksums
                        raise SystemExit(f"{name}: a node's copy fails verification once a step trained after the "
                                         f"restore (by rank): {corrupted}")
                    restores[name].append(max(r["seconds"] for r in results))
                    digests |= {r["digest"] for r in results}
                    print(f"  {name}: {restores[name][-1]:.3f} s (every node's copy committed at "
                          f"{max(r['committed'] for r in results):.3f} s), tier {results[0]['tier']}; {results[-1]['said']}; "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
                    for rank, result in enumerate(results):
                        node = rank // args.nproc_per_node
                        if result.get("profile"):
                            print(f"--- node {node} rank {rank} profile ---\n{result['profile']}")
                        if result.get("phases"):
                            print(f"--- node {node} rank {rank} phases ---\n{result['phases']}")
        for label in codes if args.restores else ():  # a count of lanes against this checkout's S3 restores
            report_restores({"from memory": restores[f"from memory{label}"],
                             "from S3": restores[f"from S3{label if 'from S3' in ways[label] else ''}"]}, label)
        if args.restores:
            print(f"restored states equal: {len(digests) == 1}")
    finally:
        server.terminate()
        shutil.rmtree(memory(0).parent, ignore_errors=True)


def report_training(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nmodel: {results[0]['params'] / 1e6:.1f} M parameters ({args.layers} layers, hidden {args.hidden}; "
          f"{args.batch} x {args.seq} tokens per step and rank, on {args.device}), "
          f"{args.steps} measured steps x {args.rounds} round(s), save after every step")
    totals = {name: [max(r["totals"][name][i] for r in results) for i in range(args.rounds)] for name in results[0]["totals"]}
    none = statistics.median(totals["none"])
    print(f"{'contender':<22}{'seconds (median)':>18}{'vs none':>10}{'slower':>9}")
    for name, seconds in totals.items():
        median = statistics.median(seconds)
        print(f"{name:<22}{median:>18.3f}{median / none:>9.3f}x{100 * (median / none - 1):>8.1f}%")
    for node, result in enumerate(results):
        shown = ", ".join(f"{name} {statistics.median(seconds):.3f} s" for name, seconds in result.get("calls", {}).items())
        fences = result.get("fence") or [0.0]
        print(f"node {node}: the save calls' seconds per round (median; part of the totals above): {shown}; "
              f"optimizer.step waiting for ours' copies: total {sum(fences):.3f} s over {len(fences)} steps")
    for node, result in enumerate(results):
        if "cpu" not in result:
            continue
        per_step = {name: statistics.median(cpu) / args.steps for name, cpu in result["cpu"].items()}
        shown = ", ".join(f"{name} {1e3 * seconds:.1f} ms" for name, seconds in per_step.items())
        threads = ", ".join(f"{name} {statistics.median(n) / args.steps:.1f}" for name, n in result["started"].items())
        print(f"node {node}: the process's CPU per measured step, every thread, up to the last save's end (median): "
              f"{shown}; threads started per step: {threads}")
    for node, result in enumerate(results):
        sent, parts = result["sent_bytes"], result["part_bytes"]
        print(f"node {node}: courier sent {sent / 1e6:.2f} MB for {result['saves']} saves whose own parts were "
              f"{parts / 1e6:.2f} MB: sent / (parts x (replicas - 1)) = {sent / parts:.4f}")
        waits, cpu = result.get("settle") or [0.0], result.get("persist_cpu") or [0.0]
        calls = result.get("call_cpu") or [0.0]
        print(f"node {node}, ours per save: training thread waiting for the saves before (Tailor._settle) median "
              f"{1e3 * statistics.median(waits):.1f} ms, total {sum(waits):.3f} s over {len(waits)} saves; training thread "
              f"CPU in the save call (Tailor.save, settling included) median {1e3 * statistics.median(calls):.2f} ms over "
              f"{len(calls)} calls; background thread CPU (copies + persist) median {1e3 * statistics.median(cpu):.1f} ms "
              f"over {len(cpu)} saves")


def report_restores(restores: dict[str, list[float]], label: str) -> None:
    memory_s, s3_s = statistics.median(restores["from memory"]), statistics.median(restores["from S3"])
    shown = lambda way: ", ".join(f"{s:.3f}" for s in restores[way])  # noqa: E731
    print(f"\nrecovery after losing node 1{label}: from the partner's memory {memory_s:.3f} s ({shown('from memory')}), "
          f"from S3 {s3_s:.3f} s ({shown('from S3')}): {s3_s / memory_s:.1f}x faster (target >= 5x)")


# -- the workers -------------------------------------------------------------------------------


class Training:
    """This rank's model (DDP), optimizer and data, resettable to the state it started in;
    ``settled``: one step trained (the optimizer's state made), else a fresh process's optimizer,
    as a relaunched job's is when it restores."""

    def __init__(self, args: argparse.Namespace, settled: bool = True):
        import copy

        import torch
        from torch.nn.parallel import DistributedDataParallel

        from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens

        config = TinyConfig(hidden_size=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                            intermediate_size=int(3.5 * args.hidden), seq_len=args.seq, vocab_size=args.vocab)
        self.device = torch.device(args.device)
        self.model = DistributedDataParallel(build_model(config, seed=0).to(self.device))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.tokens, self.seq, self.batch, self.batch_at, self.step = corpus_tokens(), args.seq, args.batch, batch_at, 0
        if settled:
            self.train(1)  # optimizer state exists from here on
        self.start = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict()))

    def reset(self) -> None:
        self.model.load_state_dict(self.start[0])
        self.optimizer.load_state_dict(self.start[1])
        self.step = 0

    def train(self, count: int) -> None:
        import torch.distributed as dist

        for _ in range(count):
            self.step += 1
            batch = self.batch_at(self.tokens, self.step * dist.get_world_size() + dist.get_rank(), self.batch, self.seq)
            batch = batch.to(self.device)
            self.model(input_ids=batch, labels=batch).loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        """Wait for the steps queued on the GPU (a no-op on the CPU), so a clock reads their end."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()


def ours(training: Training, args: argparse.Namespace, round_: int):
    """Our Tailor of round ``round_``: its run in S3, its node tier in this node's memory."""
    from llmtailor import Parity, Tailor, Tier

    return Tailor(f"{args.url}/round{round_}", training.model, training.optimizer, policy=Parity(), async_save=True,
                  async_in_flight=args.in_flight, tiers=[Tier(node_memory(round_), scope="node", replicas=2, keep=2, promote_every=args.every)])


def node_memory(round_: int) -> Path:
    """This node's memory tier of ``round_`` (ours)."""
    return Path(os.environ["LLMTAILOR_BENCH_SHM"]) / f"node{os.environ['GROUP_RANK']}" / f"round{round_}"


def courier_bytes(tailor) -> int:
    return tailor.tiers.placement.courier.sent_bytes


def process_cpu() -> float:
    """CPU seconds of this process so far, every thread (user + system)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def instrumented() -> dict[str, list[float]]:
    """Per async save of ours: the seconds the training thread waited in ``Tailor._settle`` for
    the saves before (``settle``), and the CPU seconds of the save's background thread
    (``time.thread_time`` around ``AsyncStager._run``: copies, persist, follow-up): figures that
    move less with the machine's load than the wall time. Wraps the two methods, whatever their
    arguments (the same in the trees compared)."""
    from llmtailor.async_stager import AsyncStager
    from llmtailor.tailor import Tailor

    figures: dict[str, list[float]] = {"settle": [], "persist_cpu": [], "fence": [], "call_cpu": []}

    def timed(method, clock, key: str):
        def wrapper(self, *args, **kwargs):
            start = clock()
            try:
                return method(self, *args, **kwargs)
            finally:
                figures[key].append(clock() - start)

        return wrapper

    import threading

    real_start = threading.Thread.start

    def counted_start(thread):
        figures.setdefault("started", []).append(thread.name)
        return real_start(thread)

    threading.Thread.start = counted_start  # threads started, by name (``started``)
    Tailor._settle = timed(Tailor._settle, time.perf_counter, "settle")
    AsyncStager._run = timed(AsyncStager._run, time.thread_time, "persist_cpu")
    Tailor.save = timed(Tailor.save, time.thread_time, "call_cpu")  # the training thread's CPU in each save call
    if os.environ.get("LLMTAILOR_BENCH_SAVE_PROFILE"):  # each save's background thread, its CPU per function
        import atexit
        import cProfile
        import pstats

        profiles: list = []
        run = AsyncStager._run

        def profiled(self, *args, **kwargs):
            profiler = cProfile.Profile(time.thread_time)
            profiles.append(profiler)
            profiler.runcall(run, self, *args, **kwargs)

        AsyncStager._run = profiled
        calls = cProfile.Profile(time.thread_time)
        Tailor.save = lambda self, *args, _save=Tailor.save, **kwargs: calls.runcall(_save, self, *args, **kwargs)

        @atexit.register
        def dump() -> None:
            stats = pstats.Stats(profiles[0])
            for profiler in profiles[1:]:
                stats.add(profiler)
            where = f"{os.environ['LLMTAILOR_BENCH_SAVE_PROFILE']}.{os.environ['GROUP_RANK']}"
            stats.dump_stats(where)
            calls.dump_stats(f"{where}.calls")
    AsyncStager._fence = timed(AsyncStager._fence, time.perf_counter, "fence")
    return figures


def train_worker(args: argparse.Namespace, own: Path, suffix: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    training = Training(args)
    figures = instrumented()
    dcp_group = dist.new_group(backend="gloo")  # DCP's collectives run on its thread: not on DDP's group
    shm = Path(os.environ["LLMTAILOR_BENCH_SHM"]) / f"node{os.environ['GROUP_RANK']}"
    totals: dict[str, list[float]] = {"none": [], "dcp.async_save": [], "ours nodes Parity": []}
    if args.only == "recovery":
        totals = {"ours nodes Parity": []}
    sent = parts = saves = 0
    waits: list[float] = []
    calls: dict[str, list[float]] = {name: [] for name in totals}  # per round: the save calls' seconds
    fences: list[float] = []
    cpu: dict[str, list[float]] = {name: [] for name in totals}  # per round: the process's CPU seconds, every thread
    started: dict[str, list[int]] = {name: [] for name in totals}  # per round: threads started
    for round_ in range(args.rounds):
        for name in (list(totals) if round_ % 2 == 0 else list(reversed(totals))):
            training.reset()
            tailor = ours(training, args, round_) if name.startswith("ours") else None
            pending, reports, dcp_dirs = None, [], []

            def save(step: int) -> None:
                nonlocal pending
                if tailor is not None:
                    reports.append(tailor.save(step))
                elif name == "dcp.async_save":
                    if pending is not None:
                        pending.result()
                    model_sd, optim_sd = get_state_dict(training.model, training.optimizer)
                    dcp_dirs.append(shm / "dcp" / f"step-{step}")
                    pending = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_dirs[-1]),
                                             process_group=dcp_group)
                    if len(dcp_dirs) > 2:
                        shutil.rmtree(dcp_dirs.pop(0), ignore_errors=True)

            save(0)  # the set-up save
            if tailor is not None:
                tailor.wait()
            training.train(1)
            sent_before = courier_bytes(tailor) if tailor is not None else 0
            training.synchronize()
            dist.barrier()
            start = time.perf_counter()
            settled, fenced, in_calls = len(figures["settle"]), len(figures["fence"]), 0.0
            cpu_start, threads_before = process_cpu(), len(figures.get("started", []))
            for step in range(2, args.steps + 2):
                training.train(1)
                called = time.perf_counter()
                save(step)
                in_calls += time.perf_counter() - called
            training.synchronize()
            totals[name].append(time.perf_counter() - start)
            calls[name].append(in_calls)
            waits += figures["settle"][settled:]  # one per measured save (ours only)
            fences += figures["fence"][fenced:]
            if tailor is not None:
                tailor.wait()
                sent += courier_bytes(tailor) - sent_before
                parts += sum(r.result().rank_bytes for r in reports[1:])
                saves += len(reports) - 1
                tailor.close()
            elif pending is not None:
                pending.result()
            cpu[name].append(process_cpu() - cpu_start)  # up to ``wait``: the last saves' background work too
            started[name].append(len(figures.get("started", [])) - threads_before)
            shutil.rmtree(shm / "dcp", ignore_errors=True)
            dist.barrier()
    params = sum(p.numel() for p in training.model.parameters())
    state = [*training.model.state_dict().values(),
             *(v for s in training.optimizer.state_dict()["state"].values() for v in s.values())]
    composite = sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor))
    (own / f"train{suffix}.json").write_text(json.dumps({"totals": totals, "sent_bytes": sent, "part_bytes": parts,
                                                "composite_bytes": composite, "settle": waits,
                                                "calls": calls, "fence": fences, "cpu": cpu, "started": started,
                                                "persist_cpu": figures["persist_cpu"], "call_cpu": figures["call_cpu"],
                                                "saves": saves, "params": params, "threads": torch.get_num_threads()}))


def restore_worker(args: argparse.Namespace, own: Path, suffix: str) -> None:
    import torch.distributed as dist
    import xxhash

    training = Training(args, settled=False)  # the restore makes the optimizer's state (no live tensor to land in)
    tailor = ours(training, args, args.rounds - 1)
    dist.barrier()
    phases = Phases() if args.phases else None
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    if phases is not None:
        phases.start()
    report = tailor.restore()
    seconds = time.perf_counter() - start
    if phases is not None:
        phases.stop(tailor)
    settle = getattr(tailor.tiers, "settle_healing", None)  # a healed copy is committed in the background (session 42)
    if settle is not None:
        settle()
    committed = time.perf_counter() - start
    if phases is not None:
        phases.settled()
    profile = ""
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(45)
        profile = out.getvalue()
    digest = xxhash.xxh3_64()
    for name, tensor in sorted(training.model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    for state in training.optimizer.state_dict()["state"].values():
        for key, value in sorted(state.items()):
            digest.update(key.encode() + value.detach().cpu().contiguous().numpy().tobytes())
    training.train(1)  # outside the timed span: the first step writes into the optimizer's state the restore made
    problems = node_copy_problems(node_memory(args.rounds - 1))
    tailor.close()
    said = f"node(s) served by: {report.served_by}" if report.served_by else "nothing to heal"
    (own / f"restore{suffix}.json").write_text(json.dumps({"seconds": seconds, "committed": committed, "tier": report.tier, "step": report.step,
                                                  "said": said, "digest": digest.hexdigest(), "problems": problems,
                                                  "profile": profile,
                                                  "phases": phases.table() if phases is not None else ""}))


def node_copy_problems(copy: Path) -> list[str] | None:
    """What ``Run.verify`` finds wrong in this node's copy (a Run of its own; a healed copy
    included), checked by the node's leader once a step trained after the restore: a restore
    handed the healed copy's own bytes (its tensors views of them) lets training write into that
    copy. None on another rank."""
    import torch.distributed as dist

    from llmtailor.store.run import Run

    dist.barrier()  # every rank's step trained
    if int(os.environ["LOCAL_RANK"]) != 0:
        return None
    return Run(copy).verify()


class Phases:
    """``--phases``: each phase of a restore timed on this rank (wall seconds, and CPU seconds of
    the thread that ran it: ``time.thread_time``; calls), by wrapping the functions below where
    the tree has them (the trees compared may differ), plus the restore's process CPU, the bytes
    and messages of the courier and of the job's collectives, and the coordinator's rounds; the
    CPU of the process's other threads (gloo's sends and receives, a healed copy's writer) and its
    minor page faults (fresh memory written: a healing's receive buffers) until restore returned;
    when each phase ran (from its first call's start to its last call's end, seconds from the
    restore's start: a healing's stream beside the load shows as overlapping spans). Phases nest (a phase's time includes those it calls); a phase run on a background thread
    (the healed copy's writes) overlaps the others."""

    NAMES = [
        "llmtailor.tailor:_Restoring.plan", "llmtailor.store.tiers.healing:survey",
        "llmtailor.store.tiers.healing:held_here", "llmtailor.store.tiers.healing:heal",
        "llmtailor.store.tiers.healing:recover", "llmtailor.store.tiers.healing:settle",
        "llmtailor.store.tiers.healing:_Staged.result", "llmtailor.store.tiers.healing:_Following.outcome",
        "llmtailor.store.tiers.healing:Healing._run", "llmtailor.store.tiers.runtime:Tiers.healed",
        "llmtailor.store.units:UnitReader.arrival", "llmtailor.store.units:UnitReader._checked",
        "llmtailor.distributed.courier:Courier.stream", "llmtailor.distributed.courier:Courier._hand_over",
        "llmtailor.store.tiers.healing:_Sender.hand_over", "llmtailor.store.tiers.healing:_Sender._hand",
        "llmtailor.distributed.courier:_Incoming._next", "llmtailor.store.tiers.healing:Receiving.land",
        "llmtailor.store.tiers.healing:_Landed.put",  # the last two: branch rec55's ring (825d8f4), where run against it
        "llmtailor.store.tiers.healing:Receiving.take", "llmtailor.store.tiers.healing:Receiving.finish",
        "llmtailor.store.tiers.healing:Receiving._write", "llmtailor.store.tiers.healing:Receiving._commit_written",
        "llmtailor.store.storage.local:LocalStorage.mapped", "llmtailor.tailor:_Restoring.attempt",
        "llmtailor.store.tiers.runtime:Tiers.choose", "llmtailor.store.shared_reads:share_manifests",
        "llmtailor.store.shared_reads:share_small_files", "llmtailor.providers.base:StateProvider.check_composite",
        "llmtailor.providers.local:LocalProvider.load", "llmtailor.providers.local:LocalProvider._own_copy_holds",
        "llmtailor.providers.local:LocalProvider._load_optimizer_and_scheduler",
        "llmtailor.store.units:UnitReader.read", "llmtailor.store.checked:checked_tensors",
        "llmtailor.store.checked:fetch_stored_tensors", "llmtailor.providers.base:copy_into",
        "llmtailor.providers.base:StateProvider.finish_load", "llmtailor.providers.base:StateProvider.restore_rank_state",
        "llmtailor.distributed.coordinator:StoreCoordinator.broadcast",
        "llmtailor.distributed.coordinator:StoreCoordinator.gather",
        "llmtailor.distributed.coordinator:StoreCoordinator.exchange",
        "llmtailor.distributed.read_plan:ReadPlan.fetch",
        "torch.distributed:isend", "torch.distributed:irecv", "torch.distributed:broadcast",
    ]

    def __init__(self) -> None:
        import importlib

        self.figures: dict[str, list[float]] = {}
        self.bytes: dict[str, int] = {}
        self.active = False
        for name in self.NAMES:
            module_name, path = name.split(":")
            try:
                owner = importlib.import_module(module_name)
                *outer, attr = path.split(".")
                for part in outer:
                    owner = getattr(owner, part)
                original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            except (ImportError, AttributeError, KeyError):
                continue  # not in this tree
            wrapped = self._wrap(path, original)
            setattr(owner, attr, wrapped)
            if not isinstance(owner, type):  # a function imported by name elsewhere: rebound there too
                for module in list(sys.modules.values()):
                    if getattr(module, "__name__", "").startswith("llmtailor") and getattr(module, attr, None) is original:
                        setattr(module, attr, wrapped)

    def _wrap(self, name: str, function):
        import functools

        def counted(args) -> None:
            for value in args:
                numel = getattr(value, "numel", None)
                if callable(numel) and hasattr(value, "element_size"):
                    self.bytes[name] = self.bytes.get(name, 0) + numel() * value.element_size()
                    return

        @functools.wraps(function)
        def timed(*args, **kwargs):
            if not self.active:
                return function(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                figure = self.figures.setdefault(name, [0, 0.0, 0.0, wall - self.wall, 0.0])
                figure[0] += 1
                figure[1] += ended - wall
                figure[2] += time.thread_time() - cpu
                figure[4] = ended - self.wall
                if name.startswith(("isend", "irecv", "broadcast")):
                    counted(args)

        return timed

    def start(self) -> None:
        import resource

        self.active = True
        self.threads = thread_cpu()
        self.usage = resource.getrusage(resource.RUSAGE_SELF)
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def stop(self, tailor) -> None:
        import resource

        self.active = False
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.total = (time.perf_counter() - self.wall, time.thread_time() - self.cpu,
                      usage.ru_utime - self.usage.ru_utime + usage.ru_stime - self.usage.ru_stime)
        self.faults = usage.ru_minflt - self.usage.ru_minflt
        ended = thread_cpu()
        self.busiest = sorted(((cpu - self.threads.get(key, 0.0), key[1]) for key, cpu in ended.items()), reverse=True)[:5]
        placement = getattr(tailor.tiers, "placement", None)
        self.sent = placement.courier.sent_bytes if placement is not None else 0

    def settled(self) -> None:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.until_committed = usage.ru_utime - self.usage.ru_utime + usage.ru_stime - self.usage.ru_stime

    def table(self) -> str:
        wall, thread, process = self.total
        lines = [f"restore: {wall:.3f} s wall, {thread:.3f} s CPU on the training thread, {process:.3f} s CPU of the "
                 f"process (all threads, until restore returned; {self.until_committed:.3f} s until this node's copy was "
                 f"committed); other threads (gloo's, the writer's) {process - thread:.3f} s; {self.faults} minor page "
                 f"faults; courier sent {self.sent / 1e6:.1f} MB",
                 "busiest threads (CPU s until restore returned): "
                 + ", ".join(f"{name} {cpu:.3f}" for cpu, name in self.busiest),
                 f"{'phase':<46}{'calls':>6}{'wall s':>9}{'CPU s':>8}{'from s':>8}{'to s':>8}{'MB':>9}"]
        for name, (calls, seconds, cpu, first, last) in self.figures.items():  # from the first call's start to the last's end
            moved = f"{self.bytes[name] / 1e6:9.1f}" if name in self.bytes else ""
            lines.append(f"{name:<46}{calls:>6}{seconds:>9.3f}{cpu:>8.3f}{first:>8.3f}{last:>8.3f}{moved}")
        return "\n".join(lines)


def thread_cpu() -> dict[tuple[str, str], float]:
    """(thread id, name) -> CPU seconds so far of each thread of this process (``/proc``): the
    busiest one bounds the restore where cores idle."""
    tick, cpu = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        cpu[(tid, name)] = (int(fields[11]) + int(fields[12])) / tick
    return cpu


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    own = args.root / f"node{os.environ['GROUP_RANK']}"
    try:
        (train_worker if args.worker == "train" else restore_worker)(args, own, f"-{os.environ['LOCAL_RANK']}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
