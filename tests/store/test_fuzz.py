"""Untrusted snapshot input, fuzzed: our own clear errors, never a crash.

One real run (a tiny Llama trained with Parity, snapshots at steps 1, 2 and 3) is built once.
Each example damages one file of it in place — a ``manifest.json``, a unit index
(a line of ``indexes.json``), a ``global.json``, the safetensors header (length field and JSON
header) of a tensor file, or the ``latest`` pointer — and puts the original bytes back
afterwards. ``Run.verify``, ``Run.resolve`` and
``Tailor.restore`` (plain and with ``fallback=True``) must then succeed or raise a
``TailorError``: any other exception (KeyError, TypeError, pydantic's ValidationError,
RecursionError, ...) is a bug. Paths leaving the snapshot, wrong dtypes, absurd shapes and
sizes must moreover be refused before the tensor bytes concerned are read.

Unit indexes, global.json and tensor headers are damaged two ways: raw (the checksum of the
file listing them must catch it) and re-hashed (the sizes and checksums are updated to match,
up to the manifest, as in a crafted snapshot), which drives the damage past the checksums into
the JSON and safetensors decoders and the code that applies the state.

The properties run derandomized (the same examples every run) so the suite stays
deterministic; ``LLMTAILOR_FUZZ_EXAMPLES=N`` explores N fresh random examples per property.
Every crash the fuzzer found is kept, one reproducer each, in ``test_known_crash``.

The untrusted inputs fuzzed here are manifests, unit indexes, global.json, tensor-file headers
and the ``latest`` pointer; merge plan files are fuzzed in ``tests/merge/test_plan_fuzz.py``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import xxhash
from helpers import indexes_rewritten, tiny, train, unit_index_lines
from helpers import unit_file as file_holding
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmtailor import Parity, Tailor
from llmtailor.constants import GLOBAL_JSON, GLOBAL_TENSORS, INDEXES_FILE, LATEST_FILE, MANIFEST_FILE
from llmtailor.errors import TailorError
from llmtailor.providers import rng
from llmtailor.store.run import Run
from llmtailor.store.storage.local_lock import LEASE_FILE
from llmtailor.training_example import build_optimizer

STEPS = (1, 2, 3)
# Derandomized, so the suite is deterministic; LLMTAILOR_FUZZ_EXAMPLES=N explores afresh with
# N random examples per property.
_EXPLORE = os.environ.get("LLMTAILOR_FUZZ_EXAMPLES")
FUZZ = settings(
    max_examples=int(_EXPLORE or 60),
    derandomize=_EXPLORE is None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- the run ----------------------------------------------------------------------------------


class Saved:
    """The pristine run: its directory, the original bytes of every file, a model to copy."""

    def __init__(self, root: Path, original: dict[Path, bytes], template: Any):
        self.root, self.original, self.template = root, original, template

    def __repr__(self) -> str:  # hypothesis prints it with every falsifying example
        return f"Saved({self.root})"

    def tensor_files(self) -> list[tuple[int, str]]:
        """(step, path in the snapshot) of every safetensors file, in a fixed order."""
        return sorted(
            (step, path.relative_to(Run(self.root).snapshot_dir(step)).as_posix())
            for step in STEPS
            for path in Run(self.root).snapshot_dir(step).rglob("*.safetensors")
        )

    def path(self, step: int, name: str) -> Path:
        return Run(self.root).snapshot_dir(step) / name


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokens):
    rng_before = rng.capture_rng()  # restore() loads the run's RNG states; give them back after
    root = tmp_path_factory.mktemp("fuzz") / "run"
    model, optimizer, scheduler = tiny(layers=2, hidden=16)
    tailor = Tailor(root, model, optimizer, scheduler, policy=Parity())
    for step in STEPS:
        train(model, optimizer, scheduler, tokens, [step])
        tailor.save(step)
    tailor.close()
    original = {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    yield Saved(root=root, original=original, template=tiny(layers=2, hidden=16, seed=9)[0])
    rng.restore_rng(rng_before)
    assert {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} == original


def fresh(template) -> tuple:
    """A model like the run's with its own optimizer and scheduler (a copy: building one from
    a config costs 100 ms, a copy 2 ms)."""
    model = copy.deepcopy(template)
    return (model, *build_optimizer(model, total_steps=50))


@contextmanager
def damaged(saved: Saved, contents: dict[Path, bytes]):
    """Write ``contents`` over files of the run; put the original bytes back on exit."""
    try:
        for path, data in contents.items():
            path.write_bytes(data)
        yield
    finally:
        for path in contents:
            if path in saved.original:
                path.write_bytes(saved.original[path])
            else:
                path.unlink(missing_ok=True)


def read_everything(saved: Saved) -> None:
    """Every read path over the run; each must succeed or raise a TailorError."""
    for read in (
        lambda: Run(saved.root).verify(),
        lambda: Run(saved.root).resolve(),
        lambda: Run(saved.root).verify(Run(saved.root).resolve().step),
        lambda: Tailor(saved.root, *fresh(saved.template)).restore(),
        lambda: Tailor(saved.root, *fresh(saved.template)).restore(fallback=True),
    ):
        try:
            read()
        except TailorError:
            pass


# -- damage -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """One damage to a JSON text. ``at`` picks the node (an index taken modulo the number of
    candidate nodes, in document order, or an explicit path) or the byte offset; ``value`` is
    the new value, the new key, or ``[(offset, xor mask), ...]`` for ``flip``."""

    op: str  # replace | rename | delete | truncate | flip | length (tensor headers only)
    at: int | tuple = 0
    value: Any = None


@dataclass(frozen=True)
class Nested:
    """A value of ``depth`` nested lists, spliced in as text (a deep Python object would
    overflow the stack of whoever prints it)."""

    depth: int

    PLACEHOLDER = "@nested@"

    def splice(self, text: bytes) -> bytes:
        deep = b"[" * self.depth + b"0" + b"]" * self.depth
        return text.replace(json.dumps(self.PLACEHOLDER).encode(), deep, 1)


def json_nodes(doc: Any) -> list[tuple]:
    """Paths of every node of ``doc`` in document order, the root ``()`` first."""
    out: list[tuple] = []
    stack = [((), doc)]
    while stack:
        path, node = stack.pop()
        out.append(path)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend(reversed([(path + (k,), v) for k, v in children]))
    return out


def edit_json(text: bytes, edit: Edit, dump) -> bytes:
    """``text`` (a JSON document) after ``edit``; ``dump`` re-serialises a document."""
    if edit.op == "truncate":
        return text[: edit.at % (len(text) + 1)]
    if edit.op == "flip":
        data = bytearray(text)
        for offset, mask in edit.value if data else ():
            data[offset % len(data)] ^= mask
        return bytes(data)
    doc = json.loads(text)
    nodes = json_nodes(doc)
    if edit.op == "rename":
        nodes = [p for p in nodes if p and isinstance(p[-1], str)]
    elif edit.op == "delete":
        nodes = [p for p in nodes if p]
    if not nodes:
        return text
    path = tuple(edit.at) if isinstance(edit.at, tuple) else nodes[edit.at % len(nodes)]
    value = Nested.PLACEHOLDER if isinstance(edit.value, Nested) else edit.value
    if not path:  # only "replace" reaches the root
        doc = value
    else:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if edit.op == "replace":
            parent[path[-1]] = value
        elif edit.op == "delete":
            del parent[path[-1]]
        elif edit.op == "rename":
            parent[value] = parent.pop(path[-1])
    text = dump(doc)
    return edit.value.splice(text) if isinstance(edit.value, Nested) else text


def edit_header(data: bytes, edit: Edit) -> bytes:
    """A safetensors file after ``edit`` to its header: the u64 length and the JSON after it."""
    (length,) = struct.unpack("<Q", data[:8])
    head_end = 8 + length
    if edit.op == "length":
        return struct.pack("<Q", edit.value) + data[8:]
    if edit.op == "truncate":  # somewhere in the header
        return data[: edit.at % (head_end + 1)]
    if edit.op == "flip":
        return edit_json(data[:head_end], edit, None) + data[head_end:]

    def dump(doc):
        encoded = json.dumps(doc).encode()
        encoded += b" " * (-len(encoded) % 8)
        return encoded

    header = edit_json(data[8:head_end], edit, dump)
    return struct.pack("<Q", len(header)) + header + data[head_end:]


def rehashed(saved: Saved, step: int, name: str, data: bytes) -> dict[Path, bytes]:
    """New contents of the files of snapshot ``step`` that list file ``name`` (the index file,
    then the manifest), with its size and checksum set to ``data``'s: a crafted snapshot."""
    manifest = json.loads(saved.original[saved.path(step, MANIFEST_FILE)])
    out: dict[Path, bytes] = {}
    indexes = saved.path(step, INDEXES_FILE)
    changed = {}
    for unit, line in unit_index_lines(manifest, saved.original[indexes]).items():
        index = json.loads(line)
        hits = [f for f in index["files"] if f["path"] == name]
        for entry in hits:
            entry.update(bytes=len(data), xxh3_64=xxhash.xxh3_64_hexdigest(data))
        if hits:
            changed[unit] = json.dumps(index, separators=(",", ":")).encode() + b"\n"
    if changed:
        out[indexes] = indexes_rewritten(manifest, saved.original[indexes], changed)
    for entry in [e for e in manifest["files"] if e["path"] == name]:
        entry.update(bytes=len(data), xxh3_64=xxhash.xxh3_64_hexdigest(data))
    out[saved.path(step, MANIFEST_FILE)] = json.dumps(manifest, indent=1).encode()
    return out


