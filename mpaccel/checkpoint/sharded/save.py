"""Sharded checkpoints of state dicts whose tensors may be DTensors (fully_shard models and their
optimizers, tensor parallelism composed with it): every rank writes only its own elements,
rows in one piece or N-D blocks, once across replicas, and the index records which file holds
which rows or blocks of each tensor (sharded/load.py loads them at any world size, sharding
and mesh).

Call sequence of `save_sharded` (collective, every rank, each with its own shards):
  1. every rank takes its local rows (DTensor.to_local()) and flattens the state; the ranks
     agree that the state's keys, dtypes and global shapes are the same everywhere;
  2. rank 0 picks a save id and creates the directory; all ranks agree it worked;
  3. each rank writes its rows or blocks (and rank 0 the tensors that are not DTensors)
     to `<stem>-<id>-rankNNNNN.h5` (temp name, fsync, rename); all ranks agree it worked;
  4. every rank sends its slice entries to rank 0 (a gather: no rank holds the others'),
     rank 0 checks that the slices of every tensor cover it exactly and commits
     `<stem>.index.json` (temp file, fsync, rename), then removes files of earlier saves.
With `async_save`, steps 2-4 run on a thread of their own, on a copy of the local rows only.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...comm import Comm, agreement
from ...errors import CheckpointCollectiveError, CheckpointError, MpaccelRuntimeWarning
from .. import rawio
from ..format import checksum, contiguous, dataset_name, dtype_name, flatten, to_numpy
from ..index import CheckpointIndex, SlicedTensor
from ..index_check import block_cover_problem, slice_box
from ..writer import check_same_on_every_rank, commit_index, create_directory, write_h5, write_step

SHARDED_STEM = "sharded"
BLOCK_BYTES = 4 << 20  # rows are checksummed in blocks of about this size: a partial read of a
# slice is verified by reading at most one block more on each side


@dataclass(frozen=True)
class Box:
    """A block of a tensor that a rank holds in one piece: the global elements [start, stop)
    along every dimension, which begin at index `local` of the rank's local tensor."""

    start: tuple[int, ...]
    stop: tuple[int, ...]
    local: tuple[int, ...]

    def local_slices(self) -> tuple[slice, ...]:
        """Not collective. Where the block lies in the local tensor."""
        return tuple(slice(at, at + b - a) for at, a, b in zip(self.local, self.start, self.stop))

    @property
    def size(self) -> int:
        """Not collective. How many elements the block holds."""
        return math.prod(b - a for a, b in zip(self.start, self.stop))


@dataclass(frozen=True)
class Rows:
    """The rows [start, stop) of a tensor of `shape` (its global shape) that this rank holds
    (dimension 0; a 0-d tensor has one row), and whether this rank is the one that stores them
    (the first replica, where a mesh dimension replicates them). `boxes`: where the rank's
    part is not rows in one piece (a DTensor sharded along another dimension, or strided by
    tensor parallelism under fully_shard), its blocks; start and stop then bound their rows."""

    start: int
    stop: int
    shape: tuple[int, ...]
    writer: bool
    boxes: tuple[Box, ...] = ()


def row_count(shape: tuple[int, ...] | list[int]) -> int:
    return int(shape[0]) if len(shape) else 1


