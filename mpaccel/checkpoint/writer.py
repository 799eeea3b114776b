"""Writing checkpoint directories (reader.py reads them): HDF5 shards written by all ranks in
parallel, and a JSON index written last, atomically, by rank 0. The index is the commit: a
directory without a valid index is not a checkpoint, and files the index does not name are not
part of it.

Call sequence of `write_checkpoint` (collective, every rank, same arguments but `per_rank`):
  1. every rank flattens the same state and computes the same shard plan;
  2. rank 0 picks a save id and creates the directory; all ranks agree it worked;
  3. rank r writes shards r, r+N, ... and its own per-rank file, each to a temporary name,
     fsynced, then renamed; all ranks agree it worked (else everyone raises, files removed);
  4. rank 0 writes `<stem>.index.json` (temp file, fsync, rename, fsync of the directory),
     then deletes files of earlier saves; all ranks agree it worked.
Each rank's file I/O in 2-4 runs under rawio.within(): a rank whose file system stops
answering fails the step under the collective timeout, and every rank raises naming it.
HDF5 writes go through ErrorKeepingFile, which keeps HDF5 from ever seeing an I/O error (a
failed write is raised in Python once HDF5 closed the file).

One concept, just past 600 lines: writing a checkpoint directory, from its HDF5 files to the
index that commits it and the removal of what it supersedes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import h5py
import numpy as np

from ..comm import Comm, agreement
from ..errors import (
    CheckpointCollectiveError,
    CheckpointError,
    MpaccelRuntimeWarning,
    StalledIOError,
)
from . import rawio
from .files import DIRECTORY_FLAGS, open_directory, remove_tree
from .format import (
    FORMAT_NAME,
    INDEX_DIGEST,
    checksum,
    contiguous,
    dataset_name,
    dtype_name,
    flatten,
    index_digest,
    to_numpy,
)
from .index import CheckpointIndex, RankPart, TensorEntry
from .index_check import scan


def plan_shards(sizes: list[tuple[str, int]], num_shards: int | None, max_bytes: int | None):
    """Group tensor keys into shards: sequential fill up to `max_bytes` (save_model), or
    `num_shards` shards balanced by size (save_state: one per rank)."""
    if max_bytes is not None:
        shards: list[list[str]] = [[]]
        filled = 0
        for key, nbytes in sizes:
            if shards[-1] and filled + nbytes > max_bytes:
                shards.append([])
                filled = 0
            shards[-1].append(key)
            filled += nbytes
        return shards
    count = max(1, min(num_shards or 1, len(sizes)))
    loads = [0] * count
    shards = [[] for _ in range(count)]
    for key, nbytes in sorted(sizes, key=lambda kv: -kv[1]):
        target = loads.index(min(loads))
        shards[target].append(key)
        loads[target] += nbytes
    return shards


def remove_files(paths: list[str]) -> None:
    for path in paths:
        for candidate in (path, f"{path}.partial"):
            if os.path.exists(candidate):
                os.remove(candidate)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directory(directory: str) -> None:
    """makedirs, then fsync the parent of every directory it created (each gained an entry
    that must survive a power loss along with the checkpoint)."""
    created = []
    path = os.path.abspath(directory)
    with rawio.current_watch().doing(f"creating {directory!r}"):
        while not os.path.isdir(path):
            created.append(path)
            path = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        for path in reversed(created):
            fsync_path(os.path.dirname(path))


def _layout(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str]) -> dict:
    """What must be the same on every rank for the shared state to make one checkpoint: the
    tensors' keys, dtypes and shapes (a mismatch would interleave two different shard plans)."""
    return {key: (dtypes[key], list(arrays[key].shape)) for key in sorted(arrays)}


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The path of the first place where the JSON-like trees a and b differ (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}/{key}" if path else str(key)
            if key not in a or key not in b:
                return where
            found = _first_difference(a[key], b[key], where)
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}/{i}")
            if found is not None:
                return found
        return None
    return None if a == b else (path or "/")


