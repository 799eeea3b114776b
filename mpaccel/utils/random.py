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
    """Not collective, except that `device_specific` sets up the PartialState if there is none
    (collective then, as the first PartialState() is). Seeds python's `random`, numpy and
    torch (every device) with `seed`.

    Args:
        seed: the seed (numpy receives it modulo 2**32).
        device_specific: add this process's index to the seed, so that ranks draw differently.
        deterministic: also make torch use deterministic algorithms only
            (torch.use_deterministic_algorithms(True)).
    """
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
    """Collective: every rank calls it. Gives every rank rank 0's state of each random
    generator named in `rng_types`, broadcast over MPI.

    Args:
        rng_types: the generators, by name or RNGType: "torch" (torch's global one), "cuda"
            (or another device kind: the current device's), "generator" (`generator`).
        generator: the torch.Generator that "generator" names.

    Raises:
        CollectiveError: on every rank, when a name cannot be synchronised here (on any rank).
    """
    from ..state import PartialState

    comm = PartialState().comm
    kinds: list[str] = []
    with agreement(comm, "synchronize_rng_states", catch=(ConfigurationError,)):
        kinds = check_rng_types(rng_types, generator)
    synchronize_with(comm, kinds, generator)


def synchronize_rng_state(rng_type: Any = None, generator: torch.Generator | None = None) -> None:
    """Collective: every rank calls it. `synchronize_rng_states([rng_type], generator)`.

    Args:
        rng_type: one generator's name or RNGType (see synchronize_rng_states).
        generator: the torch.Generator that "generator" names.
    """
    synchronize_rng_states([rng_type], generator)
