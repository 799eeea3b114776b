"""mpaccel.lifecycle: the exit order, end_job and abort_job, each in a process of its own (they
end it). The whole-job behaviours (an uncaught exception under mpiexec) are in
jobs/test_launch.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mpaccel import envvars

# Each test ends a Python process of its own: once, in the size-1 pass.
pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]


def _python(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
        env=envvars.child_environment({"MPACCEL_ABORT_ON_EXCEPTION": "1"}),
    )


def test_exit_hooks_run_by_stage_then_mpi_is_finalized():
    # The progress thread's stop is registered after the end-of-program barrier when the
    # communicator starts the thread first: the stage, not the registration, decides.
    run = _python(
        """
        import atexit
        from mpi4py import MPI
        from mpaccel import lifecycle
        from mpaccel.lifecycle import Stage
        def say(text):
            return lambda: print(text, "finalized" if MPI.Is_finalized() else "live", flush=True)
        def broken():
            raise RuntimeError("a hook that fails")
        lifecycle.at_exit(Stage.END_OF_PROGRAM, say("end of program, first registered"))
        lifecycle.at_exit(Stage.END_OF_PROGRAM, say("end of program, last registered"))
        lifecycle.at_exit(Stage.STOP_PROGRESS, broken)
        lifecycle.at_exit(Stage.STOP_PROGRESS, say("stop progress"))
        lifecycle.finish_before_exit(say("finish saves"))
        print("script done", flush=True)
        """
    )
    assert run.returncode == 0, run
    assert run.stdout.splitlines() == [
        "script done",
        "finish saves live",
        "stop progress live",
        "end of program, last registered live",
        "end of program, first registered live",
    ], run
    assert "Exception ignored in an mpaccel exit hook" in run.stderr, run
    assert "RuntimeError: a hook that fails" in run.stderr, run


def test_end_job_flushes_and_runs_the_exit_hooks():
    run = _python(
        """
        import sys
        from mpaccel import lifecycle
        lifecycle.at_exit(lifecycle.Stage.END_OF_PROGRAM, lambda: print("hook ran"))
        sys.stdout.write("unflushed line\\n")
        lifecycle.end_job(3)
        print("not reached")
        """
    )
    assert run.returncode == 3, run
    assert run.stdout.splitlines() == ["unflushed line", "hook ran"], run


def test_abort_job_without_mpi_ends_the_process_at_once():
    run = _python(
        """
        from mpaccel import lifecycle
        lifecycle.at_exit(lifecycle.Stage.END_OF_PROGRAM, lambda: print("hook ran"))
        lifecycle.abort_job(7)
        print("not reached")
        """
    )
    assert run.returncode == 7, run
    assert run.stdout == "", run


def test_no_abort_hook_in_a_job_of_one_process():
    run = _python(
        """
        import sys
        from mpaccel import lifecycle
        before = sys.excepthook
        lifecycle.install_abort_hook(0, 1, "here", lambda code: print("aborted"))
        assert sys.excepthook is before
        raise ValueError("plain uncaught error")
        """
    )
    assert run.returncode == 1 and "aborted" not in run.stdout, run
    assert "ValueError: plain uncaught error" in run.stderr and "[mpaccel rank" not in run.stderr