def check_same_on_every_rank(comm: Comm, what: str, documents: Any, layout: dict) -> None:
    """Collective. The shared state must have one layout on every rank: else every rank raises
    the same CollectiveError naming the ranks whose tensors differ from rank 0's, and the keys.
    Non-tensor values that differ are saved as rank 0 has them, with a warning naming the first
    one."""
    digests = comm.allgather((_digest(layout), _digest(documents)), what=what)
    if len({d[0] for d in digests}) > 1:  # every rank sees the same digests: all take this path
        error = None
        reference = comm.bcast(layout if comm.rank == 0 else None, what=what)
        if layout != reference:
            missing = [k for k in reference if k not in layout]
            extra = [k for k in layout if k not in reference]
            changed = [k for k in layout if k in reference and layout[k] != reference[k]]
            parts = [f"has no {missing[:3]}"] if missing else []
            parts += [f"has extra {extra[:3]}"] if extra else []
            parts += [
                f"{k} is {layout[k][0]} {layout[k][1]} (rank 0: {reference[k][0]} "
                f"{reference[k][1]})"
                for k in changed[:3]
            ]
            error = CheckpointError(
                "the state to save differs from rank 0's (it must be the same on every rank): "
                + "; ".join(parts),
                "every rank must save the same model and optimizer: look for code that builds "
                "or changes them depending on the rank.",
            )
        comm.agree(error, what + " (comparing the ranks' states)", kind=CheckpointCollectiveError)
    if len({d[1] for d in digests}) > 1:
        documents_of = comm.allgather(documents, what=what)
        if comm.rank == 0:
            for rank, other in enumerate(documents_of[1:], start=1):
                where = _first_difference(documents_of[0], other)
                if where is not None:
                    warnings.warn(
                        f"{what}: the value at {where!r} differs between rank 0 and rank {rank}; "
                        "the checkpoint holds rank 0's",
                        MpaccelRuntimeWarning,
                        stacklevel=4,
                    )
                    break


