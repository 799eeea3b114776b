"""pytest plugin: `mpiexec -n N python -m pytest` gives one report, one exit code, and no hang.

Inert (no MPI_Init, no change to output) unless a launcher started more than one process. Under
MPI it: runs mpaccel's discovery once, on every rank together, before any test (a launch
mistake such as silent singletons stops the run, as does a rank that cannot load its conftest
files or configure); gives each rank a basetemp of its own; checks that every rank collected
the same tests; combines each test phase's outcome over MPI (see `outcomes`); lets ranks stuck in an
mpaccel collective give up when a peer fails, skips or calls pytest.exit; reports (and prints
--help, --fixtures, ...) from rank 0 only; aborts the job, naming the test and printing every
rank's stack, when a test exceeds its timeout; and gives every rank the same exit code.

This module holds the module-level hooks; `session` the run under MPI (its own hooks), and
`fixtures` the fixtures (`comm`, `state`, `accelerator`, `mpi_tmp_path`), imported here for
pytest to find them. The markers and fixtures work in plain runs too, as a world of one.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import pytest
from _pytest._io import TerminalWriter

from .. import envvars, lifecycle
from ..environments import detect_launcher
from .fixtures import accelerator, comm, mpi_tmp_path, reset_state, state
from .session import KEY, MPISession, session_of
from .watchdog import DEFAULT_TIMEOUT, Watchdog, config_timeout
from .world import world_rank

if TYPE_CHECKING:
    from ..discovery import Discovery

# The fixtures are found by pytest in this module, the registered plugin: hence the imports.
__all__ = ["accelerator", "comm", "mpi_tmp_path", "reset_state", "state"]

_CONFIGURED = pytest.StashKey[bool]()  # this plugin's pytest_configure ran
_stderr_fd = 2  # the terminal's stderr, saved before pytest's fd capture replaces fd 2


def _world_size_from_launcher() -> int:
    expected = detect_launcher(envvars.snapshot()).expected_world_size()
    return expected or 1


def _discover_job() -> Discovery:
    """Collective over COMM_WORLD: mpaccel's discovery (discovery.discover_once), at configure
    time, without importing torch (a test session that never uses it does not pay for it).

    Discovery duplicates COMM_WORLD, a blocking collective that a waiting rank cannot abandon:
    inside a test, a rank that failed before its first PartialState() would leave the others
    there until the deadline. Done here, every rank takes part, and tests only ever reuse it
    (reset_state keeps discovery, as does AcceleratorState._reset_state). Its launch checks
    (silent singletons: the launcher says N, MPI sees 1) become a usage error on every rank."""
    from .. import discovery
    from ..errors import ConfigurationError, LaunchError

    timeout, problem = discovery.DEFAULT_TIMEOUT, None
    try:
        timeout = envvars.get_float("timeout") or timeout
    except ConfigurationError as exc:  # raised on every rank by discovery, naming this one
        problem = exc
    try:
        return discovery.discover_once(timeout, problem)
    except (LaunchError, ConfigurationError) as exc:
        # The same error on every rank; a real world prints it once, from rank 0, while every
        # silent singleton is a rank 0 of its own and prints it.
        raise pytest.UsageError(*([str(exc)] if world_rank() == 0 else [])) from exc


# -- hooks -----------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpaccel", "mpaccel: tests under mpiexec")
    group.addoption(
        "--mpi-timeout",
        type=float,
        default=None,
        help="per-test deadline in seconds under MPI; past it the job is aborted with every "
        f"rank's stack (default: ini mpi_timeout, MPACCEL_TEST_TIMEOUT, {DEFAULT_TIMEOUT:g})",
    )
    parser.addini("mpi_timeout", "per-test deadline in seconds under MPI", default=None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_cmdline_main(
    config: pytest.Config,
) -> Generator[None, int | pytest.ExitCode, int | pytest.ExitCode]:
    try:
        return (yield)
    except pytest.UsageError as exc:
        mpi = session_of(config)
        if mpi is None or mpi.start_exitcode is None:
            raise
        # Another rank stopped before the start. Printed as pytest prints a usage error, but
        # with that rank's exit code, pytest's own for what happened there, not always 4.
        for message in exc.args:
            TerminalWriter(sys.stderr).line(f"ERROR: {message}\n", red=True)
        return mpi.start_exitcode


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Iterator[None]:
    global _stderr_fd
    if _world_size_from_launcher() < 2:
        return (yield)
    if _stderr_fd == 2:
        _stderr_fd = os.dup(2)  # outermost wrapper: runs before capture starts
    if _prints_information(early_config) and envvars.rank_before_init() not in (None, 0):
        # --help, --fixtures, ...: printed once, by rank 0. The other ranks' stdout is closed
        # here, before capture saves fd 1 to restore it (a redirection made later is undone).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    try:
        return (yield)
    except Exception as exc:
        options = early_config.known_args_namespace
        if not (getattr(options, "help", False) or getattr(options, "version", False)):
            _stop_with_the_others(early_config, f"{type(exc).__name__}: {exc}")
        # else pytest lets a conftest that fails to import pass (a warning) for --help and
        # --version: this rank goes on like the others, and must not stop them.
        raise


def _prints_information(config: pytest.Config) -> bool:
    """Is this a run that prints pytest's help, markers or fixtures, and runs no test?"""
    options = config.known_args_namespace
    return any(
        getattr(options, name, False)
        for name in ("help", "markers", "showfixtures", "show_fixtures_per_test")
    )


