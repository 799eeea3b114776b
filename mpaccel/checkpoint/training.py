"""The training state a checkpoint holds: TrainingState (what save_state/load_state take:
objects with state_dict()/load_state_dict(), the Stateful protocol of
torch.distributed.checkpoint, by the name of their entry; from_prepared builds it from what an
Accelerator prepared), collecting it for a save, checking and applying a checkpoint's states
to it with a rollback, and each rank's RNG states (entry "rng")."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .. import distributed
from ..comm import Comm
from ..errors import CheckpointError
from .format import view_identity
from .reader import CheckpointReader, Deferred


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def _empty() -> Mapping[str, Any]:
    return {}


def holds_dtensors(module: torch.nn.Module) -> bool:
    """Not collective. `module` holds DTensors (fully sharded: each rank holds its rows)."""
    # No DTensor exists unless torch.distributed.tensor was imported (FSDP), and importing it
    # here would change a gloo teardown race (see mpaccel/strategy/fully_sharded.py's docstring).
    tensors = sys.modules.get("torch.distributed.tensor")
    return tensors is not None and any(
        isinstance(t, tensors.DTensor) for t in itertools.chain(module.parameters(),
                                                                module.buffers())
    )


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
    `summed_gradients(model, keys)`: for a save or load mid-accumulation of a sharded model (a
    `gradients` entry whose model is in `sharded`), the Stateful of the gradients it summed so
    far, as rows (the parallelism strategy's: mpaccel.strategy's summed_gradients); `keys`,
    on a load, the gradients the checkpoint holds.
    """

    models: Mapping[str, torch.nn.Module] = dataclasses.field(default_factory=_empty)
    optimizers: Mapping[str, torch.optim.Optimizer] = dataclasses.field(default_factory=_empty)
    shared: Mapping[str, Stateful] = dataclasses.field(default_factory=_empty)
    per_rank: Mapping[str, Stateful] = dataclasses.field(default_factory=_empty)
    gradients: Mapping[str, torch.nn.Module] = dataclasses.field(default_factory=_empty)
    optional: frozenset[str] = frozenset()
    sharded: Mapping[str, Stateful] = dataclasses.field(default_factory=_empty)
    summed_gradients: Callable[[torch.nn.Module, list[str] | None], Stateful] | None = None

    @classmethod
    def from_prepared(
        cls,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[Any],
        schedulers: Sequence[Stateful],
        loaders: Sequence[Stateful],
        *,
        scaler: Stateful | None = None,
        custom: Sequence[Stateful] = (),
        step: Stateful | None = None,
        gradients: bool = False,
        loading: bool = False,
        sharded_entries: Callable[[Mapping[str, torch.nn.Module], Mapping[str, Any], bool],
                                  Mapping[str, Stateful]] | None = None,
        summed_gradients: Callable[[torch.nn.Module, list[str] | None], Stateful] | None = None,
    ) -> TrainingState:
        """What an Accelerator's save_state/load_state hand the checkpoint, under the names of
        its entries (docs/checkpoint-format.md): the (unwrapped) `models`, `optimizers`,
        `schedulers`, the grad `scaler` (optional on load), the registered `custom` objects,
        `step` (the Accelerator's micro-batch count, entry "accelerator") and the data
        `loaders` (each rank's position); with `gradients`, the models' gradients per rank
        (a save mid-accumulation). Which entries hold each rank's rows is the parallelism
        strategy's to say: `sharded_entries(models, optimizers, loading)` (the strategy's
        `checkpoint_entries`) names them, out of the named models and optimizers, as the
        Statefuls to save (an optimizer over shards as one that, for a load, creates the
        state a fresh optimizer lacks); without it, a model holding DTensors and every
        optimizer are taken as they are."""
        named = {f"model_{i}": module for i, module in enumerate(models)}
        held = {f"optimizer_{i}": opt for i, opt in enumerate(optimizers)}
        shared: dict[str, Stateful] = {f"scheduler_{i}": s for i, s in enumerate(schedulers)}
        if scaler is not None:
            shared["scaler"] = scaler
        shared.update({f"custom_{i}": obj for i, obj in enumerate(custom)})
        if step is not None:
            shared["accelerator"] = step
        if sharded_entries is not None:
            sharded: dict[str, Any] = dict(sharded_entries(named, held, loading))
        else:
            sharded = {n: m for n, m in named.items() if holds_dtensors(m)}
            sharded.update({n: opt for n, opt in held.items()} if sharded else {})
        return cls(
            models={n: m for n, m in named.items() if n not in sharded},
            optimizers={n: o for n, o in held.items() if n not in sharded},
            shared=shared,
            per_rank={f"dataloader_{i}": loader for i, loader in enumerate(loaders)},
            gradients={n.replace("model", "gradients"): m for n, m in named.items()}
            if gradients else {},
            optional=frozenset({"scaler"}),
            sharded=sharded,
            summed_gradients=summed_gradients,
        )

    def sharded_gradients(self) -> dict[str, torch.nn.Module]:
        """The `gradients` entries whose model is one of `sharded` (a fully_shard model): their
        gradients go as rows into the sharded part (gradient_rows()), not per rank."""
        held = {id(obj) for obj in self.sharded.values()}
        return {name: module for name, module in self.gradients.items() if id(module) in held}

    def gradient_rows(self, module: torch.nn.Module, keys: list[str] | None) -> Stateful:
        """Not collective to build. `summed_gradients(module, keys)`: the Stateful of a sharded
        model's gradients summed so far, which the sharded part of the checkpoint holds as
        rows; a CheckpointError when the TrainingState has no `summed_gradients`."""
        if self.summed_gradients is None:
            raise CheckpointError(
                "the gradients of a sharded model need `summed_gradients`, the Stateful its "
                "parallelism strategy makes of them",
                "build the TrainingState with summed_gradients= (Accelerator.save_state does).",
            )
        return self.summed_gradients(module, keys)

    def __post_init__(self) -> None:
        shared = [*self.models, *self.optimizers, *self.shared, *self.sharded]
        per_rank = ["rng", *self.per_rank, *self.gradients]
        twice = sorted({n for names in (shared, per_rank) for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"TrainingState: two objects under each of the entry names {twice} (the shared "
                "entries, and each rank's, need names of their own; 'rng' is the RNG states')"
            )


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


MODEL_LOAD_OPTIONS = ("strict", "assign")  # what torch's Module.load_state_dict takes


def model_load_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """`options` for the models' load_state_dict, refused (TypeError, as for an unexpected
    keyword) unless each is one of MODEL_LOAD_OPTIONS."""
    given = dict(options or {})
    unknown = sorted(set(given) - set(MODEL_LOAD_OPTIONS))
    if unknown:
        raise TypeError(
            f"load_state() got unexpected keyword argument(s) {unknown}: the keywords it passes "
            f"on to the models' load_state_dict are {list(MODEL_LOAD_OPTIONS)}"
        )
    return given


def model_state(comm: Comm, module: torch.nn.Module) -> dict[str, Any]:
    """Collective (at size N). The (unwrapped) module's state_dict, with its buffers as rank 0
    has them. DDP keeps parameters equal across ranks, but buffers (BatchNorm's running
    statistics) only at the start of each forward, when it broadcasts rank 0's; after a forward
    every rank holds its own batch's. The checkpoint takes rank 0's, as DDP's next forward
    would: copies, broadcast in one message; the model itself is left alone."""
    state = module.state_dict()
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
    # collective's device: the buffers' own (a prepared model's are on the GPU under NCCL).
    raw = [
        state[names[0]].detach().resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)
        for names in tied
    ]
    if raw:
        wire = torch.cat([part.to(raw[0].device) for part in raw])
        distributed.broadcast(wire, 0)
        for names, part in zip(tied, wire.split([part.numel() for part in raw])):
            live = state[names[0]]
            # a copy: a slice of `wire` may start at an offset the dtype's alignment forbids
            copy = part.to(live.device, copy=True).view(live.dtype).view(live.shape)
            for name in names:
                state[name] = copy
    return state


