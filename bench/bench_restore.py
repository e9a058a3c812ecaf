"""Restore of a composite against reading its bytes once (issue 33), side by side in one run:

1. **Local.** A Parity run of two saves (the composite of the second takes half its layers from
   the first). Each repeat, with the page cache of every file of the run dropped first
   (``posix_fadvise(DONTNEED)`` per file: cold, as after a reboot, without touching other
   processes' cache): a plain read of the files the restore reads (each once, in 16 MiB pieces
   into one buffer, no checksum), then ``Tailor.restore`` into a fresh model and optimizer.
   Target: restore <= 1.2x the plain read. A warm pair (nothing dropped) is printed too.
2. **Object store** (moto's S3 server on loopback). The same two saves to ``s3://``; each
   repeat: one ``download_file`` by boto3's transfer manager (its defaults: 8 MB parts, 10
   threads) of one object holding the same bytes the restore reads, then ``Tailor.restore``
   from the URL, then the same restore with the ranged reads one after another
   (``fetch.PART`` set past every range: each range in one request, as before issue 33).
   Target: restore <= 1.3x boto3's download.

Medians over ``--repeats``; bytes the restore read are counted through the store's reads.

    .venv/bin/python bench/bench_restore.py --layers 4 --hidden 512 --intermediate 1792 --vocab 16000 --repeats 3
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_object_store import CREDS, model_and_state, new_bucket, s3  # noqa: E402
from common import MB, model_arguments, scratch  # noqa: E402

PIECE = 16 << 20


def composite_files(run, step: int) -> list[str]:
    """Keys of every file a restore of the composite of ``step`` reads: the manifests of the
    snapshots it needs, the global state, each unit's index and tensor files."""
    from llmtailor.constants import MANIFEST_FILE

    composite = run.resolve(step)
    keys = [f"{run.snapshot_key(s)}/{MANIFEST_FILE}" for s in run.needs(composite)]
    keys += [f"{run.snapshot_key(step)}/{f.path}" for f in run.manifest(step).files]
    for unit, source in composite.sources.items():
        ref = run.manifest(source).units[unit]
        keys.append(f"{run.snapshot_key(source)}/{ref.index.path}")
        keys += [run.file_location(source, f)[1] for f in run.unit_entry(source, unit).files]
    return list(dict.fromkeys(keys))


def drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_read(root: Path, keys: list[str]) -> int:
    """Read every file once, in pieces into one buffer; the bytes read."""
    buffer, total = memoryview(bytearray(PIECE)), 0
    for key in keys:
        with open(root / key, "rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                total += count
    return total


def save_two(location, args) -> None:
    from llmtailor import Parity, Tailor

    model, optimizer = model_and_state(args)
    with Tailor(location, model, optimizer, policy=Parity(), track_drift=False) as tailor:
        tailor.save(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        tailor.save(2)


def restore(location, args) -> float:
    from llmtailor import Tailor

    torch.manual_seed(1)
    model, optimizer = model_and_state(args)
    tailor = Tailor(location, model, optimizer, track_drift=False, read_only=True)
    start = time.perf_counter()
    tailor.restore()
    return time.perf_counter() - start


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def phase_local(args, out: Path) -> None:
    from llmtailor import Run

    root = out / "local"
    save_two(root, args)
    keys = composite_files(Run(root), 2)
    size = sum((root / k).stat().st_size for k in keys)
    print(f"\n== local: the composite of step 2 reads {len(keys)} files, {size / MB:.1f} MB")
    results: dict[str, list[float]] = {"cold plain read": [], "cold restore": [], "warm plain read": [], "warm restore": []}
    for _ in range(args.repeats):
        drop_cache(root)
        results["cold plain read"].append(timed(lambda: plain_read(root, keys)))
        drop_cache(root)
        results["cold restore"].append(restore(root, args))
        results["warm plain read"].append(timed(lambda: plain_read(root, keys)))
        results["warm restore"].append(restore(root, args))
    report(results, size, [("cold restore", "cold plain read", 1.2), ("warm restore", "warm plain read", None)])


def phase_object_store(args, out: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    from llmtailor import Run
    from llmtailor.store import fetch

    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(args.port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        os.environ.update({**CREDS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{args.port}"})
        for _ in range(300):
            try:
                s3().list_buckets()
                break
            except Exception:
                time.sleep(0.1)
        bucket = new_bucket()
        url = f"s3://{bucket}/run"
        save_two(url, args)
        run = Run(url)
        keys = composite_files(run, 2)
        blob = out / "blob"
        with open(blob, "wb") as handle:
            for key in keys:
                handle.write(bytes(run.storage.read(key)))
        size = blob.stat().st_size
        client, transfer = s3(), TransferConfig()
        client.upload_file(str(blob), bucket, "blob", Config=transfer)
        print(f"\n== object store (moto on loopback): the composite of step 2 reads {len(keys)} objects, {size / MB:.1f} MB")
        results: dict[str, list[float]] = {"boto3 download_file": [], "restore": [], "restore, sequential": []}
        whole = fetch.PART
        for _ in range(args.repeats):
            results["boto3 download_file"].append(
                timed(lambda: client.download_file(bucket, "blob", str(out / "downloaded"), Config=transfer)))
            results["restore"].append(restore(url, args))
            fetch.PART = 1 << 62  # each range in one request, one after another
            try:
                results["restore, sequential"].append(restore(url, args))
            finally:
                fetch.PART = whole
        report(results, size, [("restore", "boto3 download_file", 1.3), ("restore, sequential", "boto3 download_file", None)])
    finally:
        proc.terminate()
        proc.wait()


def report(results: dict[str, list[float]], size: int, ratios: list[tuple[str, str, float | None]]) -> None:
    print(f"{'contender':<22}{'seconds':>9}{'MB/s':>8}")
    med = {name: statistics.median(values) for name, values in results.items()}
    for name, seconds in med.items():
        print(f"{name:<22}{seconds:>9.3f}{size / MB / seconds:>8.0f}")
    for name, base, target in ratios:
        ratio = med[name] / med[base]
        verdict = f" (target <= {target}x): {'PASS' if ratio <= target else 'FAIL'}" if target else ""
        print(f"  {name} / {base}: {ratio:.3f}x{verdict}")


def main() -> None:
    import socket

    args = model_arguments(__doc__, lambda parser: parser.add_argument(
        "--local-only", action="store_true", help="the local phase alone (no moto server)"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        args.port = sock.getsockname()[1]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}")
    with scratch(args.out, "restore") as out:
        phase_local(args, out)
        if not args.local_only:
            phase_object_store(args, out)


if __name__ == "__main__":
    main()
