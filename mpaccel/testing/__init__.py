"""Testing helpers: the pytest plugin (registered as `mpaccel`) and `run_mpi` for plain pytest."""

from .fixtures import reset_state
from .launch import MPIRun, find_mpiexec, run_mpi

__all__ = ["MPIRun", "find_mpiexec", "reset_state", "run_mpi"]
