"""The training wrappers `Accelerator.prepare` returns: optimizer and scheduler that respect
gradient accumulation and fp16 loss scaling, and the mixed-precision forward of a model."""

from __future__ import annotations

import functools
import sys
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .device import send_to_device
from .errors import ConfigurationError, MpaccelWarning
from .tree import convert_to_fp32

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(
    mixed_precision: str, device: torch.device, options: dict[str, Any] | None = None
) -> AbstractContextManager:
    """torch.autocast for the configured precision ('no': a null context). `options`:
    AutocastKwargs(...).to_kwargs() (enabled, cache_enabled)."""
    dtype = _AUTOCAST_DTYPES.get(mixed_precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, **(options or {}))


def make_grad_scaler(
    mixed_precision: str, device: torch.device, options: dict[str, Any] | None = None
) -> Any:
    """A GradScaler for fp16 (gradients of fp16 activations underflow without it), else None.
    `options`: GradScalerKwargs(...).to_kwargs()."""
    if mixed_precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type, **(options or {}))


_warned_fp16_on_cpu = False


def warn_fp16_on_cpu(mixed_precision: str, device: torch.device) -> None:
    """Once per process: fp16 on CPU really computes in float16 here, where Accelerate quietly
    stays in float32 (docs/training.md, "Precision and clipping")."""
    global _warned_fp16_on_cpu
    if mixed_precision != "fp16" or device.type != "cpu" or _warned_fp16_on_cpu:
        return
    _warned_fp16_on_cpu = True
    warnings.warn(
        "mixed_precision='fp16' on CPU: mpaccel runs the prepared models under float16 autocast "
        "with a GradScaler, where Accelerate ignores fp16 on CPU and trains in float32. float16 "
        "on CPU is slow and loses precision; use mixed_precision='bf16' (or 'no') on CPU",
        MpaccelWarning,
        stacklevel=3,
    )


def is_compiled_module(module: Any) -> bool:
    """Not collective. Whether `module` is torch.compile's wrapper (an OptimizedModule).

    Args:
        module: any object.
    """
    # torch imports its compiler only when something is compiled: no compiled module without it
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def is_regionally_compiled(module: Any) -> bool:
    """`module` is a copy made by compile_regions: it keeps its original in `_orig_mod` as a
    plain attribute (torch.compile's wrapper holds it as a submodule)."""
    return isinstance(vars(module).get("_orig_mod"), torch.nn.Module) and not is_compiled_module(
        module
    )


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Not collective. Whether `module` has submodules and one of them (or `module`) is
    torch.compile's wrapper.

    Args:
        module: a torch module.
    """
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


def _is_repeated_blocks(module: torch.nn.Module) -> bool:
    """A non-empty ModuleList whose children are all of its first child's class."""
    if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
        return False
    kind = type(module[0])
    return all(isinstance(child, kind) for child in module)


