"""The manifest refuses untrusted input before any tensor byte is read."""

import json

import pytest

from llmtailor.errors import TailorError
from llmtailor.store.manifest import load_manifest

GOOD = {
    "schema_version": 1,
    "step": 4,
    "parent": 2,
    "save_index": 1,
    "created": "2026-11-21T00:00:00+00:00",
    "policy": "Parity()",
    "layout": {},
    "units": {
        "layer.0": {
            "tensors": [
                {"key": "weight/w", "dtype": "float32", "shape": [4, 2],
                 "chunks": [{"file": "units/layer.0.safetensors", "key": "weight/w", "offsets": [0, 0], "shape": [4, 2]}]}
            ]
        }
    },
    "composite": {"layer.0": 4, "layer.1": 2},
    "files": [{"path": "units/layer.0.safetensors", "bytes": 10, "xxh3_64": "0123456789abcdef"}],
}


def edited(path, value):
    doc = json.loads(json.dumps(GOOD))
    *parents, last = path
    target = doc
    for key in parents:
        target = target[key]
    target[last] = value
    return doc


def tensor(*path):
    return ("units", "layer.0", "tensors", 0, *path)


@pytest.mark.parametrize(
    "path, value, fragment",
    [
        (("files", 0, "path"), "../../etc/passwd", "leaves the snapshot directory"),
        (("files", 0, "path"), "/etc/passwd", "leaves the snapshot directory"),
        (tensor("dtype"), "object", "dtype 'object' is not one of"),
        (tensor("shape"), [1 << 40, 1 << 40], "absurd shape"),
        (tensor("chunks", 0, "shape"), [5, 2], "exceeds"),
        (tensor("chunks", 0, "file"), "units/other.safetensors", "unlisted file"),
        (("composite", "layer.1"), 9, "after the snapshot's own step"),
        (("composite", "layer.0"), 2, "disagrees"),
        (("schema_version",), 99, "schema_version 99 is not supported"),
        (("surprise",), 1, "unknown key 'surprise'"),
        (("files", 0, "xxh3_64"), "nothex", "files.0.xxh3_64"),
    ],
)
def test_bad_manifests_are_refused_with_the_key_named(tmp_path, path, value, fragment):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(edited(path, value)))
    with pytest.raises(TailorError) as err:
        load_manifest(manifest)
    assert str(manifest) in str(err.value) and fragment in str(err.value)


def test_good_manifest_loads(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(GOOD))
    assert load_manifest(tmp_path / "manifest.json").composite == {"layer.0": 4, "layer.1": 2}


def test_not_json(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b"\xff\x00garbage")
    with pytest.raises(TailorError, match="manifest"):
        load_manifest(tmp_path / "manifest.json")
