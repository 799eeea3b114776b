"""pytest plugin: `mpiexec -n N python -m pytest` gives one report, one exit code, and no hang.

Inert (no MPI_Init, no change to output) unless a launcher started more than one process. Under
MPI it: checks that every rank collected the same tests; combines each test phase's outcome over
MPI (a failure on any rank fails the test everywhere, the report shows each failing rank's
traceback); lets ranks stuck in an mpaccel collective give up when a peer fails; reports from rank
0 only; aborts the job, naming the test and printing every rank's stack, when a test exceeds its
timeout; and gives every rank the same exit code.

The markers and fixtures (`mpi`, `mpi_timeout`, `comm`, `state`, `accelerator`, `mpi_tmp_path`)
work in plain runs too, as a world of one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from _pytest._io import TerminalWriter

from .. import _env
from ..environments import detect_launcher

DEFAULT_TIMEOUT = 300.0
_KEY = pytest.StashKey["_MPISession"]()
_stderr_fd = 2  # the terminal's stderr, saved before pytest's fd capture replaces fd 2


def _world_size_from_launcher() -> int:
    expected = detect_launcher(_env.snapshot()).expected_world_size()
    return expected or 1


class _Watchdog:
    """A thread that aborts the job when a test runs past its deadline, after printing which test
    and where this rank's main thread is. Every rank has one; the first abort ends them all."""

    def __init__(self, rank: int, size: int, abort) -> None:
        self.rank, self.size, self._abort = rank, size, abort
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._phase = ""
        self._main = threading.main_thread().ident
        threading.Thread(target=self._run, name="mpaccel-pytest-watchdog", daemon=True).start()

    def arm(self, what: str, seconds: float) -> None:
        with self._lock:
            self._what, self._seconds = what, seconds
            self._deadline = time.monotonic() + seconds
            self._phase = "setup"
            self._lock.notify()

    def phase(self, phase: str) -> None:
        self._phase = phase

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _run(self) -> None:
        with self._lock:
            while True:
                if self._deadline is None:
                    self._lock.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                self._fire()

    def _fire(self) -> None:
        frame = sys._current_frames().get(self._main)  # type: ignore[arg-type]
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
        tag = f"[mpaccel-pytest rank {self.rank}/{self.size}]"
        lines = [
            f"{tag} TIMEOUT: {self._what} did not finish within {self._seconds:g} s on this rank "
            f"(phase: {self._phase}). Aborting the whole job. Where this rank is:",
            *(f"{tag}   {line}" for line in stack.rstrip().splitlines()),
            f"{tag} HINT: ranks whose stack ends in the outcome exchange finished the test and "
            "were waiting for the others; raise the limit with --mpi-timeout=SECONDS, "
            "@pytest.mark.mpi_timeout(SECONDS) or MPACCEL_TEST_TIMEOUT.",
        ]
        os.write(_stderr_fd, ("\n".join(lines) + "\n").encode(errors="replace"))
        time.sleep(2.0)  # let the other ranks' watchdogs print their stacks too
        self._abort(124)


class _MPISession:
    """Everything the plugin keeps for one run under MPI."""

    def __init__(self, config: pytest.Config) -> None:
        from mpi4py import MPI

        from ..comm import Alerts, MPIComm, install_alerts

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.comm = MPIComm(self.world, default_timeout=1e9, interruptible=False)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.alerts = Alerts(self.world)
        install_alerts(self.alerts)
        self.watchdog = _Watchdog(self.rank, self.size, self.world.Abort)
        base = tempfile.mkdtemp(prefix="mpaccel-pytest-") if self.rank == 0 else None
        self.base = Path(self.comm.bcast(base, what="pytest temporary directory"))
        self.config = config

    def exchange(self, report: pytest.TestReport, secondary: bool) -> None:
        """Collective: make `report` the combined outcome of this phase over all ranks.

        `secondary`: this rank failed only because it gave up waiting for a rank that failed.
        """
        mine = report.outcome
        text = None
        if report.failed:
            if not secondary:
                self.alerts.post(f"{report.nodeid} failed in {report.when}")
            text = _report_text(report)
        outcomes = self.comm.allgather(
            (report.nodeid, report.when, mine, text, secondary), what="pytest outcome exchange"
        )
        ids = {(o[0], o[1]) for o in outcomes}
        if len(ids) != 1:
            detail = ", ".join(f"rank {r}: {o[0]} [{o[1]}]" for r, o in enumerate(outcomes))
            raise RuntimeError(f"ranks are running different tests: {detail}")
        failed = [r for r, o in enumerate(outcomes) if o[2] == "failed"]
        primary = [r for r in failed if not outcomes[r][4]] or failed
        waiting = [r for r in failed if r not in primary]
        self.alerts.drain([r for r in failed if not outcomes[r][4]])
        self._resync_if_needed()
        if failed:
            parts = [f"{report.when} failed on rank(s) {primary} of {self.size}"]
            if waiting:
                parts[0] += f"; rank(s) {waiting} gave up waiting for them in a collective"
            for r in primary:
                parts.append(f"{'=' * 20} rank {r} {'=' * 20}")
                parts.extend(f"[rank {r}] {line}" for line in (outcomes[r][3] or "").splitlines())
            report.outcome = "failed"
            report.longrepr = "\n".join(parts)
            if hasattr(report, "wasxfail"):
                del report.wasxfail
        elif all(o[2] == "skipped" for o in outcomes):
            report.outcome = "skipped"
        elif mine == "skipped":
            # Skipped here, passed elsewhere: count it as passed everywhere, say so in the report.
            report.outcome = "passed"
            report.longrepr = None
        skipped = [r for r, o in enumerate(outcomes) if o[2] == "skipped"]
        if skipped and len(skipped) != self.size:
            report.sections.append(("mpaccel", f"skipped on rank(s) {skipped} only"))

    def _resync_if_needed(self) -> None:
        from .. import state

        discovery = state._discovery
        mpaccel_comm = getattr(discovery, "comm", None)
        broken = int(bool(getattr(mpaccel_comm, "broken", False)))
        if self.comm.allreduce(broken, "max", "pytest resync check"):
            mpaccel_comm.resync()  # type: ignore[union-attr]


