"""The pytest plugin, exercised on throw-away test files under a real mpiexec -n 2 and -n 4."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpaccel import envvars
from mpaccel.testing import run_mpi

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]


def _run_pytest(tmp_path, body: str, n: int, *args: str, timeout: float = 180, env=None):
    test_file = tmp_path / "test_throwaway.py"
    test_file.write_text(textwrap.dedent(body))
    # A session that fails keeps its ranks' temporary files (and says where) for the user to
    # look at: in the test's own directory, which pytest prunes, not in the machine's /tmp.
    return run_mpi(
        ["-m", "pytest", "-p", "no:cacheprovider", str(test_file), *args],
        n=n,
        timeout=timeout,
        cwd=tmp_path,
        env={"TMPDIR": str(tmp_path), **(env or {})},
    )


def _summary(text: str) -> str:
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    return lines[-1] if lines else ""


def test_a_session_under_mpiexec_imports_no_torch_of_its_own(tmp_path):
    # The plugin discovers the job at configure time; that took state.py, and torch with it
    # (1.0-1.4 s of CPU per rank, 3.5x the whole cost of a 2-rank session of one test).
    run = _run_pytest(
        tmp_path,
        """
        import sys
        def test_no_torch(comm):
            assert comm.size == 2
            assert "torch" not in sys.modules, "the session imported torch"
    """,
        2,
    )
    assert run.returncode == 0 and "1 passed" in _summary(run.stdout[0]), run.describe()


def test_all_pass_one_report(tmp_path):
    # At 2 processes: CI's mpich-n4 and openmpi-n4 stages are the same at 4, over the suite
    # (a 4-rank session here cost 13.6 s of CPU to show it again).
    n = 2
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
        # 10 s: the deadline also bounds the session's start, which took 4 ranks on 2 busy
        # cores more than 5 s once in CI ("TIMEOUT: starting the session")
        "--mpi-timeout=10",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncode != 0
    err = "".join(run.stderr)
    assert "TIMEOUT: test_throwaway.py::test_hangs did not finish within 10 s" in err
    assert "(phase: test body)" in err  # every rank is stuck inside the test, not between
    assert all(f"[mpaccel-pytest rank {r}/{n}]" in err for r in range(n))
    # once each: MPICH's MPI_Abort returns when called from the watchdog's thread
    assert all(err.count(f"[mpaccel-pytest rank {r}/{n}] TIMEOUT") == 1 for r in range(n)), err
    assert "time.sleep(3600)" in err  # rank 0's stack shows where it is stuck
    assert run.elapsed < 60


def test_a_hang_while_collecting_hits_the_timeout_and_ends_the_job(tmp_path):
    """A test module that never finishes importing on one rank: the others wait for it in the
    collection check; the run's deadline ends the job with every rank's stack."""
    run = _run_pytest(
        tmp_path,
        """
        import time
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 1:
            time.sleep(3600)
        def test_a():
            pass
    """,
        2,
        "--mpi-timeout=5",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncode != 0
    err = "".join(run.stderr)
    assert "TIMEOUT: collecting the tests did not finish within 5 s" in err, err
    assert "[mpaccel-pytest rank 1/2] TIMEOUT" in err and "time.sleep(3600)" in err
    assert "(phase: collection check (waiting for the other ranks))" in err  # rank 0
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
    assert "parametrisation" in text  # the hint for a rank-dependent collection
    assert "ranks collected different tests" not in run.stdout[1] + run.stderr[1]  # said once


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
    tmp = {"TMPDIR": str(tmp_path)}  # where the failing sessions keep their temporary files
    first = run_mpi(["-m", "pytest", "test_lf.py"], n=2, timeout=180, cwd=tmp_path, env=tmp)
    assert first.returncode == 1 and "1 failed, 1 passed" in _summary(first.stdout[0])
    again = run_mpi(["-m", "pytest", "--lf", "test_lf.py"], n=2, timeout=180, cwd=tmp_path,
                    env=tmp)
    assert again.returncode == 1, again.describe()
    assert "1 failed, 1 deselected" in _summary(again.stdout[0]), again.describe()


def test_skipped_on_one_rank_in_setup_the_body_does_not_run_there(tmp_path):
    run = _run_pytest(
        tmp_path,
        """
        import pytest
        from mpi4py import MPI
        from mpaccel import PartialState
        RANK = MPI.COMM_WORLD.Get_rank()

        @pytest.mark.skipif(RANK == 1, reason="not on rank 1")
        def test_marker_skip():
            assert RANK != 1, "the body ran on rank 1"

        @pytest.fixture
        def rank0_only():
            if RANK != 0:
                pytest.skip("only rank 0 has it")
            return 5

        def test_fixture_skip(rank0_only):
            assert rank0_only == 5

        @pytest.mark.skipif(RANK == 1, reason="not on rank 1")
        def test_fixture_waits_for_the_skipped_rank(state):
            pass

        def test_body_waits_for_the_skipped_rank(rank0_only):
            PartialState().wait_for_everyone()

        def test_still_works_after(state):
            state.wait_for_everyone()
    """,
        2,
        "--mpi-timeout=30",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncode == 1, run.describe()
    out = run.stdout[0]
    assert "1 failed, 3 passed, 1 error" in _summary(out), run.describe()
    # where it was skipped, in the default output (not only with -rP)
    note = "test_marker_skip: skipped on rank(s) [1] of 2 (Skipped: not on rank 1); counted as"
    assert note in out
    assert "test_fixture_skip: skipped on rank(s) [1] of 2 (Skipped: only rank 0 has it)" in out
    # ranks that wait in a collective for the rank that skipped give up, and say why
    waited = "failed on rank(s) [0] of 2: they gave up waiting in a collective for rank(s) [1]"
    assert f"setup {waited}" in out and f"call {waited}" in out
    assert "the body ran on rank 1" not in out and "KeyError" not in out
    assert run.elapsed < 60


@pytest.mark.parametrize("where", ["body", "fixture"])
def test_failure_before_the_first_state_is_reported(tmp_path, where):
    # The first PartialState() discovers the job; a rank failing before it must not leave the
    # others in discovery's collectives (they cannot give up there).
    first = {
        "body": """
            def test_first():
                assert MPI.COMM_WORLD.rank != 1, "rank 1 fails before the state"
                PartialState().wait_for_everyone()
        """,
        "fixture": """
            @pytest.fixture
            def rank1_fails():
                assert MPI.COMM_WORLD.rank != 1, "rank 1 fails before the state"

            def test_first(rank1_fails, state):
                state.wait_for_everyone()
        """,
    }[where]
    body = "import pytest\nfrom mpi4py import MPI\nfrom mpaccel import PartialState\n"
    body += textwrap.dedent(first)
    body += "def test_still_works_after(state):\n    state.wait_for_everyone()\n"
    run = _run_pytest(
        tmp_path,
        body,
        2,
        "--mpi-timeout=30",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncode == 1, run.describe()
    out = run.stdout[0]
    expected = "1 failed, 1 passed" if where == "body" else "1 passed, 1 error"
    assert expected in _summary(out), run.describe()
    assert "AssertionError: rank 1 fails before the state" in out
    when = "call" if where == "body" else "setup"
    assert f"{when} failed on rank(s) [1] of 2; rank(s) [0] gave up waiting for them" in out
    assert "TIMEOUT" not in "".join(run.stderr)
    assert run.elapsed < 60


# Open MPI's venv is built beside the first size-1 tests: this runs after it, in CI
@pytest.mark.second_process
def test_silent_singletons_stop_every_copy(tmp_path):
    # This venv's MPICH mpiexec starting the Open MPI venv's python: each process is a world of
    # one, and without the check each would run the whole suite and report success.
    foreign_python = Path(sys.prefix + "-openmpi") / "bin" / "python"
    if not foreign_python.exists():
        reason = f"no Open MPI venv at {foreign_python.parent.parent} (make test builds it)"
        if envvars.get("ci"):
            pytest.fail(reason)
        pytest.skip(reason)
    (tmp_path / "test_ab.py").write_text("def test_a():\n    pass\ndef test_b():\n    pass\n")
    run = run_mpi(["-m", "pytest", "-p", "no:cacheprovider", "test_ab.py"], n=2, timeout=180,
                  cwd=tmp_path, python=str(foreign_python))
    assert run.returncode == 4 and run.returncodes == (4, 4), run.describe()
    for err in run.stderr:  # each copy stops, and says why
        assert err.count("ERROR: MPICH hydra mpiexec started 2 processes") == 1, run.describe()
        assert "silent singletons" in err and "HINT:" in err, run.describe()
    assert not any("passed" in out for out in run.stdout), run.describe()


def test_silent_singleton_from_srun_without_mpi(tmp_path):
    # What each task of `srun -n 4 --mpi=none python -m pytest` sees (as in jobs/test_launch.py)
    (tmp_path / "test_ab.py").write_text("def test_a():\n    pass\n")
    env = {
        "SLURM_JOB_ID": "12",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "1",
        "SLURM_MPI_TYPE": "none",
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_ab.py"],
        env=envvars.child_environment(env), capture_output=True, text=True, timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode == 4, result.stdout + result.stderr
    assert "silent singletons" in result.stderr and "srun --mpi=pmi2" in result.stderr


def test_collection_error_on_one_rank_is_shown_once(tmp_path):
    run = _run_pytest(
        tmp_path,
        """
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            import no_such_module_on_rank1
        def test_a():
            pass
        def test_b():
            pass
    """,
        2,
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncodes == (4, 4), run.describe()
    text = run.stdout[0] + run.stderr[0]
    assert "rank 1: 0 tests vs rank 0's 2" in text
    assert "collection error in test_throwaway.py on rank(s) [1] only" in text
    assert "[rank 1] E   ModuleNotFoundError: No module named 'no_such_module_on_rank1'" in text
    assert "parametrisation" not in text  # the hint is about the error, not the rank
    assert "ranks collected different tests" not in run.stdout[1] + run.stderr[1]


@pytest.mark.parametrize("where", ["body", "fixture"])
def test_exit_on_one_rank_ends_every_rank(tmp_path, where):
    run = _run_pytest(
        tmp_path,
        f"""
        import pytest
        from mpi4py import MPI

        @pytest.fixture
        def fixture(state):
            if {where == "fixture"} and state.process_index == 1:
                pytest.exit("stop on rank 1", returncode=3)
            yield
            state.wait_for_everyone()  # rank 1 never set this fixture up: nobody comes

        def test_exit_rank1(fixture, state):
            if state.process_index == 1:
                pytest.exit("stop on rank 1", returncode=3)
            state.wait_for_everyone()  # the others wait for rank 1 in a collective

        def test_next():
            pass
    """,
        2,
        "--mpi-timeout=60",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert run.returncodes == (3, 3), run.describe()  # rank 1's exit code, on every rank
    when = "call" if where == "body" else "setup"
    reason = f"rank 1 called pytest.exit during test_throwaway.py::test_exit_rank1 ({when})"
    assert f"{reason}: stop on rank 1" in run.stdout[0], run.describe()
    assert "TIMEOUT" not in "".join(run.stderr)
    assert run.elapsed < 45


def test_xfail_on_some_ranks_only_is_xfailed(tmp_path):
    run = _run_pytest(
        tmp_path,
        """
        import pytest
        from mpi4py import MPI
        @pytest.mark.xfail(reason="fails on rank 0 only")
        def test_xfail_marker():
            assert MPI.COMM_WORLD.rank != 0
        def test_imperative():
            if MPI.COMM_WORLD.rank == 1:
                pytest.xfail("not on rank 1")
    """,
        2,
        "-rx",
    )
    assert run.returncode == 0, run.describe()
    out = run.stdout[0]
    assert "= 2 xfailed in " in out, run.describe()  # not xpassed, nor passed
    assert "fails on rank 0 only [xfailed on rank(s) [0] of 2 only]" in out
    assert "test_imperative: xfailed on rank(s) [1] of 2 (not on rank 1)" in out


def test_watchdog_fires_once_and_ends_the_process_if_abort_returns(tmp_path):
    # MPICH's MPI_Abort returns when called from a thread other than the main one.
    script = textwrap.dedent("""
        import os, sys, time
        from mpaccel.testing.watchdog import Watchdog
        calls = []
        def abort(code):
            calls.append(code)
            os.write(1, f"abort({code}) returned\\n".encode())
        dog = Watchdog(0, 1, abort, 1)
        dog.arm("the test", 0.1)
        time.sleep(10)
        print("main thread went on")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 124, result
    assert result.stdout.count("TIMEOUT: the test did not finish within 0.1 s") == 1, result
    assert result.stdout.count("abort(124) returned") == 1, result
    assert "main thread went on" not in result.stdout


