"""Hugging Face directories as lazy sources (``interop/source.py``), and the readers of
Trainer's own files.

- ``ModelDirSource``: a ``save_pretrained`` directory: ``config.json`` (its ``model_type`` picks
  the layout family) and ``model.safetensors`` (single or sharded with its index; names, dtypes
  and shapes from the headers, byte ranges copied; no model is built, so neither torch nor
  transformers is imported) or ``pytorch_model.bin`` (single or sharded with its
  ``pytorch_model.bin.index.json``, as ``save_pretrained(safe_serialization=False)`` wrote
  it before transformers 5: torch's weights-only loader, memory-mapped). No optimizer or
  training state.
- ``CheckpointSource``: a Trainer ``checkpoint-N/``: its weights as above; ``optimizer.pt`` is
  read only when asked for (indices mapped to names by Trainer's own decay / no-decay groups);
  ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json`` give the state (a merge writes
  one process's snapshot: of a checkpoint of several processes, ``rng_state_<rank>.pth`` each,
  rank 0's, as of a tailored run of several ranks; ``import-hf`` keeps every rank's).

Trainer's ``.pt`` files are read with ``torch.load(weights_only=True)``; ``training_args.bin``
(a pickled TrainingArguments) never is.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtailor.constants import KIND_OPTIM
from llmtailor.errors import ConfigError, IncompatibleModelError, IntegrityError
from llmtailor.interop.deepspeed.files import find_step_dir, is_deepspeed_checkpoint
from llmtailor.interop.formats import describe_other_format, describe_output_dir, fsdp_files, is_peft_checkpoint
from llmtailor.interop.hf.files import (
    BIN_FILE,
    BIN_INDEX_FILE,
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TOKENIZER_FILES,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    rank_of_rng_file,
    rank_rng_file,
    read_json,
    step_of,
)
from llmtailor.interop.hf.weights import BinWeights, ModelWeights, has_bin_weights, has_weights, model_weights
from llmtailor.interop.source import Source, TensorInfo, refuse_a_run
from llmtailor.layouts import Layout, layout_from_names
from llmtailor.store import dtypes
from llmtailor.store.tensor_files import ByteSource
from llmtailor.store.keys import optim_key, split_key, weight_key

if TYPE_CHECKING:
    import torch


class ModelDirSource(Source):
    kind = "model directory"

    def __init__(self, label: str, path: Path):
        self.label, self.path = label, path
        self.step = None
        self.config = read_json(path / CONFIG_FILE)
        family = family_of(self.config)
        # safetensors: names, dtypes and shapes from the headers alone (no model is built);
        # pytorch_model.bin: loaded memory-mapped.
        self._weights = model_weights(path)
        self._info = {k: TensorInfo(t.dtype, t.shape) for k, t in self._weights.tensors.items()}
        self.layout = layout_from_names(list(self._info), family)

    def has_optimizer(self) -> bool:
        return False

    def tensors(self, unit: str, optimizer: bool) -> dict[str, TensorInfo]:
        return {weight_key(n): self._info[n] for n in self.layout.units[unit]}

    def read(self, unit: str, key: str) -> torch.Tensor | ByteSource:
        return self._weights.read(split_key(key)[1])

    def tokenizer_files(self) -> list[Path]:
        return [self.path / name for name in TOKENIZER_FILES if (self.path / name).is_file()]

    def generation_config(self) -> Path | None:
        path = self.path / GENERATION_CONFIG_FILE
        return path if path.is_file() else None


class CheckpointSource(ModelDirSource):
    """An HF Trainer ``checkpoint-N/``: weights as a model directory, state and optimizer
    from Trainer's own files, ``optimizer.pt`` read only when asked for."""

    kind = "Trainer checkpoint"

    def __init__(self, label: str, path: Path):
        super().__init__(label, path)
        self.trainer_state = read_json(path / TRAINER_STATE_FILE)
        self.step = step_of(path, self.trainer_state)
        self._optimizer: tuple[list[dict[str, Any]], dict[str, dict[str, Any]]] | None = None

    def has_optimizer(self) -> bool:
        return (self.path / OPTIMIZER_FILE).is_file() and (self.path / SCHEDULER_FILE).is_file()

    def _optimizer_state(self) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        if self._optimizer is None:
            from llmtailor.interop.hf.model import meta_model, trainer_param_groups

            saved = torch_load(self.path / OPTIMIZER_FILE)
            self._optimizer = map_optimizer(self.path / OPTIMIZER_FILE, saved, trainer_param_groups(self.config),
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
        _, per_param = self._optimizer_state()
        out = {n: plain_values(n, per_param[n]) for n in self.layout.units[unit] if n in per_param}
        return {n: v for n, v in out.items() if v}

    def global_state(self, optimizer: bool = True) -> dict[str, Any]:
        groups = self._optimizer_state()[0] if optimizer and self.has_optimizer() else None
        rngs = rng_files(self.path)  # rank 0's of several, as a tailored run's is to a merge
        rng = rng_state(rngs[0]) if rngs else None
        return {
            "step": self.step,
            "optimizer_groups": groups,
            "lr_scheduler": torch_load(self.path / SCHEDULER_FILE) if groups is not None else None,
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


_WHAT_TO_GIVE = "give a checkpoint-N/ directory that Trainer saved (in its output_dir)"


def require_importable(source: Path) -> None:
    refuse_a_run(source, "hf", "a Trainer checkpoint")
    if not source.is_dir():
        kind = describe_other_format(source) if source.is_file() else None
        raise ConfigError(f"{source} is {kind}" if kind else f"{source}: no such checkpoint directory\n{_WHAT_TO_GIVE}")
    if not any(source.iterdir()):
        raise ConfigError(f"{source}: an empty directory, not a Trainer checkpoint\n{_WHAT_TO_GIVE}")
    if is_deepspeed_checkpoint(source):
        raise ConfigError(f"{source}: a Trainer checkpoint saved under DeepSpeed (its optimizer state is in "
                          f"{find_step_dir(source).name}/, not {OPTIMIZER_FILE}): import it with "
                          f"`llmtailor import-deepspeed {source}`")
    if fsdp_files(source) or is_peft_checkpoint(source):
        raise ConfigError(f"{source} is {describe_other_format(source)}")
    output_dir = describe_output_dir(source)
    if output_dir:
        raise ConfigError(f"{source} is {output_dir}; import-hf reads one checkpoint-N/ directory")
    kind = describe_other_format(source)
    if not (source / TRAINER_STATE_FILE).is_file() and kind:
        raise ConfigError(f"{source} is {kind}; import-hf reads a Trainer checkpoint-N/ directory")
    problems = [f"{name} is missing" for name in (CONFIG_FILE, TRAINER_STATE_FILE) if not (source / name).is_file()]
    if not has_weights(source) and not has_bin_weights(source):
        problems.append(f"{WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE}, {BIN_FILE}, {BIN_INDEX_FILE}) is missing")
    have_optimizer, have_scheduler = (source / OPTIMIZER_FILE).is_file(), (source / SCHEDULER_FILE).is_file()
    if not problems and not have_optimizer and not have_scheduler and not rng_files(source):
        raise IntegrityError(f"{source}: holds weights only, as Trainer writes with save_only_model=True (no "
                             f"{OPTIMIZER_FILE}, {SCHEDULER_FILE} or {RNG_FILE}): it cannot resume, in Trainer or "
                             "llmtailor; for its weights name it as a source of a `llmtailor merge` plan (--format "
                             "model), and save with save_only_model=False to import a checkpoint")
    if have_optimizer != have_scheduler:
        present, absent = (OPTIMIZER_FILE, SCHEDULER_FILE) if have_optimizer else (SCHEDULER_FILE, OPTIMIZER_FILE)
        problems.append(f"{absent} is missing beside {present} (Trainer loads them only as a pair)")
    elif not have_optimizer:
        problems.append(f"{OPTIMIZER_FILE} and {SCHEDULER_FILE} are missing (a weights-only checkpoint cannot resume)")
    if not rng_files(source):
        problems.append(f"{RNG_FILE} (or {rank_rng_file(0)}, {rank_rng_file(1)}, ... of a run of several processes) is "
                        "missing (llmtailor snapshots always carry RNG state)")
    if problems:
        raise IntegrityError(f"{source}: not an importable Trainer checkpoint: " + "; ".join(problems))


def rng_files(folder: Path) -> list[Path]:
    """The RNG files of a Trainer checkpoint, by rank: ``[rng_state.pth]`` of a one-process run,
    ``rng_state_<rank>.pth`` of each process of a run of several (Trainer's ``_save_rng_state``
    writes one per process); empty when there is none. IntegrityError, naming the files, when a
    rank's file is missing among them or both forms are there (the world size is then unknown)."""
    ranked = {rank: path for path in folder.glob(rank_rng_file("*")) if (rank := rank_of_rng_file(path.name)) is not None}
    single = folder / RNG_FILE
    if ranked and single.is_file():
        raise IntegrityError(f"{folder}: holds both {RNG_FILE} (a one-process run's) and {sorted(p.name for p in ranked.values())} "
                             "(a run of several processes'); remove the ones of the run this checkpoint is not from")
    if single.is_file():
        return [single]
    missing = [rank_rng_file(r) for r in range(max(ranked, default=-1) + 1) if r not in ranked]
    if missing:
        raise IntegrityError(f"{folder}: holds the RNG files of ranks {sorted(ranked)} but lacks {missing[:3]}: every "
                             "process of the run writes its own")
    return [ranked[r] for r in sorted(ranked)]


def weight_sources(weights: ModelWeights | BinWeights, model: torch.nn.Module, layout: Layout) -> dict[str, str]:
    """Canonical tensor name -> its name in ``weights``, from the headers only (safetensors; the
    loaded tensors of pytorch_model.bin files). Every tensor of the files must be one of the
    model's, with its shape and dtype; a tied alias may stand in for its canonical name
    (save_pretrained writes one of them)."""
    expected = model.state_dict(keep_vars=True)
    found: dict[str, str] = {}
    problems: list[str] = []
    for key, stored in weights.tensors.items():
        want = expected.get(key)
        if want is None:
            problems.append(f"{key!r} is not a tensor of the {layout.family!r} model config.json describes")
            continue
        if list(stored.shape) != list(want.shape) or stored.dtype != dtypes.name_of(want.dtype):
            problems.append(f"{key!r} is {dtypes.code_of(stored.dtype)} {list(stored.shape)}, the model has {want.dtype} "
                            f"{list(want.shape)}")
        canonical = layout.aliases.get(key, key)
        if canonical not in found or key == canonical:
            found[canonical] = key
    missing = [name for name in layout.tensor_names() if name not in found]
    problems += [f"{name!r} is missing" for name in missing[:5]]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; ... ({len(problems)} in all)" if len(problems) > 6 else "")
        raise IncompatibleModelError(f"{weights.where} does not fit the model of {weights.path / CONFIG_FILE}: {shown}")
    return found


def torch_load(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refusals, truncation, not a torch file at all
        raise IntegrityError(f"{path}: cannot be loaded with torch.load(weights_only=True) ({err})") from None


def map_optimizer(
    path: Path, saved: Any, expected: list[list[str]], model: torch.nn.Module
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Param group records with names, and per-parameter state by name. optimizer.pt numbers
    parameters by position; only Trainer's own grouping tells which position is which, so the
    saved groups must have exactly its group count and sizes, and every state tensor the shape
    of the parameter it then lands on."""
    import torch

    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) or not isinstance(
        saved.get("state"), dict
    ):
        raise IntegrityError(f"{path}: expected an Optimizer.state_dict() with 'state' and 'param_groups'")
    ambiguous = (
        "so the mapping of its indices to parameters is ambiguous; import reads checkpoints of vanilla Trainer's "
        "AdamW-style optimizer (or Adafactor) with its 2 groups (weight decay for every trainable parameter except "
        "biases and norm weights, then the rest)"
    )
    sizes = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in saved["param_groups"]]
    if sizes != [len(names) for names in expected]:
        raise IncompatibleModelError(
            f"{path}: 'param_groups' has {len(sizes)} group(s) of {sizes} parameters, vanilla Trainer builds "
            f"{len(expected)} of {[len(n) for n in expected]} for the model of {CONFIG_FILE}; {ambiguous}"
        )
    name_of: dict[Any, str] = {}
    groups: list[dict[str, Any]] = []
    for number, (group, names) in enumerate(zip(saved["param_groups"], expected)):
        for position, (index, name) in enumerate(zip(group["params"], names)):
            if index in name_of:
                raise IntegrityError(
                    f"{path}: param_groups[{number}].params[{position}] repeats index {index!r} ({name_of[index]!r})"
                )
            name_of[index] = name
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(names)})

    params = dict(model.named_parameters())
    per_param: dict[str, dict[str, Any]] = {}
    for index, entries in saved["state"].items():
        name = name_of.get(index)
        if name is None:
            raise IntegrityError(f"{path}: 'state' has index {index!r}, which no param group lists")
        if not isinstance(entries, dict):
            raise IntegrityError(f"{path}: state[{index!r}] ({name!r}) is a {type(entries).__name__}, expected a dict")
        shape = list(params[name].shape)
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and list(value.shape) != state_shape(key, shape):
                raise IncompatibleModelError(
                    f"{path}: state[{index}][{key!r}] is {list(value.shape)}, but index {index} is {name!r} of "
                    f"shape {shape} under Trainer's grouping; the optimizer state does not fit the model "
                    f"(state tensors must be scalars, of their parameter's shape or Adafactor's factors of it), "
                    f"{ambiguous}"
                )
        per_param[name] = dict(entries)
    return groups, per_param


def state_shape(key: str, shape: list[int]) -> list[int]:
    """The shape of the per-parameter state tensor ``key`` of a parameter of ``shape``: the
    parameter's own (Adam's moments), but for a matrix Adafactor's factored second moments, its
    rows and its columns: without the other dimension in transformers' ``Adafactor`` (what
    Trainer's ``optim="adafactor"`` builds), with it kept as 1 in ``torch.optim.Adafactor``."""
    if len(shape) < 2:
        return shape
    factored = {"exp_avg_sq_row": shape[:-1], "exp_avg_sq_col": shape[:-2] + shape[-1:],
                "row_var": shape[:-1] + [1], "col_var": shape[:-2] + [1] + shape[-1:]}
    return factored.get(key, shape)


def plain_values(name: str, entries: dict[str, Any]) -> dict[str, Any]:
    """The non-tensor entries of one parameter's ``optimizer.pt`` state, as a manifest stores them."""
    import torch

    from llmtailor.store.codec import plain_value

    return {
        key: plain_value(value, f"{OPTIMIZER_FILE} state of {name}.{key}")
        for key, value in entries.items()
        if not isinstance(value, torch.Tensor)
    }


def rng_state(path: Path) -> dict[str, Any]:
    """Trainer's ``_save_rng_state`` record in llmtailor's format (``llmtailor.providers.rng``)."""
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # numpy's RNG tuple, as Trainer's own _load_rng_state allows
        saved = torch_load(path)
    if not isinstance(saved, dict) or not {"python", "numpy", "cpu"} <= saved.keys():
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise IntegrityError(f"{path}: expected keys 'python', 'numpy' and 'cpu', found {keys}")
    rng = {"python": saved["python"], "numpy": saved["numpy"], "torch": saved["cpu"]}
    if saved.get("cuda") is not None:
        cuda = saved["cuda"]
        # Single-process Trainer saves one device's state; llmtailor keeps a list of all devices.
        rng["cuda"] = list(cuda) if isinstance(cuda, (list, tuple)) else [cuda]
    # Other accelerators' states (xpu, npu, mps, ...) are kept under their own keys; neither
    # restore nor the HF export sets them today.
    rng.update({k: v for k, v in saved.items() if k not in ("python", "numpy", "cpu", "cuda")})
    return rng
