"""Full (unsharded) tensors of a sharded state dict, written in save_model's layout (`model`
stem, shards of at most max_shard_size) without gathering them anywhere: every rank writes its
own rows (or N-D blocks, one run per row of a block of columns; one replica of each) straight
into the contiguous datasets, at their offsets.

Call sequence of `export_full` (collective, every rank):
  1. every rank takes its local rows and computes the same shard plan from the global shapes;
     rank 0 picks a save id and creates the directory;
  2. shard i's owner (rank i mod N) lays the file out in HDF5 (every dataset's storage
     allocated, no data), fsyncs it, and tells every rank where each dataset lies;
  3. every rank writes its rows or blocks of every tensor at their offsets (pwrite, fsync);
  4. each owner reads its files back to compute every tensor's xxh3 (the checksum of the whole
     tensor, which no rank holds), and renames them into place;
  5. rank 0 commits `model.index.json` (format 1: load_model_state reads it).
All ranks agree after each step; a failure anywhere is every rank's error, and the files of
the save are removed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np
import xxhash

from ...comm import Comm, agreement
from ...errors import CheckpointCollectiveError
from .. import rawio
from ..format import FORMAT_NAME, checksum, parse_size
from ..index import CheckpointIndex, TensorEntry
from ..writer import (
    ErrorKeepingFile,
    check_same_on_every_rank,
    commit_index,
    contiguous_early,
    create_directory,
    plan_shards,
    write_step,
)
from .save import LocalState, check_joined, collect_local, held_runs

MODEL_STEM = "model"


def _nbytes(local: LocalState, key: str) -> int:
    return int(np.prod(local.rows[key].shape, dtype=np.int64)) * local.stored[key].itemsize


def _lay_out(path: str, keys: list[str], local: LocalState) -> dict[str, int | None]:
    """Create `path` (partial) with a dataset per key, its storage allocated; returns the offset
    of each (None: no storage of its own, written here from the whole value: 0-d and empty)."""
    sink = ErrorKeepingFile(path)
    offsets: dict[str, int | None] = {}
    try:
        with h5py.File(sink, "w", libver="latest") as f:
            f.attrs["format"] = FORMAT_NAME
            for key in keys:
                shape = local.rows[key].shape
                ds = f.create_dataset(key, shape=shape, dtype=local.stored[key],
                                      dcpl=contiguous_early())
                ds.attrs["torch_dtype"] = local.dtypes[key]
                offset = ds.id.get_offset()
                if offset is None and _nbytes(local, key):
                    ds.write_direct(local.whole[key])  # a 0-d tensor: held whole by every rank
                offsets[key] = offset
        sink.check()
        os.fsync(sink.fd)
    finally:
        sink.close()
    return offsets


def _write_rows(paths: dict[str, str], placed: Mapping[str, tuple[str, int | None]],
                local: LocalState) -> None:
    """Write this rank's rows (or N-D blocks) of every tensor at their place in the files."""
    by_file: dict[str, list[tuple[str, int, np.ndarray]]] = {}
    for key in [*local.arrays, *local.blocks]:
        name, offset = placed[key]
        if offset is None:
            continue  # written with the file's layout
        itemsize = local.stored[key].itemsize
        by_file.setdefault(name, []).extend(
            (f"{key}@{at}", offset + at * itemsize, run) for at, run in held_runs(local, key))
    for name, regions in by_file.items():
        fd = os.open(paths[name], os.O_WRONLY | os.O_NOFOLLOW)
        try:
            rawio.write_arrays(fd, paths[name], regions, lambda array: "")
        finally:
            os.close(fd)