def dtensor_rows(value: Any, where: str) -> Rows | None:
    """Not collective. The part of a DTensor this rank holds (None for a plain tensor: every
    rank holds all of it), from its placements on every mesh dimension (Shard, strided shards,
    Replicate; Partial is refused: its values are not the tensor's yet)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return None
    placements = tuple(value.placements)
    if any(p.is_partial() or not (p.is_replicate() or hasattr(p, "dim")) for p in placements):
        raise CheckpointError(
            f"cannot store the DTensor at key {where!r}: its placements are {placements!r}, "
            "and sharded checkpoints hold sharded and replicated placements only (a Partial "
            "one holds values not yet reduced)",
            "save after the step that reduces it, or call .full_tensor() on this value first.",
        )
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    writer = coordinate is not None and all(
        c == 0 for c, p in zip(coordinate, placements) if p.is_replicate()
    )
    shape = tuple(int(d) for d in value.shape)
    if not shape:
        return Rows(0, 1, shape, writer)
    if coordinate is None:  # not in the mesh: it holds nothing
        return Rows(0, 0, shape, False)
    boxes = held_boxes(shape, mesh, placements)
    if not boxes:
        return Rows(0, 0, shape, writer)
    if len(boxes) == 1 and boxes[0].start[1:] == (0,) * (len(shape) - 1) and (
        boxes[0].stop[1:] == shape[1:]
    ):
        return Rows(boxes[0].start[0], boxes[0].stop[0], shape, writer)
    return Rows(min(b.start[0] for b in boxes), max(b.stop[0] for b in boxes), shape, writer,
                boxes)


def held_boxes(shape: tuple[int, ...], mesh: Any, placements: tuple) -> tuple[Box, ...]:
    """Not collective. The blocks of a tensor of global `shape` that this rank holds when it
    is laid out by `placements` on `mesh` (this rank in it), in local order. torch decides
    the layout: each dimension's global indices are those of a small probe that torch's
    distribute_tensor lays out alike without communicating (src_data_rank=None), so Shard,
    _StridedShard and their nesting on several mesh dimensions come out as torch places them;
    each run of consecutive indices is a block along its dimension."""
    key = (shape, placements, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape),
           mesh.device_type, tuple(mesh.get_coordinate() or ()))
    found = _BOXES.get(key)
    if found is None:
        runs = [index_runs(indices) for indices in held_indices(shape, mesh, placements)]
        found = tuple(
            Box(tuple(r[1] for r in combo), tuple(r[1] + r[2] for r in combo),
                tuple(r[0] for r in combo))
            for combo in itertools.product(*runs)
        )
        if len(_BOXES) > 4096:
            _BOXES.clear()
        _BOXES[key] = found
    return found


_BOXES: dict[tuple, tuple[Box, ...]] = {}


def held_indices(shape: tuple[int, ...], mesh: Any, placements: tuple) -> list[np.ndarray]:
    """Not collective (no rank communicates: see held_boxes). For each dimension of the
    tensor, the global indices this rank's local tensor holds."""
    from torch.distributed.tensor import distribute_tensor

    # Every other dimension of a probe gets a size its shardings split evenly (each mesh
    # dimension's size times the strided split factor): no rank's probe is empty there.
    even = [1] * len(shape)
    for size, p in zip(mesh.mesh.shape, placements):
        if not p.is_replicate():
            even[p.dim % len(shape)] *= int(size) * int(getattr(p, "split_factor", 1))
    out = []
    for d, extent in enumerate(shape):
        if extent == 0:
            out.append(np.empty(0, np.int64))
            continue
        view = [1] * len(shape)
        view[d] = extent
        probe_shape = list(even)
        probe_shape[d] = extent
        probe = torch.arange(extent, dtype=torch.int64).reshape(view).expand(probe_shape)
        local = distribute_tensor(probe, mesh, list(placements), src_data_rank=None).to_local()
        line = local[tuple(slice(None) if k == d else 0 for k in range(len(shape)))]
        out.append(line.cpu().numpy() if local.numel() else np.empty(0, np.int64))
    return out


def index_runs(indices: np.ndarray) -> list[tuple[int, int, int]]:
    """Not collective. (local start, global start, length) of each run of consecutive global
    indices."""
    if not len(indices):
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(indices)]))
    return [(int(a), int(indices[a]), int(b - a)) for a, b in zip(starts, stops)]


