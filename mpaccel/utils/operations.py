"""Module-level collectives with Accelerate's names (`mpaccel.utils.gather`, ...), on the
current PartialState's communicator. Each is collective: every rank must call it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import ops
from ..device import send_to_device as send_to_device
from ..errors import DistributedOperationException as DistributedOperationException


def _comm() -> Any:
    from ..state import PartialState

    return PartialState().comm


def gather(tensor: Any) -> Any:
    return ops.gather(_comm(), tensor)


def gather_object(object: Any) -> list[Any]:  # Accelerate names it `object`
    return ops.gather_object(_comm(), object)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    # "mean" by default, as accelerate.utils.reduce (Accelerator.reduce's default is "sum").
    return ops.reduce(_comm(), tensor, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    return ops.broadcast(_comm(), tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Rank `from_process`'s list, in place, on every rank (over MPI); see ops."""
    return ops.broadcast_object_list(_comm(), object_list, from_process)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor one rank passes (the others pass None) on every rank's device; see ops."""
    from ..state import PartialState

    return ops.copy_tensor_to_devices(_comm(), tensor, PartialState().device)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    return ops.pad_across_processes(_comm(), tensor, dim, pad_index, pad_first)


# -- Accelerate's helpers for nested structures ---------------------------------------------------


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """A list, tuple or named tuple of `obj`'s type holding what `generator` yields."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(
    func: Any,
    data: Any,
    *args: Any,
    test_type: Any = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """`data` (lists, tuples, named tuples, mappings, nested) rebuilt with the same types, each
    leaf for which `test_type(leaf)` holds replaced by `func(leaf, *args, **kwargs)`; other
    leaves are kept, or a TypeError if `error_on_other_type`. Not collective."""
    if isinstance(data, (tuple, list)):
        return honor_type(
            data,
            (
                recursively_apply(func, o, *args, test_type=test_type,
                                  error_on_other_type=error_on_other_type, **kwargs)
                for o in data
            ),
        )
    if isinstance(data, Mapping):
        return type(data)(  # type: ignore[call-arg]
            {
                k: recursively_apply(func, v, *args, test_type=test_type,
                                     error_on_other_type=error_on_other_type, **kwargs)
                for k, v in data.items()
            }
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(
            f"{getattr(func, '__name__', func)!s} got a {type(data).__name__} ({data!r}); it "
            f"takes nested lists, tuples and dicts of objects for which "
            f"{getattr(test_type, '__name__', test_type)!s}() holds"
        )
    return data


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in `data` (nested lists, tuples, dicts)."""
    if isinstance(data, (tuple, list, Mapping)):
        if len(data) == 0:
            raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
        first = next(iter(data.values())) if isinstance(data, Mapping) else data[0]
        return find_batch_size(first)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, got {type(data).__name__}")
    return data.shape[0]


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """A list of equally nested structures of tensors -> one structure of the tensors
    concatenated along `dim` (torch.cat). Not collective."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        parts = (concatenate([d[i] for d in data], dim) for i in range(len(first)))
        return honor_type(first, parts)
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})  # type: ignore[call-arg]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"can only concatenate tensors, got {type(first).__name__}")
    return torch.cat(data, dim=dim)
