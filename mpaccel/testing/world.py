"""Where this process sits in the run, for the plugin's modules that must know it before (or
after) mpaccel's discovery."""

from __future__ import annotations

import sys

from .. import envvars


def world_rank() -> int:
    """This process's rank in COMM_WORLD; where MPI is not (or no longer) initialised, the
    launcher's word for it, else 0."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return envvars.rank_before_init() or 0
    return int(MPI.COMM_WORLD.Get_rank())
