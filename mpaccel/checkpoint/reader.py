"""Reading committed checkpoint directories: every read checked against the index (shapes,
dtypes, byte offsets, xxh3 checksums), shards read with rawio where the layout allows it and with
h5py where it does not. writer.py writes what this reads. Also here: each HDF5 shard's own
layout checked against the index before any of its data is read (check_file), and how a read
lands in memory (which live tensors the bytes go straight into, held back until every check
passed: Deferred; which reader of a node verifies which checksum: checksum_owners).

One concept, past 600 lines: reading a committed directory, from its shard layout to the
bytes in place."""

from __future__ import annotations

import bisect
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import h5py
import numpy as np
import torch
import xxhash

from ..errors import CheckpointError
from . import rawio
from .files import descriptor_path, open_directory, open_regular
from .format import (
    checksum,
    dataset_name,
    dtype_name,
    flatten,
    from_numpy,
    numpy_storable,
    storage_dtype,
    to_numpy,
    unflatten,
)
from .index import TensorEntry, read_index
from .index_check import plain_name

__all__ = ["CheckpointReader", "Deferred", "checksum_owners"]

class CheckpointReader:
    """Read a committed checkpoint. Not collective; every read is checked against the index.

    `node_share=(i, n)`: this process is the i-th of n on its node that read the same shared
    components at the same time (a collective load; one page cache, so the same bytes). It
    verifies the checksums of its share of the shared tensors only (checksum_owners: about 1/n
    of the bytes each), so together they verify each tensor once: the caller must make any failure
    everyone's (load_state ends in a collective agreement). And unless it is the first, it reads
    behind the first rather than from the disk (rawio.preadv_following). Per-rank files are
    always read by their own rank and verified in full."""

    def __init__(self, directory: str, stem: str, node_share: tuple[int, int] = (0, 1)) -> None:
        self.directory = directory
        self.stem = stem
        self.node_share = node_share
        if not os.path.isdir(directory):
            raise CheckpointError(f"no checkpoint at {directory!r}: the directory does not exist")
        self._reset_files()
        try:
            self.index = read_index(self._directory_fd(), directory, stem)
        except BaseException:
            self.close()
            raise

    def _reset_files(self) -> None:
        """No file open yet (the directory is opened on first use)."""
        self._dir_fd = -1
        self._files: dict[str, h5py.File] = {}
        self._raw_fds: dict[str, int] = {}  # every file's descriptor, checked (see _fd)
        self._sizes: dict[str, int] = {}  # their real sizes
        self._by_file: dict[str, list[tuple[str, TensorEntry]]] | None = None
        self._refused: dict[str, tuple[str, str | None]] = {}  # files check_file refused

    def close(self) -> None:
        files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()
        fds, self._raw_fds = list(self._raw_fds.values()), {}
        if self._dir_fd >= 0:
            fds.append(self._dir_fd)
            self._dir_fd = -1
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return self.index.world_size

    def opened(self, name: str) -> tuple[int, int]:
        """(descriptor, real size) of the checkpoint's file `name`, opened and checked on first
        use, closed with the reader (for readers of their own: sharded/load.py)."""
        fd = self._fd(name)
        return fd, self._sizes[name]

    def path(self, name: str) -> str:
        """The path of the checkpoint's file `name` (a plain name, checked)."""
        return self._path(name)

    def _path(self, name: str) -> str:
        if not plain_name(name):  # (the index's schema refuses such names already)
            raise CheckpointError(
                f"{self.directory!r}: the index names the file {name!r}, which is not a plain "
                "file name in the checkpoint directory",
                "the index was damaged or crafted; load another checkpoint.",
            )
        return os.path.join(self.directory, name)

    def _directory_fd(self) -> int:
        """The checkpoint directory, open: its files are opened relative to it, so that they are
        the files in it whatever its path comes to name meanwhile."""
        if self._dir_fd < 0:
            try:
                self._dir_fd = open_directory(self.directory)
            except FileNotFoundError as exc:
                raise CheckpointError(f"cannot open {self.directory!r}: {exc}") from exc
        return self._dir_fd

    def _fd(self, name: str) -> int:
        """A descriptor of the checkpoint file `name`, opened once (see open_regular)."""
        if name not in self._raw_fds:
            path = self._path(name)
            try:
                fd = open_regular(self._directory_fd(), self.directory, name)
            except FileNotFoundError as exc:
                raise CheckpointError(
                    f"cannot open checkpoint file {path!r} (which holds {self._holds(name)}): "
                    "it does not exist",
                    "the checkpoint lost a file; restore it from a copy, or load another one.",
                ) from exc
            except CheckpointError as exc:
                raise CheckpointError(f"{exc.message} (it holds {self._holds(name)})",
                                      exc.hint) from exc
            self._raw_fds[name] = fd
            self._sizes[name] = os.fstat(fd).st_size
        return self._raw_fds[name]

    def _file(self, name: str) -> h5py.File:
        """The file `name` open in HDF5 (through the descriptor _fd() checked), once every
        dataset the index places in it passed check_file: that is before any byte of it is
        read."""
        if name in self._refused:  # (verify asks again for each of its tensors)
            raise CheckpointError(*self._refused[name])
        if name not in self._files:
            fd = self._fd(name)
            try:
                f = h5py.File(descriptor_path(fd), "r")
            except Exception as exc:
                raise CheckpointError(
                    f"cannot open checkpoint file {self._path(name)!r} in HDF5: {exc}",
                    "the file is damaged; restore it from a copy, or load another checkpoint.",
                ) from exc
            try:
                check_file(f, self._path(name), self._sizes[name], self._entries_in(name))
            except CheckpointError as exc:
                f.close()
                self._refused[name] = (exc.message, exc.hint)
                raise
            except BaseException:
                f.close()
                raise
            self._files[name] = f
        return self._files[name]

    def _holds(self, name: str) -> str:
        keys = [key for key, _ in self._entries_in(name)]
        if len(keys) < 2:
            return repr(keys[0]) if keys else "no tensor"
        return f"{keys[0]!r} and {len(keys) - 1} other tensor(s)"

    def _entries_in(self, name: str) -> list[tuple[str, TensorEntry]]:
        """(key, entry) of every tensor the index places in file `name`."""
        if self._by_file is None:
            self._by_file = {}
            for key, entry in self.index.entries():
                self._by_file.setdefault(entry.file, []).append((key, entry))
        return self._by_file.get(name, [])

    def _raw(self, entry: TensorEntry) -> tuple[int, int, np.dtype] | None:
        """(descriptor, offset, dtype) to read the entry's bytes without HDF5, where the index
        vouches for them: it recorded the dataset's offset, and the file has the size the index
        recorded (a file rewritten by another tool, e.g. h5repack, has moved its data and is read
        through h5py). This spares every rank HDF5's metadata reads, small reads scattered over
        the file, before the data streams. Called for every item before any is read: every
        file is opened and checked here, and one read through HDF5 has all its datasets
        checked here (_file)."""
        offset, name = entry.offset, entry.file
        dtype = storage_dtype(entry.dtype)
        fd = self._fd(name)
        if offset is None or dtype is None or self._sizes[name] != self.index.file_sizes.get(name):
            self._file(name)
            return None
        return fd, int(offset), dtype

    def _verify(self, key: str, array: np.ndarray, entry: TensorEntry) -> None:
        self._verify_digest(key, checksum(array), entry)

    def _verify_digest(self, key: str, digest: str, entry: TensorEntry) -> None:
        if digest != entry.xxh3:
            raise CheckpointError(
                f"checksum mismatch for {key!r} in {self._path(entry.file)!r}: the file is "
                "corrupted",
                "restore the file from a copy, or load an earlier checkpoint.",
            )

    def read_arrays(
        self,
        wanted: list[tuple[str, TensorEntry, np.ndarray | None, bool]],
        follow: bool = False,
        defer: Deferred | None = None,
    ) -> dict[str, np.ndarray]:
        """Read (key, index entry, destination or None, verify) items, on several threads.

        A destination of the right dtype and shape is filled in place (and returned); otherwise a
        new array is. Tensors at offsets the index vouches for (see _raw()) are read first, by
        rawio in file order, so the data streams before any HDF5 metadata is read; then those
        of checkpoints without offsets or rewritten by another tool, through HDF5's metadata
        (contiguous ones by rawio at the offset HDF5 gives, chunked or filtered ones by h5py).
        `follow`: another process of this node reads the same items now (rawio.read_arrays).
        `defer`: destinations taken as they are (in place) are not written now: their bytes
        are checked in the file (through a small buffer) and `defer` holds them for fill()."""
        out: dict[str, np.ndarray] = {}
        rejected: list[CheckpointError] = []  # failed checks: raised once everything is read
        watch, opened = rawio.current_watch(), set()
        placed = []
        for item in wanted:  # each file opened once
            name = item[1].file
            if name in opened:
                placed.append((item, self._raw(item[1])))
                continue
            opened.add(name)
            with watch.doing(f"opening {self._path(name)!r}"):
                placed.append((item, self._raw(item[1])))
        for at_offsets in (True, False):
            tasks = []
            for (key, entry, dest, verify), raw in placed:
                if (raw is not None) != at_offsets:
                    continue
                try:
                    task = self._read_one(key, entry, dest, verify, raw, out, rejected, defer)
                except CheckpointError:
                    raise
                except Exception as exc:
                    path = self._path(entry.file)
                    raise CheckpointError(f"cannot read {key!r} from {path!r}: {exc}") from exc
                if task is not None:
                    tasks.append(task)
            if tasks:
                rawio.read_arrays(tasks, _read_error, follow=follow)
        if rejected:
            raise rejected[0]
        return out

    def fill(self, held: Deferred, follow: bool = False) -> None:
        """Copy the reads read_arrays(defer=held) held back into their destinations: read again
        (from the page cache, as a rule) straight into them, and checked again where they were
        checked the first time (a file changed in between is an error, raised at the end)."""
        tasks = []
        for key, entry, dest, verify, source in held.items:
            if isinstance(source, np.ndarray):
                np.copyto(dest, source)  # read (and checked) into private memory
                continue
            fd, offset = source
            check = (lambda a, k=key, e=entry: self._verify(k, a, e)) if verify else None
            tasks.append(rawio.ReadTask(key, self._path(entry.file), fd, offset, dest, check))
        if tasks:
            rawio.read_arrays(tasks, _read_error, follow=follow)

    def _read_one(
        self,
        key: str,
        entry: TensorEntry,
        dest: np.ndarray | None,
        verify: bool,
        raw: tuple[int, int, np.dtype] | None,
        out: dict[str, np.ndarray],
        rejected: list[CheckpointError],
        defer: Deferred | None = None,
    ) -> rawio.ReadTask | None:
        """One item of read_arrays (`raw`: what _raw() said of it): puts its array in `out` and
        returns the rawio task that fills it (or, deferred, only checks it), or reads it here
        (through h5py, or empty) and returns None."""
        path = self._path(entry.file)
        offset: int | None
        if raw is not None:
            fd, offset, dtype = raw
            shape: tuple[int, ...] = entry.shape
            if int(np.prod(shape)) * dtype.itemsize != entry.nbytes:
                raise CheckpointError(
                    f"the index of {self.directory!r} contradicts itself for {key!r}: "
                    f"{entry.nbytes} bytes of {entry.dtype} {list(shape)}"
                )
        else:
            ds = self._file(entry.file)[key]
            if tuple(ds.shape) != entry.shape:
                raise CheckpointError(
                    f"{path!r}: {key!r} has shape {ds.shape}, index says {list(entry.shape)}"
                )
            fd, offset, dtype, shape = -1, self._h5_offset(ds), ds.dtype, ds.shape
        if (
            dest is None
            or dest.dtype != dtype
            or dest.shape != shape
            or not dest.flags.c_contiguous
            or not dest.flags.writeable
        ):
            dest = np.empty(shape, dtype=dtype)
            defer = None  # new memory: read now
        out[key] = dest
        check = (lambda a, k=key, e=entry: self._verify(k, a, e)) if verify else None
        if offset is not None and dest.size and fd < 0:
            fd = self._file(entry.file).id.get_vfd_handle()  # HDF5's own descriptor
        if defer is not None and dest.size:
            if offset is None:  # through h5py: into new memory now, copied in by fill()
                copy = np.empty(shape, dtype=dtype)
                defer.items.append((key, entry, dest, verify, copy))
                dest = copy
            else:  # its bytes checked in the file now, read in by fill()
                defer.items.append((key, entry, dest, verify, (fd, offset)))
                if not verify:
                    return None
                # format.checksum's hash, fed piece by piece
                checked = functools.partial(self._verify_digest, key, entry=entry)
                return rawio.ReadTask(
                    key, path, fd, offset, None, checked, dest.nbytes, xxhash.xxh3_64
                )
        if offset is not None and dest.size:
            return rawio.ReadTask(key, path, fd, offset, dest, check)
        if dest.size:
            ds.read_direct(dest)
        try:
            if check:
                check(dest)
        except CheckpointError as exc:
            rejected.append(exc)
        return None

    @staticmethod
    def _h5_offset(ds: h5py.Dataset) -> int | None:
        """The file offset of the dataset's data where it is its array's bytes in one piece."""
        plist = ds.id.get_create_plist()
        if (
            plist.get_layout() == h5py.h5d.CONTIGUOUS
            and plist.get_nfilters() == 0
            and plist.get_external_count() == 0
            and not ds.dtype.hasobject
            and ds.id.get_storage_size() == ds.size * ds.dtype.itemsize
        ):
            return ds.id.get_offset()
        return None

    def read_array(self, key: str, entry: TensorEntry, verify: bool = True) -> np.ndarray:
        return self.read_arrays([(key, entry, None, verify)])[key]

    def tensor(self, key: str, verify: bool = True) -> Any:
        entry = self.index.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.directory!r} has no tensor {key!r}")
        return self._decode(self.read_array(key, entry, verify), entry.dtype)

    @staticmethod
    def _decode(array: np.ndarray, dtype: str) -> Any:
        if dtype.startswith("numpy."):
            return array
        return from_numpy(array, dtype)

    def components(self) -> list[str]:
        return list(self.index.components)

    def _plan(
        self,
        component: str,
        document: Any,
        entries: Mapping[str, TensorEntry],
        into: Any,
        verify: Any,
        claimed: list[tuple[int, int]],
    ) -> tuple[list, dict[str, tuple[Any, np.ndarray]]]:
        """What reading one component's tree takes: the read_arrays items, and the tensors of
        `into` (a tree of the same shape, e.g. the live state_dict) that match and are filled in
        place, by dataset key. `claimed`: the memory already chosen to be read into; a tensor
        sharing memory with one of those (tied weights) is read into new memory instead, so
        that one read does not overwrite another (torch's load_state_dict then copies)."""
        targets = flatten(into, component)[1] if into is not None else {}
        names: list[str] = []
        unflatten(document, lambda name, kind: names.append(name))
        wanted = []
        reuse: dict[str, tuple[Any, np.ndarray]] = {}
        for name in dict.fromkeys(names):  # tied weights: one dataset for several keys
            key = dataset_name(component, name)
            entry = entries.get(key)
            if entry is None:
                raise CheckpointError(f"{self.directory!r}: the index names no tensor {key!r}")
            view = writable_view(targets.get(name), entry)
            if view is not None and not claim(claimed, view):
                view = None
            if view is not None:
                reuse[key] = (targets[name], view)
            wanted.append((key, entry, view, verify(key)))
        return wanted, reuse

    def _build(
        self,
        component: str,
        document: Any,
        entries: Mapping[str, TensorEntry],
        arrays: Mapping[str, np.ndarray],
        reuse: Mapping[str, tuple[Any, np.ndarray]],
    ) -> Any:
        def load(name: str, kind: str) -> Any:
            key = dataset_name(component, name)
            if key in reuse and arrays[key] is reuse[key][1]:
                return reuse[key][0]  # filled in place
            return self._decode(arrays[key], entries[key].dtype)

        return unflatten(document, load)

    def component(self, component: str, verify: bool = True, into: Any = None) -> Any:
        """The component's state tree. `into`: a tree whose matching tensors (same dtype and
        shape, contiguous, in host memory) are filled in place and returned as they are: no
        new memory and no second copy, but a failed read leaves them partly overwritten
        (read_components(defer=...) leaves them alone until every check passed)."""
        return self.read_components([(component, into)], verify)[component]

    def read_components(
        self,
        requests: Sequence[tuple[str, Any]],
        verify: bool = True,
        defer: Deferred | None = None,
    ) -> dict[str, Any]:
        """{component: tree} for (component, into) requests (see component()), read in one pass
        in file order: a file holds tensors of several components (shard i has part of every
        model and optimizer), and reading it once from start to end, rather than once per
        component, keeps the disk streaming. `defer`: the tensors of `into` to be filled in
        place are only checked now (their trees hold them as they are) and filled by
        fill(defer) later: a caller that must change nothing unless everything checks out."""
        missing = [c for c, _ in requests if c not in self.index.components]
        if missing:
            raise CheckpointError(
                f"{self.directory!r} has no {missing[0]!r} (it has {self.components()})"
            )
        documents, entries = self.index.components, self.index.tensors
        index, count = self.node_share
        owners = checksum_owners(entries, count)

        def verify_key(key: str) -> bool:
            return verify and owners[key] == index

        claimed: list[tuple[int, int]] = []
        plans = [
            self._plan(c, documents[c], entries, into, verify_key, claimed) for c, into in requests
        ]
        items = [item for wanted, _ in plans for item in wanted]
        arrays = self.read_arrays(items, index > 0, defer)
        return {
            c: self._build(c, documents[c], entries, arrays, reuse)
            for (c, _), (_, reuse) in zip(requests, plans, strict=True)
        }

    def rank_component(self, rank: int, component: str, verify: bool = True) -> Any:
        part = self.index.per_rank[rank]
        document, entries = part.components[component], part.tensors
        wanted, reuse = self._plan(component, document, entries, None, lambda key: verify, [])
        return self._build(component, document, entries, self.read_arrays(wanted), reuse)

    def verify(self) -> list[str]:
        """Check every tensor's checksum, and that HDF5 places it where the index does; returns
        the problems found (empty: all good)."""
        problems = []
        for key, entry in self.index.entries():
            try:
                self._check_layout(key, entry)
                self.read_array(key, entry, verify=True)
            except CheckpointError as exc:
                problems.append(str(exc))
        return problems

    def _check_layout(self, key: str, entry: TensorEntry) -> None:
        """Where loads read the entry's bytes at the index's offset, check that HDF5 agrees."""
        if self._raw(entry) is None:
            return
        ds = self._file(entry.file)[key]
        found = (self._h5_offset(ds), list(ds.shape), ds.dtype)
        if found != (entry.offset, list(entry.shape), storage_dtype(entry.dtype)):
            raise CheckpointError(
                f"{self._path(entry.file)!r}: HDF5 has {key!r} at offset {found[0]} as "
                f"{found[2]} {found[1]}, the index says offset {entry.offset}, "
                f"{entry.dtype} {list(entry.shape)}",
                "the file was changed after the save; restore it, or load an earlier checkpoint.",
            )


