"""Durable file I/O: checksummed writes, verified reads, atomic replacement.

Checksums are xxh3-64 over the exact bytes written, computed before the write so a file is
never read back to be hashed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as serialize_safetensors

from llmtailor.errors import IntegrityError
from llmtailor.store.manifest import FileEntry


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def write_durable(path: Path, data: bytes, root: Path) -> FileEntry:
    """Write ``data`` to ``path`` and fsync it; return its manifest entry relative to ``root``."""
    digest = checksum(data)
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return FileEntry(path=path.relative_to(root).as_posix(), bytes=len(data), xxh3_64=digest)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], root: Path) -> FileEntry:
    """Serialize ``tensors`` as one safetensors file, durably."""
    return write_durable(path, serialize_safetensors(tensors), root)


def read_verified(root: Path, entry: FileEntry) -> bytes:
    """The bytes of ``entry``'s file, after checking size and checksum against the manifest."""
    path = root / entry.path
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: file is missing") from None
    except OSError as err:
        raise IntegrityError(f"{path}: cannot read ({err.strerror})") from None
    if len(data) != entry.bytes:
        raise IntegrityError(f"{path}: {len(data)} bytes on disk, manifest says {entry.bytes} (truncated or replaced)")
    if checksum(data) != entry.xxh3_64:
        raise IntegrityError(f"{path}: checksum mismatch (file is corrupted)")
    return data


def read_tensors(root: Path, entry: FileEntry) -> dict[str, torch.Tensor]:
    """Load a verified safetensors file (never unpickles)."""
    data = read_verified(root, entry)
    try:
        return load_safetensors(data)
    except SafetensorError as err:
        raise IntegrityError(f"{root / entry.path}: not a valid safetensors file ({err})") from None


def check_file(root: Path, entry: FileEntry) -> str | None:
    """A problem with ``entry``'s file, or None when size and checksum match."""
    try:
        read_verified(root, entry)
    except IntegrityError as err:
        return str(err)
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
