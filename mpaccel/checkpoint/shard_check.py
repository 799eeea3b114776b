"""Checking an HDF5 shard's own layout against the index before any of its data is read
(reader.py calls this once files.py opened the shard)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from .format import CheckpointError, _numpy_storable, storage_dtype
from .index import TensorEntry

_DAMAGED = "the file was damaged or crafted; restore it from a copy, or load another checkpoint."


def check_file(
    f: h5py.File, path: str, size: int, entries: Sequence[tuple[str, TensorEntry]]
) -> None:
    """Check, from HDF5's metadata alone, every dataset the index places in the file: a dataset
    of this very file reached through hard links, of the index's dtype, shape and size, its
    data stored contiguous or in unfiltered chunks that were all written, inside the file's
    `size` bytes and apart from every other dataset's. Anything else (virtual datasets,
    external storage, soft and external links, variable-length or reference types, filters,
    fill values and chunk layouts mpaccel never writes) is refused, naming the dataset.
    Through h5py's low-level API: these are thousands of small queries."""
    extents: list[tuple[int, int, str]] = []
    groups: dict[str, Any] = {}
    for key, entry in entries:
        try:
            component, name = key.split("/")
            if component not in groups:
                groups[component] = _open(f.id, component, path, component)
            dataset = _open(groups[component], name, path, key)
            if not isinstance(dataset, h5py.h5d.DatasetID):
                raise CheckpointError(f"{path!r}: {key!r} is not a dataset", _DAMAGED)
            spans = _check_dataset(dataset, path, key, entry, size)
            extents += [(offset, nbytes, key) for offset, nbytes in spans]
        except CheckpointError:
            raise
        except Exception as exc:  # HDF5 on damaged metadata: KeyError, OSError, RuntimeError...
            raise CheckpointError(
                f"{path!r}: cannot read the HDF5 metadata of {key!r}: {exc}", _DAMAGED
            ) from exc
    extents.sort()
    end, last = 0, ""
    for offset, nbytes, key in extents:
        if offset < end:
            raise CheckpointError(
                f"{path!r}: the data of {key!r} overlaps that of {last!r}", _DAMAGED
            )
        end, last = offset + nbytes, key


def _open(group: Any, name: str, path: str, key: str) -> Any:
    """The object `name` of `group` (low-level ids), if a hard link leads there: a soft or an
    external link is not followed (an external one would open another file)."""
    link = name.encode()
    if not group.links.exists(link):
        raise CheckpointError(f"{path!r} has no dataset {key!r}", _DAMAGED)
    kind = group.links.get_info(link).type
    if kind != h5py.h5l.TYPE_HARD:
        if kind == h5py.h5l.TYPE_EXTERNAL:
            target, inside = (part.decode(errors="replace") for part in group.links.get_val(link))
            what = f"an external link (to {target!r}:{inside!r})"
        elif kind == h5py.h5l.TYPE_SOFT:
            what = f"a soft link (to {group.links.get_val(link).decode(errors='replace')!r})"
        else:
            what = "a user-defined link"
        raise CheckpointError(
            f"{path!r}: {key!r} is {what}; checkpoint data is read from the shard's own datasets "
            "only, and links are not followed",
            _DAMAGED,
        )
    return h5py.h5o.open(group, link)


