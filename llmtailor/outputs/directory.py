"""Opening an output: the one way a directory (or one file) outside a run is written so that it
appears whole or not at all (exports, merges), and the one way a scratch directory is made
beside an output.

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

``Scratch`` is a temporary directory beside an output (the same filesystem) for what a source
must copy before it can be read (DeepSpeed's conversion), made only when first asked for and
removed with everything in it when its block ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from llmtailor.errors import ConfigError, StorageError, TailorError, describe_os_error
from llmtailor.store.storage.local_durable import fsync_dir, fsync_file, remove_empty


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


class Scratch:
    """A temporary directory beside the output ``out`` (module docstring); for an output at a
    URL (or none), in the system's temporary directory. ``get()`` makes it on first use; the
    block's end (or ``remove()``) removes it, and the directories made for it while empty."""

    def __init__(self, out: Path | None, purpose: str):
        self.out, self.purpose = out, purpose
        self.path: Path | None = None
        self._created: list[Path] = []

    def get(self) -> Path:
        if self.path is None:
            if self.out is None:
                self.path = Path(tempfile.mkdtemp(prefix=f"llmtailor-{self.purpose}-"))
            else:
                self.path, self._created = open_output(self.out.parent, f".{self.out.name}.{self.purpose}-")
        return self.path

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            remove_empty(self._created)
            self.path = None

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def open_output(path: Path, prefix: str) -> tuple[Path, list[Path]]:
    """Create the output directory ``path`` (and its missing parents) and a private temporary
    directory in it (named ``prefix`` + random) for an export to write into and rename when
    whole. Returns the temporary directory and the directories created here, innermost first,
    for ``abandon_output``. An OS error becomes a TailorError naming the path, with nothing
    left behind."""
    path = Path(path)
    created: list[Path] = []
    try:
        if path.exists() and not path.is_dir():
            raise TailorError(f"{path}: is a file, not a directory; choose another output directory")
        created = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=path)), created
    except OSError as err:
        remove_empty(created)
        raise StorageError(f"cannot create the output directory: {describe_os_error(err, path)}", err) from None


def abandon_output(err: BaseException, created: list[Path], path: Path) -> BaseException:
    """After a failed export (its temporary directory removed): remove the directories
    ``open_output`` created, if still empty, so a failure leaves no empty directory; return
    the error to raise (an OS error as a TailorError naming the path and the reason)."""
    remove_empty(created)
    if isinstance(err, OSError):
        return StorageError(f"{describe_os_error(err, path)}; nothing was written to {path}", err)
    return err


def write_text_durable(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    fsync_file(path)


def copy_durable(source: Path, target: Path) -> None:
    """Copy a small side file (a config, a tokenizer file) and fsync the copy."""
    shutil.copyfile(source, target)
    fsync_file(target)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
