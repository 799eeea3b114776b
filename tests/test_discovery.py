"""Process discovery from synthetic launcher environments (the torch.distributed rendezvous is in
test_distributed.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from mpaccel import envvars
from mpaccel.discovery import check_world_size, discover
from mpaccel.environments import (
    HydraLauncher,
    OpenMPILauncher,
    PMILauncher,
    ProcessInfo,
    SingleProcess,
    SlurmBatchShell,
    SlurmFacts,
    SrunLauncher,
    detect_launcher,
    expand_nodelist,
    layout_from_node_keys,
    leftover_notes,
    mpi_family,
)
from mpaccel.environments.mpi import check_pmix_before_init
from mpaccel.environments.slurm import allocation_warnings, check_srun_layout
from mpaccel.environments.slurm_facts import runs_of, runs_text
from mpaccel.errors import ConfigurationError, LaunchError

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."
OPENMPI = "Open MPI v5.0.11, package: Open MPI ..."
# what MPICH's hydra sets in each rank it starts by itself, for a world of 2
HYDRA_RANK = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "5", "MPI_LOCALRANKID": "0",
              "MPI_LOCALNRANKS": "2"}


def layouts(keys):
    return [layout_from_node_keys(keys, r, f"h{keys[r]}") for r in range(len(keys))]


def test_two_nodes_of_four():
    infos = layouts(["a"] * 4 + ["b"] * 4)
    assert [i.local_process_index for i in infos] == [0, 1, 2, 3] * 2
    assert [i.node_index for i in infos] == [0] * 4 + [1] * 4
    assert {i.num_nodes for i in infos} == {2}
    assert {i.local_num_processes for i in infos} == {4}
    assert [i.is_local_main_process for i in infos] == [True, False, False, False] * 2
    assert [i.is_last_process for i in infos] == [False] * 7 + [True]


def test_uneven_interleaved_nodes():
    # round-robin placement (mpirun --map-by node) and a node with a single rank
    keys = ["x", "y", "x", "y", "z", "x"]
    infos = layouts(keys)
    assert [i.node_index for i in infos] == [0, 1, 0, 1, 2, 0]
    assert [i.local_process_index for i in infos] == [0, 0, 1, 1, 0, 2]
    assert [i.local_num_processes for i in infos] == [3, 2, 3, 2, 1, 3]
    assert infos[4].is_local_main_process and infos[4].num_nodes == 3


def test_process_info_is_frozen_and_validated():
    info = ProcessInfo.single("host")
    with pytest.raises(AttributeError):
        info.process_index = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        ProcessInfo(4, 4, 0, 1, 0, 1, "h")


@pytest.mark.parametrize(
    ("env", "launcher", "expected"),
    [
        ({}, SingleProcess, 1),
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}, OpenMPILauncher, 4),
        ({"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALRANKID": "2"}, HydraLauncher, 4),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"}, SrunLauncher, 4),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, SlurmBatchShell, None),
        ({"PMI_SIZE": "2", "PMI_RANK": "0"}, PMILauncher, 2),
        # hydra inside a Slurm allocation: the step variables describe hydra's proxies
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_PROCID": "1",
                "PMI_SIZE": "8",
                "MPI_LOCALRANKID": "3",
            },
            HydraLauncher,
            8,
        ),
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_PROCID": "0",
                "OMPI_COMM_WORLD_SIZE": "8",
            },
            OpenMPILauncher,
            8,
        ),
    ],
)
def test_launcher_detection(env, launcher, expected):
    found = detect_launcher(envvars.snapshot(env))
    assert type(found) is launcher
    assert found.expected_world_size() == expected


def test_mpi_family():
    assert mpi_family(MPICH) == "mpich"
    assert mpi_family(OPENMPI) == "openmpi"
    assert mpi_family("Intel(R) MPI Library 2021.6") == "intel"
    assert mpi_family("MVAPICH2 2.3") == "mvapich"
    assert mpi_family("???") == "unknown"


def _launch_error(launcher, size, library) -> LaunchError:
    with pytest.raises(LaunchError) as info:
        check_world_size(launcher, size, library)
    return info.value


def test_silent_singletons_under_srun_without_mpi_plugin():
    env = envvars.snapshot(
        {
            "SLURM_JOB_ID": "1",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_PROCID": "2",
            "SLURM_MPI_TYPE": "none",
        }
    )
    error = _launch_error(detect_launcher(env), 1, MPICH)
    assert "silent singletons" in error.message
    assert "srun --mpi=pmi2" in error.hint and "--mpi=none" in error.hint
    error = _launch_error(detect_launcher(env), 1, OPENMPI)
    assert "srun --mpi=pmix" in error.hint


def test_silent_singletons_mpich_launcher_openmpi_library():
    env = envvars.snapshot({"PMI_SIZE": "4", "PMI_RANK": "0", "MPI_LOCALRANKID": "0"})
    error = _launch_error(detect_launcher(env), 1, OPENMPI)
    assert "MPI4PY_LIBMPI=libmpich.so.12" in error.hint
    assert "Open MPI's mpirun" in error.hint


def test_silent_singletons_openmpi_launcher_mpich_library():
    env = envvars.snapshot({"OMPI_COMM_WORLD_SIZE": "4"})
    error = _launch_error(detect_launcher(env), 1, MPICH)
    assert "MPI4PY_LIBMPI=libmpi.so.40" in error.hint


def test_world_size_disagreement_that_is_not_singletons():
    env = envvars.snapshot({"OMPI_COMM_WORLD_SIZE": "4"})
    error = _launch_error(detect_launcher(env), 2, OPENMPI)
    assert error.message == (
        "Open MPI mpirun says the job has 4 processes (OMPI_COMM_WORLD_SIZE=4), but MPI sees a "
        "world of 2"
    )
    # not the hint for a world of 1: these processes did find each other
    assert "OMPI_COMM_WORLD_SIZE does not describe this MPI world" in error.hint
    assert "mpirun started several processes but each one" not in error.hint


def test_srun_step_disagreeing_with_a_world_larger_than_one():
    # e.g. ranks that found each other through PMI, in an srun step of another size
    env = envvars.snapshot(
        {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_PROCID": "1", "PMI_RANK": "1", "PMI_SIZE": "2"}
    )
    error = _launch_error(detect_launcher(env), 2, MPICH)
    assert error.message == (
        "Slurm srun says the job has 4 processes (SLURM_STEP_NUM_TASKS=4), but MPI sees a "
        "world of 2"
    )
    assert error.hint.startswith("launch exactly one MPI rank per srun task")
    assert "world of 1" not in error.hint and "--mpi=pmi2" not in error.hint
    # a world of 1 keeps the hint about srun's MPI plugin
    error = _launch_error(detect_launcher(env), 1, MPICH)
    assert "(SLURM_STEP_NUM_TASKS=4)" in error.message
    assert "each task is its own world of 1" in error.hint and "srun --mpi=pmi2" in error.hint


def test_a_stale_open_mpi_variable_under_hydra_is_named_not_trusted():
    env = envvars.snapshot({**HYDRA_RANK, "OMPI_COMM_WORLD_SIZE": "4"})
    assert type(detect_launcher(env)) is OpenMPILauncher  # before the library is known
    launcher = detect_launcher(env, MPICH)
    assert type(launcher) is HydraLauncher
    check_world_size(launcher, 2, MPICH)  # hydra's count is the world's
    [note] = leftover_notes(env, launcher, MPICH)
    assert note.startswith(
        "OMPI_COMM_WORLD_SIZE='4' is set as if Open MPI mpirun had started this process, but "
        "MPICH hydra mpiexec did (PMI_SIZE=2; mpi4py loaded 'MPICH Version: 5.0.2')"
    )
    assert "HINT: unset OMPI_COMM_WORLD_SIZE" in note


def test_stale_hydra_variables_under_open_mpi_are_named_not_trusted():
    env = envvars.snapshot({**HYDRA_RANK, "OMPI_COMM_WORLD_SIZE": "2"})
    launcher = detect_launcher(env, OPENMPI)
    assert type(launcher) is OpenMPILauncher
    [note] = leftover_notes(env, launcher, OPENMPI)
    assert note.startswith("MPI_LOCALRANKID='0' is set as if MPICH hydra mpiexec had started")


def test_a_launcher_of_another_mpi_alone_is_not_called_stale():
    # Open MPI's mpirun really started it; mpi4py loaded MPICH: a launch error, not a warning
    env = envvars.snapshot({"OMPI_COMM_WORLD_SIZE": "2"})
    launcher = detect_launcher(env, MPICH)
    assert type(launcher) is OpenMPILauncher
    assert leftover_notes(env, launcher, MPICH) == []
    hydra = envvars.snapshot(HYDRA_RANK)
    assert leftover_notes(hydra, detect_launcher(hydra, MPICH), MPICH) == []


# what Open MPI 5's mpirun sets (measured), besides OMPI_COMM_WORLD_LOCAL_*/NODE_RANK
OPEN_MPI_RANK = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
                 "PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-vm-18091@1", "PRTE_LAUNCHED": "1"}


def test_open_mpi_launch_of_mpich_without_pmix_is_refused_before_init():
    env = envvars.snapshot(OPEN_MPI_RANK)
    with pytest.raises(LaunchError) as info:
        check_pmix_before_init(detect_launcher(env, MPICH), env, MPICH)
    assert info.value.message.startswith(
        "a PMIx launcher started this process (Open MPI mpirun; PMIX_RANK='0', "
        "PMIX_NAMESPACE='prterun-vm-18091@1'), but mpi4py loaded 'MPICH Version: 5.0.2'"
    )
    assert "MPI4PY_LIBMPI=libmpi.so.40" in info.value.hint
    assert "Open MPI's mpirun" in info.value.hint
    # the libraries whose MPI_Init copes with PMIx, and processes no PMIx launcher started
    check_pmix_before_init(detect_launcher(env), env, OPENMPI)
    check_pmix_before_init(detect_launcher(env), env, MPICH + "\nMPICH configure: --with-pmix")
    check_pmix_before_init(detect_launcher(envvars.snapshot({})), envvars.snapshot({}), MPICH)


def _without_launcher_variables() -> dict[str, str]:
    prefixes = ("PMI_", "PMIX_", "MPI_LOCAL", "HYDI_", "HYDRA_", "OMPI_", "PRTE_", "SLURM",
                "MPIR_", "MPACCEL_", "MV2_")
    return {k: v for k, v in envvars.child_environment().items() if not k.startswith(prefixes)}


def test_open_mpi_launch_of_mpich_raises_the_hint_instead_of_aborting_in_mpi_init():
    from mpi4py import MPI

    library = MPI.Get_library_version()
    if mpi_family(library) != "mpich" or "pmix" in library.lower():
        pytest.skip("needs an MPICH without PMIx, whose MPI_Init aborts under a PMIx launcher")
    env = {**_without_launcher_variables(), **OPEN_MPI_RANK}
    code = "from mpaccel.discovery import discover; discover()"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1, run.stderr  # an uncaught Python exception, not MPI_Abort
    assert "mpaccel.errors.LaunchError: a PMIx launcher started this process" in run.stderr
    assert "HINT: the job was started by Open MPI's mpirun" in run.stderr
    assert "Fatal error in internal_Init_thread" not in run.stderr


@pytest.mark.mpi(min_size=2)
@pytest.mark.mpi_timeout(60)  # a rank left waiting for the one that raised would hang
def test_a_launcher_count_one_rank_disagrees_with_fails_every_rank_alike(comm):
    # the last rank's PMI_SIZE is off (a hand-made value): its verdict is everyone's, so every
    # rank raises the same error and none waits in a collective for the one that raised
    size = comm.size
    wrong = size + 1 if comm.rank == size - 1 else size
    env = {**HYDRA_RANK, "PMI_RANK": str(comm.rank), "MPI_LOCALRANKID": str(comm.rank),
           "PMI_SIZE": str(wrong)}
    with pytest.raises(LaunchError) as info:
        discover(default_timeout=30, env=envvars.snapshot(env))
    assert info.value.message == (
        f"on rank {size - 1} ({socket.gethostname()}) only: MPICH hydra mpiexec says the job has "
        f"{size + 1} processes (PMI_SIZE={size + 1}), but MPI sees a world of {size}"
    )
    assert comm.allgather(str(info.value)) == [str(info.value)] * size


@pytest.mark.mpi(min_size=2)
@pytest.mark.mpi_timeout(60)  # the ranks that parsed theirs would wait for the one that raised
def test_a_variable_malformed_on_one_rank_fails_every_rank_alike(comm):
    size = comm.size
    env = {**HYDRA_RANK, "PMI_RANK": str(comm.rank), "MPI_LOCALRANKID": str(comm.rank),
           "PMI_SIZE": str(size), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NUM_NODES": "x" if comm.rank == 0 else "1"}
    with pytest.raises(ConfigurationError) as info:
        discover(default_timeout=30, env=envvars.snapshot(env))
    assert info.value.message == (
        f"on rank 0 ({socket.gethostname()}) only: environment variable "
        "SLURM_JOB_NUM_NODES='x' is not an integer from 1 to 2147483647"
    )
    assert comm.allgather(str(info.value)) == [str(info.value)] * size


def test_consistent_world_passes():
    env = envvars.snapshot({"PMI_SIZE": "4", "MPI_LOCALRANKID": "0"})
    check_world_size(detect_launcher(env), 4, MPICH)
    check_world_size(detect_launcher(envvars.snapshot({})), 1, MPICH)


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("n[1-2]") == ["n1", "n2"]
    assert expand_nodelist("rack[1-2]-n[01-02]") == [
        "rack1-n01",
        "rack1-n02",
        "rack2-n01",
        "rack2-n02",
    ]
    assert expand_nodelist(None) == []
    with pytest.raises(LaunchError, match="cannot parse"):
        expand_nodelist("gpu[01-")


def test_tasks_per_node_are_runs_never_expanded():
    env = {"SLURM_JOB_ID": "1", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_CPUS_PER_NODE": "4"}
    facts = SlurmFacts.from_env(envvars.snapshot(env))
    assert facts.tasks_per_node == ((2, 3), (1, 1)) and facts.job_cpus_per_node == ((4, 1),)
    assert runs_text(facts.tasks_per_node) == "2(x3),1"
    assert runs_of([2, 2, 2, 1]) == ((2, 3), (1, 1)) and runs_text(runs_of([])) == ""


def test_unparseable_tasks_per_node_names_the_variable_read():
    # srun sets both; the step's is the one read, and the one to name
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x", "SLURM_TASKS_PER_NODE": "2"}
    with pytest.raises(ConfigurationError) as info:
        SlurmFacts.from_env(envvars.snapshot(env))
    assert info.value.message.startswith(
        "environment variable SLURM_STEP_TASKS_PER_NODE='2(x' is not Slurm's per-node counts "
        "such as '2(x3),1'"
    )
    assert info.value.hint.startswith("fix or unset SLURM_STEP_TASKS_PER_NODE; launchers and")
    with pytest.raises(ConfigurationError, match=r"SLURM_JOB_CPUS_PER_NODE='3,x' is not"):
        SlurmFacts.from_env(
            envvars.snapshot({"SLURM_JOB_ID": "1", "SLURM_JOB_CPUS_PER_NODE": "3,x"}))


def srun_facts(n_nodes, per_node, **overrides):
    facts = []
    for node in range(n_nodes):
        for local in range(per_node):
            env = {
                "SLURM_JOB_ID": "42",
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NUM_TASKS": str(n_nodes * per_node),
                "SLURM_STEP_NUM_NODES": str(n_nodes),
                "SLURM_JOB_NUM_NODES": str(n_nodes),
                "SLURM_TASKS_PER_NODE": f"{per_node}(x{n_nodes})",
                "SLURM_PROCID": str(node * per_node + local),
                "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node),
                "SLURMD_NODENAME": f"n{node + 1}",
                "SLURM_JOB_NODELIST": f"n[1-{n_nodes}]",
            }
            env.update(overrides)
            facts.append(SlurmFacts.from_env(envvars.snapshot(env)))
    keys = [f.nodename for f in facts]
    return facts, layouts(keys)


def test_srun_layout_ok():
    facts, infos = srun_facts(2, 4)
    check_srun_layout(facts, infos)
    assert facts[5].job_nodelist == ("n1", "n2")
    assert [i.node_index for i in infos] == [0] * 4 + [1] * 4


def test_srun_same_procid_everywhere():
    facts, infos = srun_facts(2, 2, SLURM_PROCID="0")
    with pytest.raises(LaunchError) as info:
        check_srun_layout(facts, infos)
    assert "SLURM_PROCID repeats" in info.value.message
    assert "$SLURM_PROCID" in info.value.hint and "single quotes" in info.value.hint


def test_ntasks_per_node_mismatch():
    # sbatch -N 2 --ntasks-per-node=4, then `srun -n 4`: 2 per node, half the node idle
    facts, infos = srun_facts(2, 2, SLURM_NTASKS_PER_NODE="4")
    with pytest.raises(LaunchError) as info:
        check_srun_layout(facts, infos)
    assert "--ntasks-per-node=4" in info.value.message
    assert "drop -n from srun" in info.value.hint


def test_tasks_per_node_disagrees_with_mpi():
    facts, infos = srun_facts(2, 2, SLURM_TASKS_PER_NODE="3,1")
    with pytest.raises(LaunchError, match=r"placed 3,1 task\(s\) per node \(SLURM_TASKS_PER_NODE\) "
                       r"but MPI found 2\(x2\)\n"):
        check_srun_layout(facts, infos)
    facts, infos = srun_facts(2, 2, SLURM_STEP_TASKS_PER_NODE="3,1")
    with pytest.raises(LaunchError, match=r"per node \(SLURM_STEP_TASKS_PER_NODE\) but MPI"):
        check_srun_layout(facts, infos)


def test_size_one_skips_layout_checks():
    facts, infos = srun_facts(1, 1)
    check_srun_layout(facts, infos)


def test_batch_shell_warns_when_allocation_is_wider():
    env = envvars.snapshot({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4"})
    launcher = detect_launcher(env)
    notes = allocation_warnings(SlurmFacts.from_env(env), launcher, 1)
    assert len(notes) == 1 and "python ran directly in the batch script" in notes[0]
    assert notes[0].startswith("this Slurm job has 4 tasks (SLURM_NTASKS=4) but only 1 ")
    assert allocation_warnings(SlurmFacts.from_env(envvars.snapshot({})), launcher, 1) == []


def hydra_rank(rank, size, job, nodename="n1", proxies=1, **extra):
    """What a rank that MPICH's hydra started inside a Slurm allocation sees (measured with
    salloc, docs/slurm-environment-facts.md): hydra starts one proxy per node it uses as an srun
    step, and the rank inherits that step, so SLURM_NTASKS & co. count the proxies."""
    per_node = "1" if proxies == 1 else f"1(x{proxies})"
    return {
        "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NTASKS": str(proxies), "SLURM_NPROCS": str(proxies),
        "SLURM_STEP_NUM_TASKS": str(proxies), "SLURM_NNODES": str(proxies),
        "SLURM_STEP_NUM_NODES": str(proxies), "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURMD_NODENAME": nodename,
        "PMI_RANK": str(rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": "0",
        **job, **extra,
    }


def open_mpi_rank(rank, size, job, proxies=1):
    """The same for Open MPI 5's mpirun (measured with salloc): its daemons' step is started with
    `srun --ntasks-per-node=1`, so SLURM_NTASKS_PER_NODE is 1 whatever the job asked for."""
    env = hydra_rank(rank, size, job, proxies=proxies, SLURM_NTASKS_PER_NODE="1")
    for name in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"):
        del env[name]
    return {**env, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "PMIX_RANK": str(rank)}


def _notes(env, world, nodes):
    env = envvars.snapshot(env)
    return allocation_warnings(SlurmFacts.from_env(env), detect_launcher(env), world, nodes)


@pytest.mark.parametrize(
    ("command", "env", "world", "nodes", "expected"),
    [
        (
            "salloc -N2 --ntasks-per-node=2 mpiexec -n 2",
            hydra_rank(0, 2, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
                              "SLURM_NTASKS_PER_NODE": "2"}),
            2, 1,
            "this Slurm job asked for up to 4 tasks (SLURM_NTASKS_PER_NODE=2 on "
            "SLURM_JOB_NUM_NODES=2) but only 2 process(es) joined the MPI world: MPICH hydra "
            "mpiexec started 2 rank(s).",
        ),
        (
            "salloc -N2 -n4 mpiexec -n 2",  # hydra fills n1's 3 CPUs first: n2 unused
            hydra_rank(0, 2, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "3,1"}),
            2, 1,
            "this Slurm job has 2 nodes (SLURM_JOB_NUM_NODES) but its 2 MPI process(es) run on "
            "1 of them",
        ),
        (
            "salloc -N1 -n2 mpiexec -n 4",
            hydra_rank(0, 4, {"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_CPUS_PER_NODE": "2"}),
            4, 1,
            "MPICH hydra mpiexec started 4 rank(s), but this Slurm job holds 2 CPU(s) "
            "(SLURM_JOB_CPUS_PER_NODE=2), fewer than 4 rank(s): the ranks share CPUs.",
        ),
        (
            "salloc -N1 -n2 -c2 mpiexec -n 3",
            hydra_rank(0, 3, {"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_CPUS_PER_NODE": "4",
                              "SLURM_CPUS_PER_TASK": "2"}),
            3, 1,
            "holds 4 CPU(s) (SLURM_JOB_CPUS_PER_NODE=4), fewer than 3 rank(s) x 2 "
            "CPUs (SLURM_CPUS_PER_TASK=2)",
        ),
        (
            "salloc -N2 --ntasks-per-node=2 mpiexec -n 6",
            hydra_rank(0, 6, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
                              "SLURM_NTASKS_PER_NODE": "2"}, proxies=2),
            6, 2,
            "MPICH hydra mpiexec started 6 rank(s), but this Slurm job asked for at most 4 tasks "
            "(SLURM_NTASKS_PER_NODE=2 on SLURM_JOB_NUM_NODES=2)",
        ),
        (
            # Open MPI's daemons' step sets SLURM_NTASKS_PER_NODE=1: the CPUs tell instead
            "salloc -N1 -n2 mpirun -n 4",
            open_mpi_rank(0, 4, {"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_CPUS_PER_NODE": "2"}),
            4, 1,
            "Open MPI mpirun started 4 rank(s), but this Slurm job holds 2 CPU(s)",
        ),
        (
            # ranks hydra forks itself (-launcher fork) inherit the job's SLURM_NTASKS unchanged
            "salloc -N1 -n4 mpiexec -launcher fork -n 2",
            {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
             "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_JOB_CPUS_PER_NODE": "4", **HYDRA_RANK},
            2, None,
            "this Slurm job has 4 tasks (SLURM_NTASKS=4) but only 2 process(es) joined",
        ),
    ],
)
def test_mpiexec_inside_an_allocation_of_another_size_warns(command, env, world, nodes, expected):
    [note] = _notes(env, world, nodes)
    assert expected in note, (command, note)
    assert "HINT: " in note and ("without -n" in note or "omit -n from mpiexec" in note)


@pytest.mark.parametrize(
    ("command", "env", "world", "nodes"),
    [
        (
            "salloc -N2 -n4 mpiexec",  # placed 3+1 like the job's tasks
            hydra_rank(0, 4, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "3,1"},
                       proxies=2),
            4, 2,
        ),
        (
            "salloc -N2 --ntasks-per-node=2 mpiexec",
            hydra_rank(0, 4, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
                              "SLURM_NTASKS_PER_NODE": "2"}, proxies=2),
            4, 2,
        ),
        (
            "salloc -N1 -n2 -c2 mpiexec",
            hydra_rank(0, 2, {"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_CPUS_PER_NODE": "4",
                              "SLURM_CPUS_PER_TASK": "2"}),
            2, 1,
        ),
        (
            "salloc -N2 --ntasks-per-node=2 mpirun",  # SLURM_NTASKS_PER_NODE=1: the daemons'
            open_mpi_rank(0, 4, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)"},
                          proxies=2),
            4, 2,
        ),
    ],
)
def test_mpiexec_using_the_whole_allocation_does_not_warn(command, env, world, nodes):
    assert _notes(env, world, nodes) == [], command


@pytest.mark.parametrize(
    "keys, cores, expected",
    [
        # 4 ranks on one 2-core node, each allowed on both cores: oversubscribed
        (["a"] * 4, [frozenset({0, 1})] * 4, [True] * 4),
        # 4 ranks bound one per core of a 4-core node: each sees 1 core, but together 4
        (["a"] * 4, [frozenset({i}) for i in range(4)], [False] * 4),
        # 2 nodes: node a has 3 ranks on 2 cores, node b 1 rank on 2 cores
        (["a", "a", "a", "b"], [frozenset({0, 1})] * 4, [True, True, True, False]),
        # 2 ranks bound to the same core
        (["a", "a"], [frozenset({0}), frozenset({0})], [True, True]),
    ],
)
def test_node_oversubscribed(keys, cores, expected):
    from mpaccel.discovery import node_oversubscribed

    assert [node_oversubscribed(keys, cores, r) for r in range(len(keys))] == expected


def _cpus(first, count):
    return frozenset(range(first, first + count))


@pytest.mark.parametrize(
    "keys, cores, expected",
    [
        # unbound ranks split their node: 4 on 16 CPUs, 4 on 2 CPUs (at least one thread)
        (["a"] * 4, [_cpus(0, 16)] * 4, [4] * 4),
        (["a"] * 4, [_cpus(0, 2)] * 4, [1] * 4),
        # bound to 8 CPUs each (srun --cpus-per-task=8 --cpu-bind=cores): all 8 are theirs; the
        # plain division by ranks per node gave 2
        (["a"] * 4, [_cpus(8 * i, 8) for i in range(4)], [8] * 4),
        # two nodes count apart
        (["a", "a", "b"], [_cpus(0, 8)] * 3, [4, 4, 8]),
        # overlapping: CPUs 0-3 shared by both, 4-7 rank 1's alone
        (["a", "a"], [_cpus(0, 4), _cpus(0, 8)], [2, 6]),
    ],
)
def test_core_share(keys, cores, expected):
    from mpaccel.discovery import core_share

    assert [core_share(keys, cores, r) for r in range(len(keys))] == expected


@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_node_share_its_threads(state, comm):
    import os

    local = state.local_num_processes
    if envvars.get("omp_num_threads") is not None:
        pytest.skip("OMP_NUM_THREADS is set: mpaccel leaves torch's thread count alone")
    cores = len(os.sched_getaffinity(0))
    assert torch.get_num_threads() == max(1, cores // local)
