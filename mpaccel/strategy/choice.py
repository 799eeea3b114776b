"""Which strategy a job trains with, decided once by AcceleratorState: tensor (or context)
parallelism when the ParallelismConfig asks for it (composed with FSDP2 given an FSDP plugin),
FSDP2 with an FSDP plugin (given, or built from Accelerate's variables), data parallelism
otherwise."""

from __future__ import annotations

from typing import Any

from .. import envvars
from ..config.fsdp import FullyShardedDataParallelPlugin
from ..config.parallelism import ParallelismConfig
from ..errors import ConfigurationError
from .base import Strategy
from .data_parallel import DataParallel
from .fully_sharded import FullySharded
from .mesh import resolve_auto
from .tensor_parallel import TensorParallel


def choose_plugin(
    fsdp_plugin: Any, parallelism_config: Any
) -> FullyShardedDataParallelPlugin | None:
    """Not collective (the caller makes a bad value every rank's error). The plugin to train
    with: the one given, else one built from Accelerate's variables when ACCELERATE_USE_FSDP
    (or MPACCEL_USE_FSDP) is true, else None (DistributedDataParallel)."""
    for name, value, kind in (
        ("fsdp_plugin", fsdp_plugin, FullyShardedDataParallelPlugin),
        ("parallelism_config", parallelism_config, ParallelismConfig),
    ):
        if value is not None and not isinstance(value, kind):
            raise ConfigurationError(
                f"{name} must be a {kind.__name__}, got {value!r}",
                f"build it with mpaccel.utils.{kind.__name__}(...) (docs/training.md).",
            )
    if fsdp_plugin is None and envvars.get_bool("use_fsdp", False):
        fsdp_plugin = FullyShardedDataParallelPlugin()
    if parallelism_config is not None and not parallelism_config.has_auto:
        check_data_parallel(fsdp_plugin, parallelism_config)
    return fsdp_plugin


def check_data_parallel(fsdp_plugin: Any, parallelism_config: ParallelismConfig) -> None:
    """Not collective. Data-parallel sizes > 1 in a ParallelismConfig need an FSDP plugin (the
    mesh is FSDP2's; without a ParallelismConfig, mpaccel trains with DDP)."""
    if fsdp_plugin is None and parallelism_config.data_parallel_size > 1:
        raise ConfigurationError(
            f"ParallelismConfig(dp_replicate_size={parallelism_config.dp_replicate_size}, "
            f"dp_shard_size={parallelism_config.dp_shard_size}) shapes a fully sharded mesh, "
            "but no fsdp_plugin was given",
            "pass fsdp_plugin=FullyShardedDataParallelPlugin() as well, or drop "
            "parallelism_config (mpaccel then trains with DistributedDataParallel).",
        )


def build(
    partial: Any, fsdp_plugin: FullyShardedDataParallelPlugin | None, parallelism_config: Any
) -> Strategy:
    """Collective: every rank calls this with the same plugin (AcceleratorState compared the
    settings first). The strategy for `choose_plugin`'s answer, over the PartialState
    `partial`: TensorParallel when the ParallelismConfig has tp_size or cp_size > 1 (its N-D
    mesh built here; "auto" sizes chosen from the nodes first), else FullySharded (its device
    mesh built here) with a plugin, else DataParallel."""
    config = parallelism_config
    if config is not None and config.has_auto:
        resolve_auto(partial, config)  # collective; every rank gets the same sizes or error
        check_data_parallel(fsdp_plugin, config)
    if config is not None and (config.tp_enabled or config.cp_enabled):
        return TensorParallel(partial, fsdp_plugin, config)
    if fsdp_plugin is not None:
        return FullySharded(partial, fsdp_plugin, parallelism_config)
    return DataParallel(partial)
