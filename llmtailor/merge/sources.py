"""Merge sources, read lazily: headers first, then only the bytes a plan moves.

Every kind of source answers the same questions about a unit (which tensors it holds, with
their dtypes and shapes; their values; its non-tensor optimizer values) and about its state:

- ``RunSource``: a tailored run's composite at a step. Tensor bytes are copied straight from
  the unit files (``ByteSource``), each checked against its chunk checksum on the way.
- ``ModelDirSource``: a ``save_pretrained`` directory: ``config.json`` (its ``model_type``
  picks the layout family) and ``model.safetensors`` (single or sharded with its index; names,
  dtypes and shapes from the headers, byte ranges copied; no model is built, so transformers
  is not even imported) or ``pytorch_model.bin`` (torch's weights-only loader, memory-mapped).
  No optimizer or training state.
- ``CheckpointSource``: an HF Trainer ``checkpoint-N/``: its weights as above; ``optimizer.pt``
  is read only when the plan moves optimizer state (indices mapped to names by Trainer's own
  decay / no-decay groups); ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json`` give
  the state.
- a DeepSpeed checkpoint: imported (``import_deepspeed``, one temporary copy made with
  DeepSpeed's own converter) and read as a ``RunSource``.
"""

from __future__ import annotations

import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.constants import KIND_OPTIM
from llmtailor.errors import ConfigError, IntegrityError
from llmtailor.layouts import Layout, layout_from_names
from llmtailor.store import dtypes
from llmtailor.store.files import ByteSource, safetensors_layout
from llmtailor.store.keys import optim_key, split_key, weight_key
from llmtailor.store.reader import ChunkReader
from llmtailor.store.run import Run

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja",
)


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    """By name, as a manifest writes it (``float32``)."""
    shape: tuple[int, ...]
    step: int | None = None
    """The snapshot that saved this version (a run's composite), for the dry run."""


class MergeSource(ABC):
    """A checkpoint a plan draws from (module docstring)."""

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


class RunSource(MergeSource):
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
            path = self.run.file_path(entry.step, entry.chunk_file(chunk))  # confined to the run (or its base)
            start, header = _layout_of(path)
            stored = header.get(tensor.chunk_key(chunk))
            if not isinstance(stored, dict) or (stored.get("dtype"), stored.get("shape")) != (dtypes.code_of(tensor.dtype), tensor.shape):
                raise IntegrityError(f"{path}: tensor {tensor.chunk_key(chunk)!r} is missing or not as its index says")
            begin, end = stored["data_offsets"]
            return ByteSource(path, start + begin, end - begin, tensor.dtype, tuple(tensor.shape), chunk.xxh3_64)
        return self._reader.read_region(entry.step, entry, tensor, (0,) * len(tensor.shape), tuple(tensor.shape))

    def values(self, unit: str) -> dict[str, dict[str, Any]]:
        return {name: dict(v) for name, v in self._entry(unit).values.items()}

    def global_state(self, optimizer: bool = True) -> dict[str, Any]:
        if self._state is None:
            self._state = self.run.read_global(self.step)
        return self._state

    def close(self) -> None:
        self._reader.close()
        self._lease.__exit__(None, None, None)


