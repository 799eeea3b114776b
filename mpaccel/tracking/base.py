"""What every tracker shares: the GeneralTracker base class, the `on_main_process` decorator,
and the conversions of logged values to plain numbers."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from ..errors import MpaccelRuntimeWarning

F = TypeVar("F", bound=Callable[..., Any])


def on_main_process(method: F) -> F:
    """Not collective (the process is checked at each call). Decorator: a tracker method runs
    on the main process only when the tracker's `main_process_only` is true (elsewhere it
    returns None). Read when called, not when the tracker is built: a tracker object may
    exist before the Accelerator, as in Accelerate.

    Args:
        method: the tracker method to decorate.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False):
            from ..state import PartialState

            if not PartialState().is_main_process:
                return None
        return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class GeneralTracker:
    """Base class of a tracker (Accelerate's). A subclass sets the class attributes `name` and
    `requires_logging_directory`, and implements `start` (open the run), `store_init_configuration`
    (hyperparameters), `log`, `finish`, and the `tracker` property (the library's own object:
    a SummaryWriter, a wandb run, ...). `main_process_only = True` (the default) makes the
    methods decorated with `on_main_process` do nothing on the other processes.

    The Accelerator builds and calls trackers on the main process only; elsewhere
    `get_tracker()` returns a blank one (`GeneralTracker(_blank=True)`) whose methods do nothing.
    Its methods are not collective.

    Raises:
        NotImplementedError: when a subclass lacks `name` or `requires_logging_directory`.
    """

    name: str
    requires_logging_directory: bool
    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [a for a in ("name", "requires_logging_directory") if not hasattr(self, a)]
        if missing:
            raise NotImplementedError(
                f"tracker class {type(self).__name__} does not define "
                f"{' and '.join(missing)}: set them as class attributes (name = 'my_tracker', "
                "requires_logging_directory = False)"
            )

    @property
    def tracker(self) -> Any:
        return None

    def start(self) -> None:
        """Not collective. Opens the run (called by `init_trackers`, after construction)."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Not collective. Records the run's hyperparameters.

        Args:
            values: hyperparameter name -> value (numbers, strings, bools, ...).
        """

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Not collective. Records `values` at `step`.

        Args:
            values: name -> value (a number, a one-element tensor, a string, ...; what a
                tracker cannot log it skips with a warning).
            step: the step the values belong to; None: the tracker's own count.
            **kwargs: passed on to the tracker library's logging call.
        """

    def finish(self) -> None:
        """Not collective. Flushes and closes the run."""


def number(value: Any) -> int | float | None:
    """Not collective. `value` as a Python number if it holds one, else None.

    Args:
        value: an int, float, bool, one-element torch tensor or numpy array, numpy scalar (a
            number), or anything else (None).
    """
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        result = value.item()
    elif isinstance(value, (np.generic, np.ndarray)) and value.size == 1:
        result = value.item()
    else:
        return None
    return result if isinstance(result, (int, float)) else None  # not complex, str...


def numbers_only(tracker: str, values: Mapping[str, Any]) -> dict[str, int | float]:
    """Not collective. The entries of `values` that are numbers (see `number`); the others are
    skipped with a warning: a logging call does not end a training run, where the main process
    alone would stop and leave the others waiting.

    Args:
        tracker: the tracker's name, for the warning.
        values: name -> value.
    """
    kept: dict[str, int | float] = {}
    for key, value in values.items():
        converted = number(value)
        if converted is None:
            skipped(tracker, key, value, "numbers and one-element tensors")
        else:
            kept[key] = converted
    return kept


def skipped(tracker: str, key: str, value: Any, takes: str) -> None:
    """Not collective. Warns that `tracker` skipped the value logged under `key`.

    Args:
        tracker: the tracker's name.
        key: the name the value was logged under.
        value: the value (its type is named).
        takes: what the tracker logs instead, in words.
    """
    warnings.warn(
        f"{tracker} cannot log {key!r} (a {type(value).__name__}): skipped; it logs {takes}",
        MpaccelRuntimeWarning,
        stacklevel=4,
    )
