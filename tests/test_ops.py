"""The collectives on nested structures (mpaccel.ops): inputs whose structure differs across
ranks are one clear error on every rank, found in the exchange the shape check already makes."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from mpaccel import ops
from mpaccel.errors import CollectiveMismatchError, ConfigurationError
from mpaccel.utils import broadcast_object_list, gather
from tests.conftest import accelerator


def _last_differs(comm, usual, last):
    """`last` on the last rank, `usual` on the others: what each rank passes."""
    return last if comm.rank == comm.size - 1 else usual


def _others(comm) -> str:
    return "rank 0" if comm.size == 2 else f"ranks 0-{comm.size - 2}"


def _raises_everywhere(comm, call, expected):
    with pytest.raises(ConfigurationError) as info:
        call()
    text = info.value.message
    assert text == expected, text
    assert comm.allgather(text) == [text] * comm.size  # the same error on every rank


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    ("usual", "last", "where", "said", "said_last"),
    [
        ({"a": torch.ones(2)}, {"b": torch.ones(2)}, "",
         "a dict with keys ['a']", "a dict with keys ['b']"),
        ({"a": torch.ones(2), "b": torch.ones(2)}, {"b": torch.ones(2), "a": torch.ones(2)}, "",
         "a dict with keys ['a', 'b']", "a dict with keys ['b', 'a']"),
        (torch.ones(2), {"a": torch.ones(2)}, "", "a tensor", "a dict with keys ['a']"),
        ([torch.ones(2)] * 3, [torch.ones(2)] * 2, "",
         "a list of 3 item(s)", "a list of 2 item(s)"),
        ({"x": [torch.ones(1), {"y": torch.ones(1)}]}, {"x": [torch.ones(1), torch.ones(1)]},
         "['x'][1]", "a dict with keys ['y']", "a tensor"),
        ({"x": torch.ones(1)}, {"x": 3}, "['x']", "a tensor", "a value that is not a tensor"),
    ],
    ids=["keys", "key-order", "tensor-dict", "list-length", "nested", "tensor-value"],
)
@pytest.mark.parametrize("call", ["gather", "gather_for_metrics", "reduce", "pad", "utils.gather"])
def test_structures_that_differ_across_ranks_are_one_error_naming_ranks_and_difference(
    comm, usual, last, where, said, said_last, call
):
    # dict keys 'a' vs 'b': each rank got its own keys back with the other ranks' tensors
    if call == "gather_for_metrics" and not (ops.only_tensors(usual) and ops.only_tensors(last)):
        pytest.skip("not all tensors: gather_for_metrics gathers objects (no structure to match)")
    acc = accelerator()
    mine = _last_differs(comm, usual, last)
    calls = {
        "gather": (lambda: acc.gather(mine), "gather"),
        "gather_for_metrics": (lambda: acc.gather_for_metrics(mine), "gather"),
        "reduce": (lambda: acc.reduce(mine), "reduce"),
        "pad": (lambda: acc.pad_across_processes(mine), "pad_across_processes"),
        "utils.gather": (lambda: gather(mine), "gather"),
    }
    function, what = calls[call]
    _raises_everywhere(
        comm, function,
        f"{what}: the ranks passed different structures, at input{where}: "
        f"{_others(comm)}: {said}; rank {comm.size - 1}: {said_last}",
    )
    acc.wait_for_everyone()  # still in step


def test_same_structures_still_gather(comm):
    acc = accelerator()
    r = acc.process_index
    batch = collections.OrderedDict(
        x=torch.full((2,), float(r)), rest=[torch.tensor([r]), {"n": torch.ones(1, 2)}], tag="t"
    )
    out = acc.gather(batch)
    assert out["x"].tolist() == [float(k) for k in range(comm.size) for _ in range(2)]
    assert out["rest"][0].tolist() == list(range(comm.size)) and out["tag"] == "t"
    assert out["rest"][1]["n"].shape == (comm.size, 2) and type(out) is collections.OrderedDict


@pytest.mark.mpi(min_size=2)
def test_broadcast_object_list_from_different_sources_is_one_error_naming_the_ranks(comm):
    # Each rank named itself: every rank got its own list back, silently.
    accelerator()
    objects = [f"from {comm.rank}"]
    with pytest.raises(CollectiveMismatchError) as info:
        broadcast_object_list(objects, from_process=comm.rank)
    text = str(info.value)
    calls = "; ".join(f"broadcast_object_list(from_process={r}) on rank {r}"
                      for r in range(comm.size))
    assert f"the ranks called different collective operations: {calls}" in text, text
    assert comm.allgather(text) == [text] * comm.size
    assert objects == [f"from {comm.rank}"]  # left as it was


def test_broadcast_object_list_puts_the_source_list_in_place(comm):
    accelerator()
    last = comm.size - 1
    objects: list = [{"rank": comm.rank}, np.arange(comm.rank + 1)]
    same = broadcast_object_list(objects, from_process=np.int64(last))
    assert same is objects and objects[0] == {"rank": last}
    assert objects[1].tolist() == list(range(last + 1))
    with pytest.raises(ConfigurationError, match=rf"from_process={comm.size}\) is not a rank"):
        broadcast_object_list(objects, from_process=comm.size)
    with pytest.raises(ConfigurationError, match=r"from_process='0'\): expected a rank"):
        broadcast_object_list(objects, from_process="0")  # type: ignore[arg-type]


@pytest.mark.mpi(min_size=2)
def test_a_source_out_of_range_on_one_rank_does_not_leave_the_others_waiting(comm):
    acc = accelerator()
    source = _last_differs(comm, 0, comm.size)  # the last rank names no rank at all
    for call in (lambda: broadcast_object_list(["x"], source),
                 lambda: ops.broadcast(acc._partial.comm, torch.ones(2), source)):
        with pytest.raises(CollectiveMismatchError, match=f"from_process={comm.size}\\) on rank"):
            call()
    acc.wait_for_everyone()


def test_copy_tensor_to_devices_sends_the_one_rank_s_tensor_everywhere(comm):
    # Accelerate's test_ops imports it; only the last rank knows the shape and dtype.
    from mpaccel.utils import copy_tensor_to_devices

    accelerator()
    last = comm.size - 1
    mine = torch.arange(6, dtype=torch.int32).reshape(2, 3) if comm.rank == last else None
    copied = copy_tensor_to_devices(mine)
    assert copied.dtype == torch.int32 and copied.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert copied is not mine  # a new tensor, as Accelerate's (a sum into a copy)


def test_copy_tensor_to_devices_needs_exactly_one_holder(comm):
    from mpaccel.errors import DistributedOperationException
    from mpaccel.utils import copy_tensor_to_devices

    accelerator()
    with pytest.raises(DistributedOperationException) as info:
        copy_tensor_to_devices(None)
    assert "needs the tensor on exactly one rank; no rank passed one" in str(info.value)
    if comm.size > 1:
        with pytest.raises(DistributedOperationException) as info:
            copy_tensor_to_devices(torch.ones(2))
        assert f"ranks 0-{comm.size - 1} passed one" in str(info.value)
        assert comm.allgather(str(info.value)) == [str(info.value)] * comm.size


def test_pad_across_processes_leaves_a_nested_tensor_with_a_warning(comm):
    """A nested tensor has no one size to pad to: returned as it is, with Accelerate's
    warning, while the other tensors are padded as usual."""
    acc = accelerator()
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.warns(ops.CannotPadNestedTensorWarning):
        out = acc.pad_across_processes({"n": nested, "t": torch.ones(comm.rank + 1)})
    assert out["n"] is nested
    assert out["t"].shape == (comm.size,)
