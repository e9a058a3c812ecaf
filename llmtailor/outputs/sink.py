"""The sink contract: what a merge or an export hands an output, one unit at a time.

A ``Sink`` is one output being written (a run, a model directory, a Trainer checkpoint, a peft
adapter directory). It is built with everything known before any tensor byte is read (the
step, the layout, the global state, the size of every weight it will hold), refusing there what
its format cannot hold; ``write`` then takes the units in layout order, each read just before
it is written, and returns where the output is, which appears whole or not at all.

A unit (``OutputUnit``) is what a snapshot's unit holds: tensors by unit key (``weight/``,
``optim/``, ``master/``: ``store/keys.py``), each a tensor or the bytes of one as they lie in a
file (``ByteSource``, copied without being decoded), and the non-tensor optimizer values by
parameter name as a manifest stores them (JSON-encoded). Nothing here imports torch: a merge
that only moves bytes never does.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.errors import ConfigError
from llmtailor.store import Progress

if TYPE_CHECKING:
    import torch

    from llmtailor.store.tensor_files import ByteSource

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""5 GB, mergekit's default shard size (transformers names sizes in the same decimal units)."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")


@dataclass
class OutputUnit:
    """One unit on its way into an output (module docstring)."""

    name: str
    tensors: dict[str, torch.Tensor | ByteSource]
    values: dict[str, dict[str, Any]] = field(default_factory=dict)


class Sink(ABC):
    """One output being written (module docstring)."""

    @abstractmethod
    def write(self, units: Iterable[OutputUnit], count: int, progress: Progress | None = None) -> Path | str:
        """Write ``units`` (``count`` of them, every unit of the layout, in order) and publish
        the output; return where it is. ``progress(unit, done, count)`` follows each unit."""


def counted(units: Iterable[OutputUnit], count: int, progress: Progress | None) -> Iterator[OutputUnit]:
    """``units``, calling ``progress`` as each is done (when the next is asked for)."""
    for done, unit in enumerate(units, start=1):
        yield unit
        if progress is not None:
            progress(unit.name, done, count)


def parse_size(size: int | str, what: str = "--max-shard-size") -> int:
    """A size in bytes from ``5GB``, ``500MB``, ``100KB``, ``2GiB`` or a number of bytes, in
    the units transformers' ``max_shard_size`` takes (KB = 1000 bytes, KiB = 1024); ConfigError
    naming ``what`` and the value for anything else."""
    if isinstance(size, int) and not isinstance(size, bool):
        number, unit = size, ""
    else:
        match = _SIZE.fullmatch(str(size))
        number, unit = (float(match.group(1)), match.group(2).upper()) if match else (None, None)
    if number is None or unit not in _UNITS or int(number * _UNITS[unit]) <= 0:
        raise ConfigError(f"{what}: {size!r} is not a size; expected a positive number of bytes or one with a unit "
                          "(5GB, 500MB, 100KB, 2GiB)")
    return int(number * _UNITS[unit])
