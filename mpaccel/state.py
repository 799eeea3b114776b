"""PartialState, AcceleratorState and GradientState: shared-state classes, as Accelerate has them.

All instances of a class share one dictionary, filled by the first instantiation. PartialState
(process facts and control, discovery) lives in partial_state.py; this module adds the training
configuration (AcceleratorState) and gradient accumulation (GradientState). Resetting only
forgets the configuration, so tests can build a fresh state cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from . import _absent, _env, shared_settings, strategy
from .config import (
    SHARD_INSTEAD,
    GradientAccumulationPlugin,
    TorchDynamoPlugin,
)
from .errors import ConfigurationError
from .partial_state import (
    _PARTIAL_ATTRIBUTES,
    DEFAULT_TIMEOUT,
    TRAINING_STATE,
    PartialState,
    _discover,
    _missing,
    _shared_instance,
)

__all__ = ["AcceleratorState", "GradientState", "PartialState"]


_MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
_ENGINES = {
    "deepspeed_plugin": "DeepSpeed",
    "torch_tp_plugin": "tensor parallelism",
    "megatron_lm_plugin": "Megatron-LM",
}


def _partials(name: str) -> property:
    """A read-only property that is PartialState's of that name (the process's PartialState,
    so that it still answers after AcceleratorState._reset_state(), as Accelerate's does)."""
    return property(lambda self: getattr(PartialState(), name), doc=f"PartialState.{name}")


