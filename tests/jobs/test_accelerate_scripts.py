"""Accelerate 1.15's own distributed test scripts (accelerate/test_utils/scripts/), read from an
installed Accelerate and run unchanged under a real mpiexec with `accelerate` resolved to
mpaccel (tests/accelerate_shim): each main() must reach its end, and each of its calls pass,
one by one. Needs `pip install accelerate==1.15.0 torchdata`: skipped with the reason where
they are missing, a failure under CI. docs/compatibility.md says what runs and what does not."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from mpaccel import envvars
from mpaccel.testing import run_mpi
from tests.jobs.accelerate_shim import ACCELERATE_VERSION, installed_accelerate
from tests.jobs.accelerate_shim.calls import CALLS, SPLIT_TENSOR_REASON

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]  # each test starts its own mpiexec
# The runs at 1 and 4 processes: CI runs them after the Slurm tests, in their process, which
# mostly waits (all 19 tests there made that process end 200 s after the size-1 pass; none, 200 s
# before it).
ASIDE = [pytest.mark.slow, pytest.mark.second_process]
RUN = pathlib.Path(__file__).resolve().parent / "accelerate_shim" / "run.py"
TIMEOUT = 240  # below the plugin's per-test deadline (300 s), which would dump stacks


@pytest.fixture(scope="module", autouse=True)
def _accelerate_installed():
    version, _ = installed_accelerate()
    missing = [] if version == ACCELERATE_VERSION else [f"accelerate=={ACCELERATE_VERSION}"]
    # test_distributed_data_loop's stateful loaders: torchdata's StatefulDataLoader
    if importlib.util.find_spec("torchdata") is None:
        missing.append("torchdata")
    if missing:
        found = f"accelerate {version}" if version else "no accelerate"
        reason = (f"Accelerate's test scripts need {' and '.join(missing)} in this Python "
                  f"({found} here); pip install {' '.join(missing)}")
        if envvars.get("ci"):
            pytest.fail(reason)
        pytest.skip(reason)


# 2 processes is the size Accelerate's CI runs them at; 1 and 4 are marked slow (~10 s a run).
MAIN_RUNS = [
    *[pytest.param(script, n, marks=marks, id=f"{script}-n{n}")
      for script in ("test_ops.py", "test_sync.py", "external_deps/test_metrics.py")
      for n, marks in ((1, ASIDE), (2, []), (4, ASIDE))],
    pytest.param("test_script.py", 1, marks=ASIDE, id="test_script.py-n1"),
    pytest.param("test_script.py", 2, id="test_script.py-n2"),
    pytest.param("test_script.py", 4, id="test_script.py-n4",
                 marks=[*ASIDE, pytest.mark.xfail(strict=True, reason=SPLIT_TENSOR_REASON)]),
    # it asserts two processes ("this script expects that two GPUs are available")
    pytest.param("test_distributed_data_loop.py", 2, id="test_distributed_data_loop.py-n2"),
    # it counts the GPUs; test_ddp_comm_hook.py is not CPU-applicable (docs/compatibility.md)
    pytest.param("test_cli.py", 2, marks=pytest.mark.slow, id="test_cli.py-n2"),
]


@pytest.mark.parametrize("script, n", MAIN_RUNS)
def test_main_reaches_its_end(script, n):
    run = run_mpi([str(RUN), script], n=n, timeout=TIMEOUT)
    ended = [out.count("main() reached its end") for out in run.stdout]
    if run.returncode == 0 and ended == [1] * n:
        return
    # Which of its calls fail, one by one: a second job, run only when main() did not end
    # (every call main() makes is in CALLS, so a failing main() shows here at no cost to a
    # passing run; it cost 25 s of CPU in every run as tests of their own).
    each = ""
    if script in CALLS:
        calls = run_mpi([str(RUN), script, "--each"], n=n, timeout=TIMEOUT)
        each = "\n\ncall by call:\n" + calls.stdout[0]
    pytest.fail(run.describe() + each)


# Call by call, for the calls main() makes on GPUs only: test_sync and test_metrics have
# CPU-applicable ones. (main() makes every call of test_ops, test_script and
# test_distributed_data_loop; test_main_reaches_its_end reports them one by one when it fails.)
EACH_RUNS = [
    pytest.param(script, 2, id=f"{script}-n2")
    for script in ("test_sync.py", "external_deps/test_metrics.py")
]


def _expected_outcome(call, n: int) -> str:
    if not eval(call.when, {"n": n}):
        return "SKIP"
    if eval(call.xfail, {"n": n}):
        return "NOTRUN" if call.hangs else "XFAIL"
    return "PASS"


@pytest.mark.parametrize("script, n", EACH_RUNS)
def test_each_call_passes(script, n):
    run = run_mpi([str(RUN), script, "--each"], n=n, timeout=TIMEOUT)
    reported = re.findall(r"^([A-Z]+) ([^\s:]+)", run.stdout[0], re.M)
    expected = [(_expected_outcome(call, n), call.name) for call in CALLS[script]]
    assert reported == expected, run.describe()
    assert run.returncode == 0, run.describe()
