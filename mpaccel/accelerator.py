"""Accelerator: the facade users hold. It composes the state objects, the parallelism strategy
(mpaccel.strategy, picked once by AcceleratorState), the data loaders, the checkpoint layer and
the trackers, and delegates to them; it never switches on the kind of distributed set-up.

One class in one file, past 600 lines, as Accelerate's and Lightning Fabric's (fabric.py): its
members are Accelerate's API, each a few lines that hand the work down; splitting them by
concern made mixins typed against Protocol stubs that restated the class."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from . import _absent, checkpoint, distributed, ops, preemption, shared_settings, tracking, training
from .comm import agreement
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
from .data.prepare import agreed_seed
from .data.prepare import build as build_prepared
from .data.samplers import ShardedBatchSampler
from .data.skip import skip_first_batches
from .device import release_memory
from .enums import DistributedType, DynamoBackend
from .errors import (
    ConfigurationError,
    MpaccelRuntimeWarning,
    MpaccelWarning,
    refused,
    with_hint,
)
from .state import AcceleratorState, GradientState, PartialState
from .strategy import Strategy
from .training import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    autocast_context,
    compile_model,
    make_grad_scaler,
    patch_forward,
    warn_fp16_on_cpu,
)

_LOMO_REFUSED = (
    "lomo_backward: LOMO optimizers (lomo-optim's Lomo, AdaLomo) are not supported by mpaccel",
    "use a torch.optim optimizer (AdamW, SGD, ...) with accelerator.backward(loss).",
)
_SET_CONFIG = (
    "pass Accelerator(fsdp_plugin=..., parallelism_config=ParallelismConfig("
    "dp_replicate_size=..., dp_shard_size=...))."
)


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

    # -- the parallel layout (the strategy's) ---------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """How models are parallelised (mpaccel.strategy), picked once by AcceleratorState: the
        Accelerator asks it, never which one it is."""
        return self.state.strategy

    def _mesh_rank(self, dim: str, what: str) -> int:
        """This rank's index along the mesh dimension `dim` ('dp_replicate', 'dp_shard', 'tp'), 0
        where the ParallelismConfig leaves it at size 1 (tp always: mpaccel drives no tensor
        parallelism); an error without a ParallelismConfig, as Accelerate's."""
        config = self.state.parallelism_config
        if config is None:
            message = f"{what} is not configured: the Accelerator has no parallelism_config"
            raise RuntimeError(with_hint(message, _SET_CONFIG))
        if not getattr(config, f"{dim}_enabled"):
            return 0
        return self.strategy.mesh_rank(dim)

    @property
    def is_fsdp2(self) -> bool:
        return self.state.is_fsdp2

    @property
    def deepspeed_plugin(self) -> Any:
        return None

    @property
    def parallelism_config(self) -> Any:
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        return self.state.device_mesh

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return False

    @property
    def data_parallel_rank(self) -> int:
        """This rank's replica index (mesh dimension 'dp_replicate'): 0 where the
        ParallelismConfig has dp_replicate_size 1. RuntimeError without a ParallelismConfig."""
        return self._mesh_rank("dp_replicate", "data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's index in its shard group (mesh dimension 'dp_shard'): 0 where the
        ParallelismConfig has dp_shard_size 1. RuntimeError without a ParallelismConfig."""
        return self._mesh_rank("dp_shard", "shard-based data parallelism")

    @property
    def tensor_parallel_rank(self) -> int:
        """0 with a ParallelismConfig (mpaccel drives no tensor parallelism: every rank holds
        the same slice); RuntimeError without one, as Accelerate's."""
        return self._mesh_rank("tp", "tensor parallelism")

    @property
    def context_parallel_rank(self) -> int:
        """NotImplementedError, as Accelerate's: there is no context parallelism."""
        raise NotImplementedError(with_hint(
            "context parallelism is not supported (in Accelerate neither)",
            "split long sequences yourself; ParallelismConfig's cp_size must be 1.",
        ))  # fmt: skip

    @property
    def pipeline_parallel_rank(self) -> int:
        """NotImplementedError, as Accelerate's: there is no pipeline parallelism."""
        raise NotImplementedError(with_hint(
            "pipeline parallelism is not supported (in Accelerate neither)",
            "shard the model with an fsdp_plugin instead of splitting it into stages.",
        ))  # fmt: skip

    @contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[Any] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[Any] | None = None,
    ) -> Iterator[None]:
        """No effect, as Accelerate's without context parallelism (cp_size 1, the only size
        mpaccel takes): the buffers stay whole. Warns once per process, as Accelerate's."""
        del buffers, buffer_seq_dims, no_restore_buffers
        global _warned_no_context_parallel
        if not _warned_no_context_parallel:
            _warned_no_context_parallel = True
            warnings.warn(
                "maybe_context_parallel() has no effect: mpaccel drives no context "
                "parallelism (ParallelismConfig's cp_size must be 1), as Accelerate's without "
                "cp_size > 1; every rank sees whole sequences",
                MpaccelWarning,
                stacklevel=3,
            )
        yield

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

    # -- preparing objects -----------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Collective. Models, optimizers, dataloaders and schedulers, in any order, returned
        in the same order: models on the device (DistributedDataParallel on several ranks, its
        parameters broadcast from rank 0), optimizers and schedulers aware of accumulation,
        dataloaders sharded across ranks. Anything else is returned as it is. With an FSDP plugin
        the models are fully sharded instead, and the optimizers passed with them re-pointed at
        the shards (pass each model with its optimizer, as Accelerate requires for FSDP2)."""
        if device_placement is None:
            device_placement = [self.device_placement] * len(args)
        elif len(device_placement) != len(args):
            raise ConfigurationError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects"
            )
        prepared: list[Any] = list(args)
        kinds = (torch.nn.Module, torch.optim.Optimizer, DataLoader)
        optimizers = [getattr(o, "optimizer", o) for o in args if _is_optimizer(o)]
        models = [m for m in args if isinstance(m, torch.nn.Module)]
        # under FSDP, the optimizers must not pin the whole tensors while they are sharded
        with self.strategy.optimizers_follow(models, optimizers, self._models):
            for index, obj in enumerate(args):  # schedulers need the prepared optimizers first
                if isinstance(obj, kinds):
                    prepared[index] = self._prepare_one(obj, device_placement[index])
        for index, obj in enumerate(args):
            if _is_scheduler(obj):
                prepared[index] = self.prepare_scheduler(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, obj: Any, placement: bool) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        return self.prepare_data_loader(obj, device_placement=placement)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Collective when distributed (DDP broadcasts rank 0's parameters and buffers). A
        model prepared already (or the module inside one) gives back its prepared model;
        a DDP or sharded model prepared before free_memory() (transformers' Trainer prepares in
        evaluate(), frees, prepares again in train()) comes back as it is.
        With a dynamo backend (Accelerator(dynamo_backend=...) or dynamo_plugin=), the model
        returned is torch.compile's wrapper around it, made last, as Accelerate does; with
        TorchDynamoPlugin(use_regional_compilation=True), compile_regions' copy of it (each
        repeated block compiled on its own, sharing the parameters)."""
        inner = self.unwrap_model(model, keep_torch_compile=False)
        for prepared in self._models:
            if inner is self.unwrap_model(prepared, keep_torch_compile=False):
                compiled = training.is_compiled_module(model) or training.is_regionally_compiled(
                    model
                )
                return model if compiled else prepared
        if self.strategy.is_prepared(model):
            self._models.append(model)  # by a prepare() before free_memory(), as Trainer does
            return model
        placement = device_placement if device_placement is not None else self.device_placement
        model = self.strategy.place(model, placement)  # collective under FSDP (fully_shard)
        patch_forward(model, self.mixed_precision, self.device, self._autocast_options())
        if any(p.requires_grad for p in model.parameters()) and not evaluation_mode:
            model = self.strategy.wrap(model, self.ddp_handler)
        self._models.append(model)
        plugin = self.state.dynamo_plugin
        if plugin.backend != DynamoBackend.NO:
            # Only the user's copy is compiled: checkpoints work on the model kept in _models,
            # and no_sync, accumulate and Join find the DDP inside the compiled one.
            return compile_model(model, plugin.to_kwargs(), bool(plugin.use_regional_compilation))
        return model

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Not collective. The optimizer, aware of gradient accumulation and fp16 loss scaling;
        with device placement (the Accelerator's by default) its state tensors (a loaded
        state_dict's, say) move to the device, as Accelerate's."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        if device_placement if device_placement is not None else self.device_placement:
            training.move_optimizer_state(optimizer, self.device)
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.scaler)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        optimizers = [o for o in self._optimizers if o.optimizer is scheduler.optimizer]
        wrapped = AcceleratedScheduler(
            scheduler,
            optimizers or self._optimizers,
            self.gradient_state,
            self.num_processes,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(
        self,
        data_loader: DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Callable | None = None,
    ) -> DataLoader:
        """Collective the first time (the shuffling seed is agreed over MPI, unless
        `dataloader_config.data_seed` is set). The loader is prepared as
        `dataloader_config` says, read at this call; `slice_fn_for_dispatch` cuts global batches
        when they are dispatched. A loader prepared already is returned as it is."""
        if issubclass(type(data_loader), PreparedLoader):  # isinstance would say DataLoader too
            return data_loader
        config = self.dataloader_config
        seed = config.data_seed
        if seed is None:
            if self._data_seed is None:
                self._data_seed = agreed_seed(self._partial.comm)
            seed = self._data_seed
        place = device_placement if device_placement is not None else self.device_placement
        shard = build_prepared(
            data_loader,
            device=self.device if place else None,
            num_processes=self.strategy.data_parallel_size,
            process_index=self.strategy.data_parallel_rank,
            world=(self.num_processes, self.process_index),
            split_batches=config.split_batches,
            put_on_device=place,
            rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=config.use_seedable_sampler,
            seed=seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
            torch_device_mesh=None,
            gradient_state=self.gradient_state,
        )
        self._dataloaders.append(shard)
        return shard  # type: ignore[return-value]  # it passes for a DataLoader

    @contextmanager
    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Collective in effect. Training or evaluation where ranks get different numbers of
        batches: torch.distributed's Join around the block, so that DDP models (and other
        Joinables) of ranks that ran out of batches keep answering the others' all-reduces
        instead of leaving them hanging. `even_batches` overrides the prepared map-style
        loaders' setting inside the block (False: no repeated samples, uneven batches); Join
        is enabled only when batches are uneven. Does nothing in a world of one, and warns
        (UserWarning) and does nothing for set-ups other than DDP on CPUs or GPUs."""
        if not self.strategy.joins_uneven_inputs(self.distributed_type):
            if self.distributed_type != DistributedType.NO:
                warnings.warn(
                    f"joining uneven inputs is only supported for multi-GPU and multi-CPU "
                    f"DistributedDataParallel training, not {self.distributed_type}: "
                    f"join_uneven_inputs has no effect",
                    MpaccelWarning,
                    stacklevel=3,
                )
            yield
            return
        changed = []
        if even_batches is not None:
            for loader in self._dataloaders:
                if isinstance(loader.sharding, ShardedBatchSampler):
                    changed.append((loader.sharding, loader.sharding.even_batches))
                    loader.sharding.even_batches = even_batches
            if len(changed) < len(self._dataloaders):
                warnings.warn(
                    "overriding even_batches in join_uneven_inputs is only supported for "
                    "map-style datasets; the loaders of iterable datasets keep their setting",
                    MpaccelWarning,
                    stacklevel=3,
                )
        else:
            even_batches = self.even_batches
        if not even_batches and self.gradient_accumulation_steps > 1:
            warnings.warn(
                "join_uneven_inputs with gradient accumulation: a rank whose loader ends first "
                "synchronises gradients at its last batch while the others are inside no_sync, "
                "and DDP's all-reduces then no longer pair up (the job waits until the "
                "timeout); accumulate only where every rank has the same number of batches",
                MpaccelRuntimeWarning,
                stacklevel=3,
            )
        try:
            with distributed.join(joinables, enable=not even_batches):
                yield
        finally:
            for sharding, value in changed:
                sharding.even_batches = value

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> Any:
        """A prepared loader: the same one, whose next pass starts after `num_batches` batches.
        Any other DataLoader: a new one that leaves them out on every pass (as Accelerate's)."""
        return skip_first_batches(dataloader, num_batches)

    # -- the training step -----------------------------------------------------------------------

    def _do_sync(self) -> None:
        if self.gradient_state.sync_with_dataloader and self.gradient_state.end_of_dataloader:
            self.step = 0
            self.gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            self.gradient_state._set_sync_gradients(self.step % self.gradient_state.num_steps == 0)

    @contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Not collective. One micro-batch: decides whether this step synchronises gradients
        (every `gradient_accumulation_steps`, and at the end of the dataloader) and, when it
        does not, suppresses DDP's all-reduce in backward."""
        self._do_sync()
        each_batch = self.use_distributed and self.gradient_state.sync_each_batch
        allow = self.sync_gradients or each_batch
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(contextlib.nullcontext() if allow else self.no_sync(model))
            yield

    @contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Gradients computed in this block are not all-reduced (DDP, compiled or not) nor
        reduce-scattered (FSDP: each rank accumulates whole gradients until the next
        synchronising backward); a no-op otherwise."""
        with self.strategy.no_sync(model):
            yield

    @staticmethod
    @contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """The backward of this block all-reduces the gradients, even inside no_sync() (DDP
        only; a no-op otherwise): for a last micro-batch whose forward ran under no_sync, as in
        Accelerate. Relies on DDP internals, as Accelerate's does."""
        ddp: Any = distributed.ddp_of(model)
        if ddp is None:
            yield
            return
        saved = (ddp.require_backward_grad_sync, ddp.require_forward_param_sync)
        ddp.require_backward_grad_sync = True
        ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            ddp.require_backward_grad_sync, ddp.require_forward_param_sync = saved

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward(), divided by the accumulation steps and scaled for fp16. With DDP, the
        gradients are all-reduced here on synchronising steps."""
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """fp16: divide gradients by the loss scale (done for you before clipping)."""
        targets = (
            self._optimizers
            if optimizer is None
            else (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        )
        for opt in targets:
            if isinstance(opt, AcceleratedOptimizer):
                opt.unscale_gradients()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Clip the gradients' total norm (after fp16 unscaling); returns the total norm before
        clipping. After DDP's all-reduce the gradients, and so the norm, agree on every rank.
        Under FSDP, collective: the norm is the whole model's, reduced over the shards."""
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value] (after fp16 unscaling)."""
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Run the block in the configured mixed precision (prepared models already do), with
        `autocast_handler`'s options if given, else those of kwargs_handlers' AutocastKwargs."""
        options = self._autocast_options(autocast_handler)
        with autocast_context(self.mixed_precision, self.device, options):
            yield

    def _autocast_options(self, handler: KwargsHandler | None = None) -> dict[str, Any]:
        chosen = handler or self.autocast_handler
        return chosen.to_kwargs() if chosen is not None else {}

    @contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Not collective. torch.profiler around the block, configured by `profile_handler`, else
        the ProfileKwargs of kwargs_handlers, else torch's defaults; yields the profiler (call
        its step() per iteration when a schedule is set). Each rank profiles itself; with
        output_trace_dir, each writes its Chrome trace there, named by Accelerate's
        PROFILE_PATTERN_NAME with its rank (profile_<rank>.json)."""
        from .utils import constants  # read when called: the one definition of the name

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        name = constants.PROFILE_PATTERN_NAME.format(suffix=self.process_index)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, name))

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """fp16: the last optimizer step was skipped because gradients overflowed."""
        return any(opt.step_was_skipped for opt in self._optimizers)

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

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> Any:
        """The user's model without DDP (and, with keep_fp32_wrapper=False, without autocast).
        A compiled model comes back compiled (around the unwrapped module) unless
        keep_torch_compile=False. Under FSDP, the sharded model itself (whose transformers
        `save_pretrained`, called on every rank, writes whole tensors)."""
        return training.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(
        self, model: torch.nn.Module, unwrap: bool = True, *, all_ranks: bool = False
    ) -> dict[str, Any]:
        """Not collective, but under FSDP. The model's state_dict (of the unwrapped model by
        default: no `module.` prefix from DDP, nor `_orig_mod.` from torch.compile), as
        Accelerate's, to save it or hand it to another library. A fully sharded model's is
        gathered into whole CPU tensors: on rank 0 only (the others get {}), as Accelerate's,
        or with `all_ranks=True` on every rank."""
        if unwrap:
            model = self.unwrap_model(model, keep_torch_compile=False)
        return self.strategy.full_state_dict(model, everywhere=all_ranks)

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

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """torch.save (or safetensors) on the main process only; others do nothing."""
        if not self.is_main_process:
            return
        if safe_serialization:
            try:
                from safetensors.torch import save_file
            except ImportError as exc:
                raise ConfigurationError(
                    "safe_serialization=True needs the safetensors package",
                    "pip install safetensors",
                ) from exc
            save_file(obj, f)
        else:
            torch.save(obj, f)

    # -- checkpoints -----------------------------------------------------------------------------

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Collective when every rank calls it; also callable by one rank alone (`if
        accelerator.is_main_process:`), which then writes everything (docs/checkpoint-format.md,
        "Saving from one rank"). The unwrapped model's weights in shards of at most
        `max_shard_size`, written in parallel (shard i by rank i mod N): with
        `safe_serialization=True` (Accelerate's default) as `model.safetensors`, or
        `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`, Hugging Face's
        layout; with `safe_serialization=False` as mpaccel's HDF5 shards + `model.index.json`
        (never a pickle; read back with `mpaccel.checkpoint.load_model_state(dir)`). Under FSDP
        every rank must call it: each writes its own rows of the full tensors into the same
        files, at their offsets (no rank gathers a tensor)."""
        checkpoint.save_model(
            self._partial.comm, self.unwrap_model(model), save_directory, max_shard_size,
            safe_serialization=safe_serialization,
        )

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with state_dict()/load_state_dict() in save_state/load_state."""
        bad = [
            o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            raise TypeError(
                f"register_for_checkpointing needs objects with state_dict() and "
                f"load_state_dict(); {[type(o).__name__ for o in bad]} lack them"
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, weights, output_dir)` in save_state() before anything is written,
        on every rank, in the order registered: `models` are the prepared models, `weights`
        their state_dicts (as prepared: with DDP's `module.` prefix), `output_dir` the
        checkpoint's directory (created). A hook that saves a model its own way removes its
        entry from `weights` (`weights.pop()`): that model is then left out of the checkpoint
        (its hook must load it: register_load_state_pre_hook). Returns a handle whose
        remove() unregisters the hook."""
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, input_dir)` in load_state() before anything is read, on every
        rank, in the order registered: a hook that loads a model its own way removes it from
        `models`, which load_state() then leaves alone. Returns a removable handle."""
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def _run_pre_hooks(
        self, hooks: Iterable[Callable], arguments: tuple, listed: list, what: str,
        comm: Any = None,
    ) -> list[torch.nn.Module]:
        """Collective. Call the `hooks` with `arguments` (of which `listed` is the list the
        hooks may shorten, one entry per prepared model); returns the models whose entries
        remain, the same on every rank (a hook failing on any rank fails every rank)."""
        entries = list(listed)
        comm = self._partial.comm if comm is None else comm  # a NullComm: a save by one rank
        with agreement(comm, what):
            for hook in hooks:
                hook(*arguments)
        kept = [i for i, entry in enumerate(entries) if any(entry is e for e in listed)]
        everyone = comm.allgather(kept, what)
        if any(k != kept for k in everyone):
            raise ConfigurationError(
                f"{what}: the hooks removed different models on different ranks "
                f"({dict(enumerate(everyone))}: indices of the models kept)",
                "the hooks must remove the same entries on every rank.",
            )
        return [self._models[i] for i in kept]

    def _checkpoint_objects(
        self, models: list[torch.nn.Module], gradients: bool, loading: bool = False
    ) -> checkpoint.TrainingState:
        """What save_state/load_state hand the checkpoint, under the names of its entries:
        `models` (what the pre-hooks left), then everything else prepared or registered;
        with `gradients`, the models' gradients per rank. Fully sharded models and their
        optimizers are `sharded` entries (each rank stores its rows; their gradients too, as
        rows: checkpoint/sharded/state.py). `loading`: a fresh optimizer over shards gets its
        state created to load into."""
        return checkpoint.TrainingState.from_prepared(
            [self.unwrap_model(model) for model in models],
            self._optimizers,
            self._schedulers,
            self._dataloaders,
            scaler=self.scaler,
            custom=self._custom_objects,
            step=_AccumulationStep(self),
            gradients=gradients,
            loading=loading,
            sharded_entries=self.strategy.checkpoint_entries,
            summed_gradients=self.strategy.summed_gradients,
        )

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        *,
        async_save: bool = False,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Collective when every rank calls it; also callable by one rank alone, which then
        writes everything it holds (docs/checkpoint-format.md, "Saving from one rank").
        Models, optimizers, schedulers, grad scaler, registered objects, and each
        rank's RNG states and dataloader positions, as an HDF5 checkpoint committed atomically.
        Ranks that pass different directories use rank 0's (with a warning).
        With ProjectConfiguration(automatic_checkpoint_naming=True) the directory is
        project_dir/checkpoints/checkpoint_<n> and old ones are rotated (total_limit).
        async_save=True (keyword only) snapshots to host memory and writes in the background;
        see wait_for_checkpoint(). Returns the directory. HDF5 holds no pickles, so
        `safe_serialization` (Accelerate's choice of safetensors over pickle) is always
        honoured; `save_model_func_kwargs` (Accelerate passes them to DeepSpeed) are ignored.
        Hooks of register_save_state_pre_hook run first."""
        del safe_serialization, save_model_func_kwargs
        # Saved mid-accumulation: each rank's gradients summed so far are part of the state.
        gradients = not self.sync_gradients

        def run_hooks(comm: Any, directory: str) -> checkpoint.TrainingState:
            if directory:
                try:  # an error here is the checkpoint's to report, collectively
                    os.makedirs(directory, exist_ok=True)
                except Exception:
                    pass
            weights = [self.get_state_dict(m, unwrap=False) for m in self._models]
            models = self._run_pre_hooks(
                list(self._save_model_state_pre_hook.values()),
                (self._models, weights, directory),
                weights,
                "save_state (pre-hooks)",
                comm,
            )
            return self._checkpoint_objects(models, gradients)

        return checkpoint.save_state(
            self._partial.comm,
            self._checkpoint_objects(self._models, gradients),
            output_dir,
            project=self.project_configuration,
            saver=self._async_saver,
            async_save=async_save,
            before=run_hooks if self._save_model_state_pre_hook else None,
        )

    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        allow_pickle: bool | None = None,
        **load_model_func_kwargs: Any,
    ) -> str:
        """Collective. Restore what save_state wrote (the latest complete checkpoint when
        input_dir is None and automatic naming is on). Works at another world size: shared
        state loads anywhere; per-rank RNG states are then skipped, with a warning. Ranks that
        pass different directories use rank 0's (with a warning).

        A directory written by Hugging Face Accelerate's save_state is recognised: its
        safetensors model weights load; its pickles (`optimizer.bin`, `scheduler.bin`,
        `pytorch_model.bin`, `random_states_<rank>.pkl`, ...) only with `allow_pickle=True`
        (keyword only) or MPACCEL_ALLOW_PICKLE=1, for a directory you trust; otherwise an
        error names them, before anything changes. That load is all or nothing on every rank
        too (checkpoint/accelerate_layout.py).

        `load_model_func_kwargs` go to the models' load_state_dict (`strict=False`: keys may
        be missing or extra; `assign`). `load_kwargs` (Accelerate's options for torch.load) is
        accepted and has nothing to act on. Hooks of register_load_state_pre_hook run first."""
        del load_kwargs

        def run_hooks(comm: Any, directory: str | None) -> checkpoint.TrainingState:
            listed = list(self._models)
            models = self._run_pre_hooks(
                list(self._load_model_state_pre_hook.values()),
                (listed, directory),
                listed,
                "load_state (pre-hooks)",
                comm,
            )
            return self._checkpoint_objects(models, gradients=True, loading=True)

        return checkpoint.load_state(
            self._partial.comm,
            self._checkpoint_objects(self._models, gradients=True, loading=True),
            input_dir,
            project=self.project_configuration,
            saver=self._async_saver,
            model_options=load_model_func_kwargs,
            node_share=(self.local_process_index, self._partial.local_num_processes),
            allow_pickle=allow_pickle,
            before=run_hooks if self._load_model_state_pre_hook else None,
        )

    def wait_for_checkpoint(self) -> None:
        """Collective in effect: block until an async save is committed (re-raises its error)."""
        self._async_saver.wait()

    # -- preemption (Slurm) ----------------------------------------------------------------------

    def handle_preemption(
        self, signals: Any = preemption.DEFAULT_SIGNALS, requeue: bool = True
    ) -> None:
        """Not collective. From now on SIGUSR1/SIGTERM (Slurm's --signal, preemption, the
        wall-time limit) are only recorded; the loop then asks should_stop() at step
        boundaries and calls checkpoint_and_exit(). `requeue`: put the job back in the queue."""
        if self._preemption is not None:
            self._preemption.uninstall()
        self._preemption = preemption.Preemption(signals, requeue)
        self._preemption.install()

    def should_stop(self) -> bool:
        """Collective: True on every rank once any rank received a preemption signal, at the
        first optimizer-step boundary from then on (mid-accumulation it waits for the step, so
        the checkpoint holds no half-accumulated gradients). One MPI all-reduce of an int;
        False without one when handle_preemption() was not called."""
        if self._preemption is None:
            return False
        return self._preemption.check(self._partial.comm) and self.sync_gradients

    @property
    def preempted(self) -> str | None:
        """The signal that stopped the job ('SIGUSR1', ...), None if none arrived here."""
        return None if self._preemption is None else self._preemption.signal_name

    def checkpoint_and_exit(self, output_dir: str | None = None, exit_code: int = 0) -> None:
        """Collective: save_state() (committed, even if async saves are pending), then rank 0
        requeues the Slurm job if handle_preemption(requeue=True), then every rank exits."""
        directory = self.save_state(output_dir)
        self.wait_for_checkpoint()
        # Finish MPI before requeueing: the requeue kills this job step at once, and MPI
        # processes killed mid-run leave shared-memory segments that the restarted job (same
        # job and step id, hence the same segment names under MPICH) would trip over.
        self.wait_for_everyone()
        distributed.destroy_process_group()
        self._partial.comm.finalize()
        requeued = False
        if self.is_main_process and self._preemption is not None and self._preemption.requeue:
            requeued = preemption.requeue()
        self.print(
            f"mpaccel: checkpoint {directory} committed"
            + ("; job requeued" if requeued else "")
            + "; exiting"
        )
        preemption.exit_cleanly(exit_code)

    @property
    def restart_count(self) -> int:
        """SLURM_RESTART_COUNT: 0 on the first run, n after n requeues."""
        return preemption.restart_count()

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")
    )


_warned_no_context_parallel = False

# Accelerate's members for features mpaccel lacks: refusals with a HINT (mpaccel/_absent.py).
_absent.install_members(Accelerator)


class _AccumulationStep:
    """The Accelerator's micro-batch count, as a checkpoint holds it (entry "accelerator")."""

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": self._accelerator.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state.get("step") if isinstance(state, dict) else None
        if type(step) is not int or step < 0:
            raise ValueError(f"it holds the step {step!r}, not a count")
        self._accelerator.step = step
