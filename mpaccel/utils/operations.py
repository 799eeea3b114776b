"""Module-level collectives with Accelerate's names (`mpaccel.utils.gather`, ...), on the
current PartialState's communicator. Each is collective: every rank must call it."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from ..device import send_to_device as send_to_device
from ..errors import DistributedOperationException as DistributedOperationException
from ..ops import CannotPadNestedTensorWarning as CannotPadNestedTensorWarning
from ..tree import convert_to_fp32 as convert_to_fp32
from ..tree import honor_type as honor_type
from ..tree import is_namedtuple as is_namedtuple
from ..tree import is_torch_tensor as is_torch_tensor
from ..tree import recursively_apply as recursively_apply


def _comm() -> Any:
    from ..state import PartialState

    return PartialState().comm


def gather(tensor: Any) -> Any:
    """Collective: every rank must call it. Every rank's tensors, concatenated along the first
    dimension in rank order, on every rank (torch.distributed's all-gather).

    Args:
        tensor: a tensor, or nested lists, tuples and dicts of tensors. Every rank passes the
            same structure with the same dtypes and trailing dimensions; the first dimension
            may differ between ranks, and a 0-d tensor counts as one row.

    Returns:
        The same structure holding the gathered tensors (at size 1, `tensor` itself).

    Raises:
        DistributedOperationException: on every rank, when the ranks' structures, dtypes or
            shapes disagree; it names the ranks and where they differ.
    """
    return ops.gather(_comm(), tensor)


def gather_object(object: Any) -> list[Any]:  # Accelerate names it `object`
    """Collective: every rank must call it. Every rank's picklable objects in one list, in rank
    order, on every rank; sent over MPI on the host, never through the GPU.

    Args:
        object: what this rank contributes. A list or tuple adds its items, a tensor or numpy
            array with dimensions adds its rows (as Accelerate's does), anything else adds
            itself as one item.

    Returns:
        The list of every rank's contributions.
    """
    return ops.gather_object(_comm(), object)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Collective: every rank must call it. The element-wise reduction of every rank's tensors,
    on every rank (torch.distributed's all-reduce); the inputs are left as they are.

    Args:
        tensor: a tensor, or nested lists, tuples and dicts of tensors, of the same structure,
            dtypes and shapes on every rank.
        reduction: "mean" (the default here, as in accelerate.utils.reduce; Accelerator.reduce
            defaults to "sum"), "sum", "max", "min", or "none" to return `tensor` unchanged.
        scale: a factor every reduced tensor is multiplied by.

    Returns:
        The same structure holding new, reduced tensors.

    Raises:
        ConfigurationError: for another `reduction`.
        DistributedOperationException: on every rank, when the ranks' structures, dtypes or
            shapes disagree.
    """
    # "mean" by default, as accelerate.utils.reduce (Accelerator.reduce's default is "sum").
    return ops.reduce(_comm(), tensor, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Collective: every rank must call it, naming the same `from_process`. Rank
    `from_process`'s tensors, copied into every other rank's tensors in place.

    Args:
        tensor: a tensor, or nested lists, tuples and dicts of tensors, of the same structure,
            dtypes and shapes on every rank (the receivers' values are overwritten).
        from_process: the rank whose tensors every rank receives.

    Returns:
        `tensor`, holding rank `from_process`'s values.

    Raises:
        ConfigurationError: when `from_process` is not a rank of the job.
        DistributedOperationException: on every rank, when the ranks' structures, dtypes or
            shapes disagree.
    """
    return ops.broadcast(_comm(), tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Collective: every rank must call it, naming the same `from_process`. Rank
    `from_process`'s list of picklable objects, sent over MPI on the host and put in place of
    the items of every rank's `object_list`.

    Args:
        object_list: a list; on rank `from_process` what is sent, elsewhere what is replaced
            (its length need not match).
        from_process: the rank whose list every rank receives.

    Returns:
        `object_list`, now holding rank `from_process`'s items.

    Raises:
        ConfigurationError: when `from_process` is not a rank of the job.
        CollectiveMismatchError: on every rank, when the ranks name different `from_process`.
    """
    return ops.broadcast_object_list(_comm(), object_list, from_process)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Collective: every rank must call it. The tensor that exactly one rank holds, as a new
    tensor on every rank's device; the others need not know its shape or dtype.

    Args:
        tensor: the tensor on the rank that holds it, None on every other rank.

    Returns:
        A copy of the tensor on this rank's device (PartialState().device).

    Raises:
        DistributedOperationException: on every rank, when no rank or several ranks passed a
            tensor.
    """
    from ..state import PartialState

    return ops.copy_tensor_to_devices(_comm(), tensor, PartialState().device)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Collective: every rank must call it. Each tensor padded along `dim` to the largest size
    any rank has there, so that the ranks' tensors can then be gathered.

    Args:
        tensor: a tensor, or nested lists, tuples and dicts of tensors, of the same structure,
            number of dimensions and dtypes on every rank (the other sizes may differ). A
            tensor without dimension `dim`, or a nested tensor (with a warning), is returned as
            it is.
        dim: the dimension to pad (negative counts from the end).
        pad_index: the value the new entries hold.
        pad_first: put the padding before the data instead of after it.

    Returns:
        The same structure; tensors already as long as the longest are returned as they are,
        the others as new, padded tensors.

    Raises:
        DistributedOperationException: on every rank, when the ranks' structures, numbers of
            dimensions or dtypes disagree.
    """
    return ops.pad_across_processes(_comm(), tensor, dim, pad_index, pad_first)


# -- Accelerate's helpers for nested structures ---------------------------------------------------


def find_batch_size(data: Any) -> int:
    """Not collective. The first dimension of the first tensor in `data`.

    Args:
        data: a tensor, or nested lists, tuples and dicts of tensors (a dict's first value,
            a sequence's first item, down to a tensor).

    Raises:
        ValueError: on an empty list, tuple or dict on the way.
        TypeError: when the first leaf is not a tensor.
    """
    if isinstance(data, (tuple, list, Mapping)):
        if len(data) == 0:
            raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
        first = next(iter(data.values())) if isinstance(data, Mapping) else data[0]
        return find_batch_size(first)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, got {type(data).__name__}")
    return data.shape[0]


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Not collective. One structure of tensors out of a list of equally nested ones, each
    tensor the torch.cat of the tensors at its place.

    Args:
        data: a non-empty list of tensors, or of equally nested lists, tuples and dicts of them.
        dim: the dimension to concatenate along.

    Raises:
        TypeError: when a leaf is not a tensor.
    """
    first = data[0]
    if isinstance(first, (tuple, list)):
        parts = (concatenate([d[i] for d in data], dim) for i in range(len(first)))
        return honor_type(first, parts)
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})  # type: ignore[call-arg]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"can only concatenate tensors, got {type(first).__name__}")
    return torch.cat(data, dim=dim)


# -- Accelerate's local (not collective) helpers of accelerate.utils.operations -------------------


@dataclass
class TensorInformation:
    """A tensor's shape and dtype, without its data (see get_data_structure)."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    """Not collective. Whether `tensor_info` is a TensorInformation.

    Args:
        tensor_info: any object.
    """
    return isinstance(tensor_info, TensorInformation)


def get_data_structure(data: Any) -> Any:
    """Not collective. `data` with each tensor replaced by its TensorInformation (its shape
    and dtype, without the values).

    Args:
        data: a tensor, or nested lists, tuples and dicts of tensors; other leaves are kept.
    """
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Not collective. The inverse of get_data_structure: each TensorInformation replaced by an
    uninitialised CPU tensor (torch.empty) of that shape and dtype.

    Args:
        data_structure: what get_data_structure returned (other leaves are kept).
    """
    return recursively_apply(
        lambda info: torch.empty(tuple(info.shape), dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None,
    num_processes: int | None = None,
) -> Any:
    """Not collective. `data` with each tensor indexed by `tensor_slice`.

    Args:
        data: a tensor, or nested lists, tuples and dicts of tensors; other leaves are kept.
        tensor_slice: the index, as in `tensor[tensor_slice]` (a slice, an int, a tuple).
        process_index: accepted, as Accelerate's is, and unused.
        num_processes: accepted, as Accelerate's is, and unused.
    """
    del process_index, num_processes
    return recursively_apply(lambda t: t[tensor_slice], data)


def ignorant_find_batch_size(data: Any) -> int | None:
    """Not collective. find_batch_size(data), or None where that finds no tensor (or meets an
    empty container) instead of raising.

    Args:
        data: a tensor, or nested lists, tuples and dicts of tensors.
    """
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data: Any) -> Any:
    """Not collective. `data` with each tensor replaced by `tensor.tolist()` (nested lists of
    Python numbers), taken on the CPU; bfloat16 goes through float32.

    Args:
        data: a tensor, or nested lists, tuples and dicts of tensors; other leaves are kept.
    """

    def as_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.tolist()

    return recursively_apply(as_list, data)


def convert_outputs_to_fp32(model_forward: Any) -> Any:
    """Not collective. `model_forward` wrapped so that its outputs go through convert_to_fp32
    (float16 and bfloat16 tensors become float32).

    Args:
        model_forward: a callable, usually a model's forward. It stays the result's
            `__wrapped__`, for code that unwraps decorated forwards.
    """

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Not collective. Each tensor of `tensor` grown along `dim` to the next multiple of
    `num_processes` above `batch_size`, the new entries zeros, so that the batch splits evenly
    between the processes; a size that divides already is kept.

    Args:
        tensor: a tensor, or nested lists, tuples and dicts of tensors.
        batch_size: the batch size the tensors have along `dim`.
        num_processes: the number of processes the batch is split between.
        dim: the dimension to grow.

    Raises:
        TypeError: when a leaf is not a tensor.
    """
    target = -(-batch_size // num_processes) * num_processes

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[dim] >= target:
            return t
        shape = list(t.shape)
        shape[dim] = target
        out = t.new_zeros(shape)
        out.narrow(dim, 0, t.shape[dim]).copy_(t)
        return out

    return recursively_apply(pad, tensor, error_on_other_type=True)


def find_device(data: Any) -> torch.device | None:
    """Not collective. The device of the first tensor in `data` (depth first), None if it
    holds none.

    Args:
        data: a tensor, or nested lists, tuples and dicts that may hold tensors.
    """
    if isinstance(data, torch.Tensor):
        return data.device
    children = data.values() if isinstance(data, Mapping) else data
    if isinstance(data, (Mapping, list, tuple)):
        for child in children:
            device = find_device(child)
            if device is not None:
                return device
    return None
