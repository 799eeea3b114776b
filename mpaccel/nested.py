"""Nested structures of tensors (lists, tuples, named tuples, mappings): rebuilt leaf by leaf
with their own types. Core code (training.py) and the Accelerate-path layer (utils/operations.py,
which re-exports these under Accelerate's names) both use them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


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


def _is_half(tensor: Any) -> bool:
    return getattr(tensor, "dtype", None) in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """`tensor` (a nested structure) with each float16 or bfloat16 tensor converted to float32;
    other leaves are kept."""
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)
