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
from .random import set_seed

# isort: split
# -- Accelerate's names for memory, models, structures, availability, enums and plugins --------
from .dataclasses import (
    ComputeEnvironment,
    DDPCommunicationHookType,
    DynamoBackend,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
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
    "tqdm",
]
__all__ += [
    "ComputeEnvironment",
    "DDPCommunicationHookType",
    "DynamoBackend",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
]
