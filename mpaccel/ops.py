"""gather / reduce / broadcast / pad on nested structures of tensors (lists, tuples, dicts).

Every function here is collective. Shapes are checked first with one small MPI all-gather on the
host, so a mismatch raises the same clear error on every rank instead of crashing or hanging the
data-plane collective. gather() also accepts tensors whose first dimension differs across ranks.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from . import distributed, tree
from .comm import Comm
from .errors import CollectiveMismatchError, ConfigurationError, DistributedOperationException


class CannotPadNestedTensorWarning(UserWarning):
    """pad_across_processes met a nested tensor: it has no one size along `dim` to pad to, so
    it is returned as it is."""


def _rebuild(data: Any, replace: Callable[[torch.Tensor], Any]) -> Any:
    """`data` with each tensor replaced by `replace(tensor)`, in the order of tree.leaves()."""
    return tree.map(lambda leaf: replace(leaf) if isinstance(leaf, torch.Tensor) else leaf, data)


def _exchange(comm: Comm, operation: str, mine: Any, what: str) -> list[Any]:
    """Collective: every rank's `mine`, once every rank is known to be in the same operation.
    `operation` names it with what must agree (reduce(sum), broadcast(from_process=0)...): two
    ranks in different operations here would meet in this one MPI all-gather and then go on
    to different data-plane collectives that hang (or mix the wrong data); instead every rank
    raises the same error."""
    gathered = comm.allgather((operation, mine), what=what)
    ranks: dict[str, list[int]] = {}
    for rank, (call, _) in enumerate(gathered):
        ranks.setdefault(call, []).append(rank)
    if len(ranks) > 1:
        where = "; ".join(f"{call} on {_rank_list(found)}" for call, found in ranks.items())
        raise CollectiveMismatchError(
            f"the ranks called different collective operations: {where}",
            "every rank must make the same collective calls, with the same arguments, in the "
            "same order; look for a branch taken on some ranks only (or a reduction, source "
            "rank or use_gather_object that depends on the rank).",
        )
    return [payload for _, payload in gathered]


def _rank_list(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2, 5' (sorted ranks)."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


# A nested input's structure, as the ranks compare it: "tensor", "value" (not a tensor nor a
# container: each rank keeps its own), ("dict", ((repr(key), spec), ...)) in the mapping's order,
# or (type name, (spec, ...)) for lists, tuples and named tuples. It rides on the shape check's
# exchange: comparing it costs no collective.
Spec = Any
Leaves = list[tuple[tuple[int, ...], str]]  # (shape, dtype) of each tensor, in tree.leaves() order


def _describe(data: Any, leaves: Leaves) -> Spec:
    if isinstance(data, torch.Tensor):
        # A nested tensor has no one size per dimension: -1 stands for each (ragged) size.
        shape = (-1,) * data.dim() if data.is_nested else tuple(data.shape)
        leaves.append((shape, str(data.dtype)))
        return "tensor"
    if isinstance(data, Mapping):
        return ("dict", tuple((repr(k), _describe(v, leaves)) for k, v in data.items()))
    if isinstance(data, (list, tuple)):
        return (type(data).__name__, tuple(_describe(v, leaves) for v in data))
    return "value"


def _metadata(
    comm: Comm, data: Any, what: str, operation: str | None = None
) -> list[tuple[Spec, Leaves]]:
    """Collective: every rank's (structure, leaves) of `data`, in one exchange."""
    leaves: Leaves = []
    spec = _describe(data, leaves)
    return _exchange(comm, operation or what, (spec, leaves), f"{what} (shape check)")


def _children(spec: Spec) -> list[tuple[str, Spec]]:
    """(label, child) of a container's spec: a dict's repr(key), a sequence's index."""
    kind, children = spec
    return list(children) if kind == "dict" else [(str(i), c) for i, c in enumerate(children)]


def _first_difference(a: Spec, b: Spec) -> list[str]:
    """The labels leading to the first place where the structures `a` != `b` differ."""
    if isinstance(a, str) or isinstance(b, str) or a[0] != b[0]:
        return []
    pairs_a, pairs_b = _children(a), _children(b)
    if [label for label, _ in pairs_a] != [label for label, _ in pairs_b]:
        return []
    for (label, child_a), (_, child_b) in zip(pairs_a, pairs_b):
        if child_a != child_b:
            return [label, *_first_difference(child_a, child_b)]
    return []


