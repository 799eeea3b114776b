"""The checkpoint format's building blocks: state trees split into tensors + JSON, tensor <-> HDF5
encoding that keeps the true dtype, and checksums. No pickle anywhere.

A state tree (a state_dict, an RNG state, ...) becomes a JSON document in which each tensor or
array is replaced by {"__tensor__": "<dataset name>"}; the tensors go to HDF5 datasets. Tuples,
non-string dict keys, and numpy/torch scalars are tagged so the tree comes back as it went in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import MpaccelError

FORMAT_NAME = "mpaccel-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(MpaccelError):
    """A checkpoint cannot be written, found, read or trusted; names the file and key."""


# torch dtypes numpy (and so HDF5) cannot hold: stored as same-width unsigned ints.
_VIEW_AS = {
    torch.bfloat16: torch.uint16,
    **{
        getattr(torch, name): torch.uint8
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, name)
    },
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint")
    return dtype


def storage_dtype(name: str) -> np.dtype | None:
    """The numpy dtype in which a tensor of dtype `name` (an index entry's "dtype") is stored,
    where it is a plain number type (None for anything else, or a name this torch lacks)."""
    try:
        if name.startswith("numpy."):
            stored = np.dtype(name.removeprefix("numpy."))
        else:
            dtype = torch_dtype(name)
            stored = torch.empty(0, dtype=_VIEW_AS.get(dtype, dtype)).numpy().dtype
    except (CheckpointError, TypeError, RuntimeError):
        return None
    return stored if stored.kind in "biufc" else None


def contiguous(array: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU numpy array with the tensor's bytes (bf16/fp8 viewed as uint16/uint8)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    view = _VIEW_AS.get(t.dtype)
    if view is not None:
        t = t.contiguous().view(view)
    return contiguous(t.contiguous().numpy())


def from_numpy(array: np.ndarray, name: str) -> torch.Tensor:
    dtype = torch_dtype(name)
    tensor = torch.from_numpy(contiguous(array))
    if dtype in _VIEW_AS:
        tensor = tensor.view(dtype)
    return tensor


def checksum(array: np.ndarray) -> str:
    """xxh3-64 of the array's bytes (about 20 GB/s: cheap next to the disk)."""
    data = contiguous(array)
    return xxhash.xxh3_64(memoryview(data).cast("B")).hexdigest()  # type: ignore[arg-type]


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def flatten(tree: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """Split `tree` into a JSON-able document and {dataset name: tensor or ndarray}.

    Raises CheckpointError naming the key of anything that is neither (no pickle fallback)."""
    tensors: dict[str, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if _is_array(value):
            name = path or "value"
            tensors[name] = value
            return {"__tensor__": name, "__kind__": "torch" if torch.is_tensor(value) else "numpy"}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            return {"__float__": repr(value)}
        if isinstance(value, np.generic):
            return {"__npscalar__": str(value.dtype), "value": value.item()}
        if isinstance(value, torch.dtype):
            return {"__torch_dtype__": dtype_name(value)}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in value.items()}
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise CheckpointError(
                        f"cannot store dict key {k!r} ({type(k).__name__}) at {path or prefix!r}",
                        "keys must be str, int, float, bool or None.",
                    )
                items.append([k, walk(v, f"{path}.{k}" if path else str(k))])
            return {"__items__": items}
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        raise CheckpointError(
            f"cannot store {type(value).__name__} {value!r:.80} at key {prefix}/{path}: "
            "checkpoints hold tensors, arrays, numbers, strings, lists, tuples and dicts only",
            "give the object a state_dict() that returns such values (mpaccel never pickles).",
        )

    return walk(tree, ""), tensors


def unflatten(document: Any, load: Any) -> Any:
    """Rebuild the tree; `load(name, kind)` returns the tensor or array stored under `name`."""

    def walk(value: Any) -> Any:
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "__tensor__" in value:
            return load(value["__tensor__"], value.get("__kind__", "torch"))
        if "__tuple__" in value:
            return tuple(walk(v) for v in value["__tuple__"])
        if "__items__" in value:
            return {k: walk(v) for k, v in value["__items__"]}
        if "__float__" in value:
            return float(value["__float__"])
        if "__npscalar__" in value:
            return np.dtype(value["__npscalar__"]).type(value["value"])
        if "__torch_dtype__" in value:
            return torch_dtype(value["__torch_dtype__"])
        return {k: walk(v) for k, v in value.items()}

    return walk(document)


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """`10GB`, `500MB`, `1GiB` or an int of bytes -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    text = str(size).strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return int(value * _UNITS[unit])
    raise ValueError(f"max_shard_size={size!r} is not a size like 10GB, 500MB, 2GiB or 1000000")


def dataset_name(component: str, name: str) -> str:
    """The HDF5 dataset path of tensor `name` of `component` ('/' in names escaped)."""
    return f"{component}/{name.replace('/', '%2F')}"
