"""Accelerate's module path for its configuration classes (`accelerate.utils.dataclasses`): the
same objects as mpaccel.config, mpaccel.enums and mpaccel.config.fsdp."""

from ..config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    MegatronLMPlugin,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
    TorchTensorParallelPlugin,
)
from ..config.fsdp import (
    FSDPAutoWrapPolicy,
    FSDPShardingStrategy,
    FSDPStateDictType,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
)
from ..enums import (
    ComputeEnvironment,
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from .operations import TensorInformation

__all__ = [
    "AutocastKwargs",
    "ComputeEnvironment",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FSDPAutoWrapPolicy",
    "FSDPShardingStrategy",
    "FSDPStateDictType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MegatronLMPlugin",
    "ParallelismConfig",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "SageMakerDistributedType",
    "TensorInformation",
    "TorchDynamoPlugin",
    "TorchTensorParallelPlugin",
]
