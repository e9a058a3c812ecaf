"""Every request the S3 server gets during a restore from an object store, by kind and key.

Issue 33's restores (``bench_object_store.py`` phases 4 and 5) spend about a third of their CPU
in the server, and the small requests (the lease, the listing, the manifest, the indexes, the
global and rank state) cost 4-5 ms each there whatever their size. This counts them: moto's
server runs in this process behind a WSGI layer that records each request (method, key, query
kind, a Range or not), and two torchrun jobs (a 3-rank DDP save then a 3-rank restore; a 2-rank
FSDP2 save then a 3-rank restore) mark where their read-only Tailor is made, restores and closes (as the bench times them) (a request to moto's
own API, not counted). Counts, not times: they do not depend on the machine's load.

    PYTHONPATH=. .venv/bin/python bench/restore_requests.py [--layers 4 --hidden 256 --intermediate 704 --vocab 8000]
    PYTHONPATH=. .venv/bin/python bench/restore_requests.py --snapshots 20   # one process, a run of 20 snapshots
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import subprocess
import sys
import threading
import uuid
import urllib.request
from pathlib import Path

import torch

SIZES = {"layers": 2, "hidden": 128, "intermediate": 256, "heads": 4, "kv-heads": 2, "vocab": 1024}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in SIZES.items():
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--kinds", default="ddp,fsdp")
    parser.add_argument("--snapshots", type=int, default=0,
                        help="instead: a one-process restore of a run of this many Parity saves (tests' tiny model)")
    parser.add_argument("--json", type=Path, default=None, help="write the counts there too")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def kind_of(method: str, path: str, query: str, ranged: bool) -> tuple[str, str]:
    """``(kind, key)`` of one request: GET (ranged or not), HEAD, PUT, DELETE, LIST, the key
    with the bucket and the run's prefix cut and a snapshot's reader lease id folded."""
    key = path.split("/", 2)[2] if path.count("/") >= 2 else ""
    if method == "GET" and ("list-type" in query or not key):
        prefix = re.search(r"prefix=([^&]*)", query)
        key = urllib.request.unquote(prefix.group(1)) if prefix else ""
        method = "LIST"
    elif method == "GET" and ranged:
        method = "GET range"
    elif method == "POST" and query.startswith("delete"):
        method = "DELETE (batch)"
    elif method == "POST" and "uploads" in query:
        method = "POST upload"
    key = re.sub(r"^[^/]+/", "", key, count=1)  # the run's own name (ddp/, fsdp/)
    key = re.sub(r"/\.readers/[0-9a-f]{32}$", "/.readers/<id>", key)
    key = re.sub(r"units/[^/]+\.safetensors$", "units/<unit>.safetensors", key)
    key = re.sub(r"packs/[^/]+\.safetensors$", "packs/<pack>.safetensors", key)
    return method, key


def serve() -> tuple[str, list, dict]:
    """moto's server in a thread behind a recording layer: the endpoint, the requests seen
    (``(mark, method, path, query, ranged)``) and the current mark (set by ``/moto-api/?mark=``)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    moto_app = DomainDispatcherApplication(create_backend_app)
    seen: list = []
    state = {"mark": None}
    lock = threading.Lock()

    def app(environ, start_response):
        path, query = environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        if path.startswith("/moto-api") and query.startswith("mark="):
            with lock:
                state["mark"] = query[len("mark="):] or None
            start_response("200 OK", [("Content-Length", "0")])
            return []
        with lock:
            seen.append((state["mark"], environ["REQUEST_METHOD"], path, query, "HTTP_RANGE" in environ))
        return moto_app(environ, start_response)

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", seen, state


def mark(name: str = "") -> None:
    urllib.request.urlopen(f"{os.environ['AWS_ENDPOINT_URL']}/moto-api/?mark={name}", timeout=30).close()


def launch(role: str, nproc: int, env: dict) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           __file__, "--worker", role], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{role}: " + proc.stderr[-20000:])


