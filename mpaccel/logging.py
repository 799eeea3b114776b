"""get_logger: a logger whose records are emitted on the main process only, unless asked.

logger = get_logger(__name__)
logger.info("epoch done")                          # main process only: "[RANK 0] epoch done"
logger.info("my shard", main_process_only=False)   # every process, "[RANK r] my shard"
logger.info("in turn", in_order=True)              # every process, rank by rank (collective)

Records go through the standard logging machinery: configure a handler (logging.basicConfig)
to see them.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from . import envvars


class MultiProcessAdapter(logging.LoggerAdapter):
    """Prefixes each message with `[RANK r] ` and filters by rank, as Accelerate's adapter does.
    `in_order=True` (collective: a barrier per rank) logs on every rank in turn, whatever
    `main_process_only` says."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        from .state import PartialState

        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)  # the caller's line, not this module's
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        from .state import PartialState

        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        msg, kwargs = self.process(msg, kwargs)
        if not in_order:
            if state.is_main_process or not main_only:
                self.logger.log(level, msg, *args, **kwargs)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    @functools.lru_cache(None)  # noqa: B019 (one cache entry per distinct call: the point)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """warning(), the first time it is called with these arguments only."""
        kwargs.setdefault("stacklevel", 3)
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A logger for multi-process jobs (Accelerate's `get_logger`). Without `log_level`, the
    level comes from MPACCEL_LOG_LEVEL or ACCELERATE_LOG_LEVEL where set (and, as in
    Accelerate, is then set on the root logger too)."""
    logger = logging.getLogger(name)
    if log_level is None:
        log_level = envvars.get_choice("log_level")
    if log_level is not None:
        level = log_level.upper() if isinstance(log_level, str) else log_level
        logger.setLevel(level)
        logger.root.setLevel(level)
    return MultiProcessAdapter(logger, {})
