"""Output directories outside a run (exports, merges): creating one with a private temporary
directory to write into, undoing that after a failure, and small side files copied or written
durably. (A run's own files: ``store.checked``, ``store.tensor_files``; durable local I/O:
``store.storage.local_durable``.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from llmtailor.errors import StorageError, TailorError, describe_os_error
from llmtailor.store.storage.local_durable import fsync_file, remove_empty


def write_text_durable(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    fsync_file(path)


def copy_durable(source: Path, target: Path) -> None:
    """Copy a small side file (a config, a tokenizer file) and fsync the copy."""
    shutil.copyfile(source, target)
    fsync_file(target)


def open_output(path: Path, prefix: str) -> tuple[Path, list[Path]]:
    """Create the output directory ``path`` (and its missing parents) and a private temporary
    directory in it (named ``prefix`` + random) for an export to write into and rename when
    whole. Returns the temporary directory and the directories created here, innermost first,
    for ``abandon_output``. An OS error becomes a TailorError naming the path, with nothing
    left behind."""
    import tempfile

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
