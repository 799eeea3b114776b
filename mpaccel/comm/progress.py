"""A thread that turns MPI's progress engine, for MPI libraries that move messages only while
the sending rank is inside an MPI call (MPACCEL_MPI_PROGRESS)."""

from __future__ import annotations

import atexit
import threading
from typing import Any

from ..errors import MpaccelError

_TAG_PROGRESS = 7304  # probed by ProgressThread, never sent


class ProgressThread:
    """Turns MPI's progress engine every `interval` seconds from a thread of its own, for MPI
    libraries that move messages only while the sending rank is inside an MPI call ("manual"
    progress: MPICH over libfabric's tcp provider, for one). There, a rank can finish a collective
    with its last message still queued, then block outside MPI (in gloo's gradient all-reduce,
    on the disk) while a peer waits in MPI for that message: both wait forever. Measured:
    `examples/train.py` at n=2 with `MPIR_CVAR_CH4_NETMOD=ofi MPIR_CVAR_NOLOCAL=1` hung in its
    first broadcast (rank 0 had gone on to backward()), 3 runs of 3; with this thread it ran.

    It probes `comm` (mpaccel's diagnostics communicator) for a tag nobody sends: the probe only
    drives progress. (A probe of MPI_COMM_SELF did not: MPICH answers it without the network.)
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
        atexit.register(self.stop)  # at exit, before MPI is finalized

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
