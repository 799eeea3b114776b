"""Module-level collectives with Accelerate's names (`mpaccel.utils.gather`, ...), on the
current PartialState's communicator. Each is collective: every rank must call it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import ops


def _comm() -> Any:
    from ..state import PartialState

    return PartialState().comm


def gather(tensor: Any) -> Any:
    return ops.gather(_comm(), tensor)


def gather_object(obj: Any) -> list[Any]:
    return ops.gather_object(_comm(), obj)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    # "mean" by default, as accelerate.utils.reduce (Accelerator.reduce's default is "sum").
    return ops.reduce(_comm(), tensor, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    return ops.broadcast(_comm(), tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Rank `from_process`'s list, in place, on every rank (over MPI); see ops."""
    return ops.broadcast_object_list(_comm(), object_list, from_process)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    return ops.pad_across_processes(_comm(), tensor, dim, pad_index, pad_first)


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> Any:
    """Not collective. `tensor` on `device`: a tensor, or anything with a `.to` method (a
    tokenizer's BatchEncoding, a module), or lists, tuples, named tuples and mappings of those,
    rebuilt with the same types; the values of mappings under `skip_keys` stay where they are,
    and anything else is returned as it is."""
    if isinstance(tensor, torch.Tensor) or hasattr(tensor, "to"):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() without non_blocking
            return tensor.to(device)
    if isinstance(tensor, tuple) and hasattr(tensor, "_fields"):  # a named tuple
        return type(tensor)(*(send_to_device(t, device, non_blocking, skip_keys) for t in tensor))
    if isinstance(tensor, (list, tuple)):
        return type(tensor)(send_to_device(t, device, non_blocking, skip_keys) for t in tensor)
    if isinstance(tensor, Mapping):
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
        return type(tensor)(  # type: ignore[call-arg]
            {
                k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
                for k, v in tensor.items()
            }
        )
    return tensor