def original_text(saved: Saved, step: int, name: str) -> bytes:
    """The original bytes of file ``name`` of snapshot ``step``; of a unit's index
    (``indexes.json#<unit>``, ``index_files``), its line of the index file."""
    if "#" not in name:
        return saved.original[saved.path(step, name)]
    unit = name.split("#", 1)[1]
    manifest = json.loads(saved.original[saved.path(step, MANIFEST_FILE)])
    return unit_index_lines(manifest, saved.original[saved.path(step, INDEXES_FILE)])[unit]


def replaced(saved: Saved, step: int, name: str, text: bytes, rehash: bool) -> dict[Path, bytes]:
    """New contents of the files of snapshot ``step`` once file ``name`` (or a unit's index line,
    ``original_text``) holds ``text``; with ``rehash``, the manifest records its size and checksum."""
    if "#" not in name:
        contents = {saved.path(step, name): text}
        return {**rehashed(saved, step, name, text), **contents} if rehash else contents
    manifest = json.loads(saved.original[saved.path(step, MANIFEST_FILE)])
    indexes = saved.path(step, INDEXES_FILE)
    contents = {indexes: indexes_rewritten(manifest, saved.original[indexes], {name.split("#", 1)[1]: text}, rehash)}
    if rehash:
        contents[saved.path(step, MANIFEST_FILE)] = json.dumps(manifest, indent=1).encode()
    return contents