class ModelDirSource(MergeSource):
    kind = "model directory"

    def __init__(self, label: str, path: Path):
        from llmtailor.interop.checkpoint_dirs import read_json

        self.label, self.path = label, path
        self.step = None
        self.config = read_json(path / CONFIG_FILE)
        family = family_of(self.config)
        self._bin: dict[str, torch.Tensor] | None = None
        self._files: dict[str, tuple[Path, str]] = {}
        self._info: dict[str, TensorInfo] = {}
        if (path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_INDEX_FILE).is_file():
            # Names, dtypes and shapes from the safetensors headers alone: no model is built.
            for file in _weight_files(path):
                _, header = _layout_of(file)
                for key, stored in header.items():
                    if key == "__metadata__":
                        continue
                    dtype = dtypes.from_code(stored.get("dtype"))
                    if dtype is None:
                        raise IntegrityError(f"{file}: tensor {key!r} has dtype {stored.get('dtype')!r}, not one llmtailor reads")
                    self._files[key] = (file, key)
                    self._info[key] = TensorInfo(dtype, tuple(stored["shape"]))
        elif (path / BIN_FILE).is_file():
            self._bin = self._load_bin(path / BIN_FILE)
            self._info = {k: TensorInfo(dtypes.name_of(t.dtype), tuple(t.shape)) for k, t in self._bin.items()}
        else:
            raise IntegrityError(f"{path}: no {WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE} or {BIN_FILE}")
        self.layout = layout_from_names(list(self._info), family)

    def _load_bin(self, path: Path) -> dict[str, torch.Tensor]:
        import torch

        try:
            weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # a pickle needing more than weights, truncation, not a torch file
            raise IntegrityError(
                f"{path}: cannot be read with torch's weights-only loader ({type(err).__name__}: {err}); "
                "convert it to safetensors (save_pretrained(safe_serialization=True))"
            ) from None
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise IntegrityError(f"{path}: expected a dict of tensors (a state dict)")
        # Tied weights are one tensor under two names: keep the first name, as save_pretrained does.
        seen: dict[int, str] = {}
        return {k: t for k, t in weights.items() if seen.setdefault(id(t), k) == k}

    def has_optimizer(self) -> bool:
        return False

    def tensors(self, unit: str, optimizer: bool) -> dict[str, TensorInfo]:
        return {weight_key(n): self._info[n] for n in self.layout.units[unit]}

    def read(self, unit: str, key: str) -> torch.Tensor | ByteSource:
        kind, name, _ = split_key(key)
        if self._bin is not None:
            return self._bin[name]
        path, stored_key = self._files[name]
        start, header = _layout_of(path)
        stored = header[stored_key]
        begin, end = stored["data_offsets"]
        return ByteSource(path, start + begin, end - begin, self._info[name].dtype, tuple(stored["shape"]))

    def tokenizer_files(self) -> list[Path]:
        return [self.path / name for name in TOKENIZER_FILES if (self.path / name).is_file()]

    def generation_config(self) -> Path | None:
        path = self.path / "generation_config.json"
        return path if path.is_file() else None


