"""The pytest plugin, exercised on throw-away test files under a real mpiexec -n 2 and -n 4."""

from __future__ import annotations

import re
import textwrap

import pytest

from mpaccel.testing import run_mpi

pytestmark = pytest.mark.mpi(size=1)


def _run_pytest(tmp_path, body: str, n: int, *args: str, timeout: float = 180):
    test_file = tmp_path / "test_throwaway.py"
    test_file.write_text(textwrap.dedent(body))
    return run_mpi(
        ["-m", "pytest", "-p", "no:cacheprovider", str(test_file), *args],
        n=n,
        timeout=timeout,
        cwd=tmp_path,
    )


def _summary(text: str) -> str:
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("n", [2, 4])
def test_all_pass_one_report(tmp_path, n):
    run = _run_pytest(
        tmp_path,
        """
        def test_a(comm):
            assert comm.size > 1
        def test_b(state):
            state.wait_for_everyone()
    """,
        n,
    )
    assert run.returncode == 0, run.describe()
    assert "2 passed" in _summary(run.stdout[0])
    assert all(out.strip() == "" for out in run.stdout[1:]), run.describe()


@pytest.mark.parametrize("n", [2, 4])
def test_failure_on_one_rank_fails_everywhere(tmp_path, n):
    run = _run_pytest(
        tmp_path,
        """
        def test_disagree(comm):
            assert comm.rank != 1, "rank one says no"
        def test_fails_before_a_barrier(state):
            if state.process_index == 1:
                raise ValueError("left early")
            state.wait_for_everyone()
        def test_still_works_after(state):
            state.wait_for_everyone()
    """,
        n,
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncode == 1, run.describe()
    assert run.returncodes == (1,) * n, run.describe()  # the same exit code on every rank
    out = run.stdout[0]
    assert "2 failed, 1 passed" in _summary(out), run.describe()
    assert "call failed on rank(s) [1] of" in out
    assert "[rank 1] E       AssertionError: rank one says no" in out
    assert "[rank 1] E           ValueError: left early" in out
    assert "gave up waiting for them in a collective" in out
    assert run.elapsed < 90


@pytest.mark.parametrize("n", [2, 4])
def test_deadlock_hits_the_timeout_and_ends_the_job(tmp_path, n):
    run = _run_pytest(
        tmp_path,
        """
        import time
        from mpi4py import MPI
        def test_hangs(comm):
            if comm.rank == 0:
                time.sleep(3600)
            comm.Barrier()
    """,
        n,
        "--mpi-timeout=5",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncode != 0
    err = "".join(run.stderr)
    assert "TIMEOUT: test_throwaway.py::test_hangs did not finish within 5 s" in err
    assert "(phase: test body)" in err  # every rank is stuck inside the test, not between
    assert all(f"[mpaccel-pytest rank {r}/{n}]" in err for r in range(n))
    assert "time.sleep(3600)" in err  # rank 0's stack shows where it is stuck
    assert run.elapsed < 60


def test_size_markers_and_shared_tmp_path(tmp_path):
    run = _run_pytest(
        tmp_path,
        """
        import pytest
        @pytest.mark.mpi(min_size=8)
        def test_too_big():
            raise AssertionError("must not run")
        @pytest.mark.mpi(size=2)
        def test_exactly_two(comm):
            assert comm.size == 2
        @pytest.mark.mpi(max_size=1)
        def test_serial_only():
            raise AssertionError("must not run")
        def test_shared(mpi_tmp_path, comm):
            (mpi_tmp_path / f"rank{comm.rank}").write_text("x")
            comm.Barrier()
            assert sorted(p.name for p in mpi_tmp_path.iterdir()) == ["rank0", "rank1"]
        def test_private(tmp_path, comm):
            paths = comm.allgather(str(tmp_path))
            assert len(set(paths)) == comm.size
    """,
        2,
        "-rs",
    )
    assert run.returncode == 0, run.describe()
    summary = _summary(run.stdout[0])
    assert "3 passed" in summary and "2 skipped" in summary
    assert "needs at least 8 MPI processes, running with 2" in run.stdout[0]


def test_collection_mismatch_is_an_error_not_a_hang(tmp_path):
    run = _run_pytest(
        tmp_path,
        """
        import pytest
        from mpi4py import MPI
        @pytest.mark.parametrize("x", range(2 + MPI.COMM_WORLD.rank))
        def test_depends_on_rank(x):
            pass
    """,
        2,
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncode == 4, run.describe()  # pytest's usage error, on every rank
    text = run.stdout[0] + run.stderr[0]
    assert "ranks collected different tests" in text
    assert "rank 1: 3 tests vs rank 0's 2" in text


def test_exit_first_and_keyword_selection(tmp_path):
    run = _run_pytest(
        tmp_path,
        """
        def test_one(comm):
            assert comm.rank == 0
        def test_two():
            pass
        def test_three():
            pass
    """,
        2,
        "-x",
    )
    assert run.returncode == 1
    assert "1 failed" in _summary(run.stdout[0]) and "passed" not in _summary(run.stdout[0])
    run = _run_pytest(
        tmp_path, "def test_one():\n    pass\ndef test_two():\n    pass\n", 2, "-k", "two", "-q"
    )
    assert run.returncode == 0
    assert "1 passed, 1 deselected" in _summary(run.stdout[0])


def test_no_tests_exit_code_is_uniform(tmp_path):
    run = _run_pytest(tmp_path, "x = 1\n", 2)
    assert run.returncode == 5, run.describe()


def test_last_failed_reruns_only_the_failure(tmp_path):
    body = textwrap.dedent("""
        def test_ok():
            pass
        def test_bad(comm):
            assert comm.rank != 1
    """)
    (tmp_path / "test_lf.py").write_text(body)
    first = run_mpi(["-m", "pytest", "test_lf.py"], n=2, timeout=180, cwd=tmp_path)
    assert first.returncode == 1 and "1 failed, 1 passed" in _summary(first.stdout[0])
    again = run_mpi(["-m", "pytest", "--lf", "test_lf.py"], n=2, timeout=180, cwd=tmp_path)
    assert again.returncode == 1, again.describe()
    assert "1 failed, 1 deselected" in _summary(again.stdout[0]), again.describe()
