"""Fully sharded data parallelism: torch's FSDP2 (`fully_shard`) over the device mesh of
strategy/mesh.py (1-D, or HSDP's replicate x shard), its DTensor parameters, and the
`FullySharded` strategy that prepare(), the training step and checkpoints call.

The only module that imports torch.distributed.fsdp (checkpoint/sharded/, which reads
DTensors, is the other that imports torch.distributed.tensor), and only inside its functions,
once a model is sharded: importing them at mpaccel's import made
Accelerate's test_sync.py (DDP) hang at its end in most runs at -n 4 (a torch gloo teardown
race whose odds the import changed). One concept in one file, past 600 lines: a model's life
under FSDP2 (which blocks become units, sharding from rank 0's weights with tied parameters
kept, optimizers re-pointed at the shards, gradient sync and clipping, whole and per-rank
state, the optimizer and the gradients summed mid-accumulation as checkpoint entries); its
parts share private helpers that no other module needs. Functions say which ranks call them;
the collective ones must be called by every rank in the same order."""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from .. import distributed, shared_settings
from ..comm import Comm, agreement
from ..config.fsdp import FSDPAutoWrapPolicy, FullyShardedDataParallelPlugin
from ..enums import DistributedType
from ..errors import CollectiveError, ConfigurationError, MpaccelWarning
from .base import Strategy
from .mesh import build_mesh, fsdp_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule


def offload_policy(setting: Any) -> Any:
    """torch's CPUOffloadPolicy for the plugin's cpu_offload (True or a policy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return setting if isinstance(setting, CPUOffloadPolicy) else CPUOffloadPolicy()


# -- which blocks become FSDP units --------------------------------------------------------------


def _bottom_up(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every submodule once, children before their parents, the root excluded."""
    seen: set[int] = {id(model)}
    order: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                visit(child)
                order.append(child)

    visit(model)
    return order


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _callable_policy(policy: Callable) -> Callable[[torch.nn.Module], bool]:
    """`policy(module) -> bool`, or torch's FSDP1 form `policy(module, recurse,
    nonwrapped_numel)` (a partial of transformer_auto_wrap_policy, say) asked about one module."""
    try:
        names = set(inspect.signature(policy).parameters)
    except (TypeError, ValueError):
        names = set()
    if "recurse" in names and "nonwrapped_numel" in names:
        return lambda m: bool(policy(module=m, recurse=False, nonwrapped_numel=_numel(m)))
    return lambda m: bool(policy(m))


def blocks_to_wrap(model: torch.nn.Module, plugin: Any) -> tuple[list[torch.nn.Module], str]:
    """Not collective. The submodules `plugin.auto_wrap_policy` makes FSDP units of their own,
    children before parents, and a warning ('' if none) when it selects nothing it was meant
    to: class names that match no module (naming the classes the model has)."""
    policy = plugin.auto_wrap_policy
    everything = _bottom_up(model)
    # fully_shard refuses containers without a forward (ModuleList, ModuleDict).
    candidates = [m for m in everything if type(m).forward is not torch.nn.Module.forward]
    if policy is FSDPAutoWrapPolicy.NO_WRAP:
        return [], ""
    if policy is FSDPAutoWrapPolicy.SIZE_BASED_WRAP:
        limit = plugin.min_num_params
        chosen = [m for m in candidates if limit > 0 and _numel(m) > limit]
        largest = max(map(_numel, candidates), default=0)
        note = "" if chosen else (
            f"auto_wrap_policy='size_based_wrap' with min_num_params={limit} selects no "
            f"submodule of {type(model).__name__} (largest: {largest}"
            " parameters): only the root is sharded, and each forward gathers the whole model"
        )
        return chosen, note
    if policy is FSDPAutoWrapPolicy.TRANSFORMER_BASED_WRAP:
        names = plugin.transformer_cls_names_to_wrap
        if names is None:
            names = list(getattr(model, "_no_split_modules", None) or [])
        present = {type(m).__name__: type(m) for m in [model, *everything]}
        classes = tuple(present[n] for n in names if n in present)
        chosen = [m for m in candidates if classes and isinstance(m, classes)]
        missing = [n for n in names if n not in present]
        note = ""
        if missing or not chosen:
            found = sorted(present)
            shown = ", ".join(found[:30]) + (f" and {len(found) - 30} more" if len(found) > 30
                                             else "")
            asked = f"transformer_cls_names_to_wrap={names!r}" if names else (
                "no transformer_cls_names_to_wrap (and the model has no _no_split_modules)")
            note = (
                f"auto_wrap_policy='transformer_based_wrap' with {asked}: "
                + (f"{missing!r} match no module; " if missing else "")
                + f"the model's classes are: {shown}"
                + ("" if chosen else "; only the root is sharded, and each forward gathers "
                   "the whole model")
            )
        return chosen, note
    test = _callable_policy(policy)
    return [m for m in candidates if test(m)], ""


