"""One pytest run under MPI: the outcome exchange, the per-phase hooks, the start check and the
cleanup of the ranks' temporary directories. Created by the plugin's pytest_configure."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _pytest._io import TerminalWriter

from .. import lifecycle
from .alerts import Alerts
from .outcomes import PhaseOutcome, collection_mismatch, combine, exit_everywhere
from .watchdog import Watchdog, config_timeout, timeout_for

if TYPE_CHECKING:
    from ..discovery import Discovery

KEY = pytest.StashKey["MPISession"]()

# What a rank does after a phase's outcome exchange: a watchdog report then says "test body"
# for a rank stuck in the test itself, "... outcome exchange" for one waiting for the others.
_NEXT_PHASE = {"setup": "test body", "call": "teardown", "teardown": "after teardown"}


def session_of(config: pytest.Config) -> MPISession | None:
    """The run's MPISession; None in a plain run (a world of one)."""
    return config.stash.get(KEY, None)


def _mpaccel_comm() -> Any:
    """The communicator of mpaccel's own discovery in this process (None before any)."""
    from ..discovery import discovered

    return getattr(discovered(), "comm", None)


class MPISession:
    """Everything the plugin keeps for one run under MPI; registered as a plugin of its own,
    for the hooks that only matter under MPI."""

    def __init__(
        self, config: pytest.Config, job: Discovery, stderr_fd: int,
        watchdog: Watchdog | None = None,
    ) -> None:
        """Collective (the basetemp broadcast). `stderr_fd`: the terminal's stderr, saved before
        pytest's fd capture replaced fd 2. `watchdog`: this rank's, if it already has one (it
        stays armed: the start of the session is under the run's deadline too)."""
        from mpi4py import MPI

        from ..comm import MPIComm

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.comm = MPIComm(self.world, default_timeout=1e9, interruptible=False)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.alerts = Alerts(self.world)
        # The job's communicator (the one tests use) gives up when another rank's test failed.
        self._listener = job.comm if isinstance(job.comm, MPIComm) else None
        if self._listener is not None:
            self._listener.listen(self.alerts)
        self.stderr_fd = stderr_fd
        self.watchdog = watchdog or Watchdog(self.rank, self.size, lifecycle.abort_job, stderr_fd)
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
        self.start_exitcode: int | None = None  # set where another rank stopped before the start
        self._devnull: Any = None  # the silenced terminal of ranks 1..N-1
        self._together = False  # the session is ending on every rank at once (exit_everywhere)
        self._alone: tuple[int, str] | None = None  # (exit code, why): it ends on this rank only

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
        mpaccel_comm = _mpaccel_comm()
        broken = bool(getattr(mpaccel_comm, "broken", False))
        mine = PhaseOutcome.of(report, secondary, self._alerted, self._exit, broken)
        self._alerted, self._exit = False, None
        # One collective per phase: the outcomes and whether a rank's communicator needs a
        # resync travel together (two collectives cost 32 ms a test at 4 ranks on 2 cores).
        outcomes: list[PhaseOutcome] = self.comm.allgather(mine, what="pytest outcome exchange")
        ids = {(o.nodeid, o.when) for o in outcomes}
        if len(ids) != 1:
            detail = ", ".join(f"rank {r}: {o.nodeid} [{o.when}]" for r, o in enumerate(outcomes))
            raise RuntimeError(f"ranks are running different tests: {detail}")
        exits = {r: o.exit for r, o in enumerate(outcomes) if o.exit is not None}
        alerted = [r for r, o in enumerate(outcomes) if o.alerted and r not in exits]
        self.alerts.drain(self._late_alerts + alerted)
        self._late_alerts = []
        if any(o.broken for o in outcomes):
            mpaccel_comm.resync()
        if exits:
            # The alerts of the ranks that exited stay pending until the session's teardown is
            # over: a fixture there waiting in a collective for them gives up (see sessionfinish).
            self._exit_alerts = sorted(exits)
            self._together = True
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
        the collection check: they stop too with a usage error, which rank 0 prints, and every
        rank ends with the exit code pytest gave the rank that stopped (the highest, if several;
        kept in `start_exitcode` for the plugin's pytest_cmdline_main to return)."""
        if self._start_checked:
            return
        self._start_checked = True
        # Called in pytest_unconfigure where this rank stopped: pytest's session (if any) has
        # its exit code by then (3 for a pytest_configure that raised). A conftest.py that did
        # not import stops pytest before there is a session, with a usage error.
        stopped = self.config.pluginmanager.get_plugin("session")
        code = pytest.ExitCode.USAGE_ERROR if stopped is None else stopped.exitstatus
        gathered = self.comm.allgather((error, int(code)), what="pytest start check")
        failed = {r: text for r, (text, _) in enumerate(gathered) if text is not None}
        if not failed:
            return
        worst = max(c for text, c in gathered if text is not None)
        if error is not None:
            if stopped is not None:
                stopped.exitstatus = worst  # what pytest.main returns: after unconfigure
            return
        lines = [f"rank(s) {sorted(failed)} of {self.size} stopped before the tests started:"]
        for r, text in failed.items():
            lines.extend(f"[rank {r}] {line}" for line in text.splitlines())
        lines.append(
            "HINT: see that rank's own output; the usual cause is a package missing or failing "
            "to import on some nodes or ranks."
        )
        self.start_exitcode = worst
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
                self._devnull = open(os.devnull, "w")  # closed in unconfigure
                reporter._tw = TerminalWriter(self._devnull)
            config.pluginmanager.unregister(reporter)
        cache = getattr(config, "cache", None)
        if cache is not None:
            cache.set = lambda key, value: None  # rank 0 alone writes .pytest_cache

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Iterator[Any]:
        # Collecting imports the test modules and conftests: one that hangs on some ranks (a
        # collective at import time that not every rank reaches, a stuck file system) ends the
        # job at the run's deadline too, with every rank's stack, instead of waiting forever.
        self.watchdog.arm("collecting the tests", config_timeout(self.config))
        self.watchdog.phase("importing test modules")
        try:
            return (yield)
        finally:
            self.watchdog.disarm()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors[report.nodeid] = str(report.longrepr)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.watchdog.phase("collection check (waiting for the other ranks)")
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
        self.watchdog.arm(item.nodeid, timeout_for(item))
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

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        # Ctrl-C or pytest.exit outside a test phase (in a plugin's collective, a conftest
        # hook...), unless the outcome exchange ended the session on every rank itself.
        if self._together:
            return
        code = getattr(excinfo.value, "returncode", None)
        self._alone = (pytest.ExitCode.INTERRUPTED if code is None else int(code),
                       _describe(excinfo))

    def pytest_internalerror(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self._alone = (pytest.ExitCode.INTERNAL_ERROR, _describe(excinfo))

    def _end_alone(self) -> None:
        """The session ended on this rank alone: the others wait for it in some collective of
        the plugin that it will never join. End the job now, with this rank's exit code,
        rather than at the deadline."""
        if self._alone is None:
            return
        code, why = self._alone
        first = (why.splitlines() or [""])[0]
        os.write(
            self.stderr_fd,
            f"mpaccel: the session ended on rank {self.rank} alone ({first}); the other ranks "
            f"cannot follow it: ending every rank with exit code {int(code)}\n".encode(
                errors="replace"),
        )
        lifecycle.abort_job(int(code))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Iterator[Any]:
        self._end_alone()
        # pytest tears down what is still set up here (session and module fixtures, and after
        # pytest.exit the interrupted test's): under the deadline too.
        self.watchdog.arm("the session's final teardown", config_timeout(self.config))
        self.watchdog.phase("teardown")
        raised = False
        try:
            return (yield)
        except Exception as exc:
            if not self._exit_alerts:
                raised = True  # this rank then ends with Python's 1: so does every rank
                raise
            # After pytest.exit, a rank's fixture may wait in a collective for one whose own
            # copy was never set up: it gave up (the pending alert); say so, and end as asked.
            first = (str(exc).splitlines() or [""])[0]
            os.write(
                self.stderr_fd,
                f"mpaccel: rank {self.rank}: teardown after pytest.exit failed: "
                f"{type(exc).__name__}: {first}\n".encode(errors="replace"),
            )
        finally:
            self.alerts.drain(self._exit_alerts)
            self._exit_alerts = []
            mine = max(int(session.exitstatus), 1) if raised else int(session.exitstatus)
            status = self.comm.allreduce(mine, "max", "pytest exit")
            session.exitstatus = status
            self.config._mpaccel_exitstatus = status  # type: ignore[attr-defined]
            self.watchdog.disarm()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._start_checked:  # else check_start below stops every rank, as they agree
            self._end_alone()  # where pytest skipped sessionfinish (an error in sessionstart)
        if self._listener is not None:
            self._listener.listen(None)
        self.watchdog.finish()  # a deadline that went off ends the job here, as it said
        if self._devnull is not None:
            self._devnull.close()
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


def _describe(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(excinfo.value)
    return f"{excinfo.typename}: {text}" if text else excinfo.typename
