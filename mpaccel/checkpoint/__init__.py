"""HDF5 checkpoints without pickle: the package's public names, re-exported; no logic here.

api.py: save_model / load_model_state, save_state / load_state (collective: they take a
`comm` and the objects to save by name, a TrainingState, never the Accelerator).
naming.py: where checkpoints go (checkpoint_N numbering, the latest complete one, total_limit
rotation). async_save.py: saves written in the background (AsyncSaver).
docs/architecture.md lists the other modules; docs/checkpoint-format.md the files.
"""

from .api import load_model_state, load_state, save_model, save_state
from .async_save import AsyncSaver
from .format import CheckpointCollectiveError, CheckpointError
from .naming import checkpoints_in, latest_checkpoint, resolve_output
from .reader import CheckpointReader
from .stateful import Stateful, TrainingState

# isort: split
# -- importable from here since the package was one module; kept so no import breaks ----------
from .api import MODEL_LOAD_OPTIONS as MODEL_LOAD_OPTIONS
from .async_save import snapshot as snapshot
from .async_save import threads_ok as threads_ok
from .format import parse_size as parse_size
from .naming import MODEL_STEM as MODEL_STEM
from .naming import STATE_STEM as STATE_STEM
from .naming import logger as logger
from .naming import rotate as rotate
from .storage import delete_checkpoint as delete_checkpoint
from .storage import write_checkpoint as write_checkpoint
from .training_state import Rollback as Rollback
from .training_state import apply_states as apply_states
from .training_state import apply_tensors as apply_tensors
from .training_state import collect as collect
from .training_state import finish as finish
from .training_state import model_state as model_state
from .training_state import read_back as read_back

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
