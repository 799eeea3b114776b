"""The plugin's fixtures (`comm`, `state`, `accelerator`, `mpi_tmp_path`) and `reset_state`: the
same in a plain run (a world of one) and under MPI."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .session import session_of


@pytest.fixture(scope="session")
def comm() -> Any:
    """The mpi4py COMM_WORLD of the run (a world of one in a plain pytest run)."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        pytest.skip(f"mpi4py cannot load an MPI library: {exc}")
    return MPI.COMM_WORLD


def reset_state() -> None:
    """Forget mpaccel's shared state (PartialState, AcceleratorState, GradientState) so the next
    Accelerator() starts afresh; discovery and the process group are kept. Not collective."""
    from ..state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def state() -> Iterator[Any]:
    """A fresh mpaccel PartialState (shared state reset before and after the test)."""
    from ..state import PartialState

    reset_state()
    yield PartialState()
    reset_state()


@pytest.fixture
def accelerator() -> Iterator[Any]:
    """A fresh mpaccel Accelerator (shared state reset before and after the test)."""
    from ..accelerator import Accelerator

    reset_state()
    yield Accelerator()
    reset_state()


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@pytest.fixture
def mpi_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A new, empty directory that is the same on every rank (created by rank 0 before anyone
    uses it), one per test as tmp_path is."""
    mpi = session_of(request.config)
    if mpi is None:
        return tmp_path
    # Named after the test: the end of its id, made safe for a file name, then a digest of the
    # whole id, so that ids differing only in unsafe characters, or only at their start, stay
    # apart. Every rank computes the same name: no broadcast, whose root (rank 0) would not wait.
    nodeid = request.node.nodeid
    digest = hashlib.sha1(nodeid.encode()).hexdigest()[:12]
    path = mpi.base / "shared" / f"{_UNSAFE.sub('_', nodeid)[-100:]}-{digest}"
    if mpi.rank == 0:
        if path.exists():  # the same test again in this session: fresh, as tmp_path is
            shutil.rmtree(path)
        path.mkdir(parents=True)
    # On mpaccel's communicator, not the plugin's: a rank that skipped or failed in an earlier
    # fixture never comes, and its alert makes this wait give up instead of hanging the test.
    mpi.job.comm.barrier("mpi_tmp_path")
    if not path.is_dir():
        raise FileNotFoundError(
            f"mpi_tmp_path: rank 0 created {str(path)!r}, which rank {mpi.rank} does not see: "
            f"{str(mpi.base)!r} is not on a filesystem that every node shares. HINT: run with "
            "--basetemp=DIR, DIR on a shared filesystem (mpi_tmp_path is then DIR/shared/...)"
        )
    return path
