"""load_state() on a directory that Accelerate's save_state wrote.

Accelerate's layout: `model.safetensors` (or `pytorch_model.bin`), `model_1.safetensors` ...
for more models, `optimizer.bin`, `scheduler.bin`, `scaler.pt`, `sampler.bin`,
`dl_state_dict.bin`, `custom_checkpoint_<i>.pkl` and `random_states_<rank>.pkl`. Everything but
the safetensors files is a pickle, which can run code when it is read: mpaccel reads them only
when the caller says so (`load_state(dir, allow_pickle=True)` or MPACCEL_ALLOW_PICKLE=1), and
otherwise refuses, naming the files, before anything is changed. Safetensors model weights load
either way.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .. import _env
from ..errors import MpaccelRuntimeWarning
from .format import CheckpointError
from .stateful import TrainingState

_MARKERS = ("model.safetensors", "pytorch_model.bin", "optimizer.bin", "random_states_0.pkl")
_CONVERT = (
    "to read its pickles pass load_state(dir, allow_pickle=True) (or set "
    "MPACCEL_ALLOW_PICKLE=1) for a directory you trust; then accelerator.save_state(new_dir) "
    "converts it to mpaccel's pickle-free format."
)


def recognise(directory: str) -> bool:
    """Not collective: does `directory` hold an Accelerate save_state checkpoint (and no
    mpaccel index)?"""
    if not os.path.isdir(directory) or os.path.exists(os.path.join(directory, "state.index.json")):
        return False
    return any(os.path.exists(os.path.join(directory, name)) for name in _MARKERS)


def _numbered(stem: str, i: int, ext: str) -> str:
    return f"{stem}{'' if i == 0 else f'_{i}'}.{ext}"


def _strip_ddp(state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """Accelerate saves prepared models as they are: under DDP their keys start `module.`."""
    if state and all(k.startswith("module.") for k in state) and not any(
        k.startswith("module.") for k in module.state_dict()
    ):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def _file_of(entry: str) -> tuple[str, ...]:
    """The file(s) Accelerate's save_state writes for mpaccel's entry `entry` (the first that
    exists is read), or () for an entry Accelerate keeps elsewhere."""
    kind, _, number = entry.rpartition("_")
    if not number.isdigit():
        return ("scaler.pt",) if entry == "scaler" else ()
    i = int(number)
    if kind == "model":
        return (_numbered("model", i, "safetensors"), _numbered("pytorch_model", i, "bin"))
    if kind in ("optimizer", "scheduler"):
        return (_numbered(kind, i, "bin"),)
    if kind == "custom":
        return (f"custom_checkpoint_{i}.pkl",)
    return ()


def load_accelerate_state(
    objects: TrainingState,
    directory: str,
    rank: int,
    allow_pickle: bool | None,
    model_options: dict[str, Any],
) -> None:
    """Not collective (each rank reads the files; load_state agrees on the outcome). Reads
    everything first, then applies it: a missing or refused file changes nothing. `rank`: whose
    `random_states_<rank>.pkl` to read (it also holds Accelerate's step counter, given to the
    `accelerator` entry)."""
    if allow_pickle is None:
        allow_pickle = _env.get_bool("allow_pickle", False)
    needed: list[tuple[str, str, Any]] = []  # (entry, file, target)
    pickles: list[str] = []
    targets: dict[str, Any] = {**objects.models, **objects.optimizers, **objects.shared}
    for entry, target in targets.items():
        names = _file_of(entry)
        if not names:
            continue
        found = [n for n in names if os.path.exists(os.path.join(directory, n))]
        if not found:
            if entry in objects.optional:
                continue
            raise CheckpointError(
                f"{directory!r} is an Accelerate checkpoint without {names[0]!r} (for {entry})",
                "load it with the models, optimizers and schedulers it was saved with.",
            )
        needed.append((entry, os.path.join(directory, found[0]), target))
        if not found[0].endswith(".safetensors"):
            pickles.append(found[0])
    rng_name = f"random_states_{rank}.pkl"
    rng_here = os.path.exists(os.path.join(directory, rng_name))
    if rng_here and allow_pickle:
        needed.append((RNG_ENTRY, os.path.join(directory, rng_name), targets.get("accelerator")))
    if pickles and not allow_pickle:
        raise CheckpointError(
            f"{directory!r} is a checkpoint written by Hugging Face Accelerate's save_state; "
            f"loading it here needs {pickles}, which are Python pickles (they can run code "
            "when read), and mpaccel reads no pickle unless told to",
            _CONVERT,
        )
    if rng_here and not allow_pickle:
        warnings.warn(
            f"{directory!r} (an Accelerate checkpoint): {rng_name} is a pickle and is not read; "
            "the random states stay as they are. " + _CONVERT,
            MpaccelRuntimeWarning,
            stacklevel=4,
        )
    loaded: list[tuple[str, Any, Any]] = []
    for entry, path, target in needed:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            value: Any = load_file(path)
        else:
            # The caller allowed unpickling this trusted directory (allow_pickle).
            value = torch.load(path, map_location="cpu", weights_only=False)
        loaded.append((entry, value, target))
    for entry, value, target in loaded:
        if entry in objects.models:
            target.load_state_dict(_strip_ddp(value, target), **model_options)
        elif entry == RNG_ENTRY:
            _set_rng(value, target)
        else:
            target.load_state_dict(value)


RNG_ENTRY = "random_states"


def _set_rng(states: dict[str, Any], step_counter: Any) -> None:
    import random

    import numpy as np

    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    if "step" in states and step_counter is not None:
        step_counter.load_state_dict({"step": states["step"]})
