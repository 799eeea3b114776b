"""Loading checkpoints into state dicts whose tensors may be DTensors, at any world size and
sharding (with the read and verify tasks of each row range): each rank reads only the rows it
owns (of a sharded checkpoint, format 2 or 3, or of an ordinary one, format 1), verifies them, and
only then writes them into the target.

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
Where either side holds N-D blocks (tensor parallelism), step 2 reads the checksum blocks of
each saved block that the rank needs into new memory, verifies them, keeps the elements it
needs (block_tasks), and apply() copies them in after step 3.
Step 3 reads in place rather than into new memory and then copying: fresh memory costs 1-3 s
per GiB on these VMs (page faults), more than the disk. Tensors that cannot be read in place
(another dtype, not contiguous, memory shared with another target, nothing in the target to
read into), and all of them where the bytes all ranks read would not fit comfortably in the
page cache (the second pass would go to the disk again), are read in step 2 into new memory,
verified there, and copied into the target after step 3.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ...comm import Comm, agreement
from ...errors import CheckpointCollectiveError, CheckpointError
from .. import rawio
from ..format import checksum, dataset_name, flatten, from_numpy, storage_dtype, unflatten
from ..index import RowSlice, SlicedTensor, TensorEntry
from ..reader import CheckpointReader, claim, writable_as
from .save import SHARDED_STEM, Box, Rows, localize, row_count


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
            blocks = bool(rows.boxes) or (isinstance(entry, SlicedTensor) and entry.blocks)
            view = _in_place(value, entry, stored, claimed) if in_place and not blocks else None
            out.items.append(Item(key, entry, rows.start, rows.stop,
                                   None if view is not None else np.empty(local_shape, stored),
                                   value, view, rows.boxes))
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
        if item.boxes or (isinstance(item.entry, SlicedTensor) and item.entry.blocks):
            tasks += block_tasks(reader, item)
        elif not isinstance(item.entry, SlicedTensor):
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
            tasks = (block_tasks if entry.blocks else slice_tasks)(reader, item)
            if tasks:
                rawio.read_arrays(tasks, read_error)
        except CheckpointError as exc:
            problems.append(str(exc))
    return len(sliced), problems


def read_error(task: rawio.ReadTask, exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"cannot read {task.key!r} from {task.path!r}: {exc}")


@dataclass
class Item:
    """One tensor to read: rows [start, stop) of `key` into `out` (new memory), then into
    `target` (the local tensor of a DTensor, a plain tensor, or None: a new tensor). Or, with
    `out` None, verified in the file and then read straight into `into` (a view of target)."""

    key: str
    entry: TensorEntry | SlicedTensor
    start: int
    stop: int
    out: np.ndarray | None
    target: torch.Tensor | None
    into: np.ndarray | None = None
    boxes: tuple[Box, ...] = ()  # the target's N-D blocks, where not rows in one piece (Rows)

    @property
    def dest(self) -> np.ndarray:
        """Where the rows land (for their dtype and shape)."""
        dest = self.out if self.out is not None else self.into
        assert dest is not None
        return dest


def bytes_per_row(entry: TensorEntry | SlicedTensor, dtype: np.dtype) -> int:
    shape = entry.shape
    return int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize


def rows_view(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    return array if array.ndim == 0 else array[start:stop]


def file_fd(reader: CheckpointReader, name: str) -> int:
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


@dataclass
class _Span:
    """The blocks [begin, end) of a saved slice (`piece`) that hold rows [low, high) of an
    item, at `offset` of file `fd`; `first`: the index of the first block in the slice."""

    piece: RowSlice
    path: str
    fd: int
    offset: int
    first: int
    begin: int
    end: int
    low: int
    high: int


def spans_of(reader: CheckpointReader, item: Item) -> list[_Span]:
    spans = []
    row_bytes = bytes_per_row(item.entry, item.dest.dtype)
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
        offset = piece.offset + (begin - piece.start) * row_bytes
        spans.append(_Span(piece, reader.path(piece.file), file_fd(reader, piece.file),
                           offset, first, begin, end, low, high))
    return spans


def slice_tasks(reader: CheckpointReader, item: Item) -> list[rawio.ReadTask]:
    """Tasks reading the blocks of each saved slice that overlap the item's rows (whole blocks:
    each is verified against its own checksum), then copying its rows into item.out."""
    assert item.out is not None
    tasks = []
    for span in spans_of(reader, item):
        piece, first, begin, end = span.piece, span.first, span.begin, span.end
        low, high, path, fd, offset = span.low, span.high, span.path, span.fd, span.offset
        exact = (begin, end) == (low, high)
        rest = item.out.shape[1:]
        buffer = (rows_view(item.out, low - item.start, high - item.start) if exact
                  else np.empty((end - begin, *rest), item.out.dtype))

        check = functools.partial(_check_blocks, item, piece, first, begin, (low, high),
                                  exact, path)
        if buffer.size:
            tasks.append(rawio.ReadTask(item.key, path, fd, offset, buffer, check))
    return tasks


class _BlockHashes:
    """A hasher (update, hexdigest) of consecutive blocks of `size` bytes (the last may be
    shorter): hexdigest() is the list of their xxh3 digests, as format.checksum gives them."""

    def __init__(self, size: int) -> None:
        self.size, self.left = size, size
        self.done: list[str] = []
        self.hasher = xxhash.xxh3_64()

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(self.left, len(data))
            self.hasher.update(data[:take])
            data, self.left = data[take:], self.left - take
            if not self.left:
                self.done.append(self.hasher.hexdigest())
                self.hasher, self.left = xxhash.xxh3_64(), self.size

    def hexdigest(self) -> list[str]:
        tail = [self.hasher.hexdigest()] if self.left != self.size else []
        return self.done + tail


def slice_checks(item: Item, spans: list[_Span]) -> list[rawio.ReadTask]:
    """Tasks verifying the blocks of each span in the file (streamed, nothing written)."""
    tasks = []
    row_bytes = bytes_per_row(item.entry, item.dest.dtype)
    for span in spans:
        block = span.piece.rows_per_block * row_bytes
        check = functools.partial(_check_digests, item, span)
        tasks.append(rawio.ReadTask(item.key, span.path, span.fd, span.offset, None, check,
                                    (span.end - span.begin) * row_bytes,
                                    functools.partial(_BlockHashes, block)))
    return tasks


def slice_fills(item: Item, spans: list[_Span]) -> list[rawio.ReadTask]:
    """Tasks reading each span's rows straight into item.into (verified again where the span
    is whole blocks: a file changed since the check is an error)."""
    assert item.into is not None
    tasks = []
    row_bytes = bytes_per_row(item.entry, item.into.dtype)
    for span in spans:
        exact = (span.begin, span.end) == (span.low, span.high)
        check = functools.partial(_check_blocks, item, span.piece, span.first, span.begin,
                                  (span.low, span.high), True, span.path) if exact else None
        offset = span.offset + (span.low - span.begin) * row_bytes
        tasks.append(rawio.ReadTask(item.key, span.path, span.fd, offset, rows_view(
            item.into, span.low - item.start, span.high - item.start), check))
    return tasks


def _mismatch(item: Item, piece: RowSlice, block: int, path: str) -> CheckpointError:
    row = piece.start + block * piece.rows_per_block
    return CheckpointError(
        f"checksum mismatch for {item.key!r} (rows from {row}) in {path!r}: the file "
        "is corrupted",
        "restore the file from a copy, or load an earlier checkpoint.",
    )


def _check_digests(item: Item, span: _Span, found: list[str]) -> None:
    """Compare the digests of a span's blocks, as streamed, with those of the index."""
    expected = span.piece.xxh3[span.first:]
    for j, digest in enumerate(found):
        if j >= len(expected) or digest != expected[j]:
            raise _mismatch(item, span.piece, span.first + j, span.path)


