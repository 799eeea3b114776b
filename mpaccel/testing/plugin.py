"""pytest plugin: `mpiexec -n N python -m pytest` gives one report, one exit code, and no hang.

Inert (no MPI_Init, no change to output) unless a launcher started more than one process. Under
MPI it: runs mpaccel's discovery once, on every rank together, before any test (a launch
mistake such as silent singletons stops the run, as does a rank that cannot load its conftest
files or configure); gives each rank a basetemp of its own; checks that every rank collected
the same tests; combines each test phase's outcome over MPI (see `outcomes`); lets ranks stuck in an
mpaccel collective give up when a peer fails, skips or calls pytest.exit; reports from rank 0
only; aborts the job, naming the test and printing every rank's stack, when a test exceeds its
timeout; and gives every rank the same exit code.

The markers and fixtures (`mpi`, `mpi_timeout`, `comm`, `state`, `accelerator`, `mpi_tmp_path`)
work in plain runs too, as a world of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _pytest._io import TerminalWriter

from .. import _env
from ..environments import detect_launcher
from .outcomes import PhaseOutcome, collection_mismatch, combine, exit_everywhere
from .watchdog import Watchdog

if TYPE_CHECKING:
    from ..discovery import Discovery

DEFAULT_TIMEOUT = 300.0
_KEY = pytest.StashKey["_MPISession"]()
_CONFIGURED = pytest.StashKey[bool]()  # this plugin's pytest_configure ran
_stderr_fd = 2  # the terminal's stderr, saved before pytest's fd capture replaces fd 2

# What a rank does after a phase's outcome exchange: a watchdog report then says "test body"
# for a rank stuck in the test itself, "... outcome exchange" for one waiting for the others.
_NEXT_PHASE = {"setup": "test body", "call": "teardown", "teardown": "after teardown"}


def _world_size_from_launcher() -> int:
    expected = detect_launcher(_env.snapshot()).expected_world_size()
    return expected or 1


def _discover_job() -> Discovery:
    """Collective over COMM_WORLD: mpaccel's discovery (state._discover), run at configure time.

    Discovery duplicates COMM_WORLD, a blocking collective that a waiting rank cannot abandon:
    inside a test, a rank that failed before its first PartialState() would leave the others
    there until the deadline. Done here, every rank takes part, and tests only ever reuse it
    (reset_state keeps discovery, as does AcceleratorState._reset_state). Its launch checks
    (silent singletons: the launcher says N, MPI sees 1) become a usage error on every rank."""
    from .. import state
    from ..errors import LaunchError

    try:
        return state._discover(_env.get_float("timeout") or state.DEFAULT_TIMEOUT)
    except LaunchError as exc:
        # The same error on every rank; a real world prints it once, from rank 0, while every
        # silent singleton is a rank 0 of its own and prints it.
        raise pytest.UsageError(*([str(exc)] if _world_rank() == 0 else [])) from exc


def _world_rank() -> int:
    """This process's rank in COMM_WORLD; 0 where MPI is not (or no longer) initialised."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return 0
    return int(MPI.COMM_WORLD.Get_rank())


