"""`set_seed`, with Accelerate's module path (`mpaccel.utils.set_seed`)."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python's `random`, numpy and torch (every device) with `seed`.

    `device_specific`: each process adds its index to the seed, so that ranks draw differently
    (this sets up the PartialState: collective the first time, like any PartialState()).
    `deterministic`: also make torch use deterministic algorithms only
    (torch.use_deterministic_algorithms(True))."""
    if device_specific:
        from ..state import PartialState

        seed += PartialState().process_index
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy takes 32-bit seeds only
    torch.manual_seed(seed)  # every CUDA device too
    if deterministic:
        torch.use_deterministic_algorithms(True)
