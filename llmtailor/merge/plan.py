"""The merge plan file: a strict, validated reading of the YAML a user writes.

Three spellings are accepted, so mergekit and LLMTailor users can bring their plans::

    # mergekit's slices form
    merge_method: passthrough          # the only method: layer assembly, nothing is blended
    slices:
      - sources: [{model: runs/a@400, layer_range: [0, 16]}]    # half-open, as in mergekit
      - sources: [{model: runs/b@500, layer_range: [8, 32]}]    # overlaps and depth changes allowed
    base_model: runs/b@500             # default source of training state (below)
    dtype: bfloat16                    # cast the weights (weights-only merges only); out_dtype: as written
    parameters: {scale: [{filter: o_proj, value: 0.5}, {value: [1.0, 0.5]}]}   # mergekit's passthrough scale
    tokenizer_source: base             # the output's tokenizer ("base" or a source; not "union"); or tokenizer: {source: base}
    embed: runs/a@400                  # optional per auxiliary unit: embed, norm, head
    optimizer: true                    # move optimizer state with each parameter (default: when every source has some)
    state_from: runs/b@500             # step, scheduler, RNG, trainer state

    # mergekit's models form: one model, copied (passthrough allows no blending); a model may be
    # written as mergekit's mapping too: {model: runs/a@400} or {model: {path: runs/a@400}}
    models: [{model: runs/a@400, parameters: {scale: 1.0}}]

    # published LLMTailor form: auxiliary tensors by name (mapped to units via the layout)
    pre_weights:  [{name: model.embed_tokens.weight, model: runs/a@400}]
    post_weights: [{name: model.norm.weight, model: runs/b@500}, {name: lm_head.weight, model: runs/b@500}]

What mergekit (0.1.5) makes of a passthrough plan, so do we, bit for bit
(tests/merge/test_mergekit_parity.py runs both): the output's layers are the slices' layer
ranges concatenated in order (any depth, layers repeated or skipped); the embeddings come from
the first slice's model and the final norm and LM head from the last slice's model, unless the
plan names them (``embed`` / ``norm`` / ``head`` or ``pre_weights`` / ``post_weights``).
``parameters: scale`` multiplies a weight: slice-source, then slice, then top-level parameters,
the first that gives a value wins; the embeddings take the first slice's, the final norm and
head the last slice's. A scale is a number, a gradient (numbers spread evenly over a slice's
layers, linearly interpolated: its first layer at 0, its last at 1, a one-layer slice at 1, the
embeddings, norm and head at 0), ``{filter, value}`` or a list of them: the first whose
``filter`` is a substring of the *source's* name of the tensor, or ``*``, or none, wins.
A weight is cast to ``dtype`` as read, then scaled, then cast to ``out_dtype``.
``tokenizer_source`` rebuilds the embedding and LM head rows for that tokenizer and sets
``vocab_size`` (merge/vocab.py).

Training state (step, LR scheduler, RNG, trainer state, optimizer hyperparameters) comes from
``state_from``; by default from ``base_model``; without either, from the source with the
newest step (the last slice's among equals).

A source (SRC) is ``RUN@STEP`` (a tailored run's composite at a step), ``RUN`` (its newest
composite), a model directory (``save_pretrained``: ``config.json`` and ``model.safetensors``,
sharded or not, or ``pytorch_model.bin``), a Hugging Face Trainer ``checkpoint-N/`` directory,
or a DeepSpeed checkpoint. Relative paths resolve against the plan file's directory. Every
problem of a plan is reported at once in one ConfigError naming the plan file and the key
(with the sources it names that do not exist, and a method other than passthrough first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmtailor.errors import ConfigError, describe_validation
from llmtailor.interop.hf.files import hub_id_hint

PASSTHROUGH = "passthrough"
_STEP_SUFFIX = re.compile(r"^(.*)@([0-9]+)$")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
SHOWN_PROBLEMS = 8
"""How many problems a refusal lists in full; the rest are counted (messages stay short)."""
FORMATS = ("tailor", "hf", "model")
"""Output formats; ``model`` holds weights only, so a plan written as one moves no optimizer state."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _number_or_gradient(value: object) -> object:
    """Only the shapes mergekit gives a scale: a number (or a number's text, as YAML leaves
    ``1e-3``) or a list of them."""
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(x, (int, float, str)) and not isinstance(x, bool) for x in items):
        raise ValueError(f"a scale value is a number or a list of numbers (a gradient over the layers), got {value!r}")
    return value


