"""The job of tests/distributed/test_heal_reads.py: the ``train`` and ``resume`` of
node_recovery_job.py (DDP or FSDP2 on gloo, each "node" a ``torchrun --nnodes 2 --node_rank i``
launch with its own memory directory ``$NODE_DIR``, ``replicas=2``), the ``resume`` recording
which files of its node's copy each rank read during ``Tailor.restore`` (every ``LocalStorage``
read of file bytes: ``read``, ``pieces``, ``read_range``, ``read_into``) and a digest of its
restored model and optimizer state.

    python -m torch.distributed.run --nnodes 2 --node_rank I ... heal_reads_job.py SCENARIO KIND DIR

Writes ``DIR/result-<scenario>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

sys.path.insert(0, str(Path(__file__).parent))
from node_recovery_job import save_steps, tailor_of  # noqa: E402
from torch_job import build, compare_with_composite, rank, versions  # noqa: E402

from llmtailor.store.storage.local import LocalStorage  # noqa: E402


def recording_reads() -> list[str]:
    """Every key of ``$NODE_DIR`` whose bytes a ``LocalStorage`` reads from now on, in order."""
    memory, read = Path(os.environ["NODE_DIR"]).resolve(), []
    for method in ("read", "pieces", "read_range", "read_into"):
        real = getattr(LocalStorage, method)

        def recorded(self, key, *args, real=real, **kwargs):
            if Path(self.root).resolve() == memory:
                read.append(key)
            return real(self, key, *args, **kwargs)

        setattr(LocalStorage, method, recorded)
    return read


def digest(model, optimizer) -> str:
    """xxh3 of every tensor's full value (collective under FSDP2)."""
    hashed = xxhash.xxh3_64()
    for key, tensor in sorted(versions(model, optimizer).items()):
        hashed.update(key.encode() + tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


def resume(kind: str, out: Path) -> dict:
    model, optimizer, scheduler = build(kind, seed=5)
    tailor = tailor_of(model, optimizer, scheduler)
    read = recording_reads()
    report = tailor.restore()
    tailor.close()
    held = sorted(str(p.relative_to(os.environ["NODE_DIR"])) for p in Path(os.environ["NODE_DIR"]).rglob("*") if p.is_file())
    return {"restored": report.step, "tier": report.tier, "served_by": report.served_by, "read": sorted(set(read)),
            "held": held, "digest": digest(model, optimizer),
            "mismatches": compare_with_composite(out, report.tier, model, optimizer)}


def main() -> None:
    scenario, kind, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out.mkdir(parents=True, exist_ok=True)
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
