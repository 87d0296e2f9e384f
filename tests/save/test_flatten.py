"""Nested state ⇄ flat tensors + tagged JSON tree."""

from __future__ import annotations

import base64
import json
import math
import pickle
from collections import OrderedDict
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import assert_same

from ckptd.errors import ConfigError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from ckptd.save.flatten import flatten_component, restore_tree, tree_tensor_keys


def round_trip(value, **kwargs):
    flat = flatten_component("c", value, **kwargs)
    tree = json.loads(json.dumps(flat.tree))  # the tree must survive JSON unchanged
    return restore_tree(tree, flat.tensors, **kwargs), flat


def test_plain_values_tags_and_tensors_round_trip():
    value = {
        "ints": [1, -2, 10**30],
        "floats": [0.5, float("inf"), float("-inf")],
        "tuple": (1, ("a", None)),
        "int_keys": {0: "zero", 3: (4,)},
        "tuple_keys": {(1, 2): True},
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "bytes": b"\x00\xff",
        "set": {1, 2},
        "frozen": frozenset({"x"}),
        "ordered": OrderedDict(b=1, a=2),
        "tag_collision": {"__ckptd__": "not a tag"},
        "tensor": torch.arange(4),
        "nested": {"deep": [torch.ones(2), {"t": torch.zeros(1)}]},
    }
    restored, flat = round_trip(value)
    assert set(flat.tensors) == {"tensor", "nested.deep.0", "nested.deep.1.t"}
    assert_same(value["tensor"], restored["tensor"])
    for key in ("ints", "tuple", "int_keys", "tuple_keys", "dtype", "device", "size", "bytes", "set", "frozen"):
        assert restored[key] == value[key] and type(restored[key]) is type(value[key]), key
    assert restored["floats"][0] == 0.5 and math.isinf(restored["floats"][1]) and restored["floats"][2] < 0
    assert restored["tag_collision"] == {"__ckptd__": "not a tag"}
    assert list(restored["ordered"]) == ["b", "a"]


def test_nan_round_trips():
    restored, _ = round_trip({"x": float("nan")})
    assert math.isnan(restored["x"])


def test_numpy_values_round_trip():
    state = np.random.get_state()
    restored, _ = round_trip({"np": state, "scalar": np.float32(1.5), "array": np.arange(6, dtype=np.int16)})
    assert restored["np"][0] == "MT19937" and np.array_equal(restored["np"][1], state[1])
    assert restored["np"][1].dtype == np.uint32
    assert restored["scalar"] == np.float32(1.5) and type(restored["scalar"]) is np.float32
    assert restored["array"].dtype == np.int16 and list(restored["array"]) == list(range(6))


def test_module_keys_are_kept_verbatim_and_ties_detected():
    linear = torch.nn.Linear(2, 2)
    state = {"a.weight": linear.weight, "b.weight": linear.weight, "a.bias": linear.bias}
    flat = flatten_component("model", state)
    assert list(flat.tensors) == ["a.weight", "a.bias"]
    assert flat.tied == [["a.weight", "b.weight"]]
    assert tree_tensor_keys(flat.tree) == ["a.weight", "b.weight", "a.bias"]


def test_colliding_flat_keys_are_refused():
    with pytest.raises(ConfigError, match=r"same key \'a\.b\'"):
        flatten_component("c", {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


def test_unsupported_objects_name_their_path():
    with pytest.raises(UnsupportedValueError, match=r"'c\.outer\.1'.*allow_pickle"):
        flatten_component("c", {"outer": [1, object()]})
    with pytest.raises(UnsupportedValueError, match="sparse"):
        flatten_component("c", {"s": torch.eye(3).to_sparse()})
    with pytest.raises(UnsupportedValueError, match="meta"):
        flatten_component("c", {"m": torch.empty(2, device="meta")})


def test_pickle_opt_in_is_needed_on_both_sides():
    restored, flat = round_trip({"obj": complex(1, 2)}, allow_pickle=True)
    assert restored["obj"] == complex(1, 2)
    with pytest.raises(UnsafeCheckpointError):
        restore_tree(flat.tree, flat.tensors)


@pytest.mark.parametrize("damage", ["truncated", "a class that is gone"])
def test_a_pickled_value_that_cannot_be_rebuilt_is_a_corrupt_checkpoint_not_a_pickle_error(damage):
    # with allow_pickle=True: a load across tiers falls back on CorruptCheckpointError only
    _, flat = round_trip({"obj": complex(1, 2)}, allow_pickle=True)
    tree = json.loads(json.dumps(flat.tree))
    node = tree["obj"]
    payload = base64.b64decode(node["b64"])
    if damage == "truncated":
        payload = payload[: len(payload) // 2]
    else:
        payload = pickle.dumps(Fraction(1, 3)).replace(b"fractions", b"fractionz")
    node["b64"] = base64.b64encode(payload).decode()
    with pytest.raises(CorruptCheckpointError, match="pickled object cannot be rebuilt"):
        restore_tree(tree, flat.tensors, allow_pickle=True)


def test_encoding_snapshots_values():
    inner = [1, 2]
    flat = flatten_component("c", {"list": inner})
    inner.append(3)
    assert restore_tree(flat.tree, flat.tensors) == {"list": [1, 2]}


def test_tensors_are_detached_only_where_autograd_tracks_them():
    weight = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    moment = torch.zeros(4)
    flat = flatten_component("m", {"weight": weight, "frozen": frozen, "moment": moment})
    assert not flat.tensors["weight"].requires_grad and flat.tensors["weight"].data_ptr() == weight.data_ptr()
    assert flat.tensors["moment"] is moment and flat.tensors["frozen"] is frozen
    assert flat.frozen == {"frozen"}