def collect(comm: Comm, objects: TrainingState) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, per_rank) state trees of `objects`. Collective (model_state)."""
    shared: dict[str, Any] = {
        name: model_state(comm, module) for name, module in objects.models.items()
    }
    for name, obj in [*objects.optimizers.items(), *objects.shared.items()]:
        shared[name] = obj.state_dict()
    per_rank: dict[str, Any] = {RNG: rng_state()}
    for name, obj in objects.per_rank.items():
        per_rank[name] = obj.state_dict()
    # Saved mid-accumulation: the gradients summed so far are part of the state (and, under
    # DDP's no_sync, differ from rank to rank).
    rows = objects.sharded_gradients()  # a fully sharded model's: rows of the sharded part
    for name, module in objects.gradients.items():
        if name in rows:
            continue
        per_rank[name] = {
            key: p.grad for key, p in module.named_parameters() if p.grad is not None
        }
    return shared, per_rank


def load_into(
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
    its load_state_dict takes (check_optimizer)."""
    live = opt.state_dict()
    check_optimizer(name, live, document, directory)
    return live


def check_optimizer(name: str, live: Any, document: Any, directory: str) -> None:
    """Refuse the checkpoint's optimizer state `document` unless the optimizer whose
    state_dict() is `live` takes it: param groups of the same number and sizes (what torch
    refuses, refused before anything of the load is applied). Not collective."""
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
    before: dict[str, Any]  # the other Statefuls: their state_dict() before the load
    rng: dict[str, Any] | None  # checked_rng_state(), or None (another world size)
    notes: list[str]  # warnings for the main process


