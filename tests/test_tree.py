"""mpaccel.tree, the one walker of nested structures: leaves, map and zip-map keep every
container's type (dicts and other mappings, lists, tuples, named tuples), and the places that
walk through it (send_to_device, split_between_processes, dispatch's batch joining) keep their
own rules on top. Not collective: the same on every rank."""

from __future__ import annotations

import collections
from collections import OrderedDict, UserDict

import pytest
import torch

from mpaccel import tree
from mpaccel.data.dispatch import concatenate_batches, slice_batch
from mpaccel.device import send_to_device
from mpaccel.split import split_inputs

Point = collections.namedtuple("Point", "x y")


class Encoding(UserDict):
    """Like transformers' BatchEncoding: a UserDict with a .to() of its own."""

    moved_to: object = None

    def to(self, device):  # no non_blocking, as BatchEncoding before 4.x
        self.moved_to = device
        return self


class FixedMapping(collections.abc.Mapping):
    """A mapping whose constructor does not take a dict."""

    def __init__(self):
        self.data = {"a": [1, 2, 3, 4]}

    def __getitem__(self, key):
        return self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def nested():
    return {
        "a": [torch.zeros(2), (torch.ones(1), "text")],
        "p": Point(torch.full((3,), 2.0), None),
        "o": OrderedDict(z=torch.ones(2), y=5),
    }


def test_leaves_are_depth_first_in_the_containers_order():
    found = tree.leaves(nested())
    assert [type(x).__name__ for x in found] == [
        "Tensor", "Tensor", "str", "Tensor", "NoneType", "Tensor", "int"
    ]
    assert tree.leaves([]) == [] and tree.leaves(7) == [7]
    assert tree.leaves({"x": [1, 2]}, is_leaf=lambda v: isinstance(v, list)) == [[1, 2]]


def test_map_rebuilds_every_container_in_its_type():
    out = tree.map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, nested())
    assert type(out) is dict and type(out["a"]) is list and type(out["a"][1]) is tuple
    assert type(out["p"]) is Point and out["p"].y is None
    assert type(out["o"]) is OrderedDict and list(out["o"]) == ["z", "y"]
    assert torch.equal(out["p"].x, torch.full((3,), 4.0)) and out["a"][1][1] == "text"


def test_map_visits_leaves_in_the_order_of_leaves():
    data = nested()
    seen: list = []
    tree.map(seen.append, data)
    found = tree.leaves(data)
    assert len(seen) == len(found) and all(a is b for a, b in zip(seen, found))


def test_map_skips_keys_and_takes_leaves_it_is_told_to():
    data = {"keep": [1], "walk": [1], "inner": {"keep": 2}}
    out = tree.map(lambda v: ("leaf", v), data, skip_keys={"keep"})
    assert out["keep"] is data["keep"] and out["walk"] == [("leaf", 1)]
    assert out["inner"]["keep"] == 2
    whole = tree.map(lambda v: ("leaf", v), data, is_leaf=lambda v: isinstance(v, list))
    assert whole["walk"] == ("leaf", [1])


def test_a_mapping_that_refuses_a_dict_is_an_error_or_a_dict_when_asked():
    with pytest.raises(TypeError):
        tree.map(lambda v: v, FixedMapping())
    assert tree.map(lambda v: v, FixedMapping(), dict_if_refused=True) == {"a": [1, 2, 3, 4]}


def test_zip_map_follows_the_first_structure():
    a = {"x": Point(1, [2]), "y": (3,)}
    b = {"y": (30,), "x": Point(10, [20])}
    out = tree.zip_map(lambda *v: sum(v), a, b)
    assert out == {"x": Point(11, [22]), "y": (33,)} and type(out["x"]) is Point
    assert list(out) == ["x", "y"]


def test_recursively_apply_keeps_accelerates_rules():
    data = {"t": torch.ones(2), "s": "kept"}
    out = tree.recursively_apply(lambda t, k: t * k, data, 3)
    assert torch.equal(out["t"], torch.full((2,), 3.0)) and out["s"] == "kept"
    with pytest.raises(TypeError, match=r"got a str \('kept'\); it takes nested lists"):
        tree.recursively_apply(torch.neg, data, error_on_other_type=True)
    half = {"h": torch.ones(1, dtype=torch.float16), "i": torch.ones(1, dtype=torch.int64)}
    assert tree.convert_to_fp32(half)["h"].dtype == torch.float32
    assert tree.convert_to_fp32(half)["i"].dtype == torch.int64


def test_send_to_device_moves_objects_with_to_whole():
    enc = Encoding(input_ids=torch.ones(2))
    out = send_to_device({"batch": enc, "p": Point(torch.ones(1), "s")}, "cpu", non_blocking=True)
    assert out["batch"] is enc and enc.moved_to == "cpu"  # its own .to, without non_blocking
    assert type(out["p"]) is Point and out["p"].y == "s"


def test_dispatch_joins_and_slices_batches_through_the_walker():
    batches = [{"x": torch.arange(2), "p": Point(torch.ones(2), [torch.zeros(2)])}] * 2
    joined = concatenate_batches(batches)
    assert joined["x"].tolist() == [0, 1, 0, 1] and type(joined["p"]) is Point
    assert slice_batch(joined, slice(1, 3))["x"].tolist() == [1, 0]
    with pytest.raises(TypeError, match="can only dispatch batches of tensors"):
        concatenate_batches([{"x": "a"}, {"x": "b"}])


def test_split_walks_mappings_only_and_falls_back_to_a_dict():
    inputs = UserDict(a=[1, 2, 3, 4], b=OrderedDict(c=torch.arange(4)))
    share = split_inputs(inputs, 1, 2)
    assert type(share) is UserDict and type(share["b"]) is OrderedDict
    assert share["a"] == [3, 4] and share["b"]["c"].tolist() == [2, 3]
    assert split_inputs(FixedMapping(), 0, 2) == {"a": [1, 2]}
