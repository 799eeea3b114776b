"""Launcher environments, detected in one ordered place.

The order matters: an MPI launcher inside a Slurm allocation runs its daemons through srun, so
its ranks also carry SLURM_STEP_* variables that describe the daemons, not the ranks. The MPI
launchers' own variables therefore win; srun counts only when no MPI launcher claims the ranks.
"""

from __future__ import annotations

from .._env import Snapshot
from .base import Launcher, ProcessInfo, layout_from_node_keys
from .mpi import HydraLauncher, OpenMPILauncher, PMILauncher, mpi_family
from .single import SingleProcess
from .slurm import SlurmBatchShell, SlurmFacts, SrunLauncher, expand_nodelist

LAUNCHERS: tuple[type[Launcher], ...] = (
    OpenMPILauncher,  # OMPI_COMM_WORLD_SIZE: Open MPI's mpirun, also inside Slurm
    HydraLauncher,  # MPI_LOCALRANKID: MPICH / Intel MPI hydra, also inside Slurm
    SrunLauncher,  # SLURM_STEP_NUM_TASKS + SLURM_PROCID and no MPI launcher: srun --mpi=...
    PMILauncher,  # PMI_SIZE from some other PMI launcher
    SlurmBatchShell,  # SLURM_JOB_ID only: python run straight from the batch script
    SingleProcess,  # plain `python script.py`
)


def detect_launcher(env: Snapshot) -> Launcher:
    for cls in LAUNCHERS:
        if cls.detect(env):
            return cls(env)
    raise AssertionError("SingleProcess.detect always matches")


__all__ = [
    "LAUNCHERS",
    "HydraLauncher",
    "Launcher",
    "OpenMPILauncher",
    "PMILauncher",
    "ProcessInfo",
    "SingleProcess",
    "SlurmBatchShell",
    "SlurmFacts",
    "SrunLauncher",
    "detect_launcher",
    "expand_nodelist",
    "layout_from_node_keys",
    "mpi_family",
]