def _check_blocks(item: Item, piece: RowSlice, first: int, begin: int,
                  rows: tuple[int, int], exact: bool, path: str, array: np.ndarray) -> None:
    """Verify blocks first.. of a slice read into `array` (from row `begin`); then, unless it
    was read straight into item.out, copy the item's `rows` from it there."""
    _verify_blocks(item, piece, first, path, array)
    if not exact:
        assert item.out is not None
        low, high = rows
        rows_view(item.out, low - item.start, high - item.start)[...] = array[
            low - begin : high - begin]


def _verify_blocks(item: Item, piece: RowSlice, first: int, path: str, array: np.ndarray) -> None:
    """Verify the checksum blocks first.. of a slice, read into `array`."""
    per_block = piece.rows_per_block
    count = 1 if array.ndim == 0 else -(-len(array) // per_block)
    for j in range(count):
        block = array if array.ndim == 0 else array[j * per_block : (j + 1) * per_block]
        if checksum(block) != piece.xxh3[first + j]:
            raise _mismatch(item, piece, first + j, path)


def target_boxes(item: Item) -> tuple[Box, ...]:
    """Not collective. The item's blocks: its target's N-D blocks, or its rows as one block."""
    if item.boxes:
        return item.boxes
    shape = tuple(item.entry.shape)
    if not shape:
        return (Box((), (), ()),)
    return (Box((item.start, *[0] * (len(shape) - 1)), (item.stop, *shape[1:]),
                (0,) * len(shape)),)


def _cut(box: Box, start: tuple[int, ...], stop: tuple[int, ...]) -> tuple | None:
    """(box, low, high): the part of `box` within [start, stop), or None if there is none."""
    low = tuple(max(a, b) for a, b in zip(box.start, start))
    high = tuple(min(a, b) for a, b in zip(box.stop, stop))
    return (box, low, high) if all(a < b for a, b in zip(low, high)) else None


def _place(item: Item, cuts: list[tuple], origin: tuple[int, ...], array: np.ndarray) -> None:
    """Copy each cut (box, low, high) from `array` (whose element 0 is global `origin`) to
    where the box lies in item.out."""
    assert item.out is not None
    for box, low, high in cuts:
        source = tuple(slice(a - o, b - o) for a, b, o in zip(low, high, origin))
        dest = tuple(slice(at + a - s, at + b - s)
                     for a, b, s, at in zip(low, high, box.start, box.local))
        item.out[dest] = array[source]


def _check_and_place(item: Item, piece: RowSlice, first: int, origin: tuple[int, ...],
                     cuts: list[tuple], path: str, array: np.ndarray) -> None:
    _verify_blocks(item, piece, first, path, array)
    _place(item, cuts, origin, array)


def _whole_and_place(item: Item, cuts: list[tuple], path: str, array: np.ndarray) -> None:
    assert isinstance(item.entry, TensorEntry)
    _check_whole(item.key, item.entry, path, array)
    _place(item, cuts, (0,) * array.ndim, array)


def block_tasks(reader: CheckpointReader, item: Item) -> list[rawio.ReadTask]:
    """Not collective. Tasks for an item read block by block (N-D blocks on either side:
    tensor parallelism): of each saved slice, the checksum blocks that hold elements of the
    item's blocks are read into new memory, verified, and the elements the item needs copied
    to item.out. From an ordinary checkpoint, the whole tensor (it has one checksum)."""
    assert item.out is not None
    entry, shape = item.entry, tuple(item.entry.shape)
    targets = target_boxes(item)
    if not item.out.size:
        return []
    if isinstance(entry, TensorEntry):
        cuts = [c for c in (_cut(b, (0,) * len(shape), shape) for b in targets) if c]
        if entry.offset is None or not _size_recorded(reader, entry.file):
            _place(item, cuts, (0,) * len(shape), reader.read_array(item.key, entry, verify=True))
            return []
        path = reader.path(entry.file)
        whole = np.empty(shape, item.out.dtype)
        return [rawio.ReadTask(item.key, path, file_fd(reader, entry.file), entry.offset, whole,
                               functools.partial(_whole_and_place, item, cuts, path))]
    tasks = []
    for piece in entry.slices:
        start, stop = piece.box(shape)
        cuts = [c for c in (_cut(b, start, stop) for b in targets) if c]
        if not cuts:
            continue
        per_block = piece.rows_per_block
        inner = tuple(b - a for a, b in zip(start[1:], stop[1:]))
        low = min(c[1][0] for c in cuts) if shape else 0
        high = max(c[2][0] for c in cuts) if shape else 1
        first = (low - piece.start) // per_block
        begin = piece.start + first * per_block
        end = min(piece.stop, piece.start + -(-(high - piece.start) // per_block) * per_block)
        buffer = np.empty((end - begin, *inner) if shape else (), item.out.dtype)
        row_bytes = math.prod(inner) * item.out.dtype.itemsize
        path = reader.path(piece.file)
        check = functools.partial(_check_and_place, item, piece, first,
                                  (begin, *start[1:]), cuts, path)
        tasks.append(rawio.ReadTask(item.key, path, file_fd(reader, piece.file),
                                    piece.offset + (begin - piece.start) * row_bytes, buffer,
                                    check))
    return tasks


def whole_tasks(reader: CheckpointReader, item: Item) -> list[rawio.ReadTask]:
    """Tasks for a tensor of an ordinary checkpoint: its rows, and, where they are not all of
    it, the whole tensor streamed through the checksum (it has one checksum only)."""
    entry, key = item.entry, item.key
    assert isinstance(entry, TensorEntry)
    total = row_count(entry.shape)
    whole = (item.start, item.stop) == (0, total)
    if not item.dest.size:
        return []
    if entry.offset is None or not _size_recorded(reader, entry.file):
        # no offset the index vouches for (an old file, or one another tool rewrote): HDF5
        # finds the data, and the whole tensor is read to verify it
        if item.into is not None:  # into new memory: there is nothing to stream
            item.out, item.into = np.empty(item.into.shape, item.into.dtype), None
        array = reader.read_array(key, entry, verify=True)
        item.dest[...] = rows_view(array, item.start, item.stop)
        return []
    fd = file_fd(reader, entry.file)
    path = reader.path(entry.file)
    row_bytes = bytes_per_row(entry, item.dest.dtype)
    verify = functools.partial(_check_whole, key, entry, path)
    if item.out is None:  # read in place by whole_fills, once verified here
        return [rawio.ReadTask(key, path, fd, entry.offset, None, verify, entry.nbytes,
                               xxhash.xxh3_64)]
    offset = entry.offset + item.start * row_bytes
    if whole:
        return [rawio.ReadTask(key, path, fd, offset, item.out, verify)]
    return [
        rawio.ReadTask(key, path, fd, offset, item.out, None),
        rawio.ReadTask(key, path, fd, entry.offset, None, verify, entry.nbytes,
                       xxhash.xxh3_64),
    ]


def whole_fills(reader: CheckpointReader, item: Item) -> list[rawio.ReadTask]:
    """The task reading an item whole_tasks verified in the file straight into item.into
    (verified again where it is the whole tensor: a file changed since is an error)."""
    assert item.into is not None
    entry = item.entry
    assert isinstance(entry, TensorEntry) and entry.offset is not None
    path = reader.path(entry.file)
    whole = (item.start, item.stop) == (0, row_count(entry.shape))
    check = functools.partial(_check_whole, item.key, entry, path) if whole else None
    offset = entry.offset + item.start * bytes_per_row(entry, item.into.dtype)
    return [rawio.ReadTask(item.key, path, file_fd(reader, entry.file), offset, item.into,
                           check)]


def _check_whole(key: str, entry: TensorEntry, path: str, found: Any) -> None:
    """`found` (an array, or the hex digest of its bytes) against the tensor's checksum."""
    digest = found if isinstance(found, str) else checksum(found)
    if digest != entry.xxh3:
        raise CheckpointError(
            f"checksum mismatch for {key!r} in {path!r}: the file is corrupted",
            "restore the file from a copy, or load an earlier checkpoint.",
        )


def _size_recorded(reader: CheckpointReader, name: str) -> bool:
    return reader.opened(name)[1] == reader.index.file_sizes.get(name)
