"""Which torch device a process uses: one GPU per local rank when CUDA is present, else the CPU."""

from __future__ import annotations

from .errors import LaunchError


def select_device(
    cpu: bool,
    cuda_available: bool,
    device_count: int,
    local_process_index: int,
    local_num_processes: int,
) -> str:
    """The device string for this process.

    Each task seeing exactly one GPU (Slurm's --gpus-per-task / --gpu-bind=single:1, or a
    CUDA_VISIBLE_DEVICES per rank) means `cuda:0`; otherwise the local rank picks among the
    visible GPUs, which must be at least as many as the ranks on the node.
    """
    if cpu or not cuda_available or device_count == 0:
        return "cpu"
    if device_count == 1:
        return "cuda:0"
    if local_process_index < device_count and local_num_processes <= device_count:
        return f"cuda:{local_process_index}"
    raise LaunchError(
        f"{local_num_processes} processes on this node but only {device_count} visible GPU(s): "
        f"local process {local_process_index} has no GPU of its own",
        "start one process per GPU (`srun --ntasks-per-node=<GPUs>`, `mpiexec -n <GPUs>`), or "
        "give each task one GPU (`--gpus-per-task=1 --gpu-bind=single:1`), or pass cpu=True.",
    )


def current_device(cpu: bool, local_process_index: int, local_num_processes: int):
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    name = select_device(cpu, available, count, local_process_index, local_num_processes)
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
