"""The sharded part of a training checkpoint: the `sharded` Statefuls of a TrainingState (fully
sharded models and their optimizers) written by each rank as its own rows beside the ordinary
part (save_state), and loaded at any world size, into sharded or plain objects (load_state).

A checkpoint with a sharded part holds `sharded.index.json` (format 2, or 3 with N-D blocks)
and `state.index.json` (format 1), committed in that order; the latter names the former's save
id, so that the checkpoint is complete only once both are there and belong together. Saving
again into the same directory keeps the previous sharded part (its files, and its index copied
aside to `sharded.<save id>.index.json`) until the new state index is committed: a crash
between the two commits leaves the previous checkpoint loadable."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ...comm import Comm, agreement
from ...errors import CheckpointCollectiveError, CheckpointError
from .. import rawio
from ..files import entry_exists, open_directory, replace_file
from ..index import index_path, parse_index, read_index, read_index_text
from ..reader import CheckpointReader
from ..training import Rollback, TrainingState, check_optimizer, copy_of, load_into
from ..writer import check_same_on_every_rank
from .load import Plan, apply, differences, fill_plan, plan, read_plan
from .save import SHARDED_STEM, LocalState, check_joined, collect_local, write_local

STATE_STEM = "state"
SAVE_ID = "sharded"  # the key of the state index's metadata naming the sharded part's save id


def collect(comm: Comm, objects: TrainingState, what: str, copy: bool) -> LocalState | None:
    """Collective. This rank's rows of the `sharded` Statefuls, and of the sharded models'
    gradients where `objects.gradients` asks for them (a copy with `copy`: for a save in the
    background), checked to be the same state on every rank; None if there are none."""
    if not objects.sharded:
        return None
    local = LocalState({}, {}, {}, {})
    with agreement(comm, what, kind=CheckpointCollectiveError):
        state = {n: o.state_dict() for n, o in objects.sharded.items()}
        for name, module in objects.sharded_gradients().items():
            grads = objects.gradient_rows(module, None).state_dict()
            if grads:  # none: saved at a step boundary after all
                state[name] = grads
        local = collect_local(state, comm.rank)
        if copy:
            local = local.snapshot()
    check_joined(comm, local, what)
    check_same_on_every_rank(comm, what, local.documents, local.layout())
    return local


def kept_stem(save_id: str) -> str:
    """The stem under which a sharded part's index is kept aside while a second save into its
    directory is under way (`sharded.<save id>.index.json`)."""
    return f"{SHARDED_STEM}.{save_id}"


def _committed_part(directory: str) -> str | None:
    """The save id of the sharded part that the committed state index of `directory` names
    (None: no state index, or one without a sharded part), read as a load reads it (files.py:
    no link followed, no FIFO or device opened; the bounds and schema of the index, which
    make that id a plain name)."""
    try:
        dir_fd = open_directory(directory)
    except FileNotFoundError:
        return None
    try:
        if not entry_exists(dir_fd, f"{STATE_STEM}.index.json"):
            return None
        part = read_index(dir_fd, directory, STATE_STEM).metadata.get(SAVE_ID)
    except CheckpointError as exc:
        raise CheckpointError(
            f"cannot read the checkpoint already in {directory!r} to save over it: "
            f"{exc.message}",
            "save into another directory, or delete this one first.",
        ) from exc
    finally:
        os.close(dir_fd)
    return part if isinstance(part, str) else None


def _keep_aside(directory: str) -> str | None:
    """Rank 0, before a sharded part is saved into `directory`: if the checkpoint committed
    there has a sharded part, copy its index to kept_stem(its id) (files.replace_file: a new
    temp file, fsync, rename, fsync of the directory), so that the new part's commit, which
    replaces `sharded.index.json`, leaves that checkpoint loadable until the new state index
    replaces it. Returns its save id, whose files the new commit keeps. Every file is read
    and written as files.py does, in `directory` only."""
    part = _committed_part(directory)
    if part is None:
        return None
    target = f"{kept_stem(part)}.index.json"
    dir_fd = open_directory(directory)
    try:
        if entry_exists(dir_fd, target):  # kept by an earlier save that did not complete
            return part
        if not entry_exists(dir_fd, f"{SHARDED_STEM}.index.json"):
            return part  # nothing to keep: its load fails as it would have
        try:
            text = read_index_text(dir_fd, directory, SHARDED_STEM)
        except CheckpointError as exc:
            raise CheckpointError(
                f"cannot keep the sharded part of the checkpoint in {directory!r} aside to "
                f"save over it: {exc.message}",
                "save into another directory, or delete this one first.",
            ) from exc
        if parse_index(text, index_path(directory, SHARDED_STEM)).save_id != part:
            return part  # not that part's index: leave it to the load to refuse
        replace_file(dir_fd, directory, target, text.encode())
    finally:
        os.close(dir_fd)
    return part


def write(comm: Comm, directory: str, local: LocalState | None) -> dict[str, Any]:
    """Collective: commit the sharded part; returns what the state index's metadata records.
    Saving into a directory that holds a checkpoint: that checkpoint's sharded part (files,
    and its index kept aside) stays until the new state index is committed, which removes it
    (storage.remove_stale); a crash in between leaves it loadable."""
    if local is None:
        return {}
    what = f"saving sharded checkpoint {directory!r}"
    keep: str | None = None
    with agreement(comm, what + " (keeping the checkpoint it replaces)",
                   kind=CheckpointCollectiveError):
        if comm.rank == 0 and os.path.isdir(directory):
            keep = rawio.within(rawio.stall_limit(comm.default_timeout), what,
                                functools.partial(_keep_aside, directory))
    index = write_local(comm, directory, SHARDED_STEM, local, keep=keep)
    return {SAVE_ID: index["save_id"]}


class ShardedLoad:
    """The objects of a load_state that go through rows: the `sharded` Statefuls, and the
    models and optimizers that the checkpoint holds in its sharded part. read() (collective)
    checks and verifies them, changing nothing; load_state then applies them with the rest of
    the load, under its rollback: fill() reads them in place, hand_over() hands them over."""

    def __init__(self, objects: TrainingState, state: CheckpointReader) -> None:
        self.save_id = state.index.metadata.get(SAVE_ID)
        self.directory = state.directory
        # a later save into the directory that did not complete kept this part's index aside
        self.stem = SHARDED_STEM
        if isinstance(self.save_id, str) and os.path.exists(
                index_path(self.directory, kept_stem(self.save_id))):
            self.stem = kept_stem(self.save_id)
        saved: set[str] = set()
        sliced: list[str] = []
        if self.save_id is not None:
            with CheckpointReader(self.directory, self.stem) as reader:
                self._check(reader)
                saved = set(reader.index.components)
                sliced = list(reader.index.sliced)
        self.targets: dict[str, tuple[Any, str]] = {}  # name -> (object, stem)
        for name, obj in [*objects.models.items(), *objects.optimizers.items()]:
            if name in saved:
                self.targets[name] = (obj, SHARDED_STEM)
        for name, obj in objects.sharded.items():
            self.targets[name] = (obj, SHARDED_STEM if name in saved else STATE_STEM)
        # the sharded models' gradients, where the checkpoint holds them (saved
        # mid-accumulation); else left as they are, as without FSDP
        grads = objects.sharded_gradients()
        for name, module in grads.items():
            if name in saved:
                keys = [k.split("/", 1)[1] for k in sliced if k.startswith(f"{name}/")]
                self.targets[name] = (objects.gradient_rows(module, keys), SHARDED_STEM)
        # what the ordinary load takes
        self.rest = TrainingState(
            models={n: m for n, m in objects.models.items() if n not in self.targets},
            optimizers={n: o for n, o in objects.optimizers.items() if n not in self.targets},
            shared=objects.shared, per_rank=objects.per_rank,
            gradients={n: m for n, m in objects.gradients.items()
                       if n not in self.targets and n not in grads},
            optional=objects.optional,
        )
        self.plans: list[Plan] = []
        self.readers: list[CheckpointReader] = []  # open from read() to fill()

    def _check(self, reader: CheckpointReader) -> None:
        if reader.index.save_id != self.save_id:
            raise CheckpointError(
                f"{self.directory!r} holds the sharded part of another save (save id "
                f"{reader.index.save_id!r}, its state index names {self.save_id!r}): a "
                "later save into the same directory was interrupted",
                "load an earlier checkpoint (automatic checkpoint naming saves each into a "
                "directory of its own).",
            )

    def read(self, comm: Comm, what: str, limit: float, strict: bool = True) -> None:
        """Collective, step 1 of the load for these objects, which changes nothing: check every
        target against the checkpoint (check_target: keys both ways, param groups; plan:
        global shapes and dtypes), plan its rows and verify them in the files (those that
        cannot be read in place: read into new memory and verified there); every rank agrees.
        The readers stay open for fill() (close() on the way out of a load that fails)."""
        ok = False
        try:
            with agreement(comm, what + " (matching the sharded state)",
                           kind=CheckpointCollectiveError):
                for stem in (SHARDED_STEM, STATE_STEM):
                    names = [n for n, (_, s) in self.targets.items() if s == stem]
                    if not names:
                        continue
                    opened = self.stem if stem == SHARDED_STEM else stem
                    reader = rawio.within(
                        limit, what, functools.partial(CheckpointReader, self.directory, opened))
                    self.readers.append(reader)
                    if stem == SHARDED_STEM:
                        self._check(reader)
                    target = {n: self.targets[n][0].state_dict() for n in names}
                    for name in names:
                        check_target(reader, name, self.targets[name][0], target[name], strict)
                    self.plans.append(plan(reader, target, in_place_ranks=comm.size))
                    rawio.within(limit, what, functools.partial(read_plan, reader,
                                                                self.plans[-1]))
            ok = True
        finally:
            if not ok:
                self.close()

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.readers.clear()

    def names(self) -> list[str]:
        return list(self.targets)

    def fill(self) -> None:
        """Not collective; once every rank applied everything else of the load: read the rows
        read() verified in the files straight into the targets' tensors (cannot be taken
        back: a load that fails from here on says so). Under the caller's rawio.within."""
        for reader, planned in zip(self.readers, self.plans, strict=True):
            fill_plan(reader, planned)

    def hand_over(self, rollback: Rollback, model_options: dict[str, Any]) -> None:
        """Not collective; after fill() on every rank: copy the rows read into new memory into
        the targets and hand each target its state (load_state_dict), each step's undo added
        to `rollback` first."""
        assign = bool(model_options.get("assign"))
        for planned in self.plans:
            copied = [(item.target, item.target.detach().clone()) for item in planned.items
                      if item.out is not None and isinstance(item.target, torch.Tensor)]
            rollback.add(", ".join(planned.documents), functools.partial(_put_back, copied))
            for name, state in apply(planned).items():
                target = self.targets[name][0]
                rollback.add(name, _undo_step(target, assign))
                load_into(name, target, state, self.directory, model_options)


