"""load_state() on a directory that Accelerate's save_state wrote, all or nothing on every rank.

Accelerate's layout: `model.safetensors` (or `pytorch_model.bin`), `model_1.safetensors` ...
for more models, `optimizer.bin`, `scheduler.bin`, `scaler.pt`, `sampler.bin`,
`dl_state_dict.bin`, `custom_checkpoint_<i>.pkl` and `random_states_<rank>.pkl`. Everything but
the safetensors files is a pickle, which can run code when it is read: mpaccel reads them only
when the caller says so (`load_state(dir, allow_pickle=True)` or MPACCEL_ALLOW_PICKLE=1), and
otherwise refuses, naming the files, before anything is changed. Safetensors model weights load
either way. Accelerate's saver leaves out the second name of a tied tensor (GPT-2's
`lm_head.weight`): the live model says which names are one tensor, so those are not missing.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .. import envvars
from ..comm import Comm, agreement
from ..errors import CheckpointCollectiveError, CheckpointError, MpaccelRuntimeWarning
from . import rawio
from .files import descriptor_path, open_directory, open_regular
from .training import (
    Rollback,
    TrainingState,
    checked_rng_state,
    load_into,
    model_load_options,
    set_rng_state,
)

_MARKERS = ("model.safetensors", "pytorch_model.bin", "optimizer.bin", "random_states_0.pkl")
_RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
_CONVERT = (
    "to read its pickles pass load_state(dir, allow_pickle=True) (or set "
    "MPACCEL_ALLOW_PICKLE=1) for a directory you trust; then accelerator.save_state(new_dir) "
    "converts it to mpaccel's pickle-free format."
)
_OTHER_MODEL = (
    "the checkpoint was written for another model (or prepare() was called in another order); "
    "names the model ties to another (tied weights, which Accelerate saves once) are not "
    "missing."
)
_DAMAGED = "the file is damaged, truncated or not Accelerate's; load another checkpoint."


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
    comm: Comm,
    objects: TrainingState,
    directory: str,
    *,
    allow_pickle: bool | None,
    model_options: dict[str, Any],
) -> None:
    """Collective: every rank calls this, with the same directory. (1) Each rank opens, reads
    and checks every file it needs (models: keys both ways, tied names, shapes, kinds of
    dtype; optimizers: their parameter groups; its own `random_states_<rank>.pkl`), changing
    nothing; the ranks agree. (2) Each object is handed its state (the schedulers' and other
    objects' own code may still refuse it), then the models and optimizers theirs; the ranks
    agree, and a failure on any rank gives every object on every rank its earlier state back.
    (3) The RNG states, checked in (1), are set. Every error is raised on every rank, naming
    the ranks where it happened."""
    if allow_pickle is None:
        allow_pickle = envvars.get_bool("allow_pickle", False)
    model_options = model_load_options(model_options)
    what = f"loading Accelerate checkpoint {directory!r}"
    limit = rawio.stall_limit(comm.default_timeout)
    with agreement(comm, what, kind=CheckpointCollectiveError):
        read = rawio.within(limit, what, lambda: _Read(
            objects, directory, comm.rank, comm.size, allow_pickle, model_options
        ))
    for note in read.notes if comm.rank == 0 else []:
        warnings.warn(note, MpaccelRuntimeWarning, stacklevel=3)
    rollback = Rollback()
    try:
        with agreement(comm, what, kind=CheckpointCollectiveError):
            read.apply(rollback)
    except BaseException:
        problems = rollback.run()
        if problems:
            warnings.warn(
                f"{what} failed, and not everything could be given back the state it had: "
                + "; ".join(problems),
                MpaccelRuntimeWarning,
                stacklevel=3,
            )
        raise
    if read.rng is not None:
        set_rng_state(read.rng)


@contextmanager
def _opened(directory: str) -> Iterator[int]:
    try:
        fd = open_directory(directory)
    except FileNotFoundError as exc:
        raise CheckpointError(f"cannot open checkpoint directory {directory!r}: {exc}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


class _Read:
    """Phase (1) of a load, done on construction: everything this rank needs of the
    directory, read and checked, nothing changed. `trees`: entry -> the state to hand over
    (models: completed with their tied names); `rng`: the RNG states as set_rng_state()
    takes them, or None; `step`: Accelerate's step counter, or None; `notes`: warnings for
    the main process."""

    def __init__(
        self,
        objects: TrainingState,
        directory: str,
        rank: int,
        world: int,
        allow_pickle: bool,
        model_options: dict[str, Any],
    ) -> None:
        self.objects, self.directory = objects, directory
        self.options = model_options
        self.trees: dict[str, Any] = {}
        self.rng: dict[str, Any] | None = None
        self.step: Any = None
        self.rng_here = False  # set by _rng_file: are this rank's RNG states in the files
        self.notes: list[str] = []
        if objects.sharded:
            raise CheckpointError(
                f"{directory!r} is a checkpoint written by Hugging Face Accelerate's save_state, "
                f"and {sorted(objects.sharded)} are fully sharded here: mpaccel reads "
                "Accelerate's layout into whole (unsharded) models only",
                "load it in a run without FSDP, accelerator.save_state(new_dir) there, then "
                "load new_dir under FSDP (mpaccel's checkpoints load at any sharding).",
            )
        with _opened(directory) as dir_fd:
            self._read(dir_fd, rank, world, allow_pickle)

    def _read(self, dir_fd: int, rank: int, world: int, allow_pickle: bool) -> None:
        objects, directory = self.objects, self.directory
        targets: dict[str, Any] = {**objects.models, **objects.optimizers, **objects.shared}
        files: list[tuple[str, str, int]] = []  # (entry, file name, descriptor)
        try:
            for entry in targets:
                names = _file_of(entry)
                found = next(((n, fd) for n in names if (fd := _open(dir_fd, directory, n)) >= 0),
                             None)
                if found is not None:
                    files.append((entry, *found))
                elif names and entry not in objects.optional:
                    raise CheckpointError(
                        f"{directory!r} is an Accelerate checkpoint without {names[0]!r} "
                        f"(for {entry})",
                        "load it with the models, optimizers and schedulers it was saved with.",
                    )
            pickles = [name for _, name, _ in files if not name.endswith(".safetensors")]
            if pickles and not allow_pickle:
                raise CheckpointError(
                    f"{directory!r} is a checkpoint written by Hugging Face Accelerate's "
                    f"save_state; loading it here needs {pickles}, which are Python pickles "
                    "(they can run code when read), and mpaccel reads no pickle unless told to",
                    _CONVERT,
                )
            rng_file = self._rng_file(dir_fd, rank, world, allow_pickle)
            if rng_file is not None:
                fd = _open(dir_fd, directory, rng_file)
                if fd < 0:  # listed a moment ago
                    raise CheckpointError(f"{os.path.join(directory, rng_file)!r} is gone")
                files.append(("", rng_file, fd))
            loaded = []
            for entry, name, fd in files:
                loaded.append((entry, name, _load(fd, os.path.join(directory, name))))
        finally:
            for _, _, fd in files:
                os.close(fd)
        for entry, name, value in loaded:
            path = os.path.join(directory, name)
            if entry == "":
                self._rng_of(value, path, same_world=self.rng_here)
            elif entry in objects.models:
                self.trees[entry] = _model_tree(
                    entry, objects.models[entry], value, path,
                    strict=bool(self.options.get("strict", True)),
                )
            elif entry in objects.optimizers:
                self.trees[entry] = _optimizer_tree(entry, objects.optimizers[entry], value, path)
            else:
                self.trees[entry] = value

    def _rng_file(self, dir_fd: int, rank: int, world: int, allow_pickle: bool) -> str | None:
        """The random_states file this rank reads (None: none), deciding `rng_here`: whether
        its RNG states are set (the checkpoint was written by as many processes), or only
        Accelerate's step counter is taken (from rank 0's file)."""
        directory = self.directory
        numbers = sorted(
            int(m.group(1)) for m in map(_RNG_FILE.fullmatch, os.listdir(dir_fd)) if m
        )
        self.rng_here = numbers == list(range(world))
        if not numbers:
            return None
        if not allow_pickle:
            files = (f"random_states_{numbers[0]}.pkl is a pickle and is" if len(numbers) == 1
                     else f"random_states_{numbers[0]}.pkl ... random_states_{numbers[-1]}.pkl "
                     "are pickles and are")
            self.notes.append(
                f"{directory!r} (an Accelerate checkpoint): {files} not read; the random states "
                "and Accelerate's step counter stay as they are. " + _CONVERT
            )
            return None
        if not self.rng_here:
            self.notes.append(
                f"{directory!r} holds the random states of {len(numbers)} "
                f"process{'es' if len(numbers) > 1 else ''} and is loaded by {world}: RNG "
                "states were not restored (each process keeps its own)"
                + ("" if 0 in numbers else ", nor Accelerate's step counter")
            )
            return "random_states_0.pkl" if 0 in numbers else None
        return f"random_states_{rank}.pkl"

    def _rng_of(self, states: Any, path: str, same_world: bool) -> None:
        """Accelerate's random states, checked as mpaccel's own are (checked_rng_state), and
        its step counter."""
        if not isinstance(states, dict):
            raise CheckpointError(
                f"{path!r} holds a {type(states).__name__}, not Accelerate's random states",
                _DAMAGED,
            )
        self.step = states.get("step")
        if same_world:
            self.rng = checked_rng_state({
                "python": states.get("random_state"),
                "numpy": states.get("numpy_random_seed"),
                "torch": states.get("torch_manual_seed"),
                "cuda": states.get("torch_cuda_manual_seed", []),
            }, path)

    def apply(self, rollback: Rollback) -> None:
        """Phase (2): each object takes its state, its undo step added to `rollback` first:
        the other objects (their own load_state_dict may refuse), then the models and
        optimizers, whose states phase (1) checked."""
        objects, directory = self.objects, self.directory
        handed = [(name, obj) for name, obj in objects.shared.items() if name in self.trees]
        step_counter = objects.shared.get("accelerator")
        if step_counter is not None and self.step is not None:
            self.trees["accelerator"] = {"step": self.step}
            handed.append(("accelerator", step_counter))
        for name, obj in handed:
            rollback.add(name, functools.partial(obj.load_state_dict, _copy_of(obj.state_dict())))
            load_into(name, obj, self.trees[name], directory)
        assign = bool(self.options.get("assign"))
        for name, module in objects.models.items():
            if name in self.trees:
                tied = _tied_names(module)
                rollback.add(name, _model_undo(module, assign, tied))
                load_into(name, module, self.trees[name], directory, self.options)
                if assign:  # assign=True gives each name a Parameter of its own: tie them again
                    _retie(module, tied)
        for name, opt in objects.optimizers.items():
            if name in self.trees:
                state = opt.state_dict()  # its state tensors themselves, in new dicts
                state["state"] = {k: dict(v) for k, v in state["state"].items()}
                rollback.add(name, functools.partial(opt.load_state_dict, state))
                load_into(name, opt, self.trees[name], directory)


def _copy_of(state: Any) -> Any:
    """A state_dict() to give back on failure, safe from a load_state_dict that changes what
    it is given in place."""
    try:
        return copy.deepcopy(state)
    except Exception:  # not deep-copyable: as it is
        return state


def _open(dir_fd: int, directory: str, name: str) -> int:
    """open_regular (no link followed, no FIFO or device opened, nothing outside the
    directory), or -1 where `name` does not exist."""
    try:
        return open_regular(dir_fd, directory, name)
    except FileNotFoundError:
        return -1


def _load(fd: int, path: str) -> Any:
    """The content of the open checkpoint file `path`: a safetensors file as a dict of
    tensors, any other file unpickled (the caller checked that pickles are allowed)."""
    try:
        with rawio.current_watch().doing(f"reading {path}"):
            if path.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(descriptor_path(fd))
            with os.fdopen(os.dup(fd), "rb") as f:
                # The caller allowed unpickling this trusted directory (allow_pickle).
                return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as exc:  # safetensors' and pickle's errors have no common base
        raise CheckpointError(
            f"cannot read {path!r}: {type(exc).__name__}: {exc}", _DAMAGED
        ) from exc


def _tied_names(module: torch.nn.Module) -> list[list[str]]:
    """Groups of the names of the module's state_dict that are one tensor (tied weights:
    one Parameter or buffer under several names), each in state_dict order. Found from the
    live module, whatever its architecture."""
    keys = list(module.state_dict(keep_vars=True))
    order = {key: i for i, key in enumerate(keys)}
    groups: dict[int, list[str]] = {}
    named = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if name in order:
            groups.setdefault(id(tensor), []).append(name)
    return [sorted(names, key=order.__getitem__) for names in groups.values() if len(names) > 1]


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _model_tree(
    entry: str, module: torch.nn.Module, value: Any, path: str, strict: bool
) -> dict[str, Any]:
    """The checkpoint's state of `module`, checked as load_state_dict would take it (keys both
    ways unless strict=False, shapes) and more (the kind of each dtype: load_state_dict
    would turn floats into integers silently), with every tied name the checkpoint left out
    given its tensor. Refused, naming every problem, before anything is handed over."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CheckpointError(
            f"cannot load {entry} from {path!r}: it holds a {type(value).__name__}, not a "
            "model's state_dict",
            _DAMAGED,
        )
    saved = _strip_ddp(dict(value), module)
    live = module.state_dict()
    problems = []
    for names in _tied_names(module):
        present = [n for n in names if n in saved]
        for other in present[1:]:
            a, b = saved[present[0]], saved[other]
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.shape == b.shape and torch.equal(a, b)):
                problems.append(
                    f"{present[0]} and {other} are one tensor in the model, two different "
                    "ones in the checkpoint"
                )
        for name in names:
            if present and name not in saved:
                saved[name] = saved[present[0]]
    missing = [k for k in live if k not in saved] if strict else []
    unexpected = [k for k in saved if k not in live] if strict else []
    shapes, kinds = [], []
    for key, here in live.items():
        there = saved.get(key)
        if not isinstance(here, torch.Tensor) or key not in saved:
            continue
        if not isinstance(there, torch.Tensor):
            problems.append(f"{key} is a {type(there).__name__} in the checkpoint, not a tensor")
        elif there.shape != here.shape:
            shapes.append(f"{key}: {list(there.shape)} in the checkpoint, {list(here.shape)} here")
        elif _kind(there.dtype) != _kind(here.dtype):
            kinds.append(f"{key}: {there.dtype} in the checkpoint, {here.dtype} here")
    problems = ([f"missing keys {missing}"] if missing else []) + (
        [f"unexpected keys {unexpected}"] if unexpected else []) + problems
    problems += [f"other shapes: {'; '.join(shapes)}"] if shapes else []
    problems += [f"other kinds of dtype: {'; '.join(kinds)}"] if kinds else []
    if problems:
        raise CheckpointError(f"cannot load {entry} from {path!r}: " + ", ".join(problems),
                              _OTHER_MODEL)
    return saved


