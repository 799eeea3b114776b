"""Loading checkpoints into state dicts whose tensors may be DTensors, at any world size and
sharding: each rank reads only the rows it owns (of a sharded checkpoint, format 2, or of an
ordinary one, format 1), verifies them, and only then writes them into the target.

Call sequence of `load_sharded` (collective, every rank, each with its own target):
  1. every rank reads the index (with every check CheckpointReader makes) and matches the target
     against it: a key or global shape that differs is the same error on every rank;
  2. every rank verifies its rows (the blocks of a sliced tensor that hold them; the whole
     tensor's checksum for a tensor of an ordinary checkpoint) by streaming them from the files
     through a small buffer into the hashes, nothing else written; all ranks agree it worked;
  3. every rank reads its rows again, straight into the target's (local) tensors: from the page
     cache, as a rule, where the first pass left them. A failure before this step leaves every
     target as it was, on every rank; one in it (a file changed since step 2, an I/O error) is
     still one error on every rank.
Step 3 reads in place rather than into new memory and then copying: fresh memory costs 1-3 s
per GiB on these VMs (page faults), more than the disk. Tensors that cannot be read in place
(another dtype, not contiguous, memory shared with another target, nothing in the target to
read into), and all of them where the bytes all ranks read would not fit comfortably in the
page cache (the second pass would go to the disk again), are read in step 2 into new memory,
verified there, and copied into the target after step 3.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..comm import Comm, agreement
from . import rawio
from .format import (
    CheckpointCollectiveError,
    CheckpointError,
    dataset_name,
    flatten,
    from_numpy,
    storage_dtype,
    unflatten,
)
from .index import SlicedTensor, TensorEntry
from .read_plan import claim, writable_as
from .reader import CheckpointReader
from .sharded import SHARDED_STEM, Rows, localize, row_count
from .sharded_tasks import (
    Item,
    read_error,
    slice_checks,
    slice_fills,
    slice_tasks,
    spans_of,
    whole_fills,
    whole_tasks,
)


@dataclass
class Plan:
    documents: dict[str, Any] = field(default_factory=dict)
    items: list[Item] = field(default_factory=list)
    originals: dict[str, dict[str, Any]] = field(default_factory=dict)  # component -> name -> obj


def _names(document: Any) -> set[str]:
    names: set[str] = set()
    unflatten(document, lambda name, kind: names.add(name))
    return names


def differences(reader: CheckpointReader, component: str, tree: Any) -> list[str]:
    """The names of the checkpoint's tensors in `component` that the state tree `tree` (a
    target, as plan() takes it) lacks ("state.0.exp_avg"): what plan() lets pass. Not
    collective."""
    document = reader.index.components.get(component)
    if document is None:
        return []
    local_tree, _ = localize(tree, component)
    _, tensors = flatten(local_tree, component)
    return sorted(_names(document) - set(tensors))


def _stored(entry: TensorEntry | SlicedTensor, key: str) -> np.dtype:
    dtype = storage_dtype(entry.dtype)
    if dtype is None:
        raise CheckpointError(
            f"cannot read {key!r} ({entry.dtype}) in part: its dtype is known only to its file",
            "load it with mpaccel.checkpoint.CheckpointReader instead.",
        )
    return dtype


def plan(reader: CheckpointReader, target: Mapping[str, Any],
         in_place_ranks: int | None = None) -> Plan:
    """Match `target` ({component: state tree}) against the checkpoint: every tensor of the
    target must be in it with the same global shape. Tensors of the checkpoint that the target
    lacks are read whole into new memory. `in_place_ranks` (how many ranks load alike): the
    target's tensors that allow it are read straight into (by fill_plan, once read_plan
    verified them), unless what they all read would not stay in the page cache
    (_keep_in_cache); None: all go through new memory and apply()."""
    in_place = in_place_ranks is not None
    index, out = reader.index, Plan()
    sliced = index.sliced
    where = reader.directory
    claimed: list[tuple[int, int]] = []  # memory read into in place (tied tensors: once)
    for component, tree in target.items():
        if component not in index.components:
            raise CheckpointError(
                f"{where!r} has no {component!r} (it holds {sorted(index.components)!r})",
                "name the components as they were saved.",
            )
        document = out.documents[component] = index.components[component]
        local_tree, dtensors = localize(tree, component)
        _, tensors = flatten(local_tree, component)
        saved = _names(document)
        originals = out.originals[component] = {}
        for name, value in tensors.items():
            key = dataset_name(component, name)
            if name not in saved:
                raise CheckpointError(
                    f"{key!r} is in the state to load but not in the checkpoint {where!r}",
                    "load into the model and optimizer that were saved (an optimizer that has "
                    "not stepped has no state to load into: leave it out, or step it first).",
                )
            entry = sliced.get(key) or index.tensors[key]
            held = dtensors.get(id(value))
            rows = held[0] if held is not None else Rows(
                0, row_count(value.shape), tuple(value.shape), True)
            if list(rows.shape) != list(entry.shape):
                raise CheckpointError(
                    f"{key!r} has shape {list(rows.shape)} in the state to load and "
                    f"{list(entry.shape)} in the checkpoint {where!r}",
                    "load into a model built as the saved one was (same configuration).",
                )
            if not isinstance(value, torch.Tensor):
                value = None  # a numpy array: read into new memory
            originals[name] = held[1] if held is not None else value
            local_shape = value.shape if value is not None else entry.shape
            stored = _stored(entry, key)
            view = _in_place(value, entry, stored, claimed) if in_place else None
            out.items.append(Item(key, entry, rows.start, rows.stop,
                                   None if view is not None else np.empty(local_shape, stored),
                                   value, view))
        for name in sorted(saved - set(tensors)):
            key = dataset_name(component, name)
            entry = sliced.get(key) or index.tensors[key]
            shape = entry.shape
            out.items.append(Item(key, entry, 0, row_count(shape),
                                   np.empty(shape, _stored(entry, key)), None))
    if in_place_ranks is not None:
        _keep_in_cache(out, in_place_ranks)
    return out


def _in_place(value: torch.Tensor | None, entry: TensorEntry | SlicedTensor, stored: np.dtype,
              claimed: list[tuple[int, int]]) -> np.ndarray | None:
    """A view of `value` to read its rows straight into, or None (then new memory)."""
    if value is None or value.dim() == 0 or not value.numel():
        return None
    view = writable_as(value, entry.dtype, value.shape)
    if view is None or view.dtype != stored or not claim(claimed, view):
        return None
    return view


def _keep_in_cache(planned: Plan, ranks: int) -> None:
    """Read into new memory instead of in place unless what `ranks` ranks like this one read
    fits in half the memory the kernel could give the page cache: the in-place read is a second
    pass, fast only where the first one left the bytes in the cache."""
    views = [(item, item.into) for item in planned.items if item.into is not None]
    verified = sum(item.entry.nbytes if isinstance(item.entry, TensorEntry) else into.nbytes
                   for item, into in views)
    room = rawio.page_cache_room()
    if room is None or verified * ranks <= room // 2:
        return
    for item, into in views:
        item.out, item.into = np.empty(into.shape, into.dtype), None


def read_plan(reader: CheckpointReader, planned: Plan) -> None:
    """Read and verify every item into its new memory (item.out), or, one to be read in place,
    verify it in the file. Not collective."""
    tasks: list[rawio.ReadTask] = []
    for item in planned.items:
        if not isinstance(item.entry, SlicedTensor):
            tasks += whole_tasks(reader, item)
        elif item.out is None:
            tasks += slice_checks(item, spans_of(reader, item))
        else:
            tasks += slice_tasks(reader, item)
    if tasks:
        rawio.read_arrays(tasks, read_error)


def fill_plan(reader: CheckpointReader, planned: Plan) -> None:
    """Read the items read_plan verified in the files straight into their targets. Not
    collective; call it only once every rank's read_plan worked."""
    tasks: list[rawio.ReadTask] = []
    for item in planned.items:
        if item.into is None or not item.into.size:
            continue
        if isinstance(item.entry, SlicedTensor):
            tasks += slice_fills(item, spans_of(reader, item))
        else:
            tasks += whole_fills(reader, item)
    if tasks:
        rawio.read_arrays(tasks, read_error)