class CheckpointSource(ModelDirSource):
    """An HF Trainer ``checkpoint-N/``: weights as a model directory, state and optimizer
    from Trainer's own files, ``optimizer.pt`` read only when asked for."""

    kind = "Trainer checkpoint"

    def __init__(self, label: str, path: Path):
        from llmtailor.interop.checkpoint_dirs import read_json, step_of

        super().__init__(label, path)
        self.trainer_state = read_json(path / "trainer_state.json")
        self.step = step_of(path, self.trainer_state)
        self._optimizer: tuple[list[dict[str, Any]], dict[str, dict[str, Any]]] | None = None

    def has_optimizer(self) -> bool:
        return (self.path / "optimizer.pt").is_file() and (self.path / "scheduler.pt").is_file()

    def _optimizer_state(self) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        if self._optimizer is None:
            from llmtailor.interop.hf_export import meta_model, trainer_param_groups
            from llmtailor.interop.hf_import import map_optimizer, torch_load

            saved = torch_load(self.path / "optimizer.pt")
            self._optimizer = map_optimizer(self.path / "optimizer.pt", saved, trainer_param_groups(self.config),
                                            meta_model(self.config))
        return self._optimizer

    def tensors(self, unit: str, optimizer: bool) -> dict[str, TensorInfo]:
        out = super().tensors(unit, optimizer)
        if optimizer and self.has_optimizer():
            import torch  # loaded already: optimizer.pt is read with it

            _, per_param = self._optimizer_state()
            for name in self.layout.units[unit]:
                for key, value in per_param.get(name, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[optim_key(name, key)] = TensorInfo(dtypes.name_of(value.dtype), tuple(value.shape))
        return out

    def read(self, unit: str, key: str) -> torch.Tensor | ByteSource:
        kind, name, state_key = split_key(key)
        if kind == KIND_OPTIM:
            return self._optimizer_state()[1][name][state_key]
        return super().read(unit, key)

    def values(self, unit: str) -> dict[str, dict[str, Any]]:
        if not self.has_optimizer():
            return {}
        from llmtailor.interop.hf_import import plain_values

        _, per_param = self._optimizer_state()
        out = {n: plain_values(n, per_param[n]) for n in self.layout.units[unit] if n in per_param}
        return {n: v for n, v in out.items() if v}

    def global_state(self, optimizer: bool = True) -> dict[str, Any]:
        from llmtailor.interop.hf_import import rng_state, torch_load

        groups = self._optimizer_state()[0] if optimizer and self.has_optimizer() else None
        rng = rng_state(self.path / "rng_state.pth") if (self.path / "rng_state.pth").is_file() else None
        return {
            "step": self.step,
            "optimizer_groups": groups,
            "lr_scheduler": torch_load(self.path / "scheduler.pt") if groups is not None else None,
            "rng": rng,
            "model_config": self.config,
            "extra": {"trainer_state": self.trainer_state},
        }


def family_of(config: dict[str, Any]) -> str:
    """The layout family serving the config's ``model_type`` (the name-based fallback else)."""
    from llmtailor.layouts import list_families, load_family

    model_type = config.get("model_type")
    served = [f for f in list_families() if model_type in load_family(f).model_types]
    return served[0] if served else "generic"


def _weight_files(path: Path) -> list[Path]:
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    from llmtailor.interop.checkpoint_dirs import read_json

    index = read_json(path / WEIGHTS_INDEX_FILE)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise IntegrityError(f"{path / WEIGHTS_INDEX_FILE}: key 'weight_map' is missing or empty")
    files = [path / name for name in sorted(set(map(str, weight_map.values())))]
    absent = [f.name for f in files if not f.is_file() or f.parent != path]
    if absent:
        raise IntegrityError(f"{path / WEIGHTS_INDEX_FILE}: names shard files that are missing: {absent[:3]}")
    return files


def open_source(label: str, path: Path, step: int | None, scratch: Path) -> MergeSource:
    """The source at ``path`` (kinds tried in the module docstring's order)."""
    from llmtailor.interop.checkpoint_dirs import is_deepspeed_checkpoint

    if path.is_dir() and Run(path).steps():
        return RunSource(label, Run(path), step)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such directory")
    if step is not None:
        raise ConfigError(f"{path} is a checkpoint directory: @STEP names a step of a tailored run only")
    if is_deepspeed_checkpoint(path):
        from llmtailor.interop.deepspeed_import import import_deepspeed

        run_dir = Path(tempfile.mkdtemp(prefix="deepspeed-", dir=scratch))
        shutil.rmtree(run_dir)
        import_deepspeed(path, run_dir)
        return RunSource(label, Run(run_dir), None)
    if (path / CONFIG_FILE).is_file() and (path / "trainer_state.json").is_file():
        return CheckpointSource(label, path)
    if (path / CONFIG_FILE).is_file():
        return ModelDirSource(label, path)
    raise ConfigError(
        f"{path} is not a tailored run, a model directory (config.json + model.safetensors), a Trainer "
        "checkpoint-N/ or a DeepSpeed checkpoint"
    )


_HEADERS: dict[tuple[Path, int, int], tuple[int, dict[str, Any]]] = {}


def _layout_of(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's data offset and header, read once per version of the file."""
    try:
        stat = path.stat()
        key = (path, stat.st_mtime_ns, stat.st_size)
        if key not in _HEADERS:
            if len(_HEADERS) > 512:
                _HEADERS.clear()
            _HEADERS[key] = safetensors_layout(path)
        return _HEADERS[key]
    except FileNotFoundError:
        raise IntegrityError(f"{path}: file is missing") from None
    except (OSError, ValueError) as err:
        raise IntegrityError(f"{path}: not a readable safetensors file ({err})") from None

