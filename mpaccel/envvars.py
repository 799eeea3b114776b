"""The one place mpaccel reads environment variables: one table of every variable, its kind and
the values it accepts, and typed getters that parse through that table.

Launchers consume some of their variables at MPI_Init (MPICH's PMI_*), so discovery takes a
`snapshot()` before mpi4py initialises MPI, validates it whole (`check`) and works from that
frozen copy afterwards. The kinds a variable can hold, and their bounded parsers, are
mpaccel.envvar_kinds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .envvar_kinds import (
    YEAR,
    Choice,
    CountOrAuto,
    Flag,
    Integer,
    JsonObject,
    Kind,
    NodeList,
    Number,
    PerNode,
    Text,
)


@dataclass(frozen=True)
class Variable:
    """One logical setting: the variables that carry it (the first one set wins) and its kind."""

    names: tuple[str, ...]
    kind: Kind


TEXT = Text()
RANK = Integer(0)  # a rank or an index, from 0
COUNT = Integer(1)  # a number of processes, nodes or CPUs, from 1
FLAG = Flag()


def _var(kind: Kind, *names: str) -> Variable:
    return Variable(names, kind)


# logical name -> its variables and kind. Keep this the only list of names: a variable is read
# through this table or not at all, so none escapes validation.
VARIABLES: dict[str, Variable] = {
    # MPI launchers: what the launcher believes the world looks like.
    "ompi_world_size": _var(COUNT, "OMPI_COMM_WORLD_SIZE"),
    "ompi_world_rank": _var(RANK, "OMPI_COMM_WORLD_RANK"),
    "ompi_local_rank": _var(RANK, "OMPI_COMM_WORLD_LOCAL_RANK"),
    "pmi_size": _var(COUNT, "PMI_SIZE"),
    "pmi_rank": _var(RANK, "PMI_RANK"),
    "hydra_local_rank": _var(RANK, "MPI_LOCALRANKID"),
    "hydra_local_size": _var(COUNT, "MPI_LOCALNRANKS"),
    "pmix_rank": _var(RANK, "PMIX_RANK"),
    "pmix_namespace": _var(TEXT, "PMIX_NAMESPACE"),
    "mvapich_world_size": _var(COUNT, "MV2_COMM_WORLD_SIZE"),
    "mpi4py_libmpi": _var(TEXT, "MPI4PY_LIBMPI"),
    "mpi4py_mpiabi": _var(TEXT, "MPI4PY_MPIABI"),
    # Slurm: job (allocation) and step (srun) facts. Ids stay text: they are only passed on.
    "slurm_job_id": _var(TEXT, "SLURM_JOB_ID", "SLURM_JOBID"),
    "slurm_array_job_id": _var(TEXT, "SLURM_ARRAY_JOB_ID"),
    "slurm_array_task_id": _var(TEXT, "SLURM_ARRAY_TASK_ID"),
    "slurm_job_name": _var(TEXT, "SLURM_JOB_NAME"),
    "slurm_restart_count": _var(RANK, "SLURM_RESTART_COUNT"),
    "slurm_step_id": _var(TEXT, "SLURM_STEP_ID", "SLURM_STEPID"),
    "slurm_ntasks": _var(COUNT, "SLURM_NTASKS", "SLURM_NPROCS"),
    "slurm_step_num_tasks": _var(COUNT, "SLURM_STEP_NUM_TASKS"),
    "slurm_step_num_nodes": _var(COUNT, "SLURM_STEP_NUM_NODES"),
    "slurm_job_num_nodes": _var(COUNT, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "slurm_ntasks_per_node": _var(COUNT, "SLURM_NTASKS_PER_NODE"),
    # The job's CPUs per node: the one size that an MPI launcher's srun-started daemons leave
    # to their ranks (their SLURM_NTASKS and *_TASKS_PER_NODE describe the daemons).
    "slurm_job_cpus_per_node": _var(PerNode(), "SLURM_JOB_CPUS_PER_NODE"),
    "slurm_tasks_per_node": _var(PerNode(), "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    "slurm_procid": _var(RANK, "SLURM_PROCID"),
    "slurm_localid": _var(RANK, "SLURM_LOCALID"),
    "slurm_nodeid": _var(RANK, "SLURM_NODEID"),
    "slurm_nodename": _var(TEXT, "SLURMD_NODENAME"),
    "slurm_nodelist": _var(
        NodeList(), "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"
    ),
    "slurm_job_nodelist": _var(NodeList(), "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "slurm_mpi_type": _var(TEXT, "SLURM_MPI_TYPE"),
    "slurm_partition": _var(TEXT, "SLURM_JOB_PARTITION"),
    "slurm_cpus_per_task": _var(COUNT, "SLURM_CPUS_PER_TASK"),
    # Devices: only whether they are set matters (OMP_NUM_THREADS may be a list, "4,2").
    "cuda_visible_devices": _var(TEXT, "CUDA_VISIBLE_DEVICES"),
    "omp_num_threads": _var(TEXT, "OMP_NUM_THREADS"),
    # Experiment trackers: the variables Accelerate's MLflow and ClearML trackers read, which
    # take precedence over the arguments, as there (docs/tracking.md).
    "mlflow_experiment_name": _var(TEXT, "MLFLOW_EXPERIMENT_NAME"),
    "mlflow_run_id": _var(TEXT, "MLFLOW_RUN_ID"),
    "mlflow_tags": _var(JsonObject(), "MLFLOW_TAGS"),
    "mlflow_nested_run": _var(FLAG, "MLFLOW_NESTED_RUN"),
    "clearml_project": _var(TEXT, "CLEARML_PROJECT"),
    "clearml_task": _var(TEXT, "CLEARML_TASK"),
    # mpaccel's own knobs (docs/launching.md).
    "timeout": _var(Number(0.0, YEAR, "seconds", open_low=True), "MPACCEL_TIMEOUT"),
    "master_addr": _var(TEXT, "MPACCEL_MASTER_ADDR"),
    "ifname": _var(TEXT, "MPACCEL_IFNAME"),
    "abort_on_exception": _var(FLAG, "MPACCEL_ABORT_ON_EXCEPTION"),
    "skip_launch_checks": _var(FLAG, "MPACCEL_SKIP_LAUNCH_CHECKS"),
    "debug": _var(FLAG, "MPACCEL_DEBUG", "ACCELERATE_DEBUG_MODE"),
    "mixed_precision": _var(
        Choice(("no", "fp16", "bf16", "fp8")),
        "MPACCEL_MIXED_PRECISION",
        "ACCELERATE_MIXED_PRECISION",
    ),
    "use_cpu": _var(FLAG, "MPACCEL_USE_CPU", "ACCELERATE_USE_CPU"),
    "log_level": _var(
        Choice(("debug", "info", "warning", "warn", "error", "critical", "fatal", "notset")),
        "MPACCEL_LOG_LEVEL",
        "ACCELERATE_LOG_LEVEL",
    ),
    "io_threads": _var(Integer(1, 1024), "MPACCEL_IO_THREADS"),
    "solo_save_wait": _var(Number(0.0, YEAR, "seconds"), "MPACCEL_SOLO_SAVE_WAIT"),
    "allow_pickle": _var(FLAG, "MPACCEL_ALLOW_PICKLE"),
    "mpi_progress": _var(Number(0.0, 60_000.0, "milliseconds"), "MPACCEL_MPI_PROGRESS"),
    "progress": _var(
        Choice(("auto", "bar", "lines", "off", "1", "0", "true", "false", "yes", "no", "on")),
        "MPACCEL_PROGRESS",
    ),
    # Accelerate's FSDP settings (FullyShardedDataParallelPlugin's defaults; docs/training.md).
    "use_fsdp": _var(FLAG, "MPACCEL_USE_FSDP", "ACCELERATE_USE_FSDP"),
    "fsdp_version": _var(Integer(1, 2), "FSDP_VERSION"),
    "fsdp_sharding_strategy": _var(
        # Accelerate's names, and FSDP1's codes (1-5) that older configs wrote.
        Choice(
            (
                *("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"),
                *("1", "2", "3", "4", "5"),
            )
        ),
        "FSDP_SHARDING_STRATEGY",
    ),
    "fsdp_auto_wrap_policy": _var(
        Choice(("transformer_based_wrap", "size_based_wrap", "no_wrap")), "FSDP_AUTO_WRAP_POLICY"
    ),
    "fsdp_transformer_cls_to_wrap": _var(TEXT, "FSDP_TRANSFORMER_CLS_TO_WRAP"),
    "fsdp_min_num_params": _var(Integer(0, 2**63 - 1), "FSDP_MIN_NUM_PARAMS"),
    "fsdp_reshard_after_forward": _var(FLAG, "FSDP_RESHARD_AFTER_FORWARD"),
    "fsdp_state_dict_type": _var(
        Choice(("sharded_state_dict", "full_state_dict")), "FSDP_STATE_DICT_TYPE"
    ),
    "fsdp_cpu_ram_efficient_loading": _var(FLAG, "FSDP_CPU_RAM_EFFICIENT_LOADING"),
    "fsdp_activation_checkpointing": _var(FLAG, "FSDP_ACTIVATION_CHECKPOINTING"),
    "fsdp_offload_params": _var(FLAG, "FSDP_OFFLOAD_PARAMS"),
    "fsdp_ignored_modules": _var(TEXT, "FSDP_IGNORED_MODULES"),
    # Accelerate's ParallelismConfig defaults ("auto": chosen from the nodes, docs/training.md).
    "use_parallelism_config": _var(FLAG, "ACCELERATE_USE_PARALLELISM_CONFIG"),
    "dp_replicate_size": _var(CountOrAuto(), "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"),
    "dp_shard_size": _var(CountOrAuto(), "PARALLELISM_CONFIG_DP_SHARD_SIZE"),
    "tp_size": _var(CountOrAuto(), "PARALLELISM_CONFIG_TP_SIZE"),
    "cp_size": _var(COUNT, "PARALLELISM_CONFIG_CP_SIZE"),
    "cp_backend": _var(Choice(("torch",)), "PARALLELISM_CONFIG_CP_BACKEND"),
    "cp_comm_strategy": _var(
        Choice(("allgather", "alltoall")), "PARALLELISM_CONFIG_CP_COMM_STRATEGY"
    ),
    "sp_size": _var(COUNT, "PARALLELISM_CONFIG_SP_SIZE"),
    "sp_backend": _var(Choice(("deepspeed",)), "PARALLELISM_CONFIG_SP_BACKEND"),
    "tp_across_nodes": _var(FLAG, "MPACCEL_TP_ACROSS_NODES"),
    "test_timeout": _var(Number(0.0, YEAR, "seconds"), "MPACCEL_TEST_TIMEOUT"),
    "mpiexec": _var(TEXT, "MPACCEL_MPIEXEC"),
    "ci": _var(TEXT, "CI"),
}

Snapshot = Mapping[str, str]


def snapshot(environ: Mapping[str, str] | None = None) -> Snapshot:
    """Copy every variable of the table that is set, keyed by *variable* name (read-only)."""
    source = os.environ if environ is None else environ
    names = {name for variable in VARIABLES.values() for name in variable.names}
    return MappingProxyType({name: source[name] for name in names if name in source})


def _variable(logical: str) -> Variable:
    try:
        return VARIABLES[logical]
    except KeyError:
        raise KeyError(f"mpaccel.envvars has no variable named {logical!r}") from None


def source_name(logical: str, env: Mapping[str, str] | None = None) -> str | None:
    """Which variable carries `logical`'s value: the first of its names set to something."""
    source = os.environ if env is None else env
    for name in _variable(logical).names:
        if source.get(name):
            return name
    return None


