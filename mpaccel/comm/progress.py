"""A thread that turns MPI's progress engine, for MPI libraries that move messages only while
the sending rank is inside an MPI call (MPACCEL_MPI_PROGRESS)."""

from __future__ import annotations

import threading
from typing import Any

from .. import lifecycle
from ..errors import MpaccelError

_TAG_PROGRESS = 7304  # probed by ProgressThread, never sent


class ProgressThread:
    """Turns MPI's progress engine every `interval` seconds from a thread of its own, for MPI
    libraries that move messages only while the sending rank is inside an MPI call ("manual"
    progress: MPICH over libfabric's tcp provider, for one). There, a rank can finish a collective
    with its last message still queued, then block outside MPI (in gloo's gradient all-reduce,
    on the disk) while a peer waits in MPI for that message: both wait forever (measured:
    docs/benchmarks.md, "The progress thread").

    It probes `comm` (mpaccel's diagnostics communicator) for a tag nobody sends: the probe only
    drives progress (a probe of MPI_COMM_SELF does not: MPICH answers it without the network).
    It sleeps between probes (MPICH's own MPIR_CVAR_ASYNC_PROGRESS thread spins, taking a
    core). Needs MPI_THREAD_MULTIPLE."""

    def __init__(self, comm: Any, interval: float) -> None:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise MpaccelError(
                "MPACCEL_MPI_PROGRESS needs MPI initialised with MPI_THREAD_MULTIPLE",
                "leave mpi4py.rc.thread_level at its default ('multiple'), or use an MPI "
                "library that provides it.",
            )
        self.interval = interval
        self._comm = comm
        self._any = MPI.ANY_SOURCE
        self._finalized = MPI.Is_finalized
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpaccel-mpi-progress", daemon=True)
        self._thread.start()
        lifecycle.at_exit(lifecycle.Stage.STOP_PROGRESS, self.stop)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._finalized():
                return
            self._comm.Iprobe(source=self._any, tag=_TAG_PROGRESS)

    def stop(self) -> None:
        """Idempotent; returns once the thread has made its last MPI call."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
