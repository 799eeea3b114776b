"""Device choice: the rules on synthetic GPU layouts, and the collective check that no two ranks
of a node drive one GPU (GPU identities faked: these machines have no GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from mpaccel import PartialState, device
from mpaccel.errors import LaunchError
from mpaccel.testing import reset_state

# Also run under Open MPI's mpiexec (docs/testing.md, "Which stage runs what").
pytestmark = pytest.mark.openmpi


@pytest.mark.parametrize(
    "cpu, cuda, count, local_index, local_size, expected",
    [
        (False, False, 0, 0, 4, "cpu"),  # no CUDA
        (True, True, 4, 2, 4, "cpu"),  # cpu=True forces the CPU
        (False, True, 0, 0, 1, "cpu"),  # CUDA built in, no device visible
        (False, True, 4, 2, 4, "cuda:2"),  # mpirun: every rank sees the node's 4 GPUs
        (False, True, 8, 3, 4, "cuda:3"),  # more GPUs than ranks
        (False, True, 1, 0, 1, "cuda:0"),  # one rank, one GPU
        (False, True, 1, 3, 4, "cuda:0"),  # srun --gpus-per-task=1: each task sees its own
        (False, True, 2, 1, 4, "cuda:0"),  # --gpus-per-task=2: the first of its own two
    ],
)
def test_select_device(cpu, cuda, count, local_index, local_size, expected):
    assert device.select_device(cpu, cuda, count, local_index, local_size) == expected


def test_shared_gpus_are_found_per_host():
    rows = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"), ("n2", "GPU-a"), ("n1", None)]
    assert device.shared_gpus(rows) == {("n2", "GPU-a"): [2, 3]}
    error = device.sharing_error(device.shared_gpus(rows))
    assert "ranks [2, 3] on 'n2' all use the same GPU (GPU-a)" in str(error)
    assert "--gpus-per-task=1" in error.hint


@pytest.mark.parametrize("shared", [False, True])
def test_gpu_sharing_is_a_collective_launch_error(comm, monkeypatch, shared):
    rank = comm.Get_rank()
    monkeypatch.setattr(device, "gpu_uuid", lambda _: "GPU-one" if shared else f"GPU-{rank}")
    fake_gpu = types.SimpleNamespace(type="cuda")
    state = PartialState()
    if shared and comm.Get_size() > 1:
        with pytest.raises(LaunchError) as info:
            device.check_gpus_not_shared(state.comm, "node0", fake_gpu)
        assert f"ranks {list(range(comm.Get_size()))} on 'node0'" in str(info.value)
    else:
        device.check_gpus_not_shared(state.comm, "node0", fake_gpu)


def test_a_failed_first_state_leaves_nothing_half_built(comm, monkeypatch):
    reset_state()

    def no_gpu_here(*args):
        raise LaunchError("no GPU for this rank", "a hint")

    monkeypatch.setattr("mpaccel.state.current_device", no_gpu_here)
    with pytest.raises(LaunchError):
        PartialState()
    assert not PartialState._shared_state  # not initialised, so the next try starts over
    monkeypatch.undo()
    assert PartialState().device == torch.device("cpu")
