"""split_between_processes: this process's contiguous share of a list, tuple, tensor, array,
dataset, or of a (nested) dict of those."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Set, ValuesView
from typing import Any

from . import tree
from .errors import with_hint


def _refuse(value: Any) -> TypeError:
    kind = type(value).__name__
    if isinstance(value, Set):  # set, frozenset, and dict.keys()/.items() views
        return TypeError(with_hint(
            f"split_between_processes cannot split a {kind}: it has no order that is the same "
            "on every process (a set iterates in hash order, and string hashes are salted per "
            "process), so the shares would overlap and miss items",
            "pass sorted(inputs), or a list in an order every process builds alike.",
        ))
    if isinstance(value, ValuesView):
        return TypeError(with_hint(
            f"split_between_processes cannot split a {kind} view: it cannot be sliced",
            "pass list(d.values()) (the dict's order must be the same on every process: build "
            "it alike, or split sorted(d.items())).",
        ))
    if isinstance(value, Iterator):
        return TypeError(with_hint(
            f"split_between_processes cannot split a {kind}: it has no length, can be read only "
            "once, and may yield in another order on another process",
            "pass list(inputs), or sorted(inputs) when its order may differ between processes.",
        ))
    return TypeError(with_hint(
        f"split_between_processes cannot split a {kind}",
        "pass a list, tuple, torch.Tensor, numpy array, datasets.Dataset, or a (nested) dict of "
        "those: anything with len() and slicing.",
    ))


def _length(value: Any) -> int:
    if isinstance(value, (Set, ValuesView, Iterator)) or not hasattr(value, "__getitem__"):
        raise _refuse(value)
    try:
        return len(value)
    except TypeError:
        raise _refuse(value) from None


def share_bounds(length: int, index: int, count: int) -> tuple[int, int]:
    """[start, end) of process `index` of `count`: the first `length % count` get one extra."""
    base, extra = divmod(length, count)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _pad(share: Any, last: Any, missing: int) -> Any:
    if missing <= 0:
        return share
    module = type(share).__module__
    if module.startswith("torch"):
        import torch

        return torch.cat([share, last.unsqueeze(0).expand(missing, *last.shape)])
    if module.startswith("numpy"):
        import numpy as np

        return np.concatenate([share, np.repeat(last[None], missing, axis=0)])
    if isinstance(share, tuple):
        return share + (last,) * missing
    if isinstance(share, (list, range)):  # a range (of indices) becomes a list
        return list(share) + [last] * missing
    raise TypeError(f"cannot pad a {type(share).__name__} share; use a list, tuple or tensor")


def _split_one(value: Any, bounds: tuple[int, int], padded: int, apply_padding: bool) -> Any:
    length = _length(value)
    start, end = bounds
    # datasets.Dataset and friends: rows by select(). A Dataset has a `shape` (rows, columns)
    # too, and slicing it gives a dict of columns, so its column_names tell it from an array.
    if hasattr(value, "select") and not isinstance(value, (list, tuple)) and (
        hasattr(value, "column_names") or not hasattr(value, "shape")
    ):
        rows = list(range(start, end))
        if apply_padding and length:
            rows += [length - 1] * (padded - (end - start))
        return value.select(rows)
    share = value[start:end]
    if apply_padding and length:
        share = _pad(share, value[length - 1], padded - (end - start))
    return share


def _lengths(inputs: Mapping, path: str, into: dict[str, int]) -> None:
    """The length of every leaf of the nested mapping `inputs`, by its path (`['a']['x']`)."""
    for key, value in inputs.items():
        where = f"{path}[{key!r}]"
        if isinstance(value, Mapping):
            _lengths(value, where, into)
        else:
            into[where] = _length(value)


def split_inputs(inputs: Any, index: int, count: int, apply_padding: bool = False) -> Any:
    """Process `index`'s share of `inputs` among `count` processes, as Accelerate's
    split_between_processes gives it.

    Shares are contiguous and differ in length by at most one, the first processes taking the
    extra items; a process past the input's end gets an empty share. With `apply_padding`,
    shorter shares are filled up with the input's last element so that every process holds
    `ceil(len / count)` items (drop them after gathering). A dict, nested or not, is split leaf
    by leaf with the same bounds; its leaves must all have the same length. Unordered inputs
    (sets, iterators) are refused: their order may differ between processes.
    """
    if isinstance(inputs, Mapping):
        lengths: dict[str, int] = {}
        _lengths(inputs, "", lengths)
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"inputs{path}: {n}" for path, n in list(lengths.items())[:8])
            raise ValueError(
                "split_between_processes needs every value of the dict (nested dicts: every "
                f"leaf) to have the same length, got {shown}"
            )
        length = next(iter(lengths.values()), 0)
    else:
        length = _length(inputs)
    bounds = share_bounds(length, index, count)
    padded = -(-length // count)
    if isinstance(inputs, Mapping):
        # Each mapping in its own type where that type takes a dict (an OrderedDict, a batch
        # object with .to()), else a dict; lists, arrays and datasets are leaves, split whole.
        return tree.map(
            lambda v: _split_one(v, bounds, padded, apply_padding), inputs,
            is_leaf=lambda v: not isinstance(v, Mapping), dict_if_refused=True,
        )
    return _split_one(inputs, bounds, padded, apply_padding)
