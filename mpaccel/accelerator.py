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

from . import (
    absent_names,
    checkpoint,
    distributed,
    envvars,
    ops,
    preemption,
    shared_settings,
    tracking,
    training,
)
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
from .config.parallelism import ParallelismConfig
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
    "dp_replicate_size=..., dp_shard_size=..., tp_size=...))."
)


class Accelerator:
    """Entry point: process facts, process control, and (see the training docs) training.

    Creating it is collective: every process of the job must create one.

    Args:
        device_placement: move prepared models, optimizer states and batches to `device`;
            prepare()'s `device_placement` overrides it object by object.
        split_batches: the loaders' batch size is the global one, split over the ranks;
            used only when `dataloader_config` is None.
        mixed_precision: "no", "fp16" or "bf16"; None: MPACCEL_MIXED_PRECISION or
            ACCELERATE_MIXED_PRECISION, else "no".
        gradient_accumulation_steps: micro-batches per optimizer step, an int >= 1.
        cpu: run on the CPU even when GPUs are visible.
        dataloader_config: how prepared loaders shard and place batches; None: the defaults
            with `split_batches`.
        deepspeed_plugin: must be None (mpaccel does not drive DeepSpeed).
        fsdp_plugin: a FullyShardedDataParallelPlugin: prepared models are fully sharded.
        torch_tp_plugin: must be None (Accelerate's deprecated TP plugin; tensor parallelism
            is `parallelism_config=ParallelismConfig(tp_size=...)`).
        megatron_lm_plugin: must be None (mpaccel does not drive Megatron-LM).
        rng_types: the generators prepared loaders synchronise from rank 0 each pass;
            None: ["generator"].
        log_with: the trackers init_trackers() starts: a name, a LoggerType, a
            GeneralTracker, "all", or a list of these; an unknown name is an error.
        project_dir: where checkpoints and logs go (set on `project_config` if both given).
        project_config: a ProjectConfiguration (checkpoint naming and rotation, logging
            directory); None: one made from `project_dir`.
        gradient_accumulation_plugin: a GradientAccumulationPlugin, instead of
            `gradient_accumulation_steps` (passing both is a ValueError).
        step_scheduler_with_optimizer: prepared schedulers step only when the optimizer
            does (and once per rank unless batches are split); False: at every call.
        kwargs_handlers: at most one each of InitProcessGroupKwargs,
            DistributedDataParallelKwargs, GradScalerKwargs, AutocastKwargs, ProfileKwargs.
        dynamo_backend: the torch.compile backend prepared models are compiled with; not
            with `dynamo_plugin`.
        dynamo_plugin: a TorchDynamoPlugin for torch.compile; None: one with `dynamo_backend`.
        deepspeed_plugins: must be None, as `deepspeed_plugin` (it takes its place if given).
        parallelism_config: a ParallelismConfig: the N-D mesh (data-parallel replication and
            sharding, context and tensor parallelism; docs/training.md); None: one from
            PARALLELISM_CONFIG_* when ACCELERATE_USE_PARALLELISM_CONFIG=true.
        even_batches: overrides `dataloader_config.even_batches` when not None (keyword only).

    Raises:
        ValueError: for bad or doubly given gradient accumulation settings.
        ConfigurationError: for a plugin mpaccel does not drive, both dynamo arguments, an
            unknown tracker or kwargs handler, an unknown mixed precision.
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
        if parallelism_config is None and envvars.get_bool("use_parallelism_config", False):
            parallelism_config = ParallelismConfig()  # sizes from PARALLELISM_CONFIG_*

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
        """Not collective. The torch.device this process computes on."""
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        """Not collective. The kind of set-up: a DistributedType (NO, MULTI_CPU, FSDP, ...)."""
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        """Not collective. How many processes the job has."""
        return self._partial.num_processes

    @property
    def process_index(self) -> int:
        """Not collective. This process's global index (its rank)."""
        return self._partial.process_index

    @property
    def local_process_index(self) -> int:
        """Not collective. This process's index on its node."""
        return self._partial.local_process_index

    @property
    def num_nodes(self) -> int:
        """Not collective. How many nodes the job runs on."""
        return self._partial.num_nodes

    @property
    def node_index(self) -> int:
        """Not collective. The index of this process's node."""
        return self._partial.node_index

    @property
    def use_distributed(self) -> bool:
        """Not collective. Whether the job has more than one process."""
        return self._partial.use_distributed

    @property
    def is_main_process(self) -> bool:
        """Not collective. Whether this is the process of global index 0."""
        return self._partial.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Not collective. Whether this is the process of index 0 on its node."""
        return self._partial.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Not collective. Whether this is the process of the highest global index."""
        return self._partial.is_last_process

    @property
    def mixed_precision(self) -> str:
        """Not collective. The mixed precision in use: "no", "fp16" or "bf16"."""
        return self.state.mixed_precision

    @property
    def split_batches(self) -> bool:
        """Not collective. dataloader_config's split_batches."""
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        """Not collective. dataloader_config's even_batches (set: for loaders prepared later)."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def project_dir(self) -> str | None:
        """Not collective. The ProjectConfiguration's project directory, None without one."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Not collective. The ProjectConfiguration's logging directory, None without one."""
        return self.project_configuration.logging_dir

    @property
    def sync_gradients(self) -> bool:
        """Not collective. Whether this micro-batch synchronises gradients (settable)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        """Not collective. Micro-batches per optimizer step (settable)."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": value})

    @property
    def dispatch_batches(self) -> Any:
        """Not collective. dataloader_config's dispatch_batches (None: its default)."""
        return getattr(self.dataloader_config, "dispatch_batches", None)

    @property
    def use_stateful_dataloader(self) -> bool:
        """Not collective. dataloader_config's use_stateful_dataloader."""
        return bool(getattr(self.dataloader_config, "use_stateful_dataloader", False))

    @property
    def use_seedable_sampler(self) -> bool:
        """Not collective. dataloader_config's use_seedable_sampler."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """Not collective. dataloader_config's non_blocking."""
        return self.dataloader_config.non_blocking

    @property
    def multi_device(self) -> bool:
        """Not collective. Several processes on accelerators (GPUs), as Accelerate: False on
        CPU."""
        return self.use_distributed and self.distributed_type == DistributedType.MULTI_GPU

    @property
    def should_save_model(self) -> bool:
        """Not collective. Whether this process writes the model where only some do: each
        node's local main process, as Accelerate's without a ParallelismConfig."""
        return self.is_local_main_process

    # -- the parallel layout (the strategy's) ---------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """Not collective. How models are parallelised (mpaccel.strategy), picked once by
        AcceleratorState: the Accelerator asks it, never which one it is."""
        return self.state.strategy

    def _mesh_rank(self, dim: str, what: str) -> int:
        """This rank's index along the mesh dimension `dim` ('dp_replicate', 'dp_shard', 'tp',
        'cp'), 0 where the ParallelismConfig leaves it at size 1; an error without a
        ParallelismConfig, as Accelerate's."""
        config = self.state.parallelism_config
        if config is None:
            message = f"{what} is not configured: the Accelerator has no parallelism_config"
            raise RuntimeError(with_hint(message, _SET_CONFIG))
        if not getattr(config, f"{dim}_enabled"):
            return 0
        return self.strategy.mesh_rank(dim)

    @property
    def is_fsdp2(self) -> bool:
        """Not collective. Whether models are fully sharded (mpaccel's FSDP is always FSDP2)."""
        return self.state.is_fsdp2

    @property
    def deepspeed_plugin(self) -> Any:
        """Not collective. Always None: mpaccel does not drive DeepSpeed."""
        return None

    @property
    def parallelism_config(self) -> Any:
        """Not collective. The ParallelismConfig given to the Accelerator, or None."""
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        """Not collective. The device mesh models are parallelised over: with a
        ParallelismConfig, Accelerate's dimensions of size > 1 in its order (dp_replicate,
        dp_shard, cp, tp) and the flattened dp, dp_shard_cp, dp_cp (a 'dp_shard' of size 1 is
        kept under FSDP, which shards over it); else FSDP's mesh; None without either."""
        return self.state.device_mesh

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Not collective. Always False (Accelerate's flag for its TP/CP mix)."""
        return False

    @property
    def data_parallel_rank(self) -> int:
        """Not collective. This rank's replica index (mesh dimension 'dp_replicate'): 0 where
        the ParallelismConfig has dp_replicate_size 1. RuntimeError without a
        ParallelismConfig."""
        return self._mesh_rank("dp_replicate", "data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        """Not collective. This rank's index in its shard group (mesh dimension 'dp_shard'): 0
        where the ParallelismConfig has dp_shard_size 1. RuntimeError without a
        ParallelismConfig."""
        return self._mesh_rank("dp_shard", "shard-based data parallelism")

    @property
    def tensor_parallel_rank(self) -> int:
        """Not collective. This rank's index in its tensor-parallel group (mesh dimension
        'tp'): 0 where tp_size is 1; RuntimeError without a ParallelismConfig, as
        Accelerate's."""
        return self._mesh_rank("tp", "tensor parallelism")

    @property
    def context_parallel_rank(self) -> int:
        """Not collective. This rank's index in its context-parallel group (mesh dimension
        'cp') where cp_size > 1 (on GPUs); else NotImplementedError, as Accelerate's."""
        config = self.state.parallelism_config
        if config is not None and config.cp_enabled:
            return self.strategy.mesh_rank("cp")
        raise NotImplementedError(with_hint(
            "context parallelism is not configured (Accelerate's context_parallel_rank raises "
            "as well)",
            "pass ParallelismConfig(cp_size=N) on GPUs (torch has no CPU context parallel "
            "attention).",
        ))  # fmt: skip

    @property
    def pipeline_parallel_rank(self) -> int:
        """Not collective. NotImplementedError, as Accelerate's: there is no pipeline
        parallelism."""
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
        """Not collective to enter. With cp_size > 1 (GPUs), torch's context_parallel over
        mesh['cp']: inside the block each rank holds its part of `buffers` along their
        sequence dimensions. Without, no effect, as Accelerate's: the buffers stay whole
        (warns once per process, as Accelerate's).

        Args:
            buffers: the tensors to split by sequence (inputs, labels, position ids).
            buffer_seq_dims: their sequence dimensions, one per buffer.
            no_restore_buffers: buffers not restored to whole after the block.
        """
        config = self.state.parallelism_config
        if config is not None and config.cp_enabled:
            with self.strategy.context_parallel(
                list(buffers or []), list(buffer_seq_dims or []), set(no_restore_buffers or ())
            ):
                yield
            return
        del buffers, buffer_seq_dims, no_restore_buffers
        global _warned_no_context_parallel
        if not _warned_no_context_parallel:
            _warned_no_context_parallel = True
            warnings.warn(
                "maybe_context_parallel() has no effect without ParallelismConfig(cp_size > 1), "
                "as Accelerate's; every rank sees whole sequences",
                MpaccelWarning,
                stacklevel=3,
            )
        yield

    # -- process control (delegated) ------------------------------------------------------------

    def wait_for_everyone(self, timeout: float | timedelta | None = None) -> None:
        """Collective: every rank must call it; returns once all have (PartialState's).

        Args:
            timeout: how long to wait, in seconds or as a timedelta; None: the state's.

        Raises:
            CollectiveTimeoutError: after `timeout`, naming the ranks that never arrived.
        """
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
        """Not collective. A context manager yielding this process's contiguous share of
        `inputs` (PartialState's): shares differ by at most one item.

        Args:
            inputs: a list, tuple, tensor, numpy array or datasets.Dataset, or a dict of
                those whose leaves have one length.
            apply_padding: fill shorter shares up with the last item, so every process
                holds as many (drop the extras after gathering).

        Raises:
            ValueError: for a dict whose leaves differ in length.
        """
        with self._partial.split_between_processes(inputs, apply_padding) as share:
            yield share

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Not collective. print() once per node (on each local main process).

        Args:
            *args: what print() prints.
            **kwargs: print()'s keywords (sep=, end=, file=, flush=).
        """
        self._partial.print(*args, **kwargs)

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function
        runs on the main process only; elsewhere the call returns None.

        Args:
            function: the function to decorate.
        """
        return self._partial.on_main_process(function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function
        runs on each node's local main process only; elsewhere the call returns None.

        Args:
            function: the function to decorate.
        """
        return self._partial.on_local_main_process(function)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function
        runs on the last process only; elsewhere the call returns None.

        Args:
            function: the function to decorate.
        """
        return self._partial.on_last_process(function)

    def on_process(
        self, function: Callable | None = None, process_index: int | None = None
    ) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function
        runs on the process of global index `process_index` (in a job of one process,
        whatever the index); elsewhere the call returns None.

        Args:
            function: the function to decorate; or the index itself, as in
                `@accelerator.on_process(1)`; or None, with the index as a keyword.
            process_index: the global index of the process that runs it.

        Raises:
            ConfigurationError: without an index, or with one that is not an int >= 0.
        """
        return self._partial.on_process(function, process_index)

    def on_local_process(
        self,
        function: Callable | None = None,
        local_process_index: int | None = None,
        *,
        local_process_idx: int | None = None,
    ) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function
        runs on the process of this local index on every node (in a job of one process,
        whatever the index); elsewhere the call returns None.

        Args:
            function: the function to decorate; or the index itself; or None, with the
                index as a keyword.
            local_process_index: the index, on its node, of the process that runs it.
            local_process_idx: the same, under the name Accelerate's guides use.

        Raises:
            ConfigurationError: without an index, or with one that is not an int >= 0.
        """
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
        """Not collective (it waits for no other rank), though every rank of the group should
        call it before it exits. Destroys the process group; a no-op when there is none.

        Args:
            group: the torch.distributed group to destroy; None: the default group.
        """
        self._partial.destroy_process_group(group)

    # -- experiment trackers (main process only; see mpaccel.tracking) ------------------------

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Not collective. Start the trackers of `log_with` on the main process and record
        `config` there. Called on every rank, each checks that the trackers writing files
        have a logging directory, so that all raise alike; the others then do nothing.

        Args:
            project_name: the run's project name, given to every tracker.
            config: hyperparameters each tracker records; None: none.
            init_kwargs: keywords for each tracker's constructor, by tracker name
                (`{"wandb": {...}}`).

        Raises:
            ConfigurationError: a tracker writing files has no logging directory.
        """
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
        """Not collective. The running tracker called `name`. Where no tracker runs (the
        other processes, or none started), a blank tracker whose methods do nothing, as in
        Accelerate, so the same code runs on every rank.

        Args:
            name: the tracker's name ("tensorboard", "wandb", ...).
            unwrap: return its library's object (the wandb run, ...) instead of mpaccel's.

        Raises:
            ConfigurationError: trackers run here but none is called `name`.
        """
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
        """Not collective. Record `values` with every running tracker (the main process's;
        elsewhere nothing runs and nothing happens).

        Args:
            values: the metrics, by name.
            step: the step they belong to; None: the trackers' own counting.
            log_kwargs: further keywords for each tracker's log(), by tracker name.
        """
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
        the shards (pass each model with its optimizer, as Accelerate requires for FSDP2).

        Args:
            *args: the objects to prepare.
            device_placement: one flag per object, whether to move it to the device; None:
                the Accelerator's `device_placement` for all.

        Returns:
            The prepared object, or a tuple of them for several.

        Raises:
            ConfigurationError: `device_placement` does not have one entry per object.
        """
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
        repeated block compiled on its own, sharing the parameters).

        Args:
            model: the model to prepare.
            device_placement: move it to the device; None: the Accelerator's setting.
            evaluation_mode: leave out the DDP wrapper (for inference); under FSDP the
                model is sharded all the same.
        """
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
        state_dict's, say) move to the device, as Accelerate's. One prepared already is
        returned as it is.

        Args:
            optimizer: the optimizer to prepare.
            device_placement: move its state to the device; None: the Accelerator's setting.
        """
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        if device_placement if device_placement is not None else self.device_placement:
            training.move_optimizer_state(optimizer, self.device)
        wrapped = AcceleratedOptimizer(optimizer, self.gradient_state, self.scaler)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Not collective. The scheduler, stepping as `step_scheduler_with_optimizer` says,
        with the prepared optimizer it drives (all prepared ones if none matches). One
        prepared already is returned as it is.

        Args:
            scheduler: an LR scheduler (anything with step(), optimizer and get_last_lr()).
        """
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
        when they are dispatched. A loader prepared already is returned as it is.

        Args:
            data_loader: the DataLoader to shard over the data-parallel ranks.
            device_placement: move its batches to the device; None: the Accelerator's
                setting.
            slice_fn_for_dispatch: with dispatch_batches, how rank 0 cuts a global batch
                into the ranks' parts, called as `fn(batch, slice, process_index=,
                num_processes=)`; None: every tensor sliced.
        """
        if issubclass(type(data_loader), PreparedLoader):  # isinstance would say DataLoader too
            return data_loader
        config = self.dataloader_config
        seed = config.data_seed
        if seed is None:
            if self._data_seed is None:
                self._data_seed = agreed_seed(self._partial.comm)
            seed = self._data_seed
        place = device_placement if device_placement is not None else self.device_placement
        dispatch = config.dispatch_batches
        if self.strategy.data_parallel_size != self.num_processes:
            if dispatch:
                raise ConfigurationError(
                    "dispatch_batches=True with tensor or context parallelism: mpaccel deals "
                    "batches to every rank, but the ranks of one tp/cp group must read the same",
                    "pass DataLoaderConfiguration(dispatch_batches=False): each data-parallel "
                    "group then reads its own batches.",
                )
            dispatch = False
        shard = build_prepared(
            data_loader,
            device=self.device if place else None,
            num_processes=self.strategy.data_parallel_size,
            process_index=self.strategy.data_parallel_rank,
            world=(self.num_processes, self.process_index),
            split_batches=config.split_batches,
            put_on_device=place,
            rng_types=list(self.rng_types),
            dispatch_batches=dispatch,
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
        (UserWarning) and does nothing for set-ups other than DDP on CPUs or GPUs.

        Args:
            joinables: the DDP models (or other torch Joinables) to join.
            even_batches: the prepared map-style loaders' even_batches inside the block;
                None: the Accelerator's setting, unchanged.
        """
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
        """Not collective. A prepared loader: the same one, whose next pass starts after
        `num_batches` batches. Any other DataLoader: a new one that leaves them out on every
        pass (as Accelerate's).

        Args:
            dataloader: the loader to skip in.
            num_batches: how many batches to skip.
        """
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
        does not, suppresses DDP's all-reduce in backward.

        Args:
            *models: the prepared models whose gradient synchronisation it suppresses.
        """
        self._do_sync()
        each_batch = self.use_distributed and self.gradient_state.sync_each_batch
        allow = self.sync_gradients or each_batch
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(contextlib.nullcontext() if allow else self.no_sync(model))
            yield

    @contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Not collective. Gradients computed in this block are not all-reduced (DDP,
        compiled or not) nor reduce-scattered (FSDP: each rank accumulates whole gradients
        until the next synchronising backward); a no-op otherwise.

        Args:
            model: the prepared model.
        """
        with self.strategy.no_sync(model):
            yield

    @staticmethod
    @contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """Not collective itself (the backward in it is, under DDP). The backward of this
        block all-reduces the gradients, even inside no_sync() (DDP only; a no-op otherwise):
        for a last micro-batch whose forward ran under no_sync, as in Accelerate. Relies on
        DDP internals, as Accelerate's does.

        Args:
            model: the prepared model.
        """
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
        """Collective under DDP or FSDP on synchronising steps (the gradients are reduced
        here), else not. loss.backward(), divided by the accumulation steps and scaled for
        fp16.

        Args:
            loss: the loss tensor.
            **kwargs: passed to loss.backward() (retain_graph=, ...).
        """
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Not collective. fp16: divide gradients by the loss scale (done for you before
        clipping), once per step; a no-op without a grad scaler.

        Args:
            optimizer: a prepared optimizer or a list of them; None: all prepared ones.

        Raises:
            ConfigurationError: with fp16, on a micro-batch that accumulates (unscale once
                per optimizer step: `if accelerator.sync_gradients:`).
        """
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
        """Collective under FSDP (the norm is the whole model's, reduced over the shards), else
        not. Clip the gradients' total norm (after fp16 unscaling); returns the total norm
        before clipping. After DDP's all-reduce the gradients, and so the norm, agree on every
        rank.

        Args:
            parameters: the parameters (an iterable, or one tensor) whose gradients to clip.
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm (inf for the largest element).

        Raises:
            ConfigurationError: with fp16, on a micro-batch that accumulates (unscale once
                per optimizer step: `if accelerator.sync_gradients:`).
        """
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Not collective. Clamp every gradient element to [-clip_value, clip_value] (after
        fp16 unscaling).

        Args:
            parameters: the parameters (an iterable, or one tensor) whose gradients to clip.
            clip_value: the largest absolute value a gradient element keeps.

        Raises:
            ConfigurationError: with fp16, on a micro-batch that accumulates (unscale once
                per optimizer step: `if accelerator.sync_gradients:`).
        """
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Not collective. Run the block in the configured mixed precision (prepared models
        already do).

        Args:
            autocast_handler: the AutocastKwargs to use; None: kwargs_handlers' one, if any.
        """
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
        PROFILE_PATTERN_NAME with its rank (profile_<rank>.json).

        Args:
            profile_handler: the ProfileKwargs to use; None: kwargs_handlers' one, if any.
        """
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
        """Not collective. fp16: the last optimizer step was skipped because gradients
        overflowed."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    # -- collective operations on tensors --------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Collective: every rank's tensors (nested lists/tuples/dicts) concatenated along the
        first dimension in rank order; the first dimension may differ across ranks.

        Args:
            tensor: a tensor, or nested lists, tuples and dicts of tensors, of the same
                structure on every rank.
        """
        return ops.gather(self._partial.comm, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Collective: gather(), minus the samples even_batches repeated in the last batch, so
        metrics see each sample of the dataset exactly once. Data with any leaf that is not a
        tensor goes, whole, through gather_object (a flat list: the last batch is cut down to
        its real samples). With tensor or context parallelism the ranks of one tp/cp group
        read the same batch, and only the group's first rank adds its samples (a 0-d tensor
        is one row, one per group).

        Args:
            input_data: this rank's predictions or labels: tensors (nested or not), or any
                picklable data.
            use_gather_object: gather as Python objects even when every leaf is a tensor.
        """
        use_gather_object = use_gather_object or not ops.only_tensors(input_data)
        if self.strategy.data_parallel_size != self.num_processes:
            # The ranks of a tp/cp group read the same batches: the group's first rank adds its
            # rows, the others none. Every rank reshapes alike (a 0-d tensor as one row), and a
            # rank that fails to is every rank's error, not the others' wait in the gather.
            reports = self.strategy.reports_metrics
            with agreement(self._partial.comm, "gather_for_metrics (one rank per tp/cp group)"):
                if use_gather_object:
                    input_data = input_data if reports else []
                else:
                    input_data = ops.rows_to_gather(input_data, keep=reports)
        if use_gather_object:
            data = ops.gather_object(self._partial.comm, input_data)
        else:
            data = ops.gather(self._partial.comm, input_data)
        state = self.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return data
        return data[: state.remainder] if use_gather_object else ops.truncate(data, state.remainder)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Collective: element-wise 'sum', 'mean', 'max' or 'min' over ranks, as new tensors.

        Args:
            tensor: a tensor, or nested lists, tuples and dicts of tensors, of the same
                structure, dtypes and shapes on every rank.
            reduction: "sum", "mean", "max" or "min"; "none" returns `tensor` as it is.
            scale: a factor every reduced tensor is multiplied by.

        Raises:
            ConfigurationError: for another `reduction`.
        """
        return ops.reduce(self._partial.comm, tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Collective: pad along `dim` to the largest size on any rank.

        Args:
            tensor: a tensor, or nested lists, tuples and dicts of tensors, of the same
                structure, number of dimensions and dtypes on every rank.
            dim: the dimension to pad (negative counts from the end).
            pad_index: the value the new entries hold.
            pad_first: put the padding before the data instead of after it.
        """
        return ops.pad_across_processes(self._partial.comm, tensor, dim, pad_index, pad_first)

    # -- models and memory -----------------------------------------------------------------------

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> Any:
        """Not collective. The user's model without DDP. Under FSDP, the sharded model itself
        (whose transformers `save_pretrained`, called on every rank, writes whole tensors).

        Args:
            model: a prepared model (or any module).
            keep_fp32_wrapper: keep the mixed-precision autocast around its forward; False
                removes it.
            keep_torch_compile: a compiled model comes back compiled (around the unwrapped
                module); False: the module inside.
        """
        return training.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(
        self, model: torch.nn.Module, unwrap: bool = True, *, all_ranks: bool = False
    ) -> dict[str, Any]:
        """Not collective, but under FSDP. The model's state_dict (of the unwrapped model by
        default: no `module.` prefix from DDP, nor `_orig_mod.` from torch.compile), as
        Accelerate's, to save it or hand it to another library. A fully sharded model's is
        gathered into whole CPU tensors: on rank 0 only (the others get {}), as Accelerate's,
        or with `all_ranks=True` on every rank.

        Args:
            model: a prepared model.
            unwrap: take the unwrapped model's state_dict; False: the prepared one's.
            all_ranks: under FSDP, give the gathered state_dict on every rank (keyword only).
        """
        if unwrap:
            model = self.unwrap_model(model, keep_torch_compile=False)
        return self.strategy.full_state_dict(model, everywhere=all_ranks)

    @property
    def has_lomo_optimizer(self) -> bool:
        """Not collective. Whether a LOMO optimizer (lomo-optim's Lomo or AdaLomo) was
        prepared."""
        return any(
            type(opt.optimizer).__module__.partition(".")[0] == "lomo_optim"
            for opt in self._optimizers
        )

    @refused(*_LOMO_REFUSED)
    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Not collective. Refused: mpaccel does not run LOMO optimizers' fused backward.

        Args:
            loss: accepted and ignored.
            learning_rate: accepted and ignored.

        Raises:
            ConfigurationError: always.
        """
        del loss, learning_rate
        raise ConfigurationError(*_LOMO_REFUSED)

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Not collective. True if a submodule was dispatched over several devices
        (`hf_device_map`, from `from_pretrained(device_map=...)`): such a model cannot be
        trained data-parallel.

        Args:
            model: the model to look at.
        """
        return any(len(getattr(m, "hf_device_map", ())) > 1 for m in model.modules())

    def free_memory(self, *objects: Any) -> list[Any]:
        """Not collective. Drop mpaccel's references to prepared objects and release cached
        memory; returns `objects` replaced by None (`a, b = accelerator.free_memory(a, b)`).

        Args:
            *objects: the objects to let go of (rebind the caller's names to the result).
        """
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.step = 0
        return release_memory(*objects)

    def clear(self, *objects: Any) -> list[Any]:
        """Not collective. free_memory(), under its other name.

        Args:
            *objects: the objects to let go of (rebind the caller's names to the result).
        """
        return self.free_memory(*objects)

    def __repr__(self) -> str:
        return f"Accelerator(\n{self.state!r})"

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Not collective. torch.save (or safetensors) on the main process only; others do
        nothing.

        Args:
            obj: what to save (a dict of tensors with `safe_serialization`).
            f: the file name or file object to write.
            safe_serialization: write with safetensors' save_file instead of torch.save.

        Raises:
            ConfigurationError: `safe_serialization` without the safetensors package.
        """
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
        every rank must call it, as with tensor parallelism: each writes its own parts of the
        full tensors into the same files, at their offsets (no rank gathers a tensor).

        Args:
            model: a prepared model (it is unwrapped first).
            save_directory: the directory to write into.
            max_shard_size: the largest shard, in bytes or as a string ("10GB", "500MB").
            safe_serialization: safetensors files; False: mpaccel's HDF5 shards.

        Raises:
            ConfigurationError: the strategy cannot save this model, on every rank that
                calls it, before anything is written.
        """
        unwrapped = self.unwrap_model(model)
        self.strategy.check_savable(unwrapped)  # before any rank writes or waits
        checkpoint.save_model(
            self._partial.comm, unwrapped, save_directory, max_shard_size,
            safe_serialization=safe_serialization,
        )

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Not collective (every rank should register alike). Include objects with
        state_dict()/load_state_dict() in save_state/load_state.

        Args:
            *objects: the objects, in the order their entries are saved and loaded.

        Raises:
            TypeError: an object lacks state_dict() or load_state_dict().
        """
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
        """Not collective (every rank should register alike). Call `hook(models, weights,
        output_dir)` in save_state() before anything is written, on every rank, in the order
        registered: `models` are the prepared models, `weights` their state_dicts (as
        prepared: with DDP's `module.` prefix), `output_dir` the checkpoint's directory
        (created). A hook that saves a model its own way removes its entry from `weights`
        (`weights.pop()`): that model is then left out of the checkpoint (its hook must load
        it: register_load_state_pre_hook). Returns a handle whose remove() unregisters the
        hook.

        Args:
            hook: the function to call, as above.
        """
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Not collective (every rank should register alike). Call `hook(models, input_dir)`
        in load_state() before anything is read, on every rank, in the order registered: a
        hook that loads a model its own way removes it from `models`, which load_state() then
        leaves alone. Returns a removable handle.

        Args:
            hook: the function to call, as above.
        """
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
        Hooks of register_save_state_pre_hook run first.

        Args:
            output_dir: the checkpoint's directory, needed without automatic naming; with
                automatic_checkpoint_naming it is not used (the directory is named for you).
            safe_serialization: accepted and ignored (no pickles are written either way).
            async_save: write in the background after a snapshot (keyword only).
            **save_model_func_kwargs: accepted and ignored.

        Raises:
            CheckpointError: no `output_dir` without automatic naming, or automatic naming
                would write below the newest checkpoint there.
        """
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
        accepted and has nothing to act on. Hooks of register_load_state_pre_hook run first.

        Args:
            input_dir: the checkpoint's directory; None: the latest complete one under
                automatic naming.
            load_kwargs: accepted and ignored.
            allow_pickle: load an Accelerate checkpoint's pickles (keyword only); None:
                MPACCEL_ALLOW_PICKLE decides.
            **load_model_func_kwargs: passed to the models' load_state_dict (strict=, assign=).
        """
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
        boundaries and calls checkpoint_and_exit(). Calling it again replaces the handlers.

        Args:
            signals: the signals to record (SIGUSR1 and SIGTERM by default).
            requeue: checkpoint_and_exit() puts the Slurm job back in the queue.
        """
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
        """Not collective. The signal that stopped the job ('SIGUSR1', ...), None if none
        arrived here."""
        return None if self._preemption is None else self._preemption.signal_name

    def checkpoint_and_exit(self, output_dir: str | None = None, exit_code: int = 0) -> None:
        """Collective: save_state() (committed, even if async saves are pending), then rank 0
        requeues the Slurm job if handle_preemption(requeue=True), then every rank exits.

        Args:
            output_dir: the checkpoint's directory, as save_state()'s.
            exit_code: the status every rank exits with.
        """
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
        """Not collective. SLURM_RESTART_COUNT: 0 on the first run, n after n requeues."""
        return preemption.restart_count()

    @property
    def save_iteration(self) -> int:
        """Not collective. The number the next automatically named checkpoint gets."""
        return self.project_configuration.iteration


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")
    )


_warned_no_context_parallel = False

# Accelerate's members for features mpaccel lacks: refusals with a HINT (mpaccel/absent_names.py).
absent_names.install_members(Accelerator)


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
