"""Saves to object storage: ours (Full, Parity) vs boto3's transfer manager uploading the same
bytes and vs ``dcp.save`` through its fsspec writer (s3fs), against one S3 server (moto's, on
loopback), side by side in one process run; then the two clients we could build on (obstore,
fsspec + s3fs) on the operations our store does; then a restore at another world size, bytes
fetched against bytes needed.

Phases (one server for all):

1. **Clients.** The same files (``--files`` x ``--file-mb`` MB) uploaded as a save does (one
   after another, each streamed in parts) and read back as a restore does (ranged reads),
   with obstore and with s3fs; and a training thread's stand-in (a pure-Python loop) timed
   alone and while a background thread uploads with each client: the share of the
   interpreter an upload takes from training (an async save uploads on a background thread).
2. **Saves.** The Llama of ``bench_save.py`` scaled by the flags (fp32, AdamW in HF's decay /
   no-decay groups, moments from one real step). Each repeat: ours Full (a run's first save)
   and Parity (a run's second save) to s3://; boto3 ``upload_file`` (its transfer manager:
   multipart, 10 threads) of the files of a local Full snapshot of the same state; ``dcp.save``
   of the model and optimizer state dicts through ``FsspecWriter`` (s3fs). Objects are deleted
   between contenders. Throughput = bytes / seconds; medians over ``--repeats``; targets
   (issue 23): ours Full >= 0.9x boto3's throughput, ours Parity <= 0.6x dcp.save's time.
3. **Restore at another world size.** A 2-rank FSDP2 job (torchrun) saves the model with Full
   to s3://; a 3-rank job restores it (``verify=False``: only the byte ranges each rank
   holds; and ``verify=True``: whole chunks, to check them). Each rank counts the bytes it
   fetched (through the store's reads) and the bytes of its own shards; target: fetched <=
   1.05x needed.
4. **A DDP restore at 3 ranks** (issue 33: read once, send to the rest). A 3-rank DDP job saves
   the model with Full to s3:// (ours) and ``dcp.save`` of the same state through fsspec
   (s3fs); a 3-rank job restores each, ``--repeats`` times, timed between barriers (the job
   waits for its slowest rank). Bytes fetched: ours through the store's reads, DCP's through
   s3fs's ranged reads (``S3File._fetch_range``), summed over the ranks, against the bytes of
   the composite (every object of the snapshot). Also timed in this process: boto3's
   ``download_file`` (transfer manager) of every object of the snapshot, one after another.
   Targets: fetched <= 1.05x the composite; time <= 0.5x dcp.load's, <= 1.3x boto3's.
5. **An FSDP2 restore at another world size, against dcp.load** (issue 33): as phase 4, the run
   (and DCP's) saved by a 2-rank FSDP2 job and restored by a 3-rank one (each rank reads the
   byte ranges of its shards: a restore at 3 from a save at 2 reads some chunks in part).

    .venv/bin/python bench/bench_object_store.py --repeats 3
    BENCH_TRACE=<folder> BENCH_LATENCY_MS=30 .venv/bin/python bench/bench_object_store.py --phases ddp-restore  # requests' timeline, 30 ms before each
    .venv/bin/python bench/bench_object_store.py --layers 2 --hidden 128 --intermediate 256 --vocab 1024 --repeats 1 --files 2  # quick
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MB, scratch  # noqa: E402

SIZES = {"layers": 8, "hidden": 512, "intermediate": 1792, "heads": 8, "kv-heads": 4, "vocab": 16000}
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
         "AWS_ALLOW_HTTP": "true"}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in SIZES.items():
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default})")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", type=int, default=6, help="files of phase 1")
    parser.add_argument("--file-mb", type=int, default=64, help="size of each file of phase 1")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--phases", default="clients,saves,reshard,ddp-restore,fsdp-restore",
                        help="which phases to run, comma-separated (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args()


# -- the server ------------------------------------------------------------------------------


def start_server() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({**CREDS, "AWS_ENDPOINT_URL": endpoint, "BENCH_SERVER_PID": str(proc.pid)})
    for _ in range(300):
        try:
            s3().list_buckets()
            return proc, endpoint
        except Exception:
            time.sleep(0.1)
    raise SystemExit("the S3 server did not start")


def server_cpu() -> float:
    """CPU seconds (user + system) the S3 server's process has used so far (0 where unknown)."""
    try:
        fields = Path(f"/proc/{os.environ['BENCH_SERVER_PID']}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (KeyError, OSError, ValueError, IndexError):
        return 0.0


def cpu_now() -> float:
    """CPU seconds (user + system) of this process, every thread, so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def s3():
    import boto3

    return boto3.client("s3")


def new_bucket() -> str:
    name = f"bench-{uuid.uuid4().hex[:10]}"
    s3().create_bucket(Bucket=name)
    return name


def empty(bucket: str) -> None:
    client = s3()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects})


# -- phase 1: the clients ----------------------------------------------------------------------


def phase_clients(args) -> None:
    import obstore
    import s3fs

    bucket = new_bucket()
    payload = os.urandom(args.file_mb << 20)
    store = obstore.store.from_url(f"s3://{bucket}", client_options={"allow_http": True})
    fs = s3fs.S3FileSystem()
    total = args.files * len(payload)

    def obstore_put():
        for i in range(args.files):
            writer = obstore.open_writer(store, f"o/{i}", buffer_size=16 << 20, max_concurrency=8)
            for start in range(0, len(payload), 16 << 20):
                writer.write(payload[start : start + (16 << 20)])
            writer.close()

    def s3fs_put():
        for i in range(args.files):
            with fs.open(f"{bucket}/f/{i}", "wb", block_size=16 << 20) as out:
                for start in range(0, len(payload), 16 << 20):
                    out.write(payload[start : start + (16 << 20)])

    ranges = [(start, 1 << 20) for start in range(0, len(payload), 4 << 20)]

    def obstore_get():
        for i in range(args.files):
            obstore.get_ranges(store, f"o/{i}", starts=[s for s, _ in ranges], lengths=[n for _, n in ranges])

    def s3fs_get():
        for i in range(args.files):
            fs.cat_ranges([f"{bucket}/f/{i}"] * len(ranges), [s for s, _ in ranges], [s + n for s, n in ranges])

    def spin(seconds: float) -> float:
        """Iterations per second of a pure-Python loop (a training thread's stand-in)."""
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count / seconds

    print(f"\n== phase 1: clients ({args.files} files x {args.file_mb} MB, the same server)")
    print(f"{'client':<10}{'upload MB/s':>13}{'ranged read MB/s':>18}{'loop speed while uploading':>29}")
    alone = spin(2.0)
    for name, put, get in (("obstore", obstore_put, obstore_get), ("s3fs", s3fs_put, s3fs_get)):
        ups, reads, shares = [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            put()
            ups.append(total / (time.perf_counter() - start) / MB)
            start = time.perf_counter()
            get()
            reads.append(args.files * len(ranges) * (1 << 20) / (time.perf_counter() - start) / MB)
            thread = threading.Thread(target=put)
            thread.start()
            rate = spin(1.5)
            thread.join()
            shares.append(rate / alone)
        print(f"{name:<10}{statistics.median(ups):>13.0f}{statistics.median(reads):>18.0f}"
              f"{statistics.median(shares):>28.0%}")
    empty(bucket)


# -- phase 2: saves ------------------------------------------------------------------------------


def model_and_state(args):
    from llmtailor.training_example import TinyConfig, batch_at, build_model, corpus_tokens, hf_param_groups

    config = TinyConfig(hidden_size=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                        intermediate_size=args.intermediate, vocab_size=args.vocab, seq_len=64)
    model = build_model(config, seed=0)
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-3)
    batch = batch_at(corpus_tokens(), 0, 1, 64) % args.vocab
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def phase_saves(args, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from boto3.s3.transfer import TransferConfig
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # DCP's fsspec writer (not re-exported)

    from llmtailor import Full, Parity, Tailor

    model, optimizer = model_and_state(args)
    params = sum(p.numel() for p in model.parameters())
    local = out / "local"
    with Tailor(local, model, optimizer, policy=Full(), track_drift=False) as tailor:
        tailor.save(1)
    files = [p for p in local.rglob("*") if p.is_file() and ".readers" not in p.name and p.name != ".lock"]
    full_bytes = sum(p.stat().st_size for p in files)
    print(f"\n== phase 2: saves ({params / 1e6:.1f}M params, fp32 + AdamW; a Full snapshot is {full_bytes / MB:.0f} MB)")
    bucket = new_bucket()
    results: dict[str, list[tuple[float, int]]] = {k: [] for k in ("boto3", "dcp.save", "ours Full", "ours Parity")}
    transfer = TransferConfig()  # boto3's defaults: multipart from 8 MB, 8 MB parts, 10 threads
    client = s3()
    for repeat in range(args.repeats):
        start = time.perf_counter()
        for path in files:
            client.upload_file(str(path), bucket, f"boto3/{repeat}/{path.relative_to(local)}", Config=transfer)
        results["boto3"].append((time.perf_counter() - start, full_bytes))
        empty(bucket)

        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        start = time.perf_counter()
        dcp.save(state, storage_writer=FsspecWriter(f"s3://{bucket}/dcp/{repeat}", sync_files=False))
        results["dcp.save"].append((time.perf_counter() - start, bucket_bytes(bucket)))
        empty(bucket)

        url = f"s3://{bucket}/ours/full-{repeat}"
        with Tailor(url, model, optimizer, policy=Full(), track_drift=False) as tailor:
            report = tailor.save(1)
        results["ours Full"].append((report.seconds, report.bytes))
        empty(bucket)

        url = f"s3://{bucket}/ours/parity-{repeat}"
        with Tailor(url, model, optimizer, policy=Parity(), track_drift=False) as tailor:
            tailor.save(1)  # a run's first save is full
            report = tailor.save(2)
        results["ours Parity"].append((report.seconds, report.bytes))
        empty(bucket)
        print(f"  repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in results.items()))
    print(f"\n{'contender':<14}{'MB':>9}{'seconds':>10}{'MB/s':>9}{'time/boto3':>12}{'time/dcp':>10}")
    med = {k: (statistics.median(s for s, _ in v), statistics.median(b for _, b in v)) for k, v in results.items()}
    for name, (seconds, size) in med.items():
        print(f"{name:<14}{size / MB:>9.1f}{seconds:>10.2f}{size / MB / seconds:>9.0f}"
              f"{seconds / med['boto3'][0]:>12.3f}{seconds / med['dcp.save'][0]:>10.3f}")
    ours_rate = med["ours Full"][1] / med["ours Full"][0]
    boto_rate = med["boto3"][1] / med["boto3"][0]
    parity_vs_dcp = med["ours Parity"][0] / med["dcp.save"][0]
    print("\nissue 23 targets")
    print(f"  ours Full throughput vs boto3's: {ours_rate / boto_rate:.3f}x (target >= 0.9x): "
          f"{'PASS' if ours_rate / boto_rate >= 0.9 else 'FAIL'}")
    print(f"  ours Parity time vs dcp.save's:  {parity_vs_dcp:.3f}x (target <= 0.6x): {'PASS' if parity_vs_dcp <= 0.6 else 'FAIL'}")


def bucket_bytes(bucket: str) -> int:
    total = 0
    for page in s3().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        total += sum(o["Size"] for o in page.get("Contents", []))
    return total


# -- phase 3: a restore at another world size ---------------------------------------------------


def phase_reshard(args, out: Path) -> None:
    bucket = new_bucket()
    url = f"s3://{bucket}/fsdp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_URL": url, "BENCH_SIZES": json.dumps(vars(args), default=str)}
    print("\n== phase 3: an FSDP2 run saved at 2 ranks, restored at 3")
    for nproc, role in ((2, "save"), (3, "restore")):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                               __file__, "--worker", role, "--out", str(out)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-4000:])
    print(f"{'rank':<6}{'verify':<8}{'needed MB':>11}{'fetched MB':>12}{'fetched/needed':>16}")
    worst = {}
    for rank in range(3):
        for verify in (False, True):
            result = json.loads((out / f"reshard-{rank}-{verify}.json").read_text())
            ratio = result["fetched"] / result["needed"]
            worst[verify] = max(worst.get(verify, 0), ratio)
            print(f"{rank:<6}{str(verify):<8}{result['needed'] / MB:>11.2f}{result['fetched'] / MB:>12.2f}{ratio:>16.3f}")
    print("\nissue 23 target: fetched <= 1.05x needed")
    for verify, ratio in worst.items():
        print(f"  verify={verify}: worst rank {ratio:.3f}x: {'PASS' if ratio <= 1.05 else 'FAIL'}")


# -- phase 4: a DDP restore at 3 ranks ----------------------------------------------------------


def phase_ddp_restore(args, out: Path) -> None:
    print("\n== phase 4: a DDP run saved at 3 ranks (Full; and dcp.save through fsspec), restored at 3")
    restore_phase(args, out, "ddp", saved_at=3)


def phase_fsdp_restore(args, out: Path) -> None:
    print("\n== phase 5: an FSDP2 run saved at 2 ranks (Full; and dcp.save through fsspec), restored at 3")
    restore_phase(args, out, "fsdp", saved_at=2)


def restore_phase(args, out: Path, kind: str, saved_at: int) -> None:
    """``kind`` (ddp, fsdp) saved at ``saved_at`` ranks by us and by ``dcp.save`` through fsspec,
    each restored at 3 ranks ``--repeats`` times; bytes fetched and times, against boto3's
    download of the same objects."""
    bucket = new_bucket()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_URL": f"s3://{bucket}",
           "BENCH_SIZES": json.dumps(vars(args), default=str)}
    for role, nproc in ((f"{kind}-save", saved_at), (f"{kind}-restore", 3)):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                               __file__, "--worker", role, "--out", str(out)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-20000:])
    client = s3()
    objects = {}
    for prefix in ("ours/", "dcp/"):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            objects.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    composite = {k: v for k, v in objects.items() if k.startswith("ours/snapshots/")}
    dcp_bytes = sum(v for k, v in objects.items() if k.startswith("dcp/"))
    boto, boto_cpu, boto_server = [], [], []
    for _ in range(args.repeats):
        start, cpu, served = time.perf_counter(), cpu_now(), server_cpu()
        for key in composite:
            client.download_file(bucket, key, str(out / "download.bin"))
        boto.append(time.perf_counter() - start)
        boto_cpu.append(cpu_now() - cpu)
        boto_server.append(server_cpu() - served)
    results = [json.loads((out / f"{kind}-restore-{rank}.json").read_text()) for rank in range(3)]
    total = sum(composite.values())
    ours_fetched = sum(r["ours_fetched"] for r in results)
    data_fetched = sum(r["ours_data_fetched"] for r in results)
    data = sum(v for k, v in composite.items() if data_file(k))
    dcp_fetched = sum(r["dcp_fetched"] for r in results)
    ours_s, dcp_s, boto_s = (statistics.median(x) for x in (results[0]["ours_seconds"], results[0]["dcp_seconds"], boto))
    print(f"composite (every object of the snapshot) {total / MB:.2f} MB, its unit data files {data / MB:.2f} MB; "
          f"dcp.save wrote {dcp_bytes / MB:.2f} MB")
    print(f"{'contender':<22}{'fetched MB':>12}{'fetched/composite':>19}{'seconds':>10}")
    print(f"{'ours (3 ranks)':<22}{ours_fetched / MB:>12.2f}{ours_fetched / total:>19.3f}{ours_s:>10.2f}")
    print(f"{'  of it unit data':<22}{data_fetched / MB:>12.2f}{data_fetched / data:>19.3f}")
    print(f"{'dcp.load (3 ranks)':<22}{dcp_fetched / MB:>12.2f}{dcp_fetched / dcp_bytes:>19.3f}{dcp_s:>10.2f}")
    print(f"{'boto3 download_file':<22}{total / MB:>12.2f}{1.0:>19.3f}{boto_s:>10.2f}")
    print("ours, each rank's last restore: " + "; ".join(
        f"rank {rank}: {r['requests']} requests, {r['collectives']} collectives, {r['messages']} sends/receives"
        for rank, r in enumerate(results)))
    gets = [r["ours_gets"] for r in results]
    read = sum(objects.get(f"ours/{key}", 0) for keys in gets for key in keys)
    print(f"ours, each rank's last restore: GETs {'/'.join(str(len(keys)) for keys in gets)}; bytes of the objects they "
          f"asked of (the server read, moto reading a whole object for each GET) {read / MB:.2f} MB")
    if "ours_cpu" in results[0]:
        def per_rank(name: str) -> str:
            return "/".join(f"{statistics.median(r[name]):.2f}" for r in results)

        print(f"CPU s, medians (each rank's process, every thread; the S3 server's process): ours {per_rank('ours_cpu')}, "
              f"server {statistics.median(results[0]['ours_server']):.2f}; dcp.load {per_rank('dcp_cpu')}, server "
              f"{statistics.median(results[0]['dcp_server']):.2f}; boto3 {statistics.median(boto_cpu):.2f}, server "
              f"{statistics.median(boto_server):.2f}")
    if "ours_faults" in results[0]:
        print("minor page faults, medians (each rank's process): ours " + "/".join(
            f"{statistics.median(r['ours_faults']):.0f}" for r in results) + "; dcp.load " + "/".join(
            f"{statistics.median(r['dcp_faults']):.0f}" for r in results))
    print("\nissue 33 targets")
    ratio = ours_fetched / total
    print(f"  fetched / composite: {ratio:.3f}x (target <= 1.05x): {'PASS' if ratio <= 1.05 else 'FAIL'}")
    print(f"  time vs dcp.load:    {ours_s / dcp_s:.3f}x (target <= 0.5x): {'PASS' if ours_s / dcp_s <= 0.5 else 'FAIL'}")
    print(f"  time vs boto3:       {ours_s / boto_s:.3f}x (target <= 1.3x): {'PASS' if ours_s / boto_s <= 1.3 else 'FAIL'}")


