"""Configuration objects with Accelerate's names: the kwargs handlers and the plugins, and the
enums of enums.py (mpaccel.utils re-exports them at Accelerate's paths). Unknown keys are
rejected, by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .enums import (
    DDPCommunicationHookType,
    DynamoBackend,
)
from .errors import ConfigurationError, refused


class KwargsHandler:
    """Base of the kwargs dataclasses: `to_kwargs()` returns the fields changed from defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def __setattr__(self, name: str, value: Any) -> None:
        known = {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        if name not in known:
            raise AttributeError(
                f"{type(self).__name__} has no field {name!r}; known fields: {sorted(known)}"
            )
        super().__setattr__(name, value)


def as_timedelta(value: Any, what: str = "timeout") -> timedelta | None:
    """None, a timedelta, or a number of seconds -> timedelta (positive)."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = timedelta(seconds=value)
    else:
        raise ConfigurationError(
            f"{what} must be a datetime.timedelta or a number of seconds, got {value!r}",
            f"for example {what}=timedelta(minutes=10) or {what}=600.",
        )
    if result.total_seconds() <= 0:
        raise ConfigurationError(f"{what} must be positive, got {value!r}")
    return result


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for the torch.distributed process group mpaccel creates.

    backend: None picks NCCL on GPUs and gloo on CPU. init_method: None lets mpaccel broker the
    rendezvous over MPI (recommended); a URL is passed through. timeout: also the default
    deadline of mpaccel's own barriers (wait_for_everyone, triggers).
    """

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        self.timeout = as_timedelta(self.timeout)
        if self.backend is not None and self.backend not in ("gloo", "nccl", "mpi"):
            raise ConfigurationError(
                f"InitProcessGroupKwargs(backend={self.backend!r}) is not a backend mpaccel runs",
                "use 'nccl' (GPUs), 'gloo' (CPU) or leave it None to let mpaccel choose.",
            )


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for the DistributedDataParallel wrapper `prepare()` puts around models on more
    than one process (torch's own meanings). find_unused_parameters=True is needed by models
    whose forward skips some parameters; it also keeps DDP from rebuilding its gradient
    buckets after the first step, which makes a resumed run reduce gradients exactly as an
    uninterrupted one (see the checkpoint docs).

    comm_hook / comm_wrapper / comm_state_option: a DDP communication hook registered on the
    prepared model (DDPCommunicationHookType or its value; comm_wrapper compresses another
    hook's all-reduce, FP16 or BF16 only; comm_state_option: PowerSGDState's arguments). On
    CPU (gloo) torch refuses the BF16 ones: see docs/training.md."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ConfigurationError(
                f"DistributedDataParallelKwargs(bucket_cap_mb={self.bucket_cap_mb!r}) must be > 0"
            )
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook")
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper")
        wrappers = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16,
                    DDPCommunicationHookType.BF16)
        if self.comm_wrapper not in wrappers:
            raise ConfigurationError(
                f"DistributedDataParallelKwargs(comm_wrapper={self.comm_wrapper!r}) is not a "
                f"wrapper",
                "comm_wrapper compresses another hook: 'no', 'fp16' or 'bf16'; put PowerSGD "
                "in comm_hook.",
            )
        if not isinstance(self.comm_state_option, dict):
            raise ConfigurationError(
                f"DistributedDataParallelKwargs(comm_state_option={self.comm_state_option!r}) "
                "must be a dict",
                "for example comm_state_option={'matrix_approximation_rank': 2}.",
            )

    def to_kwargs(self) -> dict[str, Any]:
        """DistributedDataParallel's own arguments (the hook fields are registered apart)."""
        hooks = ("comm_hook", "comm_wrapper", "comm_state_option")
        return {k: v for k, v in super().to_kwargs().items() if k not in hooks}

    def register_comm_hook(self, model: Any) -> None:
        """Register the configured hook on `model` (a DistributedDataParallel); nothing when
        comm_hook is NO, as in Accelerate."""
        from .distributed import register_comm_hook

        register_comm_hook(model, self.comm_hook.value, self.comm_wrapper.value,
                           self.comm_state_option)


def _hook_type(value: Any, name: str) -> DDPCommunicationHookType:
    try:
        return DDPCommunicationHookType(getattr(value, "value", value))
    except ValueError:
        raise ConfigurationError(
            f"DistributedDataParallelKwargs({name}={value!r}) is not a communication hook",
            f"use one of {DDPCommunicationHookType.list()} (or DDPCommunicationHookType.*).",
        ) from None


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for torch.autocast under mixed precision: in `kwargs_handlers` for the prepared
    models' forward and `accelerator.autocast()`, or for one block with
    `accelerator.autocast(autocast_handler=...)`. cache_enabled=None: torch's default."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for the torch.amp.GradScaler used with mixed_precision="fp16"."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradient accumulation behaves (see Accelerator(gradient_accumulation_plugin=...)).

    num_steps: micro-batches per optimizer step. adjust_scheduler: step the LR scheduler once per
    optimizer step, not per micro-batch. sync_with_dataloader: force a sync (and a step) at the
    end of the dataloader. sync_each_batch: all-reduce gradients on every micro-batch (less
    memory, more communication).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (
            isinstance(self.num_steps, bool)
            or not isinstance(self.num_steps, int)
            or self.num_steps < 1
        ):
            raise ConfigurationError(
                f"GradientAccumulationPlugin(num_steps={self.num_steps!r}) must be an int >= 1"
            )