def _model_reference(value: object) -> object:
    """mergekit's ModelReference as a mapping, ``{model: PATH}`` or ``{model: {path: PATH}}``, is
    the path itself (as mergekit 0.1.5 reads it); its parts llmtailor does not take are refused
    naming them. Anything else is left to the field's own type check."""
    if not isinstance(value, dict):
        return value
    if "path" in value and "model" not in value:
        raise ValueError("{path: ...} is an older mergekit's form; write the path, or {model: {path: ...}}")
    if value.get("lora") is not None:
        raise ValueError("a model with a lora (an adapter applied to it) is not supported: merge the adapter into its "
                         "model first (peft's merge_and_unload, then save_pretrained) and name that directory")
    if set(value) - {"model", "lora"}:
        raise ValueError(f"{sorted(set(value) - {'model', 'lora'})} of a model reference are not supported; "
                         "write {model: PATH}")
    model = value.get("model")
    if isinstance(model, dict):
        if set(model) - {"path", "revision"}:
            raise ValueError(f"{sorted(set(model) - {'path', 'revision'})} of a model path are not mergekit's; "
                             "write {model: {path: PATH}}")
        if model.get("revision") is not None:
            raise ValueError("a model's revision names a Hugging Face Hub version; llmtailor merges local directories "
                             "and runs: write {model: {path: PATH}}")
        model = model.get("path")
    return model


ModelPath = Annotated[str, Field(min_length=1), BeforeValidator(_model_reference)]
"""A source as a plan names it: a string, or mergekit's mapping form of one."""


class ScaleRule(_Strict):
    """One entry of mergekit's conditional parameter list: ``filter`` (a substring of the source
    tensor's name; ``*`` or none: every tensor) and the ``value``, a number or a gradient."""

    filter: str | None = None
    value: Annotated[float | list[float], BeforeValidator(_number_or_gradient)]

    def matches(self, name: str) -> bool:
        return self.filter is None or self.filter == "*" or self.filter in name


def _rules(value: object) -> object:
    """Every spelling of ``scale`` as a list of rules: a number or a gradient is one rule with no
    filter (mergekit resolves both alike), a single ``{filter, value}`` a list of one."""
    if value is None or isinstance(value, dict):
        return value if value is None else [value]
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return value
    if isinstance(value, list) and any(isinstance(x, dict) for x in value):
        raise ValueError("scale mixes {filter, value} entries and numbers; give a list of one kind")
    return [{"value": _number_or_gradient(value)}]


def _gradient(values: list[float], t: float) -> float | None:
    """The value at ``t`` in [0, 1] of numbers spread evenly over [0, 1], linearly
    interpolated, with mergekit's own arithmetic (so the result is the same float)."""
    if not values:
        return None
    position = t * (len(values) - 1)
    low = int(position)
    high = min(len(values) - 1, low + 1)
    frac = position - low
    return (1 - frac) * values[low] + frac * values[high]


class Parameters(_Strict):
    """The parameters passthrough takes: ``scale``, in any of mergekit's spellings: a number, a
    gradient (a list of numbers, interpolated over a slice's layers), ``{filter, value}`` or a
    list of them (the first whose filter matches decides)."""

    scale: Annotated[list[ScaleRule] | None, BeforeValidator(_rules)] = None

    def scale_for(self, name: str, t: float) -> float | None:
        """The scale of the source tensor ``name`` at position ``t`` of its slice (0 for the
        embeddings and the final norm and head); None: these parameters leave it to the next."""
        for rule in self.scale or []:
            if rule.matches(name):
                return _gradient(rule.value, t) if isinstance(rule.value, list) else rule.value
        return None


class SliceSource(_Strict):
    model: ModelPath
    layer_range: tuple[int, int]
    """Half-open ``[a, b)`` range of the source's layers, as in mergekit."""
    parameters: Parameters | None = None

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] < 0 or value[1] < value[0]:
            raise ValueError(f"layer_range {list(value)} must be [a, b] with 0 <= a <= b")
        return value