def _finish(path: str, final: str, keys: list[str], offsets: Mapping[str, int | None],
            local: LocalState) -> tuple[dict[str, TensorEntry], int]:
    """Checksum every tensor of the file as written (read back), then rename it into place."""
    digests: dict[str, str] = {}
    tasks = []
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        for key in keys:
            offset, nbytes = offsets[key], _nbytes(local, key)
            if offset is None:
                digests[key] = checksum(local.whole[key]) if nbytes else checksum(
                    np.empty(0, np.uint8))
                continue

            def keep(digest: str, key: str = key) -> None:
                digests[key] = digest

            tasks.append(rawio.ReadTask(key, path, fd, offset, None, keep, nbytes,
                                        xxhash.xxh3_64))
        if tasks:
            rawio.read_arrays(tasks, lambda task, exc: exc)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    os.replace(path, final)
    name = os.path.basename(final)
    entries = {
        key: TensorEntry(file=name, dtype=local.dtypes[key], shape=tuple(local.rows[key].shape),
                         nbytes=_nbytes(local, key), xxh3=digests[key], offset=offsets[key])
        for key in keys
    }
    return entries, size


def export_full(
    comm: Comm,
    directory: str | os.PathLike[str],
    state_dict: Mapping[str, Any],
    max_shard_size: int | str = "10GB",
) -> dict[str, Any]:
    """Collective. Write `state_dict` (a model's, whose values may be DTensors) as full tensors
    in save_model's layout under `directory`, each rank writing its own rows in place (see the
    module's docstring). Read it back with mpaccel.checkpoint.load_model_state(directory).
    Returns the committed index."""
    directory = os.fspath(directory)
    what = f"exporting full tensors to {directory!r}"
    local, max_bytes = LocalState({}, {}, {}, {}), 0
    with agreement(comm, what + " (collecting the state)", kind=CheckpointCollectiveError):
        max_bytes = parse_size(max_shard_size)
        local = collect_local({"model": state_dict}, comm.rank)
    check_joined(comm, local, what)
    check_same_on_every_rank(comm, what, local.documents, local.layout())
    keys = list(local.rows)
    shards = plan_shards([(k, _nbytes(local, k)) for k in keys], None, max_bytes)
    shards = [shard for shard in shards if shard]
    save_id = comm.bcast(uuid.uuid4().hex[:12] if comm.rank == 0 else None, what=what)
    limit = rawio.stall_limit(comm.default_timeout)
    written: list[str] = []
    create_directory(comm, directory, what, limit)

    names = [f"{MODEL_STEM}-{save_id}-{i + 1:05d}-of-{len(shards):05d}.h5"
             for i in range(len(shards))]
    mine = list(range(comm.rank, len(shards), comm.size))
    paths = {name: os.path.join(directory, name + ".partial") for name in names}
    offsets: dict[str, int | None] = {}

    def lay_out() -> None:
        for i in mine:
            written.append(paths[names[i]])
            offsets.update(_lay_out(paths[names[i]], shards[i], local))

    write_step(comm, what, "laying out the files", limit, lay_out, written)
    placed: dict[str, tuple[str, int | None]] = {}
    for part in comm.allgather({k: names[i] for i in mine for k in shards[i]}, what=what):
        placed.update({k: (name, None) for k, name in part.items()})
    for part in comm.allgather(offsets, what=what):
        placed.update({k: (placed[k][0], offset) for k, offset in part.items()})
    write_step(comm, what, "writing rows", limit, lambda: _write_rows(paths, placed, local),
               written)

    entries: dict[str, TensorEntry] = {}
    sizes: dict[str, int] = {}

    def finish() -> None:
        for i in mine:
            final = os.path.join(directory, names[i])
            written.append(final)
            part, sizes[names[i]] = _finish(paths[names[i]], final, shards[i], offsets, local)
            entries.update(part)

    write_step(comm, what, "checksumming the files", limit, finish, written)
    gathered = comm.allgather((entries, sizes), what=what)
    index: CheckpointIndex | None = None
    if comm.rank == 0:
        tensors = {k: v for part, _ in gathered for k, v in part.items()}
        index = CheckpointIndex.new(
            stem=MODEL_STEM,
            save_id=save_id,
            world_size=comm.size,
            metadata={"kind": "model"},
            components=local.documents,
            tensors={k: tensors[k] for k in keys},
            shards=tuple(sorted(names)),
            file_sizes={n: s for _, part in gathered for n, s in part.items()},
        )
    commit_index(comm, directory, MODEL_STEM, what, limit, index, None, written)
    result = comm.bcast(index.to_json() if index is not None else None, what=what)
    assert result is not None
    return result
