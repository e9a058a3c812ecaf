"""Errors llmtailor raises for a user's mistake or a damaged checkpoint, and OS errors in
plain words.

Every message names the file, key or value at fault and what was expected; the CLI prints
the message without a traceback and exits non-zero. A foundation module: it imports nothing of
llmtailor (every floor may import it).
"""

import errno
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class TailorError(Exception):
    """Base class: a problem the user can act on."""


class ConfigError(TailorError):
    """A policy, plan or option is invalid."""


class SnapshotNotFoundError(TailorError):
    """The run directory holds no committed snapshot (at the requested step)."""


class IntegrityError(TailorError):
    """A file is missing, truncated, or its checksum differs from the manifest's."""


class DamagedFileError(IntegrityError):
    """A file a committed snapshot records (the run's own, or one of the base model directory it
    keeps frozen tensors from) is missing, of another size, or its bytes differ from the checksum
    its manifest records: the run is damaged there (``verify`` names it). The CLI adds how to find every
    such file (``llmtailor verify``), by this type, whatever the message says."""


class IncompatibleModelError(TailorError):
    """The live model or optimizer does not match what the snapshot holds."""


class UnsupportedLayoutError(TailorError):
    """The ranks of a job hold layouts that cannot be saved as one run (models built differently,
    pipeline stages sharing a unit, stages under DeepSpeed): refused on every rank when the
    ``Tailor`` is built."""


class BackgroundSaveError(TailorError):
    """An async save failed in the background; nothing of it was committed. The original error
    is its ``__cause__``."""


class PromotionError(TailorError):
    """Copying a composite to a slower tier failed after its retries (``store/tiers/promote.py``);
    both tiers are as they were, and the composite stays in the faster one."""


class UnsupportedStateError(TailorError):
    """Some state cannot be stored without pickle (e.g. a callable in a scheduler)."""


class StorageError(TailorError, OSError):
    """An OS error met while reading or writing a run or an export: a TailorError whose message
    names the path and the reason in one line, and still an OSError (with the original
    ``errno``), so code that caught the OS error before catches this one."""

    def __init__(self, message: str, cause: OSError | None = None):
        super().__init__(message)
        if cause is not None:
            self.errno = os_errno(cause)

    def __str__(self) -> str:
        return str(self.args[0])


class NodeTierError(StorageError):
    """A node-local tier could not be written on some node(s) (``store/node_commit.py``): every
    rank raises it alike (the coordinator's ``ALIKE``), naming each node and why."""


# -- OS errors in plain words ------------------------------------------------------------------


_REASONS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "is a directory",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "already exists and is not empty",
    errno.ENODEV: "no such device (not a place to read or write files)",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "file name too long",
}
_BY_TYPE = ((PermissionError, errno.EACCES), (FileNotFoundError, errno.ENOENT), (FileExistsError, errno.EEXIST),
            (NotADirectoryError, errno.ENOTDIR), (IsADirectoryError, errno.EISDIR))


def os_errno(err: OSError) -> int | None:
    """``err``'s errno, also for errors raised without one (safetensors names it in the
    message, or by the exception's class only)."""
    if err.errno is not None:
        return err.errno
    found = re.search(r"os error (\d+)", str(err))
    if found:
        return int(found.group(1))
    return next((code for kind, code in _BY_TYPE if isinstance(err, kind)), None)


def describe_os_error(err: OSError, path: Path | str | None = None) -> str:
    """One line for an OS error: the path it concerns (the error's own, else ``path``) and the
    reason in plain words (``/run/x: permission denied``)."""
    code = os_errno(err)
    reason = _REASONS.get(code) or err.strerror or (os.strerror(code) if code else None) or str(err) or type(err).__name__
    where = err.filename if err.filename is not None else path
    if err.filename2 is not None:
        where = f"{where} -> {err.filename2}"
    return f"{where}: {reason}" if where is not None else reason


def describe_validation(error: "ValidationError", limit: int = 10) -> str:
    """Every problem of a pydantic ValidationError in one line, each naming its key."""
    problems = []
    for item in error.errors()[:limit]:
        key = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            problems.append(f"unknown key {key!r}")
        else:
            problems.append(f"key {key!r}: {message}" if key else message)
    more = len(error.errors()) - limit
    return "; ".join(problems) + (f"; ... ({more} more)" if more > 0 else "")
