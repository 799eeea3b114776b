"""mpaccel.commands (Accelerate's `accelerate.commands.config`, `.launch`, `.env`): an
Accelerate config file read for environment reports, and `accelerate launch` refused with the
command line that runs the script instead."""

from __future__ import annotations

import pytest

from mpaccel.commands.config import default_config_file, load_config_from_file
from mpaccel.commands.env import env_command, env_command_parser
from mpaccel.commands.launch import launch_command, launch_command_parser
from mpaccel.errors import ConfigurationError

local = pytest.mark.mpi(size=1)  # no communication: one process says all


@local
def test_an_accelerate_config_file_is_read_as_written(tmp_path):
    yaml_file = tmp_path / "default_config.yaml"
    yaml_file.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert load_config_from_file(str(yaml_file)).to_dict() == {
        "distributed_type": "MULTI_GPU", "num_processes": 2}
    json_file = tmp_path / "config.json"
    json_file.write_text('{"mixed_precision": "bf16"}')
    assert load_config_from_file(str(json_file)).to_dict() == {"mixed_precision": "bf16"}
    assert default_config_file.endswith("accelerate/default_config.yaml")


@local
def test_a_missing_config_file_is_one_error_with_the_hint(tmp_path):
    missing = str(tmp_path / "none.yaml")
    with pytest.raises(ConfigurationError, match="HINT: mpaccel needs no config file") as err:
        load_config_from_file(missing)
    assert repr(missing) in str(err.value)


@local
def test_accelerate_launch_is_refused_with_the_mpiexec_line():
    args = launch_command_parser().parse_args(
        ["--num_processes", "2", "train.py", "--lr", "1e-4"])
    with pytest.raises(ConfigurationError) as refused:
        launch_command(args)
    assert "HINT: `mpiexec -n 2 mpaccel run train.py --lr 1e-4`" in str(refused.value)


def test_accelerate_env_is_mpaccel_env(comm, capsys):
    """Collective, as `mpaccel env`: rank 0 prints the report."""
    args = env_command_parser().parse_args([])
    assert args.func is env_command
    assert env_command(args) == 0
    out = capsys.readouterr().out
    assert ("mpaccel env" in out) if comm.rank == 0 else out == ""
