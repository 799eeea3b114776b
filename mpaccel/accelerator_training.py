"""The Accelerator's training methods: preparing objects, the training step (accumulation,
backward, clipping, autocast, profiling) and unwrapping models. A mixin of Accelerator
(accelerator.py); `_Host` lists what it uses of the Accelerator, so this module needs
nothing from accelerator.py."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from . import distributed, training
from .config import AutocastKwargs, DataLoaderConfiguration, KwargsHandler, ProfileKwargs
from .data.loader import PreparedLoader
from .data.prepare import agreed_seed
from .data.prepare import build as build_prepared
from .data.samplers import ShardedBatchSampler
from .data.skip import skip_first_batches
from .enums import DistributedType, DynamoBackend
from .errors import ConfigurationError, MpaccelRuntimeWarning, MpaccelWarning
from .state import AcceleratorState, GradientState, PartialState
from .training import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    autocast_context,
    compile_model,
    patch_forward,
)


class _Host(Protocol):
    """What TrainingMethods use of the Accelerator they are mixed into."""

    step: int
    _data_seed: int | None
    state: AcceleratorState
    gradient_state: GradientState
    dataloader_config: DataLoaderConfiguration
    device_placement: bool
    step_scheduler_with_optimizer: bool
    rng_types: list[str]
    ddp_handler: Any
    autocast_handler: Any
    profile_handler: Any
    scaler: Any
    _models: list[torch.nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[PreparedLoader]

    @property
    def _partial(self) -> PartialState: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def distributed_type(self) -> DistributedType: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def process_index(self) -> int: ...
    @property
    def use_distributed(self) -> bool: ...
    @property
    def sync_gradients(self) -> bool: ...
    @property
    def mixed_precision(self) -> str: ...
    @property
    def split_batches(self) -> bool: ...
    @property
    def even_batches(self) -> bool: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...

    def _prepare_one(self, obj: Any, placement: bool) -> Any: ...
    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = ...,
        evaluation_mode: bool = ...,
    ) -> torch.nn.Module: ...
    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = ...
    ) -> AcceleratedOptimizer: ...
    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler: ...
    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = ...,
        slice_fn_for_dispatch: Callable | None = ...,
    ) -> DataLoader: ...
    def _do_sync(self) -> None: ...
    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[None]: ...
    def unscale_gradients(self, optimizer: Any = ...) -> None: ...
    def _autocast_options(self, handler: KwargsHandler | None = ...) -> dict[str, Any]: ...
    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = ...,
        keep_torch_compile: bool = ...,
    ) -> Any: ...


def _prepared_before(model: torch.nn.Module, sharded: bool) -> bool:
    """`model` is what a prepare() made (DDP; a sharded model under FSDP): preparing it again
    would wrap a DDP in another, or shard the shards."""
    if distributed.ddp_of(model) is not None:
        return True
    if not sharded:
        return False
    from . import fsdp  # imported only under FSDP (see fsdp.py's docstring)

    return fsdp.fsdp_module(model) is not None


class TrainingMethods:
    """Preparing objects and the training step: Accelerator's methods for them."""

    _data_seed: int | None  # set by Accelerator.__init__; declared for the type checker

    # -- preparing objects -----------------------------------------------------------------------

    def prepare(self: _Host, *args: Any, device_placement: list[bool] | None = None) -> Any:
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
        detached: list[Any] = []
        if self.state.fsdp_plugin is not None:  # the optimizers must not pin the whole tensors
            from . import sharding

            optimizers = [getattr(o, "optimizer", o) for o in args if _is_optimizer(o)]
            models = [m for m in args if isinstance(m, torch.nn.Module)]
            if not models:
                sharding.check_optimizers(optimizers, self._models)
            detached = sharding.detach_optimizers(models, optimizers)
        for index, obj in enumerate(args):  # schedulers need the prepared optimizers first
            if isinstance(obj, kinds):
                prepared[index] = self._prepare_one(obj, device_placement[index])
        if detached:
            from . import sharding

            sharding.attach_optimizers(detached)
        for index, obj in enumerate(args):
            if _is_scheduler(obj):
                prepared[index] = self.prepare_scheduler(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self: _Host, obj: Any, placement: bool) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        return self.prepare_data_loader(obj, device_placement=placement)

    def prepare_model(
        self: _Host,
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
        if _prepared_before(model, self.state.fsdp_plugin is not None):
            self._models.append(model)  # by a prepare() before free_memory(), as Trainer does
            return model
        placement = device_placement if device_placement is not None else self.device_placement
        if self.state.fsdp_plugin is not None:  # collective: fully_shard in place
            from . import sharding

            model = sharding.shard_model(
                model, self.state.fsdp_plugin, self.state.device_mesh, self._partial.comm,
                self.device, placement,
            )  # fmt: skip
        elif placement:
            model = model.to(self.device)
        patch_forward(model, self.mixed_precision, self.device, self._autocast_options())
        self._models.append(model)
        trainable = any(p.requires_grad for p in model.parameters())
        ddp = self.state.fsdp_plugin is None and self.num_processes > 1
        if ddp and trainable and not evaluation_mode:
            options = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
            model = distributed.wrap_ddp(model, self.device, **options)
            if self.ddp_handler is not None:
                self.ddp_handler.register_comm_hook(model)
            self._models[-1] = model
        plugin = self.state.dynamo_plugin
        if plugin.backend != DynamoBackend.NO:
            # Only the user's copy is compiled: checkpoints work on the model kept in _models,
            # and no_sync, accumulate and Join find the DDP inside the compiled one.
            return compile_model(model, plugin.to_kwargs(), bool(plugin.use_regional_compilation))
        return model

    def prepare_optimizer(
        self: _Host, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
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

    def prepare_scheduler(self: _Host, scheduler: Any) -> AcceleratedScheduler:
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
        self: _Host,
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
            num_processes=self.num_processes,
            process_index=self.process_index,
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
        self: _Host, joinables: list[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Collective in effect. Training or evaluation where ranks get different numbers of
        batches: torch.distributed's Join around the block, so that DDP models (and other
        Joinables) of ranks that ran out of batches keep answering the others' all-reduces
        instead of leaving them hanging. `even_batches` overrides the prepared map-style
        loaders' setting inside the block (False: no repeated samples, uneven batches); Join
        is enabled only when batches are uneven. Does nothing in a world of one, and warns
        (UserWarning) and does nothing for set-ups other than DDP on CPUs or GPUs."""
        if self.num_processes == 1 or self.distributed_type not in (
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
        ):
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

    def skip_first_batches(self: _Host, dataloader: DataLoader, num_batches: int = 0) -> Any:
        """A prepared loader: the same one, whose next pass starts after `num_batches` batches.
        Any other DataLoader: a new one that leaves them out on every pass (as Accelerate's)."""
        return skip_first_batches(dataloader, num_batches)

    # -- the training step -----------------------------------------------------------------------

    def _do_sync(self: _Host) -> None:
        if self.gradient_state.sync_with_dataloader and self.gradient_state.end_of_dataloader:
            self.step = 0
            self.gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            self.gradient_state._set_sync_gradients(self.step % self.gradient_state.num_steps == 0)

    @contextmanager
    def accumulate(self: _Host, *models: torch.nn.Module) -> Iterator[None]:
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
    def no_sync(self: _Host, model: torch.nn.Module) -> Iterator[None]:
        """Gradients computed in this block are not all-reduced (DDP, compiled or not) nor
        reduce-scattered (FSDP: each rank accumulates whole gradients until the next
        synchronising backward); a no-op otherwise."""
        ddp = distributed.ddp_of(model)
        if ddp is not None:
            with ddp.no_sync():
                yield
        elif self.state.fsdp_plugin is not None:
            from . import fsdp

            with fsdp.no_gradient_sync(model):
                yield
        else:
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

    def backward(self: _Host, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward(), divided by the accumulation steps and scaled for fp16. With DDP, the
        gradients are all-reduced here on synchronising steps."""
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_gradients(self: _Host, optimizer: Any = None) -> None:
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
        self: _Host, parameters: Any, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Clip the gradients' total norm (after fp16 unscaling); returns the total norm before
        clipping. After DDP's all-reduce the gradients, and so the norm, agree on every rank.
        Under FSDP, collective: the norm is the whole model's, reduced over the shards."""
        self.unscale_gradients()
        if self.state.fsdp_plugin is not None:
            from . import fsdp

            return fsdp.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self: _Host, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value] (after fp16 unscaling)."""
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @contextmanager
    def autocast(self: _Host, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Run the block in the configured mixed precision (prepared models already do), with
        `autocast_handler`'s options if given, else those of kwargs_handlers' AutocastKwargs."""
        options = self._autocast_options(autocast_handler)
        with autocast_context(self.mixed_precision, self.device, options):
            yield

    def _autocast_options(self: _Host, handler: KwargsHandler | None = None) -> dict[str, Any]:
        chosen = handler or self.autocast_handler
        return chosen.to_kwargs() if chosen is not None else {}

    @contextmanager
    def profile(self: _Host, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
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
    def optimizer_step_was_skipped(self: _Host) -> bool:
        """fp16: the last optimizer step was skipped because gradients overflowed."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    # -- models and memory -----------------------------------------------------------------------

    def unwrap_model(
        self: _Host,
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
        self: _Host, model: torch.nn.Module, unwrap: bool = True, *, all_ranks: bool = False
    ) -> dict[str, Any]:
        """Not collective, but under FSDP. The model's state_dict (of the unwrapped model by
        default: no `module.` prefix from DDP, nor `_orig_mod.` from torch.compile), as
        Accelerate's, to save it or hand it to another library. A fully sharded model's is
        gathered into whole CPU tensors: on rank 0 only (the others get {}), as Accelerate's,
        or with `all_ranks=True` on every rank."""
        if unwrap:
            model = self.unwrap_model(model, keep_torch_compile=False)
        if self.state.fsdp_plugin is not None:
            from . import fsdp  # imported only under FSDP (see fsdp.py's docstring)

            if fsdp.fsdp_module(model) is not None:
                return fsdp.full_state_dict(model, everywhere=all_ranks)
        return model.state_dict()


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")
    )