def apply(planned: Plan) -> dict[str, Any]:
    """Copy what was read into the targets; returns {component: state tree} with the target's
    objects (filled) where it had them, new tensors elsewhere, the saved non-tensor values."""
    loaded: dict[str, Any] = {}
    for item in planned.items:
        component, _, _ = item.key.partition("/")
        if item.out is None:  # read in place (fill_plan)
            loaded[item.key] = item.target
            continue
        tensor = from_numpy(item.out, item.entry.dtype) if not item.entry.dtype.startswith(
            "numpy.") else item.out
        if item.target is not None and isinstance(tensor, torch.Tensor):
            with torch.no_grad():
                item.target.copy_(tensor)
        loaded[item.key] = tensor
    result = {}
    for component, document in planned.documents.items():
        originals = planned.originals.get(component, {})

        def load(name: str, kind: str, component: str = component,
                 originals: Mapping[str, Any] = originals) -> Any:
            if name in originals and originals[name] is not None:
                return originals[name]
            return loaded[dataset_name(component, name)]

        result[component] = unflatten(document, load)
    return result


def load_sharded(
    comm: Comm,
    directory: str | os.PathLike[str],
    target: Mapping[str, Any],
    *,
    stem: str = SHARDED_STEM,
) -> dict[str, Any]:
    """Collective. Load checkpoint `directory` into `target` ({component: state dict}, as given
    to save_sharded, at any world size and sharding; or a state of plain tensors), in place:
    each DTensor's local tensor gets the rows it owns, each plain tensor all of it. Returns
    {component: state} with the target's tensors, tensors of the checkpoint the target lacks
    (whole, in new memory) and the saved non-tensor values: hand it to load_state_dict().
    `stem="state"` or `"model"` loads an ordinary (replicated) mpaccel checkpoint this way.
    All or nothing: on any failure on any rank, every rank raises the same error and no target
    tensor has changed."""
    directory = os.fspath(directory)
    what = f"loading sharded checkpoint {directory!r}"
    limit = rawio.stall_limit(comm.default_timeout)
    readers: list[CheckpointReader] = []
    planned = Plan()
    try:
        with agreement(comm, what + " (matching the state)", kind=CheckpointCollectiveError):
            readers.append(rawio.within(limit, what, lambda: CheckpointReader(directory, stem)))
            planned = plan(readers[0], target, in_place_ranks=comm.size)
        with agreement(comm, what + " (reading)", kind=CheckpointCollectiveError):
            rawio.within(limit, what, functools.partial(read_plan, readers[0], planned))
        with agreement(comm, what + " (reading in place)", kind=CheckpointCollectiveError):
            rawio.within(limit, what, functools.partial(fill_plan, readers[0], planned))
    finally:
        for reader in readers:
            reader.close()
    return apply(planned)


def read_full(directory: str, stem: str, component: str) -> Any:
    """One component of a checkpoint with whole tensors (one process; `mpaccel ckpt export`)."""
    with CheckpointReader(directory, stem) as reader:
        planned = plan(reader, {component: {}})
        read_plan(reader, planned)
    return apply(planned)[component]


def verify_sliced(reader: CheckpointReader) -> tuple[int, list[str]]:
    """Check every slice of every sliced tensor (all its blocks): (tensors, problems)."""
    problems: list[str] = []
    sliced = reader.index.sliced
    for key, entry in sliced.items():
        try:
            shape = entry.shape
            item = Item(key, entry, 0, row_count(shape), np.empty(shape, _stored(entry, key)),
                         None)
            tasks = slice_tasks(reader, item)
            if tasks:
                rawio.read_arrays(tasks, read_error)
        except CheckpointError as exc:
            problems.append(str(exc))
    return len(sliced), problems

