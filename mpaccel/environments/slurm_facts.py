"""What one task reads from its SLURM_* variables (SlurmFacts), and Slurm's compressed node lists
and per-node counts, parsed without being expanded where they are counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import hostlist

from .. import envvars
from ..envvars import Snapshot
from ..errors import LaunchError


def expand_nodelist(expression: str | None) -> list[str]:
    """`gpu[01-03,07],login1` -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1'].

    Delegates to python-hostlist, the parser Slurm sites already use (zero padding, ranges,
    several bracket groups, nested commas).
    """
    if not expression:
        return []
    try:
        return list(hostlist.expand_hostlist(expression))
    except hostlist.BadHostlist as exc:
        raise LaunchError(
            f"cannot parse the Slurm node list {expression!r}: {exc}",
            "check SLURM_JOB_NODELIST / SLURM_STEP_NODELIST; they are set by Slurm, not by hand.",
        ) from exc


Runs = tuple[tuple[int, int], ...]  # Slurm's `2(x3),1` as ((2, 3), (1, 1)): never expanded


def runs_text(runs: Runs) -> str:
    """((2, 3), (1, 1)) -> '2(x3),1', Slurm's own way of writing per-node counts."""
    return ",".join(f"{count}(x{repeat})" if repeat > 1 else str(count) for count, repeat in runs)


def runs_of(counts: Sequence[int]) -> Runs:
    """[2, 2, 2, 1] -> ((2, 3), (1, 1))."""
    runs: list[tuple[int, int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1] = (count, runs[-1][1] + 1)
        else:
            runs.append((count, 1))
    return tuple(runs)


@dataclass(frozen=True)
class SlurmFacts:
    """What one task reads from its SLURM_* variables (None: not set)."""

    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    job_name: str | None = None
    restart_count: int | None = None
    step_id: str | None = None
    ntasks: int | None = None
    step_num_tasks: int | None = None
    step_num_nodes: int | None = None
    job_num_nodes: int | None = None
    ntasks_per_node: int | None = None
    tasks_per_node: Runs = ()
    tasks_per_node_variable: str | None = None  # SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE
    job_cpus_per_node: Runs = ()
    cpus_per_task: int | None = None
    procid: int | None = None
    localid: int | None = None
    nodeid: int | None = None
    nodename: str | None = None
    nodelist: tuple[str, ...] = ()
    job_nodelist: tuple[str, ...] = ()
    mpi_type: str | None = None
    partition: str | None = None

    @classmethod
    def from_env(cls, env: Snapshot) -> SlurmFacts:
        def integer(name: str) -> int | None:
            return envvars.get_int(name, env)

        return cls(
            job_id=envvars.get("slurm_job_id", env),
            array_job_id=envvars.get("slurm_array_job_id", env),
            array_task_id=envvars.get("slurm_array_task_id", env),
            job_name=envvars.get("slurm_job_name", env),
            restart_count=integer("slurm_restart_count"),
            step_id=envvars.get("slurm_step_id", env),
            ntasks=integer("slurm_ntasks"),
            step_num_tasks=integer("slurm_step_num_tasks"),
            step_num_nodes=integer("slurm_step_num_nodes"),
            job_num_nodes=integer("slurm_job_num_nodes"),
            ntasks_per_node=integer("slurm_ntasks_per_node"),
            tasks_per_node=envvars.get_runs("slurm_tasks_per_node", env),
            tasks_per_node_variable=envvars.source_name("slurm_tasks_per_node", env),
            job_cpus_per_node=envvars.get_runs("slurm_job_cpus_per_node", env),
            cpus_per_task=integer("slurm_cpus_per_task"),
            procid=integer("slurm_procid"),
            localid=integer("slurm_localid"),
            nodeid=integer("slurm_nodeid"),
            nodename=envvars.get("slurm_nodename", env),
            nodelist=tuple(expand_nodelist(envvars.get("slurm_nodelist", env))),
            job_nodelist=tuple(expand_nodelist(envvars.get("slurm_job_nodelist", env))),
            mpi_type=envvars.get("slurm_mpi_type", env),
            partition=envvars.get("slurm_partition", env),
        )

    @property
    def in_job(self) -> bool:
        return self.job_id is not None

    @property
    def in_step(self) -> bool:
        """True inside an `srun` step (the batch shell has no SLURM_STEP_NUM_TASKS)."""
        return self.step_num_tasks is not None
