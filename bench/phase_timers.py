"""Where a restore's time goes, per phase: wall and thread CPU of the library's own functions,
by thread, measured by wrapping them (``bench_object_store.py`` with ``BENCH_PHASES=<folder>``).

Under load a phase's wall time is mostly waiting for a core; its thread CPU time
(``time.thread_time``: the CPU of the thread that ran it) moves much less. Each phase is timed
inclusively (a phase inside another counts in both), per thread kind (``main``, or the thread's
name without its number: ``llmtailor-read``, ``llmtailor-fetch``, ...). A generator (a read
plan's ``fetch``) is timed inside its own steps only, not while its caller uses what it gave.
Names missing from the tree measured (an older commit) are passed over, so one script times
both trees of a before/after pair.

    python bench/phase_timers.py <folder>    # the table of every rank's phases in <folder>
    python bench/phase_timers.py --timeline <folder> [label ...]   # each call's start and end, by rank

Each call of the labels in ``TIMELINE`` is also kept with its start and end (seconds from
``reset``), its thread and the first text argument it was given (an item's name), so that
which waits for which shows: the read plan's broadcasts one after another, say.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

PHASES = [
    ("llmtailor.tailor", "Tailor.__init__", "Tailor init"),
    ("llmtailor.tailor", "Tailor.restore", "restore (all)"),
    ("llmtailor.tailor", "_Restoring.plan", "choose + lease (rank 0), wait (others)"),
    ("llmtailor.store.shared_reads", "share_manifests", "share_manifests (lease)"),
    ("llmtailor.store.shared_reads", "share_small_files", "share_small_files"),
    ("llmtailor.providers.base", "StateProvider.check_composite", "check_composite"),
    ("llmtailor.providers.local", "LocalProvider.load_units", "load_units (DDP)"),
    ("llmtailor.providers.local", "LocalProvider._already_held", "frozen check (_already_held)"),
    ("llmtailor.providers.local", "LocalProvider._load_optimizer_and_scheduler", "optimizer + scheduler load"),
    ("llmtailor.providers.base", "copy_into", "copy into live tensors"),
    ("llmtailor.providers.fsdp", "FSDPProvider.load_units", "load_units (FSDP2)"),
    ("llmtailor.store.shared_ranges", "share_headers", "share_headers"),
    ("llmtailor.store.shared_ranges", "read_once", "read_once (ranges)"),
    ("llmtailor.store.shared_ranges", "_arrive_and_load", "arrive + load a group"),
    ("llmtailor.store.shared_ranges", "_Groups.take", "copy received parts"),
    ("llmtailor.store.dcp", "PlannedLoad.__init__", "DCP load plan"),
    ("llmtailor.store.dcp", "PlannedLoad.load", "DCP load of a unit"),
    ("llmtailor.store.dcp", "PlannedLoad.spans", "DCP spans"),
    ("llmtailor.providers.base", "StateProvider.finish_load", "finish_load"),
    ("llmtailor.providers.base", "StateProvider.restore_rank_state", "rank state"),
    ("llmtailor.frozen", "FrozenParts.restored", "frozen.restored"),
    ("llmtailor.store.lineage", "Lineage.restored", "lineage.restored"),
    ("llmtailor.distributed.coordinator", "StoreCoordinator.exchange", "coordinator exchange"),
    ("llmtailor.distributed.coordinator", "StoreCoordinator.broadcast", "coordinator broadcast"),
    ("llmtailor.distributed.coordinator", "Coordinator.agree", "coordinator agree"),
    ("llmtailor.distributed.read_plan", "ReadPlan.fetch", "read plan fetch (own steps)"),
    ("llmtailor.distributed.read_plan", "ReadPlan.deliver", "read plan deliver (own steps)"),
    ("llmtailor.distributed.read_plan", "ReadPlan._broadcast", "gloo broadcast"),
    ("llmtailor.distributed.read_plan", "ReadPlan._wait", "p2p wait"),
    ("llmtailor.distributed.read_plan", "ReadPlan._settle", "closing all-reduce"),
    ("llmtailor.distributed.read_plan", "_read_packed", "read + pack an item"),
    ("llmtailor.distributed.read_plan", "_read_into_message", "read an item into its message"),
    ("llmtailor.distributed.read_plan", "pack", "pack"),
    ("llmtailor.distributed.read_plan", "unpack", "unpack"),
    ("llmtailor.store.run", "Run.read_unit", "read_unit"),
    ("llmtailor.store.units", "UnitReader.read_small", "read a small file"),
    ("llmtailor.store.fetch", "fetch_into", "fetch_into"),
    ("llmtailor.store.fetch", "_Part.read", "GET of a part"),
    ("llmtailor.store.fetch", "_Part.done", "xxh3 (+ copy out) of a part"),
    ("llmtailor.store.storage.object_store", "ObjectStore.read", "request: GET whole"),
    ("llmtailor.store.storage.object_store", "ObjectStore.read_range", "request: GET range"),
    ("llmtailor.store.storage.object_store", "ObjectStore.read_start", "request: GET start + size"),
    ("llmtailor.store.storage.object_store", "ObjectStore.read_into", "request: GET into"),
    ("llmtailor.store.storage.object_store", "ObjectStore.size", "request: HEAD"),
    ("llmtailor.store.storage.object_store", "ObjectStore.put", "request: PUT"),
    ("llmtailor.store.storage.object_store", "ObjectStore.put_if", "request: conditional PUT"),
    ("llmtailor.store.storage.object_store", "ObjectStore.remove", "request: DELETE"),
    ("llmtailor.store.storage.object_store", "ObjectStore._children", "request: LIST"),
    ("torch.optim.optimizer", "Optimizer.load_state_dict", "Optimizer.load_state_dict"),
]

TIMELINE = {label for _, _, label in PHASES} - {"copy into live tensors", "unpack", "pack", "xxh3 (+ copy out) of a part"}

_records: dict[tuple[str, str], list[float]] = {}
_events: list[list] = []
_start = [time.perf_counter()]
_threads_at_start: dict[int, tuple[str, int, int]] = {}
_lock = threading.Lock()


def _threads() -> dict[int, tuple[str, int, int]]:
    """Each live thread of this process: id -> (name without its number, user ticks, system ticks),
    from /proc (the threads of gloo, obstore and torch too, which ``time.thread_time`` of ours
    does not see). Empty where /proc is not there."""
    threads = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
            name = re.sub(r"[-_:]?\d+$", "", stat[stat.index("(") + 1 : stat.rindex(")")])
            fields = stat.rsplit(")", 1)[1].split()
            threads[int(task.name)] = (name, int(fields[11]), int(fields[12]))
        except (OSError, ValueError, IndexError):
            continue
    return threads


def thread_cpu() -> dict[str, list[float]]:
    """CPU seconds (user, system) of this process's threads since ``reset``, by thread name
    (threads that ended meanwhile are not seen: the process's total says what they used)."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[str, list[float]] = {}
    for tid, (name, user, system) in _threads().items():
        _, user0, system0 = _threads_at_start.get(tid, (name, 0, 0))
        entry = used.setdefault(name, [0.0, 0.0])
        entry[0] += (user - user0) / tick
        entry[1] += (system - system0) / tick
    return {name: [round(u, 3), round(s, 3)] for name, (u, s) in sorted(used.items()) if u or s}


def _kind() -> str:
    thread = threading.current_thread()
    return "main" if thread is threading.main_thread() else re.sub(r"_\d+$", "", thread.name)


def _add(label: str, wall: float, cpu: float, started: float | None = None, args: tuple = ()) -> None:
    with _lock:
        entry = _records.setdefault((label, _kind()), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += wall
        entry[2] += cpu
        if started is not None and label in TIMELINE:
            text = next((a for a in args if isinstance(a, str)), "")
            _events.append([round(started - _start[0], 4), round(started + wall - _start[0], 4), round(cpu, 4),
                            label, _kind(), text[-48:]])


def _timed(fn, label: str):
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def steps(*a, **k):
            inner = fn(*a, **k)
            try:
                while True:
                    wall, cpu = time.perf_counter(), time.thread_time()
                    try:
                        value = next(inner)
                    except StopIteration:
                        return
                    finally:
                        _add(label, time.perf_counter() - wall, time.thread_time() - cpu, wall)
                    yield value
            finally:
                inner.close()
        return steps

    @functools.wraps(fn)
    def timed(*a, **k):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            _add(label, time.perf_counter() - wall, time.thread_time() - cpu, wall, a)
    return timed


def install() -> list[str]:
    """Wrap every phase the tree has; returns the labels of those it has not."""
    missing = []
    for module_name, path, label in PHASES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(label)
            continue
        owner_name, _, name = path.rpartition(".")
        owner = getattr(module, owner_name, None) if owner_name else module
        raw = vars(owner).get(name) if owner is not None else None
        if raw is None:
            missing.append(label)
            continue
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(_timed(raw.__func__, label)))
        elif owner is module:  # a function: also where other modules imported it by name
            wrapped = _timed(raw, label)
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith(("llmtailor", "torch.optim")) and vars(other).get(name) is raw:
                    setattr(other, name, wrapped)
        else:
            setattr(owner, name, _timed(raw, label))
    return missing


def reset() -> None:
    with _lock:
        _records.clear()
        _events.clear()
        _start[0] = time.perf_counter()
        _threads_at_start.clear()
        _threads_at_start.update(_threads())


def dump(path: Path, extra: dict) -> None:
    with _lock:
        phases = [[label, kind, *values] for (label, kind), values in _records.items()]
        events = sorted(_events)
    path.write_text(json.dumps({"phases": phases, "timeline": events, "threads_cpu": thread_cpu(), **extra}))


def table(folder: Path) -> None:
    """Every rank's phases of the files in ``folder``: calls, wall and CPU seconds, by thread."""
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        print(f"\n== {path.stem}: " + ", ".join(f"{k} {v}" for k, v in result.items() if k not in ("phases", "timeline")))
        print(f"{'phase':<46}{'thread':<18}{'calls':>6}{'wall s':>9}{'cpu s':>9}")
        order = {label: at for at, (_, _, label) in enumerate(PHASES)}
        for label, kind, calls, wall, cpu in sorted(result["phases"], key=lambda p: (order.get(p[0], 99), p[1])):
            print(f"{label:<46}{kind:<18}{calls:>6}{wall:>9.3f}{cpu:>9.3f}")


def timeline(folder: Path, labels: list[str]) -> None:
    """Every rank's timed calls (``TIMELINE``; those of ``labels`` where given), in start order:
    start and end (seconds from the restore's start), thread CPU, label, thread, item."""
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        print(f"\n== {path.stem}: seconds {result.get('seconds')}")
        for start, end, cpu, label, kind, text in result.get("timeline", []):
            if not labels or label in labels:
                print(f"{start:7.3f} {end:7.3f} {cpu:6.3f}  {label:<30}{kind:<18}{text}")


if __name__ == "__main__":
    if sys.argv[1] == "--timeline":
        timeline(Path(sys.argv[2]), sys.argv[3:])
    else:
        table(Path(sys.argv[1]))
