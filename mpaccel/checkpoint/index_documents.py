"""The state documents of a checkpoint index: JSON values and the tags format.unflatten reads,
each well formed, naming tensors the index holds. Checked by index_check.check_index."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .format import CheckpointError, dataset_name
from .index_fields import TORCH_NAME, Checker, article, is_int, is_number, show

_SCALAR_DTYPE = re.compile(r"[<>=|]?(bool|u?int(8|16|32|64)|float(16|32|64)|U\d{1,6})\Z")

_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__", "__npscalar__", "__torch_dtype__")


def check_document(c: Checker, document: Any, where: tuple, component: str, tensors: dict) -> None:
    """A state document holds JSON values and the tags format.unflatten reads, each well formed
    (what unflatten would otherwise fail on with a raw Python error), and names tensors of the
    index only. Iterative (the depth was bounded by the scanner); each value's path is kept as
    (parent's path, key) and spelt out on failure only."""
    stack: list[tuple[Any, Any]] = [(document, (None, where))]
    while stack:
        value, at = stack.pop()
        if type(value) is list:
            stack.extend((v, (at, i)) for i, v in enumerate(value))
        elif type(value) is dict:
            name = value.get("__tensor__")
            if type(name) is str and _tensor_ok(value, dataset_name(component, name), tensors):
                continue  # (the common case, fast)
            for tag in _TAGS:
                if tag in value:
                    stack.extend(_TAG_CHECKS[tag](_Tag(c, value, at), component, tensors))
                    break
            else:
                stack.extend((v, (at, k)) for k, v in value.items())


def _tensor_ok(value: dict, key: str, tensors: dict) -> bool:
    return (
        key in tensors
        and value.get("__kind__", "torch") in ("torch", "numpy")
        and type(value.get("__parameter__", False)) is bool
        and type(value.get("__requires_grad__", False)) is bool
    )


class _Tag:
    """A tagged dict of a document and its path (as check_document keeps it)."""

    def __init__(self, c: Checker, value: dict, at: Any) -> None:
        self.c, self.value, self.at = c, value, at

    def path(self, *more: Any) -> tuple:
        parts, linked = list(reversed(more)), self.at
        while linked[0] is not None:
            linked, key = linked
            parts.append(key)
        return (*linked[1], *reversed(parts))

    def fail(self, key: str, message: str) -> CheckpointError:
        return self.c.fail(self.path(key), message)

    def get(self, key: str, kind: type) -> Any:
        value = self.value.get(key)
        if type(value) is not kind:
            raise self.fail(key, f"is {show(value)}: expected {article(kind.__name__)}")
        return value

    def child(self, value: Any, *keys: Any) -> tuple[Any, Any]:
        at = self.at
        for key in keys:
            at = (at, key)
        return value, at


def _tensor_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    name = tag.get("__tensor__", str)
    if dataset_name(component, name) not in tensors:
        raise tag.fail("__tensor__", f"names {name!r}, a tensor the index does not hold")
    if tag.value.get("__kind__", "torch") not in ("torch", "numpy"):
        raise tag.fail("__kind__", f"is {show(tag.value['__kind__'])}: expected torch or numpy")
    for flag in ("__parameter__", "__requires_grad__"):
        if flag in tag.value:
            tag.get(flag, bool)
    return iter(())


def _tuple_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    items = tag.get("__tuple__", list)
    if tag.value.get("__type__") == "torch.Size" and not all(is_int(i) for i in items):
        raise tag.fail("__tuple__", f"is {show(items)}: a torch.Size holds integers")
    return (tag.child(v, "__tuple__", i) for i, v in enumerate(items))


def _items_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    items = tag.get("__items__", list)
    for i, pair in enumerate(items):
        if type(pair) is not list or len(pair) != 2:
            raise tag.c.fail(tag.path("__items__", i),
                             f"is {show(pair)}: expected a [key, value] pair")
        key = pair[0]
        hashable = key is None or type(key) in (str, int, float, bool) or (
            type(key) is dict and (set(key) in ({"__npscalar__", "value"}, {"__float__"}))
        )
        if not hashable:
            raise tag.c.fail(tag.path("__items__", i, 0), f"is {show(key)}: not a dict key")
    return (
        child
        for i, (k, v) in enumerate(items)
        for child in (tag.child(k, "__items__", i, 0), tag.child(v, "__items__", i, 1))
    )


def _float_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    text = tag.get("__float__", str)
    try:
        if len(text) > 64:
            raise ValueError
        float(text.removeprefix("np.float64(").removesuffix(")"))
    except ValueError:
        raise tag.fail("__float__", f"is {show(text)}: expected a float") from None
    return iter(())


def _npscalar_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    name = tag.get("__npscalar__", str)
    if not _SCALAR_DTYPE.match(name):
        raise tag.fail("__npscalar__", f"is {show(name)}: not a numpy scalar type mpaccel "
                       "stores (bool, integer, float up to float64, str)")
    dtype = np.dtype(name)
    item, kind = tag.value.get("value"), dtype.kind
    if kind in "iu":
        info = np.iinfo(dtype)
        fits = is_int(item) and int(info.min) <= int(item or 0) <= int(info.max)
    else:
        fits = (
            (kind == "b" and type(item) is bool)
            or (kind == "f" and (is_number(item) or item in ("nan", "inf", "-inf")))
            or (kind == "U" and type(item) is str)
        )
    if not fits:
        raise tag.fail("value", f"is {show(item)}: not a value of numpy {name}")
    return iter(())


def _dtype_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    import torch

    name = tag.get("__torch_dtype__", str)
    if not TORCH_NAME.match(name) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise tag.fail("__torch_dtype__", f"is {show(name)}: not a torch dtype")
    return iter(())


_TAG_CHECKS: dict[str, Callable[..., Iterator]] = {
    "__tensor__": _tensor_tag,
    "__tuple__": _tuple_tag,
    "__items__": _items_tag,
    "__float__": _float_tag,
    "__npscalar__": _npscalar_tag,
    "__torch_dtype__": _dtype_tag,
}