def is_set(logical: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether one of `logical`'s variables is set (not empty); its value is not looked at."""
    return source_name(logical, env) is not None


def _read(logical: str, env: Mapping[str, str] | None) -> tuple[str, Any] | None:
    """(text, parsed value) of the variable carrying `logical`, or None when none is set."""
    name = source_name(logical, env)
    if name is None:
        return None
    text = (os.environ if env is None else env)[name]
    try:
        return text, _variable(logical).kind.parse(text)
    except ValueError:
        raise _bad_value(name, text, _variable(logical).kind.accepted()) from None


def get(logical: str, env: Mapping[str, str] | None = None) -> str | None:
    """The text of the first variable set for `logical` (checked against its kind), from `env`
    or the live environment; None when none is set."""
    found = _read(logical, env)
    return None if found is None else found[0]


def _typed(logical: str, env: Mapping[str, str] | None, kind: type[Kind]) -> Any:
    if not isinstance(_variable(logical).kind, kind):
        raise TypeError(  # a bug in mpaccel, not in the environment
            f"{logical!r} holds {type(_variable(logical).kind).__name__}, not {kind.__name__}"
        )
    found = _read(logical, env)
    return None if found is None else found[1]


def get_int(logical: str, env: Mapping[str, str] | None = None) -> int | None:
    value: int | None = _typed(logical, env, Integer)
    return value


def get_size(logical: str, env: Mapping[str, str] | None = None) -> int | str | None:
    """Not collective. A CountOrAuto variable: a number of processes, "auto", or None when
    unset."""
    value: int | str | None = _typed(logical, env, CountOrAuto)
    return value


def get_float(logical: str, env: Mapping[str, str] | None = None) -> float | None:
    value: float | None = _typed(logical, env, Number)
    return value


def get_bool(logical: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    value: bool | None = _typed(logical, env, Flag)
    return default if value is None else value


def get_choice(logical: str, env: Mapping[str, str] | None = None) -> str | None:
    value: str | None = _typed(logical, env, Choice)
    return value


def get_json(logical: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    value: dict[str, Any] | None = _typed(logical, env, JsonObject)
    return value


def get_runs(logical: str, env: Mapping[str, str] | None = None) -> tuple[tuple[int, int], ...]:
    """Slurm's per-node counts as (count, repeat) runs; () when unset."""
    value: tuple[tuple[int, int], ...] | None = _typed(logical, env, PerNode)
    return () if value is None else value


def check(env: Mapping[str, str]) -> None:
    """Parse every setting of the table that `env` sets, as the getters would: one
    ConfigurationError naming every variable that holds a value it cannot take."""
    problems = []
    for logical in VARIABLES:
        try:
            _read(logical, env)
        except ValueError as exc:
            problems.append(exc)
    messages = list(dict.fromkeys(str(getattr(p, "message", p)) for p in problems))
    if len(messages) == 1:
        raise problems[0]
    if messages:
        from .errors import ConfigurationError

        raise ConfigurationError(
            "; ".join(messages), "fix or unset each of them (docs/launching.md lists them)."
        )


def _quoted(text: str, limit: int = 120) -> str:
    """repr(text), shortened when long: messages stay readable whatever a variable holds."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


# Variables users set themselves (the others are set by launchers and Slurm).
_USER_PREFIXES = ("MPACCEL_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


def _bad_value(name: str, text: str, accepted: str) -> Exception:
    """The ConfigurationError for variable `name` holding `text` instead of `accepted`."""
    from .errors import ConfigurationError  # a ValueError; imported late: errors is tiny anyway

    if name.startswith(_USER_PREFIXES):
        hint = f"set {name} to such a value, or unset it (docs/launching.md lists the variables)."
    elif name.startswith(("MLFLOW_", "CLEARML_")):
        hint = f"set {name} to such a value, or unset it (docs/tracking.md)."
    else:
        hint = (
            f"fix or unset {name}; launchers and Slurm set their variables themselves, so a "
            "hand-exported one is the usual cause."
        )
    return ConfigurationError(
        f"environment variable {name}={_quoted(text)} is not {accepted}", hint
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
