"""Which trackers a name stands for, which of them are installed, and building them: what
`Accelerator(log_with=...)` and `init_trackers` use."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigurationError, MpaccelWarning, with_hint
from .base import GeneralTracker
from .files import AimTracker, DVCLiveTracker, TensorBoardTracker
from .services import (
    ClearMLTracker,
    CometMLTracker,
    MLflowTracker,
    SwanLabTracker,
    TrackioTracker,
    WandBTracker,
)

# name -> tracker class; in Accelerate's order, which is the order "all" starts them in
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "comet_ml": CometMLTracker,
    "aim": AimTracker,
    "mlflow": MLflowTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
}
# the built-in names' packages: any one of them installed makes the tracker available
_PACKAGES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    **{name: (name,) for name in LOGGER_TYPE_TO_CLASS if name != "tensorboard"},
}
_warned: set[str] = set()  # names already warned about in this process


def _installed(module: str) -> bool:
    if module in sys.modules:  # None there blocks the import (Python's own convention)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def is_available(name: str) -> bool:
    """Not collective. Whether the tracker called `name` can be built here (registered ones
    always can).

    Args:
        name: a tracker's name ("tensorboard", "wandb", ...).
    """
    packages = _PACKAGES.get(name)
    if packages is None:
        return name in LOGGER_TYPE_TO_CLASS
    return any(_installed(module) for module in packages)


def get_available_trackers() -> list[str]:
    """Not collective. The names of the built-in trackers whose package is installed."""
    return [name for name in _PACKAGES if is_available(name)]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Not collective, but do it on every process, before creating the Accelerator. Makes
    `log_with="<tracker_class.name>"` build `tracker_class`, called as
    `tracker_class(project_name, [logging_dir,] **init_kwargs[name])` by `init_trackers`; a
    class registered under a taken name replaces it, with a warning.

    Args:
        tracker_class: a GeneralTracker subclass that sets `name` and
            `requires_logging_directory`.

    Raises:
        ValueError: for anything else.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(
            f"register_tracker_class needs a GeneralTracker subclass, got {tracker_class!r}"
        )
    if not getattr(tracker_class, "name", None):
        raise ValueError(f"{tracker_class.__name__} has no name: set name = 'my_tracker'")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(f"{tracker_class.__name__} does not set requires_logging_directory")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(
            f"register_tracker_class: {tracker_class!r} replaces the tracker named "
            f"{tracker_class.name!r}",
            MpaccelWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class
    _PACKAGES.pop(tracker_class.name, None)  # the user's class needs no package we know of


def _name(item: Any) -> str:
    return str(getattr(item, "value", item)).lower()  # LoggerType members too


def resolve(log_with: Any) -> list[GeneralTracker | str]:
    """Not collective (every process checks alike, when the Accelerator is created). The
    trackers `log_with` asks for: a known name whose package is missing is left out with a
    warning (on the main process, once per name), as Accelerate runs on without it.

    Args:
        log_with: None, a name or LoggerType ("all": every available one), a GeneralTracker
            object, or a list of these.

    Returns:
        The tracker objects and the names of the available trackers, each name once.

    Raises:
        ConfigurationError: for an unknown name.
    """
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    objects = [item for item in items if isinstance(item, GeneralTracker)]
    names = [_name(item) for item in items if not isinstance(item, GeneralTracker)]
    if "all" in names:
        return [*objects, *get_available_trackers()]
    unknown = [n for n in names if n not in LOGGER_TYPE_TO_CLASS]
    if unknown:
        raise ConfigurationError(
            f"log_with names unknown tracker(s) {unknown}; known: "
            f"{sorted(LOGGER_TYPE_TO_CLASS)} and 'all'",
            "fix the spelling, register your class with "
            "mpaccel.tracking.register_tracker_class(), or pass a GeneralTracker object.",
        )
    chosen: list[GeneralTracker | str] = list(objects)
    for name in dict.fromkeys(names):  # each once, in the order given
        if is_available(name):
            chosen.append(name)
        else:
            _warn_missing(name)
    return chosen


def _warn_missing(name: str) -> None:
    from ..state import PartialState

    if name in _warned or not PartialState().is_main_process:
        return
    _warned.add(name)
    package = " or ".join(_PACKAGES[name])
    warnings.warn(
        with_hint(
            f"log_with={name!r}: the {package} package is not installed, so nothing is logged "
            f"to {name} (training goes on).",
            f"pip install {_PACKAGES[name][0]}",
            separator=" ",
        ),
        MpaccelWarning,
        stacklevel=4,
    )


def _needs_logging_dir(wanted: Sequence[GeneralTracker | str]) -> list[str]:
    """The names among `wanted` whose tracker writes under the Accelerator's logging_dir."""
    return [
        item
        for item in wanted
        if isinstance(item, str) and LOGGER_TYPE_TO_CLASS[item].requires_logging_directory
    ]


def start(
    wanted: Sequence[GeneralTracker | str],
    project_name: str,
    logging_dir: str | None,
    init_kwargs: Mapping[str, Mapping[str, Any]],
) -> list[GeneralTracker]:
    """Not collective (the main process calls it: the caller decides). Builds the named
    trackers, then starts every one; tracker objects given to log_with are started as they
    are.

    Args:
        wanted: what `resolve` returned.
        project_name: the run's (project's) name, each tracker's first argument.
        logging_dir: the directory the file-writing trackers write under.
        init_kwargs: tracker name -> keyword arguments for its constructor.

    Returns:
        The started trackers.
    """
    trackers: list[GeneralTracker] = []
    for item in wanted:
        if isinstance(item, GeneralTracker):
            trackers.append(item)
            continue
        cls: Any = LOGGER_TYPE_TO_CLASS[item]
        kwargs = dict(init_kwargs.get(item, {}))
        if cls.requires_logging_directory:
            trackers.append(cls(project_name, logging_dir, **kwargs))
        else:
            trackers.append(cls(project_name, **kwargs))
    for tracker in trackers:
        tracker.start()
    return trackers


def check_logging_dir(wanted: Sequence[GeneralTracker | str], logging_dir: str | None) -> None:
    """Not collective (pure: every process can check, and all raise alike). Refuses a missing
    logging directory where a named tracker writes files.

    Args:
        wanted: what `resolve` returned.
        logging_dir: the Accelerator's logging directory, or None.

    Raises:
        ConfigurationError: when a named tracker among `wanted` writes files and
            `logging_dir` is None.
    """
    names = _needs_logging_dir(wanted)
    if names and logging_dir is None:
        raise ConfigurationError(
            f"the tracker(s) {names} write files and need a logging directory; this "
            "Accelerator has none",
            "Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...).",
        )


def filter_trackers(log_with: Any, logging_dir: str | None = None) -> list[GeneralTracker | str]:
    """Not collective. Accelerate's name for `resolve` followed by `check_logging_dir`.

    Args:
        log_with: as for `resolve`.
        logging_dir: as for `check_logging_dir`.
    """
    wanted = resolve(log_with)
    check_logging_dir(wanted, logging_dir)
    return wanted
