"""Accelerator: the facade users hold. It composes the state objects and delegates; it never
switches on the kind of distributed set-up."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from . import _absent, checkpoint, ops, preemption, shared_settings, tracking
from .accelerator_checkpoint import CheckpointMethods
from .accelerator_parallelism import ParallelismFacts
from .accelerator_training import TrainingMethods
from .config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
    handlers_by_type,
)
from .data.loader import PreparedLoader
from .device import release_memory
from .enums import DistributedType, DynamoBackend
from .errors import ConfigurationError, refused
from .state import AcceleratorState, GradientState, PartialState
from .training import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    make_grad_scaler,
    warn_fp16_on_cpu,
)

_LOMO_REFUSED = (
    "lomo_backward: LOMO optimizers (lomo-optim's Lomo, AdaLomo) are not supported by mpaccel",
    "use a torch.optim optimizer (AdamW, SGD, ...) with accelerator.backward(loss).",
)


class Accelerator(TrainingMethods, CheckpointMethods, ParallelismFacts):
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
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: DynamoBackend | str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        *,
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
        if dynamo_plugin is not None and dynamo_backend is not None:
            raise ConfigurationError(
                f"pass either dynamo_backend ({dynamo_backend!r}) or dynamo_plugin, not both",
                "put the backend in the plugin: TorchDynamoPlugin(backend=...).",
            )
        if dynamo_plugin is None:
            dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
        handlers = handlers_by_type(kwargs_handlers)
        pg = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
        if dataloader_config is None:
            dataloader_config = DataLoaderConfiguration(split_batches=split_batches)
        if even_batches is not None:
            dataloader_config.even_batches = even_batches
        if project_config is None:
            project_config = ProjectConfiguration(project_dir=project_dir)
        elif project_dir is not None:
            project_config.set_directories(project_dir)
        rng_types = rng_types if rng_types is not None else ["generator"]

        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugin=deepspeed_plugin if deepspeed_plugins is None else deepspeed_plugins,
            fsdp_plugin=fsdp_plugin,
            torch_tp_plugin=torch_tp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            parallelism_config=parallelism_config,
            _from_accelerator=True,
            _settings=shared_settings.of_accelerator(
                gradient_accumulation_plugin,
                dataloader_config,
                handlers.get(DistributedDataParallelKwargs, DistributedDataParallelKwargs()),
                rng_types,
            ),
            **pg.to_kwargs(),
        )
        self.gradient_state = GradientState(gradient_accumulation_plugin)
        self.device_placement = device_placement
        self.dataloader_config = dataloader_config
        self.project_configuration = project_config
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        self.log_with = tracking.resolve(log_with)  # an unknown tracker is an error now
        self.trackers: list[tracking.GeneralTracker] = []
        self._trigger = 0
        self.step = 0  # micro-batches since the last optimizer step (gradient accumulation)
        self.init_handler = handlers.get(InitProcessGroupKwargs)
        self.ddp_handler = handlers.get(DistributedDataParallelKwargs)
        self.autocast_handler = handlers.get(AutocastKwargs)
        self.profile_handler = handlers.get(ProfileKwargs)
        self.scaler_handler = handlers.get(GradScalerKwargs)
        self.scaler = make_grad_scaler(
            self.state.mixed_precision,
            self.device,
            self.scaler_handler.to_kwargs() if self.scaler_handler is not None else None,
        )
        # Prepared models run under autocast for both (Accelerate: not fp16 on CPU; warned).
        self.native_amp = self.state.mixed_precision in ("fp16", "bf16")
        if self.is_main_process:
            warn_fp16_on_cpu(self.state.mixed_precision, self.device)
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedLoader] = []
        self._data_seed: int | None = dataloader_config.data_seed
        self._custom_objects: list[Any] = []
        self._async_saver = checkpoint.AsyncSaver()
        self._preemption: preemption.Preemption | None = None
        self._save_model_state_pre_hook: OrderedDict[int, Callable] = OrderedDict()
        self._load_model_state_pre_hook: OrderedDict[int, Callable] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        # The state objects pickle as this process's shared state (state.py). What belongs to
        # the running process stays with the original: a background save (its thread and
        # communicator) and the preemption signal handlers.
        state = dict(self.__dict__)
        state["_async_saver"] = None
        state["_preemption"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._async_saver = checkpoint.AsyncSaver()

    # -- facts (delegated to the state) --------------------------------------------------------

    @property
    def _partial(self) -> PartialState:
        # Still the process's PartialState after AcceleratorState._reset_state(), as with
        # Accelerate: process facts and control answer then (its test scripts reset and then
        # ask is_local_main_process); the configuration (device, mixed precision) does not.
        partial = getattr(self.state, "_partial", None)
        return partial if partial is not None else PartialState()

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

    @property
    def dispatch_batches(self) -> Any:
        return getattr(self.dataloader_config, "dispatch_batches", None)

    @property
    def use_stateful_dataloader(self) -> bool:
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def multi_device(self) -> bool:
        """Several processes on accelerators (GPUs), as Accelerate: False on CPU."""
        return self.use_distributed and self.distributed_type == DistributedType.MULTI_GPU

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes the model where only some do: each node's local main
        process, as Accelerate's without a ParallelismConfig."""
        return self.is_local_main_process

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

    # -- experiment trackers (main process only; see mpaccel.tracking) ------------------------

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the trackers of `log_with` on the main process and record `config` there
        (hyperparameters); `init_kwargs={"wandb": {...}}` go to each tracker's constructor.
        Not collective. Called on every rank, each checks that the trackers writing files
        have a logging directory, so that all raise alike; the others then do nothing."""
        tracking.check_logging_dir(self.log_with, self.logging_dir)
        if not self.is_main_process:
            return
        self.trackers = tracking.start(
            self.log_with, project_name, self.logging_dir, init_kwargs or {}
        )
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The running tracker called `name` (its library's object if `unwrap`). Where no
        tracker runs (the other processes, or none started), a blank tracker whose methods do
        nothing, as in Accelerate, so the same code runs on every rank."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.trackers:
            raise ConfigurationError(
                f"no tracker named {name!r} (running: {[t.name for t in self.trackers]})",
                "pass it to Accelerator(log_with=...) and call init_trackers() first.",
            )
        return tracking.GeneralTracker(_blank=True)

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Record `values` at `step` with every tracker (main process only; not collective)."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def end_training(self) -> None:
        """Collective: finish the trackers, then tear down torch.distributed (as Accelerate)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_checkpoint()  # an async save still being written is committed first
        self.destroy_process_group()

    # -- collective operations on tensors --------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Collective: every rank's tensors (nested lists/tuples/dicts) concatenated along the
        first dimension in rank order; the first dimension may differ across ranks."""
        return ops.gather(self._partial.comm, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Collective: gather(), minus the samples even_batches repeated in the last batch, so
        metrics see each sample of the dataset exactly once. Data with any leaf that is not a
        tensor goes, whole, through gather_object (a flat list: the last batch is cut down to
        its real samples)."""
        use_gather_object = use_gather_object or not ops.only_tensors(input_data)
        if use_gather_object:
            data = ops.gather_object(self._partial.comm, input_data)
        else:
            data = ops.gather(self._partial.comm, input_data)
        state = self.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return data
        return data[: state.remainder] if use_gather_object else ops.truncate(data, state.remainder)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Collective: element-wise 'sum', 'mean', 'max' or 'min' over ranks."""
        return ops.reduce(self._partial.comm, tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Collective: pad along `dim` to the largest size on any rank."""
        return ops.pad_across_processes(self._partial.comm, tensor, dim, pad_index, pad_first)

    # -- models and memory -----------------------------------------------------------------------

    @property
    def has_lomo_optimizer(self) -> bool:
        """Whether a LOMO optimizer (lomo-optim's Lomo or AdaLomo) was prepared."""
        return any(
            type(opt.optimizer).__module__.partition(".")[0] == "lomo_optim"
            for opt in self._optimizers
        )

    @refused(*_LOMO_REFUSED)
    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Refused: mpaccel does not run LOMO optimizers' fused backward."""
        del loss, learning_rate
        raise ConfigurationError(*_LOMO_REFUSED)

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True if a submodule was dispatched over several devices (`hf_device_map`, from
        `from_pretrained(device_map=...)`): such a model cannot be trained data-parallel."""
        return any(len(getattr(m, "hf_device_map", ())) > 1 for m in model.modules())

    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop mpaccel's references to prepared objects and release cached memory; returns
        `objects` replaced by None (`a, b = accelerator.free_memory(a, b)`)."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.step = 0
        return release_memory(*objects)

    def clear(self, *objects: Any) -> list[Any]:
        return self.free_memory(*objects)

    def __repr__(self) -> str:
        return f"Accelerator(\n{self.state!r})"


# Accelerate's members for features mpaccel lacks: refusals with a HINT (mpaccel/_absent.py).
_absent.install_members(Accelerator)