def check_target(reader: CheckpointReader, name: str, obj: Any, tree: Any, strict: bool) -> None:
    """Refuse the checkpoint's `name` unless `obj` (whose state_dict() is `tree`) takes it as
    it is: a tensor of the checkpoint the target lacks is refused (a model loaded with
    strict=False lets it be; a fresh optimizer takes the state of parameters it has none
    for), and an optimizer's param groups must have its number and sizes. A tensor the
    checkpoint lacks, another global shape: plan() refuses them. Another dtype is converted
    as torch's load_state_dict converts it, as on the HDF5 path. Not collective."""
    document = reader.index.components.get(name)
    where = reader.directory
    if document is None:
        return  # plan() names what the checkpoint holds
    extra = differences(reader, name, tree)
    if isinstance(obj, torch.nn.Module):
        extra = extra if strict else []
    elif isinstance(tree, dict) and "param_groups" in tree:
        check_optimizer(name, tree, document, where)
        live = {str(pid) for pid in tree.get("state", {})}
        fresh = [str(pid) for group in document["param_groups"] for pid in group["params"]
                 if str(pid) not in live]
        extra = [n for n in extra if not any(n.startswith(f"state.{pid}.") for pid in fresh)]
    if extra:
        keys = [f"{name}/{n}" for n in extra]
        raise CheckpointError(
            f"cannot load {name} from {where!r}: the checkpoint holds {len(keys)} tensor(s) "
            f"that the object to load into lacks: {keys[:5]!r}"
            + (" ..." if len(keys) > 5 else ""),
            "load into the model and optimizer that were saved (same configuration), or pass "
            "strict=False to load_state() to leave a model's extra keys out.",
        )


def _put_back(copied: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for target, kept in copied:
            target.copy_(kept)


def _undo_step(target: Any, assign: bool) -> Any:
    """How to give `target` back the state it has now, once a load handed it another."""
    if isinstance(target, torch.nn.Module):
        held = target.state_dict(keep_vars=True)
        return functools.partial(target.load_state_dict, held, strict=False, assign=assign)
    if hasattr(target, "restorer"):  # a sharded model's summed gradients (the strategy's)
        return target.restorer()
    state = target.state_dict()
    if isinstance(state, dict) and isinstance(state.get("state"), dict):  # an optimizer's
        state = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
    else:
        state = copy_of(state)
    return functools.partial(target.load_state_dict, state)
