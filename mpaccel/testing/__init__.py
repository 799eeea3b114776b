"""Testing helpers: the pytest plugin (registered as `mpaccel`) and `run_mpi` for plain pytest."""

from .launch import MPIRun, find_mpiexec, run_mpi
from .plugin import reset_state

__all__ = ["MPIRun", "find_mpiexec", "reset_state", "run_mpi"]
