"""The one walker of nested structures (mappings, lists, tuples, named tuples): their leaves,
a map over the leaves and a zip-map over structures of the same shape, each container rebuilt
with its own type. Also Accelerate's names for it (`recursively_apply`, `honor_type`, ...),
which utils/operations.py re-exports at Accelerate's path."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "convert_to_fp32",
    "honor_type",
    "is_namedtuple",
    "is_torch_tensor",
    "leaves",
    "map",
    "recursively_apply",
    "zip_map",
]


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


def leaves(
    data: Any, is_leaf: Callable[[Any], bool] | None = None
) -> list[Any]:
    """Every leaf of `data`, depth first, in the order map() visits them: a mapping's values in
    its order, a list's or tuple's items; anything else (a tensor always, or anything `is_leaf`
    holds for) is a leaf. Not collective."""
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, torch.Tensor) or (is_leaf is not None and is_leaf(node)):
            found.append(node)
        elif isinstance(node, Mapping):
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)
        else:
            found.append(node)

    visit(data)
    return found


def zip_map(
    fn: Callable[..., Any],
    *trees: Any,
    is_leaf: Callable[[Any], bool] | None = None,
    skip_keys: Collection[Any] = (),
    dict_if_refused: bool = False,
) -> Any:
    """The structure of the first of `trees` with each leaf replaced by `fn(leaf, *the leaves
    at the same place in the other trees)`. Mappings are rebuilt as `type(m)(dict)` (with
    `dict_if_refused`, a type whose constructor refuses a dict gives a plain dict), named tuples
    field by field, lists and tuples in their type; the other trees are read by the first's
    keys and zipped by position. A mapping's values under `skip_keys` are kept as they are.
    `is_leaf`: what counts as a leaf before it is looked into (a batch object with `.to()`).
    Not collective."""

    def walk(first: Any, others: Sequence[Any]) -> Any:
        # A tensor is always a leaf: tested first, as most leaves are tensors.
        if isinstance(first, torch.Tensor) or (is_leaf is not None and is_leaf(first)):
            return fn(first, *others) if others else fn(first)
        if isinstance(first, Mapping):
            values = {
                key: value if skip_keys and key in skip_keys
                else walk(value, [o[key] for o in others] if others else others)
                for key, value in first.items()
            }
            if not dict_if_refused:
                return type(first)(values)  # type: ignore[call-arg]
            try:
                return type(first)(values)  # type: ignore[call-arg]
            except Exception:
                return values
        if isinstance(first, (list, tuple)):
            if others:
                parts = [walk(value, rest) for value, *rest in zip(first, *others)]
            else:
                parts = [walk(value, others) for value in first]
            return type(first)(*parts) if is_namedtuple(first) else type(first)(parts)
        return fn(first, *others) if others else fn(first)

    return walk(trees[0], trees[1:])


def map(
    fn: Callable[[Any], Any],
    data: Any,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    skip_keys: Collection[Any] = (),
    dict_if_refused: bool = False,
) -> Any:
    """`data` with each leaf replaced by `fn(leaf)`, in the order of leaves(); containers
    rebuilt with their types as zip_map() does. Not collective."""
    return zip_map(fn, data, is_leaf=is_leaf, skip_keys=skip_keys,
                   dict_if_refused=dict_if_refused)


def recursively_apply(
    func: Any,
    data: Any,
    *args: Any,
    test_type: Any = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Not collective. `data` rebuilt with the same types, each leaf for which
    `test_type(leaf)` holds replaced by `func(leaf, *args, **kwargs)`; other leaves are kept.

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

    def leaf(value: Any) -> Any:
        if test_type(value):
            return func(value, *args, **kwargs)
        if error_on_other_type:
            raise TypeError(
                f"{getattr(func, '__name__', func)!s} got a {type(value).__name__} ({value!r}); "
                f"it takes nested lists, tuples and dicts of objects for which "
                f"{getattr(test_type, '__name__', test_type)!s}() holds"
            )
        return value

    return map(leaf, data)


def _is_half(tensor: Any) -> bool:
    return getattr(tensor, "dtype", None) in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Not collective. `tensor` with each float16 or bfloat16 tensor converted to float32,
    nested structures rebuilt with the same types; other leaves are kept.

    Args:
        tensor: a tensor, or nested lists, tuples, named tuples and mappings of tensors.
    """
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)