def _parents(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    parents: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, child in module.named_children():
            parents.setdefault(id(child), []).append((module, name))
    return parents


def checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[Any]:
    """Not collective. Put each block behind torch's checkpoint wrapper (its activations are
    recomputed in backward); returns the wrappers, which take the blocks' place. The state
    dict's keys are unchanged (the wrapper removes its prefix)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    parents = _parents(model)
    wrapped = []
    for block in blocks:
        wrapper = checkpoint_wrapper(block)
        for parent, name in parents.get(id(block), []):
            setattr(parent, name, wrapper)
        wrapped.append(wrapper)
    return wrapped


def ignored_parameters(model: torch.nn.Module, ignored: Any) -> set[torch.nn.Parameter]:
    """Not collective. The parameters of `ignored` (modules, or a regex their names fully
    match)."""
    if ignored is None:
        return set()
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
    else:
        modules = list(ignored)
    return {p for m in modules for p in m.parameters()}


# -- sharding a model ----------------------------------------------------------------------------


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Not collective. The names of each parameter the model holds under several names (one
    Parameter object: a language model's output layer tied to its input embedding, say), in
    registration order: the first name is the one named_parameters() gives, its owner."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Not collective. Every name of each group of tied_groups holds its first name's parameter
    again, then the model's own tie_weights() runs, where it has one. Moving a model to the
    meta device and load_state_dict(assign=True) give each name an object of its own: an
    untied copy trains apart from its twin, and no optimizer holds it (they are re-pointed by
    name, which names the first only)."""
    for first, *others in groups:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)
    tie_weights = getattr(model, "tie_weights", None)
    if groups and callable(tie_weights):
        tie_weights()
    for first, *others in groups:  # tie_weights may tie by its own rules: the groups still hold
        shared = model.get_parameter(first)
        if any(model.get_parameter(name) is not shared for name in others):
            raise ConfigurationError(
                f"{type(model).__name__}.tie_weights() untied {[first, *others]!r}, which share "
                "one parameter before sharding",
                "make tie_weights() tie the names that share a parameter when the model is "
                "built, or tie none.",
            )


def split_ties(
    model: torch.nn.Module, blocks: list[torch.nn.Module], groups: list[list[str]]
) -> list[torch.nn.Module]:
    """Not collective. The blocks that hold either every name of each tied group or none. An
    FSDP unit takes over the names inside it only: a twin outside would be sharded again, apart,
    by the unit around it. A block holding part of a group is left to the unit around it."""
    sizes = {id(model.get_parameter(group[0])): len(group) for group in groups}
    kept = []
    for block in blocks:
        held = Counter(id(p) for _, p in block.named_parameters(remove_duplicate=False))
        if all(held[key] in (0, size) for key, size in sizes.items()):
            kept.append(block)
    return kept


