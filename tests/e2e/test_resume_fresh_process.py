"""Crash a real training process with SIGKILL, resume in a fresh one, compare bit for bit."""

import json
import signal
import subprocess
import sys

import pytest

from llmtailor import Run


def job(tmp_path, run, out, *flags, expect=0):
    proc = subprocess.run(
        [sys.executable, "-m", "llmtailor.training_example", "--run", str(run), "--out", str(tmp_path / out), *flags],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == expect, proc.stderr[-3000:]
    return json.loads((tmp_path / out).read_text()) if expect == 0 else None


@pytest.mark.slow
def test_full_policy_resume_in_fresh_process_is_bitwise_identical(tmp_path):
    reference = job(tmp_path, tmp_path / "ref", "ref.json")
    job(tmp_path, tmp_path / "run", "crashed.json", "--kill-at", "8", expect=-signal.SIGKILL)
    assert Run(tmp_path / "run").latest_step() == 6 and Run(tmp_path / "run").verify() == []
    resumed = job(tmp_path, tmp_path / "run", "resumed.json", "--resume")
    assert resumed["losses"] == {k: v for k, v in reference["losses"].items() if int(k) > 6}
    assert resumed["params"] == reference["params"]