@dataclass
class DataLoaderConfiguration(KwargsHandler):
    """How prepared dataloaders deal out their batches (see docs/training.md). Accelerate's
    fields, in Accelerate's order: `DataLoaderConfiguration(False, None, True)` is split_batches,
    dispatch_batches, even_batches.

    split_batches: cut each batch into one slice per process (else each takes whole batches).
    dispatch_batches: rank 0 reads the loader and sends every rank its part over MPI (None:
    for iterable datasets). even_batches: complete the last round with the epoch's first
    samples. use_seedable_sampler: shuffle with `SeedableRandomSampler` (order drawn from
    seed + epoch, even for a loader given a generator of its own). data_seed: the seed shuffles
    start from (None: rank 0's `torch.initial_seed()`). non_blocking: asynchronous copies to the
    device. use_stateful_dataloader: build the loaders on torchdata's StatefulDataLoader.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        seed = self.data_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigurationError(
                f"DataLoaderConfiguration(data_seed={seed!r}) must be an int or None",
                "pass an integer seed, e.g. data_seed=42, or None to follow torch.manual_seed.",
            )


@dataclass
class ProjectConfiguration(KwargsHandler):
    """Where checkpoints go, and how many are kept."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ConfigurationError(
                f"ProjectConfiguration(total_limit={self.total_limit!r}) must be >= 1 or None"
            )

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclass
class ProfileKwargs(KwargsHandler):
    """torch.profiler settings for `accelerator.profile()` (torch's meanings). activities:
    names ("cpu", "cuda", ...; None: torch's default); schedule_option: torch.profiler.schedule's
    arguments (wait, warmup, active, repeat, skip_first); on_trace_ready: called with the
    profiler when a cycle's trace is ready, on every rank. output_trace_dir: each rank writes
    its Chrome trace there as profile_<rank>.json when the block ends."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def _activity(self, name: str) -> Any:
        import torch

        kinds = {k.name.lower(): k for k in torch.profiler.ProfilerActivity.__members__.values()}
        kinds.pop("privateuse1", None)
        if name not in kinds:
            raise ConfigurationError(
                f"ProfileKwargs(activities=[{name!r}, ...]): not a profiler activity",
                f"use names among {sorted(kinds)}.",
            )
        return kinds[name]

    def build(self) -> Any:
        """The torch.profiler.profile these settings describe (not started)."""
        import torch

        activities = None
        if self.activities is not None:
            activities = [self._activity(name) for name in self.activities]
        schedule = None
        if self.schedule_option is not None:
            schedule = torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """torch.compile for the prepared models: `Accelerator(dynamo_plugin=...)`, or
    `Accelerator(dynamo_backend="inductor")` for the defaults. backend: a DynamoBackend or its
    name (None: "no", no compilation); mode, fullgraph, dynamic, options, disable: torch.compile's;
    use_regional_compilation: compile each block of a repeated ModuleList on its own
    (mpaccel.utils.compile_regions) instead of the whole model. Unlike Accelerate, the
    ACCELERATE_DYNAMO_* variables are not read."""

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        name = "no" if self.backend is None else str(getattr(self.backend, "value", self.backend))
        if name.upper() not in DynamoBackend:
            raise ConfigurationError(
                f"TorchDynamoPlugin(backend={self.backend!r}) is not a dynamo backend",
                f"use one of {[b.lower() for b in DynamoBackend.list()]}.",
            )
        self.backend = DynamoBackend(name.upper())
        if self.mode is None:
            self.mode = "default"
        if self.fullgraph is None:
            self.fullgraph = False
        if self.use_regional_compilation is None:
            self.use_regional_compilation = False

    def to_kwargs(self) -> dict[str, Any]:
        """torch.compile's keyword arguments: those changed from the defaults, the backend by
        torch's name ("inductor")."""
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        if "backend" in kwargs:
            kwargs["backend"] = self.backend.value.lower()
        return kwargs


def handlers_by_type(handlers: Iterable[KwargsHandler] | None) -> dict[type, Any]:
    """Accelerator(kwargs_handlers=...) by type; an unknown or repeated kind is an error."""
    known = (
        InitProcessGroupKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        AutocastKwargs,
        ProfileKwargs,
    )
    found: dict[type, Any] = {}
    for handler in handlers or ():
        kind = type(handler)
        if kind not in known:
            raise ConfigurationError(
                f"kwargs_handlers got {handler!r}; mpaccel understands "
                f"{[k.__name__ for k in known]}",
            )
        if kind in found:
            raise ConfigurationError(f"kwargs_handlers has more than one {kind.__name__}")
        found[kind] = handler
    return found


class _Refused:
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


# What to use instead of an engine mpaccel does not drive (here, state.py, _absent.py).
SHARD_INSTEAD = (
    "prepare() the model as it is: DistributedDataParallel when it fits one device (every "
    "rank holds all of it), Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()) (FSDP2: "
    "parameters, gradients and optimizer state sharded over the ranks; HYBRID_SHARD with "
    "ParallelismConfig(dp_replicate_size=...)) when it does not (docs/training.md)."
)
_DDP_INSTEAD = "drop the plugin and " + SHARD_INSTEAD


class DeepSpeedPlugin(_Refused):
    _engine = "DeepSpeed"
    _hint = _DDP_INSTEAD


class MegatronLMPlugin(_Refused):
    _engine = "Megatron-LM"
    _hint = _DDP_INSTEAD


class TorchTensorParallelPlugin(_Refused):
    _engine = "tensor parallelism"
    _hint = _DDP_INSTEAD
