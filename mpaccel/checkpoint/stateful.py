"""What save_state/load_state take: objects with state_dict()/load_state_dict() (the Stateful
protocol of torch.distributed.checkpoint), by the name of their entry in the checkpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def _empty() -> Mapping[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """The objects of a training checkpoint, each under the name of its entry (the names are
    the file format: docs/checkpoint-format.md). Entries are written in this order.

    `models`: torch modules, unwrapped (stored once, with their buffers as rank 0 has them;
    loaded in place, checked against the checkpoint first). `optimizers`: loaded in place too.
    `shared`: any other Stateful whose state is the same on every rank (schedulers, the grad
    scaler, registered objects, a step counter). `per_rank`: Statefuls whose state is each
    rank's own (data loader positions); loaded at another world size, each takes rank 0's.
    `gradients`: per-rank entry name -> model whose `.grad`s are saved (pass them only when
    saving mid-accumulation; on load, the models to give them back to, at the same world size).
    `optional`: names of `shared` a checkpoint may lack (left alone on load). The checkpoint
    also holds each rank's RNG states (entry "rng") itself.
    `sharded`: Statefuls whose state_dict() holds DTensors (fully_shard models, optimizers over
    their parameters; an optimizer's state must exist before a load: create it first). Each
    rank stores only its own rows, in the sharded part of the checkpoint, and on load reads the
    rows it owns, from a sharded or an ordinary checkpoint. Models and optimizers saved in the
    sharded part load into `models`/`optimizers` too (every rank reads whole tensors).
    """

    models: Mapping[str, torch.nn.Module] = dataclasses.field(default_factory=_empty)
    optimizers: Mapping[str, torch.optim.Optimizer] = dataclasses.field(default_factory=_empty)
    shared: Mapping[str, Stateful] = dataclasses.field(default_factory=_empty)
    per_rank: Mapping[str, Stateful] = dataclasses.field(default_factory=_empty)
    gradients: Mapping[str, torch.nn.Module] = dataclasses.field(default_factory=_empty)
    optional: frozenset[str] = frozenset()
    sharded: Mapping[str, Stateful] = dataclasses.field(default_factory=_empty)

    def sharded_gradients(self) -> dict[str, torch.nn.Module]:
        """The `gradients` entries whose model is one of `sharded` (a fully_shard model): their
        gradients go as rows into the sharded part (sharded_state.SummedGradients), not per
        rank."""
        held = {id(obj) for obj in self.sharded.values()}
        return {name: module for name, module in self.gradients.items() if id(module) in held}

    def __post_init__(self) -> None:
        shared = [*self.models, *self.optimizers, *self.shared, *self.sharded]
        per_rank = ["rng", *self.per_rank, *self.gradients]
        twice = sorted({n for names in (shared, per_rank) for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"TrainingState: two objects under each of the entry names {twice} (the shared "
                "entries, and each rank's, need names of their own; 'rng' is the RNG states')"
            )
