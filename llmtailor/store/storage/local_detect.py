"""Whether a local directory is a run, or may become one; and, where it is neither, what it is.

The storage floor knows no other format: what else a directory may be (a Hugging Face Trainer
checkpoint, a DeepSpeed checkpoint, a model directory) is told to it from above
(``recognise_other_formats``: the package wires in ``interop.formats``), so a writer refused
there names what it found.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmtailor.constants import LATEST_FILE, LOCK_FILE, SNAPSHOTS_DIR
from llmtailor.errors import StorageError, describe_os_error
from llmtailor.store.storage.strategies import RunDetection

Recogniser = Callable[[Path], "str | None"]
"""What a local directory (or file) that is not a run is (``a DeepSpeed checkpoint (...)``: a phrase
that follows "is"), or None when it is not of the recogniser's format."""

_RECOGNISERS: list[Recogniser] = []


def recognise_other_formats(*recognisers: Recogniser) -> None:
    """Add ``recognisers`` to those ``describe_non_run`` asks, in order (each once)."""
    for recogniser in recognisers:
        if recogniser not in _RECOGNISERS:
            _RECOGNISERS.append(recogniser)


class LocalDetection(RunDetection):
    """Run detection of the local directory ``root``."""

    def __init__(self, root: Path):
        self.root = root

    def describe_non_run(self) -> str | None:
        return describe_non_run(self.root)

    def is_fresh(self) -> bool:
        try:
            return not self.root.exists() or (self.root.is_dir() and not any(self.root.iterdir()))
        except OSError as err:
            raise StorageError(describe_os_error(err, self.root), err) from None


def describe_non_run(path: Path) -> str | None:
    """Why ``path`` is not an llmtailor run directory, or None when it is one: a directory
    holding ``snapshots/``, ``latest`` or ``.lock`` (what a writer leaves)."""
    try:
        if not path.exists():
            return f"{path}: no such run directory"
        if path.is_dir() and any((path / name).exists() for name in (SNAPSHOTS_DIR, LATEST_FILE, LOCK_FILE)):
            return None
        kind = next((kind for recognise in _RECOGNISERS if (kind := recognise(path))), None)
    except OSError as err:
        return describe_os_error(err, path)
    if kind:
        return f"{path}: is {kind}, not an llmtailor run"
    if not path.is_dir():
        return f"{path}: is a file, not a run directory"
    return f"{path}: not an llmtailor run directory (no {SNAPSHOTS_DIR}/ in it)"