def data_file(key: str) -> bool:
    """Whether ``key`` is one of our snapshot's unit data files (a unit's own, or a pack of small units)."""
    return "/units/" in key or "/packs/" in key


def count_fetched() -> dict[str, int]:
    """Bytes this process fetches from now on, by object key: through our store's reads and
    through s3fs's ranged reads (what ``dcp.load`` through fsspec uses)."""
    from s3fs.core import S3File

    from llmtailor.store.storage.object_store import ObjectStore

    fetched: dict[str, int] = {}

    def counting(real, key_of):
        def read(self, *a, **k):
            data = real(self, *a, **k)
            fetched[key_of(self, a)] = fetched.get(key_of(self, a), 0) + len(data)
            return data
        return read

    ObjectStore.read = counting(ObjectStore.read, lambda store, a: f"ours/{a[0]}")
    ObjectStore.read_range = counting(ObjectStore.read_range, lambda store, a: f"ours/{a[0]}")
    if "read_start" in vars(ObjectStore):  # a file's size and first bytes (its header) in one GET; not in older trees
        real_start = ObjectStore.read_start

        def read_start(self, key, length):
            size, data = real_start(self, key, length)
            fetched[f"ours/{key}"] = fetched.get(f"ours/{key}", 0) + len(data)
            return size, data

        ObjectStore.read_start = read_start
    S3File._fetch_range = counting(S3File._fetch_range, lambda file, a: f"dcp/{file.path}")
    return fetched


