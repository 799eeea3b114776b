"""What save_state/load_state put in a checkpoint, and how it comes back.

Shared (identical on every rank, written once, sharded across ranks): prepared models (unwrapped),
optimizers, schedulers, the fp16 grad scaler, registered custom objects, the accumulation step.
Per rank: RNG states (python, numpy, torch, CUDA) and dataloader positions.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import distributed
from .format import CheckpointError, view_identity
from .reader import Deferred

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


def dataloader_position(shard: Any) -> dict[str, Any]:
    # A pass whose last batch is out has only to return: saved as over, so that the resumed
    # run moves on to the next epoch (not an empty pass, nor the same epoch again), unless the
    # script asks for that same epoch again with set_epoch (its epoch counter was saved too):
    # then the pass is empty ("epoch_seen"). Every loader whose pass is under way counts (two
    # loaders zipped, an auxiliary one advanced with next()), not only the latest started.
    running = shard in shard.gradient_state.__dict__.get("dataloader_references", ())
    mid_epoch = running and not shard.end_of_dataloader
    return {
        "iteration": shard.iteration,
        "started": shard._started,
        "mid_epoch": mid_epoch,
        "epoch_seen": running and shard.end_of_dataloader,
        "batches_yielded": shard.batches_yielded if mid_epoch else 0,
        "total_batch_size": shard.total_batch_size,
    }


_REQUIRED = object()


def _field(position: dict, key: str, kind: str, default: Any = _REQUIRED) -> Any:
    """position[key], checked: kind "flag" (a bool), "count" (an int >= 0) or "count or None"."""
    value = position.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"it has no {key!r}")
    if kind == "flag":
        ok = isinstance(value, bool)
    else:
        ok = (value is None and kind == "count or None") or (type(value) is int and value >= 0)
    if not ok:
        raise ValueError(f"{key}={value!r} is not a {kind}")
    return value


def plan_dataloader(
    shard: Any, position: Any, saved_world: int, world: int, name: str
) -> tuple[dict[str, Any], str | None]:
    """What restore_dataloader() sets to resume `shard` at the saved `position` (of component
    `name`), every field checked first, and a warning to give once the load is done (or None)."""
    try:
        if not isinstance(position, dict):
            raise ValueError(f"it is a {type(position).__name__}, not a dict")
        iteration = _field(position, "iteration", "count")
        # Checkpoints without "started" saved the next pass's epoch.
        started = _field(position, "started", "flag", False)
        mid_epoch = _field(position, "mid_epoch", "flag")
        epoch_seen = _field(position, "epoch_seen", "flag", False)
        batches = _field(position, "batches_yielded", "count") if mid_epoch else 0
        saved_total = _field(position, "total_batch_size", "count or None", None)
    except ValueError as exc:
        raise CheckpointError(
            f"the position of {name} cannot be taken: {exc}",
            "the checkpoint is damaged or was not written by mpaccel; load another one.",
        ) from exc
    # Between passes the next one moves on from the saved epoch; mid-epoch it replays the saved
    # epoch (minus what was seen). Each pass gives its epoch to the sampler (the sampler's own
    # epoch, which older checkpoints hold too, is not needed).
    plan = {
        "iteration": iteration,
        "started": started and not mid_epoch,
        "epoch_seen": iteration if epoch_seen else None,
        "skip": batches if mid_epoch else None,
    }
    if not mid_epoch or saved_world == world:
        return plan, None
    total = shard.total_batch_size
    if saved_total is None or total is None:  # batches of no fixed size: count batches
        consumed, unit, what = batches * saved_world, world, "batches"
    else:
        consumed, unit, what = batches * saved_total, total, "samples"
    plan["skip"], rest = divmod(consumed, unit)
    warning = None
    if rest:
        warning = (
            f"resuming at another world size: {consumed} {what} were consumed, not a whole "
            f"number of the new global batch ({unit} {what}); "
            f"{rest} {what} of the epoch will be seen twice"
        )
    return plan, warning


def restore_dataloader(shard: Any, plan: dict[str, Any]) -> None:
    """Set what plan_dataloader() worked out (plain assignments: this cannot fail)."""
    shard.iteration = plan["iteration"]
    shard._started = plan["started"]
    shard._epoch_seen = plan["epoch_seen"]
    if plan["skip"] is not None:
        shard._resume_at(plan["skip"])


def model_state(accelerator: Any, model: Any, comm: Any = None) -> dict[str, Any]:
    """Collective (at size N). The unwrapped model's state_dict, with its buffers as rank 0 has
    them. DDP keeps parameters equal across ranks, but buffers (BatchNorm's running statistics)
    only at the start of each forward, when it broadcasts rank 0's; after a forward every rank
    holds its own batch's. The checkpoint takes rank 0's, as DDP's next forward would: copies,
    broadcast in one message; the model itself is left alone."""
    module = accelerator.unwrap_model(model)
    state = module.state_dict()
    comm = accelerator._partial.comm if comm is None else comm  # a NullComm: one rank saving
    if comm.size == 1:
        return state
    # Every name of every buffer (named_buffers() gives a buffer once, under its first name: a
    # module reused under two names would keep this rank's values under the second), grouped
    # by the memory they view, so that each is sent once and its names stay tied (stored once).
    groups: dict[Any, list[str]] = {}
    for name, _ in module.named_buffers(remove_duplicate=False):
        if name in state:
            groups.setdefault(view_identity(state[name]) or name, []).append(name)
    tied = list(groups.values())
    layout = [(names, str(state[names[0]].dtype), tuple(state[names[0]].shape)) for names in tied]
    if len(set(map(repr, comm.allgather(layout, what="saving a model (its buffers)")))) > 1:
        return state  # ranks differ: the checkpoint's layout check names how, on every rank
    # As raw bytes, in one message (gloo and NCCL lack bool, float8 and other dtypes), on the
    # collective's device (NCCL: the GPU).
    raw = [
        state[names[0]].detach().resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)
        for names in tied
    ]
    if raw:
        wire = torch.cat([part.to(accelerator.device) for part in raw])
        distributed.broadcast(wire, 0)
        for names, part in zip(tied, wire.split([part.numel() for part in raw])):
            live = state[names[0]]
            # a copy: a slice of `wire` may start at an offset the dtype's alignment forbids
            copy = part.to(live.device, copy=True).view(live.dtype).view(live.shape)
            for name in names:
                state[name] = copy
    return state


def collect(accelerator: Any, comm: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, per_rank) state trees of everything the accelerator prepared or registered.
    Collective over `comm` (model_state; the accelerator's by default)."""
    shared: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        shared[f"model_{i}"] = model_state(accelerator, model, comm)
    for i, opt in enumerate(accelerator._optimizers):
        shared[f"optimizer_{i}"] = opt.state_dict()
    for i, sched in enumerate(accelerator._schedulers):
        shared[f"scheduler_{i}"] = sched.state_dict()
    if accelerator.scaler is not None:
        shared["scaler"] = accelerator.scaler.state_dict()
    for i, obj in enumerate(accelerator._custom_objects):
        shared[f"custom_{i}"] = obj.state_dict()
    shared["accelerator"] = {"step": accelerator.step}
    per_rank: dict[str, Any] = {RNG: rng_state()}
    for i, shard in enumerate(accelerator._dataloaders):
        per_rank[f"dataloader_{i}"] = dataloader_position(shard)
    if not accelerator.sync_gradients:
        # Saved mid-accumulation: the gradients summed so far are part of the state (and, under
        # DDP's no_sync, differ from rank to rank).
        for i, model in enumerate(accelerator._models):
            per_rank[f"gradients_{i}"] = {
                name: p.grad for name, p in accelerator.unwrap_model(model).named_parameters()
                if p.grad is not None
            }
    return shared, per_rank


def _load_into(
    name: str, target: Any, state: Any, directory: str, options: dict[str, Any] | None = None
) -> None:
    """target.load_state_dict(state); `options` (strict=, assign=) for models."""
    try:
        if isinstance(target, torch.nn.Module):
            target.load_state_dict(state, **{"strict": True, **(options or {})})
        else:
            target.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"cannot load {name} from {directory!r}: {exc}",
            "the checkpoint was written for other objects (another model or optimizer layout, "
            "or prepare() called in another order).",
        ) from exc