def _check_dataset(
    ds: h5py.h5d.DatasetID, path: str, key: str, entry: TensorEntry, size: int
) -> list[tuple[int, int]]:
    """The extents (offset, bytes) of the dataset's data in the file, once it passed the checks
    of check_file."""

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path!r}: {key!r} {what}", _DAMAGED)

    dcpl = ds.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5py.h5d.VIRTUAL:
        raise refuse("is a virtual dataset (its data would be read from other datasets, "
                     "possibly in other files)")
    if dcpl.get_external_count():
        raise refuse(f"is stored in external files ({dcpl.get_external(0)[0]!r}...)")
    if ds.get_type().get_class() in (h5py.h5t.VLEN, h5py.h5t.REFERENCE) or ds.dtype.hasobject:
        raise refuse(f"is of a variable-length or reference type ({ds.dtype}), which mpaccel "
                     "never writes")
    expected = _expected_dtype(entry.dtype)
    agrees = ds.dtype == expected if expected is not None else _numpy_storable(ds.dtype)
    if not agrees:
        raise refuse(f"is {ds.dtype}, the index says {entry.dtype}")
    space = ds.get_space()
    shape = largest = None
    if space.get_simple_extent_type() != h5py.h5s.NULL:
        shape = space.get_simple_extent_dims()
        largest = tuple(None if d == h5py.h5s.UNLIMITED else d
                        for d in space.get_simple_extent_dims(True))
    if shape is None or tuple(shape) != entry.shape or largest != shape:
        raise refuse(f"has shape {shape} (at most {largest}), the index says "
                     f"{list(entry.shape)}")
    nbytes = math.prod(shape) * ds.dtype.itemsize
    if nbytes != entry.nbytes:
        raise refuse(f"holds {nbytes} bytes, the index says {entry.nbytes}")
    if dcpl.get_nfilters():
        filters = [dcpl.get_filter(i) for i in range(dcpl.get_nfilters())]
        names = [name.decode(errors="replace") or str(code) for code, _, _, name in filters]
        raise CheckpointError(
            f"{path!r}: {key!r} is stored through HDF5 filters {names}: mpaccel reads "
            "uncompressed data only (the memory decompression takes is not bounded by the size "
            "the index declares)",
            "decompress the file first (h5repack -f NONE IN OUT, then OUT in its place).",
        )
    if dcpl.fill_value_defined() == h5py.h5d.FILL_VALUE_USER_DEFINED:
        raise refuse("has a fill value, which mpaccel never writes")
    if not nbytes or layout == h5py.h5d.COMPACT:  # (compact: in the object header, < 64 KiB)
        return []
    if layout == h5py.h5d.CONTIGUOUS:
        offset = ds.get_offset()
        if offset is None or ds.get_storage_size() != nbytes:
            raise refuse("has no data written in the file (HDF5 would make it up)")
        spans = [(int(offset), nbytes)]
    elif layout == h5py.h5d.CHUNKED:
        spans = _chunks(ds, dcpl.get_chunk(), shape, nbytes // math.prod(shape), refuse)
    else:
        raise refuse(f"has an HDF5 layout ({layout}) mpaccel never writes")
    for offset, length in spans:
        if offset + length > size:
            raise refuse(f"has data at bytes {offset}..{offset + length}, past the end of the "
                         f"file ({size} bytes: truncated?)")
    return spans


def _chunks(
    ds: h5py.h5d.DatasetID, chunk: tuple, shape: tuple, itemsize: int, refuse: Any
) -> list[tuple[int, int]]:
    """The extents of a chunked dataset's chunks: each within the dataset's shape, all written
    (a chunk never written would be made up by HDF5, memory the file does not hold)."""
    if any(c > max(d, 1) for c, d in zip(chunk, shape)):
        raise refuse(f"has chunks {chunk} larger than its shape {shape}")
    count = math.prod(-(-d // c) for c, d in zip(chunk, shape))
    if ds.get_num_chunks() != count:
        raise refuse(f"has {ds.get_num_chunks()} of its {count} chunks written")
    chunk_bytes = math.prod(chunk) * itemsize
    spans: list[tuple[int, int]] = []
    try:  # HDF5 >= 1.12.3 / 1.14: one walk over the chunk index
        ds.chunk_iter(lambda info: spans.append((int(info.byte_offset), int(info.size))))
    except (AttributeError, NotImplementedError):
        spans = [(int(i.byte_offset), int(i.size)) for i in map(ds.get_chunk_info, range(count))]
    if any(length != chunk_bytes for _, length in spans):
        raise refuse(f"has chunks of other sizes than {chunk_bytes} bytes")
    return spans


def _expected_dtype(name: str) -> np.dtype | None:
    """The numpy dtype an index's dtype name is stored as (None: the file's, where the name
    does not parse back, e.g. str() of a structured numpy type)."""
    stored = storage_dtype(name)
    if stored is not None or not name.startswith("numpy."):
        return stored
    try:
        return np.dtype(name.removeprefix("numpy."))
    except (TypeError, ValueError, SyntaxError):
        return None
