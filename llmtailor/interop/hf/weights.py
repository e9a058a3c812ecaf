"""The one reader of a Hugging Face model directory's weights, for every consumer (merge
sources, the Trainer checkpoint import, a base model directory frozen tensors are kept from).

``ModelWeights`` finds the safetensors files of a ``save_pretrained`` directory or a Trainer
``checkpoint-N/`` (``model.safetensors``, or the shards ``model.safetensors.index.json``
names: ``files.weight_files``) and reads their headers, and nothing else, when built: every
tensor's file, dtype and shape, validated. A tensor's bytes are read only when asked for, as a
``ByteSource`` (copied as they are, or ``load()``-ed into a tensor). Torch-free.

``BinWeights`` reads the same for the torch pickles of an older ``save_pretrained``
(``safe_serialization=False``, transformers 4) or a Trainer checkpoint saved with
``save_safetensors=False``: ``pytorch_model.bin``, or the shards its
``pytorch_model.bin.index.json`` names (``files.bin_files``), loaded with torch's weights-only
loader, memory-mapped (bytes read when used); a tensor is returned as the loaded tensor.
``model_weights`` opens whichever a directory holds, safetensors first.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtailor.errors import IntegrityError
from llmtailor.interop.hf.files import BIN_FILE, BIN_INDEX_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, bin_files, weight_files
from llmtailor.interop.source import layout_of
from llmtailor.store import dtypes
from llmtailor.store.tensor_files import ByteSource

if TYPE_CHECKING:
    import torch


def has_weights(path: Path) -> bool:
    """Whether ``path`` holds safetensors weights (a single file or an index of shards)."""
    return (path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_INDEX_FILE).is_file()


def has_bin_weights(path: Path) -> bool:
    """Whether ``path`` holds ``pytorch_model.bin`` weights (a single file or an index of shards)."""
    return (path / BIN_FILE).is_file() or (path / BIN_INDEX_FILE).is_file()


def model_weights(path: Path) -> ModelWeights | BinWeights:
    """The weights of the model directory ``path``: its safetensors files where it has them,
    else its ``pytorch_model.bin`` files; IntegrityError naming the files looked for when it
    has neither."""
    if has_weights(path):
        return ModelWeights(path)
    if has_bin_weights(path):
        return BinWeights(path)
    raise IntegrityError(f"{path}: no {WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE}, {BIN_FILE} or {BIN_INDEX_FILE}")


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor of a model directory lies: its file, key in it, dtype name and shape."""

    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]


class ModelWeights:
    """The weights of the model directory ``path`` (module docstring). IntegrityError naming
    the file for a missing shard, an unreadable header or a dtype llmtailor does not read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = weight_files(self.path)
        self.tensors: dict[str, StoredTensor] = {}
        """Tensor name -> where it lies, in the files' order."""
        for file in self.files:
            _, header = layout_of(file)
            for key, stored in header.items():
                if key == "__metadata__":
                    continue
                code = stored.get("dtype") if isinstance(stored, dict) else None
                dtype = dtypes.from_code(code) if isinstance(code, str) else None
                if dtype is None:
                    raise IntegrityError(f"{file}: tensor {key!r} has dtype {code!r}, not one llmtailor reads")
                self.tensors[key] = StoredTensor(file, key, dtype, tuple(stored["shape"]))

    @property
    def where(self) -> Path:
        """The file that names the weights (the index where there are shards), for messages."""
        return self.files[0] if len(self.files) == 1 else self.path / WEIGHTS_INDEX_FILE

    def read(self, name: str) -> ByteSource:
        """The bytes of tensor ``name``, read only when copied or loaded."""
        stored = self.tensors[name]
        start, header = layout_of(stored.file)
        begin, end = header[name]["data_offsets"]
        return ByteSource(stored.file, start + begin, end - begin, stored.dtype, stored.shape)


class BinWeights:
    """The ``pytorch_model.bin`` weights of the model directory ``path`` (module docstring), with
    ``ModelWeights``' ``tensors``, ``where`` and ``read``. IntegrityError naming the file for a
    missing shard, a file torch's weights-only loader refuses, or one that is not a state dict.
    A tied weight is in these files under both its names (``_load_bin``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = bin_files(self.path)
        self._loaded: dict[str, torch.Tensor] = {}
        self.tensors: dict[str, StoredTensor] = {}
        for file in self.files:
            for key, tensor in _load_bin(file).items():
                self._loaded[key] = tensor
                self.tensors[key] = StoredTensor(file, key, dtypes.name_of(tensor.dtype), tuple(tensor.shape))

    @property
    def where(self) -> Path:
        return self.files[0] if len(self.files) == 1 else self.path / BIN_INDEX_FILE

    def read(self, name: str) -> torch.Tensor:
        return self._loaded[name]


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        # mapped where torch can map it (a zip file); a legacy (pre-1.6) file is read whole, as
        # transformers reads it
        weights = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:  # a pickle needing more than weights, truncation, not a torch file
        raise IntegrityError(
            f"{path}: cannot be read with torch's weights-only loader ({type(err).__name__}: {err}); "
            "convert it to safetensors (save_pretrained(safe_serialization=True))"
        ) from None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise IntegrityError(f"{path}: expected a dict of tensors (a state dict)")
    # One tensor object under two names (a hand-made torch.save) is one tensor. save_pretrained's
    # state_dict() holds a tied weight as two tensors over one storage: both names are kept, as
    # mergekit keeps them (a merge means what mergekit makes of it); an import maps the alias to
    # its canonical name (``reader.weight_sources``).
    seen: dict[int, str] = {}
    return {k: t for k, t in weights.items() if seen.setdefault(id(t), k) == k}