def _compiled_regions(module: torch.nn.Module, compile_kwargs: dict[str, Any]) -> torch.nn.Module:
    if _is_repeated_blocks(module):
        # One torch.compile per block: blocks of one class share the compiler's cache, so
        # compiling N blocks costs about one (regional compilation).
        blocks = torch.nn.ModuleList(
            [torch.compile(block, **compile_kwargs) for block in module.children()]  # type: ignore[misc]
        )
        blocks.__dict__["_orig_mod"] = module
        return blocks
    if not any(_is_repeated_blocks(sub) for sub in module.modules()):
        return torch.compile(module, **compile_kwargs)  # type: ignore[return-value]
    # A copy of this module that shares its parameters, buffers and attributes, with its
    # children replaced: the user's module is left uncompiled. Each copy keeps its original
    # (not only the outermost, as Accelerate's), so that unwrap_model finds the user's module
    # inside DDP's copy too.
    copy = type(module).__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy._modules = {}
    for name, child in module.named_children():
        copy.add_module(name, _compiled_regions(child, compile_kwargs))
    copy.__dict__["_orig_mod"] = module
    return copy


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Not collective. Regional compilation: each block of a repeated ModuleList (a
    transformer's layers) compiled on its own, and the rest of the model compiled in the largest
    pieces holding no such list; a model without one is compiled whole.

    Args:
        module: the model.
        **compile_kwargs: passed to each torch.compile call.

    Returns:
        A new module sharing `module`'s parameters; `module` itself is unchanged and is the
        result's `_orig_mod`.
    """
    return _compiled_regions(module, compile_kwargs)


def compile_model(
    model: torch.nn.Module, compile_kwargs: dict[str, Any], regional: bool = False
) -> torch.nn.Module:
    """torch.compile(model, **compile_kwargs), or with `regional` compile_regions(model, ...),
    unless it is compiled already (either way)."""
    if is_compiled_module(model) or is_regionally_compiled(model):
        return model
    if regional:
        return compile_regions(model, **compile_kwargs)
    return torch.compile(model, **compile_kwargs)  # type: ignore[return-value]


def unwrap_model(
    model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> Any:
    """The user's module inside DistributedDataParallel/DataParallel, torch.compile's wrapper
    and compile_regions' copies. `keep_fp32_wrapper=False` also removes the mixed-precision
    forward; `keep_torch_compile`: a compiled model comes back compiled, around the unwrapped
    module (a new wrapper when DDP sat between them, so the prepared model is left as it is;
    regionally, the compiled copy of the user's module that DDP's copy holds)."""
    from torch.nn import DataParallel
    from torch.nn.parallel import DistributedDataParallel

    compiled = None
    while True:
        if is_compiled_module(model):
            compiled = compiled or model
            model = model._orig_mod
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            # before the regional test: DDP's regional copy holds the user's one in `module`
            model = model.module
        elif is_regionally_compiled(model):
            compiled = compiled or model
            model = vars(model)["_orig_mod"]
        else:
            break
    if not keep_fp32_wrapper:
        unpatch_forward(model)
    if not keep_torch_compile or compiled is None:
        return model
    if compiled._orig_mod is model:
        return compiled
    if not is_compiled_module(compiled):
        return compiled  # regional copies cannot be rebuilt around another module
    return type(compiled)(model, compiled.dynamo_ctx)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Put the optimizer's state tensors (a loaded state_dict's) on `device`; torch's
    load_state_dict then keeps them beside their parameters, `step` counters where it wants
    them. A fresh optimizer has no state: nothing to do."""
    if not optimizer.state:
        return
    optimizer.load_state_dict(send_to_device(optimizer.state_dict(), device))


def patch_forward(
    model: torch.nn.Module,
    mixed_precision: str,
    device: torch.device,
    options: dict[str, Any] | None = None,
) -> None:
    """Run `model.forward` under autocast, returning float32 outputs (as Accelerate does).
    `options`: as for autocast_context."""
    if mixed_precision not in _AUTOCAST_DTYPES or hasattr(model, "_mpaccel_original_forward"):
        return

    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast_context(mixed_precision, device, options):
            output = original(*args, **kwargs)
        return convert_to_fp32(output)

    model._mpaccel_original_forward = original  # type: ignore[assignment]
    model.forward = forward


def unpatch_forward(model: torch.nn.Module) -> None:
    original = model.__dict__.pop("_mpaccel_original_forward", None)
    if original is not None:
        model.forward = original


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: `step()` and `zero_grad()` do nothing while gradients accumulate; with
    fp16, steps go through the GradScaler (skipped steps are reported by `step_was_skipped`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: Any, scaler: Any):
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self._step_was_skipped = False
        self._unscaled_at: int | None = None  # the scaler's update count when last unscaled

    # Behave as the wrapped optimizer for everything else.
    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_gradients(self) -> None:
        """fp16: divide the gradients by the loss scale, once per step (before clipping). Only
        on a micro-batch that syncs gradients: before that, the next backward adds scaled
        gradients to the sum, which must stay scaled too."""
        if self.scaler is not None and not self.gradient_state.sync_gradients:
            raise ConfigurationError(
                "fp16 gradients unscaled (clip_grad_norm_, clip_grad_value_ or "
                "unscale_gradients) on a micro-batch that accumulates: the next backward would "
                "add scaled gradients to unscaled ones, and the step would be wrong",
                "clip once per optimizer step: `if accelerator.sync_gradients: "
                "accelerator.clip_grad_norm_(...)`.",
            )
        # Once per scaler update, as GradScaler allows: another optimizer's step (which updates
        # the shared scaler) makes this one's gradients scaled again after its next backward.
        if self.scaler is not None and self._unscaled_at != _updates(self.scaler):
            self.scaler.unscale_(self.optimizer)
            self._unscaled_at = _updates(self.scaler)

    def step(self, closure: Any = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        if self.scaler is None:
            self._step_was_skipped = False
            return self.optimizer.step(closure) if closure else self.optimizer.step()
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer, closure) if closure else self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scaler._mpaccel_updates = _updates(self.scaler) + 1
        self._step_was_skipped = self.scaler.get_scale() < scale_before
        return None

    @property
    def step_was_skipped(self) -> bool:
        """fp16: the last step was skipped because gradients overflowed."""
        return self._step_was_skipped

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def _updates(scaler: Any) -> int:
    """How many times the prepared optimizers updated this GradScaler (its unscale_ may run
    once per optimizer between two updates)."""
    return getattr(scaler, "_mpaccel_updates", 0)


class AcceleratedScheduler:
    """Wraps an LR scheduler written for one process: steps only when the optimizer stepped,
    and `num_processes` times per step unless batches are split (each optimizer step consumes
    that many single-process batches). While accumulating with `adjust_scheduler`, only the
    step counter moves."""

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        gradient_state: Any,
        num_processes: int,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.num_processes = num_processes
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1  # (ReduceLROnPlateau has no counter)
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(1 if self.split_batches else self.num_processes):
            # OneCycleLR refuses to step past total_steps (N steps per optimizer step may get
            # there before the loop ends). Counted by last_epoch, the steps taken: _step_count
            # also moved while accumulating, and stopped the cycle early.
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler.last_epoch < total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
