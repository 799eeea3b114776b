"""mpaccel: Accelerate's process API for jobs launched by mpiexec, mpirun, srun or plain python.

Importing mpaccel has no side effects: MPI is initialised, and torch.distributed set up, by the
first `PartialState()` / `Accelerator()`.
"""

from ._version import __version__
from .accelerator import Accelerator
from .data import skip_first_batches
from .environments import ProcessInfo
from .errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigurationError,
    LaunchError,
    MpaccelError,
    MpaccelWarning,
)
from .state import AcceleratorState, GradientState, PartialState
from .utils import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)

# isort: split
# Accelerate's other top-level names (its `accelerate/__init__.py`)
from .utils import (
    AutocastKwargs,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    ParallelismConfig,
    ProfileKwargs,
    find_executable_batch_size,
    is_rich_available,
    synchronize_rng_states,
)

__all__ = [
    "Accelerator",
    "AcceleratorState",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigurationError",
    "DataLoaderConfiguration",
    "DistributedType",
    "GradientAccumulationPlugin",
    "GradientState",
    "InitProcessGroupKwargs",
    "LaunchError",
    "MpaccelError",
    "MpaccelWarning",
    "PartialState",
    "ProcessInfo",
    "ProjectConfiguration",
    "__version__",
    "skip_first_batches",
]
__all__ += [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "ParallelismConfig",
    "ProfileKwargs",
    "find_executable_batch_size",
    "is_rich_available",
    "synchronize_rng_states",
]
