"""Which strategy a job trains with, decided once by AcceleratorState: FSDP2 with an FSDP
plugin (given, or built from Accelerate's variables), data parallelism otherwise."""

from __future__ import annotations

from typing import Any

from .. import envvars
from ..config.fsdp import FullyShardedDataParallelPlugin, ParallelismConfig
from ..errors import ConfigurationError
from .base import Strategy
from .data_parallel import DataParallel
from .fully_sharded import FullySharded


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
    if fsdp_plugin is None and parallelism_config is not None and parallelism_config.total_size > 1:
        raise ConfigurationError(
            f"ParallelismConfig(dp_replicate_size={parallelism_config.dp_replicate_size}, "
            f"dp_shard_size={parallelism_config.dp_shard_size}) shapes a fully sharded mesh, "
            "but no fsdp_plugin was given",
            "pass fsdp_plugin=FullyShardedDataParallelPlugin() as well, or drop "
            "parallelism_config (mpaccel then trains with DistributedDataParallel).",
        )
    return fsdp_plugin


def build(
    partial: Any, fsdp_plugin: FullyShardedDataParallelPlugin | None, parallelism_config: Any
) -> Strategy:
    """Collective: every rank calls this with the same plugin (AcceleratorState compared the
    settings first). The strategy for `choose_plugin`'s answer, over the PartialState
    `partial`: FullySharded (its device mesh built here) with a plugin, else DataParallel."""
    if fsdp_plugin is not None:
        return FullySharded(partial, fsdp_plugin, parallelism_config)
    return DataParallel(partial)
