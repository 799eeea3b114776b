"""HDF5 checkpoints without pickle: the package's public names, re-exported; no logic here.

api.py: save_model / load_model_state, save_state / load_state (collective: they take a
`comm` and the objects to save by name, a TrainingState (training.py), never the Accelerator).
naming.py: where checkpoints go (checkpoint_N numbering, the latest complete one, total_limit
rotation). async_save.py: saves written in the background (AsyncSaver).
docs/architecture.md lists the other modules; docs/checkpoint-format.md the files.
"""

from ..errors import CheckpointCollectiveError, CheckpointError
from .api import load_model_state, load_state, save_model, save_state
from .async_save import AsyncSaver
from .naming import checkpoints_in, latest_checkpoint, resolve_output
from .reader import CheckpointReader
from .training import Stateful, TrainingState

__all__ = [
    "AsyncSaver",
    "CheckpointCollectiveError",
    "CheckpointError",
    "CheckpointReader",
    "Stateful",
    "TrainingState",
    "checkpoints_in",
    "latest_checkpoint",
    "load_model_state",
    "load_state",
    "resolve_output",
    "save_model",
    "save_state",
]
