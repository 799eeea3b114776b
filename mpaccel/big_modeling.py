"""Accelerate's `accelerate.big_modeling` path. Big Model Inference (device maps, offloading)
is not what mpaccel does: each of that module's names resolves, on first use, to the refusal
mpaccel gives it at `mpaccel.X` (an importable placeholder that raises with a HINT when used,
mpaccel/_absent.py). Its hooks are real: mpaccel.hooks."""

import typing as _typing

from . import _absent
from .hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

__all__ = ["AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module"]

if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        for module in ("mpaccel", "mpaccel.utils"):
            if name in _absent.MODULE_NAMES[module]:
                return _absent.resolve(module, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
