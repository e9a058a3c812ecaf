import json
import math
import re

import numpy as np
import pytest
import torch

from llmtailor.errors import UnsupportedStateError
from llmtailor.providers import rng
from llmtailor.store import codec


def roundtrip(obj):
    import json

    doc, tensors = codec.encode(obj)
    return codec.decode(json.loads(json.dumps(doc)), tensors)


def test_nested_state_roundtrips_exactly():
    state = {
        "betas": (0.9, 0.999),
        "lr": 0.1 + 0.2,
        "bad": [math.inf, -math.inf],
        3: "int key",
        "$looks_like_a_tag": {"$tensor": "user data"},
        "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "scalar": torch.tensor(3.0),
        "np": np.arange(4, dtype=np.uint32),
        "np_scalar": np.float64(1.5),
        "none": None,
        "flag": True,
    }
    back = roundtrip(state)
    assert back.keys() == state.keys()
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert back["lr"] == 0.1 + 0.2 and back["bad"] == [math.inf, -math.inf]
    assert back[3] == "int key" and back["$looks_like_a_tag"] == {"$tensor": "user data"}
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], state["t"])
    assert torch.equal(back["scalar"], state["scalar"])
    assert back["np"].dtype == np.uint32 and (back["np"] == state["np"]).all()
    assert back["np_scalar"] == 1.5 and isinstance(back["np_scalar"], np.float64)
    assert back["none"] is None and back["flag"] is True


def test_rng_state_roundtrips():
    import random

    captured = roundtrip(rng.capture_rng())
    expected = (random.random(), np.random.rand(), torch.rand(2))
    rng.restore_rng(captured)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


def test_unsupported_value_names_its_path():
    with pytest.raises(UnsupportedStateError, match=r"state\.sched\.fn\[1\] is a builtins\.function"):
        codec.encode({"sched": {"fn": [1, lambda: 0]}})


@pytest.mark.parametrize("state, path", [
    ({"a": (1, [2, {"b": object()}])}, "state.a[1][1].b"),
    ({"$x": {3: [object()]}}, "state['$x'][3][0]"),
    ({(1, 2): 0, "k": {object(): 1}}, "state['k']<key <object object"),
    ([np.float64(1.0), 2, 3.5, "s", None, True, object()], "state[6]"),
], ids=["tuple-list-dict", "dollar-keys", "non-string-key", "flat-list"])
def test_unsupported_value_names_its_path_through_every_container(state, path):
    with pytest.raises(UnsupportedStateError, match="^" + re.escape(path)):
        codec.encode(state)


def test_flat_lists_of_plain_values_encode_as_they_are_and_numpy_scalars_keep_their_tag():
    state = {"mt": (3, tuple(range(625)), None), "x": [1.5, np.float64(2.5), True, np.int64(4)]}
    doc, tensors = codec.encode(state)
    assert doc["mt"] == {"$tuple": [3, {"$tuple": list(range(625))}, None]} and not tensors
    assert doc["x"][1] == {"$npscalar": "<f8", "value": 2.5} and doc["x"][3]["$npscalar"] == "<i8"
    back = codec.decode(json.loads(json.dumps(doc)), tensors)
    assert back == state and type(back["x"][1]) is np.float64 and type(back["mt"][1]) is tuple