def index_files(saved: Saved) -> list[tuple[int, str]]:
    """(step, ``indexes.json#<unit>``) of every unit index (a line of its snapshot's index
    file), in a fixed order."""
    return sorted(
        (step, f"{INDEXES_FILE}#{unit}")
        for step in STEPS
        for unit in json.loads(saved.original[saved.path(step, MANIFEST_FILE)])["units"]
    )


# -- strategies -------------------------------------------------------------------------------

ODD_STRINGS = [
    "", "..", "../x", "/etc/passwd", "units/../../x", "units\\..\\x", "\x00", "\ud800", "é", "step-00000001",
    "float32", "bfloat16", "int64", "object", "embed", "layer.0", "layer.1", "layer.99", "norm", "head", "other",
    "units/layer.0.safetensors", GLOBAL_JSON, GLOBAL_TENSORS, "weight/model.norm.weight", "optim/x/exp_avg",
    "F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E8M0", "F4", "C64", "cuda:0", "meta", "<f8", "O", "V8", "<U4",
]
ODD_KEYS = ["$tensor", "$ndarray", "$npscalar", "$tuple", "$dict", "value", "device", "params", "lr", "python",
            "numpy", "torch", "rng", "step", "optimizer_groups", "lr_scheduler", "extra", "layer.99", "bogus",
            "dtype", "shape", "data_offsets", "__metadata__"]
