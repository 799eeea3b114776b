"""Accelerate's `accelerate.utils.deepspeed` path. mpaccel does not drive DeepSpeed: every name
of that module resolves, on first use, to the refusal mpaccel.utils gives it (an importable
placeholder that raises with a HINT when used, mpaccel/absent_names.py); transformers imports
HfDeepSpeedConfig from here whenever deepspeed is installed."""

import typing as _typing

from .. import absent_names

if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if absent_names.MODULE_NAMES["mpaccel.utils"].get(name) is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return absent_names.resolve("mpaccel.utils", name)