def _check_model(
    name: str, live: dict[str, Any], saved: dict[str, Any], directory: str, strict: bool = True
) -> None:
    # strict=False lets keys be missing on either side, as torch's load_state_dict does; other
    # shapes are refused either way.
    missing = [k for k in live if k not in saved] if strict else []
    unexpected = [k for k in saved if k not in live] if strict else []
    shapes = [
        f"{k}: {list(saved[k].shape)} in the checkpoint, {list(live[k].shape)} here"
        for k in live
        if k in saved
        and isinstance(live[k], torch.Tensor)
        and isinstance(saved[k], torch.Tensor)
        and saved[k].shape != live[k].shape
    ]
    problems = [f"missing keys {missing}"] if missing else []
    problems += [f"unexpected keys {unexpected}"] if unexpected else []
    problems += [f"other shapes: {'; '.join(shapes)}"] if shapes else []
    if problems:
        raise CheckpointError(
            f"cannot load {name} from {directory!r}: " + ", ".join(problems),
            "the checkpoint was written for another model (or prepare() was called in another "
            "order).",
        )


def _optimizer_target(name: str, opt: Any, document: Any, directory: str) -> Any:
    """The optimizer's live state_dict to read into, once the checkpoint's is checked to be one
    its load_state_dict takes: param groups of the same number and sizes (what torch refuses,
    refused here, before anything of the load is applied)."""
    live = opt.state_dict()
    saved = document.get("param_groups") if isinstance(document, dict) else None
    if (
        not isinstance(saved, list)
        or not isinstance(document.get("state"), dict)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved)
    ):
        raise CheckpointError(
            f"cannot load {name} from {directory!r}: it is not an optimizer's state_dict",
            "the checkpoint is damaged or was not written by mpaccel; load another one.",
        )
    sizes = [len(g["params"]) for g in saved]
    here = [len(g["params"]) for g in live["param_groups"]]
    if sizes != here:
        raise CheckpointError(
            f"cannot load {name} from {directory!r}: its parameter groups hold {sizes} "
            f"parameters, the optimizer's hold {here}",
            "the checkpoint was written for another optimizer layout (or prepare() was called "
            "in another order).",
        )
    return live