def test_mpi_tmp_path_gives_up_waiting_for_a_rank_that_skipped_before_it(tmp_path):
    # mpi_tmp_path waits for rank 0 to create the directory: a rank that skipped in an earlier
    # fixture never comes, and the wait must give up (as any mpaccel collective does), not hang.
    run = _run_pytest(
        tmp_path,
        """
        import pytest
        from mpi4py import MPI
        RANK = MPI.COMM_WORLD.Get_rank()

        @pytest.fixture
        def rank0_only():
            if RANK != 0:
                pytest.skip("only rank 0 has it")

        def test_shared_after_skip(rank0_only, mpi_tmp_path):
            pass

        def test_still_works_after(mpi_tmp_path, state):
            state.wait_for_everyone()
    """,
        2,
        "--mpi-timeout=30",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert "TIMEOUT" not in "".join(run.stderr), run.describe()
    assert run.returncodes == (1, 1), run.describe()
    out = run.stdout[0]
    assert "1 passed, 1 error" in _summary(out), run.describe()
    assert "setup failed on rank(s) [0] of 2: they gave up waiting in a collective for" in out
    assert run.elapsed < 60


@pytest.mark.parametrize("n", [2, 4])
def test_keyboard_interrupt_on_one_rank_ends_every_rank(tmp_path, n):
    run = _run_pytest(
        tmp_path,
        """
        def test_interrupted(state):
            if state.process_index == 1:
                raise KeyboardInterrupt
            state.wait_for_everyone()  # the others wait for rank 1 in a collective

        def test_next():
            pass
    """,
        n,
        "--mpi-timeout=60",
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert "TIMEOUT" not in "".join(run.stderr), run.describe()
    assert run.returncodes == (2,) * n, run.describe()  # pytest's "interrupted", everywhere
    out = run.stdout[0]
    reason = "rank 1 was interrupted during test_throwaway.py::test_interrupted (call)"
    assert f"{reason}: KeyboardInterrupt" in out, run.describe()
    assert "test_next" not in out and "passed" not in _summary(out)
    assert run.elapsed < 45


def test_basetemp_option_is_private_to_each_rank(tmp_path):
    # pytest empties a given --basetemp before using it: N ranks sharing one would race.
    run = _run_pytest(
        tmp_path,
        """
        import time
        def test_private(tmp_path, comm):
            (tmp_path / "mine").write_text(str(comm.rank))
            assert len(set(comm.allgather(str(tmp_path)))) == comm.size
            time.sleep(0.5)
            assert (tmp_path / "mine").read_text() == str(comm.rank)

        def test_shared(mpi_tmp_path, comm):
            assert len(set(comm.allgather(str(mpi_tmp_path)))) == 1
    """,
        2,
        f"--basetemp={tmp_path / 'given'}",
        timeout=120,
    )
    assert run.returncode == 0, run.describe()
    assert "2 passed" in _summary(run.stdout[0]), run.describe()
    given = sorted(p.name for p in (tmp_path / "given").iterdir())
    assert given == ["rank-0", "rank-1", "shared"]  # mpi_tmp_path's too, kept as pytest does
    assert "temporary files kept" not in run.stderr[0], run.describe()


@pytest.mark.parametrize("where", ["import", "configure", "configure-first"])
def test_a_rank_that_cannot_start_stops_every_rank(tmp_path, where):
    # A conftest.py that fails on one rank (a package missing on one node): that rank stops
    # before the session, when the others are in the first collectives; they must not wait.
    conftest = {
        "import": "if RANK == 1:\n    import no_such_module_on_rank1\n",
        "configure": (
            "def pytest_configure(config):\n"
            "    if RANK == 1:\n"
            "        raise ImportError('no module named no_such_module_on_rank1')\n"
        ),
        "configure-first": (  # before mpaccel's own pytest_configure
            "import pytest\n"
            "@pytest.hookimpl(tryfirst=True)\n"
            "def pytest_configure(config):\n"
            "    if RANK == 1:\n"
            "        raise ImportError('no module named no_such_module_on_rank1')\n"
        ),
    }[where]
    header = "from mpaccel.envvars import rank_before_init\nRANK = rank_before_init()\n"
    (tmp_path / "conftest.py").write_text(header + conftest)
    run = _run_pytest(tmp_path, "def test_a():\n    pass\n", 2, "--mpi-timeout=30", timeout=120)
    assert not run.timed_out, run.describe()
    assert "TIMEOUT" not in "".join(run.stderr), run.describe()
    # Every rank ends with pytest's own code for what happened on rank 1: a usage error (4) for
    # a conftest.py that does not import, an internal error (3) for a pytest_configure that raised
    expected = 4 if where == "import" else 3
    assert run.returncodes == (expected, expected), run.describe()
    text = run.stdout[0] + run.stderr[0]
    assert "rank(s) [1] of 2 stopped before the tests started" in text, run.describe()
    assert "no_such_module_on_rank1" in run.stdout[1] + run.stderr[1], run.describe()
    assert "passed" not in run.stdout[0]
    assert run.elapsed < 60


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--help", "--mpi-timeout"),
        ("--markers", "@pytest.mark.mpi(min_size"),
        ("--fixtures", "mpi_tmp_path"),
        ("--fixtures-per-test", "comm"),
    ],
)
def test_information_options_print_once(tmp_path, option, expected):
    run = _run_pytest(tmp_path, "def test_a(comm):\n    pass\n", 2, option, timeout=120)
    assert not run.timed_out, run.describe()
    assert run.returncodes == (0, 0), run.describe()
    assert expected in run.stdout[0], run.describe()
    assert run.stdout[1] == "", run.describe()


