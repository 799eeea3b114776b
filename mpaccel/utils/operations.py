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
    return ops.gather(_comm(), tensor)


def gather_object(object: Any) -> list[Any]:  # Accelerate names it `object`
    return ops.gather_object(_comm(), object)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    # "mean" by default, as accelerate.utils.reduce (Accelerator.reduce's default is "sum").
    return ops.reduce(_comm(), tensor, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    return ops.broadcast(_comm(), tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Rank `from_process`'s list, in place, on every rank (over MPI); see ops."""
    return ops.broadcast_object_list(_comm(), object_list, from_process)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor one rank passes (the others pass None) on every rank's device; see ops."""
    from ..state import PartialState

    return ops.copy_tensor_to_devices(_comm(), tensor, PartialState().device)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    return ops.pad_across_processes(_comm(), tensor, dim, pad_index, pad_first)


# -- Accelerate's helpers for nested structures ---------------------------------------------------


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in `data` (nested lists, tuples, dicts)."""
    if isinstance(data, (tuple, list, Mapping)):
        if len(data) == 0:
            raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
        first = next(iter(data.values())) if isinstance(data, Mapping) else data[0]
        return find_batch_size(first)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, got {type(data).__name__}")
    return data.shape[0]


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """A list of equally nested structures of tensors -> one structure of the tensors
    concatenated along `dim` (torch.cat). Not collective."""
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
    return isinstance(tensor_info, TensorInformation)


def get_data_structure(data: Any) -> Any:
    """`data` with each tensor replaced by its TensorInformation (shape, dtype)."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """The inverse of get_data_structure: each TensorInformation replaced by an uninitialised
    CPU tensor (torch.empty) of that shape and dtype."""
    return recursively_apply(
        lambda info: torch.empty(tuple(info.shape), dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None,
    num_processes: int | None = None,
) -> Any:
    """`data` with each tensor indexed by `tensor_slice` (`tensor[tensor_slice]`).
    `process_index` and `num_processes` are accepted, as Accelerate does, and unused."""
    del process_index, num_processes
    return recursively_apply(lambda t: t[tensor_slice], data)


def ignorant_find_batch_size(data: Any) -> int | None:
    """find_batch_size(data), or None where it finds no tensor (or an empty container)."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data: Any) -> Any:
    """`data` with each tensor replaced by `tensor.tolist()` (nested lists of Python numbers),
    taken on the CPU; bfloat16 goes through float32, which numpy cannot do without."""

    def as_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.tolist()

    return recursively_apply(as_list, data)


def convert_outputs_to_fp32(model_forward: Any) -> Any:
    """`model_forward` whose outputs go through convert_to_fp32. The original is the result's
    `__wrapped__`, for code that unwraps decorated forwards."""

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Each tensor of `tensor` grown along `dim` from `batch_size` to the next multiple of
    `num_processes` (a size that already divides is kept), the new rows zeros, so that the
    batch splits evenly between the processes. Not collective."""
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
    """The device of the first tensor found in `data` (depth first), None if it holds none."""
    if isinstance(data, torch.Tensor):
        return data.device
    children = data.values() if isinstance(data, Mapping) else data
    if isinstance(data, (Mapping, list, tuple)):
        for child in children:
            device = find_device(child)
            if device is not None:
                return device
    return None
