"""Utilities with Accelerate's module paths: `mpaccel.utils.InitProcessGroupKwargs`, ..."""

from .dataclasses import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
)
from .operations import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)

__all__ = [
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]
