"""The lazy source contract: a checkpoint read headers first, then only the bytes asked for.

Every kind of source (a tailored run, ``interop/tailored.py``; a ``save_pretrained`` model
directory or a Trainer ``checkpoint-N/``, ``interop/hf/reader.py``; a DeepSpeed checkpoint,
imported then read as a run) answers the same questions about a unit — which tensors it holds,
with their dtypes and shapes; their values (``ByteSource`` where the stored bytes can be copied
as they are); its non-tensor optimizer values — and about its training state. Merge plans and
imports read through it. Invariant: nothing is read before it is asked for, and a tensor's
bytes are checked against the checksum its source recorded where it recorded one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.constants import SNAPSHOTS_DIR
from llmtailor.errors import ConfigError, IntegrityError
from llmtailor.layouts import Layout
from llmtailor.store import dtypes
from llmtailor.store.tensor_files import ByteSource, read_header

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    """By name, as a manifest writes it (``float32``)."""
    shape: tuple[int, ...]
    step: int | None = None
    """The snapshot that saved this version (a run's composite), for the dry run."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


class Source(ABC):
    """A checkpoint read lazily (module docstring)."""

    label: str
    layout: Layout
    step: int | None
    """The step its state belongs to (None: a model directory, which has no training state)."""
    config: dict[str, Any] | None
    """Its Hugging Face model config."""
    kind: str

    @abstractmethod
    def has_optimizer(self) -> bool:
        """Whether it holds optimizer state."""

    @abstractmethod
    def tensors(self, unit: str, optimizer: bool) -> dict[str, TensorInfo]:
        """Tensor key -> dtype and shape of ``unit`` (``optim/`` keys only with ``optimizer``)."""

    @abstractmethod
    def read(self, unit: str, key: str) -> torch.Tensor | ByteSource:
        """The value of a tensor: its bytes where they can be copied as they are."""

    def values(self, unit: str) -> dict[str, dict[str, Any]]:
        """Non-tensor optimizer state of ``unit`` by parameter name (as stored: JSON-encoded)."""
        return {}

    def global_state(self, optimizer: bool = True) -> dict[str, Any] | None:
        """Step, optimizer groups (by name), LR scheduler, RNG, model config, extras; None for a
        source without training state. ``optimizer=False``: without optimizer groups and LR
        scheduler (a source may then skip reading them)."""
        return None

    def tokenizer_files(self) -> list[Path]:
        return []

    def close(self) -> None:
        pass


_HEADERS: dict[tuple[Path, int, int], tuple[int, dict[str, Any]]] = {}


def layout_of(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's data offset and header, read once per version of the file."""
    try:
        stat = path.stat()
        key = (path, stat.st_mtime_ns, stat.st_size)
        if key not in _HEADERS:
            if len(_HEADERS) > 512:
                _HEADERS.clear()
            _HEADERS[key] = read_header(path)
        return _HEADERS[key]
    except FileNotFoundError:
        raise IntegrityError(f"{path}: file is missing") from None
    except (OSError, ValueError) as err:
        raise IntegrityError(f"{path}: not a readable safetensors file ({err})") from None


def refuse_a_run(path: Path, format: str, what: str) -> None:
    """ConfigError when ``path`` is already an llmtailor run (it holds ``snapshots/``), saying
    that the import is not needed and that ``assemble --format FORMAT`` writes ``what`` of it."""
    if (path / SNAPSHOTS_DIR).is_dir():
        raise ConfigError(f"{path} is already an llmtailor run: inspect, verify, assemble and merge read it as it is\n"
                          f"`llmtailor assemble {path} --format {format} -o OUT` writes {what} of it")