@pytest.mark.parametrize("option", ["--help", "--version"])
def test_help_with_a_conftest_failing_on_one_rank(tmp_path, option):
    """pytest lets a conftest.py that fails to import pass for --help and --version (a warning):
    the rank where it fails goes on like the others, and so does the job (it hung in --help)."""
    (tmp_path / "conftest.py").write_text(
        "from mpaccel.envvars import rank_before_init\n"
        "if rank_before_init() == 1:\n"
        "    import no_such_module_on_rank1\n"
    )
    run = _run_pytest(tmp_path, "def test_a():\n    pass\n", 2, option, timeout=90)
    assert not run.timed_out, run.describe()
    assert run.returncodes == (0, 0), run.describe()
    if option == "--help":
        assert "--mpi-timeout" in run.stdout[0] and run.stdout[1] == "", run.describe()


def test_captured_output_of_a_failure_is_shown_once_and_tagged(tmp_path):
    run = _run_pytest(
        tmp_path,
        """
        def test_fails_on_every_rank(comm):
            print(f"output of rank {comm.rank}")
            assert False
        def test_fails_on_rank_1(comm):
            print(f"second test, rank {comm.rank}")
            assert comm.rank != 1
    """,
        2,
        timeout=120,
        env={"CI": "1"},  # where pytest shows a failure's whole message in the short summary
    )
    assert run.returncode == 1, run.describe()
    report, summary = run.stdout[0].split("short test summary info")
    # the summary has one line per failure, the first line of the combined report
    assert [line for line in summary.splitlines() if line.startswith("FAILED")] == [
        "FAILED test_throwaway.py::test_fails_on_every_rank - call failed on rank(s) [0, 1] of 2",
        "FAILED test_throwaway.py::test_fails_on_rank_1 - call failed on rank(s) [1] of 2",
    ], summary
    assert "[rank" not in summary, summary
    out = report
    # each failing rank's output is in its tagged part of the report, and nowhere else
    for r in (0, 1):
        assert out.count(f"output of rank {r}") == 1, run.describe()
        assert f"[rank {r}] output of rank {r}" in out
    assert out.count("second test, rank 1") == 1 and "[rank 1] second test, rank 1" in out
    # rank 0 passed test_fails_on_rank_1: its output, if shown, says whose it is
    assert "second test, rank 0" not in out or "Captured stdout call (rank 0)" in out, out


