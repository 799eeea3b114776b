"""Every test starts, and leaves, with no mpaccel shared state (discovery is kept); the helpers
tests share: `accelerator(**kwargs)` and `params(model)` (`from tests.conftest import ...`).

Markers (pyproject.toml) decide which CI stage runs a test: docs/testing.md, "Which stage runs
what"."""

from __future__ import annotations

import os

import pytest
import torch

from mpaccel import Accelerator
from mpaccel.testing import reset_state

# What pytest-xdist adds to a worker's environment (its id, the number of workers, the run's id).
_XDIST_VARIABLES = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


def pytest_configure(config):
    # The jobs a test starts (mpiexec, srun, sbatch) get the environment of a plain `pytest`
    # run, however many workers run the tests: the environment's size alone once decided
    # whether MPI_Init hit the MPICH/Slurm pmi2 bug (docs/slurm.md,
    # tests/environments/test_slurm.py).
    for name in _XDIST_VARIABLES:
        os.environ.pop(name, None)


def accelerator(**kwargs) -> Accelerator:
    """`Accelerator(**kwargs)` on fresh shared state: a test that builds a second one (another
    set-up, a "restarted" job) starts it as a new job would, not from the first one's state.
    (mpaccel's pytest plugin has an `accelerator` fixture too: one `Accelerator()` per test.)"""
    reset_state()
    return Accelerator(**kwargs)


def params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of `model`, detached and flattened into one tensor: two models trained
    alike compare with one torch.equal / assert_close."""
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _why_no_cuda() -> str | None:
    """Why the `cuda` tests cannot run in this process (None where they can)."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (
            f"needs CUDA: torch {torch.__version__} is a CPU build (`make test-gpu` on a GPU "
            "machine, with a CUDA build of torch within setup.cfg's range, runs it)"
        )
    return (
        f"needs CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
        "(none here, or CUDA_VISIBLE_DEVICES hides them)"
    )


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda"):
        reason = _why_no_cuda()
        if reason is not None:
            pytest.skip(reason)
    # Each worker would start the one Slurm cluster for its share of these tests, and stop it
    # under the others' running jobs (seen: jobs CANCELLED, steps Terminated).
    workers = getattr(item.config, "workerinput", {}).get("workercount", 1)
    if workers > 1 and item.get_closest_marker("slurm"):
        pytest.fail(
            f"the Slurm tests share one cluster and cannot be spread over {workers} pytest-xdist "
            "workers: run them in one process, `python -m pytest -m slurm tests` (and the others "
            'with `-n N -m "not slurm"`), as scripts/test-matrix.sh does',
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _fresh_mpaccel_state():
    reset_state()
    yield
    reset_state()


@pytest.fixture
def no_group_left_behind():
    """At size 1 an FSDP plugin makes a torch.distributed group of one in this process; tests
    that run after it in the same pytest process expect none (a plain python job has none):
    take down a group the test made."""
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    yield
    if not had and dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()


@pytest.fixture
def group():
    """mpaccel's communicator, with a default torch.distributed group for fully_shard (at size 1
    mpaccel makes none: a gloo group of one is made here, and removed after the test)."""
    import torch.distributed as dist

    from mpaccel import PartialState

    state = PartialState()
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield state.comm
    if made:
        dist.destroy_process_group()
