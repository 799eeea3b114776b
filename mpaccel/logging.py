"""get_logger: a logger whose records are emitted on the main process only, unless asked.

logger = get_logger(__name__)
logger.info("epoch done")                          # main process only
logger.info("my shard", main_process_only=False)   # every process
logger.info("in turn", main_process_only=False, in_order=True)  # rank by rank (collective)
"""

from __future__ import annotations

import logging
from typing import Any


class MultiProcessAdapter(logging.LoggerAdapter):
    """Prefixes nothing, filters by rank. `in_order=True` is collective (a barrier per rank)."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        from .state import PartialState

        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        if main_only:
            if state.is_main_process:
                self.logger.log(level, msg, *args, **kwargs)
            return
        if not in_order:
            self.logger.log(level, msg, *args, **kwargs)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A logger for multi-process jobs (Accelerate's `get_logger`)."""
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper() if isinstance(log_level, str) else log_level)
    return MultiProcessAdapter(logger, {})
