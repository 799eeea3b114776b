"""Slurm: the facts a task reads from SLURM_* variables, the `srun` launcher, and the cross-checks
that turn the classic launch mistakes into errors with a HINT.

The checks are pure functions of every rank's facts, so each rank reaches the same verdict and
raises the same error without another collective.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import hostlist

from .. import _env
from .._env import Snapshot
from ..errors import LaunchError
from .base import Launcher, ProcessInfo
from .mpi import mpi_family

SKIP_HINT = "(set MPACCEL_SKIP_LAUNCH_CHECKS=1 if this layout is intended)"


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


_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(expression: str | None) -> list[int]:
    """Slurm's compressed `2(x3),1` -> [2, 2, 2, 1]."""
    if not expression:
        return []
    out: list[int] = []
    for part in expression.split(","):
        match = _TASKS_PER_NODE.match(part.strip())
        if match is None:
            raise LaunchError(
                f"cannot parse SLURM_TASKS_PER_NODE={expression!r} (part {part!r})",
                "this variable is set by Slurm; unset any hand-made value.",
            )
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


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
    tasks_per_node: tuple[int, ...] = ()
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
            return _env.get_int(name, env)

        return cls(
            job_id=_env.get("slurm_job_id", env),
            array_job_id=_env.get("slurm_array_job_id", env),
            array_task_id=_env.get("slurm_array_task_id", env),
            job_name=_env.get("slurm_job_name", env),
            restart_count=integer("slurm_restart_count"),
            step_id=_env.get("slurm_step_id", env),
            ntasks=integer("slurm_ntasks"),
            step_num_tasks=integer("slurm_step_num_tasks"),
            step_num_nodes=integer("slurm_step_num_nodes"),
            job_num_nodes=integer("slurm_job_num_nodes"),
            ntasks_per_node=integer("slurm_ntasks_per_node"),
            tasks_per_node=tuple(expand_tasks_per_node(_env.get("slurm_tasks_per_node", env))),
            procid=integer("slurm_procid"),
            localid=integer("slurm_localid"),
            nodeid=integer("slurm_nodeid"),
            nodename=_env.get("slurm_nodename", env),
            nodelist=tuple(expand_nodelist(_env.get("slurm_nodelist", env))),
            job_nodelist=tuple(expand_nodelist(_env.get("slurm_job_nodelist", env))),
            mpi_type=_env.get("slurm_mpi_type", env),
            partition=_env.get("slurm_partition", env),
        )

    @property
    def in_job(self) -> bool:
        return self.job_id is not None

    @property
    def in_step(self) -> bool:
        """True inside an `srun` step (the batch shell has no SLURM_STEP_NUM_TASKS)."""
        return self.step_num_tasks is not None


def srun_mpi_hint(mpi_library: str, mpi_type: str | None) -> str:
    family = mpi_family(mpi_library)
    plugin = {"mpich": "pmi2", "openmpi": "pmix", "intel": "pmi2", "mvapich": "pmi2"}.get(family)
    said = f" (this step ran with --mpi={mpi_type})" if mpi_type else ""
    if plugin is None:
        choice = "`srun --mpi=pmi2` for MPICH-based MPIs or `srun --mpi=pmix` for Open MPI"
    else:
        choice = f"`srun --mpi={plugin}` (mpi4py loaded {family})"
    return (
        f"srun started the tasks without an MPI plugin the library understands{said}, so each "
        f"task is its own world of 1. Use {choice}; `srun --mpi=list` shows what the cluster "
        "offers, and `export SLURM_MPI_TYPE=...` or MpiDefault in slurm.conf sets it for all steps."
    )


class SrunLauncher(Launcher):
    """`srun` launching the ranks itself (not as the daemon launcher of an mpiexec)."""

    name = "Slurm srun"

    @classmethod
    def detect(cls, env):
        return (
            _env.get("slurm_step_num_tasks", env) is not None
            and _env.get("slurm_procid", env) is not None
        )

    def __init__(self, env: Snapshot) -> None:
        super().__init__(env)
        self.facts = SlurmFacts.from_env(env)

    def expected_world_size(self):
        return self.facts.step_num_tasks

    def node_key(self):
        # Slurm's node, not the shared-memory domain: simulated nodes share one host, and on real
        # clusters the two agree. GPU binding and SLURM_LOCALID follow Slurm's node.
        if self.facts.nodename is not None:
            return self.facts.nodename
        return self.facts.nodeid

    def singleton_hint(self, mpi_library):
        return srun_mpi_hint(mpi_library, self.facts.mpi_type)


