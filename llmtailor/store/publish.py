"""Writing a directory (or one file) outside a run so that it appears whole or not at all
(exports, merges).

    with publishing(out_dir, "checkpoint-500") as tmp:
        ...write files durably into tmp...
    # now out_dir/checkpoint-500 exists, complete

The files go into a private temporary directory beside the target (created with the mode an
ordinary ``mkdir`` gives, not ``mkdtemp``'s 0700, which would outlive the rename); when the
block ends without error the directory is fsynced, renamed into place atomically and its
parent fsynced. An existing target is never replaced (a ``ConfigError``, checked before any
byte is written and again at the rename), except an empty directory with ``replace_empty``.
On any failure the temporary directory, and every directory made for the output that is still
empty, are removed, and an OS error becomes a ``TailorError`` naming the path.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from llmtailor.errors import ConfigError
from llmtailor.store.files import abandon_output, open_output
from llmtailor.store.storage.local_durable import fsync_dir, fsync_file


@contextmanager
def publishing(parent: str | Path, name: str, *, replace_empty: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``parent/name`` when the block succeeds
    (module docstring)."""
    parent = Path(parent)
    target = parent / name

    def refuse_existing() -> None:
        if target.exists() and not (replace_empty and target.is_dir() and not any(target.iterdir())):
            raise ConfigError(f"{target} already exists; refusing to overwrite it (choose another -o)")

    refuse_existing()
    tmp, created = open_output(parent, f".{name}.tmp-")
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        fsync_dir(tmp)
        refuse_existing()  # os.rename would replace an empty directory made meanwhile
        if target.exists():
            target.rmdir()  # empty (replace_empty): the whole new directory takes its place
        os.rename(tmp, target)
        fsync_dir(parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise abandon_output(err, created, parent) from None


def publish_file(parent: str | Path, name: str, write: Callable[[Path], None]) -> Path:
    """``parent/name``, written by ``write(path)`` under a temporary name beside it, fsynced,
    then linked into place (an existing file is never replaced: a ``ConfigError``), the
    parent fsynced. On failure nothing is left, not even a directory made for it."""
    parent = Path(parent)
    target = parent / name
    if target.exists():
        raise ConfigError(f"{target} already exists; refusing to overwrite it (choose another -o)")
    tmp, created = open_output(parent, f".{name}.tmp-")
    try:
        write(tmp / name)
        fsync_file(tmp / name)
        os.chmod(tmp / name, 0o666 & ~_umask())
        try:
            os.link(tmp / name, target)  # unlike rename, never replaces a file made meanwhile
        except FileExistsError:
            raise ConfigError(f"{target} already exists; refusing to overwrite it (choose another -o)") from None
        shutil.rmtree(tmp)
        fsync_dir(parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise abandon_output(err, created, parent) from None
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