class _MPISession:
    """Everything the plugin keeps for one run under MPI; registered as a plugin of its own,
    for the hooks that only matter under MPI."""

    def __init__(self, config: pytest.Config, job: Discovery) -> None:
        from mpi4py import MPI

        from ..comm import Alerts, MPIComm, install_alerts

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.comm = MPIComm(self.world, default_timeout=1e9, interruptible=False)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.alerts = Alerts(self.world)
        install_alerts(self.alerts)
        self.watchdog = Watchdog(self.rank, self.size, self.world.Abort, _stderr_fd)
        # Where the ranks' basetemp dirs (rank-R) and mpi_tmp_path's (shared/) are: a given
        # --basetemp (the way to a filesystem every node sees), else a new dir in rank 0's TMPDIR.
        self.given_base = config.option.basetemp is not None
        base = None
        if self.rank == 0 and self.given_base:
            base = os.path.abspath(config.option.basetemp)
            shutil.rmtree(os.path.join(base, "shared"), ignore_errors=True)  # a previous run's
        elif self.rank == 0:
            base = tempfile.mkdtemp(prefix="mpaccel-pytest-")
        self.base = Path(self.comm.bcast(base, what="pytest temporary directory"))
        self.config = config
        self.job = job  # mpaccel's discovery: its comm is the one tests use, interruptible
        self.collect_errors: dict[str, str] = {}
        self.notes: dict[tuple[str, str], None] = {}  # (nodeid, note), for the summary
        self._alerted = False  # this rank posted an alert during the current phase
        self._exit: tuple[str, str, int | None] | None = None  # see PhaseOutcome.exit
        self._late_alerts: list[int] = []  # posted after the last exchange, drained at the next
        self._exit_alerts: list[int] = []  # ranks that called pytest.exit: drained at the end
        self._skip_body: tuple[str, str] | None = None  # (nodeid, reason): skipped here in setup
        self._start_checked = False

    # -- outcomes ------------------------------------------------------------------------------

    def _post(self, text: str) -> None:
        """Not collective: tell the others this rank is leaving the phase; once per phase, as
        the exchange drains one alert from each rank that says it posted."""
        if not self._alerted:
            self.alerts.post(text)
            self._alerted = True

    def exchange(self, report: pytest.TestReport, secondary: bool) -> None:
        """Collective: make `report` the combined outcome of this phase over all ranks.

        `secondary`: this rank failed only because it gave up waiting for a rank that failed.
        Raises pytest's Exit on every rank when some rank called pytest.exit in this phase.
        """
        if report.outcome != "passed" and not secondary:
            # A rank that failed, skipped or xfailed may have left before a collective that the
            # others are waiting in (a fixture's, the body's): tell them at once.
            word = "xfailed" if hasattr(report, "wasxfail") else report.outcome
            self._post(f"{report.nodeid} {word} in {report.when} on rank {self.rank}")
        mine = PhaseOutcome.of(report, secondary, self._alerted, self._exit)
        self._alerted, self._exit = False, None
        outcomes: list[PhaseOutcome] = self.comm.allgather(mine, what="pytest outcome exchange")
        ids = {(o.nodeid, o.when) for o in outcomes}
        if len(ids) != 1:
            detail = ", ".join(f"rank {r}: {o.nodeid} [{o.when}]" for r, o in enumerate(outcomes))
            raise RuntimeError(f"ranks are running different tests: {detail}")
        exits = {r: o.exit for r, o in enumerate(outcomes) if o.exit is not None}
        alerted = [r for r, o in enumerate(outcomes) if o.alerted and r not in exits]
        self.alerts.drain(self._late_alerts + alerted)
        self._late_alerts = []
        self._resync_if_needed()
        if exits:
            # The alerts of the ranks that exited stay pending until the session's teardown is
            # over: a fixture there waiting in a collective for them gives up (see sessionfinish).
            self._exit_alerts = sorted(exits)
            raise exit_everywhere(report, exits)
        note = combine(report, outcomes, self.rank)
        if note is not None:
            self.notes[(report.nodeid, note)] = None
        if report.when == "setup" and report.passed:
            # Skipped here but not everywhere: pytest would run the body here (the combined
            # setup passed). This rank skips it instead (pytest_runtest_call), and tells the
            # others, so that a collective in their body gives up instead of waiting for it.
            absent = [r for r, o in enumerate(outcomes) if o.outcome == "skipped"]
            if self.rank in absent:
                reason = outcomes[self.rank].reason or "skipped"
                self._skip_body = (report.nodeid, reason)
                self.alerts.post(
                    f"{report.nodeid} was skipped on rank {self.rank} ({reason}): it does not "
                    "run the test body"
                )
            self._late_alerts = absent

    def _resync_if_needed(self) -> None:
        from .. import state

        discovery = state._discovery
        mpaccel_comm = getattr(discovery, "comm", None)
        broken = int(bool(getattr(mpaccel_comm, "broken", False)))
        if self.comm.allreduce(broken, "max", "pytest resync check"):
            mpaccel_comm.resync()  # type: ignore[union-attr]

    def _phase(self, item: pytest.Item, when: str) -> Generator[None, None, None]:
        """Around one phase: pytest.exit (or KeyboardInterrupt) on this rank alone would leave
        the others waiting for it in the outcome exchange. Catch it, tell the others at once,
        and let the exchange end the run on every rank."""
        try:
            yield
        except pytest.exit.Exception as exc:
            self._exit = ("called pytest.exit", str(exc.msg), exc.returncode)
            self._post(f"rank {self.rank} called pytest.exit during {item.nodeid} ({when})")
        except KeyboardInterrupt:
            # Raised by the test, or a SIGINT sent to this rank alone: the same as pytest.exit
            # (pytest's "interrupted" exit code), not a rank leaving the others behind.
            self._exit = ("was interrupted", "KeyboardInterrupt", None)
            self._post(f"rank {self.rank} was interrupted during {item.nodeid} ({when})")

    def check_start(self, error: str | None) -> None:
        """Collective, once: did every rank get as far as the session's start? A rank that
        stopped before (a conftest.py that does not import there, a pytest_configure that
        raised) says so, with `error`, instead of leaving the others waiting for it forever in
        the collection check: they stop with a usage error, which rank 0 prints."""
        if self._start_checked:
            return
        self._start_checked = True
        errors = self.comm.allgather(error, what="pytest start check")
        failed = {r: text for r, text in enumerate(errors) if text is not None}
        if not failed or error is not None:
            return
        lines = [f"rank(s) {sorted(failed)} of {self.size} stopped before the tests started:"]
        for r, text in failed.items():
            lines.extend(f"[rank {r}] {line}" for line in text.splitlines())
        lines.append(
            "HINT: see that rank's own output; the usual cause is a package missing or failing "
            "to import on some nodes or ranks."
        )
        raise pytest.UsageError(*(["\n".join(lines)] if self.rank == 0 else []))

    # -- hooks (registered under MPI only) -----------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.check_start(None)
        if self.rank == 0:
            return
        config = session.config
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            # Its own sessionstart (the header) still runs in this hook call: silence it first.
            if hasattr(reporter, "_tw"):
                reporter._tw = TerminalWriter(open(os.devnull, "w"))
            config.pluginmanager.unregister(reporter)
        cache = getattr(config, "cache", None)
        if cache is not None:
            cache.set = lambda key, value: None  # rank 0 alone writes .pytest_cache

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors[report.nodeid] = str(report.longrepr)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        ids = [item.nodeid for item in session.items]
        errors = sorted(self.collect_errors)
        digest = hashlib.sha256("\n".join([*ids, "-- errors --", *errors]).encode()).hexdigest()
        if len(set(self.comm.allgather(digest, what="pytest collection check"))) == 1:
            return
        gathered = self.comm.allgather((ids, self.collect_errors), what="pytest collection check")
        # Every rank stops with exit code 4; rank 0 alone says why.
        raise pytest.UsageError(*([collection_mismatch(gathered)] if self.rank == 0 else []))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[Any]:
        self.watchdog.arm(item.nodeid, _timeout_for(item))
        try:
            return (yield)
        finally:
            self.watchdog.disarm()
            self._skip_body = None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        return (yield from self._phase(item, "setup"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        if self._skip_body is not None and self._skip_body[0] == item.nodeid:
            reason = self._skip_body[1].removeprefix("Skipped: ")
            raise pytest.skip.Exception(reason, _use_item_location=True)
        return (yield from self._phase(item, "call"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        return (yield from self._phase(item, "teardown"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        from ..errors import PeerFailedError

        self.watchdog.phase(f"{call.when} outcome exchange")
        secondary = call.excinfo is not None and call.excinfo.errisinstance(PeerFailedError)
        self.exchange(report, secondary)
        self.watchdog.phase(_NEXT_PHASE[call.when])
        return report

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.notes:
            return
        terminalreporter.write_sep("=", "mpaccel: outcomes that differed between ranks")
        for nodeid, note in self.notes:
            terminalreporter.write_line(f"{nodeid}: {note}")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Iterator[Any]:
        # pytest tears down what is still set up here (session and module fixtures, and after
        # pytest.exit the interrupted test's): under the deadline too.
        self.watchdog.arm("the session's final teardown", _config_timeout(self.config))
        self.watchdog.phase("teardown")
        try:
            return (yield)
        except Exception as exc:
            if not self._exit_alerts:
                raise
            # After pytest.exit, a rank's fixture may wait in a collective for one whose own
            # copy was never set up: it gave up (the pending alert); say so, and end as asked.
            first = (str(exc).splitlines() or [""])[0]
            os.write(
                _stderr_fd,
                f"mpaccel: rank {self.rank}: teardown after pytest.exit failed: "
                f"{type(exc).__name__}: {first}\n".encode(errors="replace"),
            )
        finally:
            self.alerts.drain(self._exit_alerts)
            self._exit_alerts = []
            status = self.comm.allreduce(int(session.exitstatus), "max", "pytest exit")
            session.exitstatus = status
            self.config._mpaccel_exitstatus = status  # type: ignore[attr-defined]
            self.watchdog.disarm()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        from ..comm import install_alerts

        install_alerts(None)
        # No-op where the session started; else this rank stopped in pytest_configure (or
        # there was no session on any rank: --help, --markers).
        self.check_start("stopped in pytest_configure (see this rank's output)")
        status = getattr(config, "_mpaccel_exitstatus", 0)  # 0: no session, no files
        clean = status == 0 and not self.given_base  # pytest keeps a given one, as ever
        if clean:
            shutil.rmtree(self.base / f"rank-{self.rank}", ignore_errors=True)
        self.comm.barrier("pytest cleanup")
        if clean and self.rank != 0:
            with contextlib.suppress(OSError):
                self.base.rmdir()  # this node's copy, when it is not rank 0's
        elif clean:
            shutil.rmtree(self.base, ignore_errors=True)
        elif self.rank == 0 and not self.given_base:
            os.write(2, f"mpaccel: per-rank temporary files kept in {self.base}\n".encode())


def _session(config: pytest.Config) -> _MPISession | None:
    return config.stash.get(_KEY, None)


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
def pytest_load_initial_conftests(early_config: pytest.Config) -> Iterator[None]:
    global _stderr_fd
    if _world_size_from_launcher() < 2:
        return (yield)
    if _stderr_fd == 2:
        _stderr_fd = os.dup(2)  # outermost wrapper: runs before capture starts
    try:
        return (yield)
    except Exception as exc:
        _stop_with_the_others(early_config, f"{type(exc).__name__}: {exc}")
        raise


def _stop_with_the_others(config: pytest.Config, error: str) -> None:
    """This rank cannot start (a conftest.py that fails to import here, a pytest_configure that
    raised before ours): the others are on their way to discovery and the start check. Take
    part in both, so that they stop too; pytest then reports the error here as usual."""
    job = _discover_job()
    if job.info.num_processes > 1:
        session = _MPISession(config, job)
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
    if _world_size_from_launcher() < 2:
        return
    job = _discover_job()
    if job.info.num_processes < 2:
        return  # a world of one that MPACCEL_SKIP_LAUNCH_CHECKS lets through: a plain run
    session = _MPISession(config, job)
    config.stash[_KEY] = session
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


def _timeout_for(item: pytest.Item) -> float:
    marker = item.get_closest_marker("mpi_timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return _config_timeout(item.config)


def _config_timeout(config: pytest.Config) -> float:
    for value in (
        config.getoption("--mpi-timeout"),
        config.getini("mpi_timeout"),
        _env.get_float("test_timeout"),
    ):
        if value not in (None, ""):
            return float(value)
    return DEFAULT_TIMEOUT


def _world_size(config: pytest.Config) -> int:
    mpi = _session(config)
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


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def comm() -> Any:
    """The mpi4py COMM_WORLD of the run (a world of one in a plain pytest run)."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        pytest.skip(f"mpi4py cannot load an MPI library: {exc}")
    return MPI.COMM_WORLD


def reset_state() -> None:
    """Forget mpaccel's shared state (PartialState, AcceleratorState, GradientState) so the next
    Accelerator() starts afresh; discovery and the process group are kept. Not collective."""
    from ..state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def state() -> Iterator[Any]:
    """A fresh mpaccel PartialState (shared state reset before and after the test)."""
    from ..state import PartialState

    reset_state()
    yield PartialState()
    reset_state()


@pytest.fixture
def accelerator() -> Iterator[Any]:
    """A fresh mpaccel Accelerator (shared state reset before and after the test)."""
    from ..accelerator import Accelerator

    reset_state()
    yield Accelerator()
    reset_state()


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@pytest.fixture
def mpi_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A directory that is the same on every rank (created by rank 0 before anyone uses it)."""
    mpi = _session(request.config)
    if mpi is None:
        return tmp_path
    name = _UNSAFE.sub("_", request.node.nodeid)[-120:]
    path = mpi.base / "shared" / name
    if mpi.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    # On mpaccel's communicator, not the plugin's: a rank that skipped or failed in an earlier
    # fixture never comes, and its alert makes this wait give up instead of hanging the test.
    mpi.job.comm.barrier("mpi_tmp_path")
    if not path.is_dir():
        raise FileNotFoundError(
            f"mpi_tmp_path: rank 0 created {str(path)!r}, which rank {mpi.rank} does not see: "
            f"{str(mpi.base)!r} is not on a filesystem that every node shares. HINT: run with "
            "--basetemp=DIR, DIR on a shared filesystem (mpi_tmp_path is then DIR/shared/...)"
        )
    return path
