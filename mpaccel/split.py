"""split_between_processes: this process's contiguous share of a list, tuple, dict or tensor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _length(value: Any) -> int:
    try:
        return len(value)
    except TypeError:
        raise TypeError(
            f"split_between_processes cannot split a {type(value).__name__}; pass a list, tuple, "
            "dict of those, torch.Tensor, numpy array or anything with len() and slicing"
        ) from None


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


def _split_one(value: Any, index: int, count: int, apply_padding: bool) -> Any:
    length = _length(value)
    start, end = share_bounds(length, index, count)
    if (
        hasattr(value, "select")
        and not isinstance(value, (list, tuple))
        and not hasattr(value, "shape")
    ):
        share = value.select(range(start, end))  # datasets.Dataset and friends
        if apply_padding and length:
            padded = -(-length // count)
            share = value.select(list(range(start, end)) + [length - 1] * (padded - (end - start)))
        return share
    share = value[start:end]
    if apply_padding and length:
        share = _pad(share, value[length - 1], -(-length // count) - (end - start))
    return share


def split_inputs(inputs: Any, index: int, count: int, apply_padding: bool = False) -> Any:
    """Process `index`'s share of `inputs` among `count` processes.

    Shares are contiguous and differ in length by at most one, the first processes taking the
    extra items. With `apply_padding`, shorter shares are filled up with the input's last element
    so that every process holds `ceil(len / count)` items (drop them after gathering). A dict is
    split value by value (into a mapping of its own type where that type takes a dict); its
    values must all have the same length.
    """
    if isinstance(inputs, Mapping):
        lengths = {key: _length(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                "split_between_processes needs every value of the dict to have the same length, "
                f"got {lengths!r}"
            )
        shares = {key: _split_one(v, index, count, apply_padding) for key, v in inputs.items()}
        try:  # the input's own type (an OrderedDict, a batch object with .to()), where it can
            return type(inputs)(shares)  # type: ignore[call-arg]
        except Exception:
            return shares
    return _split_one(inputs, index, count, apply_padding)
