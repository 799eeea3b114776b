"""The control plane: who is here, has anyone asked to stop (re-exports only).

`base` holds the interface every communicator has (`Comm`) and the world of one (`NullComm`);
`mpi` the MPI one (`MPIComm`); `diagnosis` the "where are you" exchange behind its errors;
`progress` the thread that turns MPI's progress engine where the library needs it.
"""

from .base import Comm, NullComm, agreement
from .mpi import AlertSource, MPIComm
from .progress import ProgressThread

__all__ = ["AlertSource", "Comm", "MPIComm", "NullComm", "ProgressThread", "agreement"]
