"""`set_seed` and `synchronize_rng_states`, with Accelerate's module path
(`mpaccel.utils.random`, also `mpaccel.utils`)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..comm import agreement
from ..errors import ConfigurationError
from ..rng import check_rng_types as check_rng_types
from ..rng import rng_kind as rng_kind
from ..rng import synchronize_with as synchronize_with


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


def synchronize_rng_states(
    rng_types: list[Any], generator: torch.Generator | None = None
) -> None:
    """Collective: every rank calls it. Give every rank rank 0's state of each random generator
    named in `rng_types` ("torch": torch's global one; "cuda" (or another device kind): the
    current device's; "generator": `generator`), broadcast over MPI. A name that cannot be
    synchronised here fails on every rank with the same CollectiveError."""
    from ..state import PartialState

    comm = PartialState().comm
    kinds: list[str] = []
    with agreement(comm, "synchronize_rng_states", catch=(ConfigurationError,)):
        kinds = check_rng_types(rng_types, generator)
    synchronize_with(comm, kinds, generator)


def synchronize_rng_state(rng_type: Any = None, generator: torch.Generator | None = None) -> None:
    """Collective: `synchronize_rng_states([rng_type], generator)`."""
    synchronize_rng_states([rng_type], generator)