ODD_NUMBERS = [-1, 0, 1, 2, 3, 4, 255, 2**31, 2**32, 2**48, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63), 0.5, -0.0,
               math.inf, -math.inf, math.nan, 1e308]

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(ODD_STRINGS),
    st.sampled_from(ODD_NUMBERS),
)
KEYS = st.one_of(st.text(max_size=8), st.sampled_from(ODD_KEYS + ODD_STRINGS))
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(KEYS, children, max_size=4),
        # A tag of the global-state codec with an arbitrary payload.
        st.builds(lambda key, v: {key: v}, st.sampled_from(ODD_KEYS[:5]), children),
    ),
    max_leaves=8,
)
NODE = st.integers(min_value=0, max_value=10**6)
JSON_EDITS = st.one_of(
    st.builds(Edit, op=st.just("replace"), at=NODE, value=JSON_VALUES),
    st.builds(Edit, op=st.just("rename"), at=NODE, value=KEYS),
    st.builds(Edit, op=st.just("delete"), at=NODE),
    st.builds(Edit, op=st.just("truncate"), at=NODE),
    st.builds(
        Edit,
        op=st.just("flip"),
        at=st.just(0),
        value=st.lists(st.tuples(NODE, st.integers(1, 255)), min_size=1, max_size=4),
    ),
)
HEADER_EDITS = st.one_of(
    JSON_EDITS,
    st.builds(Edit, op=st.just("length"), value=st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 7, 8, 2**63])),
)


# -- properties -------------------------------------------------------------------------------


def damaged_json(saved: Saved, step: int, name: str, edits: list[Edit], rehash: bool) -> dict[Path, bytes]:
    """New contents for file ``name`` of snapshot ``step`` (a JSON file) after ``edits``, and for
    its manifest if ``rehash``."""
    text = original_text(saved, step, name)
    for edit in edits:
        try:
            text = edit_json(text, edit, lambda doc: json.dumps(doc).encode())
        except (ValueError, RecursionError):  # not JSON any more: later structural edits are moot
            break
    return replaced(saved, step, name, text, rehash)


@FUZZ
@given(step=st.sampled_from(STEPS), edits=st.lists(JSON_EDITS, min_size=1, max_size=3))
@example(step=2, edits=[Edit("replace", ("files", -1, "path"), "\x00")])
@example(step=3, edits=[Edit("replace", (), Nested(100_000))])
def test_damaged_manifest_gives_only_our_errors(saved, step, edits):
    with damaged(saved, damaged_json(saved, step, MANIFEST_FILE, edits, rehash=False)):
        read_everything(saved)


@FUZZ
@given(file=NODE, edits=st.lists(JSON_EDITS, min_size=1, max_size=3), rehash=st.booleans())
@example(file=0, edits=[Edit("replace", ("files", 0, "path"), "../x")], rehash=True)
@example(file=0, edits=[Edit("replace", ("tensors", 0, "chunks", 0, "file"), 7)], rehash=True)
def test_damaged_unit_index_gives_only_our_errors(saved, file, edits, rehash):
    files = index_files(saved)
    step, name = files[file % len(files)]
    with damaged(saved, damaged_json(saved, step, name, edits, rehash)):
        read_everything(saved)


@FUZZ
@given(step=st.sampled_from(STEPS), edits=st.lists(JSON_EDITS, min_size=1, max_size=3), rehash=st.booleans())
@example(step=3, edits=[Edit("replace", (), Nested(600))], rehash=True)
@example(step=3, edits=[Edit("replace", ("rng", "numpy"), {"$npscalar": "<i1", "value": 1000})], rehash=True)
@example(step=3, edits=[Edit("replace", ("rng", "numpy"), {"$dict": [[[1], 2]]})], rehash=True)
@example(step=3, edits=[Edit("replace", ("rng", "torch"), {"$tensor": [0]})], rehash=True)
def test_damaged_global_json_decodes_or_gives_our_errors(saved, step, edits, rehash):
    """Reading global state (the JSON, the codec, the tensors it names); applying it to live
    objects is the next property's business."""
    with damaged(saved, damaged_json(saved, step, GLOBAL_JSON, edits, rehash)):
        for read in (lambda: Run(saved.root).verify(), lambda: Run(saved.root).read_global(step)):
            try:
                read()
            except TailorError:
                pass