def test_temporary_paths_on_another_node_than_rank_0s(tmp_path):
    # Rank 1 in a mount namespace of its own, with an empty tmpfs over TMPDIR: its TMPDIR is
    # private to it, as /tmp is to each node of a cluster.
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr!r}")
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    (tmp_path / "test_nodes.py").write_text(
        "def test_private(tmp_path):\n    (tmp_path / 'x').write_text('x')\n"
        "def test_shared(mpi_tmp_path):\n    (mpi_tmp_path / 'y').write_text('y')\n"
    )

    other_node = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none {node_tmp} && exec "$@"',
                  "sh"]

    def run(*args: str):
        return run_mpi(["-m", "pytest", "-p", "no:cacheprovider", "test_nodes.py", *args], n=2,
                       timeout=180, env={"TMPDIR": str(node_tmp)}, cwd=tmp_path,
                       rank_prefix={1: other_node})

    # tmp_path works on every node; mpi_tmp_path says why it cannot and what to do
    result = run()
    assert result.returncode == 1, result.describe()
    out = result.stdout[0]  # the report is rank 0's
    summary = _summary(out)  # with "1 warning" too: rankio imported mpaccel before pytest
    assert "1 passed" in summary and "1 error" in summary, result.describe()
    assert "is not on a filesystem that every node shares" in out
    assert "HINT: run with --basetemp=DIR" in out
    # which is a --basetemp on a filesystem that every rank sees
    result = run(f"--basetemp={tmp_path / 'shared-fs'}")
    assert result.returncode == 0, result.describe()
    assert "2 passed" in _summary(result.stdout[0]), result.describe()
    assert sorted(p.name for p in (tmp_path / "shared-fs").iterdir()) == [
        "rank-0", "rank-1", "shared"
    ]


