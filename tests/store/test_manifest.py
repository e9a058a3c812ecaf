"""The manifest and the unit indexes refuse untrusted input before any tensor byte is read."""

import json
from pathlib import Path

import pytest

from llmtailor.errors import TailorError
from llmtailor.store.manifest import load_manifest, load_unit_entry

GOOD = {
    "schema_version": 2,
    "step": 4,
    "parent": 2,
    "save_index": 1,
    "created": "2026-11-21T00:00:00+00:00",
    "policy": "Parity()",
    "layout": {},
    "units": {
        "layer.0": {"index": {"path": "index/layer.0.json", "bytes": 10, "xxh3_64": "0123456789abcdef"}, "bytes": 20},
    },
    "composite": {"layer.0": 4, "layer.1": 2},
    "files": [{"path": "global.json", "bytes": 10, "xxh3_64": "0123456789abcdef"}],
}

GOOD_INDEX = {
    "unit": "layer.0",
    "step": 4,
    "files": [
        {"path": "units/layer.0.rank-00000.safetensors", "bytes": 10, "xxh3_64": "0123456789abcdef"},
        {"path": "units/layer.0.rank-00001.safetensors", "bytes": 10, "xxh3_64": "0123456789abcdef"},
    ],
    "tensors": [
        {"key": "weight/w", "dtype": "float32", "shape": [4, 2], "chunks": [
            {"file": 0, "offsets": [0, 0], "shape": [2, 2], "xxh3_64": "0123456789abcdef"},
            {"file": 1, "offsets": [2, 0], "shape": [2, 2], "xxh3_64": "0123456789abcdef"},
        ]}
    ],
}


def edited(doc, path, value):
    doc = json.loads(json.dumps(doc))
    *parents, last = path
    target = doc
    for key in parents:
        target = target[key]
    target[last] = value
    return doc


def tensor(*path):
    return ("tensors", 0, *path)


@pytest.mark.parametrize(
    "path, value, fragment",
    [
        (("files", 0, "path"), "../../etc/passwd", "leaves the snapshot directory"),
        (("files", 0, "path"), "/etc/passwd", "leaves the snapshot directory"),
        (("units", "layer.0", "index", "path"), "index/../../x.json", "leaves the snapshot directory"),
        (("units", "layer.0", "index", "path"), "index/layer.1.json", "expected 'index/layer.0.json'"),
        (("units", "layer.0", "bytes"), -1, "units.layer.0.bytes"),
        (("composite", "layer.1"), 9, "after the snapshot's own step"),
        (("composite", "layer.0"), 2, "disagrees"),
        (("schema_version",), 1, "schema_version 1 is not supported"),
        (("surprise",), 1, "unknown key 'surprise'"),
        (("files", 0, "xxh3_64"), "nothex", "files.0.xxh3_64"),
        (("step",), "4", "key 'step': Input should be a valid integer"),  # strict: no string for a number
        (("save_index",), 1.0, "key 'save_index'"),
    ],
)
def test_bad_manifests_are_refused_with_the_key_named(tmp_path, path, value, fragment):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(edited(GOOD, path, value)))
    with pytest.raises(TailorError) as err:
        load_manifest(manifest)
    assert str(manifest) in str(err.value) and fragment in str(err.value)


@pytest.mark.parametrize(
    "path, value, fragment",
    [
        (("files", 1, "path"), "../x", "leaves the snapshot directory"),
        (tensor("dtype"), "object", "dtype 'object' is not one of"),
        (tensor("shape"), [1 << 40, 1 << 40], "absurd shape"),
        (tensor("chunks", 0, "shape"), [5, 2], "exceeds"),
        (tensor("chunks", 1, "offsets"), [0, 0], "chunks cover"),
        (tensor("chunks", 1, "file"), 2, "names file 2 of 2"),
        (tensor("chunks", 1, "xxh3_64"), "x", "xxh3_64"),
        (("files",), [], "files"),
    ],
)
def test_bad_unit_indexes_are_refused_with_the_key_named(path, value, fragment):
    raw = json.dumps(edited(GOOD_INDEX, path, value)).encode()
    with pytest.raises(TailorError) as err:
        load_unit_entry(raw, Path("index/layer.0.json"), "layer.0", 4)
    assert "index/layer.0.json" in str(err.value) and fragment in str(err.value)


def test_an_index_of_another_unit_or_step_is_refused():
    raw = json.dumps(GOOD_INDEX).encode()
    with pytest.raises(TailorError, match="expected 'layer.1' at 4"):
        load_unit_entry(raw, Path("index/layer.1.json"), "layer.1", 4)


def test_good_manifest_and_index_load(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(GOOD))
    assert load_manifest(tmp_path / "manifest.json").composite == {"layer.0": 4, "layer.1": 2}
    entry = load_unit_entry(json.dumps(GOOD_INDEX).encode(), Path("i"), "layer.0", 4)
    assert [entry.tensors[0].chunk_key(c) for c in entry.tensors[0].chunks] == ["weight/w#0,0", "weight/w#2,0"]


def test_not_json(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b"\xff\x00garbage")
    with pytest.raises(TailorError, match="manifest"):
        load_manifest(tmp_path / "manifest.json")


def test_a_manifest_of_another_step_than_its_directory_is_named_as_that(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(edited(GOOD, ("step",), 6)))
    with pytest.raises(TailorError, match="manifest says step 6, its directory says step 4"):
        load_manifest(tmp_path / "manifest.json", step=4)
