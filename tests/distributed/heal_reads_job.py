"""The job of tests/distributed/test_heal_reads.py: the ``train`` and ``resume`` of
node_recovery_job.py (DDP or FSDP2 on gloo, each "node" a launch as ``torchrun --nnodes 2 --node_rank i``
launch with its own memory directory ``$NODE_DIR``, ``replicas=2``), the ``resume`` recording
which files of its node's copy each rank read during ``Tailor.restore`` (every ``LocalStorage``
read of file bytes: ``read``, ``pieces``, ``read_range``, ``read_into``) and a digest of its
restored model and optimizer state.

    python -m torch.distributed.run --nnodes 2 --node_rank I ... heal_reads_job.py SCENARIO KIND DIR [NAME=VALUE ...] ...

Several jobs in turn in one launch, each with its environment (``node_recovery_job.run_in_turn``).
Writes ``DIR/result-<scenario>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).parent))
from node_recovery_job import run_in_turn, save_steps, tailor_of  # noqa: E402
from torch_job import build, compare_with_composite, rank, versions  # noqa: E402

from llmtailor.store.storage.local import LocalStorage  # noqa: E402


@contextmanager
def recording_reads():
    """Every key of ``$NODE_DIR`` whose bytes a ``LocalStorage`` reads inside the block, in order,
    and (``mapped``) every key it maps (a healing's sender sends from the mapping)."""
    memory, read, mapped = Path(os.environ["NODE_DIR"]).resolve(), [], []
    methods = {method: getattr(LocalStorage, method) for method in ("read", "pieces", "read_range", "read_into", "mapped")}
    for method, real in methods.items():

        def recorded(self, key, *args, real=real, into=mapped if method == "mapped" else read, **kwargs):
            if Path(self.root).resolve() == memory:
                into.append(key)
            return real(self, key, *args, **kwargs)

        setattr(LocalStorage, method, recorded)
    try:
        yield read, mapped
    finally:
        for method, real in methods.items():
            setattr(LocalStorage, method, real)


def digest(model, optimizer) -> str:
    """xxh3 of every tensor's full value (collective under FSDP2)."""
    hashed = xxhash.xxh3_64()
    for key, tensor in sorted(versions(model, optimizer).items()):
        hashed.update(key.encode() + tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


def resume(kind: str, out: Path) -> dict:
    model, optimizer, scheduler = build(kind, seed=5)
    tailor = tailor_of(model, optimizer, scheduler)
    with recording_reads() as (read, mapped):
        report = tailor.restore()
        tailor.close()
    held = sorted(str(p.relative_to(os.environ["NODE_DIR"])) for p in Path(os.environ["NODE_DIR"]).rglob("*") if p.is_file())
    return {"restored": report.step, "tier": str(report.tier), "served_by": report.served_by, "skipped": report.skipped,
            "read": sorted(set(read)),
            "mapped": sorted(set(mapped)),
            "held": held, "digest": digest(model, optimizer),
            "mismatches": compare_with_composite(out, report.tier, model, optimizer)}


def run_job(scenario: str, kind: str, out: Path) -> None:
    if scenario == "train":
        model, optimizer, scheduler = build(kind, seed=0)
        tailor = tailor_of(model, optimizer, scheduler)
        save_steps(tailor, model, optimizer, scheduler, out, 1, int(os.environ["LAST"]))
        tailor.close()
        result = {}
        del model, optimizer, scheduler, tailor  # the DDP model gone before the group is destroyed (bench_object_store.worker: pytorch#56297)
    else:
        result = resume(kind, out)
    (out / f"result-{scenario}-{rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_in_turn(run_job)