def _report_text(report: pytest.TestReport) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    for title, content in report.sections:
        text += f"\n----- {title} -----\n{content}"
    return text


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
    if _world_size_from_launcher() > 1 and _stderr_fd == 2:
        _stderr_fd = os.dup(2)  # outermost wrapper: runs before capture starts
    return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mpi(min_size=None, max_size=None, size=None): run only at these world sizes",
    )
    config.addinivalue_line("markers", "mpi_timeout(seconds): per-test deadline under MPI")
    if _world_size_from_launcher() < 2:
        return
    session = _MPISession(config)
    config.stash[_KEY] = session
    if session.rank != 0 and getattr(config.option, "xmlpath", None):
        config.option.xmlpath = None  # one JUnit XML, from rank 0, with the combined outcomes
    if config.option.basetemp is None:
        # One private base per rank: pytest deletes and renumbers basetemp dirs, which N ranks
        # doing at once in the same place would race on.
        config.option.basetemp = str(session.base / f"rank-{session.rank}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    mpi = _session(session.config)
    if mpi is None or mpi.rank == 0:
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


def pytest_collection_finish(session: pytest.Session) -> None:
    mpi = _session(session.config)
    if mpi is None:
        return
    ids = [item.nodeid for item in session.items]
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
    digests = mpi.comm.allgather((digest, len(ids)), what="pytest collection check")
    if len({d for d, _ in digests}) == 1:
        return
    lists = mpi.comm.allgather(ids, what="pytest collection check")
    reference = lists[0]
    lines = []
    for r, other in enumerate(lists[1:], start=1):
        if other != reference:
            missing = sorted(set(reference) - set(other))[:5]
            extra = sorted(set(other) - set(reference))[:5]
            lines.append(
                f"  rank {r}: {len(other)} tests vs rank 0's {len(reference)}; "
                f"missing {missing or 'none'}, extra {extra or 'none'}"
                + ("" if missing or extra else ", same tests in another order")
            )
    raise pytest.UsageError(
        "ranks collected different tests:\n" + "\n".join(lines) + "\nHINT: collection must not "
        "depend on the rank (rank-dependent skipif at import, random parametrisation, files "
        "created during collection); use @pytest.mark.mpi(...) to restrict world sizes."
    )


def _timeout_for(item: pytest.Item) -> float:
    marker = item.get_closest_marker("mpi_timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    config = item.config
    for value in (
        config.getoption("--mpi-timeout"),
        config.getini("mpi_timeout"),
        _env.get_float("test_timeout"),
    ):
        if value not in (None, ""):
            return float(value)
    return DEFAULT_TIMEOUT


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    mpi = _session(item.config)
    if mpi is None:
        return (yield)
    mpi.watchdog.arm(item.nodeid, _timeout_for(item))
    try:
        return (yield)
    finally:
        mpi.watchdog.disarm()


# What a rank does after a phase's outcome exchange: a watchdog report then says "test body"
# for a rank stuck in the test itself, "... outcome exchange" for one waiting for the others.
_NEXT_PHASE = {"setup": "test body", "call": "teardown", "teardown": "after teardown"}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    mpi = _session(item.config)
    if mpi is not None:
        from ..errors import PeerFailedError

        mpi.watchdog.phase(f"{call.when} outcome exchange")
        secondary = call.excinfo is not None and call.excinfo.errisinstance(PeerFailedError)
        mpi.exchange(report, secondary)
        mpi.watchdog.phase(_NEXT_PHASE[call.when])
    return report


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


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[Any]:
    mpi = _session(session.config)
    if mpi is not None:
        session.exitstatus = mpi.comm.allreduce(int(session.exitstatus), "max", "pytest exit")
        session.config._mpaccel_exitstatus = int(session.exitstatus)  # type: ignore[attr-defined]
    return (yield)


def pytest_unconfigure(config: pytest.Config) -> None:
    mpi = _session(config)
    if mpi is None:
        return
    from ..comm import install_alerts

    install_alerts(None)
    status = getattr(config, "_mpaccel_exitstatus", 1)
    mpi.comm.barrier("pytest cleanup")
    if mpi.rank == 0:
        if status == 0 and config.option.basetemp == str(mpi.base / "rank-0"):
            shutil.rmtree(mpi.base, ignore_errors=True)
        else:
            os.write(2, f"mpaccel: per-rank temporary files kept in {mpi.base}\n".encode())


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
    mpi.comm.barrier("mpi_tmp_path")
    return path
