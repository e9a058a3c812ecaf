"""The one reader of a Hugging Face model directory's weights, for every consumer (merge
sources, the Trainer checkpoint import, a base model directory frozen tensors are kept from).

``ModelWeights`` finds the safetensors files of a ``save_pretrained`` directory or a Trainer
``checkpoint-N/`` (``model.safetensors``, or the shards ``model.safetensors.index.json``
names: ``files.weight_files``) and reads their headers, and nothing else, when built: every
tensor's file, dtype and shape, validated. A tensor's bytes are read only when asked for, as a
``ByteSource`` (copied as they are, or ``load()``-ed into a tensor). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmtailor.errors import IntegrityError
from llmtailor.interop.hf.files import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, weight_files
from llmtailor.interop.source import layout_of
from llmtailor.store import dtypes
from llmtailor.store.tensor_files import ByteSource


def has_weights(path: Path) -> bool:
    """Whether ``path`` holds safetensors weights (a single file or an index of shards)."""
    return (path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_INDEX_FILE).is_file()


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
