"""The environment table: one place, typed reads through the table's kinds, errors that name the
variable, its value and what it takes, with bounded work whatever the value."""

from __future__ import annotations

import socket
import tracemalloc

import pytest

from mpaccel import AcceleratorState, PartialState, envvars
from mpaccel.discovery import discover
from mpaccel.environments import SlurmFacts
from mpaccel.errors import ConfigurationError


def test_first_set_variable_wins():
    env = {"SLURM_JOBID": "5", "SLURM_JOB_ID": "7"}
    assert envvars.get("slurm_job_id", env) == "7"
    assert envvars.get("slurm_job_id", {"SLURM_JOBID": "5"}) == "5"
    assert envvars.get("slurm_job_id", {}) is None
    assert envvars.get("slurm_job_id", {"SLURM_JOB_ID": ""}) is None


def test_unknown_logical_name():
    with pytest.raises(KeyError, match="no_such"):
        envvars.get("no_such", {})


def test_int_and_bool_errors_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_NTASKS='four'"):
        envvars.get_int("slurm_ntasks", {"SLURM_NTASKS": "four"})
    assert envvars.get_bool("debug", False, {"ACCELERATE_DEBUG_MODE": "yes"}) is True
    assert envvars.get_bool("debug", True, {}) is True
    with pytest.raises(ValueError, match="MPACCEL_DEBUG='maybe'"):
        envvars.get_bool("debug", False, {"MPACCEL_DEBUG": "maybe"})
    with pytest.raises(ValueError, match="is not a number of seconds"):
        envvars.get_float("timeout", {"MPACCEL_TIMEOUT": "soon"})


# (variable, value, what the message says is accepted): the values issue 18 found accepted
# silently or ending in a raw Python error, and their neighbours.
BAD = [
    ("MPACCEL_TIMEOUT", "nan", "a number of seconds > 0 and <= 31536000"),
    ("MPACCEL_TIMEOUT", "inf", "a number of seconds > 0 and <= 31536000"),
    ("MPACCEL_TIMEOUT", "1e300", "a number of seconds > 0 and <= 31536000"),
    ("MPACCEL_TIMEOUT", "-5", "a number of seconds > 0 and <= 31536000"),
    ("MPACCEL_TIMEOUT", "0", "a number of seconds > 0 and <= 31536000"),
    ("MPACCEL_MPI_PROGRESS", "nan", "a number of milliseconds >= 0 and <= 60000"),
    ("MPACCEL_TEST_TIMEOUT", "-1", "a number of seconds >= 0 and <= 31536000"),
    ("MPACCEL_MIXED_PRECISION", "fp32", "one of 'no', 'fp16', 'bf16', 'fp8' (in any case)"),
    ("ACCELERATE_MIXED_PRECISION", "fp32", "one of 'no', 'fp16', 'bf16', 'fp8' (in any case)"),
    ("MPACCEL_LOG_LEVEL", "loud", "one of 'debug', 'info', 'warning', 'warn', 'error', "
     "'critical', 'fatal', 'notset' (in any case)"),
    ("MPACCEL_IO_THREADS", "0", "an integer from 1 to 1024"),
    ("MPACCEL_USE_CPU", "sometimes", "a boolean (1/0, true/false, yes/no, on/off)"),
    ("SLURM_NTASKS", "0", "an integer from 1 to 2147483647"),
    ("SLURM_NTASKS", "-1", "an integer from 1 to 2147483647"),
    ("SLURM_PROCID", "-1", "an integer from 0 to 2147483647"),
    ("PMI_SIZE", "3000000000", "an integer from 1 to 2147483647"),
    ("PMI_RANK", "\u0661", "an integer from 0 to 2147483647"),  # int() takes Arabic-Indic digits
    ("SLURM_TASKS_PER_NODE", "2(x200000000)",
     "Slurm's per-node counts such as '2(x3),1' (counts >= 1, at most 100000 nodes)"),
    ("SLURM_JOB_CPUS_PER_NODE", "0(x2)",
     "Slurm's per-node counts such as '2(x3),1' (counts >= 1, at most 100000 nodes)"),
    ("SLURM_JOB_NODELIST", "n[0-99999],m[0-99999]",
     "a Slurm node list such as 'gpu[01-03,07],login1' (at most 100000 nodes)"),
    ("SLURM_JOB_NODELIST", "n[1-3", "a Slurm node list such as 'gpu[01-03,07],login1' "
     "(at most 100000 nodes)"),
]


