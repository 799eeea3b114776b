"""Module-level collectives with Accelerate's names (`mpaccel.utils.gather`, ...), on the
current PartialState's communicator. Each is collective: every rank must call it."""

from __future__ import annotations

from typing import Any

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
    """Rank `from_process`'s list, in place, on every rank (over MPI)."""
    object_list[:] = _comm().bcast(list(object_list), root=from_process, what="broadcast_object")
    return object_list


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    return ops.pad_across_processes(_comm(), tensor, dim, pad_index, pad_first)
