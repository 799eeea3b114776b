"""The per-test deadline of the pytest plugin: how long a test may run (`timeout_for`), and a
thread that prints where this rank is stuck and ends the whole job when a test runs past it."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from .. import envvars
from .world import world_rank

if TYPE_CHECKING:
    import pytest

# What a timed-out job exits with, as timeout(1) does.
TIMEOUT_EXIT_CODE = 124
DEFAULT_TIMEOUT = 300.0


def timeout_for(item: pytest.Item) -> float:
    """The deadline of one test: its mpi_timeout marker's, else the run's (0: none)."""
    marker = item.get_closest_marker("mpi_timeout")
    if marker is not None and marker.args:
        return _seconds(marker.args[0], f"@pytest.mark.mpi_timeout of {item.nodeid}")
    return config_timeout(item.config)


def config_timeout(config: pytest.Config) -> float:
    """The run's deadline: --mpi-timeout, else the ini option mpi_timeout, else
    MPACCEL_TEST_TIMEOUT, else DEFAULT_TIMEOUT (0: none). A value that is not a number is a
    usage error (rank 0 says which)."""
    for value, source in (
        (config.getoption("--mpi-timeout"), "--mpi-timeout"),
        (config.getini("mpi_timeout"), "the ini option mpi_timeout"),
    ):
        if value not in (None, ""):
            return _seconds(value, source)
    try:
        seconds = envvars.get_float("test_timeout")
    except ValueError as exc:  # the table's ConfigurationError, naming the variable
        _usage_error(str(exc))
    return DEFAULT_TIMEOUT if seconds is None else seconds


def _seconds(value: object, source: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if math.isnan(seconds) or seconds < 0:
        _usage_error(f"{source}: {value!r} is not a time in seconds "
                     "(a number >= 0; 0 turns the deadline off)")
    return seconds


def _usage_error(text: str) -> NoReturn:
    """pytest's usage error, its text printed by rank 0 alone."""
    import pytest

    raise pytest.UsageError(*([text] if world_rank() == 0 else []))


class Watchdog:
    """A thread that aborts the job when a test runs past its deadline, after printing which test
    and where this rank's main thread is. Every rank has one; the first abort ends them all.

    It fires at most once. `abort` (MPI_Abort) is expected not to return; MPICH's does return
    when called from a thread other than the main one, so the process then ends itself with
    os._exit, which the launcher treats as an abnormal end of the job."""

    def __init__(self, rank: int, size: int, abort: Callable[[int], object], fd: int) -> None:
        self.rank, self.size, self._abort, self._fd = rank, size, abort, fd
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._seconds = 0.0
        self._what = ""
        self._phase = ""
        self._main = threading.main_thread().ident
        self.fired = threading.Event()  # set (once) when the deadline went off
        self._thread = threading.Thread(target=self._run, name="mpaccel-pytest-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self, what: str, seconds: float) -> None:
        """Start the clock for `what`; 0 (or an infinite time) means no deadline."""
        with self._lock:
            self._what, self._seconds = what, seconds
            limited = 0 < seconds < math.inf
            self._deadline = time.monotonic() + seconds if limited else None
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
                if left <= 0:
                    self.fired.set()
                    break
                self._lock.wait(left)
        self._fire()

    def finish(self) -> None:
        """At the end of the run: if the deadline went off, wait here for the abort (the thread
        is a daemon, and a process that ended first would report the run as it stood, e.g.
        passed with exit code 0, after printing TIMEOUT)."""
        if self.fired.is_set():
            self._thread.join()

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
        os.write(self._fd, ("\n".join(lines) + "\n").encode(errors="replace"))
        time.sleep(2.0)  # let the other ranks' watchdogs print their stacks too
        try:
            self._abort(TIMEOUT_EXIT_CODE)
        finally:
            os._exit(TIMEOUT_EXIT_CODE)
