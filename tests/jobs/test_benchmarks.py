"""The benchmarks still run (tiny sizes, one round): they are not tests of speed, and no timing
is asserted, but a rename in mpaccel once left benchmarks/checkpoint.py failing at start."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_checkpoint_benchmark_runs(tmp_path):
    # Without the 1 GiB touched before each timed step (prefault(), ~6 s of CPU here at any
    # size): the two-rank run below keeps it.
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), *_TINY_CHECKPOINT,
         "--no-prefault", "--dir", str(tmp_path / "scratch")],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mpaccel phases" in run.stdout and "cold (total" in run.stdout, run.stdout


# --settle 0: no 1 s pause (for the disk to settle) after each method
_TINY_CHECKPOINT = ["--param-gib", "0.002", "--layers", "1", "--rounds", "1", "--warmup", "0",
                    "--methods", "mpaccel,dd", "--settle", "0"]


def test_checkpoint_benchmark_runs_on_two_ranks(tmp_path):
    from mpaccel.testing import run_mpi

    run = run_mpi(
        [str(ROOT / "benchmarks" / "checkpoint.py"), *_TINY_CHECKPOINT,
         "--dir", str(tmp_path / "scratch")],
        n=2, timeout=300,
    )
    assert not run.timed_out and run.returncode == 0, run.describe()
    out = run.stdout[0]
    assert "mpaccel phases" in out and "dd x 2 warm" in out, run.describe()


def test_control_plane_benchmark_runs():
    from mpaccel.testing import run_mpi

    run = run_mpi(
        [str(ROOT / "benchmarks" / "control_plane.py"), "--iters", "20", "--warmup", "2",
         "--mpi-only"],
        n=2, timeout=180,
    )
    assert not run.timed_out and run.returncode == 0, run.describe()
    out = run.stdout[0]
    assert "mpaccel wait_for_everyone" in out and "MPI Barrier" in out, run.describe()
    assert "mpaccel check_trigger / MPI allreduce(int)" in out, run.describe()


def test_training_benchmark_runs():
    # The driver starts its own mpiexec job (the one beside this python); Accelerate is skipped.
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "training.py"), "--n", "2", "--repeats", "1",
         "--accelerate-python", "", "--steps", "2", "--rounds", "1", "--warmup", "1",
         "--rewarm", "0", "--samples", "512", "--wait-idle", "0", "--job-timeout", "120"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| mpaccel | mpaccel |" in run.stdout and "| raw DDP | mpaccel |" in run.stdout
    assert "mpaccel / raw DDP (paired windows)" in run.stdout, run.stdout


def test_fsdp_benchmark_runs():
    # Tiny model, one round: the driver starts its own mpiexec jobs (n=2: DDP, FSDP, both).
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fsdp.py"), "--n", "2", "--gib", "0.002",
         "--d", "64", "--throughput-d", "64", "--blocks", "2", "--batch", "4", "--steps", "1",
         "--rounds", "2", "--window", "1", "--timeout", "240"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "n=2: FSDP peak / DDP peak" in run.stdout, run.stdout
    assert "n=2: mpaccel" in run.stdout and "raw fully_shard" not in run.stderr, run.stdout
