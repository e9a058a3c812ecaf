"""Crash a real training process with SIGKILL, resume in a fresh one, compare bit for bit. The
uninterrupted run and the one killed are jobs forked from one launch (forked_jobs.py: each a
process of its own); the resume is a fresh interpreter of its own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from forked_jobs import run_jobs

from llmtailor import Run

JOB = Path(__file__).with_name("example_job.py")


def job(tmp_path, run, out, *flags):
    proc = subprocess.run(
        [sys.executable, "-m", "llmtailor.training_example", "--run", str(run), "--out", str(tmp_path / out), *flags],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / out).read_text())


@pytest.mark.slow
def test_full_policy_resume_in_fresh_process_is_bitwise_identical(tmp_path):
    done = run_jobs(JOB, {
        "ref": (["--run", tmp_path / "ref", "--out", tmp_path / "ref.json"], tmp_path / "ref.json"),
        "crashed": (["--run", tmp_path / "run", "--out", tmp_path / "crashed.json", "--kill-at", "8"],
                    tmp_path / "crashed.json"),
    }, tmp_path / "jobs", together=True)
    reference = done["ref"].result()
    done["crashed"].result(crash=True)  # SIGKILLed (status -9)
    assert Run(tmp_path / "run").latest_step() == 6 and Run(tmp_path / "run").verify() == []
    resumed = job(tmp_path, tmp_path / "run", "resumed.json", "--resume")
    assert resumed["losses"] == {k: v for k, v in reference["losses"].items() if int(k) > 6}
    assert resumed["params"] == reference["params"]
