"""Experiment trackers behind Accelerate's names: `Accelerator(log_with=...)`, `init_trackers`,
`log`, `get_tracker`, `end_training`.

A tracker lives on the main process only (the others get a blank one that does nothing), so a
training loop calls `accelerator.log(...)` on every rank without a rank test and without any
communication. `log_with` takes tracker objects (subclasses of GeneralTracker, built by the
user) and the names of the trackers mpaccel builds itself: "tensorboard" (needs the
`tensorboard` package) and "all" (every one whose package is installed). Any other name is an
error naming what is available: a tracker asked for is never silently dropped.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .errors import ConfigurationError, MpaccelRuntimeWarning


class GeneralTracker:
    """Base class of a tracker. Subclasses set `name` and `requires_logging_directory`, and
    implement `store_init_configuration`, `log`, `finish` and the `tracker` property (the
    underlying object, e.g. a SummaryWriter). Methods are called on the main process only."""

    name = "general"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        self._blank = _blank

    @property
    def tracker(self) -> Any:
        return None

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record `values` (name -> number, string or dict of numbers) at `step`."""

    def finish(self) -> None:
        """Flush and close."""


class TensorBoardTracker(GeneralTracker):
    """torch.utils.tensorboard's SummaryWriter, writing to `<logging_dir>/<run_name>`."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter

        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.writer = SummaryWriter(self.logging_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.writer.add_hparams(dict(values), metric_dict={})
        self.writer.flush()

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers (one-element tensors and numpy scalars too) as scalars, strings as text,
        dicts of numbers as grouped scalars. Anything else is skipped with a warning: a
        logging call does not end a training run (the main process alone would stop)."""
        for key, value in values.items():
            number = _number(value)
            # each value read once (.item() of a GPU tensor waits for the device)
            scalars = (
                {str(k): _number(v) for k, v in value.items()}
                if isinstance(value, Mapping)
                else None
            )
            if number is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif scalars is not None and None not in scalars.values():
                self.writer.add_scalars(key, scalars, global_step=step, **kwargs)
            else:
                warnings.warn(
                    f"tensorboard cannot log {key!r}={value!r:.80}: skipped (it logs numbers, "
                    "one-element tensors, strings, and dicts of numbers)",
                    MpaccelRuntimeWarning,
                    stacklevel=3,
                )
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def _number(value: Any) -> int | float | None:
    """`value` as a Python number if it holds one: int, float, bool, a one-element torch
    tensor or numpy array, a numpy scalar. Else None."""
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        number = value.item()
    elif isinstance(value, (np.generic, np.ndarray)) and value.size == 1:
        number = value.item()
    else:
        return None
    return number if isinstance(number, (int, float)) else None  # not complex, str...


# name -> (tracker class, module it needs): the trackers mpaccel can build from a name
_BUILT_IN: dict[str, tuple[Callable[..., GeneralTracker], str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard"),
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve(log_with: Any) -> list[GeneralTracker | str]:
    """Check `log_with` (None, a name, a GeneralTracker, or a list of these) when the
    Accelerator is created: names of trackers that cannot be built are an error now, not
    at the first log."""
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    out: list[GeneralTracker | str] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            out.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()  # LoggerType-like enums too
        if name == "all":
            out += [n for n, (_, module) in _BUILT_IN.items() if _installed(module)]
            continue
        if name not in _BUILT_IN:
            raise ConfigurationError(
                f"log_with={item!r}: mpaccel builds only {sorted(_BUILT_IN)} from a name",
                "pass a tracker object instead: a subclass of mpaccel.tracking.GeneralTracker "
                "with store_init_configuration(), log() and finish().",
            )
        module = _BUILT_IN[name][1]
        if not _installed(module):
            raise ConfigurationError(
                f"log_with={item!r} needs the {module!r} package, which is not installed",
                f"pip install {module}, or drop it from log_with.",
            )
        out.append(name)
    return out


def start(
    wanted: list[GeneralTracker | str],
    project_name: str,
    logging_dir: str | None,
    init_kwargs: Mapping[str, Mapping[str, Any]],
) -> list[GeneralTracker]:
    """Build the named trackers (main process only: the caller decides)."""
    trackers: list[GeneralTracker] = []
    for item in wanted:
        if isinstance(item, GeneralTracker):
            trackers.append(item)
            continue
        factory = _BUILT_IN[item][0]
        if logging_dir is None:
            raise ConfigurationError(
                f"the {item} tracker writes files and needs a logging directory",
                "Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...).",
            )
        trackers.append(factory(project_name, logging_dir, **dict(init_kwargs.get(item, {}))))
    return trackers
