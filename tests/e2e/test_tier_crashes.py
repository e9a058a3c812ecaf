"""Storage tiers under real crashes: a training process saving every step (async) to a host-memory
tier in front of its run directory is SIGKILLed; it resumes from the memory tier (at most the
save in flight lost), or, with the memory tier wiped (the node lost), from the run directory
(at most the saves since the last promotion lost); both resumed runs end bitwise equal to an
uninterrupted one. A process SIGKILLed in the middle of a promotion leaves both tiers whole."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from llmtailor import Run

SHM = Path("/dev/shm")
JOB = Path(__file__).parent / "tier_crash_job.py"
WAITING_JOB = Path(__file__).parent / "waiting_job.py"


@pytest.fixture
def memory(tmp_path):
    """A fresh directory in host memory (/dev/shm), removed afterwards."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = SHM / f"llmtailor-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def job(out: Path, *flags: str, expect: int = 0, promoted_at: str | None = None) -> tuple[dict | None, list[dict]]:
    """Run ``llmtailor.training_example``'s job; ``promoted_at`` (steps, comma-separated): through
    ``waiting_job.py``, which waits after those saves until their promotions have committed."""
    runner = ["-m", "llmtailor.training_example"] if promoted_at is None else [str(WAITING_JOB), promoted_at]
    proc = subprocess.run([sys.executable, *runner, "--out", str(out), *flags], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == expect, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return (json.loads(out.read_text()) if expect == 0 else None), lines


@pytest.mark.slow
def test_sigkill_resumes_from_memory_and_wiped_memory_from_disk(tmp_path, memory):
    steps = ["--steps", "14", "--save-every", "1"]
    reference, _ = job(tmp_path / "ref.json", "--run", str(tmp_path / "ref"), *steps)

    home = tmp_path / "home"
    tiered = [*steps, "--run", str(home), "--tier", str(memory), "--promote-every", "4", "--async"]
    # The job waits for the promotions of steps 1 and 5 (4 steps on): the run directory holds
    # them when the job goes on. Later ones (9, or 10) ran in the background and may or may not
    # have committed by the kill: what was promoted is read from the run directory itself.
    _, lines = job(tmp_path / "crashed.json", *tiered, "--kill-at", "10", expect=-signal.SIGKILL, promoted_at="1,5")
    assert max(line["step"] for line in lines if "step" in line) == 10
    in_memory, on_disk = Run(memory), Run(home)
    assert in_memory.verify() == [] and on_disk.verify() == []
    assert in_memory.latest_step() >= 9  # the async save of step 10 may have been in flight
    assert on_disk.steps()[:2] == [1, 5] and set(on_disk.steps()) <= {1, 5, 9, 10}
    assert on_disk.latest_step() <= in_memory.latest_step()
    saved_in_memory, saved_on_disk = in_memory.latest_step(), on_disk.latest_step()
    wiped_home = tmp_path / "home-copy"
    shutil.copytree(home, wiped_home)

    resumed, lines = job(tmp_path / "resumed.json", *tiered, "--resume")
    assert lines[0] == {"restored": saved_in_memory, "tier": str(memory)}
    assert resumed["params"] == reference["params"]

    shutil.rmtree(memory)  # the node is lost: only the run directory is left
    resumed, lines = job(tmp_path / "from-disk.json", *[*tiered[:-5], "--run", str(wiped_home), "--tier", str(memory),
                                                       "--promote-every", "4", "--async"], "--resume")
    assert lines[0] == {"restored": saved_on_disk, "tier": str(wiped_home)}
    assert resumed["params"] == reference["params"]
    assert Run(wiped_home).latest_step() == 14 and Run(wiped_home).verify() == []  # close() promoted the last save


@pytest.mark.slow
@pytest.mark.parametrize("point", ["file", "carrier", "manifest"])
def test_sigkill_during_promotion_leaves_both_tiers_whole(tmp_path, memory, point):
    """The job saves Parity composites at steps 1..4 (promote_every=3: step 1 and 4 promoted) and
    kills itself inside the promotion of step 4: in its first file, after the carrier (step 3,
    whose units the composite of step 4 needs) was committed, or just before the manifest of
    step 4. The memory tier restores step 4; the run directory still restores step 1; a new
    writer clears what the crash left and promotes again."""
    home = tmp_path / "home"
    proc = subprocess.run([sys.executable, str(JOB), str(home), str(memory), point], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    in_memory, on_disk = Run(memory), Run(home)
    assert in_memory.verify() == [] and in_memory.latest_step() == 4
    assert on_disk.verify() == [] and on_disk.latest_step() == 1
    assert on_disk.steps() == ([1, 3] if point != "file" else [1])
    proc = subprocess.run([sys.executable, str(JOB), str(home), str(memory), "resume"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"restored": 4, "tier": str(memory), "promoted_to_disk": 4}
    assert Run(home).latest_step() == 4 and Run(home).verify() == []
    assert not (home / ".tmp").exists() or not any((home / ".tmp").iterdir())


@pytest.mark.slow
def test_a_script_that_ends_without_close_commits_its_last_save_and_promotes_what_is_due(tmp_path, memory):
    script = tmp_path / "no_close.py"
    script.write_text(
        "from llmtailor import Parity, Tailor, Tier\n"
        "from llmtailor.training_example import batch_at, build_model, build_optimizer, corpus_tokens, job_config\n"
        "model = build_model(job_config(), seed=0)\n"
        "optimizer, scheduler = build_optimizer(model, total_steps=10)\n"
        f"tailor = Tailor({str(tmp_path / 'home')!r}, model, optimizer, scheduler, policy=Parity(), async_save=True,\n"
        f"                tiers=[Tier({str(memory)!r}, promote_every=1)])\n"
        "tokens = corpus_tokens()\n"
        "for step in range(1, 6):\n"
        "    batch = batch_at(tokens, step, 2, 32)\n"
        "    model(input_ids=batch, labels=batch).loss.backward()\n"
        "    optimizer.step()\n"
        "    scheduler.step()\n"
        "    optimizer.zero_grad(set_to_none=True)\n"
        "    tailor.save(step)\n"
        "# no close(): the save in flight is committed at exit, and its promotion (due) runs\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert Run(memory).latest_step() == 5 and Run(memory).verify() == []
    assert Run(tmp_path / "home").latest_step() == 5 and Run(tmp_path / "home").verify() == []
