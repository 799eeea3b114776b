"""Which torch device a process uses: one GPU per local rank when CUDA is present, else the CPU;
putting things on it, and giving back the memory its allocator caches."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch

from . import tree
from .errors import LaunchError

_HINT = (
    "start one process per GPU (`srun --ntasks-per-node=<GPUs>`, `mpiexec -n <GPUs>`), or give "
    "each task a GPU of its own (`--gpus-per-task=1 --gpu-bind=single:1`), or pass cpu=True."
)


def select_device(
    cpu: bool,
    cuda_available: bool,
    device_count: int,
    local_process_index: int,
    local_num_processes: int,
) -> str:
    """The device string for this process.

    When a task sees at least as many GPUs as there are processes on its node (every rank sees
    the node's GPUs, as under mpirun), the local rank picks its own; when it sees fewer (Slurm's
    --gpus-per-task / --gpu-bind, or a CUDA_VISIBLE_DEVICES per rank), its GPUs are taken to be
    its own and it uses the first. `check_gpus_not_shared` then verifies that, collectively.
    """
    if cpu or not cuda_available or device_count == 0:
        return "cpu"
    if local_num_processes <= device_count:
        return f"cuda:{local_process_index}"
    return "cuda:0"


def shared_gpus(rows: Sequence[tuple[str, str | None]]) -> dict[tuple[str, str], list[int]]:
    """Given (hostname, GPU UUID) per rank, the GPUs that more than one rank uses."""
    users: dict[tuple[str, str], list[int]] = {}
    for rank, (host, uuid) in enumerate(rows):
        if uuid is not None:
            users.setdefault((host, uuid), []).append(rank)
    return {gpu: ranks for gpu, ranks in users.items() if len(ranks) > 1}


def sharing_error(shared: dict[tuple[str, str], list[int]]) -> LaunchError:
    (host, uuid), ranks = next(iter(shared.items()))
    return LaunchError(
        f"ranks {ranks} on {host!r} all use the same GPU ({uuid}); NCCL cannot run two ranks "
        f"on one GPU" + (f" ({len(shared)} GPUs are shared in all)" if len(shared) > 1 else ""),
        _HINT,
    )


def gpu_uuid(device: Any) -> str | None:
    """The physical identity of a CUDA device (None where torch cannot tell)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else None


def current_device(cpu: bool, local_process_index: int, local_num_processes: int):
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    name = select_device(cpu, available, count, local_process_index, local_num_processes)
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def check_gpus_not_shared(comm: Any, hostname: str, device: Any) -> None:
    """Collective: raise the same LaunchError on every rank when two ranks of a node would
    drive one physical GPU (e.g. four unbound tasks on a node where each sees one GPU)."""
    uuid = gpu_uuid(device) if device.type == "cuda" else None
    rows = comm.allgather((hostname, uuid), what="checking that no two ranks share a GPU")
    shared = shared_gpus(rows)
    if shared:
        raise sharing_error(shared)


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> Any:
    """Not collective. `tensor` on `device`, nested structures rebuilt with the same types;
    the values of mappings under `skip_keys` stay where they are, and anything without a `.to`
    method is returned as it is.

    Args:
        tensor: a tensor, or anything with a `.to` method (a tokenizer's BatchEncoding, a
            module), or lists, tuples, named tuples and mappings of those.
        device: where to move it (a torch.device, "cuda:0", or a device index).
        non_blocking: passed to `.to` (a `.to` that does not take it is called without).
        skip_keys: a mapping key, or keys, whose values stay where they are.
    """

    def movable(value: Any) -> bool:
        return isinstance(value, torch.Tensor) or hasattr(value, "to")

    def move(value: Any) -> Any:
        if not movable(value):
            return value
        try:
            return value.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() without non_blocking
            return value.to(device)

    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
    return tree.map(move, tensor, is_leaf=movable, skip_keys=skip)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return the memory torch's allocator caches on this machine's accelerator (CUDA, XPU,
    MPS); `garbage_collection`: run gc.collect() first (slow)."""
    if garbage_collection:
        gc.collect()
    for name in ("cuda", "xpu", "mps"):
        module = getattr(torch, name, None)
        available = getattr(module, "is_available", None)
        if module is not None and available is not None and available():
            module.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Not collective. As many Nones as `objects`, returned after a garbage collection and
    emptying the device cache: `a, b = release_memory(a, b)`.

    Args:
        *objects: the objects to let go of (the caller's names must be rebound to the result).
    """
    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released
