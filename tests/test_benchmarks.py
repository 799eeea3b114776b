"""The benchmarks still run (tiny sizes, one round): they are not tests of speed, and no timing
is asserted, but a rename in mpaccel once left benchmarks/checkpoint.py failing at start."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.mpi(size=1)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_checkpoint_benchmark_runs(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), "--param-gib", "0.002",
         "--layers", "1", "--rounds", "1", "--warmup", "0", "--methods", "mpaccel,dd",
         "--dir", str(tmp_path / "scratch")],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mpaccel phases" in run.stdout and "cold (total" in run.stdout, run.stdout
