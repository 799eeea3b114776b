"""The sharded part of a training checkpoint: the `sharded` Statefuls of a TrainingState (fully
sharded models and their optimizers) written by each rank as its own rows beside the ordinary
part (save_state), and loaded at any world size, into sharded or plain objects (load_state).

A checkpoint with a sharded part holds `sharded.index.json` (format 2) and `state.index.json`
(format 1), committed in that order; the latter names the former's save id, so that the
checkpoint is complete only once both are there and belong together."""

from __future__ import annotations

import functools
from typing import Any

from ..comm import Comm, agreement
from . import rawio
from .format import CheckpointCollectiveError, CheckpointError
from .reader import CheckpointReader
from .sharded import SHARDED_STEM, LocalState, collect_local, write_local
from .sharded_read import Plan, apply, plan, read_plan
from .stateful import TrainingState
from .storage import check_same_on_every_rank
from .training_state import load_into

STATE_STEM = "state"
SAVE_ID = "sharded"  # the key of the state index's metadata naming the sharded part's save id


def collect(comm: Comm, objects: TrainingState, what: str, copy: bool) -> LocalState | None:
    """Collective. This rank's rows of the `sharded` Statefuls (a copy with `copy`: for a save
    in the background), checked to be the same state on every rank; None if there are none."""
    if not objects.sharded:
        return None
    local = LocalState({}, {}, {}, {})
    with agreement(comm, what, kind=CheckpointCollectiveError):
        local = collect_local({n: o.state_dict() for n, o in objects.sharded.items()}, comm.rank)
        if copy:
            local = local.snapshot()
    check_same_on_every_rank(comm, what, local.documents, local.layout())
    return local


def write(comm: Comm, directory: str, local: LocalState | None) -> dict[str, Any]:
    """Collective: commit the sharded part; returns what the state index's metadata records."""
    if local is None:
        return {}
    index = write_local(comm, directory, SHARDED_STEM, local)
    return {SAVE_ID: index["save_id"]}


class ShardedLoad:
    """The objects of a load_state that go through rows: the `sharded` Statefuls, and the
    models and optimizers that the checkpoint holds in its sharded part. read() (collective)
    reads and verifies them, changing nothing; apply() hands them over."""

    def __init__(self, objects: TrainingState, state: CheckpointReader) -> None:
        self.save_id = state.index.metadata.get(SAVE_ID)
        self.directory = state.directory
        saved: set[str] = set()
        if self.save_id is not None:
            with CheckpointReader(self.directory, SHARDED_STEM) as reader:
                self._check(reader)
                saved = set(reader.index.components)
        self.targets: dict[str, tuple[Any, str]] = {}  # name -> (object, stem)
        for name, obj in [*objects.models.items(), *objects.optimizers.items()]:
            if name in saved:
                self.targets[name] = (obj, SHARDED_STEM)
        for name, obj in objects.sharded.items():
            self.targets[name] = (obj, SHARDED_STEM if name in saved else STATE_STEM)
        # what the ordinary load takes
        self.rest = TrainingState(
            models={n: m for n, m in objects.models.items() if n not in self.targets},
            optimizers={n: o for n, o in objects.optimizers.items() if n not in self.targets},
            shared=objects.shared, per_rank=objects.per_rank,
            gradients={n: m for n, m in objects.gradients.items() if n not in self.targets},
            optional=objects.optional,
        )
        self.plans: list[Plan] = []

    def _check(self, reader: CheckpointReader) -> None:
        if reader.index.save_id != self.save_id:
            raise CheckpointError(
                f"{self.directory!r} holds the sharded part of another save (save id "
                f"{reader.index.save_id!r}, its state index names {self.save_id!r}): a "
                "later save into the same directory was interrupted",
                "load an earlier checkpoint (automatic checkpoint naming saves each into a "
                "directory of its own).",
            )

    def read(self, comm: Comm, what: str, limit: float) -> None:
        """Collective: plan and read every target's rows into new memory, verified."""
        readers: list[CheckpointReader] = []
        try:
            with agreement(comm, what + " (matching the sharded state)",
                           kind=CheckpointCollectiveError):
                for stem in (SHARDED_STEM, STATE_STEM):
                    names = [n for n, (_, s) in self.targets.items() if s == stem]
                    if not names:
                        continue
                    reader = rawio.within(
                        limit, what, functools.partial(CheckpointReader, self.directory, stem))
                    readers.append(reader)
                    if stem == SHARDED_STEM:
                        self._check(reader)
                    target = {n: self.targets[n][0].state_dict() for n in names}
                    self.plans.append(plan(reader, target))
                    rawio.within(limit, what, functools.partial(read_plan, reader,
                                                                self.plans[-1]))
        finally:
            for reader in readers:
                reader.close()

    def apply(self, comm: Comm, what: str, model_options: dict[str, Any]) -> None:
        """Collective: copy the rows read into the targets and hand each its state."""
        with agreement(comm, what + " (handing over the sharded state)",
                       kind=CheckpointCollectiveError):
            for planned in self.plans:
                for name, state in apply(planned).items():
                    load_into(name, self.targets[name][0], state, self.directory,
                              model_options)