@pytest.mark.parametrize(("variable", "value", "accepted"), BAD)
def test_a_bad_value_is_one_clear_error_naming_variable_value_and_what_is_accepted(
    variable, value, accepted
):
    with pytest.raises(ConfigurationError) as info:
        envvars.check({variable: value})
    assert info.value.message == f"environment variable {variable}={value!r} is not {accepted}"
    if variable.startswith(("MPACCEL_", "ACCELERATE_")):
        assert info.value.hint.startswith(f"set {variable} to such a value, or unset it")
    else:
        assert info.value.hint.startswith(f"fix or unset {variable}; launchers and Slurm")


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SLURM_TASKS_PER_NODE", "2(x200000000)"), ("SLURM_TASKS_PER_NODE", "2(x99999)," * 10000),
     ("SLURM_JOB_NODELIST", "n[0-99999]," * 10000), ("SLURM_JOB_NODELIST", "n[1-99999999]"),
     ("SLURM_NTASKS", "9" * 100_000), ("MPACCEL_TIMEOUT", "1" * 100_000)],
    ids=["200M-nodes", "10k-runs", "1G-names", "100M-range", "huge-int", "huge-float"],
)
def test_refusing_any_value_takes_bounded_memory(variable, value):
    # '2(x200000000)' took 3.2 GB before start-up (expanded into a list); a list of ranges
    # adds up past any memory; a 100,000-digit integer hit Python's int-digits limit.
    tracemalloc.start()
    try:
        env = envvars.snapshot({"SLURM_JOB_ID": "1", variable: value})
        with pytest.raises(ConfigurationError) as info:  # what discovery reads, as it reads it
            SlurmFacts.from_env(env)
            envvars.get_float("timeout", env)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.message.startswith(f"environment variable {variable}=")
    assert len(info.value.message) < 500  # the value is quoted, shortened
    assert peak < 5 * len(value) + 1_000_000


def test_per_node_counts_are_kept_as_runs_at_the_limit():
    tracemalloc.start()
    try:
        facts = SlurmFacts.from_env(envvars.snapshot({"SLURM_JOB_ID": "1",
                                                   "SLURM_TASKS_PER_NODE": "2(x100000)"}))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert facts.tasks_per_node == ((2, 100_000),)
    assert peak < 100_000  # a tuple of 100,000 counts alone is 800 kB


def test_every_variable_of_the_table_is_validated_by_its_kind():
    # A value no kind but text takes: every other variable refuses it, by its own name.
    for logical, variable in envvars.VARIABLES.items():
        assert isinstance(variable.kind, envvars.Kind), logical
        for name in variable.names:
            if isinstance(variable.kind, envvars.Text):
                assert envvars.get(logical, {name: "[x"}) == "[x"
                continue
            with pytest.raises(ConfigurationError, match=rf"^environment variable {name}='\[x'"):
                envvars.check({name: "[x"})
            with pytest.raises(ConfigurationError, match=rf"^environment variable {name}='\[x'"):
                envvars.get(logical, {name: "[x"})


