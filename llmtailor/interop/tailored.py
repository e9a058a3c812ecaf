"""A tailored run's composite read for another format: unit by unit as an output takes them
(``composite_units``; the size of every weight before any byte is read:
``composite_weight_sizes``), whole (``read_composite``), or as a lazy source
(``interop/source.py``) whose tensor bytes are copied straight from the unit files
(``ByteSource``), each checked against its chunk checksum on the way, leased for as long as it
is read (``RunSource``, for merges)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from llmtailor.constants import KIND_OPTIM
from llmtailor.errors import IntegrityError
from llmtailor.interop.source import Source, TensorInfo
from llmtailor.layouts import Layout
from llmtailor.store import dtypes
from llmtailor.store.checked import stored_header
from llmtailor.store.tensor_files import ByteSource
from llmtailor.store import Progress
from llmtailor.outputs.sink import OutputUnit, counted
from llmtailor.store.keys import split_key, split_unit, unit_weights
from llmtailor.store.reader import ChunkReader
from llmtailor.store.run import Run

if TYPE_CHECKING:
    import torch


def read_composite(
    run: Run, sources: dict[str, int], layout: Layout, progress: Progress | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Every weight of the composite ``sources`` names (unit -> step), by parameter name, and
    each parameter's optimizer state (state key -> value), read one unit at a time with its
    checksums verified."""
    weights: dict[str, torch.Tensor] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for unit in counted(composite_units(run, sources, layout), len(layout.units), progress):
        unit_weights, unit_state = split_unit(unit.name, layout.units[unit.name], unit.tensors, unit.values)
        weights.update(unit_weights)
        per_param.update(unit_state)
    return weights, per_param


def composite_units(run: Run, sources: dict[str, int], layout: Layout) -> Iterator[OutputUnit]:
    """The units of the composite ``sources`` names (unit -> step), in layout order, each read
    (checksums verified) when asked for."""
    for unit in layout.units:
        yield OutputUnit(unit, *run.read_unit(sources[unit], unit))


def composite_weight_sizes(run: Run, sources: dict[str, int], layout: Layout) -> dict[str, int]:
    """Every weight of the composite (``keys.unit_weights``) by name, with its bytes, in layout
    order: from the unit indexes, before any tensor byte is read."""
    sizes: dict[str, int] = {}
    for unit in layout.units:
        entries = {t.key: t for t in run.unit_entry(sources[unit], unit).tensors}
        sizes.update({name: math.prod(t.shape) * dtypes.itemsize(t.dtype) for name, t in unit_weights(entries).items()})
    return sizes


class RunSource(Source):
    kind = "tailored run"

    def __init__(self, label: str, run: Run, step: int | None):
        self.label, self.run = label, run
        # Leased for as long as the merge reads it: retention elsewhere leaves it whole.
        self._lease = run.reading(step)
        self.composite = self._lease.__enter__()
        self.step = self.composite.step
        self.layout = Layout.from_record(self.composite.manifest.layout)
        self._state: dict[str, Any] | None = None
        self._reader = ChunkReader(run, verify=True)

    @property
    def config(self) -> dict[str, Any] | None:  # type: ignore[override]
        return self.global_state().get("model_config")

    def has_optimizer(self) -> bool:
        return self.global_state().get("optimizer_groups") is not None

    def _entry(self, unit: str):
        return self.run.unit_entry(self.composite.sources[unit], unit)

    def tensors(self, unit: str, optimizer: bool) -> dict[str, TensorInfo]:
        entry = self._entry(unit)
        return {
            t.key: TensorInfo(t.dtype, tuple(t.shape), entry.step)
            for t in entry.tensors
            if optimizer or split_key(t.key)[0] != KIND_OPTIM
        }

    def read(self, unit: str, key: str) -> torch.Tensor | ByteSource:
        entry = self._entry(unit)
        tensor = entry.tensor(key)
        if tensor is None:
            raise IntegrityError(f"{self.label}: unit {unit!r} holds no tensor {key!r}")
        if len(tensor.chunks) == 1 and tensor.chunks[0].shape == tensor.shape:
            chunk = tensor.chunks[0]
            file = entry.chunk_file(chunk)
            storage, key = self.run.file_location(entry.step, file)  # inside the run (or its base)
            start, header = stored_header(storage, key, file)
            stored = header.get(tensor.chunk_key(chunk))
            if not isinstance(stored, dict) or (stored.get("dtype"), stored.get("shape")) != (dtypes.code_of(tensor.dtype), tensor.shape):
                raise IntegrityError(f"{storage.where(key)}: tensor {tensor.chunk_key(chunk)!r} is missing or not as its index says")
            begin, end = stored["data_offsets"]
            return ByteSource(storage.where(key), start + begin, end - begin, tensor.dtype, tuple(tensor.shape), chunk.xxh3_64,
                              storage=storage, key=key)
        return self._reader.read_region(entry.step, entry, tensor, (0,) * len(tensor.shape), tuple(tensor.shape))

    def values(self, unit: str) -> dict[str, dict[str, Any]]:
        return {name: dict(v) for name, v in self._entry(unit).values.items()}

    def global_state(self, optimizer: bool = True) -> dict[str, Any]:
        if self._state is None:
            self._state = self.run.whole_global(self.step)  # stages merged
        return self._state

    def close(self) -> None:
        self._reader.close()
        self._lease.__exit__(None, None, None)
