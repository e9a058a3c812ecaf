"""How many storage calls a look at a run makes, against the run's size: is any O(N^2)?

Runs of N = 8, 16 and 32 ``Parity`` snapshots of a tiny model on local disk; each look (steps,
latest_step, resolve, lineage, plan_retention, a reading lease, verify, the CLI's ``inspect``)
on a fresh ``Run`` of each, counted by a wrapper over ``LocalStorage``'s methods; then a save's
own calls at each step of a run of 32, without and with ``keep=2``. Counts, not times: they do
not depend on the machine's load.

    PYTHONPATH=. .venv/bin/python bench/store_calls.py
"""

from __future__ import annotations

import collections
import functools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import tiny, train  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from llmtailor import Parity, Tailor  # noqa: E402
from llmtailor.cli import app  # noqa: E402
from llmtailor.store.retention import plan_retention  # noqa: E402
from llmtailor.store.run import Run  # noqa: E402
from llmtailor.store.storage.local import LocalStorage  # noqa: E402

CALLS = ["size", "exists", "is_file", "read", "read_range", "read_start", "read_into", "mapped", "pieces", "list_dir",
         "walk", "put", "replace", "remove"]
counts: collections.Counter = collections.Counter()
TOKENS = torch.randint(0, 100, (4096,), generator=torch.Generator().manual_seed(0))
LOOKS = {
    "steps": lambda run: run.steps(),
    "latest_step": lambda run: run.latest_step(),
    "resolve": lambda run: run.resolve(),
    "lineage": lambda run: list(run.lineage()),
    "plan_retention(keep=2)": lambda run: plan_retention(run, 2),
    "reading (leases)": lambda run: run.reading().__enter__(),
    "verify": lambda run: run.verify(),
}


def counted(name: str) -> None:
    real = getattr(LocalStorage, name)

    @functools.wraps(real)
    def call(self, *args, **kwargs):
        counts[name] += 1
        return real(self, *args, **kwargs)

    setattr(LocalStorage, name, call)


def saved(root: Path, steps: int, keep: int | None = None) -> dict[int, int]:
    """A run of ``steps`` saves at ``root``: each save's storage calls."""
    model, optimizer, scheduler = tiny(layers=2)
    per_save = {}
    with Tailor(root, model, optimizer, scheduler, policy=Parity(), track_drift=False, keep=keep) as tailor:
        for step in range(1, steps + 1):
            train(model, optimizer, scheduler, TOKENS, [step])
            counts.clear()
            tailor.save(step)
            tailor.run.storage.commits.wait_purged()
            per_save[step] = sum(counts.values())
    return per_save


def looks(root: Path) -> dict[str, int]:
    """Each look's storage calls on a fresh ``Run`` of ``root``."""
    calls = {}
    for name, look in LOOKS.items():
        run = Run(root)
        counts.clear()
        look(run)
        calls[name] = sum(counts.values())
    counts.clear()
    result = CliRunner().invoke(app, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    calls["CLI inspect"] = sum(counts.values())
    return calls


def main() -> None:
    for name in CALLS:
        if hasattr(LocalStorage, name):
            counted(name)
    base = Path(tempfile.mkdtemp())
    sizes = (8, 16, 32)
    for n in sizes:
        saved(base / f"run{n}", n)
    table = {n: looks(base / f"run{n}") for n in sizes}
    print(f"{'look':24s}" + "".join(f"{f'N={n}':>8s}" for n in sizes) + "   32/16")
    for name in table[sizes[0]]:
        print(f"{name:24s}" + "".join(f"{table[n][name]:8d}" for n in sizes) + f"   {table[32][name] / max(table[16][name], 1):.2f}")
    for keep in (None, 2):
        per_save = saved(base / f"keep{keep}", 32, keep)
        print(f"a save's calls, keep={keep}:", {step: per_save[step] for step in (2, 4, 8, 16, 32)})


if __name__ == "__main__":
    main()
