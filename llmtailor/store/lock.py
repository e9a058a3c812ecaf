"""One writer per run: an exclusive advisory lock on ``RUN/.lock``.

``flock`` is released by the kernel when its holder exits, however it exits (SIGKILL
included), so a lock can never be left stale. Holding it also proves that nothing under
``.tmp/`` or ``.trash/`` belongs to a live writer: the holder clears both.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from pathlib import Path

from llmtailor.constants import LOCK_FILE, TMP_DIR, TRASH_DIR
from llmtailor.errors import TailorError


class WriterLock:
    """Exclusive write access to a run directory, held until ``release`` or process exit."""

    def __init__(self, root: Path):
        self.root = root
        self._handle = None

    @property
    def held(self) -> bool:
        return self._handle is not None

    def acquire(self) -> None:
        """Take the lock or raise TailorError naming the holder; then clear what crashed
        writers left behind."""
        if self.held:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        handle = open(self.root / LOCK_FILE, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown process"
            handle.close()
            raise TailorError(
                f"{self.root} is being written by another writer ({holder}); a run has one writer at a time"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._handle = handle
        for leftover in (TMP_DIR, TRASH_DIR):
            shutil.rmtree(self.root / leftover, ignore_errors=True)

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor releases the flock
            self._handle = None