@FUZZ
@given(step=st.sampled_from(STEPS), edits=st.lists(JSON_EDITS, min_size=1, max_size=3))
@example(step=3, edits=[Edit("replace", ("rng", "python"), 5)])
def test_restoring_a_crafted_global_json_gives_only_our_errors(saved, step, edits):
    with damaged(saved, damaged_json(saved, step, GLOBAL_JSON, edits, rehash=True)):
        read_everything(saved)


@FUZZ
@given(file=NODE, edits=st.lists(HEADER_EDITS, min_size=1, max_size=2), rehash=st.booleans())
def test_damaged_tensor_header_gives_only_our_errors(saved, file, edits, rehash):
    files = saved.tensor_files()
    step, name = files[file % len(files)]
    path = saved.path(step, name)
    data = saved.original[path]
    for edit in edits:
        try:
            data = edit_header(data, edit)
        except (ValueError, RecursionError, struct.error):  # no JSON header any more
            break
    contents = {path: data}
    if rehash:
        contents = {**rehashed(saved, step, name, data), **contents}
    with damaged(saved, contents):
        read_everything(saved)


@FUZZ
@given(content=st.binary(max_size=24) | st.text(max_size=12).map(lambda s: f"step-{s}\n".encode()))
@example(content=b"\x80")
def test_damaged_latest_pointer_gives_only_our_errors(saved, content):
    with damaged(saved, {saved.root / LATEST_FILE: content}):
        read_everything(saved)


# -- crashes the fuzzer found (each fixed; kept as regression cases) --------------------------

_Q = "model.layers.0.self_attn.q_proj.weight"


LAYER0_INDEX = f"{INDEXES_FILE}#layer.0"


def _without_tensor(key: str):
    def change(doc):
        tensors = doc["tensors"]
        tensors[:] = [t for t in tensors if t["key"] != key]

    return change


def _manifest(step: int, *edits: Edit):
    return lambda saved: damaged_json(saved, step, MANIFEST_FILE, list(edits), rehash=False)


def crafted_index(saved: Saved, step: int, change) -> dict[Path, bytes]:
    """Step ``step``'s index of layer.0 after ``change(doc)``, re-hashed into its manifest."""
    doc = json.loads(original_text(saved, step, LAYER0_INDEX))
    change(doc)
    return replaced(saved, step, LAYER0_INDEX, json.dumps(doc).encode(), rehash=True)


def _global(step: int, *edits: Edit):
    return lambda saved: damaged_json(saved, step, GLOBAL_JSON, list(edits), rehash=True)


def _latest(content: bytes):
    return lambda saved: {saved.root / LATEST_FILE: content}


def _bug(id: str, damage, reason: str):
    """A crash found by the fuzzer; ``reason`` says what it was before the fix."""
    return pytest.param(damage, id=id)


@pytest.mark.parametrize(
    "damage",
    [
        _bug(
            "manifest-composite-names-a-unit-its-source-lacks",
            _manifest(3, Edit("rename", ("composite", "layer.1"), "layer.99")),
            "KeyError 'layer.99': Run.verify(step) (run.py, manifest.units[u]) and "
            "TrainingState.check_compatible (source.units[unit]) index a source manifest by a unit "
            "the composite names but that manifest does not hold",
        ),
        _bug(
            "manifest-unit-lacks-an-optimizer-state-tensor",
            lambda saved: crafted_index(saved, 3, _without_tensor(f"optim/{_Q}/step")),
            "KeyError 'step' inside torch's Adam.__setstate__: a unit whose index drops one "
            "optimizer-state tensor of a parameter (here its `step`) reaches "
            "Optimizer.load_state_dict with the parameter's state incomplete",
        ),
        _bug(
            "global-json-nested-too-deeply",
            _global(3, Edit("replace", (), Nested(100_000))),
            "RecursionError from json.loads in Run.read_global, which catches only ValueError",
        ),
        _bug(
            "global-rng-python-not-a-state",
            _global(3, Edit("replace", ("rng", "python"), 5)),
            "TypeError in rng.restore_rng (random.setstate / _as_python_state); also ValueError "
            "'state vector is the wrong size', OverflowError, IndexError for other shapes",
        ),
        _bug(
            "global-rng-without-torch",
            _global(3, Edit("delete", ("rng", "torch"))),
            "KeyError 'torch' in rng.restore_rng",
        ),
        _bug(
            "global-without-rng",
            _global(3, Edit("delete", ("rng",))),
            "KeyError 'rng' in TrainingState.apply_global",
        ),
        _bug(
            "global-optimizer-group-not-an-object",
            _global(3, Edit("replace", ("optimizer_groups", 0), 1)),
            "TypeError in optimizer.match_groups (g['params'] on a non-dict)",
        ),
        _bug(
            "global-scheduler-not-an-object",
            _global(3, Edit("replace", ("lr_scheduler",), 5)),
            "the LR scheduler's load_state_dict is handed a non-dict",
        ),
        _bug(
            "latest-not-utf8",
            _latest(b"\x80"),
            "UnicodeDecodeError in Run._read_pointer, which catches only OSError",
        ),
        _bug(
            "latest-unicode-digit",
            _latest("step-\u00b2\n".encode()),
            "ValueError in Run._read_pointer: str.isdigit() accepts '\u00b2' but int() refuses it "
            "(Run.steps() has the same check for directory names)",
        ),
    ],
)
def test_known_crash(saved, damage):
    """Each case crashed (with something other than a TailorError) when it was found."""
    with damaged(saved, damage(saved)):
        read_everything(saved)