def _read_error(task: rawio.ReadTask, exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"cannot read {task.key!r} from {task.path!r}: {exc}")


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
    agrees = ds.dtype == expected if expected is not None else numpy_storable(ds.dtype)
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


class Deferred:
    """In-place reads held back by read_arrays(defer=...) until CheckpointReader.fill(): (key,
    entry, destination, verify, where its bytes are: (fd, offset) in the file, or an array
    they were read into)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, TensorEntry, np.ndarray, bool, Any]] = []


def writable_view(tensor: Any, entry: TensorEntry) -> np.ndarray | None:
    """A numpy view of `tensor`'s memory if the entry's bytes can be read straight into it
    (None for anything else: GPU, sparse, non-contiguous or uninitialized lazy tensors...)."""
    return writable_as(tensor, entry.dtype, entry.shape)


def writable_as(tensor: Any, dtype: str, shape: Sequence[int]) -> np.ndarray | None:
    """writable_view for bytes of tensor dtype `dtype` and shape `shape` (a DTensor's rows)."""
    if not isinstance(tensor, torch.Tensor) or torch.nn.parameter.is_lazy(tensor):
        return None
    try:
        if (
            tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or not tensor.is_contiguous()
            or dtype_name(tensor.dtype) != dtype
            or tuple(tensor.shape) != tuple(shape)
        ):
            return None
        view = to_numpy(tensor)
    except Exception:
        return None
    if not view.flags.writeable or view.ctypes.data != tensor.data_ptr():
        return None
    return view


def claim(claimed: list[tuple[int, int]], view: np.ndarray) -> bool:
    """Add the bytes of `view` to the sorted, disjoint (start, end) ranges of `claimed`, unless
    they overlap one of them (then False)."""
    start = view.ctypes.data
    end = start + view.nbytes
    i = bisect.bisect_left(claimed, (start, end))
    if (i > 0 and claimed[i - 1][1] > start) or (i < len(claimed) and claimed[i][0] < end):
        return False
    claimed.insert(i, (start, end))
    return True


def checksum_owners(entries: Mapping[str, TensorEntry], count: int) -> dict[str, int]:
    """{key: which of `count` readers verifies it}: the tensors in file order (file, offset),
    cut into `count` runs of about equal bytes; a tensor belongs to the run holding its middle
    byte. By bytes, not by number of tensors: a model's few large matrices and many small
    vectors would otherwise leave one reader hashing most of the data while the others wait."""
    order = sorted(entries, key=lambda k: (entries[k].file, entries[k].offset or 0, k))
    total = sum(entries[k].nbytes for k in order)
    owners, start = {}, 0
    for key in order:
        size = entries[key].nbytes
        middle = start + size / 2
        owners[key] = min(count - 1, int(middle * count / total)) if total else 0
        start += size
    return owners