def _say(spec: Spec, labels: list[str]) -> str:
    """What `spec` holds at `labels`, in words."""
    for label in labels:
        spec = None if isinstance(spec, str) else dict(_children(spec)).get(label)
    if spec is None or isinstance(spec, str):
        return {None: "nothing", "tensor": "a tensor", "value": "a value that is not a tensor"}[
            spec
        ]
    kind, children = spec
    if kind != "dict":
        return f"a {kind} of {len(children)} item(s)"
    keys = [key for key, _ in children]
    more = f", ... ({len(keys)} keys)" if len(keys) > 8 else ""
    return f"a dict with keys [{', '.join(keys[:8])}{more}]"


def _check_structure(what: str, specs: list[Spec]) -> None:
    """Every rank's structure equal to rank 0's, else one error naming the ranks, where the
    structures differ and how (the same on every rank: computed from what every rank got)."""
    groups: dict[Spec, list[int]] = {}
    for rank, spec in enumerate(specs):
        groups.setdefault(spec, []).append(rank)
    if len(groups) == 1:
        return
    labels = _first_difference(specs[0], next(s for s in groups if s != specs[0]))
    found = "; ".join(f"{_rank_list(ranks)}: {_say(s, labels)}" for s, ranks in groups.items())
    where = "".join(f"[{label}]" for label in labels)
    raise ConfigurationError(
        f"{what}: the ranks passed different structures, at input{where}: {found}",
        "every rank must pass the same nested structure: the same dict keys in the same order, "
        "lists and tuples of the same length, tensors in the same places.",
    )


def _mismatch(what: str, metas: list, leaf: int, rule: str) -> DistributedOperationException:
    shapes = ", ".join(f"rank {r}: {m[leaf][0]} {m[leaf][1]}" for r, m in enumerate(metas))
    return DistributedOperationException(
        f"{what}: tensor #{leaf} differs across ranks ({shapes}); {rule}",
        "call it with the same structure, dtype and shape on every rank; for predictions of "
        "varying length use pad_across_processes() first, or gather_for_metrics("
        "use_gather_object=True).",
        what,
    )


# What each operation needs to agree across ranks, beyond the structure and the dtypes: a test
# of (this rank's shape, rank 0's shape), and what to say when it fails.
_SHAPE_RULES: dict[str, tuple[Callable[[tuple, tuple], bool], str]] = {
    "shape": (lambda a, b: a == b, "shapes must match"),
    "trailing": (
        lambda a, b: len(a) == len(b) and a[1:] == b[1:],
        "only the first dimension may differ",
    ),
    "ndim": (lambda a, b: len(a) == len(b), "the number of dimensions must match"),
}


def _check(what: str, exchanged: list[tuple[Spec, Leaves]], rule: str) -> list[Leaves]:
    """Every rank's leaves, once structures, dtypes and shapes (by `rule`) agree across ranks;
    else the same ConfigurationError on every rank."""
    _check_structure(what, [spec for spec, _ in exchanged])
    metas = [leaves for _, leaves in exchanged]
    agrees, message = _SHAPE_RULES[rule]
    for leaf in range(len(metas[0])):
        shape0, dtype0 = metas[0][leaf]
        for m in metas:
            shape, dtype = m[leaf]
            if dtype != dtype0:
                raise _mismatch(what, metas, leaf, "dtypes must match")
            if not agrees(shape, shape0):
                raise _mismatch(what, metas, leaf, message)
    return metas


def gather(comm: Comm, data: Any) -> Any:
    """Collective: every rank of `comm` must call it. Every rank's tensors concatenated along
    the first dimension, in rank order.

    Args:
        comm: the job's communicator.
        data: a tensor, or nested lists, tuples and dicts of tensors, of the same structure,
            dtypes and trailing dimensions on every rank; the first dimension may differ, and
            a 0-d tensor counts as one row.

    Raises:
        DistributedOperationException: on every rank, when the ranks' data disagree.
    """
    if comm.size == 1:
        return data
    metas = _check("gather", _metadata(comm, data, "gather"), "trailing")
    counter = iter(range(len(metas[0])))

    def one(tensor: torch.Tensor) -> torch.Tensor:
        leaf = next(counter)
        rows = [m[leaf][0][0] if m[leaf][0] else 1 for m in metas]
        flat = tensor.reshape(1) if tensor.ndim == 0 else tensor
        longest = max(rows)
        if flat.shape[0] < longest:
            pad = flat.new_zeros((longest - flat.shape[0], *flat.shape[1:]))
            flat = torch.cat([flat, pad])
        pieces = distributed.all_gather(flat, comm.size)
        return torch.cat([piece[:n] for piece, n in zip(pieces, rows)])

    return _rebuild(data, one)