# -- paths that leave the snapshot, and wrong dtypes, shapes and sizes -------------------------


class Opened:
    """Records the files opened by Python (audit events) and the tensor files handed to
    safetensors, while ``recording``."""

    recording = False
    paths: list[Path] = []
    loaded: list[Path] = []

    @classmethod
    def audit(cls, event: str, args: tuple) -> None:
        if cls.recording and event == "open" and isinstance(args[0], (str, Path)):
            cls.paths.append(Path(args[0]))

    @classmethod
    @contextmanager
    def watch(cls):
        real = safetensors.torch.load_file

        def spy(path, *args, **kwargs):
            cls.loaded.append(Path(path))
            return real(path, *args, **kwargs)

        cls.paths, cls.loaded, cls.recording = [], [], True
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(safetensors.torch, "load_file", spy)
            try:
                yield cls
            finally:
                cls.recording = False

    @classmethod
    def tensor_files(cls) -> list[Path]:
        return [p for p in cls.paths + cls.loaded if p.suffix == ".safetensors"]


sys.addaudithook(Opened.audit)  # hooks cannot be removed; it records only inside watch()

ESCAPES = st.one_of(
    st.sampled_from(["../x", "../../etc/passwd", "/etc/passwd", "units/../../x", "..", "/", "units/..//../y"]),
    st.builds(
        lambda n, tail: "../" * n + tail,
        st.integers(1, 4),
        st.sampled_from(["x", "step-00000001/units/embed.safetensors", "snapshots/step-00000001/global.json"]),
    ),
    st.builds(lambda tail: "/" + tail, st.text(max_size=10)),
    st.builds(lambda head, tail: f"{head}/../{tail}", st.sampled_from(["units", "a/b", "."]), st.just("../z")),
)


def composite_needs(saved: Saved) -> set[int]:
    """Steps whose manifests a restore of the latest composite reads."""
    composite = Run(saved.root).resolve()
    return {composite.step, *composite.sources.values()}


@FUZZ
@given(step=st.sampled_from(STEPS), entry=NODE, escape=ESCAPES)
def test_paths_leaving_the_snapshot_are_refused_before_any_tensor_file_is_opened(saved, step, entry, escape):
    path = saved.path(step, MANIFEST_FILE)
    doc = json.loads(saved.original[path])
    targets = doc["files"] + [ref["index"] for ref in doc["units"].values()]
    targets[entry % len(targets)]["path"] = escape
    snapshot = saved.path(step, "")
    needed = composite_needs(saved)
    with damaged(saved, {path: json.dumps(doc).encode()}), Opened.watch() as opened:
        problems = Run(saved.root).verify()
        assert any(f"{path}: invalid manifest" in p and ("leaves the snapshot directory" in p or "index file" in p) for p in problems)
        # (The reader lease is opened first, by design: it holds no data.)
        assert not [p for p in opened.paths + opened.loaded if p.is_relative_to(snapshot) and p not in (path, snapshot / LEASE_FILE)]
        opened.paths.clear()
        if step in needed:
            with pytest.raises(TailorError, match="leaves the snapshot directory|index file"):
                Tailor(saved.root, *fresh(saved.template)).restore()
            assert opened.tensor_files() == []
        else:
            Tailor(saved.root, *fresh(saved.template)).restore()
    run_root = saved.root.resolve()
    assert all(p.resolve().is_relative_to(run_root) for p in opened.paths + opened.loaded)


