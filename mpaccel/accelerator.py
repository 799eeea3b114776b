"""Accelerator: the facade users hold. It composes the state objects and delegates; it never
switches on the kind of distributed set-up."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from .errors import ConfigurationError
from .state import AcceleratorState, GradientState, PartialState
from .utils.dataclasses import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProjectConfiguration,
)


def _handlers_by_type(handlers: Iterable[KwargsHandler] | None) -> dict[type, KwargsHandler]:
    known = (InitProcessGroupKwargs,)
    found: dict[type, KwargsHandler] = {}
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


class Accelerator:
    """Entry point: process facts, process control, and (see the training docs) training.

    Creating it is collective: every process of the job must create one.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: Any = None,
        even_batches: bool | None = None,
    ) -> None:
        if gradient_accumulation_plugin is not None and gradient_accumulation_steps != 1:
            raise ValueError(
                "pass either gradient_accumulation_steps or gradient_accumulation_plugin, not "
                "both: put num_steps in the plugin, "
                "GradientAccumulationPlugin(num_steps=...)"
            )
        if gradient_accumulation_plugin is None:
            if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
                raise ValueError(
                    f"gradient_accumulation_steps must be an int >= 1, got "
                    f"{gradient_accumulation_steps!r}"
                )
            gradient_accumulation_plugin = GradientAccumulationPlugin(
                num_steps=gradient_accumulation_steps
            )
        handlers = _handlers_by_type(kwargs_handlers)
        pg = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
        if dataloader_config is None:
            dataloader_config = DataLoaderConfiguration(split_batches=split_batches)
        if even_batches is not None:
            dataloader_config.even_batches = even_batches
        if project_config is None:
            project_config = ProjectConfiguration(project_dir=project_dir)
        elif project_dir is not None:
            project_config.set_directories(project_dir)

        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            _from_accelerator=True,
            **pg.to_kwargs(),
        )
        self.gradient_state = GradientState(gradient_accumulation_plugin)
        self.device_placement = device_placement
        self.dataloader_config = dataloader_config
        self.project_configuration = project_config
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types if rng_types is not None else ["generator"]
        self.log_with = log_with
        self.dynamo_backend = dynamo_backend
        self._trigger = 0

    # -- facts (delegated to the state) --------------------------------------------------------

    @property
    def _partial(self) -> PartialState:
        return self.state._partial

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self._partial.num_processes

    @property
    def process_index(self) -> int:
        return self._partial.process_index

    @property
    def local_process_index(self) -> int:
        return self._partial.local_process_index

    @property
    def num_nodes(self) -> int:
        return self._partial.num_nodes

    @property
    def node_index(self) -> int:
        return self._partial.node_index

    @property
    def use_distributed(self) -> bool:
        return self._partial.use_distributed

    @property
    def is_main_process(self) -> bool:
        return self._partial.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._partial.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self._partial.is_last_process

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": value})

    # -- process control (delegated) ------------------------------------------------------------

    def wait_for_everyone(self, timeout: float | timedelta | None = None) -> None:
        """Collective: see PartialState.wait_for_everyone."""
        self._partial.wait_for_everyone(timeout)

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Collective: see PartialState.main_process_first."""
        with self._partial.main_process_first():
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Collective: see PartialState.local_main_process_first."""
        with self._partial.local_main_process_first():
            yield

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """See PartialState.split_between_processes."""
        with self._partial.split_between_processes(inputs, apply_padding) as share:
            yield share

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() once per node (on each local main process)."""
        self._partial.print(*args, **kwargs)

    def on_main_process(self, function: Callable | None = None) -> Callable:
        return self._partial.on_main_process(function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        return self._partial.on_local_main_process(function)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        return self._partial.on_last_process(function)

    def on_process(
        self, function: Callable | None = None, process_index: int | None = None
    ) -> Callable:
        return self._partial.on_process(function, process_index)

    def on_local_process(
        self,
        function: Callable | None = None,
        local_process_index: int | None = None,
        *,
        local_process_idx: int | None = None,
    ) -> Callable:
        return self._partial.on_local_process(
            function, local_process_index, local_process_idx=local_process_idx
        )

    # -- triggers --------------------------------------------------------------------------------

    def set_trigger(self) -> None:
        """Not collective: raise this process's flag for the next check_trigger()."""
        self._trigger = 1

    def check_trigger(self) -> bool:
        """Collective: True on every rank if any rank called set_trigger() since the last check;
        the flag is then cleared everywhere. One host-side MPI all-reduce of an int."""
        if self._partial.comm.allreduce(self._trigger, "max", "check_trigger"):
            self._trigger = 0
            return True
        return False

    def destroy_process_group(self, group: Any = None) -> None:
        self._partial.destroy_process_group(group)

    def __repr__(self) -> str:
        return f"Accelerator(\n{self.state!r})"
