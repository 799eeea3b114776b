"""Slurm: the `srun` launcher, the batch shell, and the cross-checks that turn the classic launch
mistakes into errors with a HINT (the facts they check: slurm_facts.py).

The checks are pure functions of every rank's facts, so each rank reaches the same verdict and
raises the same error without another collective.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .. import envvars
from ..errors import LaunchError, with_hint
from .base import Launcher, ProcessInfo, layout_from_node_keys, mpi_family
from .slurm_facts import Runs, SlurmFacts, runs_of, runs_text

SKIP_HINT = "(set MPACCEL_SKIP_LAUNCH_CHECKS=1 if this layout is intended)"


def _tally(runs: Runs) -> dict[int, int]:
    """How many nodes have each count: the order-free comparison of two per-node layouts."""
    nodes: dict[int, int] = {}
    for count, repeat in runs:
        nodes[count] = nodes.get(count, 0) + repeat
    return nodes


def srun_mpi_hint(mpi_library: str, mpi_type: str | None) -> str:
    family = mpi_family(mpi_library)
    plugin = {"mpich": "pmi2", "openmpi": "pmix", "intel": "pmi2", "mvapich": "pmi2"}.get(family)
    said = f" (this step ran with --mpi={mpi_type})" if mpi_type else ""
    if plugin is None:
        choice = "`srun --mpi=pmi2` for MPICH-based MPIs or `srun --mpi=pmix` for Open MPI"
    else:
        choice = f"`srun --mpi={plugin}` (mpi4py loaded {family})"
    return (
        f"srun started the tasks without an MPI plugin the library understands{said}, so they "
        "cannot form one MPI world (each task is its own world of 1, or MPI_Init aborts). Use "
        f"{choice}; `srun --mpi=list` shows what the cluster offers, and `export "
        "SLURM_MPI_TYPE=...` or MpiDefault in slurm.conf sets it for all steps."
    )


class SrunLauncher(Launcher):
    """`srun` launching the ranks itself (not as the daemon launcher of an mpiexec)."""

    name = "Slurm srun"

    @classmethod
    def detect(cls, env):
        return (
            envvars.is_set("slurm_step_num_tasks", env) and envvars.is_set("slurm_procid", env)
        )

    def expected_world_size(self):
        return envvars.get_int("slurm_step_num_tasks", self.env)

    def size_variable(self):
        return "SLURM_STEP_NUM_TASKS"

    def node_key(self):
        # Slurm's node, not the shared-memory domain: simulated nodes share one host, and on real
        # clusters the two agree. GPU binding and SLURM_LOCALID follow Slurm's node.
        nodename = envvars.get("slurm_nodename", self.env)
        if nodename is not None:
            return nodename
        return envvars.get_int("slurm_nodeid", self.env)

    def singleton_hint(self, mpi_library):
        return srun_mpi_hint(mpi_library, envvars.get("slurm_mpi_type", self.env))

    def mismatch_hint(self, mpi_library):
        return (
            "launch exactly one MPI rank per srun task: either `srun --mpi=... python ...` or "
            "`mpiexec python ...` inside the allocation, not one inside the other. The same "
            "happens when the SLURM_STEP_* variables come from another step (an srun inside an "
            "srun task, or variables exported by hand): launch the ranks with one srun directly. "
            + SKIP_HINT
        )

    # No allocation_notes: srun runs the allocation's own tasks, and check_layout compares
    # the step with the world instead.
    def check_layout(
        self, slurm: Sequence[SlurmFacts], keys: Sequence[Hashable], hosts: Sequence[str]
    ) -> None:
        infos = [layout_from_node_keys(keys, r, hosts[r]) for r in range(len(keys))]
        check_srun_layout(slurm, infos)


class SlurmBatchShell(Launcher):
    """Python started directly in an sbatch script or salloc shell: one process, inside a job."""

    name = "Slurm batch shell (no srun)"

    @classmethod
    def detect(cls, env):
        return envvars.is_set("slurm_job_id", env)

    def expected_world_size(self):
        return None

    def allocation_notes(
        self, slurm: SlurmFacts, world: int, nodes: int | None = None
    ) -> list[str]:
        how = "python ran directly in the batch script (or salloc's shell), not under srun"
        return notes_on_allocation(slurm, how, world, nodes)


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
    step = facts[0]  # (its SLURM_STEP_NUM_TASKS against the world: discovery.check_world_size)
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
    if step.tasks_per_node and _tally(step.tasks_per_node) != _tally(runs_of(observed)):
        raise LaunchError(
            f"Slurm placed {runs_text(step.tasks_per_node)} task(s) per node "
            f"({step.tasks_per_node_variable}) but MPI found {runs_text(runs_of(observed))}",
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


def _job_tasks(facts: SlurmFacts) -> tuple[int, str, bool] | None:
    """(count, where from, exact) of the job's tasks as this process can know them.

    An MPI launcher inside an allocation (hydra, Open MPI's mpirun) starts its daemons as an srun
    step, and its ranks inherit that step: their SLURM_NTASKS, SLURM_NPROCS, SLURM_NNODES and
    SLURM_TASKS_PER_NODE count the daemons (measured: docs/slurm-environment-facts.md). Outside
    a step (the batch shell, or ranks an mpiexec forked itself) SLURM_NTASKS is the job's.
    SLURM_NTASKS_PER_NODE x SLURM_JOB_NUM_NODES bounds it (`-n` may ask for less); hydra's ranks
    keep the job's SLURM_NTASKS_PER_NODE, Open MPI's get 1 from its daemons' step (`srun
    --ntasks-per-node=1`), so in a step a 1 says nothing.
    """
    if not facts.in_step and facts.ntasks is not None:
        return facts.ntasks, f"SLURM_NTASKS={facts.ntasks}", True
    per_node = facts.ntasks_per_node
    if per_node is not None and facts.job_num_nodes is not None:
        if facts.in_step and per_node == 1:
            return None
        source = f"SLURM_NTASKS_PER_NODE={per_node} on SLURM_JOB_NUM_NODES={facts.job_num_nodes}"
        return per_node * facts.job_num_nodes, source, False
    return None


WHOLE_ALLOCATION_HINT = (
    "use `srun --mpi=pmi2 python ...` (MPICH), or `mpiexec python ...` without -n: inside an "
    "allocation, MPICH's mpiexec and Open MPI's mpirun start one rank per Slurm task."
)


def _more_tasks_hint(world: int) -> str:
    return (
        f"ask Slurm for {world} tasks (`sbatch -n {world}` / `salloc -n {world}`), or omit -n "
        "from mpiexec to start one rank per Slurm task."
    )


def allocation_warnings(
    facts: SlurmFacts, launcher: Launcher, world: int, nodes: int | None = None
) -> list[str]:
    """What discovery warns about `launcher`'s launch of `world` processes (on `nodes` Slurm
    nodes, if known) inside the Slurm job `facts` describe: its allocation_notes."""
    return launcher.allocation_notes(facts, world, nodes)


def notes_on_allocation(
    facts: SlurmFacts, how: str, world: int, nodes: int | None = None
) -> list[str]:
    """Suspicious but possibly intended layouts inside a Slurm job (warnings, not errors), for
    `world` processes that a launcher other than srun started (`how` it did, for the messages).

    `nodes`: on how many Slurm nodes (SLURMD_NODENAME) the world's processes run, if known.
    """
    out: list[str] = []
    if not facts.in_job:
        return out
    tasks = _job_tasks(facts)
    if tasks is not None and world < tasks[0]:
        count, source, exact = tasks
        has = f"has {count} tasks" if exact else f"asked for up to {count} tasks"
        message = (
            f"this Slurm job {has} ({source}) but only {world} process(es) joined the MPI "
            f"world: {how}."
        )
        out.append(with_hint(message, WHOLE_ALLOCATION_HINT, " "))
    elif nodes is not None and facts.job_num_nodes is not None and nodes < facts.job_num_nodes:
        message = (
            f"this Slurm job has {facts.job_num_nodes} nodes (SLURM_JOB_NUM_NODES) but its "
            f"{world} MPI process(es) run on {nodes} of them: {how}, and the other node(s) "
            "stay idle."
        )
        out.append(with_hint(message, WHOLE_ALLOCATION_HINT, " "))
    cpus = sum(count * repeat for count, repeat in facts.job_cpus_per_node)
    per_task = facts.cpus_per_task or 1
    if tasks is not None and world > tasks[0]:
        count, source, exact = tasks
        has = f"has {count} tasks" if exact else f"asked for at most {count} tasks"
        message = (
            f"{how}, but this Slurm job {has} ({source}): its CPUs (and GPUs) were allocated "
            "for fewer processes."
        )
        out.append(with_hint(message, _more_tasks_hint(world), " "))
    elif cpus and world * per_task > cpus:
        need = f"{world} rank(s)"
        if facts.cpus_per_task:
            need += f" x {per_task} CPUs (SLURM_CPUS_PER_TASK={facts.cpus_per_task})"
        message = (
            f"{how}, but this Slurm job holds {cpus} CPU(s) (SLURM_JOB_CPUS_PER_NODE="
            f"{runs_text(facts.job_cpus_per_node)}), fewer than {need}: the ranks share CPUs."
        )
        out.append(with_hint(message, _more_tasks_hint(world), " "))
    return out
