"""Who writes a save: every rank together (the collective, parallel path), this rank alone
(Accelerate's `if accelerator.is_main_process: accelerator.save_model(...)`), or another rank
alone. Decided by the communicator's presence handshake (comm/presence.py), without a
collective, so that a rank calling alone never waits for ranks that will not come."""

from __future__ import annotations

import os
from typing import Any

from .. import _env
from ..comm.presence import ALONE, COLLECTIVE, OTHERS

__all__ = ["ALONE", "COLLECTIVE", "OTHERS", "solo_wait", "who_saves"]

# Seconds a save waits for ranks that are computing (ranks waiting in a collective answer at
# once). Long enough that ranks all calling a save, but some late under load, still save
# together; only a rank alone while the others compute pays it.
DEFAULT_WAIT = 10.0


def solo_wait() -> float:
    """Seconds a save waits for the other ranks before saving alone (MPACCEL_SOLO_SAVE_WAIT)."""
    value = _env.get_float("solo_save_wait")
    return DEFAULT_WAIT if value is None else value


def who_saves(comm: Any, what: str, directory: Any, wait: float | None = None) -> str:
    """Not collective. COLLECTIVE, ALONE or OTHERS for the save `what` into `directory` (None:
    the automatic one). At size 1 (a NullComm) always COLLECTIVE."""
    presence = getattr(comm, "presence", None)
    if comm.size == 1 or presence is None:
        return COLLECTIVE
    key = f"{what}:{os.path.abspath(os.fspath(directory)) if directory is not None else ''}"
    return str(presence.who(key, solo_wait() if wait is None else wait))
