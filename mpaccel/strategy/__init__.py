"""How a model is parallelised, chosen once per job (AcceleratorState): the interface the
Accelerator calls (base.py) and its strategies, data parallelism (data_parallel.py) and fully
sharded data parallelism (fully_sharded.py, over strategy/mesh.py's device mesh)."""

from .base import Strategy
from .choice import build, choose_plugin
from .data_parallel import DataParallel
from .fully_sharded import FullySharded

__all__ = ["DataParallel", "FullySharded", "Strategy", "build", "choose_plugin"]
