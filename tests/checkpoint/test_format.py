"""What a checkpoint can hold: colliding keys, empty tensors of any shape, dtypes numpy lacks,
numpy scalars, and the values it refuses (named, before any file is written). The bodies that
take `comm` run at size 1 and under mpiexec -n 2 / -n 4."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest
import torch

from mpaccel import Accelerator, CollectiveError
from mpaccel.checkpoint import CheckpointError, CheckpointReader, load_model_state
from mpaccel.checkpoint.format import flatten, unflatten
from mpaccel.cli import main as cli
from mpaccel.testing import reset_state


class Holder:
    """A registered object whose state is whatever the test puts in it."""

    def __init__(self, state=None):
        self.state, self.loaded = state, None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def _save(directory, state):
    reset_state()
    acc = Accelerator()
    acc.register_for_checkpointing(Holder(state))
    acc.save_state(directory)
    return acc


def _load(directory):
    reset_state()
    acc = Accelerator()
    holder = Holder()
    acc.register_for_checkpointing(holder)
    acc.load_state(directory)
    return holder.loaded


def _same_bytes(a, b):
    """Equal dtype, shape and bytes (NaN payloads included; for dtypes torch cannot compare)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(raw), b.contiguous().view(raw))


def _ckpt(*args):
    """`mpaccel ckpt ...` in this process: (exit code, stdout + stderr)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli(["ckpt", *map(str, args)])
    return code, out.getvalue()


# -- keys that would share a dataset -----------------------------------------------------------

def _colliding():
    """Pairs of keys whose paths are written alike; every tensor a value of its own."""
    t = [torch.full((2,), float(i)) for i in range(10)]
    return {
        "a.b": t[0], "a": {"b": t[1]},       # nested levels are joined by '.'
        1: t[2], "1": t[3],                  # an int key and its str
        "l": [t[4]], "l.0": t[5],            # list positions are joined by '.' too
        "s/b": t[6], "s%2Fb": t[7],          # '/' is escaped as %2F
        "": t[8], "value": t[9],             # a tensor at an empty path is named "value"
    }


def test_colliding_keys_each_keep_their_own_tensor(mpi_tmp_path, comm):
    state = _colliding()
    _save(mpi_tmp_path / "keys", state)
    loaded = _load(mpi_tmp_path / "keys")
    assert loaded.keys() == state.keys()
    assert torch.equal(loaded["a"]["b"], state["a"]["b"])
    assert torch.equal(loaded["l"][0], state["l"][0])
    for key in ("a.b", 1, "1", "l.0", "s/b", "s%2Fb", "", "value"):
        assert torch.equal(loaded[key], state[key]), key
    with CheckpointReader(str(mpi_tmp_path / "keys"), "state") as reader:
        assert reader.verify() == []
        assert len([k for k in reader.index.tensors if k.startswith("custom_0/")]) == 10
    code, text = _ckpt("verify", mpi_tmp_path / "keys")
    assert code == 0, text
    # The names depend on each key's path, not on the order of the dict (a live state_dict
    # matched against the checkpoint's names to be read into in place finds the same ones).
    backwards = dict(reversed(list(_colliding().items())))
    document, tensors = flatten(backwards, "c")
    names = {float(t[0]): name for name, t in tensors.items()}
    again = {float(t[0]): name for name, t in flatten(_colliding(), "c")[1].items()}
    assert names == again and len(set(names.values())) == 10
    assert names[0.0] != "a.b" and names[0.0].startswith("a.b~")
    assert unflatten(document, lambda name, kind: tensors[name])["a"]["b"].eq(1).all()


def test_a_name_that_cannot_be_made_unique_is_an_error_before_anything_is_written(
    mpi_tmp_path, comm
):
    state = {"x": torch.zeros(1), "": {"x": torch.ones(1)}}
    taken = next(name for name, t in flatten(state, "custom_0")[1].items() if t.item() == 0)
    state[taken] = torch.ones(2)  # a key spelled like the name the first "x" was given
    with pytest.raises(CollectiveError) as info:
        _save(mpi_tmp_path / "clash", state)
    message = str(info.value)
    assert "collecting the state" in message, message
    assert f"custom_0['x'] and custom_0[{taken!r}]" in message, message
    assert not os.path.exists(mpi_tmp_path / "clash")


# -- empty tensors -----------------------------------------------------------------------------

def test_empty_tensors_of_any_shape_save_and_load(mpi_tmp_path, comm):
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(0, 4))  # weight (4, 0)
    model.register_buffer("wide", torch.zeros(3, 0))
    model.register_buffer("tall", torch.zeros(0, 3, dtype=torch.bfloat16))
    model = acc.prepare(model)
    expected = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    acc.save_model(model, mpi_tmp_path / "model", safe_serialization=False)
    loaded = load_model_state(mpi_tmp_path / "model")
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert _same_bytes(loaded[key], value), key
    assert loaded["1.weight"].shape == (4, 0) and loaded["tall"].shape == (0, 3)
    assert _ckpt("verify", mpi_tmp_path / "model")[0] == 0
    code, text = _ckpt("ls", mpi_tmp_path / "model")
    assert code == 0 and any(line.split()[:3] == ["model/1.weight", "float32", "4x0"]
                             for line in text.splitlines()), text
    state = {"np": np.zeros((2, 0)), "t": torch.zeros(0, 3, 0, dtype=torch.int16)}
    holder = Holder(state)
    acc.register_for_checkpointing(holder)
    acc.save_state(mpi_tmp_path / "state")
    with torch.no_grad():
        acc.unwrap_model(model)[0].weight.zero_()
    acc.load_state(mpi_tmp_path / "state")
    for key, value in acc.unwrap_model(model).state_dict().items():
        assert _same_bytes(value, expected[key]), key
    assert holder.loaded["np"].shape == (2, 0) and holder.loaded["np"].dtype == np.float64
    assert holder.loaded["t"].shape == (0, 3, 0) and holder.loaded["t"].dtype == torch.int16


# -- dtypes numpy has no type for --------------------------------------------------------------

def _raw(dtype, shape):
    """Random bytes as a tensor of `dtype` (NaN payloads and all)."""
    size = torch.empty(0, dtype=dtype).element_size()
    data = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8)
    return data.view(dtype)


NUMPYLESS = [
    (torch.complex32, "uint32"),
    *[(getattr(torch, name), "uint8") for name in ("float8_e8m0fnu", "float4_e2m1fn_x2")
      if hasattr(torch, name)],
]


@pytest.mark.parametrize(("dtype", "stored"), NUMPYLESS, ids=lambda v: str(v))
def test_dtypes_numpy_lacks_are_stored_as_raw_integers(mpi_tmp_path, comm, dtype, stored):
    torch.manual_seed(0)
    state = {"t": _raw(dtype, (3, 4)), "strided": _raw(dtype, (4, 6))[:, ::2],
             "scalar": _raw(dtype, (1,))[0], "empty": _raw(dtype, (0,))}
    _save(mpi_tmp_path / "state", state)
    loaded = _load(mpi_tmp_path / "state")
    for key, value in state.items():
        assert _same_bytes(loaded[key], value), key
    index = json.loads((mpi_tmp_path / "state" / "state.index.json").read_text())
    entry = index["tensors"]["custom_0/t"]
    assert entry["dtype"] == str(dtype).removeprefix("torch.")
    with h5py.File(mpi_tmp_path / "state" / entry["file"]) as f:
        assert f["custom_0/t"].dtype == np.dtype(stored)
        assert f["custom_0/t"].attrs["torch_dtype"] == entry["dtype"]
    assert _ckpt("verify", mpi_tmp_path / "state")[0] == 0
    reset_state()
    acc = Accelerator()
    module = torch.nn.Module()
    # a parameter: at size N buffers are broadcast from rank 0 first, which gloo cannot do for
    # every one of these dtypes
    module.w = torch.nn.Parameter(state["t"], requires_grad=False)
    acc.save_model(module, mpi_tmp_path / "model", safe_serialization=False)
    assert _same_bytes(load_model_state(mpi_tmp_path / "model")["w"], state["t"])


def test_lazily_conjugated_tensors_are_stored_resolved(mpi_tmp_path, comm):
    z = torch.randn(3, 2, dtype=torch.complex64)
    # one element: contiguous, so .contiguous() keeps the negative bit of the view
    state = {"conj": z.conj(), "neg": torch.tensor([1 + 2j]).conj().imag}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    _save(mpi_tmp_path / "conj", state)
    loaded = _load(mpi_tmp_path / "conj")
    for key, value in state.items():
        assert torch.equal(loaded[key], value.resolve_conj().resolve_neg()), key


# -- numpy scalars -----------------------------------------------------------------------------

def test_numpy_scalars_come_back_with_their_type(mpi_tmp_path, comm):
    state = {
        "f64": np.float64(2.5), "f64_nan": np.float64("nan"), "f32_inf": np.float32("-inf"),
        "f16": np.float16(0.1), "str": np.str_("hï ✓"), "empty_str": np.str_(""),
        "i8": np.int8(-3), "u64": np.uint64(2**64 - 1), "bool": np.bool_(True),
        "nested": [np.float64(1.0), (np.str_("t"),)],
    }
    _save(mpi_tmp_path / "np", state)
    loaded = _load(mpi_tmp_path / "np")

    def same(a, b):
        if isinstance(b, (list, tuple)):
            return type(a) is type(b) and all(same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and (a == b or (a != a and b != b))

    for key, value in state.items():
        assert same(loaded[key], value), (key, loaded[key], value)

    def no_constant(name):  # NaN / Infinity: not JSON, and not in the index
        raise AssertionError(f"{name} in the index")

    json.loads((mpi_tmp_path / "np" / "state.index.json").read_text(),
               parse_constant=no_constant)
    # an index written before: np.float32 NaN as a bare NaN, np.float64 as a plain float
    # (and np.float64 infinity as its repr under numpy 2, which no earlier version could read)
    old = json.loads('{"a": {"__npscalar__": "float32", "value": NaN}, "b": 2.5, '
                     '"c": {"__float__": "np.float64(-inf)"}, "d": {"__float__": "nan"}}')
    back = unflatten(old, None)
    assert type(back["a"]) is np.float32 and np.isnan(back["a"]) and type(back["b"]) is float
    assert back["c"] == -np.inf and np.isnan(back["d"])


def test_non_finite_float_keys_are_tagged_not_written_as_bare_nan(mpi_tmp_path, comm):
    """A dict keyed by floats, NaN and infinities among them (a histogram's bin edges), loads
    back with the same keys, and the index stays JSON (it held bare NaN / Infinity, which
    strict parsers and other languages reject)."""
    import math

    state = {"edges": {0.5: 1, float("inf"): 2, float("-inf"): 3, float("nan"): 4, 2: 5}}
    _save(mpi_tmp_path / "keys", state)
    loaded = _load(mpi_tmp_path / "keys")["edges"]
    assert list(loaded.values()) == [1, 2, 3, 4, 5]
    keys = list(loaded)
    assert keys[:3] == [0.5, math.inf, -math.inf] and math.isnan(keys[3]) and keys[4] == 2
    assert all(type(k) is float for k in keys[:4]) and type(keys[4]) is int

    def no_constant(name):
        raise AssertionError(f"{name} in the index")

    json.loads((mpi_tmp_path / "keys" / "state.index.json").read_text(),
               parse_constant=no_constant)
    # an index written before: the keys bare
    old = unflatten(json.loads('{"__items__": [[NaN, 1], [-Infinity, 2]]}'), None)
    first, second = old
    assert math.isnan(first) and second == -math.inf


def test_dict_keys_keep_their_type_or_are_refused(mpi_tmp_path, comm):
    """Keys are held to the rules of values: numpy scalar keys came back as plain floats and
    ints, an IntEnum or str-subclass key silently as its base type, and a float subclass whose
    repr is not a float's saved a checkpoint that no rank could load."""
    import enum

    state = {"by": {np.float64(0.5): 1, np.int64(3): 2, np.float32("nan"): 3, np.str_("s"): 4}}
    _save(mpi_tmp_path / "numpy-keys", state)
    keys = list(_load(mpi_tmp_path / "numpy-keys")["by"])
    assert [type(k) for k in keys] == [np.float64, np.int64, np.float32, np.str_]
    assert keys[0] == 0.5 and keys[1] == 3 and np.isnan(keys[2]) and keys[3] == "s"

    class Level(enum.IntEnum):
        LOW = 1

    class Name(str):
        pass

    class Odd(float):
        def __repr__(self):
            return f"Odd({float(self)})"

    for key, base in ((Level.LOW, "int"), (Name("a"), "str"), (Odd("nan"), "float")):
        with pytest.raises(CheckpointError, match=rf"it would come back as a plain {base}"):
            flatten({"d": {key: 1}}, "c")


def test_a_tensor_and_its_detached_alias_keep_their_own_requires_grad(mpi_tmp_path, comm):
    """Tied keys load as one tensor object: setting requires_grad on it for the key that had
    it made the other key's plain alias require grad too (an in-place update on it then
    raised), after a background save only."""
    learnable = torch.ones(3, requires_grad=True)
    acc = _save(mpi_tmp_path / "sync", {"w": learnable, "plain": learnable.detach()})
    acc.save_state(mpi_tmp_path / "async", async_save=True)
    acc.wait_for_checkpoint()
    for name in ("sync", "async"):
        loaded = _load(mpi_tmp_path / name)
        assert loaded["w"].requires_grad and not loaded["plain"].requires_grad, name
        loaded["plain"].add_(1)  # a leaf that requires grad would refuse this
        assert loaded["w"].tolist() == [2.0] * 3, name  # still one memory


def test_containers_and_tensors_come_back_as_their_own_type(mpi_tmp_path, comm):
    """A Counter (MultiStepLR's milestones), torch.Size, nn.Parameter and requires_grad come
    back as they went in (they came back as dict, tuple, a plain tensor without grad: a resumed
    MultiStepLR then failed, a registered learnable tensor stopped learning)."""
    import collections

    state = {
        "milestones": collections.Counter({2: 1, 4: 2}),
        "size": torch.Size([2, 3]),
        "param": torch.nn.Parameter(torch.ones(2)),
        "frozen": torch.nn.Parameter(torch.ones(1), requires_grad=False),
        "learnable": torch.ones(2, requires_grad=True),
        "plain": torch.ones(2),
        "ordered": collections.OrderedDict(b=1, a=2),  # a dict, in the same order
    }
    _save(mpi_tmp_path / "types", state)
    loaded = _load(mpi_tmp_path / "types")
    assert type(loaded["milestones"]) is collections.Counter
    assert loaded["milestones"] == state["milestones"]
    assert type(loaded["size"]) is torch.Size and loaded["size"] == state["size"]
    assert type(loaded["param"]) is torch.nn.Parameter and loaded["param"].requires_grad
    assert type(loaded["frozen"]) is torch.nn.Parameter and not loaded["frozen"].requires_grad
    assert loaded["learnable"].requires_grad and not loaded["plain"].requires_grad
    assert list(loaded["ordered"]) == ["b", "a"]


def test_a_resumed_multistep_scheduler_keeps_working(mpi_tmp_path, comm):
    import collections

    def build():
        reset_state()
        acc = Accelerator()
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
        return acc, acc.prepare(opt, sched)

    acc, (opt, sched) = build()
    acc.save_state(mpi_tmp_path / "multistep")
    acc, (opt, sched) = build()
    acc.load_state(mpi_tmp_path / "multistep")
    assert type(sched.scheduler.milestones) is collections.Counter
    sched.scheduler._get_closed_form_lr()  # Counter.elements(): AttributeError on a dict


def test_subclasses_that_would_come_back_as_their_base_type_are_refused():
    import collections
    import enum

    class Level(enum.IntEnum):
        LOW = 1

    cases = {
        "named tuple": (collections.namedtuple("Pair", "a b")(1, 2), "plain tuple"),
        "IntEnum": (Level.LOW, "plain int"),
        "defaultdict": (collections.defaultdict(int, a=1), "plain dict"),
    }
    for value, base in cases.values():
        with pytest.raises(CheckpointError, match=rf"at key c/v: it would come back as a {base}"):
            flatten({"v": value}, "c")


# -- what a checkpoint refuses -----------------------------------------------------------------

def _quantized():
    return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


REFUSED = {
    "sparse": (lambda: torch.eye(3).to_sparse(), "sparse_coo tensor"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr tensor"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
               "nested tensor"),
    "meta": (lambda: torch.empty(3, device="meta"), "meta tensor"),
    "quantized": (_quantized, "dtype qint8"),
    "str_array": (lambda: np.array(["a", "bc"]), "dtype <U2"),
    "object_array": (lambda: np.array([1, "x"], dtype=object), "dtype object"),
    "datetime_array": (lambda: np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64"),
    "masked_array": (lambda: np.ma.masked_array([1, 2], mask=[0, 1]), "masked array"),
    "complex_scalar": (lambda: np.complex128(1 + 2j), "numpy scalar complex128"),
    "datetime_scalar": (lambda: np.datetime64("2020-01-01"), "numpy scalar datetime64"),
    "bytes_scalar": (lambda: np.bytes_(b"ab"), "numpy scalar bytes_"),
}
if np.dtype(np.longdouble).itemsize > 8:  # wider than float64 here: not exact as a JSON number
    REFUSED["longdouble_scalar"] = (lambda: np.longdouble(1) / 3, "numpy scalar longdouble")


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors are a prototype
@pytest.mark.parametrize("case", list(REFUSED))
def test_values_a_checkpoint_cannot_hold_are_named_before_anything_is_written(
    mpi_tmp_path, comm, case
):
    make, what = REFUSED[case]
    value = make()
    good = mpi_tmp_path / "good"
    acc = _save(good, {"w": torch.ones(3), "bad": 1.0})
    before = sorted(os.listdir(good))
    acc.register_for_checkpointing(Holder({"w": torch.ones(3), "bad": [value]}))
    for target in (good, mpi_tmp_path / "new"):
        with pytest.raises(CollectiveError) as info:
            acc.save_state(target)
        message = str(info.value)
        assert info.value.failed_ranks == list(range(comm.size)), message
        assert "collecting the state" in message and "CheckpointError" in message, message
        assert "at key custom_1/bad.0: " in message and what in message, message
        assert "checkpoints hold" in message and "HINT" in message, message
    acc.wait_for_everyone()
    assert sorted(os.listdir(good)) == before and not os.path.exists(mpi_tmp_path / "new")
    with pytest.raises(CheckpointError, match=r"at key c/bad\.0: "):
        flatten({"bad": [value]}, "c")
