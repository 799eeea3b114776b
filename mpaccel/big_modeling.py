"""Accelerate's `accelerate.big_modeling` path. Big Model Inference (device maps, offloading)
is not what mpaccel does: each of that module's names resolves, on first use, to the refusal
mpaccel gives it at `mpaccel.X` (an importable placeholder that raises with a HINT when used,
mpaccel/absent_names.py). Its hooks are real: mpaccel.hooks."""

import typing as _typing

from . import absent_names
from .hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

__all__ = ["AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module"]

if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        for module in ("mpaccel", "mpaccel.utils"):
            if name in absent_names.MODULE_NAMES[module]:
                return absent_names.resolve(module, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
