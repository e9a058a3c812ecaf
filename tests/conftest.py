import os
import shutil
import subprocess

import pytest
import torch

from llmtailor.training_example import corpus_tokens


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    """The real corpus (pydoc_data.topics) as byte tokens."""
    return corpus_tokens()


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or f'exit status {result.returncode}'}")
    try:
        yield mount
    finally:
        # A failed test may still hold the run's lock file open: detach the mount lazily then.
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount)], check=True)