class Slice(_Strict):
    sources: list[SliceSource]
    parameters: Parameters | None = None

    @field_validator("sources")
    @classmethod
    def _one_source(cls, value: list[SliceSource]) -> list[SliceSource]:
        if len(value) != 1:
            raise ValueError(
                f"a passthrough slice takes exactly one source, got {len(value)} (blending several is not layer assembly)"
            )
        return value


class ModelEntry(_Strict):
    """An entry of mergekit's ``models`` form."""

    model: ModelPath
    parameters: Parameters | None = None


class NamedWeight(_Strict):
    """An auxiliary tensor of the published LLMTailor form; its whole unit moves with it."""

    name: str = Field(min_length=1)
    model: str = Field(min_length=1)


class PlanSpec(_Strict):
    """The plan file's keys (see the module docstring)."""

    slices: list[Slice] | None = None
    models: list[ModelEntry] | None = None
    merge_method: str = PASSTHROUGH
    dtype: str | None = None
    out_dtype: str | None = None
    parameters: Parameters | None = None
    base_model: ModelPath | None = None
    tokenizer_source: ModelPath | None = None
    embed: str | None = None
    norm: str | None = None
    head: str | None = None
    pre_weights: list[NamedWeight] = []
    post_weights: list[NamedWeight] = []
    optimizer: bool | None = None
    """Move each parameter's optimizer state with it. Default: when every source holds
    optimizer state (a model directory holds none)."""
    state_from: str | None = None
    tokenizer: dict | None = None
    """mergekit's ``tokenizer:`` block: ``{source: X}`` alone is ``tokenizer_source: X``
    (``_tokenizer_block``); anything else in it is refused, naming it."""
    chat_template: str | None = None
    """mergekit's; refused, naming it (``_not_supported``)."""
    modules: dict | None = None
    """mergekit's; refused, naming it (``_not_supported``)."""

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_block(cls, data: object) -> object:
        """mergekit builds the same embedding rows from ``tokenizer: {source: X}`` as from
        ``tokenizer_source: X`` (checked against mergekit 0.1.5), so the block of a source alone
        is read as that key."""
        block = data.get("tokenizer") if isinstance(data, dict) else None
        if isinstance(block, dict) and set(block) == {"source"} and "tokenizer_source" not in data:
            data = {**{k: v for k, v in data.items() if k != "tokenizer"}, "tokenizer_source": block["source"]}
        return data

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_parts(cls, value: dict | None) -> dict | None:
        if value is None:
            return value
        parts = sorted(set(value) - {"source"})
        why = (f"{parts} (mergekit's per-token embeddings and vocabulary padding) are not supported" if parts else
               "'source' is missing (mergekit's default, union, is not supported)" if "source" not in value else
               "give tokenizer_source or tokenizer, not both")
        raise ValueError(f"{why}; write tokenizer: {{source: base}} or {{source: SRC}} (or tokenizer_source)")

    @field_validator("chat_template", "modules")
    @classmethod
    def _not_supported(cls, value: object, info) -> object:
        if value is None:
            return value
        what = {"chat_template": "(a chat template written into the output's tokenizer); set it on the merged "
                                 "tokenizer's files instead",
                "modules": "(several output modules); a passthrough plan has 'slices' or 'models'"}[info.field_name]
        raise ValueError(f"mergekit's {info.field_name!r} is not supported by llmtailor merge {what}")

    @field_validator("merge_method")
    @classmethod
    def _passthrough_only(cls, value: str) -> str:
        if value != PASSTHROUGH:
            raise ValueError(
                f"merge method {value!r} is not supported: only layer assembly (passthrough) is supported; "
                "blending tensors would break the exact optimizer state of a training checkpoint"
            )
        return value

    @field_validator("tokenizer_source")
    @classmethod
    def _one_vocabulary(cls, value: str | None) -> str | None:
        if value == "union":
            raise ValueError("tokenizer_source 'union' (a new vocabulary merged from every source's tokenizer) is not "
                             "supported: name one source's tokenizer, or base")
        return value

    @field_validator("dtype", "out_dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        name = value.removeprefix("torch.") if value is not None else None  # mergekit reads both spellings
        if name is not None and name not in DTYPE_NAMES:
            raise ValueError(f"dtype {value!r} is not one of {list(DTYPE_NAMES)}")
        return name

    @model_validator(mode="after")
    def _one_form(self) -> PlanSpec:
        problems = []
        if (self.slices is None) == (self.models is None):
            problems.append("give either 'slices' or 'models' (mergekit's two forms), not both or neither")
        if self.models is not None and len(self.models) != 1:
            problems.append(
                f"'models' with passthrough copies one model; got {len(self.models)} (blending is not layer assembly)"
            )
        if self.slices is not None and not self.slices:
            problems.append("'slices' is empty: the plan names no layer")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def output_dtype(self) -> str | None:
        return self.out_dtype or self.dtype


@dataclass(frozen=True)
class SourceRef:
    """A source as the plan names it: ``label`` is the text of the plan; ``step`` is None for
    a run's newest composite or a checkpoint directory."""

    label: str
    path: Path | str
    """A local path, or the URL of a run on an object store (``s3://bucket/run``)."""
    step: int | None


def parse_source(text: str, base_dir: Path) -> SourceRef:
    """``RUN@STEP``, ``RUN`` or a directory; relative paths against ``base_dir``; a URL
    (``s3://bucket/run@400``) as it is."""
    from llmtailor.store.storage import is_url

    match = _STEP_SUFFIX.match(text)
    path_text, step = (match.group(1), int(match.group(2))) if match else (text, None)
    if is_url(path_text):
        return SourceRef(label=text, path=path_text, step=step)
    path = Path(path_text).expanduser()
    return SourceRef(label=text, path=path if path.is_absolute() else base_dir / path, step=step)


def load_plan(plan_file: str | Path) -> PlanSpec:
    """Read and validate ``plan_file``; one ConfigError names the file and every problem
    (malformed YAML: with its line and column)."""
    path = Path(plan_file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such plan file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the plan ({err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.composer.ComposerError as err:
        if "another document" not in str(err.problem):
            raise _malformed(path, err) from None
        raise ConfigError(f"{path}: holds several YAML documents (mergekit-multi's form, one merge each): llmtailor "
                          "merge takes one plan a file; write each in a file of its own") from None
    except yaml.YAMLError as err:
        raise _malformed(path, err) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a plan is a YAML mapping (slices, merge_method, ...), got {type(data).__name__}")
    try:
        return PlanSpec.model_validate(data)
    except ValidationError as err:
        # The method first: under another method, the other problems (unknown parameters,
        # several sources per slice) are its consequences.
        ordered = _Errors(sorted(err.errors(), key=lambda e: tuple(e["loc"][:1]) != ("merge_method",)))
        problems = [f"invalid plan: {describe_validation(ordered, limit=SHOWN_PROBLEMS)}"]
        problems += _missing_sources(data, path.resolve().parent)
        raise ConfigError(f"{path}: " + "; ".join(problems)) from None


def _malformed(path: Path, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    return ConfigError(f"{path}: malformed YAML{where}: {problem}")


_SOURCE_KEYS = ("model", "base_model", "embed", "norm", "head", "state_from", "tokenizer_source", "source", "path")


class _Errors:
    """A validation error's problems in another order, for ``describe_validation``."""

    def __init__(self, items: list):
        self.items = items

    def errors(self) -> list:
        return self.items


def _missing_sources(node: object, base_dir: Path, key: str | None = None) -> list[str]:
    """Sources named anywhere in a plan that failed validation whose directory does not exist,
    so they are reported with its other problems (a valid plan's sources are opened and
    checked fully by the planner)."""
    if isinstance(node, dict):
        return list(dict.fromkeys(p for k, v in node.items() for p in _missing_sources(v, base_dir, k)))
    if isinstance(node, list):
        return list(dict.fromkeys(p for v in node for p in _missing_sources(v, base_dir, key)))
    if key in _SOURCE_KEYS and isinstance(node, str) and node and node not in ("base", "union"):
        try:
            path = parse_source(node, base_dir).path
            if not isinstance(path, Path):  # a URL: opened, and checked, once the plan is valid
                return []
            exists, hint = path.exists(), hub_id_hint(node, path)
        except (OSError, ValueError, RuntimeError):  # a name no filesystem holds (a NUL byte, ~nobody)
            exists, hint = False, ""
        if not exists:
            return [f"source {node!r}: no such directory{hint}"]
    return []

