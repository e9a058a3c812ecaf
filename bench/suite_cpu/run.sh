#!/usr/bin/env bash
# The CPU and the processes of a test run, per test file, for comparing two trees side by side:
#   bench/suite_cpu/run.sh OUT TREE [pytest arguments...]
# runs pytest in TREE (its own code imported first) and writes OUT.jsonl (per file: wall, CPU of
# pytest and of its reaped children, load; cpufile.py), OUT.procs (each interpreter started or
# forked; sitecustomize.py) and OUT.out (pytest's output, /usr/bin/time -v's summary).
set -uo pipefail
OUT=$(realpath -m "$1"); TREE=$(realpath "$2"); shift 2
HERE=$(dirname "$(realpath "$0")")
PY=${PY:-$(dirname "$HERE")/../.venv/bin/python}
echo "start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" > "$OUT.out"
cd "$TREE" && CPUFILE_OUT="$OUT.jsonl" LLMT_PROC_LOG="$OUT.procs" PYTHONPATH="$TREE:$HERE" \
  /usr/bin/time -v "$PY" -m pytest -q -p no:cacheprovider -p cpufile --durations=40 "$@" >> "$OUT.out" 2>&1
echo "rc=$? end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT.out"
