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


def load_accelerate_state(
    accelerator: Any, directory: str, allow_pickle: bool | None, model_options: dict[str, Any]
) -> None:
    """Not collective (each rank reads the files; load_state agrees on the outcome). Reads
    everything first, then applies it: a missing or refused file changes nothing."""
    if allow_pickle is None:
        allow_pickle = _env.get_bool("allow_pickle", False)
    needed: list[tuple[str, str, Any]] = []  # (kind, file, target)
    pickles: list[str] = []

    def want(kind: str, name: str, target: Any, required: bool = True) -> None:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            if required:
                raise CheckpointError(
                    f"{directory!r} is an Accelerate checkpoint without {name!r} (for {kind})",
                    "load it with the models, optimizers and schedulers it was saved with.",
                )
            return
        needed.append((kind, path, target))
        if not name.endswith(".safetensors"):
            pickles.append(name)

    for i, model in enumerate(accelerator._models):
        safe = _numbered("model", i, "safetensors")
        if os.path.exists(os.path.join(directory, safe)):
            want("model", safe, model)
        else:
            want("model", _numbered("pytorch_model", i, "bin"), model)
    for i, opt in enumerate(accelerator._optimizers):
        want("optimizer", _numbered("optimizer", i, "bin"), opt)
    for i, sched in enumerate(accelerator._schedulers):
        want("scheduler", _numbered("scheduler", i, "bin"), sched)
    if accelerator.scaler is not None:
        want("scaler", "scaler.pt", accelerator.scaler)
    for i, obj in enumerate(accelerator._custom_objects):
        want("custom", f"custom_checkpoint_{i}.pkl", obj)
    rng_name = f"random_states_{accelerator.process_index}.pkl"
    rng_here = os.path.exists(os.path.join(directory, rng_name))
    if rng_here and allow_pickle:
        want("rng", rng_name, None)
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
    for kind, path, target in needed:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            value: Any = load_file(path)
        else:
            # The caller allowed unpickling this trusted directory (allow_pickle).
            value = torch.load(path, map_location="cpu", weights_only=False)
        loaded.append((kind, value, target))
    for kind, value, target in loaded:
        if kind == "model":
            module = accelerator.unwrap_model(target)
            module.load_state_dict(_strip_ddp(value, module), **model_options)
        elif kind == "rng":
            _set_rng(accelerator, value)
        else:
            target.load_state_dict(value)


def _set_rng(accelerator: Any, states: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    if "step" in states:
        accelerator.step = states["step"]
