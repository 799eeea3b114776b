"""Experiment trackers behind Accelerate's names: `Accelerator(log_with=...)`, `init_trackers`,
`log`, `get_tracker`, `end_training`.

Trackers are built and called on the main process only (the others get a blank one that does
nothing), so a training loop calls `accelerator.log(...)` on every rank without a rank test
and without communication. `log_with` takes tracker objects (GeneralTracker subclasses) and
names: each built-in tracker drives its own library (tensorboard, wandb, comet_ml, aim, mlflow,
clearml, dvclive, swanlab, trackio) and is available where that library is installed; "all"
is every available one. See docs/tracking.md.
"""

from .base import GeneralTracker, on_main_process
from .files import AimTracker, DVCLiveTracker, TensorBoardTracker
from .registry import (
    LOGGER_TYPE_TO_CLASS,
    check_logging_dir,
    filter_trackers,
    get_available_trackers,
    is_available,
    register_tracker_class,
    resolve,
    start,
)
from .services import (
    ClearMLTracker,
    CometMLTracker,
    MLflowTracker,
    SwanLabTracker,
    TrackioTracker,
    WandBTracker,
)

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "check_logging_dir",
    "filter_trackers",
    "get_available_trackers",
    "is_available",
    "on_main_process",
    "register_tracker_class",
    "resolve",
    "start",
]
