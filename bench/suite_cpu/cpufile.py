"""A pytest plugin (``-p cpufile``, with this folder on PYTHONPATH): per test file, the wall and
the CPU seconds of pytest itself and of its reaped children (``resource.getrusage``), one JSON
line each into ``$CPUFILE_OUT``. A fork server that outlives a file is charged to the file in
which it ends: sum a directory's lines for its true CPU."""

import json
import os
import resource
import time

_OUT = os.environ.get("CPUFILE_OUT", "cpufile.jsonl")
_state: dict = {"file": None}


def _snap() -> tuple[float, float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _load() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _close() -> None:
    if _state["file"] is None:
        return
    (wall, own, children), (wall0, own0, children0) = _snap(), _state["start"]
    with open(_OUT, "a") as out:
        out.write(json.dumps({"file": _state["file"], "wall": round(wall - wall0, 2), "self": round(own - own0, 2),
                              "children": round(children - children0, 2), "start_load": _state["load"],
                              "load": _load(), "t": time.strftime("%H:%M:%S")}) + "\n")


def pytest_runtest_logstart(nodeid, location):
    file = nodeid.split("::")[0]
    if file != _state["file"]:
        _close()
        _state.update(file=file, start=_snap(), load=_load())


def pytest_sessionfinish(session):
    _close()
    _state["file"] = None
