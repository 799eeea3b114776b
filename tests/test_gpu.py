"""What only a GPU machine can show: each rank on the GPU of its local rank, the NCCL process
group (bound to that GPU, with mpaccel's deadline, its watchdog ending a stuck job), bf16/fp16
autocast and the GradScaler, FSDP2 on CUDA, a checkpoint round trip of a CUDA model (tensors,
optimizer state and CUDA RNG states), gather/reduce of CUDA tensors, and `mpaccel env`.

Every test is marked `cuda`: where torch sees no GPU it is collected and skipped with the reason
(tests/conftest.py). `make test-gpu` runs them at size 1 and under `mpiexec -n <GPUs>`, one GPU
per local rank (docs/testing.md, "The GPU stage"). The same bodies run at every size."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mpaccel import PartialState, distributed
from mpaccel.testing import reset_state
from mpaccel.utils import (
    InitProcessGroupKwargs,
)

pytestmark = pytest.mark.cuda


def _gpu_of(state: PartialState) -> torch.device:
    """The GPU this rank must drive: its local rank's where it sees every GPU of the node (as
    under mpiexec), else the first it sees (Slurm's --gpus-per-task gives each its own)."""
    index = state.local_process_index
    return torch.device("cuda", index if state.local_num_processes <= torch.cuda.device_count()
                        else 0)


@pytest.fixture
def own_process_group():
    """No default process group before the test (PartialState() makes a new one) nor after."""
    reset_state()
    distributed.destroy_process_group()
    yield
    reset_state()
    distributed.destroy_process_group()


@pytest.mark.mpi(min_size=2)  # a job of one has no process group
@pytest.mark.parametrize(
    "handler, variable, seconds",
    [(None, None, 1800.0), (None, "123", 123.0), (77.0, "123", 77.0)],
    ids=["default", "MPACCEL_TIMEOUT", "InitProcessGroupKwargs"],
)
def test_nccl_group_is_bound_to_the_gpu_with_mpaccels_deadline(
    comm, monkeypatch, own_process_group, handler, variable, seconds
):
    if variable is None:
        monkeypatch.delenv("MPACCEL_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("MPACCEL_TIMEOUT", variable)
    given = None if handler is None else timedelta(seconds=handler)
    state = PartialState(**InitProcessGroupKwargs(timeout=given).to_kwargs())  # as Accelerator
    assert state.backend == "nccl" and dist.get_backend() == "nccl"
    assert state.default_timeout == seconds
    world = dist.group.WORLD
    assert world.bound_device_id == state.device == _gpu_of(state)  # device_id= given
    # NCCL's own default would be 10 min: the watchdog must wait as long as mpaccel does
    assert world._get_backend(state.device).options._timeout == timedelta(seconds=seconds)
    ranks = torch.full((1,), float(state.process_index + 1), device=state.device)
    dist.all_reduce(ranks)
    assert ranks.item() == comm.size * (comm.size + 1) / 2
