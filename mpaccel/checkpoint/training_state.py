"""What save_state/load_state put in a checkpoint, and how it comes back.

Shared (identical on every rank, written once, sharded across ranks): prepared models (unwrapped),
optimizers, schedulers, the fp16 grad scaler, registered custom objects, the accumulation step.
Per rank: RNG states (python, numpy, torch, CUDA) and dataloader positions.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import distributed
from .format import CheckpointError, view_identity

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


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    for i, cuda_state in enumerate(state.get("cuda", [])):
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


def restore_dataloader(shard: Any, position: dict[str, Any], saved_world: int, world: int) -> None:
    shard.iteration = position["iteration"]
    # Between passes the next one moves on from the saved epoch; mid-epoch it replays the saved
    # epoch (minus what was seen). Each pass gives its epoch to the sampler (the sampler's own
    # epoch, which older checkpoints hold too, is not needed). Checkpoints without "started"
    # saved the next pass's epoch.
    shard._started = bool(position.get("started", False)) and not position["mid_epoch"]
    shard._epoch_seen = shard.iteration if position.get("epoch_seen") else None
    if not position["mid_epoch"]:
        return
    batches = position["batches_yielded"]
    if saved_world != world:
        saved_total, total = position["total_batch_size"], shard.total_batch_size
        if saved_total is None or total is None:  # batches of no fixed size: count batches
            consumed, unit, what = batches * saved_world, world, "batches"
        else:
            consumed, unit, what = batches * saved_total, total, "samples"
        batches, rest = divmod(consumed, unit)
        if rest:
            warnings.warn(
                f"resuming at another world size: {consumed} {what} were consumed, not a whole "
                f"number of the new global batch ({unit} {what}); "
                f"{rest} {what} of the epoch will be seen twice",
                RuntimeWarning,
                stacklevel=3,
            )
    shard._resume_at(batches)


def model_state(accelerator: Any, model: Any) -> dict[str, Any]:
    """Collective (at size N). The unwrapped model's state_dict, with its buffers as rank 0 has
    them. DDP keeps parameters equal across ranks, but buffers (BatchNorm's running statistics)
    only at the start of each forward, when it broadcasts rank 0's; after a forward every rank
    holds its own batch's. The checkpoint takes rank 0's, as DDP's next forward would: copies,
    broadcast in one message; the model itself is left alone."""
    module = accelerator.unwrap_model(model)
    state = module.state_dict()
    if accelerator.num_processes == 1:
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
    comm = accelerator._partial.comm
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


def collect(accelerator: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, per_rank) state trees of everything the accelerator prepared or registered.
    Collective (model_state)."""
    shared: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        shared[f"model_{i}"] = model_state(accelerator, model)
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


def _optimizer_target(opt: Any, document: Any) -> Any:
    """The optimizer's live state_dict to read into, if the checkpoint's param groups have the
    same sizes (else None: torch then refuses the state before anything was overwritten)."""
    live = opt.state_dict()
    saved = document.get("param_groups") if isinstance(document, dict) else None
    if not isinstance(saved, list) or [len(g.get("params", [])) for g in saved] != [
        len(g["params"]) for g in live["param_groups"]
    ]:
        return None
    return live


def read_back(
    accelerator: Any, reader: Any, rank: int, model_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Phase 1 of a load: read (and verify) every state tree this rank needs. Tensors of the
    models and optimizers are filled in place where dtype and shape match. Reading goes on past
    a failed check, so every rank ends with the same bytes in those tensors; the first error is
    raised at the end, before anything else changed (see apply())."""
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
        (f"optimizer_{i}", _optimizer_target(opt, documents[f"optimizer_{i}"]))
        for i, opt in enumerate(accelerator._optimizers)
    ]
    shared += [(c, None) for c in [*others, "scaler", "accelerator"] if c in documents]
    read(lambda: reader.read_components(shared))  # one pass over the files, not one per component
    strict = bool((model_options or {}).get("strict", True))
    for name, live in shared:
        if name.startswith("model_") and name in trees and not first:
            # What load_state_dict(strict=True) would refuse in phase 2, refused here, before
            # any rank applies anything (a rank whose model differs must not be the only one
            # left without the checkpoint's RNG states, step, scheduler...)
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
    return trees


def apply(
    accelerator: Any,
    trees: dict[str, Any],
    reader: Any,
    model_options: dict[str, Any] | None = None,
) -> list[str]:
    """Phase 2 of a load, once every rank read everything: hand the trees to the objects.
    `model_options`: for the models' load_state_dict (strict=, assign=).
    Returns warnings (e.g. RNG states skipped at another world size)."""
    notes: list[str] = []
    directory = reader.directory
    for i, model in enumerate(accelerator._models):
        module, tree = accelerator.unwrap_model(model), trees[f"model_{i}"]
        _load_into(f"model_{i}", module, tree, directory, model_options)
    for i, opt in enumerate(accelerator._optimizers):
        _load_into(f"optimizer_{i}", opt, trees[f"optimizer_{i}"], directory)
    for i, sched in enumerate(accelerator._schedulers):
        _load_into(f"scheduler_{i}", sched, trees[f"scheduler_{i}"], directory)
    if accelerator.scaler is not None and "scaler" in trees:
        accelerator.scaler.load_state_dict(trees["scaler"])
    for i, obj in enumerate(accelerator._custom_objects):
        _load_into(f"custom_{i}", obj, trees[f"custom_{i}"], directory)
    accelerator.step = int(trees["accelerator"]["step"])
    same_world = reader.world_size == accelerator.num_processes
    for i, shard in enumerate(accelerator._dataloaders):
        if f"rank:dataloader_{i}" in trees:
            restore_dataloader(
                shard, trees[f"rank:dataloader_{i}"], reader.world_size, accelerator.num_processes
            )
    if same_world:
        for i, model in enumerate(accelerator._models):
            grads = trees.get(f"rank:gradients_{i}", {})
            for name, p in accelerator.unwrap_model(model).named_parameters():
                if name in grads:
                    p.grad = grads[name].to(p.device)
        set_rng_state(trees[f"rank:{RNG}"])
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
    return notes
