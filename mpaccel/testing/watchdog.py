"""The per-test deadline of the pytest plugin: how long a test may run (`timeout_for`), and a
thread that prints where this rank is stuck and ends the whole job when a test runs past it."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _env

if TYPE_CHECKING:
    import pytest

# What a timed-out job exits with, as timeout(1) does.
TIMEOUT_EXIT_CODE = 124
DEFAULT_TIMEOUT = 300.0


def timeout_for(item: pytest.Item) -> float:
    """The deadline of one test: its mpi_timeout marker's, else the run's."""
    marker = item.get_closest_marker("mpi_timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return config_timeout(item.config)


def config_timeout(config: pytest.Config) -> float:
    """The run's deadline: --mpi-timeout, else the ini option mpi_timeout, else
    MPACCEL_TEST_TIMEOUT, else DEFAULT_TIMEOUT."""
    for value in (
        config.getoption("--mpi-timeout"),
        config.getini("mpi_timeout"),
        _env.get_float("test_timeout"),
    ):
        if value not in (None, ""):
            return float(value)
    return DEFAULT_TIMEOUT


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
                if left <= 0:
                    break
                self._lock.wait(left)
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
        os.write(self._fd, ("\n".join(lines) + "\n").encode(errors="replace"))
        time.sleep(2.0)  # let the other ranks' watchdogs print their stacks too
        try:
            self._abort(TIMEOUT_EXIT_CODE)
        finally:
            os._exit(TIMEOUT_EXIT_CODE)
