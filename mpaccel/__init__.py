"""mpaccel: Accelerate's process API for jobs launched by mpiexec, mpirun, srun or plain python.

Importing mpaccel has no side effects: MPI is initialised, and torch.distributed set up, by the
first `PartialState()` / `Accelerator()`. Nor does it import torch: each public name is
imported from its module on first use, so what needs no tensors (the pytest plugin, for one)
starts without torch's 1.5 s of CPU per process.
"""

from __future__ import annotations

import importlib
import typing

from ._version import __version__

if typing.TYPE_CHECKING:
    from .accelerator import Accelerator
    from .data.skip import skip_first_batches
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
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DeepSpeedPlugin,
        DistributedDataParallelKwargs,
        DistributedType,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ParallelismConfig,
        ProfileKwargs,
        ProjectConfiguration,
        find_executable_batch_size,
        is_rich_available,
        synchronize_rng_states,
    )

# Each public name and the module it lives in; the TYPE_CHECKING block above says the same to
# type checkers (tests/test_init.py holds the two together).
_WHERE = {
    "Accelerator": ".accelerator",
    "skip_first_batches": ".data.skip",
    "ProcessInfo": ".environments",
    **dict.fromkeys(
        ["CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError",
         "ConfigurationError", "LaunchError", "MpaccelError", "MpaccelWarning"], ".errors"),
    **dict.fromkeys(["AcceleratorState", "GradientState", "PartialState"], ".state"),
    **dict.fromkeys(
        ["DataLoaderConfiguration", "DistributedType", "GradientAccumulationPlugin",
         "InitProcessGroupKwargs", "ProjectConfiguration",
         # Accelerate's other top-level names (its `accelerate/__init__.py`)
         "AutocastKwargs", "DDPCommunicationHookType", "DeepSpeedPlugin",
         "DistributedDataParallelKwargs", "FullyShardedDataParallelPlugin", "GradScalerKwargs",
         "ParallelismConfig", "ProfileKwargs", "find_executable_batch_size",
         "is_rich_available", "synchronize_rng_states"], ".utils"),
}

__all__ = ["__version__", *_WHERE]

if not typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        """A public name, from its module on first use; Accelerate's names for features
        mpaccel lacks resolve to refusals with a HINT (mpaccel/absent_names.py), not in __all__
        (type checkers keep reporting them as absent)."""
        if name.startswith("_"):  # a private submodule not imported yet: the import system's
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module = _WHERE.get(name)
        if module is None:
            # import_module, not `from . import`: that would ask this __getattr__ for the
            # module's own name first, and recurse
            absent = importlib.import_module(".absent_names", __name__)
            return absent.resolve(__name__, name)
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