def count_calls() -> dict[str, int]:
    """Requests this process makes of the object store through our store (``requests``: reads,
    each a GET, and sizes, each a HEAD) and the torch.distributed calls it makes (``collectives``:
    broadcasts and all-reduces; ``messages``: point-to-point sends and receives), from now on."""
    import torch.distributed as dist

    from llmtailor.store.storage.object_store import ObjectStore

    counts = {"requests": 0, "collectives": 0, "messages": 0}

    def counting(owner, name, kind):
        real = getattr(owner, name)

        def counted(*a, **k):
            counts[kind] += 1
            return real(*a, **k)

        setattr(owner, name, counted)

    for name in ("read", "read_range", "read_start", "size"):
        if name in vars(ObjectStore):
            counting(ObjectStore, name, "requests")
    for name in ("broadcast", "all_reduce"):
        counting(dist, name, "collectives")
    for name in ("isend", "irecv"):
        counting(dist, name, "messages")
    return counts


def request_timeline() -> list[list]:
    """``[start, end, [operation, thread, key, args...]]`` of every request this process makes of
    the object store through our store from now on (``BENCH_TRACE=<folder>``: ours' last restore's,
    by rank, to see which requests wait for which). ``BENCH_LATENCY_MS``: each request first
    sleeps that long (a real store's time to first byte, which moto on loopback lacks; no CPU
    used), outside the times recorded."""
    from llmtailor.store.storage.object_store import ObjectStore

    timeline: list[list] = []
    latency = float(os.environ.get("BENCH_LATENCY_MS", "0")) / 1000

    def timed(name, real):
        def request(self, *a, **k):
            start = time.perf_counter()
            try:
                return real(self, *a, **k)
            finally:
                timeline.append([start, time.perf_counter(), [name, threading.current_thread().name, *map(str, a)]])

        def slowed(self, *a, **k):
            time.sleep(latency)
            return request(self, *a, **k)
        return slowed if latency else request

    for name in ("read", "read_range", "read_start", "size", "list_dir", "put", "put_if", "remove"):
        if name in vars(ObjectStore):
            setattr(ObjectStore, name, timed(name, vars(ObjectStore)[name]))
    return timeline


