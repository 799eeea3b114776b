"""Loading checkpoints into state dicts whose tensors may be DTensors, at any world size and
sharding: each rank reads only the rows it owns (of a sharded checkpoint, format 2, or of an
ordinary one, format 1), verifies them, and only then writes them into the target.

Call sequence of `load_sharded` (collective, every rank, each with its own target):
  1. every rank reads the index (with every check CheckpointReader makes) and matches the target
     against it: a key or global shape that differs is the same error on every rank;
  2. every rank reads its rows into new memory and verifies them (the blocks of a sliced tensor
     that hold its rows; the whole tensor's checksum for a tensor of an ordinary checkpoint read
     in part, streamed through a small buffer); all ranks agree it worked;
  3. the rows are copied into the target's (local) tensors. A failure before this step leaves
     every target as it was, on every rank.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ..comm import Comm, agreement
from . import rawio
from .format import (
    CheckpointCollectiveError,
    CheckpointError,
    checksum,
    dataset_name,
    flatten,
    from_numpy,
    storage_dtype,
    unflatten,
)
from .index import RowSlice, SlicedTensor, TensorEntry
from .reader import CheckpointReader
from .sharded import SHARDED_STEM, Rows, localize, row_count


def _error(task: rawio.ReadTask, exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"cannot read {task.key!r} from {task.path!r}: {exc}")


@dataclass
class _Item:
    """One tensor to read: rows [start, stop) of `key` into `out` (new memory), then into
    `target` (the local tensor of a DTensor, a plain tensor, or None: a new tensor)."""

    key: str
    entry: TensorEntry | SlicedTensor
    start: int
    stop: int
    out: np.ndarray
    target: torch.Tensor | None


@dataclass
class Plan:
    documents: dict[str, Any] = field(default_factory=dict)
    items: list[_Item] = field(default_factory=list)
    originals: dict[str, dict[str, Any]] = field(default_factory=dict)  # component -> name -> obj


def _names(document: Any) -> set[str]:
    names: set[str] = set()
    unflatten(document, lambda name, kind: names.add(name))
    return names


def _stored(entry: TensorEntry | SlicedTensor, key: str) -> np.dtype:
    dtype = storage_dtype(entry.dtype)
    if dtype is None:
        raise CheckpointError(
            f"cannot read {key!r} ({entry.dtype}) in part: its dtype is known only to its file",
            "load it with mpaccel.checkpoint.CheckpointReader instead.",
        )
    return dtype


def plan(reader: CheckpointReader, target: Mapping[str, Any]) -> Plan:
    """Match `target` ({component: state tree}) against the checkpoint: every tensor of the
    target must be in it with the same global shape. Tensors of the checkpoint that the target
    lacks are read whole into new memory."""
    index, out = reader.index, Plan()
    sliced = index.sliced
    where = reader.directory
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
            out.items.append(_Item(key, entry, rows.start, rows.stop,
                                   np.empty(local_shape, _stored(entry, key)), value))
        for name in sorted(saved - set(tensors)):
            key = dataset_name(component, name)
            entry = sliced.get(key) or index.tensors[key]
            shape = entry.shape
            out.items.append(_Item(key, entry, 0, row_count(shape),
                                   np.empty(shape, _stored(entry, key)), None))
    return out


def _row_bytes(entry: TensorEntry | SlicedTensor, dtype: np.dtype) -> int:
    shape = entry.shape
    return int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize


def _rows_view(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    return array if array.ndim == 0 else array[start:stop]


def _file(reader: CheckpointReader, name: str) -> int:
    """The checked descriptor of `name`, which must have the size the index recorded (its
    offsets are then within it: index_check)."""
    fd, real = reader.opened(name)
    size = reader.index.file_sizes.get(name)
    if real != size:
        raise CheckpointError(
            f"{reader.path(name)!r} holds {real} bytes, the index says {size}",
            "the file was changed after the save; restore it, or load an earlier checkpoint.",
        )
    return fd


def _slice_tasks(reader: CheckpointReader, item: _Item) -> list[rawio.ReadTask]:
    """Tasks reading the blocks of each saved slice that overlap the item's rows (whole blocks:
    each is verified against its own checksum), then copying its rows into item.out."""
    tasks = []
    row_bytes = _row_bytes(item.entry, item.out.dtype)
    assert isinstance(item.entry, SlicedTensor)
    for piece in item.entry.slices:
        low, high = max(item.start, piece.start), min(item.stop, piece.stop)
        if low >= high:
            continue
        per_block = piece.rows_per_block
        first = (low - piece.start) // per_block
        last = -(-(high - piece.start) // per_block)
        begin = piece.start + first * per_block
        end = min(piece.stop, piece.start + last * per_block)
        path = reader.path(piece.file)
        fd = _file(reader, piece.file)
        offset = piece.offset + (begin - piece.start) * row_bytes
        exact = (begin, end) == (low, high)
        rest = item.out.shape[1:]
        buffer = (_rows_view(item.out, low - item.start, high - item.start) if exact
                  else np.empty((end - begin, *rest), item.out.dtype))

        check = functools.partial(_check_blocks, item, piece, first, begin, (low, high),
                                  exact, path)
        if buffer.size:
            tasks.append(rawio.ReadTask(item.key, path, fd, offset, buffer, check))
    return tasks


def _check_blocks(item: _Item, piece: RowSlice, first: int, begin: int,
                  rows: tuple[int, int], exact: bool, path: str, array: np.ndarray) -> None:
    """Verify blocks first.. of a slice read into `array` (from row `begin`); then, unless it
    was read straight into item.out, copy the item's `rows` from it there."""
    per_block = piece.rows_per_block
    count = 1 if array.ndim == 0 else -(-len(array) // per_block)
    for j in range(count):
        block = array if array.ndim == 0 else array[j * per_block : (j + 1) * per_block]
        if checksum(block) != piece.xxh3[first + j]:
            row = piece.start + (first + j) * per_block
            raise CheckpointError(
                f"checksum mismatch for {item.key!r} (rows from {row}) in {path!r}: the file "
                "is corrupted",
                "restore the file from a copy, or load an earlier checkpoint.",
            )
    if not exact:
        low, high = rows
        _rows_view(item.out, low - item.start, high - item.start)[...] = array[
            low - begin : high - begin]


def _whole_tasks(reader: CheckpointReader, item: _Item) -> list[rawio.ReadTask]:
    """Tasks for a tensor of an ordinary checkpoint: its rows, and, where they are not all of
    it, the whole tensor streamed through the checksum (it has one checksum only)."""
    entry, key = item.entry, item.key
    assert isinstance(entry, TensorEntry)
    total = row_count(entry.shape)
    whole = (item.start, item.stop) == (0, total)
    if not item.out.size:
        return []
    if entry.offset is None or not _size_recorded(reader, entry.file):
        # no offset the index vouches for (an old file, or one another tool rewrote): HDF5
        # finds the data, and the whole tensor is read to verify it
        array = reader.read_array(key, entry, verify=True)
        item.out[...] = _rows_view(array, item.start, item.stop)
        return []
    fd = _file(reader, entry.file)
    path = reader.path(entry.file)
    row_bytes = _row_bytes(entry, item.out.dtype)

    def verify(found: Any) -> None:
        digest = found if isinstance(found, str) else checksum(found)
        if digest != entry.xxh3:
            raise CheckpointError(
                f"checksum mismatch for {key!r} in {path!r}: the file is corrupted",
                "restore the file from a copy, or load an earlier checkpoint.",
            )

    offset = entry.offset + item.start * row_bytes
    if whole:
        return [rawio.ReadTask(key, path, fd, offset, item.out, verify)]
    return [
        rawio.ReadTask(key, path, fd, offset, item.out, None),
        rawio.ReadTask(key, path, fd, entry.offset, None, verify, entry.nbytes,
                       xxhash.xxh3_64),
    ]


def _size_recorded(reader: CheckpointReader, name: str) -> bool:
    return reader.opened(name)[1] == reader.index.file_sizes.get(name)


def read_plan(reader: CheckpointReader, planned: Plan) -> None:
    """Read and verify every item into its new memory (item.out). Not collective."""
    tasks: list[rawio.ReadTask] = []
    for item in planned.items:
        if isinstance(item.entry, SlicedTensor):
            tasks += _slice_tasks(reader, item)
        else:
            tasks += _whole_tasks(reader, item)
    if tasks:
        rawio.read_arrays(tasks, _error)


def apply(planned: Plan) -> dict[str, Any]:
    """Copy what was read into the targets; returns {component: state tree} with the target's
    objects (filled) where it had them, new tensors elsewhere, the saved non-tensor values."""
    loaded: dict[str, Any] = {}
    for item in planned.items:
        component, _, _ = item.key.partition("/")
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
            planned = plan(readers[0], target)
        with agreement(comm, what + " (reading)", kind=CheckpointCollectiveError):
            rawio.within(limit, what, functools.partial(read_plan, readers[0], planned))
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
            item = _Item(key, entry, 0, row_count(shape), np.empty(shape, _stored(entry, key)),
                         None)
            tasks = _slice_tasks(reader, item)
            if tasks:
                rawio.read_arrays(tasks, _error)
        except CheckpointError as exc:
            problems.append(str(exc))
    return len(sliced), problems