def copy_of(state: Any) -> Any:
    """A state_dict() to give back on failure, safe from a load_state_dict that changes the
    dicts and lists it was given (as is) in place."""
    try:
        return copy.deepcopy(state)
    except Exception:  # not deep-copyable: as it is
        return state


def read_back(
    objects: TrainingState, reader: CheckpointReader, rank: int, world: int, strict: bool = True
) -> Loaded:
    """Phase 1 of a load, which changes nothing: read every state tree this rank needs and
    verify it, and check every part that can be checked without handing it over (RNG states,
    the models' keys and shapes, the optimizers' layout). Tensors of the models and
    optimizers that can take the bytes as they are (same dtype and shape) are not written yet:
    their bytes are only verified in the files, and apply_tensors() reads them in once every
    rank agreed. Reading goes on past a failed check; the first error is raised at the end."""
    directory = reader.directory
    documents = reader.index.components
    required = [*objects.models, *objects.optimizers]
    required += [name for name in objects.shared if name not in objects.optional]
    missing = [c for c in required if c not in documents]
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
        (name, module.state_dict()) for name, module in objects.models.items()
    ]
    shared += [
        (name, _optimizer_target(name, opt, documents[name], directory))
        for name, opt in objects.optimizers.items()
    ]
    shared += [(name, None) for name in objects.shared if name in documents]
    held = Deferred()
    # one pass over the files, not one per component
    read(lambda: reader.read_components(shared, defer=held))
    for name, live in shared:
        if name in objects.models and name in trees and not first:
            # What load_state_dict(strict=True) would refuse, refused here, before any rank
            # applies anything (a rank whose model differs must not be the only one left
            # without the checkpoint's RNG states, step, scheduler...)
            _check_model(name, live, trees[name], directory, strict)
    same_world = reader.world_size == world
    source = rank if same_world else 0
    # at another world size: rank 0's per-rank Statefuls only (no RNG states, no gradients)
    wanted = {*objects.per_rank, *([RNG, *objects.gradients] if same_world else [])}
    per_rank = [c for c in reader.index.per_rank[source].components if c in wanted]
    read(lambda: {f"rank:{c}": reader.rank_component(source, c) for c in per_rank})
    if first:
        raise first[0]
    return _check(objects, reader, trees, dict(shared), held, world)


