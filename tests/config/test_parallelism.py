"""ParallelismConfig and its handlers: Accelerate's fields, variables, checks (one process)."""

from __future__ import annotations

import pytest

import mpaccel
from mpaccel.errors import ConfigurationError
from mpaccel.parallelism_config import ParallelismConfig
from mpaccel.utils import TorchContextParallelConfig, TorchTensorParallelConfig


def test_accelerate_paths_and_fields():
    assert mpaccel.ParallelismConfig is ParallelismConfig
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert config.total_size == 8 and config.data_parallel_size == 4
    assert config.non_data_parallel_size == 2
    assert config.dp_dim_names == ["dp_replicate", "dp_shard"]
    assert config.non_dp_dim_names == ["tp"]
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert config.dp_shard_cp_dim_names == ["dp_shard"]
    assert config.dp_cp_dim_names == ["dp_replicate", "dp_shard"]
    assert config.active_mesh_dims == ["dp_replicate", "dp_shard", "tp"]
    assert isinstance(config.tp_handler, TorchTensorParallelConfig)
    assert config.cp_backend == "torch" and config.sp_backend == "deepspeed"
    assert config.to_json()["tp_handler"] == {"enable_async_tp": False, "tp_plan": None}
    with pytest.raises(AttributeError, match="no field 'tp_sise'"):
        config.tp_sise = 2


def test_variables_fill_unset_sizes(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "auto")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    config = ParallelismConfig()
    assert config.tp_size == 2 and config.dp_shard_size == "auto" and config.has_auto
    assert TorchContextParallelConfig().cp_comm_strategy == "alltoall"
    config.set_sizes({"dp_replicate": 1, "dp_shard": 3, "cp": 1, "tp": 2})
    assert config.total_size == 6
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ConfigurationError, match="PARALLELISM_CONFIG_TP_SIZE"):
        ParallelismConfig()


@pytest.mark.parametrize("fields, message", [
    ({"tp_size": 0}, r"tp_size=0\) must be an int >= 1"),
    ({"cp_size": "auto"}, r"cp_size='auto'\) must be an int >= 1"),
    ({"sp_size": 2}, "DeepSpeed"),
    ({"cp_backend": "ring"}, "cp_backend must be one of"),
    ({"tp_size": 2, "dp_replicate_size": 2}, "cannot be used with pure data parallelism"),
    ({"tp_size": 2, "tp_handler": object()}, "must be a TorchTensorParallelConfig"),
])
def test_accelerate_checks(fields, message):
    with pytest.raises(ConfigurationError, match=message):
        ParallelismConfig(**fields)


def test_handlers_check_their_values():
    with pytest.raises(ConfigurationError, match="cp_comm_strategy"):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    with pytest.raises(ConfigurationError, match="module-name"):
        TorchTensorParallelConfig(tp_plan={"a": 1})
    with pytest.raises(ConfigurationError, match="chosen when the Accelerator is built"):
        _ = ParallelismConfig(tp_size="auto").total_size
