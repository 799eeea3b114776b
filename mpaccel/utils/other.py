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
    """Not collective. The user's module inside DistributedDataParallel and torch.compile's
    wrapper (as Accelerator.unwrap_model).

    Args:
        model: a module, wrapped or not.
        keep_fp32_wrapper: keep the forward that converts mixed-precision outputs to float32.
        keep_torch_compile: keep torch.compile's wrapper (else return the module inside it).
        recursive: Accelerate's, for wrappers around submodules, which mpaccel never puts
            there: accepted and changes nothing.
    """
    del recursive
    return _unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)


def wait_for_everyone() -> None:
    """Collective: every rank must call it; returns once all have (PartialState's barrier,
    with its default timeout)."""
    from ..state import PartialState

    PartialState().wait_for_everyone()


# -- plain helpers -----------------------------------------------------------------------------


def get_pretty_name(obj: Any) -> str:
    """Not collective. The qualified name of `obj`.

    Args:
        obj: a class or function, or an instance (then its class's name).
    """
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Not collective. `source` merged into `destination`: nested dicts are merged key by key,
    any other value of `source` replaces `destination`'s.

    Args:
        source: the dict whose entries win.
        destination: the dict changed in place, and returned.
    """
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """Not collective. `obj.a.b.c` for attr="a.b.c".

    Args:
        obj: where the lookup starts.
        attr: attribute names joined by dots.

    Raises:
        AttributeError: as getattr raises it, for the first name that is missing.
    """
    return functools.reduce(getattr, attr.split("."), obj)


def convert_bytes(size: float) -> str:
    """Not collective. `size` bytes in the largest unit (of 1024) that keeps it under 1024,
    e.g. "1.5 KB".

    Args:
        size: a number of bytes.
    """
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Not collective. Those of `library_names` that are imported in this process already.

    Args:
        *library_names: top-level module names, e.g. "torch_xla".
    """
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
