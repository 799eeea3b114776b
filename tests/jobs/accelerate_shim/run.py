"""Run one of Accelerate's test scripts against mpaccel, on every rank of an MPI job:

    mpiexec -n 2 python tests/jobs/accelerate_shim/run.py test_ops.py           # its main()
    mpiexec -n 2 python tests/jobs/accelerate_shim/run.py test_ops.py --each    # call by call

The script is read from the installed Accelerate (`accelerate_shim.script_path`) and executed
with `accelerate` resolved to mpaccel. main() mode ends with the line "main() reached its end"
on every rank; an exception ends the job through mpaccel's abort, as in any script.

--each runs the calls listed for the script in `accelerate_shim.calls`, each after a state
reset; rank 0 prints one line per call: `PASS name`, `FAIL name [ranks]: error`, `SKIP name`
(main() does not make the call at this size), `XFAIL name: reason` / `XPASS name` (a known
failure, listed in calls.py, and whether it still fails) or `NOTRUN name: reason` (a known
failure that would leave the other ranks waiting). It exits 1 on a FAIL or an XPASS. A call
that fails on some ranks only may leave the others waiting in a collective for it: the failing
rank then waits GRACE seconds for them, prints what it knows and aborts the job."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
import types
from pathlib import Path

# Run as a file: make the package beside this file importable, and not the directory itself.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import accelerate_shim  # noqa: E402
from accelerate_shim.calls import CALLS  # noqa: E402

GRACE = 60.0

# Accelerate's external_deps scripts import datasets, evaluate and transformers at the top; the
# functions that run on CPU only set those packages' logging verbosity. Where a package is
# missing, a stand-in provides that and refuses anything else (the Hub functions are not run).
_HUB_PACKAGES = ("datasets", "evaluate", "transformers")


class _Missing(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        what = f"{self.__name__}.{attr}"

        def refuse(*args, **kwargs):
            raise ModuleNotFoundError(f"{what}: {self.__name__} is not installed here")

        return refuse


def _stand_in_for_missing_hub_packages() -> None:
    for package in _HUB_PACKAGES:
        if importlib.util.find_spec(package) is not None:
            continue
        module = _Missing(package)
        quiet = types.SimpleNamespace(
            set_verbosity_warning=lambda: None, set_verbosity_error=lambda: None
        )
        module.utils = types.SimpleNamespace(logging=quiet)
        sys.modules[package] = module


def load_script(relative: str) -> types.ModuleType:
    """Execute the installed Accelerate's scripts/RELATIVE as a module (its main() not called)."""
    path = accelerate_shim.script_path(relative)
    module = types.ModuleType(Path(relative).stem)
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # pickle finds the classes the script defines
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _exchange(world, error: str, name: str) -> list[str]:
    """Every rank's outcome of the call. A rank that failed waits GRACE seconds for the others
    (they may be stuck in a collective the failing rank never reached), then aborts the job."""
    request = world.Ibarrier()  # every rank: a blocking Barrier would not match it
    deadline = time.monotonic() + GRACE
    while not request.Test():
        if error and time.monotonic() > deadline:
            print(f"FAIL {name} [{world.rank}]: {error}; the other ranks did not come back "
                  f"within {GRACE:.0f} s (waiting in a collective?): aborting", flush=True)
            world.Abort(3)
        time.sleep(0.005)
    return world.allgather(error)


def run_each(script: types.ModuleType, relative: str, only: list[str], verbose: bool) -> int:
    from mpaccel.accelerator import Accelerator
    from mpaccel.state import PartialState
    from mpaccel.testing import reset_state

    n = PartialState().num_processes  # mpaccel's discovery initialises MPI, not mpi4py's import
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    failed = 0
    for call in CALLS[relative]:
        if only and call.name not in only:
            continue
        if not eval(call.when, {"n": n}):
            _report(world, f"SKIP {call.name} (main() makes this call only when {call.when})")
            continue
        expected = bool(eval(call.xfail, {"n": n}))
        if expected and call.hangs:
            _report(world, f"NOTRUN {call.name}: {call.reason} (a failure leaves ranks waiting)")
            continue
        reset_state()
        namespace = {"Accelerator": Accelerator, "PartialState": PartialState, **vars(script)}
        error = ""
        try:
            exec(call.statement, namespace)
        except BaseException as exc:  # reported; the next call runs
            error = _first_line(exc) or type(exc).__name__
            if verbose:
                traceback.print_exc()
        outcomes = _exchange(world, error, call.name)
        bad = [rank for rank, outcome in enumerate(outcomes) if outcome]
        if bad and expected:
            _report(world, f"XFAIL {call.name}: {call.reason}")
        elif bad:
            _report(world, f"FAIL {call.name} {bad}: {outcomes[bad[0]]}")
        elif expected:
            _report(world, f"XPASS {call.name}: expected to fail ({call.reason})")
        else:
            _report(world, f"PASS {call.name}")
        failed += bool(bad) != expected
    return 1 if failed else 0


def _report(world, line: str) -> None:
    if world.rank == 0:
        print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", choices=[*sorted(CALLS), "test_cli.py", "test_ddp_comm_hook.py"],
                        help="path under accelerate/test_utils/scripts/")
    parser.add_argument("--each", nargs="*", metavar="NAME",
                        help="run the listed calls (all when none is named) one by one")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="with --each, print the traceback of each failing call")
    args = parser.parse_args()
    accelerate_shim.install()
    _stand_in_for_missing_hub_packages()
    script = load_script(args.script)
    if args.each is not None:
        return run_each(script, args.script, args.each, args.verbose)
    script.main()
    print("main() reached its end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
