"""Each rank's random number generator states, as a checkpoint holds them (entry "rng")."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .format import CheckpointError

RNG = "rng"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def checked_rng_state(state: Any, directory: str) -> dict[str, Any]:
    """The saved RNG states as set_rng_state() takes them, each first set on a generator of its
    own: one this process cannot take (a crafted or damaged checkpoint) is refused here, before
    anything of the load is applied, rather than after the model and optimizer were."""
    try:
        version, internal, gauss = state["python"]
        python_state = (version, tuple(internal), gauss)
        random.Random().setstate(python_state)
        numpy_state = tuple(state["numpy"])
        np.random.RandomState().set_state(numpy_state)
        torch_state = state["torch"]
        torch.Generator().set_state(torch_state)
        cuda_states = list(state.get("cuda", []))
        for i, cuda_state in enumerate(cuda_states):
            if i < torch.cuda.device_count():
                torch.Generator(device=f"cuda:{i}").set_state(cuda_state)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(
            f"{directory!r} holds RNG states this process cannot take "
            f"({type(exc).__name__}: {exc})",
            "the checkpoint is damaged or was not written by mpaccel; load another one.",
        ) from exc
    return {"python": python_state, "numpy": numpy_state, "torch": torch_state,
            "cuda": cuda_states}


def set_rng_state(state: dict[str, Any]) -> None:
    """Set RNG states that checked_rng_state() returned (it tried each one: this cannot fail)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for i, cuda_state in enumerate(state["cuda"]):
        if i < torch.cuda.device_count():
            torch.cuda.set_rng_state(cuda_state, i)