def _stop_with_the_others(config: pytest.Config, error: str) -> None:
    """This rank cannot start (a conftest.py that fails to import here, a pytest_configure that
    raised before ours): the others are on their way to discovery and the start check. Take
    part in both, so that they stop too; pytest then reports the error here as usual."""
    job = _discover_job()
    if job.info.num_processes > 1:
        session = MPISession(config, job, _stderr_fd)
        session.check_start(error)
        session.pytest_unconfigure(config)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mpi(min_size=None, max_size=None, size=None): run only at these world sizes",
    )
    config.addinivalue_line("markers", "mpi_timeout(seconds): per-test deadline under MPI")
    config.stash[_CONFIGURED] = True
    size = _world_size_from_launcher()
    if size < 2:
        return
    # Under the run's deadline from here: a rank whose root conftest.py never finishes
    # importing, or whose pytest_configure never returns, leaves the others waiting in
    # discovery or in the start check, which have no deadline of their own that short.
    seconds = config_timeout(config)
    watchdog = Watchdog(world_rank(), size, lifecycle.abort_job, _stderr_fd)
    watchdog.arm("starting the session (every rank's conftest.py and pytest_configure)", seconds)
    watchdog.phase("waiting for the other ranks")
    if 0 < seconds < math.inf:
        # The watchdog needs the GIL, which MPI_Init (at mpi4py's import) holds while it waits
        # for every rank to start: faulthandler's thread does not. It prints every thread's
        # stack and ends this process; the launcher then ends the others.
        faulthandler.dump_traceback_later(seconds + 5, exit=True, file=_stderr_fd)
    try:
        job = _discover_job()
    finally:
        faulthandler.cancel_dump_traceback_later()
    if job.info.num_processes < 2:
        watchdog.disarm()
        return  # a world of one that MPACCEL_SKIP_LAUNCH_CHECKS lets through: a plain run
    session = MPISession(config, job, _stderr_fd, watchdog)
    config.stash[KEY] = session
    config.pluginmanager.register(session, "mpaccel-mpi-session")
    if session.rank != 0 and getattr(config.option, "xmlpath", None):
        config.option.xmlpath = None  # one JUnit XML, from rank 0, with the combined outcomes
    # One private basetemp per rank: pytest deletes and renumbers basetemp dirs (and empties a
    # given --basetemp), which N ranks doing at once in the same place would race on. Each rank
    # creates its parent: pytest does not, and on other nodes than rank 0's it may not exist.
    session.base.mkdir(parents=True, exist_ok=True)
    config.option.basetemp = str(session.base / f"rank-{session.rank}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _world_size_from_launcher() > 1 and not config.stash.get(_CONFIGURED, False):
        # Another pytest_configure (a conftest's, tryfirst) raised on this rank before ours ran.
        _stop_with_the_others(config, "stopped in pytest_configure (see this rank's output)")


def _world_size(config: pytest.Config) -> int:
    mpi = session_of(config)
    return 1 if mpi is None else mpi.size


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("mpi")
    if marker is None:
        return
    unknown = set(marker.kwargs) - {"min_size", "max_size", "size"}
    if unknown or marker.args:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.mpi takes min_size=, max_size=, size=; got "
            f"{marker.args!r} {sorted(unknown)!r}"
        )
    size = _world_size(item.config)
    min_size, max_size, exact = (marker.kwargs.get(k) for k in ("min_size", "max_size", "size"))
    if exact is not None and size != exact:
        pytest.skip(f"needs exactly {exact} MPI processes, running with {size}")
    if min_size is not None and size < min_size:
        pytest.skip(f"needs at least {min_size} MPI processes, running with {size}")
    if max_size is not None and size > max_size:
        pytest.skip(f"needs at most {max_size} MPI processes, running with {size}")
