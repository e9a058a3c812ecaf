"""Tensors written as safetensors shards of at most ``max_shard_size`` bytes, with an index.

The split is made before any byte is read, from the size of every tensor in the order they
will come, as transformers' ``save_pretrained`` and mergekit split a state dict: tensors go
into the current shard until the next one would take it over ``max_shard_size`` bytes of tensor
data, which then opens the next shard (a tensor larger than that alone fills one). One shard is
one file under the single name (``model.safetensors``), with no index; several are named
``<stem>-00001-of-0000N<suffix>`` by the caller's naming, with an index beside them in the format
transformers writes and reads::

    {"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {"<tensor>": "<shard file>", ...}}

``ShardWriter`` writes a shard, durably, as soon as its last tensor has come: memory holds at
most one shard's tensors (the bytes of a ``ByteSource`` are copied from its file as the shard
is written), as mergekit's writer does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtailor.errors import IntegrityError
from llmtailor.outputs.directory import write_text_durable
from llmtailor.store.storage.local_durable import Syncer
from llmtailor.store.tensor_files import write_tensor_file

if TYPE_CHECKING:
    import torch

    from llmtailor.store.tensor_files import ByteSource


@dataclass(frozen=True)
class ShardPlan:
    """Which file each tensor goes into (module docstring)."""

    files: dict[str, list[str]]
    """File name -> its tensors' names, in the order they come."""
    sizes: dict[str, int]
    """Tensor name -> bytes of its data."""

    @classmethod
    def split(cls, sizes: dict[str, int], max_shard_size: int, single: str, shard_name: Callable[[int, int], str]) -> ShardPlan:
        """The split of tensors of ``sizes`` (name -> bytes, in the order they come); files named
        ``single`` (one shard) or ``shard_name(i, n)`` (shard i of n, from 1)."""
        shards: list[list[str]] = []
        filled = 0
        for name, size in sizes.items():
            if not shards or (filled + size > max_shard_size and shards[-1]):
                shards.append([])
                filled = 0
            shards[-1].append(name)
            filled += size
        if len(shards) <= 1:
            return cls({single: shards[0] if shards else []}, dict(sizes))
        return cls({shard_name(i, len(shards)): names for i, names in enumerate(shards, start=1)}, dict(sizes))

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def index(self) -> str:
        """The index file's text, as transformers writes it."""
        weight_map = {name: file for file, names in self.files.items() for name in names}
        index = {"metadata": {"total_size": sum(self.sizes.values())}, "weight_map": weight_map}
        return json.dumps(index, indent=2, sort_keys=True) + "\n"


class ShardWriter:
    """Writes the tensors of ``plan`` into ``folder`` as they come (module docstring); the
    index as ``index_name`` where there are several shards. With a ``syncer``, each shard's
    final flush is left to it (durable once the syncer drains)."""

    def __init__(self, folder: Path, plan: ShardPlan, index_name: str, syncer: Syncer | None = None):
        self.folder, self.plan, self.index_name, self.syncer = folder, plan, index_name, syncer
        self._file_of = {name: file for file, names in plan.files.items() for name in names}
        self._waiting: dict[str, dict[str, torch.Tensor | ByteSource]] = {file: {} for file in plan.files}

    def add(self, tensors: dict[str, torch.Tensor | ByteSource]) -> None:
        """Take ``tensors`` (by name); write every shard they complete."""
        for name, tensor in tensors.items():
            file = self._file_of.get(name)
            waiting = self._waiting.get(file)
            if waiting is None or name in waiting:
                raise IntegrityError(f"{self.folder}: tensor {name!r} was not planned, or came twice")
            size = tensor.numel() * tensor.element_size()
            if size != self.plan.sizes[name]:
                raise IntegrityError(f"{self.folder}: tensor {name!r} has {size} bytes, {self.plan.sizes[name]} were planned")
            waiting[name] = tensor
            self._write_complete(file)

    def finish(self) -> None:
        """Write the index; IntegrityError if a planned tensor never came."""
        for file in list(self._waiting):
            self._write_complete(file)  # a shard of no tensors (a model without weights)
        missing = [name for file in self._waiting for name in self.plan.files[file] if name not in self._waiting[file]]
        if missing:
            raise IntegrityError(f"{self.folder}: planned tensors never came, e.g. {missing[:3]}")
        if self.plan.sharded:
            write_text_durable(self.folder / self.index_name, self.plan.index())

    def _write_complete(self, file: str) -> None:
        if len(self._waiting[file]) == len(self.plan.files[file]):
            shard = self._waiting.pop(file)
            write_tensor_file(self.folder / file, shard, self.folder, metadata={"format": "pt"}, syncer=self.syncer)