def test_a_test_past_its_deadline_ends_the_job_even_when_it_finishes_last(tmp_path):
    """The deadline went off (TIMEOUT printed on every rank) during the last test, which then
    finished: the run reported "1 passed" and exited 0, because the process ended before the
    watchdog's abort."""
    run = _run_pytest(
        tmp_path,
        """
        import time, pytest
        @pytest.mark.mpi_timeout(1)
        def test_slow():
            time.sleep(1.5)
    """,
        2,
        timeout=120,
    )
    assert not run.timed_out, run.describe()
    assert "TIMEOUT: test_throwaway.py::test_slow" in "".join(run.stderr), run.describe()
    assert run.returncode != 0, run.describe()


def test_a_deadline_of_zero_is_none_and_a_bad_one_a_usage_error(tmp_path):
    run = _run_pytest(tmp_path, "import time\ndef test_a():\n    time.sleep(1.2)\n", 2,
                      "--mpi-timeout=0", timeout=120, env={"MPACCEL_TEST_TIMEOUT": "1"})
    assert run.returncodes == (0, 0), run.describe()
    assert "TIMEOUT" not in "".join(run.stderr), run.describe()
    for args, env, named in (
        (["--mpi-timeout=-3"], None, "--mpi-timeout: -3.0 is not a time in seconds"),
        (["-o", "mpi_timeout=abc"], None, "mpi_timeout: 'abc' is not a time in seconds"),
        ([], {"MPACCEL_TEST_TIMEOUT": "soon"},
         "environment variable MPACCEL_TEST_TIMEOUT='soon' is not a number of seconds >= 0"),
    ):
        run = _run_pytest(tmp_path, "def test_a():\n    pass\n", 2, *args, timeout=120, env=env)
        assert run.returncodes == (4, 4), run.describe()
        text = run.stdout[0] + run.stderr[0]
        assert named in text and "Traceback" not in text, run.describe()
        assert named not in run.stdout[1] + run.stderr[1], run.describe()  # said once