def restore_worker(role: str, out: Path, model, optimizer) -> None:
    """``<kind>-save``: ours (Full) and ``dcp.save`` through fsspec of ``model`` and ``optimizer``;
    ``<kind>-restore``: each restored ``repeats`` times, timed between barriers, bytes counted."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from llmtailor import Full, Tailor

    url = os.environ["BENCH_URL"]
    if role.endswith("-save"):
        with Tailor(f"{url}/ours", model, optimizer, policy=Full(), track_drift=False) as tailor:
            tailor.save(1)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 storage_writer=FsspecWriter(f"{url}/dcp", sync_files=False))
        return
    fetched, calls = count_fetched(), count_calls()
    requests = request_timeline()
    seconds: dict[str, list[float]] = {"ours": [], "dcp": []}
    cpu: dict[str, list[float]] = {"ours": [], "dcp": [], "ours_server": [], "dcp_server": []}
    faults: dict[str, list[int]] = {"ours": [], "dcp": []}
    counts: dict[str, int | list[str]] = {}
    timers = None
    if os.environ.get("BENCH_PHASES"):  # each phase's wall and thread CPU of ours' last restore, by rank
        import phase_timers as timers

        missing = timers.install()
    for _ in range(json.loads(os.environ["BENCH_SIZES"])["repeats"]):
        for name in ("ours", "dcp"):
            fetched.clear()
            calls.update(dict.fromkeys(calls, 0))
            dist.barrier()
            profile = cProfile.Profile() if os.environ.get("BENCH_PROFILE") else None
            if timers is not None:
                timers.reset()
            start, used, served = time.perf_counter(), cpu_now(), server_cpu()
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if profile is not None:
                profile.enable()
            if name == "ours":
                requests.clear()
                Tailor(f"{url}/ours", model, optimizer, track_drift=False, read_only=True).restore()
                counts["gets"] = [rest[2] for *_, rest in requests if rest[0] in ("read", "read_range", "read_start")]
                if os.environ.get("BENCH_TRACE"):  # ours' last restore's requests, by rank
                    (Path(os.environ["BENCH_TRACE"]) / f"{role}-{dist.get_rank()}.json").write_text(
                        json.dumps([[round(t - start, 4) for t in times] + rest for *times, rest in requests]))
            else:
                dcp.load({"model": model.state_dict(), "optim": optimizer.state_dict()}, storage_reader=FsspecReader(f"{url}/dcp"))
            if profile is not None:  # the last repeat's profile of each contender, by rank (``BENCH_PROFILE``: a folder)
                profile.disable()
                profile.dump_stats(Path(os.environ["BENCH_PROFILE"]) / f"{role}-{dist.get_rank()}-{name}.prof")
            cpu[name].append(cpu_now() - used)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
            cpu[f"{name}_server"].append(server_cpu() - served)
            if timers is not None and name == "ours":
                timers.dump(Path(os.environ["BENCH_PHASES"]) / f"{role}-{dist.get_rank()}.json",
                            {"seconds": round(seconds[name][-1], 3), "process_cpu": round(cpu[name][-1], 3),
                             "server_cpu": round(cpu["ours_server"][-1], 3), "not_in_tree": missing})
            counts[name] = sum(v for k, v in fetched.items() if k.startswith(f"{name}/"))
            counts[f"{name}_data"] = sum(v for k, v in fetched.items() if k.startswith(f"{name}/") and data_file(k))
            if name == "ours":  # ours' last restore: its requests of the store and its torch.distributed calls
                counts.update({f"ours_{k}": v for k, v in calls.items()})
    (out / f"{role}-{dist.get_rank()}.json").write_text(json.dumps({
        "ours_seconds": seconds["ours"], "dcp_seconds": seconds["dcp"], "ours_fetched": counts["ours"],
        "ours_data_fetched": counts["ours_data"], "dcp_fetched": counts["dcp"], "ours_cpu": cpu["ours"], "dcp_cpu": cpu["dcp"],
        "ours_server": cpu["ours_server"], "dcp_server": cpu["dcp_server"], "ours_faults": faults["ours"], "dcp_faults": faults["dcp"],
        "ours_gets": counts["gets"], **{k: counts[f"ours_{k}"] for k in ("requests", "collectives", "messages")}}))


def worker(role: str, out: Path) -> None:
    """A rank of ``role``'s job. Its model is gone before the process group is destroyed
    (``work`` returned): a DDP model freed after it, its reducer holding the last reference to
    the gloo group, destroys the group while holding the GIL, which gloo's thread may need to
    free the last barrier's tensors: a deadlock (pytorch#56297), seen as a rank of the 3-rank
    DDP save left waiting after the other two exited (native stack: ``~Reducer`` ->
    ``~ProcessGroupGloo`` joining ``runLoop``, which waits for the GIL in ``~AsyncBarrierWork``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    work(role, out)
    dist.barrier()
    dist.destroy_process_group()


def work(role: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llmtailor import Full, Tailor
    from llmtailor.store.storage import objects

    torch.set_num_threads(1)
    args = argparse.Namespace(**json.loads(os.environ["BENCH_SIZES"]))
    from llmtailor.training_example import TinyConfig, build_model, hf_param_groups

    config = TinyConfig(hidden_size=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                        intermediate_size=args.intermediate, vocab_size=args.vocab, seq_len=64)
    model = build_model(config, seed=0)
    if role.startswith("ddp-"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(hf_param_groups(model.module), lr=1e-3)
        batch = torch.randint(0, args.vocab, (1, 64))
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        restore_worker(role, out, model, optimizer)
        return
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-3)
    batch = torch.randint(0, args.vocab, (1, 64))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if role.startswith("fsdp-"):
        restore_worker(role, out, model, optimizer)
        return
    url = os.environ["BENCH_URL"]
    if role == "save":
        with Tailor(url, model, optimizer, policy=Full(), track_drift=False) as tailor:
            tailor.save(1)
    else:
        fetched = [0]
        for name in ("read", "read_range"):
            real = getattr(objects.ObjectStorage, name)

            def counted(self, *a, _real=real, **k):
                data = _real(self, *a, **k)
                fetched[0] += len(data)
                return data

            setattr(objects.ObjectStorage, name, counted)
        needed = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        needed += sum(v.to_local().numel() * v.element_size() for s in optimizer.state.values()
                      for v in s.values() if hasattr(v, "to_local") and v.dim() > 0)
        for verify in (False, True):
            fetched[0] = 0
            Tailor(url, model, optimizer, track_drift=False, read_only=True).restore(verify=verify)
            (out / f"reshard-{dist.get_rank()}-{verify}.json").write_text(json.dumps({"fetched": fetched[0], "needed": needed}))


def main() -> None:
    args = arguments()
    if args.worker:
        worker(args.worker, args.out)
        return
    import moto
    import obstore
    import s3fs

    print(f"python {platform.python_version()}, torch {torch.__version__}, obstore {obstore.__version__}, "
          f"s3fs {s3fs.__version__}, moto {moto.__version__}, {os.cpu_count()} CPUs")
    server, endpoint = start_server()
    print(f"S3 server: moto on {endpoint} (a process of its own)")
    try:
        with scratch(args.out, "bench_object_store") as out:
            phases = {"clients": phase_clients, "saves": phase_saves, "reshard": phase_reshard,
                      "ddp-restore": phase_ddp_restore, "fsdp-restore": phase_fsdp_restore}
            for name in args.phases.split(","):
                phases[name](args) if name == "clients" else phases[name](args, out)
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
