"""mpaccel.comm: the control plane's collectives and agreements. Every test body here runs at
size 1 (plain pytest, NullComm) and under mpiexec -n 2 / -n 4 (MPIComm) through the mpaccel
pytest plugin."""

from __future__ import annotations

import pytest

from mpaccel import CollectiveError


def test_agree_names_every_failing_rank(state, comm):
    error = RuntimeError(f"bad {comm.rank}") if comm.rank % 2 else None
    if comm.size == 1:
        error = RuntimeError("bad 0")
    with pytest.raises(CollectiveError) as info:
        state.comm.agree(error, "unit agreement")
    expected = [r for r in range(comm.size) if r % 2] or [0]
    assert info.value.failed_ranks == expected
    assert all(f"bad {r}" in str(info.value) for r in expected)
    assert "[rank" in info.value.tracebacks()


@pytest.mark.parametrize("persistent", [True, False])
def test_comm_collectives(state, comm, monkeypatch, persistent):
    c = state.comm
    if comm.size > 1:
        from mpi4py import MPI

        if "MPICH" in MPI.Get_library_version():  # MPICH 4+ has persistent collectives
            assert set(c._persistent) == {"barrier", "max", "min", "sum"}
        if not persistent:  # an MPI-3 library: Ibarrier/Iallreduce
            monkeypatch.setattr(c, "_persistent", {})
    for _ in range(3):  # persistent requests are restarted, not rebuilt
        c.barrier()
    assert c.allreduce(comm.rank, "max") == comm.size - 1
    assert c.allreduce(comm.rank, "min") == 0
    assert c.allreduce(1, "sum") == comm.size
    assert c.allgather({"r": comm.rank}) == [{"r": r} for r in range(comm.size)]
    assert c.bcast("from root" if comm.rank == 0 else None) == "from root"
    assert c.bcast(comm.rank, root=comm.size - 1) == comm.size - 1
    with pytest.raises(ValueError, match="unknown reduction"):
        c.allreduce(1, "prod")
    with pytest.raises(ValueError, match="out of range"):
        c.bcast(1, root=comm.size)
