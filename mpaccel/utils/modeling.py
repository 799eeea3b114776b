"""Accelerate's `accelerate.utils.modeling` names that training scripts use: the GradScaler and
autocast context of the current configuration (built by mpaccel.training, as Accelerator builds
its own), and whether a model is a PEFT model."""

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
    """A new GradScaler (GradScalerKwargs' arguments in `kwargs`) for this process's device
    type: CUDA on GPUs, CPU on CPUs (where Accelerate's is a CUDA scaler that disables
    itself). With distributed_type=DistributedType.FSDP, torch's ShardedGradScaler. Not
    collective."""
    device = _device()
    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, **kwargs)
    return make_grad_scaler("fp16", device, kwargs)


def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> AbstractContextManager:
    """The autocast context of AcceleratorState's mixed_precision on its device (what prepared
    models run under) when `native_amp`, else a null context. `autocast_kwargs`: its options.
    Creates the AcceleratorState if there is none (collective then, as AcceleratorState())."""
    if not native_amp:
        return nullcontext()
    from ..state import AcceleratorState

    state = AcceleratorState()
    options = autocast_kwargs.to_kwargs() if autocast_kwargs is not None else None
    return autocast_context(state.mixed_precision, state.device, options)


def is_peft_model(model: Any) -> bool:
    """`model`, out of its DistributedDataParallel, is a peft PeftModel (a compiled one is not,
    as in Accelerate); False where peft is not installed."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


__all__ = ["get_grad_scaler", "get_mixed_precision_context_manager", "is_peft_model"]
