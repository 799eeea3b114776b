"""The configuration dataclasses users build, with Accelerate's names (mpaccel.utils re-exports
them at Accelerate's paths), one concept a module: `kwargs` (the kwargs handlers and their
base), `plugins` (gradient accumulation, torch.compile), `dataloader`, `project`, `fsdp`
(FullyShardedDataParallelPlugin), `parallelism` (ParallelismConfig and its handlers) and
`refused` (engines mpaccel does not drive). Unknown keys are rejected, by name."""

from .dataloader import DataLoaderConfiguration
from .kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    as_timedelta,
    handlers_by_type,
)
from .plugins import GradientAccumulationPlugin, TorchDynamoPlugin
from .project import ProjectConfiguration
from .refused import (
    SHARD_INSTEAD,
    DeepSpeedPlugin,
    MegatronLMPlugin,
    Refused,
    TorchTensorParallelPlugin,
)

__all__ = [
    "SHARD_INSTEAD",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "MegatronLMPlugin",
    "ProfileKwargs",
    "ProjectConfiguration",
    "Refused",
    "TorchDynamoPlugin",
    "TorchTensorParallelPlugin",
    "as_timedelta",
    "handlers_by_type",
]