def contiguous_early() -> h5py.h5p.PropDCID:
    """Dataset creation properties: one contiguous extent, allocated when the dataset is created
    (so its file offset is known before any data is written), never filled."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def write_h5(
    path: str, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str]
) -> tuple[dict[str, TensorEntry], int]:
    """Write datasets to `path` atomically (temp name, fsync, rename). Returns their index
    entries (with the file offset of each dataset that is its array's bytes in one piece) and
    the file's size.

    HDF5 lays the file out and writes its metadata; the data goes to the datasets' extents
    through rawio (parallel writes with early writeback: see rawio.py)."""
    partial = f"{path}.partial"
    # HDF5 writes through a file object that keeps I/O errors from it (ErrorKeepingFile, below);
    # they are raised by check()/finish(), after HDF5 closed the file cleanly.
    sink = ErrorKeepingFile(partial)
    try:
        regions = []
        offsets: dict[str, int] = {}  # where each array's bytes are, in one piece
        with h5py.File(sink, "w", libver="latest") as f:
            f.attrs["format"] = FORMAT_NAME
            for key, array in arrays.items():
                # Contiguous, uncompressed: chunking or compression would cost speed.
                ds = f.create_dataset(
                    key, shape=array.shape, dtype=array.dtype, dcpl=contiguous_early()
                )
                ds.attrs["torch_dtype"] = dtypes[key]
                offset = ds.id.get_offset()
                if offset is not None and ds.id.get_storage_size() == array.nbytes:
                    regions.append((key, offset, array))
                elif array.size:  # no extent of its own (0-d), or not the array's bytes
                    ds.write_direct(array)
                    offset = ds.id.get_offset()  # HDF5 gives a 0-d dataset one when written
                if array.size and offset is not None and ds.id.get_storage_size() == array.nbytes:
                    offsets[key] = int(offset)
        sink.check()
        # fsyncs the whole file: HDF5's metadata and the data
        written = rawio.write_arrays(sink.fd, partial, regions, checksum)
        size = os.fstat(sink.fd).st_size
    finally:
        sink.close()
    os.replace(partial, path)
    name = os.path.basename(path)
    entries = {
        key: TensorEntry(
            file=name,
            dtype=dtypes[key],
            shape=tuple(array.shape),
            nbytes=int(array.nbytes),
            xxh3=written[key] if key in written else checksum(array),
            offset=offsets.get(key),
        )
        for key, array in arrays.items()
    }
    return entries, size


def _split(trees: Mapping[str, Any]) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """Documents, arrays (by dataset name) and true dtypes of some state trees."""
    documents: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for component, tree in trees.items():
        documents[component], tensors = flatten(tree, component)
        for name, value in tensors.items():
            key = dataset_name(component, name)
            if isinstance(value, np.ndarray):
                arrays[key], dtypes[key] = contiguous(value), f"numpy.{value.dtype}"
            else:
                arrays[key], dtypes[key] = to_numpy(value), dtype_name(value.dtype)
    return documents, arrays, dtypes


def write_checkpoint(
    comm: Comm,
    directory: str,
    stem: str,
    shared: Mapping[str, Any],
    per_rank: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict:
    """Collective. Write `shared` (identical on every rank) and `per_rank` (this rank's own) state
    trees under `directory`; returns the committed index."""
    what = f"saving checkpoint {directory!r}"
    documents: dict = {}
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    rank_docs: dict = {}
    rank_arrays: dict[str, np.ndarray] = {}
    rank_dtypes: dict[str, str] = {}
    with agreement(comm, what + " (collecting the state)", kind=CheckpointCollectiveError):
        documents, arrays, dtypes = _split(shared)
        rank_docs, rank_arrays, rank_dtypes = _split(per_rank or {})
    check_same_on_every_rank(comm, what, documents, _layout(arrays, dtypes))

    save_id = comm.bcast(uuid.uuid4().hex[:12] if comm.rank == 0 else None, what=what)
    limit = rawio.stall_limit(comm.default_timeout)
    create_directory(comm, directory, what, limit)

    shards = plan_shards([(k, a.nbytes) for k, a in arrays.items()], comm.size, max_shard_bytes)
    total = len(shards)
    written: list[str] = []
    entries: dict[str, TensorEntry] = {}
    sizes: dict[str, int] = {}
    rank_file: str | None = None
    rank_entries: dict[str, TensorEntry] = {}

    def write_mine() -> None:
        nonlocal rank_file, rank_entries
        for shard_no in range(comm.rank, total, comm.size):
            name = f"{stem}-{save_id}-{shard_no + 1:05d}-of-{total:05d}.h5"
            path = os.path.join(directory, name)
            written.append(path)
            shard_entries, sizes[name] = write_h5(
                path, {k: arrays[k] for k in shards[shard_no]}, dtypes
            )
            entries.update(shard_entries)
        if per_rank is not None:
            rank_file = f"{stem}-{save_id}-rank{comm.rank:05d}.h5"
            written.append(os.path.join(directory, rank_file))
            rank_entries, sizes[rank_file] = write_h5(
                os.path.join(directory, rank_file), rank_arrays, rank_dtypes
            )

    write_step(comm, what, "writing shards", limit, write_mine, written)

    gathered = comm.allgather(
        (entries, (rank_file, rank_docs, rank_entries) if per_rank is not None else None, sizes),
        what=what,
    )
    index = CheckpointIndex.new(
        stem=stem,
        save_id=save_id,
        world_size=comm.size,
        metadata=dict(metadata or {}),
        components=documents,
        tensors={k: v for part, _, _ in gathered for k, v in part.items()},
        shards=tuple(sorted({v.file for part, _, _ in gathered for v in part.values()})),
        per_rank=tuple(
            RankPart(file=extra[0], components=extra[1], tensors=extra[2])
            for _, extra, _ in gathered
            if extra is not None
        ),
        file_sizes={name: size for _, _, part in gathered for name, size in part.items()},
    )
    commit_index(comm, directory, stem, what, limit, index, None, written)
    return index.to_json()


def write_step(comm: Comm, what: str, step: str, limit: float, work: Callable[[], object],
               written: list[str]) -> None:
    """Collective: run this rank's part of a step of a save (`work`, which lists the files it
    makes in `written`) under the I/O deadline `limit`; every rank agrees on it. If it failed
    anywhere, every rank removes its files of the save (not those a thread given up on, still
    writing, owns: StalledIOError)."""
    stalled = False

    def wrap(exc: Exception) -> BaseException:
        nonlocal stalled
        if isinstance(exc, StalledIOError):
            stalled = True
            return exc
        if isinstance(exc, CheckpointError):
            return exc
        # No __cause__: its traceback would keep h5py objects of the failed file alive until
        # interpreter shutdown, where collecting them after HDF5 is torn down crashes.
        if written:
            return CheckpointError(f"rank {comm.rank} could not write {written[-1]!r}: {exc}")
        return CheckpointError(f"rank {comm.rank}: {step}: {exc}")

    with agreement(comm, f"{what} ({step})", kind=CheckpointCollectiveError, wrap=wrap,
                   cleanup=lambda: None if stalled else remove_files(written)):
        rawio.within(limit, what, work)


def create_directory(comm: Comm, directory: str, what: str, limit: float) -> None:
    """Collective: rank 0 creates `directory` (within `limit` seconds); every rank raises if
    that failed."""
    def wrap(exc: Exception) -> BaseException:
        if isinstance(exc, StalledIOError):
            return exc
        return CheckpointError(f"cannot create checkpoint directory {directory!r}: {exc}")

    with agreement(comm, what + " (creating the directory)", kind=CheckpointCollectiveError,
                   wrap=wrap):
        if comm.rank == 0:
            rawio.within(limit, what, lambda: make_directory(directory))


def commit_index(comm: Comm, directory: str, stem: str, what: str, limit: float,
                 index: CheckpointIndex | None, error: BaseException | None,
                 written: list[str], keep: str | None = None) -> None:
    """Collective, the last step of every save. Rank 0 writes `index` (built there; `error` if
    it could not be) atomically, syncs the directory and removes files of earlier saves; if
    that fails on rank 0, every rank raises, and every rank removes its `written` files of the
    save, unless the index may be in place (a commit given up on: the rename may still
    happen, so every file stays). `keep`: a save id whose files stay (see remove_stale)."""
    committed: bool | None = False

    def put() -> None:
        nonlocal committed
        assert index is not None
        write_index(directory, stem, index)
        committed = True  # from here on, a failure must not take its files away
        fsync_path(directory)
        remove_stale(directory, stem, index, keep)

    if comm.rank == 0 and error is None:
        try:
            rawio.within(limit, what, put)
        except StalledIOError as exc:
            error, committed = exc, committed or None
        except Exception as exc:
            error = CheckpointError(f"cannot commit the index of {directory!r}: {exc}")
            error.__cause__ = exc
    committed = comm.bcast(committed, what=what)
    try:
        comm.agree(error, what + " (committing the index)", kind=CheckpointCollectiveError)
    except Exception:
        if committed is False:  # a save that will never be loaded: its files go
            remove_files(written)
        raise


def write_index(directory: str, stem: str, index: CheckpointIndex) -> None:
    """Put the index in place atomically (temp file, fsync, rename); if that fails, the temp
    file is removed. The caller fsyncs the directory."""
    final = os.path.join(directory, f"{stem}.index.json")
    temp = f"{final}.tmp-{index.save_id}"
    document = index.to_json()
    document[INDEX_DIGEST] = index_digest(document)
    # non-finite floats are tagged
    data = json.dumps(document, indent=1, allow_nan=False).encode()
    try:
        scan(data, final)  # what saves loads: the readers' bounds, before anything is written
    except CheckpointError as exc:
        raise CheckpointError(
            f"cannot save: {exc.message}",
            "the state holds more small values than a checkpoint index may (a long list of "
            "short strings or of small dicts in a registered object): store them as an array, "
            "or in a file of their own.",
        ) from None
    watch = rawio.current_watch()
    try:
        # a new file (O_EXCL), never one a link there points to
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with open(os.open(temp, flags, 0o644), "wb") as f, watch.doing(f"writing {temp!r}"):
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        watch.check()  # a commit given up on (see rawio.within) must not happen behind it
        os.replace(temp, final)
    except BaseException:
        remove_files([temp])
        raise


def delete_checkpoint(directory: str, stem: str) -> str:
    """Delete a checkpoint directory so that it is never taken for a complete one, however the
    process ends meanwhile: the commit is undone first (its index removed, the directory
    synced), then the rest goes; leftovers are debris without an index. Never through a link
    (files.remove_tree): a `directory` that is a symbolic link is unlinked, its target left
    alone. Returns what was there: "directory", "link", "missing" or "other" (left alone)."""
    parent, name = os.path.split(os.path.abspath(directory))
    parent_fd = open_directory(parent)
    try:
        fd = os.open(name, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:  # a link (ELOOP), not a directory, or gone: remove_tree tells them apart
        fd = -1
    finally:
        os.close(parent_fd)
    if fd >= 0:
        try:
            os.unlink(f"{stem}.index.json", dir_fd=fd)
        except FileNotFoundError:
            pass
        else:
            os.fsync(fd)
        finally:
            os.close(fd)
    return remove_tree(parent, name)


def remove_stale(directory: str, stem: str, index: CheckpointIndex,
                 keep_save: str | None = None) -> None:
    """Remove the files of this stem that the committed index does not name, but those of the
    save `keep_save` (the sharded part that the directory's committed state index still
    names while a second save into it is under way: sharded/state.py). A state index that
    names a sharded part (`metadata.sharded`) supersedes the other sharded parts: theirs go."""
    keep = set(index.shards) | {p.file for p in index.per_rank}
    if keep_save is not None:
        keep |= {n for n in os.listdir(directory) if n.startswith(f"{stem}-{keep_save}-")}
    part = index.metadata.get("sharded")
    if part is not None:
        remove_superseded(directory, "sharded", part)
    # shards and per-rank files of earlier or interrupted saves, and index temp files of
    # saves that died between writing and renaming them
    pattern = re.compile(
        rf"^{re.escape(stem)}(-[0-9a-f]{{12}}-.*\.h5(\.partial)?|\.index\.json\.tmp-[0-9a-f]{{12}})$"
    )
    _unlink_matching(directory, lambda name: bool(pattern.match(name)) and name not in keep)


def remove_superseded(directory: str, stem: str, save_id: str) -> None:
    """Once a state index naming the sharded part `save_id` is committed: remove the files of
    the other sharded parts in `directory` (the previous save's, kept until this commit, and
    its index kept aside as `<stem>.<save id>.index.json`)."""
    pattern = re.compile(rf"^{re.escape(stem)}(-[0-9a-f]{{12}}-.*\.h5(\.partial)?"
                         rf"|\.[0-9a-f]{{12}}\.index\.json(\.partial)?)$")
    _unlink_matching(directory, lambda name: bool(pattern.match(name)) and save_id not in name)


def _unlink_matching(directory: str, doomed: Callable[[str], bool]) -> None:
    """Unlink the entries of `directory` whose name is `doomed`, relative to the directory
    open (a link is unlinked, never followed; a directory of such a name is left alone)."""
    dir_fd = open_directory(directory)
    try:
        for name in os.listdir(dir_fd):
            if doomed(name):
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except (FileNotFoundError, IsADirectoryError):  # gone meanwhile; not ours
                    pass
    finally:
        os.close(dir_fd)


_REMEMBERED = 1 << 20  # after a failure, writes up to this size are kept for HDF5 to read back


class ErrorKeepingFile:
    """Binary read/write file at `path` (created or truncated), positioned like io.RawIOBase.

    Not thread-safe; one HDF5 file at a time, as h5py requires of file objects anyway."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.error: OSError | None = None
        self._pos = 0
        # Metadata written after a failure, kept so that HDF5 reading it back finds it and
        # closes normally. Raw data is not kept: HDF5 does not read it while writing.
        self._kept: dict[int, bytes] = {}

    # -- the methods h5py's file-object driver calls --------------------------------------------
    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self._pos = offset
        elif whence == os.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = os.fstat(self.fd).st_size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.error is None:
            try:
                done = 0
                while done < size:  # pwrite may write less than asked
                    done += os.pwrite(self.fd, view[done:], self._pos + done)
            except OSError as exc:
                self.error = exc
        if self.error is not None and size <= _REMEMBERED:
            self._kept[self._pos] = bytes(view)
        self._pos += size
        return size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        kept = self._kept.get(self._pos)
        if kept is not None and len(kept) >= len(view):
            view[:] = kept[: len(view)]
            count = len(view)
        else:
            try:
                count = os.preadv(self.fd, [view], self._pos)
            except OSError as exc:
                self.error = self.error or exc
                count = 0  # h5py fills what was not read with zeros
        self._pos += count
        return count

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, os.fstat(self.fd).st_size - self._pos)
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(buffer)])

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.error = exc
        return size

    def flush(self) -> None:
        pass  # nothing is buffered: every write went to the kernel

    # -- for the checkpoint writer ---------------------------------------------------------------
    def check(self) -> None:
        """Raise the first I/O error HDF5's writes met (call once HDF5 closed the file)."""
        if self.error is not None:
            raise OSError(self.error.errno, self.error.strerror, self.path)

    def finish(self) -> None:
        """After HDF5 closed the file: raise the kept error, else fsync. Closes the descriptor."""
        try:
            self.check()
            os.fsync(self.fd)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
