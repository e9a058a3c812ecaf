"""Planning a merge: a plan file resolved into an explicit list of per-tensor actions, and
every check that can be made from manifests, before any tensor byte is read.

Invariants of a ``MergePlan``:

- every destination unit (the layout of ``state_from`` with the plan's N layers) is taken
  whole from exactly one source unit, and each of its tensors has one ``Action``;
- output layer i taken from source layer j renames every key ``...layers.<j>....`` to
  ``...layers.<i>....``, weights and optimizer state together (``weight/<name>``,
  ``optim/<name>/<state key>``), using the family's own layer patterns;
- the layer ranges of the slices cover layer indices 0..N-1 exactly once (a plan assembles
  one model position by position; repeating or skipping a layer, as mergekit's depth-changing
  frankenmerges do, is refused as an overlap or a gap);
- names, shapes and dtypes of every renamed tensor equal what the destination expects, and
  with ``optimizer: true`` its optimizer state keys too; with ``optimizer: false`` no
  ``optim/*`` key is planned.

A Hugging Face ``checkpoint-N/`` source is imported (``import_hf``) into a temporary run in
a scratch directory beside OUT, removed when the plan is closed: this costs one copy of that
checkpoint, made before planning because its layout is only known after reading it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from llmtailor.constants import EMBED, HEAD, KIND_OPTIM, KIND_WEIGHT, LAYER_PREFIX, NORM, layer_unit
from llmtailor.errors import ConfigError, TailorError
from llmtailor.layouts import Layout, load_family, unit_rank
from llmtailor.layouts.layout import UnknownTensorError
from llmtailor.merge.plan import PlanSpec, SourceRef, load_plan, parse_source
from llmtailor.store.keys import join_key, split_key
from llmtailor.store.manifest import TensorEntry
from llmtailor.store.run import Composite, Run

HF_MARKERS = ("trainer_state.json", "config.json")


@dataclass(frozen=True)
class Action:
    """Copy ``source_key`` of ``source_unit`` (as saved at ``step`` in source ``source``) to
    ``dest_key`` of ``dest_unit``."""

    source: str
    step: int
    source_unit: str
    source_key: str
    dest_unit: str
    dest_key: str


@dataclass(frozen=True)
class Source:
    """An opened source: ``composite`` is the one the plan names (``RUN@STEP``, or newest)."""

    label: str
    run: Run
    composite: Composite
    layout: Layout
    imported_from: Path | None = None

    @property
    def step(self) -> int:
        return self.composite.step


@dataclass
class MergePlan:
    plan_file: Path
    spec: PlanSpec
    sources: dict[str, Source]
    state_from: str
    layout: Layout
    """The destination layout: ``state_from``'s, with the plan's number of layers."""
    actions: list[Action]
    renames: dict[str, dict[str, str]]
    """Destination unit -> {source parameter name: destination parameter name}."""
    warnings: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.sources[self.state_from].step

    @property
    def optimizer(self) -> bool:
        return self.spec.optimizer

    def actions_by_unit(self) -> dict[str, list[Action]]:
        grouped: dict[str, list[Action]] = {unit: [] for unit in self.layout.units}
        for action in self.actions:
            grouped[action.dest_unit].append(action)
        return grouped


@contextmanager
def open_plan(plan_file: str | Path, out: str | Path) -> Iterator[MergePlan]:
    """Load, resolve and validate ``plan_file``; yields the ``MergePlan``. Raises ConfigError
    (or another TailorError) naming every problem found, before any tensor byte is read.
    Temporary runs of imported HF sources live beside ``out`` until the block ends."""
    plan_file = Path(plan_file)
    spec = load_plan(plan_file)
    scratch = _Scratch(Path(out))
    try:
        yield _build(plan_file, spec, scratch)
    finally:
        scratch.remove()


class _Scratch:
    """A temporary directory beside OUT, made only when an HF source needs importing."""

    def __init__(self, out: Path):
        self.out, self.path = out, None

    def new_run_dir(self) -> Path:
        if self.path is None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.merge-", dir=self.out.parent))
        return self.path / f"source-{len(list(self.path.iterdir()))}"

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def _build(plan_file: Path, spec: PlanSpec, scratch: _Scratch) -> MergePlan:
    where = str(plan_file)
    warnings: list[str] = []
    sources = _open_sources(spec, plan_file.resolve().parent, scratch, where)

    # Output layer i <- (source label, source layer j), in slice order, as mergekit concatenates.
    layers: list[tuple[str, int]] = []
    for k, s in enumerate(spec.slices):
        src = s.sources[0]
        a, b = src.layer_range
        if a == b:
            warnings.append(f"slices[{k}]: zero-width layer_range [{a}, {b}] of {src.model!r} ignored")
        layers += [(src.model, j) for j in range(a, b)]
    problems = _coverage_problems([j for _, j in layers])

    state_label = spec.state_from or max(sources, key=lambda label: sources[label].step)
    state = sources[state_label]
    n = len(layers)
    if spec.optimizer and n != state.layout.num_layers:
        problems.append(
            f"the plan assembles {n} layers but state_from {state_label!r} has {state.layout.num_layers}; "
            "with optimizer: true the optimizer's param groups must keep the same parameters (renumbering "
            "optimizer groups for another depth is not supported); use optimizer: false to assemble weights only"
        )
    for label, source in sources.items():
        if source.layout.family != state.layout.family:
            problems.append(
                f"source {label!r} is a {source.layout.family!r} model, state_from {state_label!r} a "
                f"{state.layout.family!r} one: sources must share one architecture"
            )
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))

    # Destination unit -> (source label, source unit).
    assignment: dict[str, tuple[str, str]] = {}
    default = spec.base_model or spec.slices[0].sources[0].model
    aux = _aux_sources(spec, sources, problems)
    for unit in state.layout.aux_units():
        assignment[unit] = (aux.get(unit, default), unit)
    for i, (label, j) in enumerate(layers):
        if layer_unit(j) not in sources[label].layout.units:
            problems.append(f"source {label!r} has {sources[label].layout.num_layers} layers; the plan names its layer {j}")
        assignment[layer_unit(i)] = (label, layer_unit(j))
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))

    family = load_family(state.layout.family)
    dest_units: dict[str, list[str]] = {}
    actions: list[Action] = []
    renames: dict[str, dict[str, str]] = {}
    for unit in sorted(assignment, key=unit_rank):
        label, source_unit = assignment[unit]
        source = sources[label]
        expected = _expected_entries(state, unit, family)
        rename = _renamer(family, source_unit, unit)
        version = source.composite.sources.get(source_unit)
        if version is None:
            problems.append(f"source {label!r}: its composite names no version of unit {source_unit}")
            continue
        got: dict[str, TensorEntry] = {}
        renames[unit] = {}
        for entry in source.run.unit_entry(version, source_unit).tensors:
            kind, name, state_key = split_key(entry.key)
            if kind == KIND_OPTIM and not spec.optimizer:
                continue
            dest_name = rename(name)
            if dest_name is None:
                problems.append(f"source {label!r}: tensor {name!r} of {source_unit} does not follow the layer naming")
                continue
            renames[unit][name] = dest_name
            dest_key = join_key(kind, dest_name, state_key)
            got[dest_key] = entry
            actions.append(Action(label, version, source_unit, entry.key, unit, dest_key))
        problems += _entry_problems(unit, label, source_unit, got, expected, spec)
        dest_units[unit] = [split_key(k)[1] for k in got if split_key(k)[0] == KIND_WEIGHT]
    if problems:
        problems = list(dict.fromkeys(problems))
        shown = problems[:12] + ([f"... ({len(problems)} problems in all)"] if len(problems) > 12 else [])
        raise ConfigError(f"{where}: " + "; ".join(shown))

    canonical = {name for names in dest_units.values() for name in names}
    aliases = {a: t for a, t in state.layout.aliases.items() if t in canonical and a not in canonical}
    layout = Layout(state.layout.family, dest_units, aliases)
    return MergePlan(plan_file, spec, sources, state_label, layout, actions, renames, warnings)


def _open_sources(spec: PlanSpec, base_dir: Path, scratch: _Scratch, where: str) -> dict[str, Source]:
    labels = [s.sources[0].model for s in spec.slices]
    labels += [x for x in (spec.base_model, spec.embed, spec.norm, spec.head, spec.state_from) if x]
    labels += [w.model for w in (*spec.pre_weights, *spec.post_weights)]
    refs = {label: parse_source(label, base_dir) for label in dict.fromkeys(labels)}
    problems, runs = [], {}
    for label, ref in refs.items():
        if _is_hf_checkpoint(ref.path):
            if ref.step is not None:
                problems.append(f"source {label!r}: an HF checkpoint directory takes no @STEP")
            runs[label] = None
        elif ref.path.is_dir() and Run(ref.path).steps():
            runs[label] = Run(ref.path)
        else:
            problems.append(f"source {label!r}: {ref.path} is neither a tailored run nor an HF checkpoint-N/ directory")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    sources = {}
    for label, ref in refs.items():
        try:
            sources[label] = _open(label, ref, runs[label], scratch)
        except TailorError as err:
            problems.append(f"source {label!r}: {err}")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return sources


def _open(label: str, ref: SourceRef, run: Run | None, scratch: _Scratch) -> Source:
    imported = None
    if run is None:
        from llmtailor.interop.hf_import import import_hf

        run = Run(scratch.new_run_dir())
        import_hf(ref.path, run.root)
        imported = ref.path
    composite = run.resolve(ref.step)
    return Source(label, run, composite, Layout.from_record(composite.manifest.layout), imported)


def _is_hf_checkpoint(path: Path) -> bool:
    return all((path / marker).is_file() for marker in HF_MARKERS)


def _coverage_problems(indices: list[int]) -> list[str]:
    counts = Counter(indices)
    gaps = [j for j in range(max(indices, default=-1) + 1) if j not in counts]
    overlaps = sorted(j for j, c in counts.items() if c > 1)
    problems = []
    if gaps:
        problems.append(f"layer gap: no slice covers layers {gaps}")
    if overlaps:
        problems.append(f"layer overlap: layers {overlaps} are covered more than once")
    if problems:
        problems[-1] += " (the slices must cover layers 0..N-1 each exactly once)"
    return problems


def _aux_sources(spec: PlanSpec, sources: dict[str, Source], problems: list[str]) -> dict[str, str]:
    """Auxiliary unit -> source label from ``embed``/``norm``/``head`` and ``pre_weights`` /
    ``post_weights`` (a name moves its whole unit; tied names resolve through aliases)."""
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
        if label is not None:
            if chosen.setdefault(unit, label) != label:
                problems.append(f"key {unit!r}: {label!r} disagrees with pre/post_weights naming {chosen[unit]!r}")
    return chosen


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


def _expected_entries(state: Source, unit: str, family) -> dict[str, TensorEntry]:
    """What the destination expects in ``unit``: state_from's own version of it (its layer 0,
    renamed, for a layer index it does not have)."""
    own = unit if unit in state.layout.units else layer_unit(0)
    version = state.composite.sources[own]
    rename = _renamer(family, own, unit)
    out = {}
    for entry in state.run.unit_entry(version, own).tensors:
        kind, name, state_key = split_key(entry.key)
        out[join_key(kind, rename(name), state_key)] = entry
    return out


def _entry_problems(unit, label, source_unit, got, expected, spec: PlanSpec) -> list[str]:
    problems = []
    wanted = {k for k in expected if spec.optimizer or split_key(k)[0] != KIND_OPTIM}
    origin = f"{unit} from {label!r} {source_unit}"
    missing, extra = sorted(wanted - got.keys()), sorted(got.keys() - wanted)
    if missing or extra:
        problems.append(f"{origin}: architecture or optimizer state differs from state_from "
                        f"(lacks {missing[:3]}, has extra {extra[:3]})")
    for key in sorted(wanted & got.keys()):
        have, want = got[key], expected[key]
        if (have.dtype, have.shape) != (want.dtype, want.shape):
            problems.append(f"{origin}: {key} is {have.dtype} {have.shape}, the destination expects {want.dtype} {want.shape}")
        elif spec.dtype is not None and split_key(key)[0] == KIND_WEIGHT and have.dtype != spec.dtype:
            problems.append(
                f"key 'dtype': {spec.dtype} differs from the sources' {have.dtype}; a merge never casts, "
                "since casting would break the exact optimizer state"
            )
    return problems
