"""Accelerate's configuration classes for engines mpaccel does not drive (DeepSpeed,
Megatron-LM, Accelerate's older tensor-parallel plugin): importable, so that scripts naming
them import; building one is a ConfigurationError saying what to use instead
(`SHARD_INSTEAD`)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError, refused


class Refused:
    """Accelerate's configuration classes for engines mpaccel does not drive: importable, so
    scripts that name them import; building one is a ConfigurationError with what to do."""

    _engine = ""
    _hint = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refused(cls._message(), cls._hint)(cls)  # what __init__ raises, for docs/compatibility.md

    @classmethod
    def _message(cls) -> str:
        return f"mpaccel does not drive {cls._engine}: {cls.__name__}(...) cannot be used"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigurationError(self._message(), self._hint)


# What to use instead of an engine mpaccel does not drive (here, state.py, absent_names.py).
SHARD_INSTEAD = (
    "prepare() the model as it is: DistributedDataParallel when it fits one device (every "
    "rank holds all of it), Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()) (FSDP2: "
    "parameters, gradients and optimizer state sharded over the ranks; HYBRID_SHARD with "
    "ParallelismConfig(dp_replicate_size=...)) when it does not (docs/training.md)."
)
_DDP_INSTEAD = "drop the plugin and " + SHARD_INSTEAD


class DeepSpeedPlugin(Refused):
    _engine = "DeepSpeed"
    _hint = _DDP_INSTEAD


class MegatronLMPlugin(Refused):
    _engine = "Megatron-LM"
    _hint = _DDP_INSTEAD


class TorchTensorParallelPlugin(Refused):
    _engine = (
        "Accelerate's TorchTensorParallelPlugin (here tensor parallelism is "
        "ParallelismConfig(tp_size=...))"
    )
    _hint = _DDP_INSTEAD
