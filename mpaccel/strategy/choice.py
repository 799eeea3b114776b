"""Which strategy a job trains with, decided once by AcceleratorState: FSDP2 with an FSDP
plugin (given, or built from Accelerate's variables), data parallelism otherwise."""

from __future__ import annotations

from typing import Any

from .. import envvars
from ..config.fsdp import FullyShardedDataParallelPlugin
from ..config.parallelism import ParallelismConfig
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
    if parallelism_config is not None:
        check_data_parallel_only(parallelism_config)
    if fsdp_plugin is None and parallelism_config is not None and parallelism_config.total_size > 1:
        raise ConfigurationError(
            f"ParallelismConfig(dp_replicate_size={parallelism_config.dp_replicate_size}, "
            f"dp_shard_size={parallelism_config.dp_shard_size}) shapes a fully sharded mesh, "
            "but no fsdp_plugin was given",
            "pass fsdp_plugin=FullyShardedDataParallelPlugin() as well, or drop "
            "parallelism_config (mpaccel then trains with DistributedDataParallel).",
        )
    return fsdp_plugin


def check_data_parallel_only(parallelism_config: ParallelismConfig) -> None:
    """Not collective. The sizes this version drives: data-parallel ones, given as numbers
    (no strategy splits layers or sequences yet, and nothing chooses "auto" sizes)."""
    sizes = {"tp_size": parallelism_config.tp_size, "cp_size": parallelism_config.cp_size,
             "dp_replicate_size": parallelism_config.dp_replicate_size,
             "dp_shard_size": parallelism_config.dp_shard_size}  # fmt: skip
    others = {
        name: value for name, value in sizes.items()
        if value == "auto" or (name in ("tp_size", "cp_size") and value != 1)
    }  # fmt: skip
    if others:
        raise ConfigurationError(
            f"ParallelismConfig({', '.join(f'{k}={v!r}' for k, v in others.items())}): mpaccel "
            "drives no tensor or context parallelism and chooses no 'auto' size yet",
            "leave tp_size and cp_size at 1 and give dp_replicate_size and dp_shard_size as "
            "numbers: they shape the data-parallel mesh.",
        )


def build(
    partial: Any, fsdp_plugin: FullyShardedDataParallelPlugin | None, parallelism_config: Any
) -> Strategy:
    """Collective: every rank calls this with the same plugin (AcceleratorState compared the
    settings first). The strategy for `choose_plugin`'s answer, over the PartialState
    `partial`: FullySharded (its device mesh built here) with a plugin, else DataParallel."""
    if fsdp_plugin is not None:
        return FullySharded(partial, fsdp_plugin, parallelism_config)
    return DataParallel(partial)