def test_typed_getters_parse_through_the_table_and_refuse_another_kind():
    assert envvars.get_choice("mixed_precision", {"ACCELERATE_MIXED_PRECISION": " BF16 "}) == "bf16"
    assert envvars.get_bool("use_cpu", False, {"ACCELERATE_USE_CPU": "t"}) is True  # Accelerate's
    assert envvars.get_float("mpi_progress", {"MPACCEL_MPI_PROGRESS": "0"}) == 0.0
    assert envvars.get_int("slurm_procid", {"SLURM_PROCID": " 3 "}) == 3
    assert envvars.get_runs("slurm_tasks_per_node", {}) == ()
    assert envvars.get("slurm_nodelist", {"SLURM_NODELIST": "n[1-2]"}) == "n[1-2]"
    with pytest.raises(TypeError, match="'timeout' holds Number, not Integer"):
        envvars.get_int("timeout", {})


def test_several_bad_variables_are_named_in_one_error():
    with pytest.raises(ConfigurationError) as info:
        envvars.check({"SLURM_NTASKS": "-1", "MPACCEL_TIMEOUT": "nan", "PMI_SIZE": "2"})
    assert info.value.message == (
        "environment variable SLURM_NTASKS='-1' is not an integer from 1 to 2147483647; "
        "environment variable MPACCEL_TIMEOUT='nan' is not a number of seconds > 0 and <= "
        "31536000"
    )


def test_a_shadowed_variable_is_not_read_so_not_refused():
    envvars.check({"MPACCEL_DEBUG": "1", "ACCELERATE_DEBUG_MODE": "maybe"})


@pytest.mark.parametrize(
    ("variable", "value"),
    [("MPACCEL_TIMEOUT", "nan"), ("SLURM_TASKS_PER_NODE", "2(x200000000)"),
     ("MPACCEL_MIXED_PRECISION", "fp32")],
)
@pytest.mark.mpi_timeout(60)  # a rank left waiting for one that raised alone would hang
def test_discovery_refuses_a_bad_variable_on_every_rank_naming_the_one_that_has_it(
    comm, variable, value
):
    size = comm.size
    env = {"PMI_RANK": str(comm.rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(comm.rank),
           "SLURM_JOB_ID": "7"}
    if comm.rank == size - 1:
        env[variable] = value
    with pytest.raises(ConfigurationError) as info:
        discover(default_timeout=30, env=envvars.snapshot(env))
    said = f"environment variable {variable}={value!r} is not "
    if size == 1:
        assert info.value.message.startswith(said)
    else:
        assert info.value.message.startswith(
            f"on rank {size - 1} ({socket.gethostname()}) only: {said}")
    assert comm.allgather(str(info.value)) == [str(info.value)] * size


def test_state_refuses_bad_variables_naming_them(state, monkeypatch):
    # Set on every rank: each raises the same error (at size N too, no rank waits).
    monkeypatch.setenv("MPACCEL_MIXED_PRECISION", "fp32")
    with pytest.raises(ConfigurationError) as info:
        AcceleratorState()
    assert info.value.message.startswith(
        "environment variable MPACCEL_MIXED_PRECISION='fp32' is not one of 'no', 'fp16'")
    monkeypatch.setenv("MPACCEL_MIXED_PRECISION", "FP16")
    assert AcceleratorState().mixed_precision == "fp16"
    monkeypatch.setenv("MPACCEL_TIMEOUT", "nan")
    with pytest.raises(ConfigurationError, match=r"^environment variable MPACCEL_TIMEOUT='nan'"):
        PartialState()


def test_snapshot_keeps_only_table_variables_and_is_read_only():
    snap = envvars.snapshot({"PMI_SIZE": "4", "HOME": "/root"})
    assert dict(snap) == {"PMI_SIZE": "4"}
    with pytest.raises(TypeError):
        snap["PMI_SIZE"] = "2"  # type: ignore[index]


def test_rank_before_init_order():
    assert envvars.rank_before_init({"PMI_RANK": "3", "SLURM_PROCID": "0"}) == 3
    assert envvars.rank_before_init({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert envvars.rank_before_init({}) is None


def test_no_other_module_reads_os_environ():
    import pathlib

    root = pathlib.Path(envvars.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "envvars.py"
        and ("os.environ" in path.read_text() or "os.getenv" in path.read_text())
    ]
    assert offenders == []
