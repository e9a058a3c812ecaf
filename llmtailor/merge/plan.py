"""The merge plan file: a strict, validated reading of the YAML a user writes.

Two spellings are accepted, so mergekit and LLMTailor users can bring their plans::

    # mergekit form
    merge_method: passthrough          # the only method: layer assembly, nothing is blended
    slices:
      - sources: [{model: runs/a@400, layer_range: [0, 16]}]    # half-open, as in mergekit
      - sources: [{model: runs/b@500, layer_range: [16, 32]}]
    base_model: runs/b@500             # default source of embed / norm / head and of state
    dtype: bfloat16                    # only if it is the sources' dtype (no casting)
    tokenizer_source: base             # accepted and recorded; tokenizers are not copied
    embed: runs/a@400                  # optional per auxiliary unit: embed, norm, head
    optimizer: true                    # move each layer's optimizer state with it
    state_from: runs/b@500             # step, scheduler, RNG, trainer state (default: newest)

    # published LLMTailor form: auxiliary tensors by name (mapped to units via the layout)
    pre_weights:  [{name: model.embed_tokens.weight, model: runs/a@400}]
    post_weights: [{name: model.norm.weight, model: runs/b@500}, {name: lm_head.weight, model: runs/b@500}]

A source (SRC) is ``RUN@STEP`` (a tailored run's composite at a step), ``RUN`` (its newest
composite) or a Hugging Face Trainer ``checkpoint-N/`` directory. Relative paths resolve
against the plan file's directory. Every problem of a plan is reported at once in one
ConfigError naming the plan file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmtailor.errors import ConfigError, describe_validation

PASSTHROUGH = "passthrough"
_STEP_SUFFIX = re.compile(r"^(.*)@([0-9]+)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SliceSource(_Strict):
    model: str = Field(min_length=1)
    layer_range: tuple[int, int]
    """Half-open ``[a, b)`` range of the source's layers, as in mergekit."""

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] < 0 or value[1] < value[0]:
            raise ValueError(f"layer_range {list(value)} must be [a, b] with 0 <= a <= b")
        return value


class Slice(_Strict):
    sources: list[SliceSource]

    @field_validator("sources")
    @classmethod
    def _one_source(cls, value: list[SliceSource]) -> list[SliceSource]:
        if len(value) != 1:
            raise ValueError(f"a passthrough slice takes exactly one source, got {len(value)}")
        return value


class NamedWeight(_Strict):
    """An auxiliary tensor of the published LLMTailor form; its whole unit moves with it."""

    name: str = Field(min_length=1)
    model: str = Field(min_length=1)


class PlanSpec(_Strict):
    """The plan file's keys (see the module docstring)."""

    slices: list[Slice] = Field(min_length=1)
    merge_method: str = PASSTHROUGH
    dtype: str | None = None
    base_model: str | None = None
    tokenizer_source: str | None = None
    embed: str | None = None
    norm: str | None = None
    head: str | None = None
    pre_weights: list[NamedWeight] = []
    post_weights: list[NamedWeight] = []
    optimizer: bool = True
    state_from: str | None = None

    @field_validator("merge_method")
    @classmethod
    def _passthrough_only(cls, value: str) -> str:
        if value != PASSTHROUGH:
            raise ValueError(
                f"merge method {value!r} is not supported: only layer assembly (passthrough) is supported; "
                "blending tensors would break the exact optimizer state of a training checkpoint"
            )
        return value

    @model_validator(mode="after")
    def _some_layer(self) -> PlanSpec:
        if all(s.sources[0].layer_range[0] == s.sources[0].layer_range[1] for s in self.slices):
            raise ValueError("every slice is empty: the plan names no layer")
        return self


@dataclass(frozen=True)
class SourceRef:
    """A source as the plan names it: ``label`` is the text of the plan; ``step`` is None for
    a run's newest composite or an HF checkpoint directory."""

    label: str
    path: Path
    step: int | None


def parse_source(text: str, base_dir: Path) -> SourceRef:
    """``RUN@STEP``, ``RUN`` or a checkpoint directory; relative paths against ``base_dir``."""
    match = _STEP_SUFFIX.match(text)
    path_text, step = (match.group(1), int(match.group(2))) if match else (text, None)
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
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a plan is a YAML mapping (slices, merge_method, ...), got {type(data).__name__}")
    try:
        return PlanSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{path}: invalid plan: {describe_validation(err, limit=50)}") from None
