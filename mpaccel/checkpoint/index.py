"""The checkpoint index (`<stem>.index.json`, docs/checkpoint-format.md) as frozen dataclasses:
from_json checks a document read from disk (index_check.py) and upgrades older layouts, here
and nowhere else; to_json gives the JSON document that writers commit; read_index opens a
directory's index (files.py: no link followed, the size bounded) and explains a missing one
(an interrupted save, or the other kind of checkpoint)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._version import __version__
from ..errors import CheckpointError
from .files import read_regular
from .format import (
    BLOCK_FORMAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DIGEST,
    SHARDED_FORMAT_VERSION,
    index_digest,
)
from .index_check import (
    MAX_INDEX_BYTES,
    check_index,
    decode_index,
    decode_text,
    no_collection,
    scan,
)

_OPTIONAL = ("stem", "save_id", "created", "mpaccel_version")  # text fields, absent in some


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lies: `nbytes` bytes of `dtype` (a torch dtype's name, or `numpy.` and
    a numpy dtype's) and `shape`, in `file` at `offset` in one piece (None: not recorded, for
    an empty tensor or a file of an index older than offsets; HDF5 then finds the data), with
    the xxh3 of those bytes."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    xxh3: str
    offset: int | None = None

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> TensorEntry:
        """The entry of a checked index (CheckpointIndex.from_json checks it)."""
        return cls(entry["file"], entry["dtype"], tuple(entry["shape"]), entry["nbytes"],
                   entry["xxh3"], entry.get("offset"))

    def __reduce__(self) -> tuple[Any, tuple]:
        # The ranks allgather their entries at every save: rebuilt from their fields, they
        # unpickle about twice as fast as through the dataclass's __setstate__.
        return (TensorEntry, (self.file, self.dtype, self.shape, self.nbytes, self.xxh3,
                              self.offset))

    def to_json(self) -> dict[str, Any]:
        out = {"file": self.file, "dtype": self.dtype, "shape": list(self.shape),
               "nbytes": self.nbytes, "xxh3": self.xxh3}
        if self.offset is not None:
            out["offset"] = self.offset
        return out


@dataclass(frozen=True, slots=True)
class RowSlice:
    """Rows `start` to `stop` (exclusive, along dimension 0; a 0-d tensor has one row) of a
    sliced tensor: `nbytes` bytes in `file` at `offset`, C order, with one xxh3 per block of
    `rows_per_block` rows (the last block may be shorter). `inner`: for an N-D block (tensor
    parallelism), its (start, stop) along each dimension after the first; None: all of each,
    whole rows."""

    file: str
    start: int
    stop: int
    offset: int
    nbytes: int
    rows_per_block: int
    xxh3: tuple[str, ...]
    inner: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def from_json(cls, piece: Mapping[str, Any]) -> RowSlice:
        inner = piece.get("inner")
        return cls(piece["file"], piece["start"], piece["stop"], piece["offset"],
                   piece["nbytes"], piece["rows_per_block"], tuple(piece["xxh3"]),
                   None if inner is None else tuple((a, b) for a, b in inner))

    def to_json(self) -> dict[str, Any]:
        out = {"file": self.file, "start": self.start, "stop": self.stop, "offset": self.offset,
               "nbytes": self.nbytes, "rows_per_block": self.rows_per_block,
               "xxh3": list(self.xxh3)}
        if self.inner is not None:
            out["inner"] = [[a, b] for a, b in self.inner]
        return out

    def box(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Not collective. (start, stop) along every dimension of a tensor of `shape` (a 0-d
        one: none)."""
        if not shape:
            return (), ()
        inner = self.inner if self.inner is not None else tuple((0, d) for d in shape[1:])
        return (self.start, *(a for a, _ in inner)), (self.stop, *(b for _, b in inner))


@dataclass(frozen=True, slots=True)
class SlicedTensor:
    """A tensor of a sharded checkpoint (format 2; 3 with N-D blocks): its dtype, its global
    shape, and the slices that hold its rows, in row order, covering each row once; or, where
    some slice has `inner` (`blocks`), N-D blocks covering each element once."""

    dtype: str
    shape: tuple[int, ...]
    slices: tuple[RowSlice, ...]

    @property
    def blocks(self) -> bool:
        """Not collective. Its slices are N-D blocks, not whole rows."""
        return any(piece.inner is not None for piece in self.slices)

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> SlicedTensor:
        return cls(entry["dtype"], tuple(entry["shape"]),
                   tuple(RowSlice.from_json(piece) for piece in entry["slices"]))

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape),
                "slices": [piece.to_json() for piece in self.slices]}


