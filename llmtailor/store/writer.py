"""Writing a snapshot: staged state in, one committed directory out.

Staging (``StagedSnapshot``) is separate from writing (``persist``): a synchronous save stages
references to the live tensors and persists at once, one unit in memory at a time; an async
save stages private copies and persists them on a background thread. Persisting follows the
commit protocol: write every file into a private temporary directory and fsync it, write
the manifest last and fsync it, rename the directory into ``snapshots/`` atomically, fsync
``snapshots/``, then replace the ``latest`` pointer atomically. A crash at any instant leaves
every earlier snapshot and the previous composite loadable; a failure removes the partial
temporary directory.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from llmtailor.constants import (
    GLOBAL_JSON,
    GLOBAL_TENSORS,
    LATEST_FILE,
    MANIFEST_FILE,
    SCHEMA_VERSION,
    UNITS_DIR,
    snapshot_dirname,
)
from llmtailor.errors import TailorError
from llmtailor.store.files import fsync_dir, replace_text_atomically, write_durable, write_tensors
from llmtailor.store.manifest import Chunk, FileEntry, Manifest, TensorEntry, UnitEntry, dtype_name
from llmtailor.store.run import Run


@dataclass
class StagedUnit:
    """One unit's state, ready to write. ``tensors`` maps ``weight/<param>``,
    ``optim/<param>/<key>`` ... to tensors (live references for a synchronous save);
    ``values`` holds non-tensor optimizer state by parameter name."""

    unit: str
    tensors: dict[str, torch.Tensor]
    values: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class StagedSnapshot:
    step: int
    parent: int | None
    save_index: int
    policy: str
    layout: dict[str, Any]
    units: Iterable[StagedUnit]
    """Iterated once, in order: a generator stages one unit at a time (bounded memory)."""
    composite: dict[str, int]
    # Global state, already encoded (``tree.encode``) so it is a copy taken at staging time.
    global_doc: Any
    global_tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class PersistResult:
    path: Path
    bytes: int
    seconds: float
    unit_bytes: dict[str, int]
    pointer_error: str | None = None
    """Set when the snapshot was committed but the ``latest`` pointer could not be replaced."""


def counting(progress: Callable[[str, int, int], None] | None, total: int) -> Callable[[str, int], None]:
    """Adapt a ``progress(unit, done, total)`` callback (the CLI's bars) to ``persist``'s
    ``on_unit(unit, bytes)``."""
    done = 0

    def on_unit(unit: str, _bytes: int) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(unit, done, total)

    return on_unit


def persist(run: Run, staged: StagedSnapshot, on_unit: Callable[[str, int], None] | None = None) -> PersistResult:
    """Write ``staged`` into ``run`` and commit it. ``on_unit(unit, bytes)`` reports progress."""
    start = time.perf_counter()
    final = run.snapshot_dir(staged.step)
    if final.exists():
        raise TailorError(f"{final} already exists; refusing to overwrite a committed snapshot")
    run.tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = run.tmp_dir / f"{snapshot_dirname(staged.step)}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        (tmp / UNITS_DIR).mkdir(parents=True)
        files: list[FileEntry] = []
        units: dict[str, UnitEntry] = {}
        unit_bytes: dict[str, int] = {}
        for staged_unit in staged.units:
            entry, file = _write_unit(tmp, staged_unit)
            units[staged_unit.unit] = entry
            files.append(file)
            unit_bytes[staged_unit.unit] = file.bytes
            if on_unit:
                on_unit(staged_unit.unit, file.bytes)
        files.append(write_tensors(tmp / GLOBAL_TENSORS, staged.global_tensors, tmp))
        files.append(write_durable(tmp / GLOBAL_JSON, json.dumps(staged.global_doc).encode(), tmp))
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            step=staged.step,
            parent=staged.parent,
            save_index=staged.save_index,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            policy=staged.policy,
            layout=staged.layout,
            units=units,
            composite=staged.composite,
            files=files,
        )
        # The manifest is written last: a directory without one is not a snapshot.
        write_durable(tmp / MANIFEST_FILE, manifest.dumps().encode(), tmp)
        fsync_dir(tmp / UNITS_DIR)
        fsync_dir(tmp)
        run.snapshots_dir.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, final)
        fsync_dir(run.snapshots_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise TailorError(
                f"no space left on the device of {run.root} while saving step {staged.step}; "
                "the partial snapshot was removed and earlier snapshots are intact"
            ) from None
        raise
    pointer_error = None
    try:
        replace_text_atomically(run.root / LATEST_FILE, final.name + "\n")
    except OSError as err:
        # The snapshot is committed and loadable: its manifest names its parent, which the old
        # pointer names, so Run.latest_step() finds it. Report, do not undo.
        reason = "no space left on the device" if err.errno in (errno.ENOSPC, errno.EDQUOT) else err.strerror
        pointer_error = (
            f"step {staged.step} was saved and committed in {run.root}, but its {LATEST_FILE} pointer "
            f"could not be updated ({reason}); restore still finds step {staged.step} through its parent link"
        )
    total = sum(f.bytes for f in files) + (final / MANIFEST_FILE).stat().st_size
    return PersistResult(
        path=final, bytes=total, seconds=time.perf_counter() - start, unit_bytes=unit_bytes, pointer_error=pointer_error
    )


def _write_unit(tmp: Path, staged: StagedUnit) -> tuple[UnitEntry, FileEntry]:
    relpath = f"{UNITS_DIR}/{staged.unit}.safetensors"
    tensors = {key: t.detach().contiguous() for key, t in staged.tensors.items()}
    file = write_tensors(tmp / relpath, tensors, tmp)
    entries = [
        TensorEntry(
            key=key,
            dtype=dtype_name(t.dtype),
            shape=list(t.shape),
            chunks=[Chunk(file=relpath, key=key, offsets=[0] * t.dim(), shape=list(t.shape))],
        )
        for key, t in tensors.items()
    ]
    return UnitEntry(tensors=entries, values=staged.values), file
