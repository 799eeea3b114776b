"""Launcher environments, detected in one ordered place.

The order matters: an MPI launcher inside a Slurm allocation runs its daemons through srun, so
its ranks also carry SLURM_STEP_* variables that describe the daemons, not the ranks. The MPI
launchers' own variables therefore win; srun counts only when no MPI launcher claims the ranks.
Between two MPI launchers, the MPI library decides once it is known (the other's variables are
left over from another launch).
"""

from __future__ import annotations

from ..envvars import Snapshot
from .base import Launcher, ProcessInfo, layout_from_node_keys, mpi_family
from .mpi import HydraLauncher, OpenMPILauncher, PMILauncher, leftover_notes
from .single import SingleProcess
from .slurm import SlurmBatchShell, SrunLauncher
from .slurm_facts import SlurmFacts, expand_nodelist

LAUNCHERS: tuple[type[Launcher], ...] = (
    OpenMPILauncher,  # OMPI_COMM_WORLD_SIZE: Open MPI's mpirun, also inside Slurm
    HydraLauncher,  # MPI_LOCALRANKID: MPICH / Intel MPI hydra, also inside Slurm
    SrunLauncher,  # SLURM_STEP_NUM_TASKS + SLURM_PROCID and no MPI launcher: srun --mpi=...
    PMILauncher,  # PMI_SIZE from some other PMI launcher
    SlurmBatchShell,  # SLURM_JOB_ID only: python run straight from the batch script
    SingleProcess,  # plain `python script.py`
)


def detect_launcher(env: Snapshot, mpi_library: str | None = None) -> Launcher:
    """The first launcher of LAUNCHERS whose variables are set; knowing the library mpi4py
    loaded, one of its family's MPI launchers rather than another MPI's listed before it."""
    found = [cls for cls in LAUNCHERS if cls.detect(env)]
    chosen = found[0]
    if mpi_library is not None and chosen.families:
        family = mpi_family(mpi_library)
        chosen = next((cls for cls in found if family in cls.families), chosen)
    return chosen(env)


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
    "leftover_notes",
    "mpi_family",
]