def worker(role: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llmtailor import Full, Tailor
    from llmtailor.training_example import TinyConfig, build_model, hf_param_groups

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    args = json.loads(os.environ["BENCH_SIZES"])
    config = TinyConfig(hidden_size=args["hidden"], layers=args["layers"], heads=args["heads"], kv_heads=args["kv_heads"],
                        intermediate_size=args["intermediate"], vocab_size=args["vocab"], seq_len=64)
    model = build_model(config, seed=0)
    kind, action = role.split("-")
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(hf_param_groups(model.module), lr=1e-3)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in (*model.model.layers, model):  # each layer, then the rest
            fully_shard(module, mesh=mesh)
        optimizer = torch.optim.AdamW(hf_param_groups(model), lr=1e-3)
    batch = torch.randint(0, args["vocab"], (1, 64))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    url = f"{os.environ['BENCH_URL']}/{kind}"
    if action == "save":
        with Tailor(url, model, optimizer, policy=Full(), track_drift=False) as tailor:
            tailor.save(1)
    else:
        made: list = []
        steps = {"open": lambda: made.append(Tailor(url, model, optimizer, track_drift=False, read_only=True)),
                 "restore": lambda: made[0].restore(), "close": lambda: made[0].close()}
        for name, call in steps.items():  # as the bench's restore: a read-only Tailor made, restore, close
            dist.barrier()
            if dist.get_rank() == 0:
                mark(f"{kind}-{name}")
            dist.barrier()
            call()
        dist.barrier()
        if dist.get_rank() == 0:
            mark()
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


def show(counted: collections.Counter) -> None:
    kinds: collections.Counter = collections.Counter()
    for (method, _), n in counted.items():
        kinds[method] += n
    print("   by kind: " + ", ".join(f"{method} {n}" for method, n in sorted(kinds.items())))
    for (method, key), n in sorted(counted.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"   {n:>4}  {method:<14} {key}")


def one_process(count: int, bucket: str) -> None:
    """A one-process restore of a run of ``count`` Parity saves of the tests' tiny model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import tiny, train

    from llmtailor import Parity, Tailor
    from llmtailor.training_example import corpus_tokens

    tokens, (model, opt, sched) = corpus_tokens(), tiny()
    with Tailor(f"s3://{bucket}/one", model, opt, sched, policy=Parity()) as tailor:
        for step in range(1, count + 1):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    with Tailor(f"s3://{bucket}/one", *tiny(), read_only=True) as tailor:
        mark("one-restore")
        tailor.restore()
        mark()


def main() -> None:
    args = arguments()
    if args.worker:
        worker(args.worker)
        return
    endpoint, seen, _ = serve()
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
             "AWS_ALLOW_HTTP": "true", "AWS_ENDPOINT_URL": endpoint}
    os.environ.update(creds)
    import boto3

    bucket = f"requests-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    if args.snapshots:
        one_process(args.snapshots, bucket)
        counted = collections.Counter(kind_of(m, p, q, r) for at, m, p, q, r in seen if at == "one-restore")
        print(f"\n== a one-process restore of a run of {args.snapshots} Parity saves: {sum(counted.values())} requests")
        show(counted)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_URL": f"s3://{bucket}",
           "BENCH_SIZES": json.dumps({k.replace("-", "_"): v for k, v in vars(args).items()}, default=str)}
    found = {}
    for kind in args.kinds.split(","):
        launch(f"{kind}-save", 3 if kind == "ddp" else 2, env)
        launch(f"{kind}-restore", 3, env)
        for step in ("open", "restore", "close"):
            counted = collections.Counter(kind_of(method, path, query, ranged)
                                          for at, method, path, query, ranged in seen if at == f"{kind}-{step}")
            found[f"{kind}-{step}"] = counted
            print(f"\n== a 3-rank restore of a {'3-rank DDP' if kind == 'ddp' else '2-rank FSDP2'} save, {step}: "
                  f"{sum(counted.values())} requests")
            show(counted)
    if args.json is not None:
        args.json.write_text(json.dumps({kind: [[m, k, n] for (m, k), n in sorted(c.items())] for kind, c in found.items()}))


if __name__ == "__main__":
    main()
