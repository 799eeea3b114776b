"""Process discovery from synthetic launcher environments: nothing is launched here."""

from __future__ import annotations

import pytest

from mpaccel import _env
from mpaccel.discovery import check_world_size
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
    mpi_family,
)
from mpaccel.environments.slurm import (
    allocation_warnings,
    check_srun_layout,
    expand_tasks_per_node,
)
from mpaccel.errors import LaunchError

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."
OPENMPI = "Open MPI v5.0.11, package: Open MPI ..."


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
    found = detect_launcher(_env.snapshot(env))
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
    env = _env.snapshot(
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
    env = _env.snapshot({"PMI_SIZE": "4", "PMI_RANK": "0", "MPI_LOCALRANKID": "0"})
    error = _launch_error(detect_launcher(env), 1, OPENMPI)
    assert "MPI4PY_LIBMPI=libmpich.so.12" in error.hint
    assert "Open MPI's mpirun" in error.hint


def test_silent_singletons_openmpi_launcher_mpich_library():
    env = _env.snapshot({"OMPI_COMM_WORLD_SIZE": "4"})
    error = _launch_error(detect_launcher(env), 1, MPICH)
    assert "MPI4PY_LIBMPI=libmpi.so.40" in error.hint


def test_world_size_disagreement_that_is_not_singletons():
    env = _env.snapshot({"OMPI_COMM_WORLD_SIZE": "4"})
    error = _launch_error(detect_launcher(env), 2, OPENMPI)
    assert "sees 2" in error.message


def test_consistent_world_passes():
    env = _env.snapshot({"PMI_SIZE": "4", "MPI_LOCALRANKID": "0"})
    check_world_size(detect_launcher(env), 4, MPICH)
    check_world_size(detect_launcher(_env.snapshot({})), 1, MPICH)


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


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node("two")


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
            facts.append(SlurmFacts.from_env(_env.snapshot(env)))
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


def test_srun_step_tasks_disagree_with_world():
    facts, infos = srun_facts(1, 4, SLURM_STEP_NUM_TASKS="8")
    with pytest.raises(LaunchError, match="SLURM_STEP_NUM_TASKS=8"):
        check_srun_layout(facts, infos)


def test_ntasks_per_node_mismatch():
    # sbatch -N 2 --ntasks-per-node=4, then `srun -n 4`: 2 per node, half the node idle
    facts, infos = srun_facts(2, 2, SLURM_NTASKS_PER_NODE="4")
    with pytest.raises(LaunchError) as info:
        check_srun_layout(facts, infos)
    assert "--ntasks-per-node=4" in info.value.message
    assert "drop -n from srun" in info.value.hint


def test_tasks_per_node_disagrees_with_mpi():
    facts, infos = srun_facts(2, 2, SLURM_TASKS_PER_NODE="3,1")
    with pytest.raises(LaunchError, match="placed"):
        check_srun_layout(facts, infos)


def test_size_one_skips_layout_checks():
    facts, infos = srun_facts(1, 1)
    check_srun_layout(facts, infos)


def test_batch_shell_warns_when_allocation_is_wider():
    env = _env.snapshot({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4"})
    launcher = detect_launcher(env)
    notes = allocation_warnings(SlurmFacts.from_env(env), launcher, 1)
    assert len(notes) == 1 and "python ran directly in the batch script" in notes[0]
    assert allocation_warnings(SlurmFacts.from_env(_env.snapshot({})), launcher, 1) == []


def test_mpiexec_using_part_of_allocation_warns():
    env = _env.snapshot(
        {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}
    )
    notes = allocation_warnings(SlurmFacts.from_env(env), detect_launcher(env), 4)
    assert "only 4 process(es)" in notes[0]


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
