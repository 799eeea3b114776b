"""The one place mpaccel reads environment variables: a table of logical names to variable names.

Launchers consume some of their variables at MPI_Init (MPICH's PMI_*), so discovery takes a
`snapshot()` before mpi4py initialises MPI and works from that frozen copy afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

# logical name -> variable names, first one set wins. Keep this the only list of names.
VARIABLES: dict[str, tuple[str, ...]] = {
    # MPI launchers: what the launcher believes the world looks like.
    "ompi_world_size": ("OMPI_COMM_WORLD_SIZE",),
    "ompi_world_rank": ("OMPI_COMM_WORLD_RANK",),
    "ompi_local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
    "pmi_size": ("PMI_SIZE",),
    "pmi_rank": ("PMI_RANK",),
    "hydra_local_rank": ("MPI_LOCALRANKID",),
    "hydra_local_size": ("MPI_LOCALNRANKS",),
    "pmix_rank": ("PMIX_RANK",),
    "pmix_namespace": ("PMIX_NAMESPACE",),
    "mvapich_world_size": ("MV2_COMM_WORLD_SIZE",),
    "mpi4py_libmpi": ("MPI4PY_LIBMPI",),
    "mpi4py_mpiabi": ("MPI4PY_MPIABI",),
    # Slurm: job (allocation) and step (srun) facts.
    "slurm_job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "slurm_array_job_id": ("SLURM_ARRAY_JOB_ID",),
    "slurm_array_task_id": ("SLURM_ARRAY_TASK_ID",),
    "slurm_job_name": ("SLURM_JOB_NAME",),
    "slurm_restart_count": ("SLURM_RESTART_COUNT",),
    "slurm_step_id": ("SLURM_STEP_ID", "SLURM_STEPID"),
    "slurm_ntasks": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "slurm_step_num_tasks": ("SLURM_STEP_NUM_TASKS",),
    "slurm_step_num_nodes": ("SLURM_STEP_NUM_NODES",),
    "slurm_job_num_nodes": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "slurm_ntasks_per_node": ("SLURM_NTASKS_PER_NODE",),
    # The job's CPUs per node: the one size that an MPI launcher's srun-started daemons leave
    # to their ranks (their SLURM_NTASKS and *_TASKS_PER_NODE describe the daemons).
    "slurm_job_cpus_per_node": ("SLURM_JOB_CPUS_PER_NODE",),
    "slurm_tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    "slurm_procid": ("SLURM_PROCID",),
    "slurm_localid": ("SLURM_LOCALID",),
    "slurm_nodeid": ("SLURM_NODEID",),
    "slurm_nodename": ("SLURMD_NODENAME",),
    "slurm_nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "slurm_job_nodelist": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "slurm_mpi_type": ("SLURM_MPI_TYPE",),
    "slurm_partition": ("SLURM_JOB_PARTITION",),
    "slurm_cpus_per_task": ("SLURM_CPUS_PER_TASK",),
    # Devices.
    "cuda_visible_devices": ("CUDA_VISIBLE_DEVICES",),
    "omp_num_threads": ("OMP_NUM_THREADS",),
    # mpaccel's own knobs.
    "timeout": ("MPACCEL_TIMEOUT",),
    "master_addr": ("MPACCEL_MASTER_ADDR",),
    "ifname": ("MPACCEL_IFNAME",),
    "abort_on_exception": ("MPACCEL_ABORT_ON_EXCEPTION",),
    "skip_launch_checks": ("MPACCEL_SKIP_LAUNCH_CHECKS",),
    "debug": ("MPACCEL_DEBUG", "ACCELERATE_DEBUG_MODE"),
    "mixed_precision": ("MPACCEL_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION"),
    "use_cpu": ("MPACCEL_USE_CPU", "ACCELERATE_USE_CPU"),
    "log_level": ("MPACCEL_LOG_LEVEL", "ACCELERATE_LOG_LEVEL"),
    "io_threads": ("MPACCEL_IO_THREADS",),
    "mpi_progress": ("MPACCEL_MPI_PROGRESS",),
    "progress": ("MPACCEL_PROGRESS",),
    "test_timeout": ("MPACCEL_TEST_TIMEOUT",),
    "mpiexec": ("MPACCEL_MPIEXEC",),
    "ci": ("CI",),
}

Snapshot = Mapping[str, str]


def snapshot(environ: Mapping[str, str] | None = None) -> Snapshot:
    """Copy every variable of the table that is set, keyed by *variable* name (read-only)."""
    source = os.environ if environ is None else environ
    names = {name for names in VARIABLES.values() for name in names}
    return MappingProxyType({name: source[name] for name in names if name in source})


def get(logical: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value of the first variable set for `logical`, from `env` or the live environment."""
    try:
        names = VARIABLES[logical]
    except KeyError:
        raise KeyError(f"mpaccel._env has no variable named {logical!r}") from None
    source = os.environ if env is None else env
    for name in names:
        value = source.get(name)
        if value is not None and value != "":
            return value
    return None


def source_name(logical: str, env: Mapping[str, str] | None = None) -> str | None:
    """Which variable `get(logical)` would take its value from (for error messages)."""
    source = os.environ if env is None else env
    for name in VARIABLES[logical]:
        if source.get(name):
            return name
    return None


def get_int(logical: str, env: Mapping[str, str] | None = None) -> int | None:
    """`get` parsed as an int; a malformed value is an error that names the variable."""
    value = get(logical, env)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise _bad(logical, env, value, "an integer") from None


def get_float(logical: str, env: Mapping[str, str] | None = None) -> float | None:
    value = get(logical, env)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise _bad(logical, env, value, "a number") from None


def get_bool(logical: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    value = get(logical, env)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise _bad(logical, env, value, "a boolean (1/0, true/false, yes/no, on/off)")


def _bad(logical: str, env: Mapping[str, str] | None, value: str, kind: str) -> Exception:
    from .errors import ConfigurationError  # a ValueError; imported late: errors is tiny anyway

    name = source_name(logical, env)
    return ConfigurationError(
        f"environment variable {name}={value!r} is not {kind}",
        f"fix or unset {name}; launchers and Slurm set their variables themselves, so a "
        "hand-exported one is the usual cause.",
    )


def child_environment(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of this process's environment for a child process, with `overrides` applied."""
    env = dict(os.environ)
    env.update(overrides or {})
    return env


def rank_before_init(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank by its launcher's variables (before MPI_Init), or None."""
    for logical in ("pmi_rank", "ompi_world_rank", "pmix_rank", "slurm_procid"):
        value = get_int(logical, env)
        if value is not None:
            return value
    return None