@dataclass(frozen=True, slots=True)
class RankPart:
    """One rank's own file: its state documents and their tensors (all in `file`)."""

    file: str
    components: Mapping[str, Any]
    tensors: Mapping[str, TensorEntry]

    @classmethod
    def from_json(cls, part: Mapping[str, Any]) -> RankPart:
        return cls(part["file"], part["components"], _entries(part["tensors"]))

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "components": dict(self.components),
                "tensors": {key: entry.to_json() for key, entry in self.tensors.items()}}


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointIndex:
    """A checkpoint's index. `components`: each component's state document (JSON, its tensors
    tagged by name: format.flatten); `tensors`: the shared tensors by `<component>/<name>`;
    `shards`: the shared files; `per_rank`: each rank's own part (none for save_model and
    sharded checkpoints); `sliced`: the tensors of a sharded checkpoint (format 2 or 3);
    `file_sizes`: every file's size as written (empty in indexes older than it)."""

    format_version: int
    world_size: int
    metadata: Mapping[str, Any]
    components: Mapping[str, Any]
    tensors: Mapping[str, TensorEntry]
    shards: tuple[str, ...]
    per_rank: tuple[RankPart, ...]
    file_sizes: Mapping[str, int]
    sliced: Mapping[str, SlicedTensor]
    stem: str | None = None
    save_id: str | None = None
    created: str | None = None
    mpaccel_version: str | None = None
    index_xxh3: str | None = None  # as read (None: written before it, or not written yet)

    @classmethod
    def from_json(cls, document: Any, path: str) -> CheckpointIndex:
        """The index in `document` (as json.loads gave it) of the file `path`, once it passed
        every check of index_check.py and matches its checksum; a CheckpointError naming `path`
        and the field otherwise. Older layouts are upgraded here: no `format_version` is 0, no
        `metadata` or `file_sizes` empty ones, an entry without `offset` None (read through
        HDF5), `sliced` is read from format 2 on."""
        check_index(document, path)
        saved = document.get(INDEX_DIGEST)
        if saved is not None and saved != index_digest(document, parsed=True):
            raise CheckpointError(
                f"{path!r} does not match its checksum: the index (which holds the state's "
                "non-tensor values: learning rates, steps, positions) was changed after the "
                "save, or is corrupted",
                "restore it from a copy, or load an earlier checkpoint.",
            )
        version = document.get("format_version", 0)
        sliced = document.get("sliced") if version >= SHARDED_FORMAT_VERSION else None
        return cls(
            format_version=version,
            world_size=document["world_size"],
            metadata=document.get("metadata") or {},
            components=document["components"],
            tensors=_entries(document["tensors"]),
            shards=tuple(document["shards"]),
            per_rank=tuple(RankPart.from_json(part) for part in document["per_rank"]),
            file_sizes=document.get("file_sizes") or {},
            sliced={key: SlicedTensor.from_json(entry) for key, entry in (sliced or {}).items()},
            **{key: document.get(key) for key in _OPTIONAL},
            index_xxh3=saved,
        )

    @classmethod
    def new(
        cls,
        *,
        stem: str,
        save_id: str,
        world_size: int,
        metadata: Mapping[str, Any],
        components: Mapping[str, Any],
        shards: tuple[str, ...],
        file_sizes: Mapping[str, int],
        tensors: Mapping[str, TensorEntry] | None = None,
        per_rank: tuple[RankPart, ...] = (),
        sliced: Mapping[str, SlicedTensor] | None = None,
    ) -> CheckpointIndex:
        """Not collective. The index of a save this mpaccel commits now: format 3 if a
        `sliced` tensor has N-D blocks, else 2 if it has `sliced` tensors, else 1 (each the
        oldest format that holds it, so that older readers still read what they can)."""
        version = FORMAT_VERSION
        if sliced is not None:
            blocks = any(entry.blocks for entry in sliced.values())
            version = BLOCK_FORMAT_VERSION if blocks else SHARDED_FORMAT_VERSION
        return cls(
            format_version=version,
            stem=stem,
            save_id=save_id,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            mpaccel_version=__version__,
            world_size=world_size,
            metadata=metadata,
            components=components,
            tensors={} if tensors is None else tensors,
            shards=shards,
            per_rank=per_rank,
            file_sizes=file_sizes,
            sliced={} if sliced is None else sliced,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document of this index, fields in the order writers have always written
        them (`index_xxh3` last, where there is one: storage.write_index adds it)."""
        out: dict[str, Any] = {"format": FORMAT_NAME, "format_version": self.format_version}
        for key in _OPTIONAL:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["world_size"] = self.world_size
        out["metadata"] = dict(self.metadata)
        out["components"] = dict(self.components)
        out["tensors"] = {key: entry.to_json() for key, entry in self.tensors.items()}
        if self.format_version >= SHARDED_FORMAT_VERSION:
            out["sliced"] = {key: entry.to_json() for key, entry in self.sliced.items()}
        out["shards"] = list(self.shards)
        out["per_rank"] = [part.to_json() for part in self.per_rank]
        out["file_sizes"] = dict(self.file_sizes)
        if self.index_xxh3 is not None:
            out[INDEX_DIGEST] = self.index_xxh3
        return out

    @property
    def is_sharded(self) -> bool:
        """Not collective. A sharded checkpoint (format 2 or 3): its tensors are `sliced`."""
        return self.format_version >= SHARDED_FORMAT_VERSION

    def entries(self) -> Iterator[tuple[str, TensorEntry]]:
        """(key, entry) of every tensor: the shared ones, then each rank's own."""
        yield from self.tensors.items()
        for part in self.per_rank:
            yield from part.tensors.items()


def _entries(tensors: Mapping[str, Any]) -> dict[str, TensorEntry]:
    make = TensorEntry.from_json
    return {key: make(entry) for key, entry in tensors.items()}


def index_path(directory: str, stem: str) -> str:
    return os.path.join(directory, f"{stem}.index.json")


def read_index(directory_fd: int, directory: str, stem: str) -> CheckpointIndex:
    """Not collective. The index `stem`.index.json of the checkpoint `directory` (open as
    `directory_fd`): a regular file of bounded size, read without following links and without
    blocking, nested, sized and dense within bounds, of the index's schema, and matching its
    checksum (indexes of earlier versions have none)."""
    return parse_index(read_index_text(directory_fd, directory, stem), index_path(directory, stem))


def read_index_text(directory_fd: int, directory: str, stem: str) -> str:
    """Not collective. The text of `stem`.index.json, read through files.read_regular (at most
    MAX_INDEX_BYTES) and the bounds of index_check.scan, not yet parsed (parse_index)."""
    path = index_path(directory, stem)
    try:
        data = read_regular(directory_fd, directory, f"{stem}.index.json", MAX_INDEX_BYTES,
                            "an index")
    except FileNotFoundError:
        raise no_index(directory, stem) from None
    scan(data, path)
    text = decode_text(data, path)
    data.clear()  # not kept while json.loads builds the index: its memory is bounded by that
    return text


def parse_index(text: str, path: str) -> CheckpointIndex:
    """Not collective. The index in `text` (read_index_text: scanned) of the file `path`,
    parsed and checked (CheckpointIndex.from_json)."""
    with no_collection():
        return CheckpointIndex.from_json(decode_index(text, path), path)


def no_index(directory: str, stem: str) -> CheckpointError:
    kinds = {"model": "save_model", "state": "save_state"}
    other = next(
        (s for s in kinds if s != stem and os.path.isfile(index_path(directory, s))), None
    )
    hint = "a save that was interrupted leaves no index; load the previous checkpoint."
    if other is not None:
        hint = f"it holds a {kinds[other]}() checkpoint ({other}.index.json): " + (
            "load it with mpaccel.checkpoint.load_model_state(directory) and "
            "model.load_state_dict()."
            if other == "model"
            else "load it with accelerator.load_state(directory)."
        )
    return CheckpointError(
        f"{directory!r} holds no committed checkpoint: {stem}.index.json is missing", hint
    )