def test_mpi_tmp_path_is_new_and_empty_for_every_test(tmp_path):
    """Test ids that differ only in characters a file name cannot hold ("x y", "x_y", "x/y")
    shared one directory, and a test found the files of the one before."""
    run = _run_pytest(
        tmp_path,
        """
        import pytest
        @pytest.mark.parametrize("name", ["x y", "x_y", "x/y", "x?y"])
        def test_fresh(name, mpi_tmp_path, comm):
            assert list(mpi_tmp_path.iterdir()) == []
            comm.barrier()
            if comm.rank == 0:
                (mpi_tmp_path / "marker").write_text(name)
    """,
        2,
        timeout=120,
    )
    assert run.returncode == 0, run.describe()
    assert "4 passed" in _summary(run.stdout[0]), run.describe()


def test_the_silenced_ranks_leak_no_file(tmp_path):
    run = _run_pytest(tmp_path, "def test_a():\n    pass\n", 2, "-W", "error::ResourceWarning",
                      timeout=120, env={"PYTHONWARNINGS": "error::ResourceWarning"})
    assert run.returncodes == (0, 0), run.describe()
    assert "ResourceWarning" not in "".join(run.stderr), run.describe()


_RANK_CONFTEST = "import os, time, pytest\nRANK = int(os.environ.get('PMI_RANK', '0'))\n"