def gather_object(comm: Comm, obj: Any) -> list[Any]:
    """Collective: every rank of `comm` must call it. Every rank's picklable objects in one
    list, in rank order; runs over MPI (host), not the GPU.

    Args:
        comm: the job's communicator.
        obj: this rank's part: lists and tuples are concatenated, tensors and numpy arrays
            contribute their rows (as in Accelerate), anything else one element.
    """
    parts = _exchange(comm, "gather_object", obj, "gather_object")
    out: list[Any] = []
    for part in parts:
        if isinstance(part, (list, tuple)):
            out.extend(part)
        elif isinstance(part, (torch.Tensor, np.ndarray)) and part.ndim > 0:
            out.extend(part)
        else:
            out.append(part)
    return out


def only_tensors(data: Any) -> bool:
    """Not collective. True if every leaf of `data` is a tensor.

    Args:
        data: a tensor, or nested lists, tuples and dicts.
    """
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(only_tensors(value) for value in data.values())
    if isinstance(data, (list, tuple)):
        return all(only_tensors(value) for value in data)
    return False


def reduce(comm: Comm, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Collective: every rank of `comm` must call it, with the same `reduction`. The
    element-wise reduction of every rank's tensors, as new tensors (the inputs are left alone).

    Args:
        comm: the job's communicator.
        data: a tensor, or nested lists, tuples and dicts of tensors, of the same structure,
            dtypes and shapes on every rank.
        reduction: "sum", "mean", "max" or "min"; "none" returns `data` as it is.
        scale: a factor every reduced tensor is multiplied by.

    Raises:
        ConfigurationError: for another `reduction`.
        DistributedOperationException: on every rank, when the ranks' data disagree.
    """
    if reduction not in ("sum", "mean", "max", "min", "none"):
        raise ConfigurationError(
            f"reduce(reduction={reduction!r}): expected 'sum', 'mean', 'max' or 'min'"
        )
    if reduction == "none":
        return data
    if comm.size > 1:
        _check("reduce", _metadata(comm, data, "reduce", f"reduce({reduction})"), "shape")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if comm.size > 1:
            distributed.all_reduce(out, "sum" if reduction == "mean" else reduction)
        if reduction == "mean":
            out = out / comm.size
        return out * scale if scale != 1.0 else out

    return _rebuild(data, one)


def _as_rank(value: Any) -> Any:
    """`value` as a plain int where it is one (a numpy integer too), else as it is."""
    try:
        return operator.index(value)
    except TypeError:
        return value


def _source(what: str, from_process: Any, size: int) -> None:
    """Refuse a `from_process` that is no rank (every rank named it: checked after the
    exchange, so a rank alone with a bad one cannot leave the others waiting)."""
    if not isinstance(from_process, int):
        raise ConfigurationError(f"{what}(from_process={from_process!r}): expected a rank (int)")
    if not 0 <= from_process < size:
        raise ConfigurationError(
            f"{what}(from_process={from_process}) is not a rank of this job of {size}",
            f"use a rank from 0 to {size - 1}.",
        )


def broadcast(comm: Comm, data: Any, from_process: int = 0) -> Any:
    """Collective: every rank of `comm` must call it, naming the same `from_process`. Rank
    `from_process`'s tensors copied into every rank's, in place.

    Args:
        comm: the job's communicator.
        data: a tensor, or nested lists, tuples and dicts of tensors, of the same structure,
            dtypes and shapes on every rank.
        from_process: the rank whose tensors every rank receives.

    Raises:
        ConfigurationError: when `from_process` is not a rank of the job.
        DistributedOperationException: on every rank, when the ranks' data disagree.
    """
    from_process = _as_rank(from_process)
    if comm.size == 1:
        _source("broadcast", from_process, 1)
        return data
    operation = f"broadcast(from_process={from_process!r})"
    exchanged = _metadata(comm, data, "broadcast", operation)
    _source("broadcast", from_process, comm.size)
    _check("broadcast", exchanged, "shape")
    return _rebuild(data, lambda t: distributed.broadcast(t, from_process))


def broadcast_object_list(comm: Comm, objects: list[Any], from_process: int = 0) -> list[Any]:
    """Collective: rank `from_process`'s list of picklable objects on every rank, put in place
    of `objects`' items (over MPI). Every rank must name the same `from_process`: it rides
    in the one exchange, so a rank naming another is one error on every rank, naming them.

    Args:
        comm: the job's communicator.
        objects: on rank `from_process` the list sent, elsewhere the list whose items are
            replaced.
        from_process: the rank whose list every rank receives.

    Raises:
        ConfigurationError: when `from_process` is not a rank of the job.
        CollectiveMismatchError: on every rank, when the ranks name different ones.
    """
    from_process = _as_rank(from_process)
    operation = f"broadcast_object_list(from_process={from_process!r})"
    mine = list(objects) if from_process == comm.rank else None
    parts = _exchange(comm, operation, mine, "broadcast_object_list")
    _source("broadcast_object_list", from_process, comm.size)
    objects[:] = parts[from_process]
    return objects


def copy_tensor_to_devices(
    comm: Comm, tensor: torch.Tensor | None, device: torch.device | str
) -> torch.Tensor:
    """Collective: the tensor exactly one rank passes (the others pass None), as a new tensor on
    `device` on every rank. Unlike broadcast, the others need not know its shape or dtype: they
    ride in one exchange, which also finds the holder (none, or several, is the same error on
    every rank).

    Args:
        comm: the job's communicator.
        tensor: the tensor on the rank that holds it, None on every other rank.
        device: where every rank's copy is made.

    Raises:
        DistributedOperationException: on every rank, when no rank or several passed one.
    """
    held = (tuple(tensor.shape), str(tensor.dtype)) if tensor is not None else None
    facts = _exchange(comm, "copy_tensor_to_devices", held, "copy_tensor_to_devices")
    holders = [rank for rank, fact in enumerate(facts) if fact is not None]
    if len(holders) != 1:
        raise DistributedOperationException(
            "copy_tensor_to_devices needs the tensor on exactly one rank; "
            f"{_rank_list(holders) if holders else 'no rank'} passed one",
            "pass the tensor on the rank that has it and None on every other rank, or use "
            "broadcast() when every rank holds a tensor of the same shape.",
            "copy_tensor_to_devices",
        )
    shape, dtype = facts[holders[0]]
    if tensor is None:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device)
    else:
        tensor = tensor.to(device, copy=True)
    return tensor if comm.size == 1 else distributed.broadcast(tensor, holders[0])


def pad_across_processes(
    comm: Comm, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Collective: every rank of `comm` must call it. Each tensor padded along `dim` to the
    largest size any rank has there, with `pad_index`.

    Args:
        comm: the job's communicator.
        data: a tensor, or nested lists, tuples and dicts of tensors, of the same structure,
            number of dimensions and dtypes on every rank. A tensor without dimension `dim`,
            or a nested tensor (with a CannotPadNestedTensorWarning), is returned as it is.
        dim: the dimension to pad (negative counts from the end).
        pad_index: the value the new entries hold.
        pad_first: put the padding before the data instead of after it.

    Raises:
        DistributedOperationException: on every rank, when the ranks' data disagree.
    """
    # Each rank pads only `dim`, so other dimensions may differ; the structure, the number of
    # dimensions and the dtypes may not (else ranks would fail, or not, one by one).
    metas = _check("pad_across_processes", _metadata(comm, data, "pad_across_processes"), "ndim")
    counter = iter(range(len(metas[0])))

    def one(tensor: torch.Tensor) -> torch.Tensor:
        leaf = next(counter)
        if tensor.is_nested:
            warnings.warn(
                "pad_across_processes cannot pad a nested tensor (its sizes are ragged): "
                "returned as it is",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return tensor
        if not -tensor.ndim <= dim < tensor.ndim:
            return tensor  # no such dimension here (0-d, or fewer dimensions): as it is
        axis = dim % tensor.ndim
        longest = max(m[leaf][0][axis] for m in metas)
        if tensor.shape[axis] >= longest:
            return tensor
        shape = list(tensor.shape)
        shape[axis] = longest
        out = tensor.new_full(shape, pad_index)
        index = [slice(None)] * tensor.ndim
        size = tensor.shape[axis]
        index[axis] = slice(longest - size, longest) if pad_first else slice(0, size)
        out[tuple(index)] = tensor
        return out

    return _rebuild(data, one)


def rows_to_gather(data: Any, keep: bool) -> Any:
    """Not collective. What one rank adds to a gather: every tensor of `data` as rows (a 0-d
    tensor as one row, as gather counts it), all of them if `keep`, else none (the trailing
    dimensions kept, so that the ranks' tensors still agree in gather's shape check).

    Args:
        data: a tensor, or nested lists, tuples and dicts of tensors.
        keep: add the rows; False: add none.
    """

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.reshape(1) if tensor.ndim == 0 else tensor
        return flat if keep else flat[:0]

    return _rebuild(data, rows)


def truncate(data: Any, count: int) -> Any:
    """Not collective. The first `count` rows of every tensor.

    Args:
        data: a tensor, or nested lists, tuples and dicts of tensors.
        count: how many rows to keep.
    """
    return _rebuild(data, lambda t: t[:count])
