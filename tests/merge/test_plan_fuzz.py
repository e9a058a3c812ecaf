"""Plan files fuzzed: any YAML, and any mutation of a valid plan, gives a plan or our own
clear error (a TailorError naming the plan file), never another exception."""

import json

import pytest
import yaml
from helpers import tiny, train
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtailor import Full, Tailor
from llmtailor.errors import TailorError
from llmtailor.merge.planner import open_plan

FUZZ = settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
SCALARS = st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=True) | st.text(max_size=12)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
KEYS = st.sampled_from(
    ["slices", "sources", "model", "layer_range", "merge_method", "dtype", "base_model", "embed", "norm", "head",
     "pre_weights", "post_weights", "name", "optimizer", "state_from", "tokenizer_source", "parameters", "scale",
     "filter", "value", "out_dtype"]
)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory, tokens):
    root = tmp_path_factory.mktemp("plans")
    model, opt, sched = tiny(layers=2, hidden=16)
    with Tailor(root / "run", model, opt, sched, policy=Full()) as tailor:
        for step in (1, 2):
            train(model, opt, sched, tokens, [step])
            tailor.save(step)
    return root


VALID = {
    "merge_method": "passthrough",
    "slices": [{"sources": [{"model": "run@1", "layer_range": [0, 1]}]}, {"sources": [{"model": "run@2", "layer_range": [1, 2]}]}],
    "base_model": "run@2",
    "optimizer": False,
    "parameters": {"scale": [{"filter": "mlp", "value": [0.5, 1.0]}, {"value": 1.0}]},
}


def attempt(plan_dir, text: bytes | str) -> None:
    path = plan_dir / "plan.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        with open_plan(path, plan_dir / "out") as plan:
            assert plan.actions
    except TailorError as err:
        assert str(path) in str(err) or "plan" in str(err).lower(), str(err)
    assert not (plan_dir / "out").exists()  # planning never writes


def test_the_valid_plan_plans(plan_dir):
    attempt(plan_dir, yaml.safe_dump(VALID))


@FUZZ
@given(doc=JSON)
def test_any_yaml_document(plan_dir, doc):
    attempt(plan_dir, yaml.safe_dump(doc))


@FUZZ
@given(data=st.binary(max_size=200))
def test_any_bytes(plan_dir, data):
    attempt(plan_dir, data)


@FUZZ
@given(path=st.lists(st.integers(0, 3) | KEYS, min_size=1, max_size=4), value=JSON, delete=st.booleans())
def test_a_valid_plan_with_one_node_changed(plan_dir, path, value, delete):
    doc = json.loads(json.dumps(VALID))
    node = doc
    for key in path[:-1]:
        if isinstance(node, dict) and isinstance(key, str) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            break
    last = path[-1]
    if isinstance(node, dict) and isinstance(last, str):
        if delete:
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value
    attempt(plan_dir, yaml.safe_dump(doc))
