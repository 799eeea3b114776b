"""How a read lands in memory: which live tensors a checkpoint's bytes can be read straight
into (and held back until every check passed: Deferred), and which reader of a node verifies
which tensor's checksum."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .format import dtype_name, to_numpy
from .index import TensorEntry


class Deferred:
    """In-place reads held back by read_arrays(defer=...) until CheckpointReader.fill(): (key,
    entry, destination, verify, where its bytes are: (fd, offset) in the file, or an array
    they were read into)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, TensorEntry, np.ndarray, bool, Any]] = []


def writable_view(tensor: Any, entry: TensorEntry) -> np.ndarray | None:
    """A numpy view of `tensor`'s memory if the entry's bytes can be read straight into it
    (None for anything else: GPU, sparse, non-contiguous or uninitialized lazy tensors...)."""
    return writable_as(tensor, entry.dtype, entry.shape)


def writable_as(tensor: Any, dtype: str, shape: Sequence[int]) -> np.ndarray | None:
    """writable_view for bytes of tensor dtype `dtype` and shape `shape` (a DTensor's rows)."""
    if not isinstance(tensor, torch.Tensor) or torch.nn.parameter.is_lazy(tensor):
        return None
    try:
        if (
            tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or not tensor.is_contiguous()
            or dtype_name(tensor.dtype) != dtype
            or tuple(tensor.shape) != tuple(shape)
        ):
            return None
        view = to_numpy(tensor)
    except Exception:
        return None
    if not view.flags.writeable or view.ctypes.data != tensor.data_ptr():
        return None
    return view


def claim(claimed: list[tuple[int, int]], view: np.ndarray) -> bool:
    """Add the bytes of `view` to the sorted, disjoint (start, end) ranges of `claimed`, unless
    they overlap one of them (then False)."""
    start = view.ctypes.data
    end = start + view.nbytes
    i = bisect.bisect_left(claimed, (start, end))
    if (i > 0 and claimed[i - 1][1] > start) or (i < len(claimed) and claimed[i][0] < end):
        return False
    claimed.insert(i, (start, end))
    return True


def checksum_owners(entries: Mapping[str, TensorEntry], count: int) -> dict[str, int]:
    """{key: which of `count` readers verifies it}: the tensors in file order (file, offset),
    cut into `count` runs of about equal bytes; a tensor belongs to the run holding its middle
    byte. By bytes, not by number of tensors: a model's few large matrices and many small
    vectors would otherwise leave one reader hashing most of the data while the others wait."""
    order = sorted(entries, key=lambda k: (entries[k].file, entries[k].offset or 0, k))
    total = sum(entries[k].nbytes for k in order)
    owners, start = {}, 0
    for key in order:
        size = entries[key].nbytes
        middle = start + size / 2
        owners[key] = min(count - 1, int(middle * count / total)) if total else 0
        start += size
    return owners
