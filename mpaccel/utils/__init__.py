"""Utilities with Accelerate's module paths: `mpaccel.utils.InitProcessGroupKwargs`, ..."""

from .dataclasses import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
)

__all__ = [
    "DataLoaderConfiguration",
    "DistributedType",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProjectConfiguration",
]