@FUZZ
@given(file=NODE, entry=NODE, escape=ESCAPES)
def test_unit_file_paths_leaving_the_snapshot_are_refused_before_any_tensor_file_is_opened(saved, file, entry, escape):
    step, name = index_files(saved)[file % len(index_files(saved))]
    doc = json.loads(original_text(saved, step, name))
    doc["files"][entry % len(doc["files"])]["path"] = escape
    contents = replaced(saved, step, name, json.dumps(doc).encode(), rehash=True)
    with damaged(saved, contents), Opened.watch() as opened:
        problems = Run(saved.root).verify()
        assert any("invalid unit index" in p and "leaves the snapshot directory" in p for p in problems)
        if step in composite_needs(saved):
            try:
                Tailor(saved.root, *fresh(saved.template)).restore()
            except TailorError:
                pass
    run_root = saved.root.resolve()
    assert all(p.resolve().is_relative_to(run_root) for p in opened.paths + opened.loaded)


WEIGHT = "weight/model.layers.0.self_attn.q_proj.weight"
OPTIM = "optim/model.layers.0.self_attn.q_proj.weight/exp_avg"


def _tensor(doc: dict, key: str) -> dict:
    return next(t for t in doc["tensors"] if t["key"] == key)


def _set_dtype(key: str, dtype: str):
    def change(doc):
        _tensor(doc, key)["dtype"] = dtype

    return change


def _set_shape(key: str, shape: list[int]):
    def change(doc):
        tensor = _tensor(doc, key)
        tensor["shape"] = tensor["chunks"][0]["shape"] = shape  # a whole chunk (written without one)
        tensor["chunks"][0].setdefault("offsets", [0] * len(shape))

    return change


def _set_bytes(size: int):
    def change(doc):
        doc["files"][0]["bytes"] = size  # the file holding layer.0 (the tiny model's pack file)

    return change




@pytest.mark.parametrize(
    "change, message, opens_no_tensor_file",
    [
        pytest.param(_set_dtype(WEIGHT, "float16"), "snapshot 3 has float16", True, id="weight-dtype"),
        pytest.param(_set_dtype(WEIGHT, "object"), "dtype 'object' is not one of", True, id="unknown-dtype"),
        pytest.param(_set_dtype(OPTIM, "complex64"), "dtype 'complex64' is not one of", True, id="optim-unknown-dtype"),
        pytest.param(_set_shape(WEIGHT, [16, 17]), "snapshot 3 has float32 [16, 17]", True, id="weight-shape"),
        pytest.param(_set_shape(WEIGHT, [1 << 30, 1 << 30]), "absurd shape", True, id="absurd-shape"),
        pytest.param(_set_shape(OPTIM, [-16, -16]), "absurd shape", True, id="negative-shape"),
        # The size is compared with the file's on opening it, before a byte is read.
        pytest.param(_set_bytes(1 << 62), "manifest says 4611686018427387904", False, id="absurd-size"),
        pytest.param(_set_dtype(OPTIM, "float16"), "float16", False, id="optim-dtype"),
        pytest.param(_set_shape(OPTIM, [16, 17]), "[16, 17]", False, id="optim-shape"),
    ],
)
def test_wrong_dtypes_shapes_and_sizes_are_refused_before_the_tensor_bytes_are_read(
    saved, change, message, opens_no_tensor_file
):
    unit_file = file_holding(saved.root, 3, "layer.0")
    with damaged(saved, crafted_index(saved, 3, change)), Opened.watch() as opened:
        with pytest.raises(TailorError) as err:
            Tailor(saved.root, *fresh(saved.template)).restore()
    assert message in str(err.value)
    assert unit_file not in opened.loaded
    if opens_no_tensor_file:
        assert opened.tensor_files() == []


def test_restoring_the_pristine_run_works(saved):
    """The control: every property above starts from a run that restores cleanly."""
    assert Run(saved.root).verify() == []
    assert Tailor(saved.root, *fresh(saved.template)).restore().step == 3