class SlurmBatchShell(Launcher):
    """Python started directly in an sbatch script or salloc shell: one process, inside a job."""

    name = "Slurm batch shell (no srun)"

    @classmethod
    def detect(cls, env):
        return _env.get("slurm_job_id", env) is not None

    def expected_world_size(self):
        return None


def check_srun_layout(facts: Sequence[SlurmFacts], infos: Sequence[ProcessInfo]) -> None:
    """Cross-check every rank's Slurm facts against the MPI layout of an srun-launched job.

    `facts[r]` and `infos[r]` belong to rank r. Raises LaunchError (same on every rank).
    """
    world = len(infos)
    if world < 2:
        return
    procids = [f.procid for f in facts]
    if len(set(procids)) != len(procids):
        shared = sorted({p for p in procids if procids.count(p) > 1}, key=str)
        raise LaunchError(
            f"{world} MPI ranks but SLURM_PROCID repeats across tasks (values "
            f"{procids!r}; {shared!r} seen more than once)",
            "something in the job script set SLURM_PROCID for every task, usually a "
            "$SLURM_PROCID (or $SLURM_LOCALID) that the batch shell expanded before srun ran, "
            'as in `srun bash -c "... $SLURM_PROCID"` or `export SLURM_PROCID=...`. Quote it '
            "with single quotes, or drop it: mpaccel reads ranks from MPI. " + SKIP_HINT,
        )
    step = facts[0]
    if step.step_num_tasks is not None and step.step_num_tasks != world:
        raise LaunchError(
            f"this srun step has SLURM_STEP_NUM_TASKS={step.step_num_tasks} but MPI sees "
            f"{world} ranks",
            "launch exactly one MPI rank per srun task: either `srun --mpi=... python ...` or "
            "`mpiexec python ...` inside the allocation, not both. " + SKIP_HINT,
        )
    local_sizes: dict[int, int] = {}
    for info in infos:
        local_sizes[info.node_index] = info.local_num_processes
    observed = [local_sizes[n] for n in sorted(local_sizes)]
    if step.step_num_nodes is not None and step.step_num_nodes != len(observed):
        raise LaunchError(
            f"this srun step spans SLURM_STEP_NUM_NODES={step.step_num_nodes} node(s) but the "
            f"ranks report {len(observed)} distinct node(s) (SLURMD_NODENAME)",
            "the SLURM_* variables were probably inherited from another step; launch the "
            "ranks with one srun directly. " + SKIP_HINT,
        )
    if step.tasks_per_node and sorted(step.tasks_per_node) != sorted(observed):
        raise LaunchError(
            f"Slurm placed {list(step.tasks_per_node)} task(s) per node "
            f"(SLURM_TASKS_PER_NODE) but MPI found {observed}",
            "the SLURM_* variables do not describe this step; launch the ranks with one srun "
            "directly. " + SKIP_HINT,
        )
    if (
        step.ntasks_per_node is not None
        and step.job_num_nodes is not None
        and step.ntasks_per_node * step.job_num_nodes != world
    ):
        wanted = step.ntasks_per_node * step.job_num_nodes
        raise LaunchError(
            f"the job asked for --ntasks-per-node={step.ntasks_per_node} on "
            f"{step.job_num_nodes} node(s) ({wanted} tasks) but this srun step runs {world} "
            f"task(s) laid out as {observed} per node",
            "an `srun -n`/`--ntasks` that disagrees with #SBATCH --ntasks-per-node leaves "
            "cores or GPUs idle or overloads a node; drop -n from srun so it inherits the "
            "job's layout, or make --ntasks = --nodes x --ntasks-per-node. " + SKIP_HINT,
        )


def allocation_warnings(facts: SlurmFacts, launcher: Launcher, world: int) -> list[str]:
    """Suspicious but possibly intended layouts inside a Slurm job (warnings, not errors)."""
    out: list[str] = []
    if not facts.in_job or isinstance(launcher, SrunLauncher):
        return out
    if facts.ntasks is not None and facts.ntasks > world:
        how = (
            "python ran directly in the batch script"
            if isinstance(launcher, SlurmBatchShell)
            else f"{launcher.name} started {world} rank(s)"
        )
        out.append(
            f"this Slurm job has {facts.ntasks} tasks (SLURM_NTASKS) but only {world} process(es) "
            f"joined the MPI world: {how}. HINT: use `srun --mpi=pmi2 python ...` (MPICH) or "
            "`mpiexec python ...` without -n to use the whole allocation."
        )
    return out