def _optimizer_tree(entry: str, opt: Any, value: Any, path: str) -> Any:
    """An optimizer's state_dict from the checkpoint, checked to be one its load_state_dict
    takes: param groups of the same number and sizes as the live optimizer's."""
    groups = value.get("param_groups") if isinstance(value, dict) else None
    if (
        not isinstance(groups, list)
        or not isinstance(value.get("state"), dict)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise CheckpointError(
            f"cannot load {entry} from {path!r}: it holds no optimizer's state_dict", _DAMAGED
        )
    sizes = [len(g["params"]) for g in groups]
    here = [len(g["params"]) for g in opt.state_dict()["param_groups"]]
    if sizes != here:
        raise CheckpointError(
            f"cannot load {entry} from {path!r}: its parameter groups hold {sizes} "
            f"parameters, the optimizer's hold {here}",
            "the checkpoint was written for another optimizer layout (or prepare() was called "
            "in another order).",
        )
    return value


def _model_undo(module: torch.nn.Module, assign: bool, tied: list[list[str]]) -> Any:
    """How to give `module` back its state: its tensors' values, copied now, and (assign=True
    replaces them) the tensors themselves, tied as they were (`tied`)."""
    held = module.state_dict(keep_vars=True)
    kept = {k: v.detach().clone() for k, v in held.items() if isinstance(v, torch.Tensor)}

    def undo() -> None:
        with torch.no_grad():
            for key, value in kept.items():
                held[key].copy_(value)
        if assign:
            module.load_state_dict(held, strict=False, assign=True)
            _retie(module, tied)

    return undo


def _retie(module: torch.nn.Module, groups: list[list[str]]) -> None:
    """Make each group of names one tensor again: the first name's, under every name."""
    tensors = module.state_dict(keep_vars=True)
    for names in groups:
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, tensors[names[0]])