@pytest.mark.parametrize(
    ("hooks", "code", "said"),
    [
        ("def pytest_collection_modifyitems(items):\n    if RANK == 1:\n"
         "        raise RuntimeError('boom on rank 1')\n", 3, "RuntimeError: boom on rank 1"),
        ("def pytest_collection_modifyitems(items):\n    if RANK == 1:\n"
         "        pytest.exit('enough', returncode=7)\n", 7, "Exit: enough"),
        ("def pytest_sessionstart(session):\n    if RANK == 1:\n"
         "        raise RuntimeError('no start')\n", 3, "RuntimeError: no start"),
    ],
    ids=["error-in-collection-hook", "exit-in-collection-hook", "error-in-sessionstart"],
)
def test_a_session_that_ends_on_one_rank_alone_ends_every_rank_at_once(
    tmp_path, hooks, code, said
):
    """An error or pytest.exit on one rank outside a test phase (a conftest hook): that rank
    left for the exit-code vote while the others waited in the collection check or the
    outcome exchange, and the job hung until the deadline (then blamed an innocent test)."""
    (tmp_path / "conftest.py").write_text(_RANK_CONFTEST + hooks)
    run = _run_pytest(tmp_path, "def test_a():\n    pass\n", 2, "--mpi-timeout=60", timeout=120)
    assert not run.timed_out and run.elapsed < 40, run.describe()
    assert run.returncode == code, run.describe()
    assert f"the session ended on rank 1 alone ({said})" in "".join(run.stderr), run.describe()


def test_a_root_conftest_that_hangs_on_one_rank_ends_at_the_deadline(tmp_path):
    """Imported before the plugin's pytest_configure: no deadline covered it, and the other
    ranks waited in discovery (30 minutes by default)."""
    (tmp_path / "conftest.py").write_text(_RANK_CONFTEST + "if RANK == 1:\n    time.sleep(600)\n")
    run = _run_pytest(tmp_path, "def test_a():\n    pass\n", 2, "--mpi-timeout=5", timeout=120)
    assert not run.timed_out and run.elapsed < 60, run.describe()
    assert run.returncode != 0, run.describe()
    err = "".join(run.stderr)
    # the watchdog's report, or faulthandler's where MPI_Init held the GIL while it waited
    assert "TIMEOUT: starting the session" in err or "Timeout (0:00:10)!" in err, run.describe()


def test_an_error_in_a_conftest_sessionfinish_on_one_rank_gives_every_rank_its_code(tmp_path):
    (tmp_path / "conftest.py").write_text(
        _RANK_CONFTEST + "def pytest_sessionfinish(session):\n    if RANK == 1:\n"
        "        raise RuntimeError('finish')\n"
    )
    run = _run_pytest(tmp_path, "def test_a():\n    pass\n", 2, timeout=120)
    assert run.returncodes == (1, 1), run.describe()


def test_tb_line_shows_the_combined_failure(tmp_path):
    run = _run_pytest(
        tmp_path,
        "from mpi4py import MPI\ndef test_a():\n    assert MPI.COMM_WORLD.Get_rank() != 1\n",
        2, "--tb=line", timeout=120,
    )
    assert run.returncode == 1, run.describe()
    assert "call failed on rank(s) [1] of 2" in run.stdout[0], run.describe()
    assert "_Crash(" not in run.stdout[0], run.describe()
