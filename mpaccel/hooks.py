"""Accelerate's `accelerate.hooks`: hooks that run around a module's forward (before it, on its
arguments; after it, on its output), attached and removed in place. transformers attaches them
(NEFTune's noise, device alignment in generation); none of this is collective.

The attributes a hooked module carries are Accelerate's, because libraries test for them:
`_hf_hook` (the hook) and `_old_forward` (the forward it wraps). AlignDevicesHook moves a
module and its inputs to one device; it does not offload weights (Big Model Inference, which
mpaccel does not have: see mpaccel/absent_names.py)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch

from . import absent_names
from .device import send_to_device
from .errors import ConfigurationError

_HOOK = "_hf_hook"
_OLD_FORWARD = "_old_forward"


class ModelHook:
    """A hook: `init_hook` when attached, `pre_forward` on the arguments, `post_forward` on the
    output, `detach_hook` when removed. With `no_grad`, the wrapped forward runs without
    autograd. Subclass it and override what you need; each default changes nothing."""

    no_grad = False

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks as one: attached and run before the forward in order, after it in order."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    hook: ModelHook = getattr(module, _HOOK)
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    original = getattr(module, _OLD_FORWARD)
    with torch.no_grad() if hook.no_grad else contextlib.nullcontext():
        output = original(*args, **kwargs)
    return hook.post_forward(module, output)


def add_hook_to_module(
    module: torch.nn.Module, hook: ModelHook, append: bool = False
) -> torch.nn.Module:
    """Run `hook` around `module`'s forward from now on (the module is changed in place and
    returned). A hook already there is replaced, or with `append=True` runs first, then this
    one (a SequentialHook)."""
    current = getattr(module, _HOOK, None)
    if append and current is not None:
        remove_hook_from_module(module)
        hook = SequentialHook(current, hook)
    if not hasattr(module, _OLD_FORWARD):
        setattr(module, _OLD_FORWARD, module.forward)
    original = getattr(module, _OLD_FORWARD)
    module = hook.init_hook(module)
    setattr(module, _HOOK, hook)
    forward = functools.partial(_hooked_forward, module)
    module.forward = functools.update_wrapper(forward, original)
    return module


def remove_hook_from_module(module: torch.nn.Module, recurse: bool = False) -> torch.nn.Module:
    """Detach the hook add_hook_to_module attached and give the module its own forward back
    (in its submodules too with `recurse`). A module without a hook is left as it is."""
    hook = module.__dict__.pop(_HOOK, None)
    if hook is not None:
        hook.detach_hook(module)
    original = module.__dict__.pop(_OLD_FORWARD, None)
    if original is not None:
        if getattr(type(module), "forward", None) is not getattr(original, "__func__", None):
            module.forward = original  # a forward of its own
        else:
            module.__dict__.pop("forward", None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: torch.nn.Module) -> None:
    """remove_hook_from_module on `module` and every module inside it."""
    remove_hook_from_module(module, recurse=True)


class AlignDevicesHook(ModelHook):
    """Runs a module on `execution_device`: attaching it moves the module there, its forward
    receives its arguments there, and with `io_same_device` the output goes back to the device
    of the first tensor argument. Offloading (`offload=True`, `weights_map`) is Big Model
    Inference, which mpaccel refuses. `place_submodules`, `skip_keys` and the rest are
    Accelerate's arguments: keys in `skip_keys` stay where they are."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, Any] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
    ) -> None:
        if offload or weights_map is not None or offload_buffers:
            reason = absent_names.MODULE_NAMES["mpaccel"]["cpu_offload"]
            raise ConfigurationError(
                f"AlignDevicesHook(offload={offload!r}, weights_map=..., offload_buffers="
                f"{offload_buffers!r}) cannot be used: {reason.why}",
                reason.instead,
            )
        self.execution_device = execution_device
        self.io_same_device = io_same_device
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.input_device: torch.device | None = None

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device!r}, "
                f"io_same_device={self.io_same_device!r})")

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.execution_device is not None:
            if self.place_submodules:
                module.to(self.execution_device)
            else:  # this module's own tensors; its submodules get hooks of their own
                for name, param in list(module.named_parameters(recurse=False)):
                    moved = param.detach().to(self.execution_device)
                    setattr(module, name, torch.nn.Parameter(moved, param.requires_grad))
                for name, buffer in list(module.named_buffers(recurse=False)):
                    setattr(module, name, buffer.to(self.execution_device))
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self.io_same_device:
            first = next((a for a in [*args, *kwargs.values()] if torch.is_tensor(a)), None)
            self.input_device = first.device if first is not None else None
        if self.execution_device is None:
            return args, kwargs
        moved_args = send_to_device(args, self.execution_device)
        moved_kwargs = send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys)
        return moved_args, moved_kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if self.io_same_device and self.input_device is not None:
            return send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output


__all__ = [
    "AlignDevicesHook",
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]
