"""Planning a merge: a plan file resolved into an explicit list of per-tensor actions, and
every check that can be made from headers and manifests, before any tensor byte is read.

Invariants of a ``MergePlan``:

- the output's layers are the slices' layer ranges concatenated (mergekit's passthrough):
  output layer i is source layer j of the slice it falls in; any depth, layers repeated,
  skipped or reordered; the auxiliary units come from the first slice's model (embed) and the
  last slice's model (norm, head) unless the plan names their sources;
- every destination unit is taken whole from exactly one source unit, and each of its tensors
  has one ``Action``; output layer i taken from source layer j renames every key
  ``...layers.<j>....`` to ``...layers.<i>....``, weights and optimizer state together, with
  the family's own layer patterns;
- names, shapes and dtypes of every renamed tensor equal what the destination expects (the
  layer template of the state source), with its optimizer state keys too when optimizer state
  moves; with it, each output parameter joins the optimizer param group its source parameter
  was in, so a model deepened by repeating layers resumes training with their moments;
- a weight is cast to ``dtype`` as read, has its vocabulary rows taken (``tokenizer_source``),
  is scaled, then cast to ``out_dtype``, as mergekit does (``Action``); each of these applies to
  weights only and is refused with optimizer state (exactness first); a ``model`` output moves
  no optimizer state;
- every problem is reported in one ConfigError: the sources that do not open do not stop the
  checks that can be made without them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from llmtailor.constants import EMBED, HEAD, KIND_WEIGHT, LAYER_PREFIX, NORM, layer_unit
from llmtailor.errors import ConfigError, TailorError
from llmtailor.layouts import Layout, load_family, unit_rank
from llmtailor.layouts.layout import UnknownTensorError
from llmtailor.merge.plan import (
    FORMATS,
    SHOWN_PROBLEMS,
    Parameters,
    PlanSpec,
    Slice,
    SliceSource,
    load_plan,
    parse_source,
)
from llmtailor.interop.source import Source, TensorInfo
from llmtailor.interop.sources import open_source
from llmtailor.outputs.directory import Scratch
from llmtailor.merge.vocab import VOCAB_UNITS, build_vocabulary, vocab_size_of
from llmtailor.store.keys import join_key, split_key, unit_weights


@dataclass(frozen=True)
class Action:
    """Copy ``source_key`` of ``source_unit`` (of source ``source``, its version saved at
    ``step``) to ``dest_key`` of ``dest_unit``; weights only, in mergekit's order: cast to
    ``read_dtype`` (the plan's ``dtype``) as read, multiplied by ``scale``, cast to ``dtype``
    (``out_dtype``) as written, each when set."""

    source: str
    step: int | None
    source_unit: str
    source_key: str
    dest_unit: str
    dest_key: str
    scale: float | None = None
    dtype: str | None = None
    read_dtype: str | None = None
    rows: tuple[int, ...] | None = None
    """A vocabulary tensor's rows for ``tokenizer_source`` (merge/vocab.py), taken after the read
    cast: row i is source row ``rows[i]``, a zero row where that is -1."""
    written: TensorInfo | None = None
    """The tensor as it is written: its dtype and shape after the casts and the rows taken."""

    @property
    def unchanged(self) -> bool:
        return self.scale in (None, 1.0) and self.dtype is None and self.read_dtype is None and self.rows is None

    def describe(self) -> str:
        """What happens to the tensor, for messages and the dry run (empty: copied as it is)."""
        steps = [f"as {self.read_dtype}" if self.read_dtype else "",
                 f"{len(self.rows)} vocabulary rows" if self.rows is not None else "",
                 f"scale {self.scale}" if self.scale not in (None, 1.0) else "", f"to {self.dtype}" if self.dtype else ""]
        return ", ".join(x for x in steps if x)


@dataclass
class MergePlan:
    plan_file: Path
    spec: PlanSpec
    sources: dict[str, Source]
    state_from: str
    layout: Layout
    """The destination layout."""
    actions: list[Action]
    renames: dict[str, dict[str, str]]
    """Destination unit -> {source parameter name: destination parameter name}."""
    optimizer: bool
    optimizer_groups: list[dict[str, Any]] | None
    """The output's param groups (names), with ``optimizer``."""
    model_config: dict[str, Any] | None
    """The output's HF model config (its layer count the plan's)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.sources[self.state_from].step or 0

    def actions_by_unit(self) -> dict[str, list[Action]]:
        grouped: dict[str, list[Action]] = {unit: [] for unit in self.layout.units}
        for action in self.actions:
            grouped[action.dest_unit].append(action)
        return grouped


@contextmanager
def open_plan(plan_file: str | Path, out: str | Path, format: str = "tailor") -> Iterator[MergePlan]:
    """Load, resolve and validate ``plan_file`` for an output in ``format``; yields the
    ``MergePlan``. Raises ConfigError (or another TailorError) naming every problem found,
    before any tensor byte is read. Temporary copies (a DeepSpeed source's conversion) live
    beside ``out`` until the block ends. A ``model`` output holds no optimizer state, so its plan moves
    none (and may cast and scale whatever its sources hold)."""
    from llmtailor.store.storage import is_url

    if format not in FORMATS:
        raise ConfigError(f"unknown output format {format!r}; expected one of {FORMATS}")
    plan_file = Path(plan_file)
    spec = load_plan(plan_file)
    sources: dict[str, Source] = {}
    with Scratch(None if is_url(out) else Path(out), "merge") as scratch:
        try:
            sources, problems = _open_sources(spec, plan_file.resolve().parent, scratch)
            yield _build(plan_file, spec, sources, writes_optimizer=format != "model", problems=problems)
        finally:
            for source in sources.values():
                source.close()


def _labels(spec: PlanSpec) -> list[str]:
    labels = [s.sources[0].model for s in spec.slices or []] + [m.model for m in spec.models or []]
    labels += [x for x in (spec.base_model, spec.embed, spec.norm, spec.head, spec.state_from) if x]
    labels += [w.model for w in (*spec.pre_weights, *spec.post_weights)]
    if spec.tokenizer_source not in (None, "base"):
        labels.append(spec.tokenizer_source)
    return list(dict.fromkeys(labels))


def _open_sources(spec: PlanSpec, base_dir: Path, scratch: Scratch) -> tuple[dict[str, Source], list[str]]:
    """The sources that open, and a problem for each that does not (planning goes on without
    it, so the plan's other problems are reported with it)."""
    problems, sources = [], {}
    for label in _labels(spec):
        ref = parse_source(label, base_dir)
        try:
            sources[label] = open_source(label, ref.path, ref.step, scratch)
        except TailorError as err:
            problems.append(f"source {label!r}: {err}")
    return sources, problems


@dataclass
class _Findings:
    """What planning has found wrong (refused together, as one error) and worth a warning."""

    where: str
    problems: list[str]
    warnings: list[str] = field(default_factory=list)

    def refuse_if_any(self) -> None:
        if self.problems:
            _refuse(self.where, self.problems)


# Output layer i <- (source label, source layer j, its parameters, its position t in its slice).
_Layer = tuple[str, int, list[Parameters | None], float]
# Destination unit -> (source label, source unit, parameters, t).
_Assignment = dict[str, tuple[str, str, list[Parameters | None], float]]


def _build(plan_file: Path, spec: PlanSpec, sources: dict[str, Source], writes_optimizer: bool,
           problems: list[str]) -> MergePlan:
    """The plan, or one ConfigError with every problem: ``problems`` (the sources that did not
    open) first; what can be checked without those sources is checked all the same. Each
    phase refuses before the next, which needs what it checked."""
    found = _Findings(str(plan_file), list(problems))
    if not sources:
        _refuse(found.where, found.problems)
    slices, layers = _slices_and_layers(spec, sources, found)
    _layers_kept_in_place(sources, layers, found)
    first, last = slices[0].sources[0].model, slices[-1].sources[0].model
    family_name, state_label, optimizer = _state_and_optimizer(spec, sources, first, last, writes_optimizer, found)
    found.refuse_if_any()
    assignment = _assign(spec, sources, slices, layers, first, last, state_label, found)
    vocab = None
    if spec.tokenizer_source is not None:
        vocab = build_vocabulary(spec.tokenizer_source, spec.base_model or first,
                                 [assignment[u][0] for u in VOCAB_UNITS if u in assignment], sources, found.problems,
                                 found.warnings)
    found.refuse_if_any()
    family = load_family(family_name)
    actions, renames, dest_units = _actions(spec, sources, assignment, state_label, family, optimizer, vocab, found)
    found.refuse_if_any()
    canonical = {name for names in dest_units.values() for name in names}
    template = sources[state_label].layout
    aliases = {a: t for a, t in template.aliases.items() if t in canonical and a not in canonical}
    layout = Layout(family_name, dest_units, aliases)
    groups = _optimizer_groups(sources, state_label, layout, assignment, renames, found.where) if optimizer else None
    config = _model_config(sources, state_label, first, family.num_layers_key, [(label, j) for label, j, *_ in layers],
                           spec.output_dtype, found.where)
    if config is not None and vocab is not None:
        config["vocab_size"] = vocab.size  # mergekit: the output tokenizer's size
    return MergePlan(plan_file, spec, sources, state_label, layout, actions, renames, optimizer, groups, config,
                     found.warnings)


def _slices_and_layers(spec: PlanSpec, sources: dict[str, Source], found: _Findings) -> tuple[list[Slice], list[_Layer]]:
    """The plan's slices (mergekit's models form is one slice of the model's whole depth, its
    parameters the source's) and the output's layers, in order."""
    slices = spec.slices or [
        Slice(sources=[SliceSource(model=m.model, layer_range=(0, sources[m.model].layout.num_layers if m.model in sources else 0),
                                   parameters=m.parameters)])
        for m in spec.models
    ]
    layers: list[_Layer] = []
    for k, s in enumerate(slices):
        src = s.sources[0]
        a, b = src.layer_range
        if a == b:
            found.warnings.append(f"slices[{k}]: zero-width layer_range [{a}, {b}] of {src.model!r} ignored")
        if src.model not in sources:
            continue  # reported already
        for j in range(a, b):
            if layer_unit(j) not in sources[src.model].layout.units:
                found.problems.append(
                    f"slices[{k}]: source {src.model!r} has {sources[src.model].layout.num_layers} layers; "
                    f"layer_range {list(src.layer_range)} names its layer {j}"
                )
                break
            # A gradient runs from the slice's first layer (t = 0) to its last (t = 1); one layer: t = 1.
            t = (j - a) / (b - a - 1) if b - a > 1 else 1
            layers.append((src.model, j, [src.parameters, s.parameters, spec.parameters], t))
    if not layers and not found.problems:
        found.problems.append("every slice is empty: the plan names no layer")
    return slices, layers


PLACE_BOUND = {
    "hidden_size_per_layer_input": "per-layer inputs (embed_tokens_per_layer and per_layer_model_projection hold "
                                   "one block per layer, by its place)",
    "num_kv_shared_layers": "KV sharing (its last layers reuse the cache of an earlier layer, by place)",
}
"""Config keys whose non-zero value binds a model's layers to their places (gemma3n, gemma4):
a layer moved, or a stack of another depth, would meet another layer's per-layer input block
or cache, which no tensor of the layer's own unit says; the plan is refused, never merged wrong.
So are the layers of a model whose layer units hold several stacks (a multimodal model's text
and vision towers, ``Layout.layer_stacks``): a plan names layers of one stack, and moving a
unit would move the other stacks' layers with it (mergekit 0.1.5 refuses ``slices`` for such a
model, asking for its per-module syntax, which llmtailor does not take)."""


def _layers_kept_in_place(sources: dict[str, Source], layers: list[_Layer], found: _Findings) -> None:
    """A source whose config binds its layers to their places (``PLACE_BOUND``), or whose layer
    units hold several stacks of layers, may give the output only a stack of its own depth,
    each layer at its own place."""
    for label in dict.fromkeys(label for label, *_ in layers):
        depth = sources[label].layout.num_layers
        moved = [(i, j) for i, (other, j, *_) in enumerate(layers) if other == label and i != j]
        if not moved and len(layers) == depth:
            continue  # every layer at its own place in a stack of its depth: nothing to check (nor torch to import)
        values = _place_bound_values(sources[label].config or {})
        bound = [why for key, why in PLACE_BOUND.items() if values.get(key)]
        if len(stacks := sources[label].layout.layer_stacks()) > 1:
            bound.append(f"{len(stacks)} stacks of layers ({', '.join(stacks)}), layer i of each in its unit layer.i")
        if bound:
            change = (f"puts its layer {moved[0][1]} at layer {moved[0][0]}" if moved
                      else f"makes a stack of {len(layers)} layers from its {depth}")
            found.problems.append(f"source {label!r} has {' and '.join(bound)}; the plan {change}: llmtailor cannot move "
                                  "its layers exactly, so each must stay at its own place in a stack of its depth")


def _place_bound_values(config: dict[str, Any]) -> dict[str, Any]:
    """The ``PLACE_BOUND`` keys' values of a config (a multimodal model's: its ``text_config``'s)
    as its transformers config class gives them, defaults included: transformers 4.x saved only
    the keys that differ from the class's defaults, so a gemma3n or gemma4 config.json without
    ``hidden_size_per_layer_input`` has per-layer inputs all the same (the default, 256). Where
    transformers does not know the config (or refuses it), the keys written."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    written = {key: config.get(key) or text.get(key) for key in PLACE_BOUND}
    made = _transformers_config(config)
    try:
        made = made.get_text_config() if made is not None else None
    except Exception:  # a config transformers makes but cannot name the text part of
        made = None
    if made is None:
        return written
    return {key: getattr(made, key, None) or value for key, value in written.items()}


def _transformers_config(config: dict[str, Any]) -> Any:
    """``config`` as its transformers config class makes it (the values it derives and its
    defaults included; these classes import torch), from a copy (``from_dict`` edits its
    input); None where transformers does not know the config (no ``model_type``, no such
    class, not installed) or refuses it."""
    try:
        import transformers

        return transformers.CONFIG_MAPPING[config["model_type"]].from_dict(copy.deepcopy(config))
    except Exception:
        return None


def _state_and_optimizer(spec: PlanSpec, sources: dict[str, Source], first: str, last: str, writes_optimizer: bool,
                         found: _Findings) -> tuple[str, str, bool]:
    """The shared architecture, the source the training state comes from, and whether the
    output holds optimizer state."""
    families = {label: s.layout.family for label, s in sources.items()}
    if first not in families:
        first = next(iter(families))  # for the checks below; the plan is refused already
    family_name = families[first]
    found.problems += [
        f"source {label!r} is a {fam!r} model, {first!r} a {family_name!r} one: sources must share one architecture"
        for label, fam in families.items() if fam != family_name
    ]
    state_label = spec.state_from if spec.state_from in sources else spec.base_model if spec.base_model in sources else max(
        sources, key=lambda label: (sources[label].step is not None, sources[label].step or 0, label == last)
    )
    # Every source but one named only for its tokenizer contributes tensors or state.
    tensor_sources = {label: s for label, s in sources.items() if label in _labels(spec.model_copy(update={"tokenizer_source": None}))}
    stateless = [label for label, s in tensor_sources.items() if not s.has_optimizer()]
    optimizer = spec.optimizer if spec.optimizer is not None else not stateless
    if not writes_optimizer:
        if spec.optimizer:
            found.warnings.append("optimizer: true ignored: --format model writes weights only")
        optimizer = False
    elif spec.optimizer is None and stateless:
        found.warnings.append(f"weights only: {stateless} hold no optimizer state (optimizer: false by default)")
    if optimizer:
        found.problems += [f"optimizer: true, but source {label!r} ({sources[label].kind}) holds no optimizer state; set "
                           "optimizer: false" for label in stateless]
    return family_name, state_label, optimizer


def _assign(spec: PlanSpec, sources: dict[str, Source], slices: list[Slice], layers: list[_Layer], first: str, last: str,
            state_label: str, found: _Findings) -> _Assignment:
    """Which source unit each destination unit comes from, with the parameters that apply."""
    assignment: _Assignment = {}
    aux = _aux_sources(spec, sources, first, last, found.problems)
    template = sources[state_label].layout
    named = sources[aux[HEAD]].layout
    if HEAD in named.units and HEAD not in template.units and aux[HEAD] != aux[EMBED]:
        # A tied output has no head of its own: another source's head would be silently left out.
        found.problems.append(
            f"the LM head is taken from {aux[HEAD]!r}, but the output's model (the config of {state_label!r}) ties "
            f"{', '.join(named.units[HEAD])} to {', '.join(template.units.get(EMBED, []))}, taken from {aux[EMBED]!r}: "
            f"the head of {aux[HEAD]!r} would be lost; take the embedding from {aux[HEAD]!r} too, or the config "
            "(state_from) from a model with a head of its own")
    if HEAD in template.units and HEAD not in named.units:
        # An untied output whose head source ties its head: the output's lm_head would be missing
        # (mergekit 0.1.5 writes no head then, and the model loads with a newly initialised one).
        found.problems.append(
            f"the output's model (the config of {state_label!r}) has an LM head of its own "
            f"({', '.join(template.units[HEAD])}), but its source {aux[HEAD]!r} ties its head to its embedding and "
            f"holds none: the output's head would be missing; take the head from a model with one of its own "
            f"(head: SRC), or the config (state_from) from a model that ties its head too")
    for unit in (u for u in template.aux_units() if u not in (EMBED, NORM, HEAD) or u in sources[aux[u]].layout.units):
        label = aux.get(unit, first)
        # mergekit: the embeddings take the first slice's parameters, the final norm and head the
        # last slice's (a source's own only where it is the unit's source), at t = 0.
        s = slices[0] if unit == EMBED else slices[-1] if unit in (NORM, HEAD) else None
        params = [spec.parameters] if s is None else [
            *(src.parameters for src in s.sources if src.model == label), s.parameters, spec.parameters]
        assignment[unit] = (label, unit, params, 0.0)
    for i, (label, j, params, t) in enumerate(layers):
        assignment[layer_unit(i)] = (label, layer_unit(j), params, t)
    return assignment


def _actions(spec: PlanSpec, sources: dict[str, Source], assignment: _Assignment, state_label: str, family,
             optimizer: bool, vocab, found: _Findings) -> tuple[list[Action], dict[str, dict[str, str]], dict[str, list[str]]]:
    """One action per destination tensor; the parameter renames per unit; the destination
    units' weight names. Sources that do not fit the state source are summarised per source."""
    dest_units: dict[str, list[str]] = {}
    actions: list[Action] = []
    renames: dict[str, dict[str, str]] = {}
    misfits: dict[str, list[str]] = {}  # source label -> a line per misfitting unit, summarised below
    for unit in sorted(assignment, key=unit_rank):
        label, source_unit, params, t = assignment[unit]
        source = sources[label]
        if source_unit not in source.layout.units:
            found.problems.append(f"source {label!r} has no unit {source_unit} (its layout: {list(source.layout.units)})")
            continue
        got, renames[unit] = _unit_actions(spec, label, source, source_unit, unit, params, t, family, optimizer, vocab,
                                           actions, found)
        misfit = _misfit(source_unit if source_unit == unit else f"{source_unit} (put at {unit})", got,
                         _expected(sources[state_label], unit, family, optimizer))
        if misfit:
            misfits.setdefault(label, []).append(misfit)
        dest_units[unit] = list(unit_weights(got))  # a DeepSpeed source holds fp32 masters, no weights
    for label, lines in misfits.items():
        more = f" (and {len(lines) - 1} more units like it)" if len(lines) > 1 else ""
        # Of the state source itself: its layers differ from one another (a gemma's sliding and full attention).
        whom = ("the output's layers, as the config of that source has them" if label == state_label else
                f"the state source {state_label!r}")
        found.problems.append(f"source {label!r} does not fit {whom}: {lines[0]}{more}")
    changed = sorted({f"{a.dest_key} ({a.describe()})" for a in actions if not a.unchanged})
    if optimizer and changed:
        found.problems.append(
            f"dtype / parameters: scale / tokenizer_source would change weights {changed[:3]}, which the optimizer state "
            "was computed for: allowed only with optimizer: false or --format model (a merge that moves optimizer state "
            "never casts, scales or cuts)"
        )
    return actions, renames, dest_units


def _unit_actions(spec: PlanSpec, label: str, source: Source, source_unit: str, unit: str, params: list[Parameters | None],
                  t: float, family, optimizer: bool, vocab, actions: list[Action],
                  found: _Findings) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Append the actions of one destination unit; return its tensors (by destination key) and
    its renames."""
    rename = _renamer(family, source_unit, unit)
    got: dict[str, TensorInfo] = {}
    renames: dict[str, str] = {}
    for key, info in source.tensors(source_unit, optimizer).items():
        kind, name, state_key = split_key(key)
        dest_name = rename(name)
        if dest_name is None:
            found.problems.append(f"source {label!r}: tensor {name!r} of {source_unit} does not follow the layer naming")
            continue
        renames[name] = dest_name
        dest_key = join_key(kind, dest_name, state_key)
        got[dest_key] = info
        if kind == KIND_WEIGHT:
            # mergekit matches a filter against the source's name of the tensor; casts to
            # ``dtype`` as it reads, scales, then casts to ``out_dtype`` as it writes.
            scale = _scale(params, name, t)
            read_dtype = spec.dtype if spec.dtype not in (None, _dtype_name(info.dtype)) else None
            computed = read_dtype or _dtype_name(info.dtype)
            dtype = spec.out_dtype if spec.out_dtype not in (None, computed) else None
            rows = vocab.rows_of(label, unit, info, vocab_size_of(source)) if vocab is not None else None
        else:
            scale = dtype = read_dtype = rows = None
        shape = (len(rows), *info.shape[1:]) if rows is not None else tuple(info.shape)
        written = TensorInfo(dtype or read_dtype or _dtype_name(info.dtype), shape)
        actions.append(Action(label, info.step, source_unit, key, unit, dest_key, scale, dtype, read_dtype, rows, written))
    return got, renames


def _refuse(where: str, problems: list[str]) -> NoReturn:
    """Raise one ConfigError naming the plan file and its problems, each once, the first
    ``SHOWN_PROBLEMS`` of them in full."""
    problems = list(dict.fromkeys(problems))
    shown = problems[:SHOWN_PROBLEMS]
    shown += [f"... ({len(problems)} problems in all)"] if len(problems) > SHOWN_PROBLEMS else []
    raise ConfigError(f"{where}: " + "; ".join(shown))


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scale(params: list[Parameters | None], name: str, t: float) -> float | None:
    """The first scale that applies: slice source, slice, then top-level parameters."""
    for p in params:
        if p is not None:
            value = p.scale_for(name, t)
            if value is not None:
                return value
    return None


def _aux_sources(spec: PlanSpec, sources: dict[str, Source], first: str, last: str, problems: list[str]) -> dict[str, str]:
    """Auxiliary unit -> source label: as mergekit does (embed from the first slice's model,
    norm and head from the last slice's), unless ``embed``/``norm``/``head`` or ``pre_weights``
    / ``post_weights`` name them (a name moves its whole unit; tied names resolve through
    aliases)."""
    chosen: dict[str, str] = {}
    for key, weights in (("pre_weights", spec.pre_weights), ("post_weights", spec.post_weights)):
        for w in weights:
            try:
                unit = sources[w.model].layout.unit_of(w.name)
            except UnknownTensorError as err:
                problems.append(f"{key}: {err}")
                continue
            if unit.startswith(LAYER_PREFIX):
                problems.append(f"{key}: {w.name!r} is in {unit}; layers are chosen by slices")
            elif chosen.setdefault(unit, w.model) != w.model:
                problems.append(f"{key}: unit {unit} is named from both {chosen[unit]!r} and {w.model!r}; a unit moves whole")
    for unit, label in ((EMBED, spec.embed), (NORM, spec.norm), (HEAD, spec.head)):
        if label is not None and chosen.setdefault(unit, label) != label:
            problems.append(f"key {unit!r}: {label!r} disagrees with pre/post_weights naming {chosen[unit]!r}")
    defaults = {EMBED: first, NORM: last, HEAD: last}
    return {**{u: chosen.get(u, defaults.get(u, first)) for u in (EMBED, NORM, HEAD)},
            **{u: l for u, l in chosen.items() if u not in defaults}}


def _renamer(family, source_unit: str, dest_unit: str):
    """Parameter name in ``source_unit`` -> its name in ``dest_unit`` (None: not a layer name)."""
    if not source_unit.startswith(LAYER_PREFIX):
        return lambda name: name
    j, i = int(source_unit.removeprefix(LAYER_PREFIX)), dest_unit.removeprefix(LAYER_PREFIX)

    def rename(name: str) -> str | None:
        hits = [(m.start(), key, m) for key, regex in family.matchers if (m := regex.search(name))]
        if not hits:
            return None
        _, key, m = min(hits, key=lambda hit: hit[0])
        if key != LAYER_PREFIX.rstrip(".") or int(m.group(1)) != j:
            return None
        return name[: m.start(1)] + i + name[m.end(1) :]

    return rename


def _expected(state: Source, unit: str, family, optimizer: bool) -> dict[str, TensorInfo]:
    """What the destination expects in ``unit``: the state source's own version of it (its layer
    0, renamed, for a layer)."""
    own = unit if unit in state.layout.units else layer_unit(0)
    if own not in state.layout.units:
        return {}
    rename = _renamer(family, own, unit)
    out = {}
    for key, info in state.tensors(own, optimizer).items():
        kind, name, state_key = split_key(key)
        out[join_key(kind, rename(name), state_key)] = info
    return out


def _misfit(source_unit: str, got: dict[str, TensorInfo], expected: dict[str, TensorInfo]) -> str | None:
    """One short line on how ``source_unit``'s tensors differ from what the destination expects
    (None: they fit): the keys it lacks or has extra, else how many differ in shape or dtype,
    with one example."""
    if not expected:
        return None
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or extra:
        return (f"its {source_unit} lacks {len(missing)} tensors ({', '.join(missing[:2])}) and has {len(extra)} "
                f"extra ({', '.join(extra[:2])}): another architecture, or other optimizer state")
    differ = [k for k in sorted(got, key=lambda k: (split_key(k)[0] != KIND_WEIGHT, k))
              if (got[k].dtype, got[k].shape) != (expected[k].dtype, expected[k].shape)]
    if not differ:
        return None
    key = differ[0]
    return (f"{len(differ)} of the {len(got)} tensors of its {source_unit} differ in shape or dtype, e.g. {key} is "
            f"{_dtype_name(got[key].dtype)} {list(got[key].shape)}, expected {_dtype_name(expected[key].dtype)} "
            f"{list(expected[key].shape)}")


def _optimizer_groups(sources, state_label, layout, assignment, renames, where) -> list[dict[str, Any]]:
    """The output's param groups: the state source's hyperparameters; each output parameter in
    the group (by index) its source parameter was in; within a group, units in layout order and
    within a unit the order of its source's group (the model's own order, which Trainer's
    positional optimizer.pt follows)."""
    state_groups = sources[state_label].global_state()["optimizer_groups"]
    membership: dict[str, dict[str, int]] = {}
    position: dict[str, dict[str, int]] = {}
    problems = []
    for label, source in sources.items():
        if not source.has_optimizer():
            continue  # a tokenizer's source only
        groups = source.global_state()["optimizer_groups"]
        if len(groups) != len(state_groups):
            problems.append(f"source {label!r} has {len(groups)} optimizer groups, the state source {len(state_groups)}")
        membership[label] = {name: index for index, group in enumerate(groups) for name in group["params"]}
        position[label] = {name: i for group in groups for i, name in enumerate(group["params"])}
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    members: list[list[str]] = [[] for _ in state_groups]
    for unit, names in layout.units.items():
        label = assignment[unit][0]
        moved = [(position[label][s], s, d) for s, d in renames[unit].items() if d in names and s in membership[label]]
        for _, source_name, dest_name in sorted(moved):
            members[membership[label][source_name]].append(dest_name)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": m} for g, m in zip(state_groups, members)]


LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
"""Where transformers' configs hold their number of layers, for a model no family file
describes (gemma3, gemma4, ...): the first that holds the source's number of layer units is
its layer count, updated where a plan changes the depth (before, a cut gemma4 kept its old
count beside the cut layer_types, and transformers refused to load it)."""


def _model_config(sources, state_label, first, num_layers_key, layers: list[tuple[str, int]], cast,
                  where) -> dict[str, Any] | None:
    """The output's HF config: the state source's (else the first slice's), its layer count
    under the family's own key (a family without one, as the name-based fallback: the usual key
    that holds the source's number of layers, ``LAYER_COUNT_KEYS``), its dtype the cast's, and its ``layer_types`` (per layer: sliding
    or full attention, ...) those of the output's layers (``layers``: output layer i is layer j
    of a source) as their sources' configs give them, so each layer keeps the attention it was
    trained with wherever a plan puts it."""
    label = state_label if sources[state_label].config else first
    config = sources[label].config
    if config is None:
        return None
    config = dict(config)
    if num_layers_key is None:
        depth = sources[label].layout.num_layers
        num_layers_key = next((key for key in LAYER_COUNT_KEYS if config.get(key) == depth), None)
    if num_layers_key is not None and config.get(num_layers_key) not in (None, len(layers)):
        config[num_layers_key] = len(layers)
    # A config without the list: derived (transformers' config classes import torch) only where
    # a layer moved or comes from a source of another config, whose kinds may differ at a place.
    moved = any(j != i for i, (_, j) in enumerate(layers))
    own = _kinds(config, derive=moved or any(sources[other].config != sources[label].config for other, _ in layers))
    kinds = _layer_types(sources, own, layers, where) if own is not None else None
    if kinds is not None and ("layer_types" in config or kinds != own):  # none written where its class derives them
        config["layer_types"] = kinds
    if isinstance(config.get("per_layer_config"), dict):
        config["per_layer_config"] = _per_layer_config(sources, layers, where)
    if kinds is not None and kinds != own and len(set(kinds)) > 1:  # one kind throughout: nothing to force
        _refuse_changed_kinds(config, kinds, layers, where)
    if cast is not None:
        config["torch_dtype"] = config["dtype"] = cast
    return config


def _layer_types(sources, own: list, layers: list[tuple[str, int]], where) -> list:
    """Each output layer's kind (``layer_types``): its source layer's, from that source's config;
    where a source's config gives none, the kind every layer of the output's config has."""
    kinds, known = [], {}
    for label, j in layers:
        if label not in known:  # each source's config once (a transformers config built where it lists none)
            known[label] = _kinds(sources[label].config)
        types = known[label]
        if isinstance(types, list) and j < len(types):
            kinds.append(types[j])
        elif len(set(own)) == 1:
            kinds.append(own[0])
        else:
            raise ConfigError(f"{where}: the output's config mixes layer_types {sorted(set(own))}, and the config of "
                              f"{label!r} gives none for its layer {j}: which attention that layer had is unknown")
    return kinds


def _refuse_changed_kinds(config: dict[str, Any], kinds: list, layers: list[tuple[str, int]], where) -> None:
    """ConfigError where the output config's transformers class would not keep ``kinds`` (the
    output's layers' own): gemma4's makes its last layer full attention whatever the list says,
    so a stack ending in a sliding layer would load that layer as another kind (of another
    shape). Checked only for a stack of mixed kinds that changed (transformers' config classes import
    torch); nothing to check where transformers does not know the config."""
    kept = getattr(_transformers_config(config), "layer_types", None)
    if kept is None:  # no such class or attribute, or a config it refuses (as loading the output would say)
        return
    changed = [i for i, (ours, theirs) in enumerate(zip(kinds, kept)) if ours != theirs]
    if changed:
        i = changed[0]
        label, j = layers[i]
        raise ConfigError(f"{where}: the output's layer {i} is layer {j} of {label!r}, a {kinds[i]} layer, which "
                          f"transformers' {config['model_type']!r} config makes a {kept[i]} layer there: it would not "
                          f"load as it was trained; put a {kept[i]} layer there")


def _per_layer_config(sources, layers: list[tuple[str, int]], where) -> dict[str, Any]:
    """The output's ``per_layer_config`` (gemma4's: the overrides of some layers, as a
    full-attention layer's wider ``head_dim``, keyed by layer index): each output layer's entry
    is its source layer's, from that source's config, so the entries follow their layers as
    ``layer_types`` do (before, a cut gemma4 kept an entry for a layer it no longer had, which
    transformers refuses, and a layer moved met its new place's overrides)."""
    entries: dict[str, Any] = {}
    for i, (label, j) in enumerate(layers):
        own = (sources[label].config or {}).get("per_layer_config")
        if not isinstance(own, dict):
            raise ConfigError(f"{where}: the output's config has a per_layer_config, and the config of {label!r} has "
                              f"none: which overrides its layer {j} had is unknown")
        entry = own.get(str(j), own.get(j))  # JSON's keys are strings; a config object's may be ints
        if entry is not None:
            entries[str(i)] = entry
    return entries


def _kinds(config: dict[str, Any] | None, derive: bool = True) -> list | None:
    """A config's ``layer_types``: its own list, else (``derive``) the one its transformers config
    class derives from it where it has none (a gemma2 config.json saved before transformers wrote
    the list: its layers alternate sliding and full attention by position; transformers' config
    classes import torch, which a plan that moves no layer does without); None where neither gives
    one (no such attribute, transformers not installed, a config it does not know)."""
    if not config:
        return None
    if isinstance(config.get("layer_types"), list):
        return config["layer_types"]
    if not derive:
        return None
    derived = getattr(_transformers_config(config), "layer_types", None)  # none: a family without layer kinds, or refused
    return list(derived) if isinstance(derived, (list, tuple)) else None
