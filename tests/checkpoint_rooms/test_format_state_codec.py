"""The JSON form of a rank's state: everything a state_dict may hold comes back exactly, anything
else is refused naming where it was, and a crafted value costs no more memory than its size."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hookloop.engine.checkpoint_format.state_codec import decode, encode


def round_trip(value):
    return decode(json.loads(json.dumps(encode(value))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_tensors_come_back_bitwise_with_dtype_and_shape(dtype):
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    back = round_trip(t)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    empty = round_trip(torch.empty(0, 5, dtype=dtype))
    assert empty.shape == (0, 5) and empty.dtype == dtype
    scalar = torch.tensor(2, dtype=dtype)  # 0-dim: a loss a handler keeps without reading it
    back = round_trip(scalar)
    assert back.shape == () and back.dtype == dtype and torch.equal(back, scalar)


def test_containers_keys_and_arrays_come_back_as_they_were():
    value = {
        "tuple": (1, (2.5, "x")),
        "int keys": {1: "a", (2, 3): "b"},
        "__dunder__": None,
        "array": np.arange(6, dtype=np.float16).reshape(2, 3),
        "scalar": np.int64(7),
        "list": [True, None, -1],
    }
    back = round_trip(value)
    assert back["tuple"] == (1, (2.5, "x")) and back["int keys"] == {1: "a", (2, 3): "b"}
    assert back["__dunder__"] is None and back["scalar"] == 7 and back["list"] == [True, None, -1]
    assert back["array"].dtype == np.float16 and np.array_equal(back["array"], value["array"])


def test_what_json_cannot_carry_safely_is_refused_naming_where():
    with pytest.raises(TypeError, match=r"handler 'x'\.model holds a Linear"):
        encode({"model": torch.nn.Linear(1, 1)}, "handler 'x'")
    with pytest.raises(TypeError, match=r"state\[1\] holds a set"):
        encode([1, {2}])


@pytest.mark.parametrize(
    ("crafted", "message"),
    [
        ({"__tensor__": "", "dtype": "os.system", "shape": []}, "is not a torch dtype"),
        ({"__tensor__": "AAAA", "dtype": "float32", "shape": [1 << 30]}, "takes 4294967296 bytes"),
        ({"__tensor__": "", "dtype": "float32", "shape": [-1]}, "non-negative integers"),
        ({"__tensor__": "", "dtype": "float32", "shape": [1] * 65}, "at most 64 sizes"),
        ({"__ndarray__": "", "dtype": "|O", "shape": [0]}, "holds Python objects"),
        ({"__ndarray__": "AAAA", "dtype": "<f8", "shape": [2]}, "takes 16 bytes, the data has 3"),
    ],
)
def test_a_value_that_does_not_describe_its_own_bytes_is_refused(crafted, message):
    with pytest.raises(ValueError, match=message):
        decode(crafted)
