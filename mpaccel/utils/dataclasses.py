"""Accelerate's module path for its configuration classes (`accelerate.utils.dataclasses`): the
same objects as mpaccel.config, mpaccel.enums, mpaccel.config.fsdp and
mpaccel.config.parallelism."""

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
)
from ..config.parallelism import (
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
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
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
]
