"""Accelerate's `accelerate.utils.other` names: unwrapping models, a module-level barrier,
regional compilation and small plain helpers."""

from __future__ import annotations

import functools
import sys
from typing import Any

from ..training import compile_regions, has_compiled_regions, is_compiled_module
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


# -- plain helpers -----------------------------------------------------------------------------


def get_pretty_name(obj: Any) -> str:
    """The qualified name of `obj` (a class or function), of its class for an instance."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """`source` merged into `destination` (changed in place, and returned): nested dicts are
    merged key by key, any other value of `source` replaces `destination`'s."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """`obj.a.b.c` for attr='a.b.c' (AttributeError as getattr raises it)."""
    return functools.reduce(getattr, attr.split("."), obj)


def convert_bytes(size: float) -> str:
    """`size` bytes in the largest unit (of 1024) that keeps it under 1024: '1.5 KB'."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of `library_names` that are imported in this process already."""
    return [name for name in library_names if name in sys.modules]


__all__ = [
    "are_libraries_initialized",
    "compile_regions",
    "convert_bytes",
    "extract_model_from_parallel",
    "get_pretty_name",
    "has_compiled_regions",
    "is_compiled_module",
    "merge_dicts",
    "recursive_getattr",
    "wait_for_everyone",
]