def block_runs(shape: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...],
               block: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Not collective. Where the elements [start, stop) of a tensor of `shape`, held as
    `block` (C order), lie in the whole tensor laid out C order: (element offset, 1-D run of
    `block`) for each run of consecutive elements: one for rows in one piece, one per row
    for a block of columns."""
    if not block.size:
        return
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    whole = len(shape)  # the dimensions from `whole` on are all in the block
    while whole > 0 and (start[whole - 1], stop[whole - 1]) == (0, shape[whole - 1]):
        whole -= 1
    outer = max(0, whole - 1)  # one run per index of the dimensions before the cut one
    base = sum(a * st for a, st in zip(start[outer:], strides[outer:]))
    for index in itertools.product(*(range(a, b) for a, b in zip(start[:outer], stop[:outer]))):
        at = base + sum(i * st for i, st in zip(index, strides))
        yield at, block[tuple(i - a for i, a in zip(index, start))].reshape(-1)


def held_runs(local: LocalState, key: str) -> Iterator[tuple[int, np.ndarray]]:
    """Not collective. block_runs of what this rank writes of `key` (its rows, or its
    blocks)."""
    shape = local.rows[key].shape
    if key in local.arrays:
        rows = local.rows[key]
        yield from block_runs(shape, (rows.start, *[0] * (len(shape) - 1)),
                              (rows.stop, *shape[1:]), local.arrays[key])
    for box, block in local.blocks.get(key, ()):
        yield from block_runs(shape, box.start, box.stop, block)


def localize(tree: Any, prefix: str) -> tuple[Any, dict[int, tuple[Rows, Any]]]:
    """The tree with every DTensor replaced by its local tensor, and {id(local): (its Rows, the
    DTensor)}. Plain containers are rebuilt where they hold a DTensor; the rest is kept."""
    found: dict[int, tuple[Rows, Any]] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            rows = dtensor_rows(value, f"{prefix}/{path}")
            if rows is None:
                return value
            local = value.to_local()  # type: ignore[attr-defined]
            found[id(local)] = (rows, value)
            return local
        if type(value) in (dict, collections.OrderedDict):
            return type(value)((k, walk(v, f"{path}.{k}" if path else str(k)))
                               for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(walk(v, f"{path}.{i}") for i, v in enumerate(value))
        return value

    return walk(tree, ""), found


@dataclass
class LocalState:
    """What one rank holds of a state to save: the documents (the same on every rank), the
    arrays of the rows it writes, and for every tensor its dtype and Rows."""

    documents: dict[str, Any]
    arrays: dict[str, np.ndarray]  # key -> this rank's rows (only where it is the writer)
    dtypes: dict[str, str]
    rows: dict[str, Rows]
    # key -> this rank's blocks, where they are not rows in one piece (Rows.boxes; only where
    # it is the writer): each block's Box and its elements, C order
    blocks: dict[str, list[tuple[Box, np.ndarray]]] = dataclasses.field(default_factory=dict)
    stored: dict[str, np.dtype] = dataclasses.field(default_factory=dict)  # dtype in the file
    whole: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # held whole here
    # the global ranks of the device meshes its DTensors span, and this rank's among them
    meshes: set[int] = dataclasses.field(default_factory=set)
    mesh_rank: int | None = None
    # key -> (shape, lowest global rank) of the mesh of a DTensor: meshes of one shape that
    # do not overlap (tp groups of different data-parallel replicas) hold copies
    mesh_of: dict[str, tuple[tuple[int, ...], int]] = dataclasses.field(default_factory=dict)

    def snapshot(self) -> LocalState:
        """A copy of the local rows (for a save in the background)."""
        return LocalState(self.documents, {k: a.copy() for k, a in self.arrays.items()},
                          self.dtypes, self.rows,
                          {k: [(box, a.copy()) for box, a in blocks]
                           for k, blocks in self.blocks.items()},
                          self.stored, meshes=self.meshes, mesh_rank=self.mesh_rank,
                          mesh_of=self.mesh_of)

    def layout(self) -> dict:
        return {key: (self.dtypes[key], list(self.rows[key].shape)) for key in sorted(self.rows)}


def collect_local(state: Mapping[str, Any], rank: int) -> LocalState:
    """Flatten {component: state tree} into this rank's LocalState (see LocalState). Raises
    CheckpointError naming the key of anything that cannot be stored."""
    out = LocalState({}, {}, {}, {})
    for component, tree in state.items():
        local_tree, dtensors = localize(tree, component)
        out.documents[component], tensors = flatten(local_tree, component)
        for name, value in tensors.items():
            key = dataset_name(component, name)
            if isinstance(value, np.ndarray):
                array, out.dtypes[key] = contiguous(value), f"numpy.{value.dtype}"
            else:
                array, out.dtypes[key] = to_numpy(value), dtype_name(value.dtype)
            held = dtensors.get(id(value))
            if held is None:  # the same on every rank: rank 0 stores it
                rows = Rows(0, row_count(array.shape), tuple(array.shape), rank == 0)
            else:
                rows, mesh = held[0], held[1].device_mesh
                out.meshes.update(int(r) for r in mesh.mesh.flatten().tolist())
                out.mesh_rank = int(mesh.get_rank())
                out.mesh_of[key] = (tuple(mesh.mesh.shape), int(mesh.mesh.min()))
            out.rows[key] = rows
            out.stored[key] = array.dtype
            if not rows.boxes and (rows.start, rows.stop) == (0, row_count(rows.shape)):
                out.whole[key] = array
            if rows.writer and rows.boxes:
                out.blocks[key] = [(box, np.ascontiguousarray(array[box.local_slices()]))
                                   for box in rows.boxes if box.size]
            elif rows.writer and rows.stop > rows.start and array.nbytes:
                out.arrays[key] = array
    return out


def check_joined(comm: Comm, local: LocalState, what: str) -> None:
    """Collective, before anything of a save is written: refuse to save sharded state that
    ranks holding rows of it did not join (a rank saving alone: api.who_saves), naming
    them. Each rank's rows are its own: without theirs no tensor would be whole.

    Also where DTensors lie on meshes that do not span the world (tensor parallelism on tp
    groups, replicated across data-parallel groups without fully_shard): of the meshes of one
    shape that hold a tensor, the one with the lowest rank writes it, and the copies on the
    others are dropped from `local` here (each mesh's own replicas are deduplicated by their
    placements). Meshes are matched per tensor: two tensors on meshes of one shape (each
    stage of a model on ranks of its own) are not copies of each other."""
    gathered = comm.allgather((local.mesh_rank, sorted(set(local.mesh_of.values()))),
                              what=what + " (which ranks save)")
    joined = [rank for rank, _ in gathered]
    lows: dict[tuple[int, ...], set[int]] = {}
    for _, meshes in gathered:
        for shape, lowest in meshes:
            lows.setdefault(shape, set()).add(lowest)
    # Only tensors on meshes of a shape that lie at several places can have copies; every
    # rank has the same `gathered`, so all of them take this branch or none does.
    if any(len(found) > 1 for found in lows.values()):
        mine = {(key, shape): lowest for key, (shape, lowest) in local.mesh_of.items()
                if len(lows[shape]) > 1}
        first = comm.bcast(_first_copies(comm.gather(mine, what=what + " (which copy saves)")),
                           what=what + " (which copy saves)")
        for (key, shape), lowest in mine.items():
            if first.get((key, shape), lowest) != lowest:
                local.arrays.pop(key, None)
                local.blocks.pop(key, None)
    with agreement(comm, what, kind=CheckpointCollectiveError):
        absent = sorted(local.meshes - set(joined))
        if absent:
            saving = sorted(r for r in joined if r is not None)
            raise CheckpointError(
                f"rank(s) {absent} did not join the save: a sharded (FSDP) checkpoint holds "
                f"the rows each rank owns, and only rank(s) {saving} are saving theirs",
                "call the save on every rank, not under `if accelerator.is_main_process:` (a "
                "fully sharded model's state is spread over all of them).",
            )


def _first_copies(
    parts: list[dict[tuple[str, tuple[int, ...]], int]] | None,
) -> dict[tuple[str, tuple[int, ...]], int] | None:
    """Of the ranks' {(key, mesh shape): lowest rank of its mesh} (on the gather's root;
    None elsewhere), the lowest per (key, mesh shape) where meshes at several places hold
    it: the one copy that is saved."""
    if parts is None:
        return None
    found: dict[tuple[str, tuple[int, ...]], set[int]] = {}
    for part in parts:
        for held, lowest in part.items():
            found.setdefault(held, set()).add(lowest)
    return {held: min(lows) for held, lows in found.items() if len(lows) > 1}


def block_digests(array: np.ndarray, rows_per_block: int) -> list[str]:
    if array.ndim == 0:
        return [checksum(array)]
    return [checksum(array[i : i + rows_per_block])
            for i in range(0, array.shape[0], rows_per_block)]


def rows_per_block(array: np.ndarray) -> int:
    row_bytes = array.nbytes // max(1, row_count(array.shape))
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def block_dataset(key: str, i: int) -> str:
    """Not collective. The dataset of a rank's file that holds block `i` of its blocks of
    `key`."""
    return f"{key}@{i}"


def _write_rank_file(path: str, local: LocalState) -> tuple[dict[str, list[dict]], int]:
    """This rank's file: its rows (or blocks) of every tensor; returns {key: [slice entries]}
    and its size."""
    datasets = dict(local.arrays)
    dtypes = dict(local.dtypes)
    parts: dict[str, list[tuple[str, Box | None]]] = {key: [(key, None)] for key in local.arrays}
    for key, blocks in local.blocks.items():
        parts[key] = []
        for i, (held, array) in enumerate(blocks):
            name = block_dataset(key, i)
            datasets[name], dtypes[name] = array, local.dtypes[key]
            parts[key].append((name, held))
    entries, size = write_h5(path, datasets, dtypes)
    slices: dict[str, list[dict]] = {}
    for key, names in parts.items():
        rows = local.rows[key]
        slices[key] = []
        for name, box in names:
            array, entry = datasets[name], entries[name]
            if entry.offset is None:
                raise CheckpointError(f"HDF5 gave {name!r} no contiguous storage in {path!r}")
            per_block = rows_per_block(array)
            digests = block_digests(array, per_block) if array.ndim else [entry.xxh3]
            if len(digests) == 1:
                digests = [entry.xxh3]
            piece = {
                "file": entry.file,
                "start": rows.start if box is None else box.start[0],
                "stop": rows.stop if box is None else box.stop[0],
                "offset": entry.offset, "nbytes": entry.nbytes,
                "rows_per_block": per_block, "xxh3": digests,
            }
            if box is not None and (box.start[1:] != (0,) * (len(box.start) - 1)
                                    or box.stop[1:] != rows.shape[1:]):
                piece["inner"] = [[a, b] for a, b in zip(box.start[1:], box.stop[1:])]
            slices[key].append(piece)
    return slices, size


def _coverage_error(key: str, shape: list[int], slices: list[dict]) -> str | None:
    """Where the slices of a tensor do not cover it exactly once (None: they do)."""
    if any("inner" in piece for piece in slices):
        problem = block_cover_problem(shape, [slice_box(piece, shape) for piece in slices])
        return None if problem is None else f"{key!r}: {problem}"
    expected = 0
    for piece in slices:
        if piece["start"] != expected:
            return (f"{key!r}: rows {expected}..{piece['start']} are missing or stored twice "
                    f"(next slice starts at {piece['start']})")
        expected = piece["stop"]
    total = row_count(shape) if math.prod(shape) else 0
    if (slices and expected != total) or (not slices and total):
        return f"{key!r}: the slices cover rows 0..{expected} of {total}"
    return None


def build_index(
    comm_size: int, stem: str, save_id: str, local: LocalState,
    gathered: list[tuple[dict[str, dict], dict[str, int]]], metadata: Mapping[str, Any],
) -> CheckpointIndex:
    sliced: dict[str, dict] = {
        key: {"dtype": local.dtypes[key], "shape": list(rows.shape), "slices": []}
        for key, rows in sorted(local.rows.items())
    }
    sizes: dict[str, int] = {}
    for slices, files in gathered:
        sizes.update(files)
        for key, pieces in slices.items():
            sliced[key]["slices"].extend(pieces)
    problems = []
    for key, entry in sliced.items():
        entry["slices"].sort(key=lambda piece: (piece["start"], piece.get("inner", [])))
        problem = _coverage_error(key, entry["shape"], entry["slices"])
        if problem:
            problems.append(problem)
    if problems:
        raise CheckpointError(
            "the ranks' shards do not make whole tensors: " + "; ".join(problems[:3]),
            "every rank must save the same fully_shard model and optimizer, on one device mesh "
            "spanning all ranks.",
        )
    return CheckpointIndex.new(
        stem=stem,
        save_id=save_id,
        world_size=comm_size,
        metadata={"kind": "sharded", **dict(metadata)},
        components=local.documents,
        tensors={},
        sliced={key: SlicedTensor.from_json(entry) for key, entry in sliced.items()},
        shards=tuple(sorted(sizes)),
        file_sizes=sizes,
    )


def write_local(comm: Comm, directory: str, stem: str, local: LocalState,
                metadata: Mapping[str, Any] | None = None,
                keep: str | None = None) -> Mapping[str, Any]:
    """Collective: steps 2-4 of save_sharded (see the module's docstring). Returns the committed
    index: on rank 0 the dict it wrote, on the others a CommittedIndex. `keep`: the save id of
    files of this stem that stay in the directory (commit_index)."""
    what = f"saving sharded checkpoint {directory!r}"
    save_id = comm.bcast(uuid.uuid4().hex[:12] if comm.rank == 0 else None, what=what)
    limit = rawio.stall_limit(comm.default_timeout)
    create_directory(comm, directory, what, limit)
    name = f"{stem}-{save_id}-rank{comm.rank:05d}.h5"
    path = os.path.join(directory, name)
    written: list[str] = []
    slices: dict[str, list[dict]] = {}
    sizes: dict[str, int] = {}

    def write_mine() -> None:
        nonlocal slices
        # nothing of its own to store (a replica, an empty shard)
        if not local.arrays and not any(local.blocks.values()):
            return
        written.append(path)
        slices, sizes[name] = _write_rank_file(path, local)

    write_step(comm, what, "writing shards", limit, write_mine, written)
    # Only rank 0 writes the index: the others send it their slice entries and hold no one
    # else's (an allgather, or a broadcast of the index, would give every rank all n x T).
    gathered = comm.gather((slices, sizes), what=what)
    index: CheckpointIndex | None = None
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            assert gathered is not None
            index = build_index(comm.size, stem, save_id, local, gathered, metadata or {})
        except Exception as exc:  # reported by commit_index, on every rank
            error = exc
    commit_index(comm, directory, stem, what, limit, index, error, written, keep)
    if index is not None:
        return index.to_json()
    return CommittedIndex(directory, stem, save_id)


class CommittedIndex(Mapping[str, Any]):
    """The index a save committed, as ranks other than 0 get it: read from its file when first
    used (most callers want only `save_id`, which it knows), so that the save itself moves no
    index to them."""

    def __init__(self, directory: str, stem: str, save_id: str) -> None:
        self.directory, self.stem, self.save_id = directory, stem, save_id
        self._index: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        if self._index is None:
            from ..files import open_directory
            from ..index import index_path, read_index_text
            from ..index_check import decode_index

            path = index_path(self.directory, self.stem)
            dir_fd = open_directory(self.directory)  # read as a load reads it (files.py)
            try:
                index = decode_index(read_index_text(dir_fd, self.directory, self.stem), path)
            finally:
                os.close(dir_fd)
            if index.get("save_id") != self.save_id:
                raise CheckpointError(
                    f"{path!r} is the index of save {index.get('save_id')!r}, not of the save "
                    f"{self.save_id!r} that returned it: the directory was saved into again",
                    "use the index right after the save, or save into a directory of its own.",
                )
            self._index = index
        return self._index

    def __getitem__(self, key: str) -> Any:
        if key == "save_id":
            return self.save_id
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def save_sharded(
    comm: Comm,
    directory: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    stem: str = SHARDED_STEM,
    metadata: Mapping[str, Any] | None = None,
    saver: Any = None,
) -> Mapping[str, Any] | None:
    """Collective. Save {component: state dict} (values may be DTensors of Shard(0) and
    Replicate placements, plain tensors, arrays and plain values) under `directory`: each rank
    writes only its own rows. Returns the committed index (on ranks other than 0, read from
    its file when first used: see CommittedIndex).

    `saver` (an mpaccel.checkpoint.AsyncSaver): copy the local rows and write them in the
    background; returns None at once, `saver.wait()` waits for the commit and raises its error.
    """
    directory = os.fspath(directory)
    what = f"saving sharded checkpoint {directory!r}"
    local = LocalState({}, {}, {}, {})
    with agreement(comm, what + " (collecting the state)", kind=CheckpointCollectiveError):
        local = collect_local(state, comm.rank)
        if saver is not None:
            local = local.snapshot()
    check_joined(comm, local, what)
    check_same_on_every_rank(comm, what, local.documents, local.layout())
    if saver is None:
        return write_local(comm, directory, stem, local, metadata)
    from ..async_save import threads_ok

    saver.wait()
    if not threads_ok():
        warnings.warn("async_save needs MPI_THREAD_MULTIPLE; saving synchronously",
                      MpaccelRuntimeWarning, stacklevel=2)
        return write_local(comm, directory, stem, local, metadata)
    background = saver.comm_for(comm)  # collective, the first time
    saver.start(lambda: write_local(background, directory, stem, local, metadata))
    return None
