"""Opening checkpoint files without leaving their directory or blocking, and checking an HDF5
shard's own layout against the index before any of its data is read (reader.py calls these)."""

from __future__ import annotations

import errno
import math
import os
import stat
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from .format import CheckpointError, _numpy_storable, storage_dtype
from .index import TensorEntry
from .index_fields import plain_name

# O_NONBLOCK: opening a FIFO for reading would wait for a writer forever. On a regular file it
# changes nothing but one thing: a lease another process holds (a file server's) makes the open
# fail with EWOULDBLOCK instead of waiting for the lease to be broken; see open_regular.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
DIRECTORY_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_DAMAGED = "the file was damaged or crafted; restore it from a copy, or load another checkpoint."


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str, mode: int) -> CheckpointError:
    kind = _kind(mode)
    hint = "checkpoint files are read only as regular files of the checkpoint directory."
    if stat.S_ISLNK(mode):
        hint = ("links are not followed (a checkpoint must not read outside its directory): "
                "copy the file it points to into the directory.")
    return CheckpointError(f"{path!r} is {kind}, not a regular file", hint)


def open_regular(dir_fd: int, directory: str, name: str) -> int:
    """A descriptor of `name` in the directory open as `dir_fd`, checked to be a regular file on
    the directory's file system, opened without following a link and without blocking.

    `name` must be a plain file name (no directory part). Its kind is looked at (lstat) before
    it is opened, so a device is never opened, and again (fstat) once it is, in case it was
    replaced meanwhile. FileNotFoundError where it does not exist."""
    path = os.path.join(directory, name)
    if not plain_name(name):
        raise CheckpointError(f"{path!r}: {name!r} is not a plain file name", _DAMAGED)
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        try:
            fd = os.open(name, _OPEN_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
        except BlockingIOError:
            # A regular file under another process's lease (a FIFO opens at once without a
            # writer): wait for the kernel to break the lease, as any reader would. Collective
            # loads run this under the I/O deadline (rawio.within), which ends a wait that
            # never does.
            fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the lstat
            raise _refuse(path, stat.S_IFLNK) from exc
        raise CheckpointError(f"cannot open checkpoint file {path!r}: {exc}") from exc
    try:
        found, home = os.fstat(fd), os.fstat(dir_fd)
        if not stat.S_ISREG(found.st_mode):
            raise _refuse(path, found.st_mode)
        if found.st_dev != home.st_dev:
            raise CheckpointError(
                f"{path!r} lies on another file system than its directory (a mount)",
                "checkpoint files are read only from the checkpoint directory's own file system.",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def descriptor_path(fd: int) -> str:
    """A path that opens the very file `fd` is open on (for HDF5, which opens by name)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


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