def has_meta_tensors(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def structure(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each state tensor, to compare models across ranks."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in model.state_dict().items()]


class _Pending:
    """Stands in an optimizer's parameter list while the parameter is being sharded, so that
    the optimizer no longer holds the whole tensor (its memory is freed as shards replace it)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def detach_optimizers(
    model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]
) -> list[list[Any]]:
    """Not collective. Replace, in each param group, the parameters of `model` by placeholders
    naming them (in place: an optimizer caching its list, as LBFGS does, sees the change);
    returns the groups to hand to attach_optimizers."""
    names = {id(p): canonical_name(name) for name, p in model.named_parameters()}
    groups = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if id(p) in names:
                    params[i] = _Pending(names[id(p)])
            groups.append(params)
    return groups


# Wrappers that prepare() may put between a module and its parameters: not part of the name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def attach_optimizers(model: torch.nn.Module, groups: list[list[Any]]) -> None:
    """Not collective. Put the sharded parameters where detach_optimizers left placeholders
    (param groups and their hyperparameters are kept)."""
    params = {canonical_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    for group in groups:
        for i, p in enumerate(group):
            if isinstance(p, _Pending):
                group[i] = params[canonical_name(p.name)]


def _broadcast_states(model: torch.nn.Module) -> None:
    """Collective: every rank's parameters and buffers become rank 0's, in place (as DDP does
    at wrap time): a model initialised differently on each rank must not be sharded from rows of
    different models."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not isinstance(tensor, DTensor):  # placed already (tensor parallelism's plan)
                distributed.broadcast(tensor.data, 0)


def _rank0_states(model: torch.nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """Rank 0's tensors by state-dict key, plus its non-persistent buffers (by module path),
    before the model goes to the meta device; other ranks keep nothing."""
    if not is_main:
        return {}
    states = {k: v.detach() for k, v in model.state_dict().items()}
    for name, buffer in model.named_buffers():
        states.setdefault(name, buffer.detach())
    return states


def _load_from_rank0(
    model: torch.nn.Module, states: dict[str, torch.Tensor], device: torch.device, is_main: bool
) -> None:
    """Collective. Every rank's sharded model (on the meta device) receives rank 0's tensors:
    each whole tensor is broadcast in turn and each rank keeps its own rows."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    meta = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for key, target in meta.items():
        local = target.to_local() if isinstance(target, DTensor) else target
        shape = target.shape
        full = states[key].to(device) if is_main else torch.empty(
            shape, dtype=local.dtype, device=device)
        distributed.broadcast(full, 0)
        if isinstance(target, DTensor):
            loaded[key] = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None)
        else:
            loaded[key] = full
    model.load_state_dict(loaded, assign=True)
    persistent = set(meta)
    for name, buffer in list(model.named_buffers()):
        if name in persistent:
            continue
        full = states[name].to(device) if is_main else torch.empty(
            buffer.shape, dtype=buffer.dtype, device=device)
        distributed.broadcast(full, 0)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, full, persistent=False)


def shard(
    model: torch.nn.Module,
    blocks: list[torch.nn.Module],
    mesh: DeviceMesh,
    options: dict[str, Any],
    reshard_after_forward: bool,
    ignored: Any,
    from_rank0: bool,
    is_main: bool,
    device: torch.device,
) -> None:
    """Collective. fully_shard each block (children first), then the root, over `mesh`.
    `options`: fully_shard's mp_policy and offload_policy; `ignored`: the plugin's
    ignored_modules. Parameters start as rank 0's: broadcast before sharding, or, `from_rank0`
    (cpu_ram_efficient_loading), sent to a model sharded on the meta device (the other ranks'
    may start there). Parameters shared under several names (tied_groups) stay shared, each
    one FSDP parameter; a block holding part of such a group is no unit of its own."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    states: dict[str, torch.Tensor] = {}
    groups = tied_groups(model)
    if from_rank0:
        states = _rank0_states(model, is_main)
        model.to(torch.device("meta"))  # new parameter objects: ignored ones are found after
        retie(model, groups)
    else:
        _broadcast_states(model)
    blocks = split_ties(model, blocks, groups)
    skipped = ignored_parameters(model, ignored)
    if skipped:
        options = {**options, "ignored_params": skipped}
    for block in blocks:
        if not isinstance(block, FSDPModule):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
    # The root: torch's default keeps it gathered after forward (backward needs it at once)
    # unless the user asked for no resharding anywhere.
    fully_shard(model, mesh=mesh, reshard_after_forward=None if reshard_after_forward else False,
                **options)  # fmt: skip
    if from_rank0:
        _load_from_rank0(model, states, device, is_main)
        states.clear()
        retie(model, groups)


def forward_methods(model: torch.nn.Module, extra: list[str]) -> list[str]:
    """Not collective. The methods of `model` that FSDP must treat as forward passes (gather
    the parameters before, free them after): `generate` where the model has one (it calls
    submodules, an encoder say, without going through the root's forward, which gathers the
    root unit's parameters: a shared embedding), and the plugin's `forward_methods`. A name
    the model lacks is a ConfigurationError."""
    missing = [name for name in extra if not callable(getattr(model, name, None))]
    if missing:
        raise ConfigurationError(
            f"FullyShardedDataParallelPlugin(forward_methods=...): {type(model).__name__} has "
            f"no method {missing!r}",
            "name methods of the model passed to prepare() (the plugin applies to every model "
            "prepared with it).",
        )
    found = ["generate"] if callable(getattr(model, "generate", None)) else []
    return found + [name for name in extra if name not in found]


def register_forward_methods(model: torch.nn.Module, names: list[str]) -> None:
    """Not collective. Each method of `names` gathers the root unit's parameters as forward
    does (torch's register_fsdp_forward_method; `model` is sharded)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in names:
        register_fsdp_forward_method(model, name)


# -- training with a sharded model ---------------------------------------------------------------


def fsdp_module(model: Any) -> FSDPModule | None:
    """The FSDP module `model` is, or holds under torch.compile's wrapper; None if none."""
    from torch.distributed.fsdp import FSDPModule

    while not isinstance(model, FSDPModule) and isinstance(
        getattr(model, "_orig_mod", None), torch.nn.Module
    ):
        model = model._orig_mod
    return model if isinstance(model, FSDPModule) else None


def no_gradient_sync(model: Any) -> AbstractContextManager[None]:
    """Not collective. Inside the block, backward accumulates whole gradients locally (no
    reduce-scatter); the first backward after it reduces them all. A model that is no FSDP
    module: a null context (not a generator: its frame would keep the model, and DDP's
    process group, alive longer, which let torch's gloo teardown deadlock in Accelerate's
    test_sync.py)."""
    module = fsdp_module(model)
    return nullcontext() if module is None else _gradient_sync_off(module)


@contextmanager
def _gradient_sync_off(module: FSDPModule) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _full(norm: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Collective (the norms of sharded gradients are reduced over their mesh). Clip the
    gradients to a total `norm_type` norm of `max_norm`; returns the total norm before
    clipping, as a plain tensor equal on every rank for sharded gradients (unsharded ones, of
    ignored modules, count as each rank holds them)."""
    from torch.distributed.tensor import DTensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        key = id(grad.device_mesh) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    if not groups:
        return torch.tensor(0.0)
    norms = [_full(torch.nn.utils.get_total_norm(grads, norm_type)) for grads in groups.values()]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def full_state_dict(model: torch.nn.Module, everywhere: bool) -> dict[str, Any]:
    """Collective. The model's state dict with whole tensors (on the CPU). `everywhere`: on
    every rank, with rank 0's values for what is not sharded (buffers, which FSDP leaves to
    each rank); else, as Accelerate's get_state_dict, on rank 0 only (the others get {}).
    The names of a tied parameter (tied_groups) hold one tensor, as in an unsharded model's
    state dict, so that save_pretrained and safetensors store it once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    state = get_model_state_dict(model, options=options)
    if everywhere:
        sharded = {k for k, v in model.state_dict().items() if isinstance(v, DTensor)}
        for key, value in state.items():
            if key not in sharded and isinstance(value, torch.Tensor):
                distributed.broadcast(value, 0)
        state = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    for first, *others in tied_groups(model):
        for name in others:
            if first in state and name in state:
                state[name] = state[first]
    return state


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Not collective. The second and later names of each tied parameter (tied_groups): the
    names a safetensors file leaves out, as for an unsharded model whose names share memory."""
    return {name for _, *others in tied_groups(model) for name in others}


class OptimizerState:
    """An optimizer over fully_shard parameters as a checkpoint's Stateful (`sharded` entry).
    With `create` (for a load), state_dict() first creates the state a fresh optimizer lacks
    (one step at learning rate 0 over zero gradients, as torch.distributed.checkpoint does:
    the parameters stay as they are), so that each rank reads its rows into it; undo() drops
    that state again after a failed load."""

    def __init__(self, optimizer: Any, create: bool = False) -> None:
        self.optimizer = optimizer
        self._raw = getattr(optimizer, "optimizer", optimizer)  # under mpaccel's wrapper
        self._create = create
        self._created = False

    def state_dict(self) -> dict[str, Any]:
        if self._create and not self._raw.state:
            self._init_state()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def undo(self) -> None:
        if self._created:
            self._raw.state.clear()
            self._created = False

    def _init_state(self) -> None:
        params = [p for group in self._raw.param_groups for p in group["params"]]
        grads = [p.grad for p in params]  # mid-accumulation gradients are kept
        rates = [group["lr"] for group in self._raw.param_groups]
        try:
            for p in params:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            for group in self._raw.param_groups:
                group["lr"] = 0.0
            self._raw.step()
            self._created = True
        finally:
            for group, lr in zip(self._raw.param_groups, rates):
                group["lr"] = lr
            for p, grad in zip(params, grads):
                p.grad = grad


class WholeSavePretrained:
    """A sharded model's `save_pretrained` (transformers'), as a method of that model: writes
    whole tensors. transformers' own reads model.state_dict(), whose DTensor shards safetensors
    cannot write (the save fails and writes no weights), unless it is handed a state_dict. This
    one hands it the gathered one (on rank 0, the rank transformers writes from) when the
    caller passes none: the unchanged `accelerator.unwrap_model(model).save_pretrained(dir,
    is_main_process=..., save_function=accelerator.save)` of transformers' no_trainer scripts
    writes the full model. Set on the instance only (install()), so nothing else changes:
    state_dict() still gives the shards that torch's and mpaccel's checkpoints read, and a
    caller that passes a state_dict (Trainer) reaches transformers' method untouched."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @classmethod
    def install(cls, model: torch.nn.Module, comm: Comm) -> None:
        """Not collective. Give `model` (sharded) this save_pretrained, if its class has one."""
        if callable(getattr(type(model), "save_pretrained", None)):
            vars(model)["save_pretrained"] = types.MethodType(cls(comm), model)

    def __call__(self, model: Any, save_directory: Any, *given: Any, **kwargs: Any) -> Any:
        """Collective when no state_dict is passed: every rank calls it (the gather)."""
        args = list(given)  # transformers' order: is_main_process, state_dict, ...
        if (args[1] if len(args) > 1 else kwargs.get("state_dict")) is None:
            from ..checkpoint import api as solo

            who = solo.who_saves(self.comm, "save_pretrained", save_directory)
            if who != solo.COLLECTIVE:
                raise ConfigurationError(
                    f"save_pretrained({os.fspath(save_directory)!r}) of a fully sharded "
                    f"{type(model).__name__} was called by one rank alone: the whole tensors are "
                    "gathered from every rank's shards",
                    "call it on every rank (is_main_process=accelerator.is_main_process decides "
                    "who writes), or pass state_dict=accelerator.get_state_dict(model), which "
                    "every rank computes, to the main process's call.",
                )
            whole = full_state_dict(model, everywhere=False)  # {} but on rank 0, the writer
            if len(args) > 1:
                args[1] = whole
            else:
                kwargs["state_dict"] = whole
        return type(model).save_pretrained(model, save_directory, *args, **kwargs)


# -- sharding a model, collectively --------------------------------------------------------------


def _fingerprint(model: torch.nn.Module) -> str:
    """A digest of the model's state-dict names, shapes and dtypes, to compare across ranks."""
    return hashlib.sha1(repr(structure(model)).encode()).hexdigest()


def _check_model(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin, rank: int) -> None:
    """This rank's model can be sharded as the plugin says (raised, then agreed on)."""
    on_meta = has_meta_tensors(model)
    if on_meta and not plugin.cpu_ram_efficient_loading:
        raise ConfigurationError(
            f"the model given to prepare() ({type(model).__name__}) has tensors on the meta "
            "device: there are no weights to shard",
            "create the model with real weights, or pass FullyShardedDataParallelPlugin("
            "cpu_ram_efficient_loading=True) and give rank 0 a model with real weights (the "
            "other ranks may build theirs on the meta device).",
        )
    if on_meta and rank == 0:
        raise ConfigurationError(
            f"cpu_ram_efficient_loading: rank 0's model ({type(model).__name__}) is on the meta "
            "device, but rank 0 holds the weights every rank receives",
            "load the real weights on rank 0 (the other ranks may use the meta device).",
        )


def shard_model(
    model: torch.nn.Module,
    plugin: FullyShardedDataParallelPlugin,
    mesh: Any,
    comm: Comm,
    device: torch.device,
    placement: bool,
) -> torch.nn.Module:
    """Collective: every rank calls this with its copy of the same model. Applies fully_shard
    per the plugin's wrap policy (blocks first, then the root) over `mesh`, in place, starting
    from rank 0's weights; returns the model (the same object, now an FSDP module), whose
    `generate` (where it has one) and the plugin's forward_methods gather the parameters as
    forward does, and whose transformers `save_pretrained` writes whole tensors
    (WholeSavePretrained). Tied parameters stay tied (retie). A model
    whose ranks disagree (structure, meta device) is one CollectiveError on every rank."""
    blocks: list[torch.nn.Module] = []
    methods: list[str] = []
    note = ""
    with agreement(comm, "preparing a model for FSDP", passing=(CollectiveError,)):
        _check_model(model, plugin, comm.rank)
        methods = forward_methods(model, plugin.forward_methods or [])
        blocks, note = blocks_to_wrap(model, plugin)
        if plugin.ignored_modules is not None:
            ignored_parameters(model, plugin.ignored_modules)  # a bad regex fails here
    units = shared_settings.of_units(model, blocks)
    gathered = comm.allgather((_fingerprint(model), units), what="comparing the models to shard")
    prints = [p for p, _ in gathered]
    if len(set(prints)) > 1:
        odd = [r for r, p in enumerate(prints) if p != prints[0]]
        raise ConfigurationError(
            f"the model given to prepare() differs between ranks: ranks {odd} hold a model with "
            "other parameter names, shapes or dtypes than rank 0's",
            "build the same model on every rank before prepare().",
        )
    mismatch = shared_settings.mismatch([[u] for _, u in gathered], "prepare()")
    if mismatch is not None:  # a wrap policy that decides by the rank or its environment
        raise mismatch
    if note and comm.rank == 0:
        warn(note)
    if placement and not has_meta_tensors(model):
        model = model.to(device)
    if plugin.mixed_precision_policy is not None:
        upcast_low_precision(model, announce=comm.rank == 0)
    if plugin.activation_checkpointing:
        blocks = checkpoint_blocks(model, blocks)
    options: dict[str, Any] = {}
    if plugin.mixed_precision_policy is not None:
        options["mp_policy"] = mixed_precision_policy(plugin.mixed_precision_policy)
    if plugin.offloads and device.type != "cpu":  # on the CPU the parameters are there already
        options["offload_policy"] = offload_policy(plugin.cpu_offload)
    shard(
        model, blocks, mesh, options, plugin.reshard_after_forward, plugin.ignored_modules,
        from_rank0=bool(plugin.cpu_ram_efficient_loading), is_main=comm.rank == 0, device=device,
    )  # fmt: skip
    register_forward_methods(model, methods)
    WholeSavePretrained.install(model, comm)
    return model


def upcast_low_precision(model: torch.nn.Module, announce: bool) -> None:
    """Not collective (every rank holds the same model: checked before). Under a mixed-precision
    policy FSDP2 computes in the policy's dtype but keeps the sharded parameters in the dtype
    they arrive in: a model loaded in bfloat16 (transformers' torch_dtype=torch.bfloat16) would
    have bfloat16 master weights, and updates smaller than their rounding step vanish. Its
    floating tensors become float32 first, as Accelerate does; `announce`: warn (the main
    process), since a checkpoint then holds float32 tensors."""
    low = (torch.bfloat16, torch.float16)
    if not any(p.requires_grad and p.dtype in low for p in model.parameters()):
        return
    model.to(torch.float32)
    if announce:
        warn("FSDP under mixed precision keeps float32 master weights: the model's bfloat16/"
             "float16 parameters were upcast to float32 before sharding (the policy still "
             "computes in its param_dtype); its checkpoints hold float32 tensors.")


@contextmanager
def optimizers_following(
    models: list[torch.nn.Module], optimizers: list[Any], prepared: Iterable[Any]
) -> Iterator[None]:
    """Not collective. Around the replacing of `models`' parameters by DTensors (sharding,
    splitting): the `optimizers` hold placeholders during the block, then the new parameters,
    by name. Optimizers passed without models must hold DTensors of `prepared` already."""
    if not models:
        check_optimizers(optimizers, prepared)
    detached = [(model, detach_optimizers(model, optimizers)) for model in models]
    yield
    for model, groups in detached:
        attach_optimizers(model, groups)


def check_optimizers(
    optimizers: Iterable[torch.optim.Optimizer], prepared: Iterable[torch.nn.Module]
) -> None:
    """Not collective (the same on every rank). An optimizer prepared without its model must
    already hold the sharded parameters of prepared models (built after prepare(model)); one
    over the whole tensors of before would train nothing."""
    known = {id(p) for model in prepared for p in model.parameters()}
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stale = sum(id(p) not in known for p in params)
        if stale:
            raise ConfigurationError(
                f"{type(optimizer).__name__} was passed to prepare() without its model, and "
                f"{stale} of its {len(params)} parameters belong to no prepared (sharded) model",
                "pass the model and its optimizer to the same prepare() call (as Accelerate "
                "requires under FSDP2), or build the optimizer over the prepared model's "
                "parameters.",
            )


def warn(message: str, stacklevel: int = 4) -> None:
    warnings.warn(message, MpaccelWarning, stacklevel=stacklevel)


def mixed_precision_policy(policy: Any) -> Any:
    """torch's MixedPrecisionPolicy for the plugin's (config.fsdp.PrecisionPolicy); None
    stays None."""
    if policy is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
    )


def sharded_grad_scaler(device_type: str, **kwargs: Any) -> Any:
    """Not collective. torch's ShardedGradScaler (GradScalerKwargs' arguments in `kwargs`)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type, **kwargs)


class SummedGradients:
    """The gradients a fully_shard model summed so far mid-accumulation, as DTensors sharded like
    its parameters: a Stateful of the sharded part, so that they are saved as rows and load at
    any world size.

    While FSDP2 accumulates without synchronising (accumulate(), no_sync()), each rank holds
    whole gradients of its own micro-batches (FSDPParam's unsharded gradient); the next
    synchronising backward averages them over the ranks, reduce-scatters them and adds them
    to `p.grad`. state_dict() (collective over the model's mesh) does that reduction into new
    memory, leaving FSDP's own state alone: p.grad + the ranks' average of the pending
    gradients (under tensor parallelism, TensorParallel's inner FSDP2, each pending gradient is
    this rank's tp part: averaged over the data-parallel mesh dims only, its tp placement
    kept). load_state_dict() sets `p.grad` to it and drops pending gradients, so the next
    synchronising backward adds the rest as it would have. `keys`: the gradients a load
    expects (those the checkpoint holds). FullySharded.summed_gradients hands it to the
    checkpoint (TrainingState.summed_gradients), which calls `restorer()` to undo a failed
    load."""

    def __init__(self, module: Any, keys: list[str] | None = None) -> None:
        self.module = module
        self.keys = keys

    def _params(self) -> dict[str, Any]:
        return {name: p for name, p in self.module.named_parameters() if p.requires_grad}

    def _pending(self) -> list[Any]:
        """FSDP2's FSDPParams of the model (private API: torch 2.13's names)."""
        from torch.distributed.fsdp import FSDPModule

        out = []
        for sub in self.module.modules():
            if isinstance(sub, FSDPModule):
                group = sub._get_fsdp_state()._fsdp_param_group
                out += [] if group is None else list(group.fsdp_params)
        return out

    def state_dict(self) -> dict[str, Any]:
        params = self._params()
        if self.keys is not None:  # targets of a load, sharded like the parameters
            return {key: torch.zeros_like(params[key]).detach() for key in self.keys}
        from torch.distributed.tensor import DTensor, Partial

        pending: dict[int, tuple[torch.Tensor, Any]] = {}
        for fsdp_param in self._pending():
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None and hasattr(fsdp_param, "_unsharded_param"):
                grad = fsdp_param._unsharded_param.grad
            if grad is not None:
                # under TP, a DTensor on mesh['tp']: this tp rank's part, whole over dp
                tp = grad.placements[-1] if isinstance(grad, DTensor) else None
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                pending[id(fsdp_param.sharded_param)] = (local, tp)
        out = {}
        for name, p in params.items():
            total = p.grad
            local, tp = pending.get(id(p), (None, None))
            if local is not None and isinstance(p, DTensor):
                mesh = p.device_mesh
                # averaged over the data-parallel dims only; the tp part stays this rank's
                placements = [tp if dim == "tp" and tp is not None else Partial("avg")
                              for dim in (mesh.mesh_dim_names or ("",) * mesh.ndim)]
                summed = DTensor.from_local(
                    local.to(p.dtype), mesh, placements, run_check=False,
                    shape=p.shape, stride=p.stride(),
                ).redistribute(mesh, p.placements)
                total = summed if total is None else total + summed
            if total is not None:
                out[name] = total.detach()
        return out

    def restorer(self) -> Any:
        """A callable that gives the model back the gradients it holds now (its `.grad`s and
        FSDP's pending ones), which load_state_dict() replaces."""
        grads = [(p, p.grad) for p in self._params().values()]
        pending = [(f, f.unsharded_accumulated_grad,
                    f._unsharded_param.grad if hasattr(f, "_unsharded_param") else None)
                   for f in self._pending()]

        def restore() -> None:
            for p, grad in grads:
                p.grad = grad
            for f, accumulated, unsharded in pending:
                f.unsharded_accumulated_grad = accumulated
                if hasattr(f, "_unsharded_param"):
                    f._unsharded_param.grad = unsharded

        return restore

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = self._params()
        for fsdp_param in self._pending():
            fsdp_param.unsharded_accumulated_grad = None
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None
        for key, value in state.items():
            params[key].grad = value


class FullySharded(Strategy):
    """FSDP2 (torch's fully_shard) with the FullyShardedDataParallelPlugin `plugin`, over a
    mesh built here from `parallelism_config` or the node layout (strategy/mesh.py): HSDP on a
    2-D mesh. `mesh`: an N-D mesh built already (TensorParallel's), sharded over its
    data-parallel dimensions. Creating it is collective (the mesh)."""

    distributed_type = DistributedType.FSDP

    def __init__(
        self,
        partial: Any,
        plugin: FullyShardedDataParallelPlugin,
        parallelism_config: Any,
        mesh: Any = None,
    ) -> None:
        self.plugin = plugin
        if mesh is None:
            mesh = build_mesh(partial, plugin.hybrid, parallelism_config)
        self.mesh = mesh
        #: what fully_shard shards over: the data-parallel dimensions of an N-D mesh
        self.shard_mesh = fsdp_mesh(mesh)
        super().__init__(partial)  # after the mesh: a world of one got its backend there

    def is_prepared(self, model: torch.nn.Module) -> bool:
        return super().is_prepared(model) or fsdp_module(model) is not None

    def place(self, model: torch.nn.Module, placement: bool) -> torch.nn.Module:
        """Collective: fully_shard in place (shard_model)."""
        return shard_model(model, self.plugin, self.shard_mesh, self.comm, self.device, placement)

    @contextmanager
    def optimizers_follow(
        self, models: list[torch.nn.Module], optimizers: list[Any], prepared: Iterable[Any]
    ) -> Iterator[None]:
        """Not collective. The optimizers hold placeholders for the models' parameters while
        they are sharded (the whole tensors are freed as shards replace them), then the shards.
        Optimizers passed without models must hold the shards of `prepared` already."""
        with optimizers_following(models, optimizers, prepared):
            yield

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        """Not collective. Each rank accumulates whole gradients until the next synchronising
        backward (no reduce-scatter); a DDP's no_sync for a DDP prepared before."""
        ddp = distributed.ddp_of(model)
        return no_gradient_sync(model) if ddp is None else ddp.no_sync()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Collective: the norm is the whole model's, reduced over the shards."""
        return clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def full_state_dict(self, model: torch.nn.Module, everywhere: bool) -> dict[str, Any]:
        if fsdp_module(model) is None:
            return model.state_dict()
        return full_state_dict(model, everywhere=everywhere)

    def is_sharded(self, model: torch.nn.Module) -> bool:
        return fsdp_module(model) is not None

    def tied_aliases(self, model: torch.nn.Module) -> set[str]:
        return tied_aliases(model) if self.is_sharded(model) else set()

    def checkpoint_entries(
        self, models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, Any], loading: bool
    ) -> dict[str, Any]:
        """The sharded models, and, if there is one, every optimizer (prepare() built them all
        over the shards) as an OptimizerState."""
        entries: dict[str, Any] = {n: m for n, m in models.items() if self.is_sharded(m)}
        if entries:
            entries.update({n: OptimizerState(o, create=loading) for n, o in optimizers.items()})
        return entries

    def summed_gradients(self, model: torch.nn.Module, keys: list[str] | None) -> Any:
        return SummedGradients(model, keys)
