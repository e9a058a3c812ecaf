"""Crash a real training process with SIGKILL, resume in a fresh one, compare bit for bit. The
uninterrupted run and the one killed are jobs forked at once (tests/e2e/conftest.py: each a
process of its own); the resume is a fresh interpreter of its own."""

import json
import subprocess
import sys

import pytest

from llmtailor import Run


def job(tmp_path, run, out, *flags):
    proc = subprocess.run(
        [sys.executable, "-m", "llmtailor.training_example", "--run", str(run), "--out", str(tmp_path / out), *flags],
        capture_output=True, text=True, timeout=1200,  # a bound on a hang (a fresh interpreter on a busy machine)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / out).read_text())


@pytest.mark.slow
def test_full_policy_resume_in_fresh_process_is_bitwise_identical(tmp_path, example_jobs):
    example = [sys.executable, "-m", "llmtailor.training_example"]
    (ref, _, ref_err), (crashed, _, crashed_err) = example_jobs.run([
        [*example, "--run", tmp_path / "ref", "--out", tmp_path / "ref.json"],
        [*example, "--run", tmp_path / "run", "--out", tmp_path / "crashed.json", "--kill-at", "8"],
    ])
    assert ref == 0, ref_err[-3000:]
    assert crashed == -9, f"exited with {crashed}:\n{crashed_err[-3000:]}"  # SIGKILLed
    reference = json.loads((tmp_path / "ref.json").read_text())
    assert Run(tmp_path / "run").latest_step() == 6 and Run(tmp_path / "run").verify() == []
    resumed = job(tmp_path, tmp_path / "run", "resumed.json", "--resume")
    assert resumed["losses"] == {k: v for k, v in reference["losses"].items() if int(k) > 6}
    assert resumed["params"] == reference["params"]