class Rollback:
    """How to take back what a load applied: one undo step per object it handed a state to,
    run last first."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], Any]]] = []

    def add(self, name: str, undo: Callable[[], Any]) -> None:
        self._steps.append((name, undo))

    def run(self) -> list[str]:
        """Undo everything; returns what could not be undone (an object whose load_state_dict
        refuses its own earlier state), as "name (error)"."""
        problems = []
        for name, undo in reversed(self._steps):
            try:
                undo()
            except Exception as exc:
                problems.append(f"{name} ({type(exc).__name__}: {exc})")
        self._steps = []
        return problems


@dataclasses.dataclass
class Loaded:
    """Phase 1 of a load: every tree this rank needs, read, verified and checked."""

    trees: dict[str, Any]
    live: dict[str, Any]  # model_i: the live state_dict its tree takes tensors from
    held: Deferred  # the tensors read in place by apply_tensors (reader.fill)
    before: dict[str, Any]  # scheduler_i, scaler, custom_i: their state_dict() before the load
    rng: dict[str, Any] | None  # checked_rng_state(), or None (another world size)
    loaders: list[tuple[Any, dict[str, Any]]]  # (shard, plan_dataloader())
    step: int
    notes: list[str]  # warnings for the main process
    warnings: list[str]  # warnings for this process


def _copy_of(state: Any) -> Any:
    """A state_dict() to give back on failure, safe from a load_state_dict that changes the
    dicts and lists it was given (as is) in place."""
    try:
        return copy.deepcopy(state)
    except Exception:  # not deep-copyable: as it is
        return state


def read_back(accelerator: Any, reader: Any, rank: int, strict: bool = True) -> Loaded:
    """Phase 1 of a load, which changes nothing: read every state tree this rank needs and
    verify it, and check every part that is not a tensor (RNG states, loader positions, step,
    the optimizers' layout). Tensors of the models and optimizers that can take the bytes as
    they are (same dtype and shape) are not written yet: their bytes are only verified in the
    files, and apply_tensors() reads them in once every rank agreed. Reading goes on past a
    failed check; the first error is raised at the end."""
    directory = reader.directory
    others = [f"scheduler_{i}" for i in range(len(accelerator._schedulers))]
    others += [f"custom_{i}" for i in range(len(accelerator._custom_objects))]
    expected = (
        [f"model_{i}" for i in range(len(accelerator._models))]
        + [f"optimizer_{i}" for i in range(len(accelerator._optimizers))]
        + others
    )
    documents = reader.index["components"]
    missing = [c for c in expected if c not in documents]
    if missing:
        raise CheckpointError(
            f"{directory!r} has no {missing} (it holds {reader.components()})",
            "prepare()/register_for_checkpointing() the same objects as when it was saved.",
        )
    trees: dict[str, Any] = {}
    first: list[CheckpointError] = []

    def read(load: Callable[[], dict[str, Any]]) -> None:
        try:
            trees.update(load())
        except CheckpointError as exc:
            first.append(exc)

    shared: list[tuple[str, Any]] = [
        (f"model_{i}", accelerator.unwrap_model(model).state_dict())
        for i, model in enumerate(accelerator._models)
    ]
    shared += [
        (f"optimizer_{i}", _optimizer_target(f"optimizer_{i}", opt, documents[f"optimizer_{i}"],
                                             directory))
        for i, opt in enumerate(accelerator._optimizers)
    ]
    shared += [(c, None) for c in [*others, "scaler", "accelerator"] if c in documents]
    held = Deferred()
    # one pass over the files, not one per component
    read(lambda: reader.read_components(shared, defer=held))
    for name, live in shared:
        if name.startswith("model_") and name in trees and not first:
            # What load_state_dict(strict=True) would refuse, refused here, before any rank
            # applies anything (a rank whose model differs must not be the only one left
            # without the checkpoint's RNG states, step, scheduler...)
            _check_model(name, live, trees[name], directory, strict)
    same_world = reader.world_size == accelerator.num_processes
    source = rank if same_world else 0
    per_rank = [  # at another world size: rank 0's dataloader positions only
        c
        for c in reader.index["per_rank"][source]["components"]
        if same_world or c.startswith("dataloader_")
    ]
    read(lambda: {f"rank:{c}": reader.rank_component(source, c) for c in per_rank})
    if first:
        raise first[0]
    return _check(accelerator, reader, trees, dict(shared), held, same_world)


def _check(
    accelerator: Any,
    reader: Any,
    trees: dict[str, Any],
    live: dict[str, Any],
    held: Deferred,
    same_world: bool,
) -> Loaded:
    """The parts of phase 1 that are not tensors, checked; and copies of the states of the
    objects that apply_states() hands theirs to, to give back on failure."""
    directory = reader.directory
    step = trees["accelerator"].get("step") if isinstance(trees["accelerator"], dict) else None
    if type(step) is not int or step < 0:
        raise CheckpointError(
            f"{directory!r} holds the step {step!r}, not a count",
            "the checkpoint is damaged or was not written by mpaccel; load another one.",
        )
    before = {
        f"scheduler_{i}": _copy_of(s.state_dict()) for i, s in enumerate(accelerator._schedulers)
    }
    before.update(
        {f"custom_{i}": _copy_of(o.state_dict()) for i, o in enumerate(accelerator._custom_objects)}
    )
    if accelerator.scaler is not None and "scaler" in trees:
        before["scaler"] = _copy_of(accelerator.scaler.state_dict())
    loaders, warned = [], []
    for i, shard in enumerate(accelerator._dataloaders):
        if f"rank:dataloader_{i}" in trees:
            plan, warning = plan_dataloader(
                shard, trees[f"rank:dataloader_{i}"], reader.world_size,
                accelerator.num_processes, f"dataloader_{i} in {directory!r}",
            )
            loaders.append((shard, plan))
            warned += [warning] if warning else []
    notes = []
    rng = None
    if same_world:
        rng = checked_rng_state(trees[f"rank:{RNG}"], directory)
    else:
        if any(k.startswith("gradients_") for k in reader.index["per_rank"][0]["components"]):
            notes.append(
                f"{directory!r} was saved mid-accumulation; the partial gradients of "
                "each process cannot be mapped to another world size and were dropped"
            )
        notes.append(
            f"checkpoint {directory!r} was written by {reader.world_size} processes and is "
            f"loaded by {accelerator.num_processes}: model, optimizer, scheduler and custom "
            "states were restored; per-process RNG states were not (each process keeps its own)"
        )
    return Loaded(trees, live, held, before, rng, loaders, step, notes, warned)


def apply_states(accelerator: Any, loaded: Loaded, reader: Any, rollback: Rollback) -> None:
    """Phase 2 of a load, once every rank read and checked everything: the states that the
    objects' own code takes (schedulers, scaler, registered objects: their load_state_dict may
    refuse one), and the partial gradients; each one's undo step added to `rollback` first.
    The tensors of the models and optimizers are untouched so far."""
    directory, trees = reader.directory, loaded.trees
    objects = [(f"scheduler_{i}", s) for i, s in enumerate(accelerator._schedulers)]
    if accelerator.scaler is not None and "scaler" in trees:
        objects.append(("scaler", accelerator.scaler))
    objects += [(f"custom_{i}", o) for i, o in enumerate(accelerator._custom_objects)]
    for name, obj in objects:
        rollback.add(name, functools.partial(obj.load_state_dict, loaded.before[name]))
        _load_into(name, obj, trees[name], directory)
    if loaded.rng is not None:  # at the same world size: this rank's partial gradients
        for i, model in enumerate(accelerator._models):
            grads = trees.get(f"rank:gradients_{i}", {})
            for name, p in accelerator.unwrap_model(model).named_parameters():
                if name in grads:
                    rollback.add(f"gradients_{i}", functools.partial(setattr, p, "grad", p.grad))
                    p.grad = grads[name].to(p.device)


def _same_memory(a: Any, b: torch.Tensor) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.data_ptr() == b.data_ptr()
    )


def apply_tensors(
    accelerator: Any,
    loaded: Loaded,
    reader: Any,
    rollback: Rollback,
    fill: Callable[[], Any],
    model_options: dict[str, Any] | None = None,
) -> None:
    """Phase 3 of a load, once every rank applied phase 2: fill() reads the tensors held back
    in phase 1 into the models and optimizers, in place (reader.fill: checked again on the
    way, a file changed since phase 1 is an error), then the models' and optimizers'
    load_state_dict run (their keys, shapes and layout were checked in phase 1). Only what was
    not read in place can be taken back from here on (rollback)."""
    directory, trees = reader.directory, loaded.trees
    options = model_options or {}
    models = []
    for i, model in enumerate(accelerator._models):
        name, module = f"model_{i}", accelerator.unwrap_model(model)
        live, tree = loaded.live[name], trees[name]
        # load_state_dict copies into what was not read in place: those bytes, as they are
        kept = {
            key: value.detach().to("cpu", copy=True)
            for key, value in live.items()
            if isinstance(value, torch.Tensor)
            and key in tree
            and not _same_memory(tree[key], value)
        }
        models.append((name, module, live, tree, kept, module.state_dict(keep_vars=True)))
    fill()
    for name, module, live, tree, kept, objects in models:

        def undo_model(module: Any = module, live: Any = live, kept: Any = kept,
                       objects: Any = objects) -> None:
            with torch.no_grad():
                for key, value in kept.items():
                    live[key].copy_(value)
            # assign=True replaced the objects: they come back
            module.load_state_dict(objects, strict=False, assign=bool(options.get("assign")))

        rollback.add(name, undo_model)
        _load_into(name, module, tree, directory, options)
    for i, opt in enumerate(accelerator._optimizers):
        state = opt.state_dict()  # its state tensors themselves, in new dicts
        state["state"] = {k: dict(v) for k, v in state["state"].items()}
        rollback.add(f"optimizer_{i}", functools.partial(opt.load_state_dict, state))
        _load_into(f"optimizer_{i}", opt, trees[f"optimizer_{i}"], directory)


def finish(accelerator: Any, loaded: Loaded) -> None:
    """Phase 4, once every rank applied phase 3: what phase 1 checked and worked out, assigned
    (loader positions, RNG states, step). Nothing here can fail, so nothing needs taking back."""
    for shard, plan in loaded.loaders:
        restore_dataloader(shard, plan)
    if loaded.rng is not None:
        set_rng_state(loaded.rng)
    accelerator.step = loaded.step