def _check(
    objects: TrainingState,
    reader: CheckpointReader,
    trees: dict[str, Any],
    live: dict[str, Any],
    held: Deferred,
    world: int,
) -> Loaded:
    """The RNG states of phase 1, checked; and copies of the states of the objects that
    apply_states() hands theirs to, to give back on failure."""
    directory = reader.directory
    before = {
        name: copy_of(obj.state_dict()) for name, obj in objects.shared.items() if name in trees
    }
    before.update({
        f"rank:{name}": copy_of(obj.state_dict())
        for name, obj in objects.per_rank.items()
        if f"rank:{name}" in trees
    })
    notes = []
    rng = None
    if reader.world_size == world:
        rng = checked_rng_state(trees.get(f"rank:{RNG}"), directory)
    else:
        if any(c in objects.gradients for c in reader.index.per_rank[0].components):
            notes.append(
                f"{directory!r} was saved mid-accumulation; the partial gradients of "
                "each process cannot be mapped to another world size and were dropped"
            )
        notes.append(
            f"checkpoint {directory!r} was written by {reader.world_size} processes and is "
            f"loaded by {world}: model, optimizer, scheduler and custom "
            "states were restored; per-process RNG states were not (each process keeps its own)"
        )
    return Loaded(trees, live, held, before, rng, notes)


def apply_states(
    objects: TrainingState, loaded: Loaded, reader: CheckpointReader, rollback: Rollback
) -> None:
    """Phase 2 of a load, once every rank read and checked everything: the states that the
    objects' own code takes (the shared and per-rank Statefuls: their load_state_dict may
    refuse one), and the partial gradients; each one's undo step added to `rollback` first.
    The tensors of the models and optimizers are untouched so far."""
    directory, trees = reader.directory, loaded.trees
    handed = [(name, name, obj) for name, obj in objects.shared.items()]
    handed += [(name, f"rank:{name}", obj) for name, obj in objects.per_rank.items()]
    for name, key, obj in handed:
        if key in trees:
            rollback.add(name, functools.partial(obj.load_state_dict, loaded.before[key]))
            load_into(name, obj, trees[key], directory)
    if loaded.rng is not None:  # at the same world size: this rank's partial gradients
        for entry, module in objects.gradients.items():
            grads = trees.get(f"rank:{entry}", {})
            for name, p in module.named_parameters():
                if name in grads:
                    rollback.add(entry, functools.partial(setattr, p, "grad", p.grad))
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
    objects: TrainingState,
    loaded: Loaded,
    reader: CheckpointReader,
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
    for name, module in objects.models.items():
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
    for name, module, live, tree, kept, held in models:

        def undo_model(module: Any = module, live: Any = live, kept: Any = kept,
                       held: Any = held) -> None:
            with torch.no_grad():
                for key, value in kept.items():
                    live[key].copy_(value)
            # assign=True replaced the objects: they come back
            module.load_state_dict(held, strict=False, assign=bool(options.get("assign")))

        rollback.add(name, undo_model)
        load_into(name, module, tree, directory, options)
    for name, opt in objects.optimizers.items():
        state = opt.state_dict()  # its state tensors themselves, in new dicts
        state["state"] = {k: dict(v) for k, v in state["state"].items()}
        rollback.add(name, functools.partial(opt.load_state_dict, state))
        load_into(name, opt, trees[name], directory)


def finish(loaded: Loaded) -> None:
    """Phase 4, once every rank applied phase 3: the RNG states phase 1 checked, set. Nothing
    here can fail, so nothing needs taking back."""
    if loaded.rng is not None:
        set_rng_state(loaded.rng)
