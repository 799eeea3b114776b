"""Nested structures of tensors (lists, tuples, named tuples, mappings): rebuilt leaf by leaf
with their own types. Core code (training.py) and the Accelerate-path layer (utils/operations.py,
which re-exports these under Accelerate's names) both use them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def is_torch_tensor(tensor: Any) -> bool:
    """Not collective. Whether `tensor` is a torch.Tensor.

    Args:
        tensor: any object.
    """
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """Not collective. Whether `data` is a named tuple (a tuple with `_fields`).

    Args:
        data: any object.
    """
    return isinstance(data, tuple) and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """Not collective. A list, tuple or named tuple of `obj`'s type holding what `generator`
    yields.

    Args:
        obj: the list, tuple or named tuple whose type the result takes.
        generator: an iterable of the items (a named tuple's in field order).
    """
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
    """Not collective. `data` rebuilt with the same types, each leaf for which
    `test_type(leaf)` holds replaced by `func(leaf, *args, **kwargs)`.

    Args:
        func: what a leaf is replaced by the result of.
        data: a leaf, or nested lists, tuples, named tuples and mappings of leaves.
        *args: passed to `func` after the leaf.
        test_type: which leaves `func` applies to (default: tensors).
        error_on_other_type: raise on any other leaf instead of keeping it.
        **kwargs: passed to `func`.

    Raises:
        TypeError: with `error_on_other_type`, on a leaf `test_type` refuses.
    """
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
    """Not collective. `tensor` with each float16 or bfloat16 tensor converted to float32.

    Args:
        tensor: a tensor, or nested lists, tuples and dicts of them; other leaves are kept.
    """
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)
