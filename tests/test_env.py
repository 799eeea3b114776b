"""The environment table: one place, typed reads, errors that name the variable."""

from __future__ import annotations

import pytest

from mpaccel import _env


def test_first_set_variable_wins():
    env = {"SLURM_JOBID": "5", "SLURM_JOB_ID": "7"}
    assert _env.get("slurm_job_id", env) == "7"
    assert _env.get("slurm_job_id", {"SLURM_JOBID": "5"}) == "5"
    assert _env.get("slurm_job_id", {}) is None
    assert _env.get("slurm_job_id", {"SLURM_JOB_ID": ""}) is None


def test_unknown_logical_name():
    with pytest.raises(KeyError, match="no_such"):
        _env.get("no_such", {})


def test_int_and_bool_errors_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_NTASKS='four'"):
        _env.get_int("slurm_ntasks", {"SLURM_NTASKS": "four"})
    assert _env.get_bool("debug", False, {"ACCELERATE_DEBUG_MODE": "yes"}) is True
    assert _env.get_bool("debug", True, {}) is True
    with pytest.raises(ValueError, match="MPACCEL_DEBUG='maybe'"):
        _env.get_bool("debug", False, {"MPACCEL_DEBUG": "maybe"})
    with pytest.raises(ValueError, match="not a number"):
        _env.get_float("timeout", {"MPACCEL_TIMEOUT": "soon"})


def test_snapshot_keeps_only_table_variables_and_is_read_only():
    snap = _env.snapshot({"PMI_SIZE": "4", "HOME": "/root"})
    assert dict(snap) == {"PMI_SIZE": "4"}
    with pytest.raises(TypeError):
        snap["PMI_SIZE"] = "2"  # type: ignore[index]


def test_rank_before_init_order():
    assert _env.rank_before_init({"PMI_RANK": "3", "SLURM_PROCID": "0"}) == 3
    assert _env.rank_before_init({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert _env.rank_before_init({}) is None


def test_no_other_module_reads_os_environ():
    import pathlib

    root = pathlib.Path(_env.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "_env.py"
        and ("os.environ" in path.read_text() or "os.getenv" in path.read_text())
    ]
    assert offenders == []