class AcceleratorState:
    """PartialState plus the training configuration (mixed precision, plugins). Shared state.

    Process facts and process control are PartialState's, reached through this object.
    `dynamo_plugin` is the TorchDynamoPlugin prepared models are compiled with. With an
    `fsdp_plugin` (or ACCELERATE_USE_FSDP=true) models are fully sharded: `distributed_type` is
    FSDP and `device_mesh` the mesh they are sharded over (built collectively here; its shape
    from `parallelism_config`, else from the nodes for HYBRID_SHARD). `strategy` is how models
    are parallelised (mpaccel.strategy), picked here once. The plugins of engines
    mpaccel does not drive (DeepSpeed, Megatron-LM, tensor parallelism) must be None: anything
    else is a ConfigurationError.
    """

    _shared_state: dict[str, Any] = TRAINING_STATE

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        _from_accelerator: bool = False,
        _settings: Sequence[shared_settings.Setting] = (),
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        for name, plugin in (
            ("deepspeed_plugin", deepspeed_plugin),
            ("torch_tp_plugin", torch_tp_plugin),
            ("megatron_lm_plugin", megatron_lm_plugin),
        ):
            if plugin is not None:
                raise ConfigurationError(
                    f"mpaccel does not drive {_ENGINES[name]}; got {name}={plugin!r}",
                    f"drop {name}= and {SHARD_INSTEAD}",
                )
        explicit_fsdp = fsdp_plugin
        try:  # the variable's error names it; raised on every rank (PartialState.__init__)
            requested = mixed_precision or _env.get_choice("mixed_precision")
            fsdp_plugin = strategy.choose_plugin(fsdp_plugin, parallelism_config)
        except ConfigurationError as exc:
            _discover(DEFAULT_TIMEOUT, exc)
            raise
        if requested is not None:
            requested = str(getattr(requested, "value", requested)).lower()
            if requested not in _MIXED_PRECISION:
                raise ConfigurationError(
                    f"mixed_precision={mixed_precision!r} is not one of {_MIXED_PRECISION}"
                )
            if requested == "fp8":
                raise ConfigurationError(
                    "mixed_precision='fp8' needs Transformer Engine / MS-AMP on recent GPUs, "
                    "which mpaccel does not drive",
                    "use 'bf16' or 'fp16'.",
                )
        partial = PartialState(cpu, **kwargs)
        if self.initialized:
            current = self.__dict__.get("fsdp_plugin")
            if _from_accelerator:  # Accelerator() is collective; what it asks may differ by rank
                resolved = shared_settings.of_state(
                    current if explicit_fsdp is None else explicit_fsdp,
                    self.__dict__.get("parallelism_config"),
                    requested or self._mixed_precision,
                )  # first, so that the refusals below are every rank's or none's
                shared_settings.compare(partial.comm, [*resolved, *_settings], "Accelerator()")
            if requested is not None and requested != self._mixed_precision:
                raise ConfigurationError(
                    f"AcceleratorState was already initialised with "
                    f"mixed_precision={self._mixed_precision!r} and cannot switch to "
                    f"{requested!r}",
                    "create the Accelerator once, or call AcceleratorState._reset_state() first.",
                )
            if explicit_fsdp is not None and explicit_fsdp is not current:
                raise ConfigurationError(
                    "AcceleratorState was already initialised "
                    + ("without an fsdp_plugin" if current is None else "with another fsdp_plugin"),
                    "create the Accelerator once, or call AcceleratorState._reset_state() first.",
                )
            if _from_accelerator:
                self._from_accelerator = True
            return
        mixed = requested or "no"
        if fsdp_plugin is not None and mixed in ("bf16", "fp16"):
            fsdp_plugin.set_mixed_precision(mixed)
        if _from_accelerator:  # before the mesh: building it is collective for FSDP ranks only
            resolved = shared_settings.of_state(fsdp_plugin, parallelism_config, mixed)
            shared_settings.compare(partial.comm, [*resolved, *_settings], "Accelerator()")
        chosen = strategy.build(partial, fsdp_plugin, parallelism_config)
        if chosen.distributed_type is not None:
            self.distributed_type = chosen.distributed_type
        self._partial = partial
        self._mixed_precision: str = mixed
        self.dynamo_plugin = dynamo_plugin if dynamo_plugin is not None else TorchDynamoPlugin()
        self.deepspeed_plugins: dict[str, Any] = {}
        self.fsdp_plugin = fsdp_plugin
        self.torch_tp_plugin = None
        self.megatron_lm_plugin = None
        self.parallelism_config = parallelism_config
        self.strategy = chosen  # how models are parallelised: the Accelerator asks it
        self.device_mesh = chosen.mesh  # FSDP's mesh; None without FSDP
        self._from_accelerator = _from_accelerator

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: the process facts and process control
        # (PartialState's), or anything once the state was reset.
        if name.startswith("__"):
            raise AttributeError(name)
        partial = self.__dict__.get("_partial")
        if partial is None:
            raise _missing("AcceleratorState", name, _ACCELERATOR_ATTRIBUTES)
        if name in _PARTIAL_ATTRIBUTES or hasattr(PartialState, name):
            return getattr(partial, name)
        raise _missing("AcceleratorState", name, _ACCELERATOR_ATTRIBUTES)

    def __reduce__(self) -> tuple[Any, ...]:
        # As PartialState's: the unpickled object is this process's shared state.
        return (_shared_instance, (AcceleratorState,))

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are fully sharded (mpaccel's FSDP is always torch's FSDP2)."""
        return self.__dict__.get("fsdp_plugin") is not None

    # The process-control methods and facts Accelerate's AcceleratorState has are defined here,
    # so that the class has them (help, inspect.signature, hasattr on the class); the rest of
    # PartialState's surface is reached through __getattr__. As Accelerate's, they ask the
    # process's PartialState, not this state's: they keep working after _reset_state() (its
    # scripts reset, then call accelerator.is_local_main_process or state.destroy_process_group).
    def wait_for_everyone(self, timeout: float | timedelta | None = None) -> None:
        """Collective; see PartialState.wait_for_everyone."""
        PartialState().wait_for_everyone(timeout)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """See PartialState.print."""
        PartialState().print(*args, **kwargs)

    use_distributed = _partials("use_distributed")
    is_main_process = _partials("is_main_process")
    is_local_main_process = _partials("is_local_main_process")
    is_last_process = _partials("is_last_process")
    fork_launched = _partials("fork_launched")

    def destroy_process_group(self, group: Any = None) -> None:
        """See PartialState.destroy_process_group."""
        PartialState().destroy_process_group(group)

    def main_process_first(self) -> AbstractContextManager[None]:
        """Collective; see PartialState.main_process_first."""
        return PartialState().main_process_first()

    def local_main_process_first(self) -> AbstractContextManager[None]:
        """Collective; see PartialState.local_main_process_first."""
        return PartialState().local_main_process_first()

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> AbstractContextManager[Any]:
        """Not collective; see PartialState.split_between_processes."""
        return PartialState().split_between_processes(inputs, apply_padding)

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    @property
    def deepspeed_plugin(self) -> Any:
        return None

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The DeepSpeed plugin registered under `name` (mpaccel registers none)."""
        try:
            return self.deepspeed_plugins[name]
        except KeyError:
            raise ConfigurationError(
                f"no DeepSpeed plugin named {name!r}: mpaccel does not drive DeepSpeed"
            ) from None

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Activate the DeepSpeed plugin `name` (mpaccel registers none)."""
        self.get_deepspeed_plugin(name)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return repr(self._partial) + f"Mixed precision type: {self.mixed_precision}\n"

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


# What a set-up AcceleratorState holds: named in the error after a reset (with PartialState's).
_ACCELERATOR_ATTRIBUTES = _PARTIAL_ATTRIBUTES | {
    "_partial",
    "_mixed_precision",
    "_from_accelerator",
    "dynamo_plugin",
    "deepspeed_plugins",
    "fsdp_plugin",
    "torch_tp_plugin",
    "megatron_lm_plugin",
    "parallelism_config",
    "device_mesh",
    "strategy",
    "num_processes",
    "process_index",
    "local_process_index",
    "is_main_process",
    "is_local_main_process",
    "use_distributed",
}


def is_initialized() -> bool:
    """AcceleratorState exists in this process (an Accelerator or AcceleratorState was made, and
    not reset): AcceleratorState().initialized without creating one. Not collective."""
    return AcceleratorState._shared_state != {}


class GradientState:
    """Gradient synchronisation state for accumulation (shared state)."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None):
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references: list[Any] = [None]
            self.plugin_kwargs: dict[str, Any] = {}
            self._is_xla_gradients_synced = False
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = {
                "num_steps": gradient_accumulation_plugin.num_steps or 1,
                "adjust_scheduler": gradient_accumulation_plugin.adjust_scheduler,
                "sync_with_dataloader": gradient_accumulation_plugin.sync_with_dataloader,
                "sync_each_batch": gradient_accumulation_plugin.sync_each_batch,
            }

    def __reduce__(self) -> tuple[Any, ...]:
        # As PartialState's: the unpickled object is this process's shared state.
        return (_shared_instance, (GradientState,))

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def sync_each_batch(self) -> bool:
        return self.plugin_kwargs.get("sync_each_batch", False)

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        if not self.in_dataloader:
            return False
        return bool(getattr(self.active_dataloader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        if not self.in_dataloader:
            return -1
        return int(getattr(self.active_dataloader, "remainder", -1))

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Always False: mpaccel has no XLA path (kept for code that reads it)."""
        return self._is_xla_gradients_synced

    @is_xla_gradients_synced.setter
    def is_xla_gradients_synced(self, value: bool) -> None:
        self._is_xla_gradients_synced = value

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        # A pass left paused (a peek, a break) ends when its iterator is collected, which may
        # be after the state was reset (and not set up again yet): then there is nothing to do.
        references = self.__dict__.get("dataloader_references")
        if references is None:
            return
        if dataloader in references:
            references.remove(dataloader)
        self.active_dataloader = references[-1]

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        GradientState._shared_state.clear()


# Accelerate's names for features mpaccel lacks: refusals with a HINT (mpaccel/_absent.py).
_absent.install_members(AcceleratorState)

if not TYPE_CHECKING:  # type checkers keep reporting these names as absent

    def __getattr__(name: str) -> Any:
        return _absent.resolve(__name__, name)
