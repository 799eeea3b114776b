"""The read tasks of a sharded load (sharded_read.py plans the load; this says how each tensor's
bytes are read): the blocks of a sliced tensor (format 2) that hold a rank's rows, or the rows of
a tensor of an ordinary checkpoint (format 1); each either read into new memory and verified
there, verified in the file by streaming it through the hashes, or read in place once verified.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from . import rawio
from .format import CheckpointError, checksum
from .index import RowSlice, SlicedTensor, TensorEntry
from .reader import CheckpointReader
from .sharded import row_count


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
    per_block = piece.rows_per_block
    count = 1 if array.ndim == 0 else -(-len(array) // per_block)
    for j in range(count):
        block = array if array.ndim == 0 else array[j * per_block : (j + 1) * per_block]
        if checksum(block) != piece.xxh3[first + j]:
            raise _mismatch(item, piece, first + j, path)
    if not exact:
        assert item.out is not None
        low, high = rows
        rows_view(item.out, low - item.start, high - item.start)[...] = array[
            low - begin : high - begin]


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
