"""The kwargs handlers of `Accelerator(kwargs_handlers=[...])`, with Accelerate's names, and
their base `KwargsHandler` (the base of every configuration dataclass: unknown keys are
rejected, by name; `to_kwargs()` gives the fields changed from the defaults)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..enums import DDPCommunicationHookType
from ..errors import ConfigurationError


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
        from ..distributed import register_comm_hook

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
