"""Accelerate's `accelerate.utils.modeling` names that training scripts and transformers use: the
GradScaler and autocast context of the current configuration (built by mpaccel.training, as
Accelerator builds its own), whether a model is a PEFT model, and the two device-map helpers
transformers imports with every model (`clean_device_map`, `get_max_layer_size`: plain
bookkeeping over module names and sizes, which mpaccel's training never calls)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ..config import AutocastKwargs
from ..enums import DistributedType
from ..training import autocast_context, make_grad_scaler
from .imports import is_peft_available
from .other import extract_model_from_parallel


def _device() -> torch.device:
    """The current PartialState's device; before there is one, the device it would take."""
    from ..state import PartialState

    if PartialState._shared_state:
        return PartialState().device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> Any:
    """Not collective. A new GradScaler for this process's device type: CUDA on GPUs, CPU on
    CPUs (where Accelerate's is a CUDA scaler that disables itself).

    Args:
        distributed_type: DistributedType.FSDP for torch's ShardedGradScaler; anything else
            (None by default) for the plain one.
        **kwargs: GradScalerKwargs' arguments, passed to the scaler.
    """
    device = _device()
    if distributed_type == DistributedType.FSDP:
        from ..strategy import fully_sharded

        return fully_sharded.sharded_grad_scaler(device.type, **kwargs)
    return make_grad_scaler("fp16", device, kwargs)


def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> AbstractContextManager:
    """Not collective, except that it creates the AcceleratorState if there is none (collective
    then, as AcceleratorState() is). The autocast context prepared models run under.

    Args:
        native_amp: False gives a null context; True the autocast context of
            AcceleratorState's mixed_precision on its device.
        autocast_kwargs: the autocast options (AutocastKwargs), or None for the defaults.
    """
    if not native_amp:
        return nullcontext()
    from ..state import AcceleratorState

    state = AcceleratorState()
    options = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else None
    return autocast_context(state.mixed_precision, state.device, options)


def is_peft_model(model: Any) -> bool:
    """Not collective. Whether `model`, out of its DistributedDataParallel, is a peft PeftModel
    (a compiled one is not, as in Accelerate); False where peft is not installed.

    Args:
        model: a module, wrapped or not.
    """
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


def get_max_layer_size(
    modules: list[tuple[str, torch.nn.Module]],
    module_sizes: dict[str, int],
    no_split_module_classes: list[str],
) -> tuple[int, list[str]]:
    """Not collective. The largest layer size among the layers inside `modules`, and the names
    of the layers that have it.

    Args:
        modules: (name, module) pairs to search.
        module_sizes: each layer's size, by its dotted name.
        no_split_module_classes: class names of modules counted as one layer even with
            children (any module without children is one).

    Returns:
        (largest size, [names of the layers of that size]).
    """
    largest, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, torch.nn.Module) else []
        if children and type(module).__name__ not in no_split_module_classes:
            pending[:0] = [(f"{name}.{child}", sub) for child, sub in children]
            continue
        size = module_sizes[name]
        if size > largest:
            largest, names = size, [name]
        elif size == largest:
            names.append(name)
    return largest, names


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """`device_map` (module name -> device), changed in place and returned: wherever every
    entry under a module names one device, the entries become one entry for that module. Pure."""
    prefix = f"{module_name}." if module_name else ""
    under = [key for key in device_map if key.startswith(prefix)]
    devices = [device_map[key] for key in under]
    if len(devices) > 1 and all(device == devices[0] for device in devices):
        for key in under:
            del device_map[key]
        device_map[module_name] = devices[0]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = {
        ".".join(key.split(".")[:depth])
        for key in device_map
        if key.startswith(prefix) and len(key) > len(module_name)
    }
    for child in children:
        clean_device_map(device_map, child)
    return device_map


__all__ = [
    "clean_device_map",
    "get_grad_scaler",
    "get_max_layer_size",
    "get_mixed_precision_context_manager",
    "is_peft_model",
]
