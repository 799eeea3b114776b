"""Random generators by Accelerate's names (RNGType values): which of them this machine has, and
rank 0's states given to every rank over the control plane."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .errors import ConfigurationError

# Accelerate's RNGType values. "xla" has no torch module to read a state from without torch_xla.
_DEVICE_KINDS = ("cuda", "xpu", "npu", "mlu", "sdaa", "musa", "hpu", "neuron")
_KINDS = ("torch", "generator", "xla", *_DEVICE_KINDS)


def rng_kind(rng_type: Any) -> str:
    """"torch", "generator", ...: an RNGType member or its value."""
    kind = str(getattr(rng_type, "value", rng_type))
    if kind not in _KINDS:
        raise ConfigurationError(
            f"unknown RNG type {rng_type!r}; expected one of {list(_KINDS)}",
            "name the generators to synchronise as Accelerate does, e.g. ['torch', 'generator'].",
        )
    return kind


def _device_module(kind: str) -> Any:
    module = getattr(torch, kind, None)
    if module is None or not module.is_available():
        raise ConfigurationError(
            f"cannot synchronise the {kind!r} random generator: this process has no {kind} device",
            "synchronise only the generators this machine has ('torch', 'generator', and "
            "'cuda' on GPUs); Accelerator(rng_types=[...]) takes the same names.",
        )
    return module


def check_rng_types(rng_types: Iterable[Any], generator: torch.Generator | None) -> list[str]:
    """Not collective. The kinds named in `rng_types`, checked: each exists on this machine, and
    "generator" comes with a generator (ConfigurationError otherwise)."""
    kinds = [rng_kind(t) for t in rng_types]
    for kind in kinds:
        if kind == "xla":
            raise ConfigurationError(
                "cannot synchronise the 'xla' random generator: mpaccel does not run on TPUs",
                "leave 'xla' out of rng_types.",
            )
        if kind in _DEVICE_KINDS:
            _device_module(kind)
        if kind == "generator" and not isinstance(generator, torch.Generator):
            raise ConfigurationError(
                f"synchronising the 'generator' RNG needs a torch.Generator, got {generator!r}",
                "pass it: synchronize_rng_states(['generator'], generator=my_generator).",
            )
    return kinds


def _get(kind: str, generator: torch.Generator | None) -> torch.Tensor:
    if kind == "torch":
        return torch.get_rng_state()
    if kind == "generator":
        assert generator is not None
        return generator.get_state()
    return _device_module(kind).get_rng_state()


def _set(kind: str, state: torch.Tensor, generator: torch.Generator | None) -> None:
    if kind == "torch":
        torch.set_rng_state(state)
    elif kind == "generator":
        assert generator is not None
        generator.set_state(state)
    else:
        _device_module(kind).set_rng_state(state)


def synchronize_with(comm: Any, kinds: list[str], generator: torch.Generator | None) -> None:
    """Collective over `comm` (the control plane). Rank 0's states of the checked `kinds`
    (check_rng_types), set on every rank: one broadcast of host tensors."""
    if comm.size == 1 or not kinds:
        return
    mine = [_get(kind, generator) for kind in kinds] if comm.rank == 0 else None
    states = comm.bcast(mine, root=0, what="synchronize_rng_states")
    for kind, state in zip(kinds, states):
        _set(kind, state, generator)
