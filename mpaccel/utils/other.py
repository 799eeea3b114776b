"""Accelerate's `accelerate.utils.other` names: unwrapping models, a module-level barrier."""

from __future__ import annotations

from typing import Any

from ..training import is_compiled_module
from ..training import unwrap_model as _unwrap_model


def extract_model_from_parallel(
    model: Any,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> Any:
    """The user's module inside DistributedDataParallel and torch.compile's wrapper (see
    Accelerator.unwrap_model). Not collective. `recursive` (Accelerate's, for wrappers around
    submodules, which mpaccel never puts there) is accepted and changes nothing."""
    del recursive
    return _unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)


def wait_for_everyone() -> None:
    """Collective: every rank must call it; returns once all have (PartialState's barrier)."""
    from ..state import PartialState

    PartialState().wait_for_everyone()


__all__ = ["extract_model_from_parallel", "is_compiled_module", "wait_for_everyone"]
