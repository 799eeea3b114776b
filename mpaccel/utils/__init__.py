"""Utilities with Accelerate's module paths: `mpaccel.utils.InitProcessGroupKwargs`, ..."""

from .dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    ProjectConfiguration,
)
from .operations import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from .progress import tqdm
from .random import (
    set_seed,
    synchronize_rng_state,
    synchronize_rng_states,
)

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "tqdm",
]
