"""Accelerate's `accelerate.utils.other` names: unwrapping models, a module-level barrier,
regional compilation and small plain helpers."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

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
        blocks = [torch.compile(block, **compile_kwargs) for block in module.children()]
        return torch.nn.ModuleList(blocks)  # type: ignore[arg-type]
    if not any(_is_repeated_blocks(sub) for sub in module.modules()):
        return torch.compile(module, **compile_kwargs)  # type: ignore[return-value]
    # A copy of this module that shares its parameters, buffers and attributes, with its
    # children replaced: the user's module is left uncompiled.
    copy = type(module).__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy._modules = {}
    for name, child in module.named_children():
        copy.add_module(name, _compiled_regions(child, compile_kwargs))
    return copy


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Regional compilation: each block of a repeated ModuleList (a transformer's layers)
    compiled on its own with torch.compile(block, **compile_kwargs), and the rest of the model
    compiled in the largest pieces holding no such list; a model without one is compiled whole.
    Returns a new module sharing `module`'s parameters (`module` itself is unchanged and is the
    result's `_orig_mod`). Not collective."""
    compiled = _compiled_regions(module, compile_kwargs)
    if "_orig_mod" not in compiled.__dict__:
        compiled.__dict__["_orig_mod"] = module  # the way back to the uncompiled model
    return compiled


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """`module` has submodules, and one of them (or `module`) is torch.compile's wrapper."""
    return bool(module._modules) and any(is_compiled_module(m) for m in module.modules())


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
