"""mpaccel.comm: the control plane's collectives and agreements. Every test body here runs at
size 1 (plain pytest, NullComm) and under mpiexec -n 2 / -n 4 (MPIComm) through the mpaccel
pytest plugin."""

from __future__ import annotations

import pytest

from mpaccel import CollectiveError
from mpaccel.comm import agreement

pytestmark = pytest.mark.openmpi


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


class _Refused(CollectiveError):
    """A caller's own kind of collective error (as checkpoint's CheckpointCollectiveError)."""


def test_agreement_raises_the_same_error_on_every_rank(state, comm):
    last = comm.size - 1
    cleaned = []
    with pytest.raises(_Refused) as info:
        with agreement(state.comm, "unit step", kind=_Refused, cleanup=lambda: cleaned.append(1)):
            if comm.rank == last:
                raise OSError(f"disk full on {comm.rank}")
    assert info.value.failed_ranks == [last]
    assert f"OSError: disk full on {last}" in str(info.value)
    assert isinstance(info.value.__cause__, OSError) == (comm.rank == last)
    assert cleaned == [1]  # on every rank, the ones that did not fail too
    state.wait_for_everyone()  # still in step afterwards


def test_agreement_that_passes_runs_no_cleanup(state, comm):
    cleaned = []
    with agreement(state.comm, "unit step", cleanup=lambda: cleaned.append(1)):
        value = comm.rank
    assert value == comm.rank and cleaned == []


def test_agreement_reports_the_wrapped_error(state, comm):
    def wrap(exc: Exception) -> BaseException:
        return ValueError(f"could not write 'shard-{comm.rank}.h5': {exc}")

    with pytest.raises(CollectiveError) as info:
        with agreement(state.comm, "unit step", wrap=wrap):
            if comm.rank == 0:
                raise OSError("no space left")
    assert info.value.failed_ranks == [0]
    failure = info.value.failures[0]
    assert (failure.exc_type, failure.message) == (
        "ValueError", "could not write 'shard-0.h5': no space left"
    )


def test_agreement_leaves_other_exceptions_alone(state, comm):
    # Raised on every rank alike (else the others would wait in the agreement for this one).
    with pytest.raises(KeyError):
        with agreement(state.comm, "unit step", catch=(OSError,)):
            raise KeyError("not agreed")
    state.wait_for_everyone()


def test_agreement_lets_an_agreed_error_pass_without_a_second_agreement(state, comm):
    with pytest.raises(CollectiveError) as info:
        with agreement(state.comm, "outer", passing=(CollectiveError,)):
            with agreement(state.comm, "inner"):
                if comm.rank == 0:
                    raise RuntimeError("inner failure")
    assert info.value.operation == "inner"
    state.wait_for_everyone()  # no rank is left waiting in an "outer" agreement


def test_gather_brings_every_object_to_the_root_only(state, comm):
    c = state.comm
    for root in sorted({0, comm.size - 1}):
        mine = {"r": comm.rank, "rows": list(range(comm.rank * 1000))}
        got = c.gather(mine, root=root, what="unit gather")
        if comm.rank == root:
            assert got == [{"r": r, "rows": list(range(r * 1000))} for r in range(comm.size)]
            assert got[root] is mine  # the root's own object, not a copy
        else:
            assert got is None
    assert c.gather(None) == ([None] * comm.size if comm.rank == 0 else None)
    with pytest.raises(ValueError, match="out of range"):
        c.gather(1, root=comm.size)
    c.barrier()  # still in step afterwards


@pytest.mark.mpi(min_size=2)
def test_gather_timeout_names_the_missing_rank(state, comm):
    import time

    from mpaccel import CollectiveTimeoutError

    late = comm.size - 1
    if comm.rank == late:
        time.sleep(2.5)  # past the others' deadline; the plugin resyncs the communicator
        return
    with pytest.raises(CollectiveTimeoutError) as info:
        state.comm.gather(comm.rank, what="unit gather", timeout=1.0)
    assert info.value.missing == [late]
    assert f"rank(s) {late} (" in str(info.value) and "HINT" in str(info.value)
