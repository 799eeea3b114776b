"""The schema a checkpoint index read from disk must have before anything uses it (types,
ranges, plain file names, extents that fit the files, well-formed state documents: those in
index_documents.py), once index_scan.py bounded its bytes. Pure functions of bytes and JSON
values; index_read.py does the I/O, index.py builds the typed index from what passed. Every
failure is a CheckpointError naming the file and the field (index_fields.py)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from .format import (
    FORMAT_NAME,
    SHARDED_FORMAT_VERSION,
    CheckpointError,
    _numpy_storable,
    storage_dtype,
)
from .index_documents import check_document
from .index_fields import TORCH_NAME, Checker, field_path, is_int, plain_name, show
from .index_scan import HINT as _HINT

MAX_DIMS = 64  # numpy's
_HEX16 = re.compile(r"[0-9a-f]{16}\Z")
# components mpaccel writes whose state is a dict (custom_N hold whatever their state_dict gives)
_STATE_DICTS = re.compile(
    r"(model|scaler|accelerator|rng|(model|optimizer|scheduler|dataloader|gradients)_\d+)\Z"
)

_Extent = tuple[int, int, tuple, str]  # offset, bytes, where the part is, tensor key


def _parse_constant(name: str) -> float:
    # Indexes of earlier versions hold bare NaN / Infinity for some values of the state (see
    # docs/checkpoint-format.md); the schema refuses them in every field of the format itself.
    return float(name)


def decode_text(data: bytes | bytearray, path: str) -> str:
    """The text of an index's bytes (UTF-8)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path!r} is not UTF-8 text: {exc}", _HINT) from None


def decode_index(text: str, path: str) -> Any:
    """The JSON document in `text` (the whole file, already fed through an IndexScanner), not
    yet checked: CheckpointIndex.from_json checks it. Call it under no_collection()."""
    try:
        return json.loads(text, parse_constant=_parse_constant)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path!r} is not valid JSON: {exc}", _HINT) from exc
    except ValueError as exc:  # int() under a lower sys.set_int_max_str_digits() than ours
        raise CheckpointError(f"{path!r}: {exc}", _HINT) from exc


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused: building and walking an index makes hundreds
    of thousands of objects, none of them garbage, and the collections they set off cost more
    than parsing and checking them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_index(index: Any, path: str) -> None:
    """Nothing if `index` (parsed JSON) has the shape of a checkpoint index, else a
    CheckpointError naming `path` and the field. Unknown fields are left alone (later writers
    of format version 1 may add optional ones)."""
    c = Checker(path)
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path!r} is not an mpaccel checkpoint index", _HINT)
    version = index.get("format_version", 0)
    if not is_int(version) or version < 0:
        raise c.fail(("format_version",), f"is {show(version)}: expected an integer >= 0")
    if version > SHARDED_FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} has format version {version}; this mpaccel reads up to "
            f"{SHARDED_FORMAT_VERSION}",
            "upgrade mpaccel to read it.",
        )
    for key in ("stem", "save_id", "created", "mpaccel_version"):
        c.get(index, (), key, str, optional=True)
    digest = c.get(index, (), "index_xxh3", str, optional=True)
    if digest is not None and not _HEX16.match(digest):
        raise c.fail(("index_xxh3",), f"is {show(digest)}: expected 16 hex digits")
    world = c.integer(index, (), "world_size", low=1)
    metadata = c.get(index, (), "metadata", dict, optional=True) or {}
    kind = c.get(metadata, ("metadata",), "kind", str, optional=True)
    part = c.get(metadata, ("metadata",), "sharded", str, optional=True)
    if part is not None and not plain_name(f"sharded.{part}.index.json"):
        # a save id: the saver and the loader make file names of it
        raise c.fail(("metadata", "sharded"), f"is {show(part)}: expected a save id (a plain "
                     "file name: no directory part)")
    c.integer(metadata, ("metadata",), "iteration", optional=True)
    sizes = c.get(index, (), "file_sizes", dict, optional=True) or {}
    for name in sizes:
        c.integer(sizes, ("file_sizes",), name)
    shards = c.get(index, (), "shards", list)
    extents: dict[str, list[_Extent]] = {}
    # the tensors first: an error then names the tensor as well as the file
    files = {s for s in shards if isinstance(s, str)}
    sliced = _check_sliced(c, index, files, extents) if version >= 2 else {}
    _check_part(c, index, (), files, extents, sliced)
    for i, name in enumerate(shards):
        c.name(name, ("shards", i))
    parts = c.get(index, (), "per_rank", list)
    if len(parts) not in (0, world) or (kind == "state" and len(parts) != world):
        raise c.fail(("per_rank",), f"has {len(parts)} entries for world_size {world}")
    for rank, part in enumerate(parts):
        where = ("per_rank", rank)
        if not isinstance(part, dict):
            raise c.fail(where, f"is {show(part)}: expected a dict")
        own = c.name(c.get(part, where, "file", str), (*where, "file"))
        _check_part(c, part, where, {own}, extents)
    _check_extents(c, extents, sizes)
    for name in sizes:  # (after the tensors: an error there names the tensor as well)
        c.name(name, ("file_sizes",))


def _check_part(
    c: Checker,
    part: dict,
    where: tuple,
    files: set[str],
    extents: dict[str, list[_Extent]],
    sliced: dict | None = None,
) -> None:
    """A part's components (state documents) and their tensors' entries (documents may also
    name the `sliced` tensors of a sharded checkpoint)."""
    components = c.get(part, where, "components", dict)
    tensors = c.get(part, where, "tensors", dict)
    for component in components:
        if not plain_name(component):
            raise c.fail((*where, "components"), f"names a component {show(component)}")
    plain = {f for f in files if plain_name(f)}
    for key, entry in tensors.items():
        component, _, link = key.partition("/")
        if component not in components or not link or "/" in link or link in (".", ".."):
            raise c.fail((*where, "tensors", key), "is not a tensor of a component of the index")
        if not _entry_ok(entry, plain):  # (the detailed check, for its message)
            _check_entry(c, entry, (*where, "tensors", key), files)
        offset = entry.get("offset")
        if offset is not None and entry["nbytes"]:
            extents.setdefault(entry["file"], []).append((offset, entry["nbytes"], where, key))
    for component, document in components.items():
        at = (*where, "components", component)
        if _STATE_DICTS.match(component) and not isinstance(document, dict):
            raise c.fail(at, f"is {show(document)}: expected the object's state_dict")
        if component == "accelerator":
            c.integer(document, at, "step")
        check_document(c, document, at, component, {**tensors, **sliced} if sliced else tensors)


def _check_sliced(
    c: Checker, index: dict, files: set[str], extents: dict[str, list[_Extent]]
) -> dict:
    """Format 2's `sliced` tensors: {key: {dtype, shape (global), slices: [{file, start, stop,
    offset, nbytes, rows_per_block, xxh3: [one per block]}]}}, rows along dimension 0 (a 0-d
    tensor has one), the slices in order, covering every row once."""
    sliced = c.get(index, (), "sliced", dict, optional=True) or {}
    found = index.get("components")
    components: dict = found if isinstance(found, dict) else {}
    for key, entry in sliced.items():
        at = ("sliced", key)
        component, _, link = key.partition("/")
        if component not in components or not link or "/" in link or link in (".", ".."):
            raise c.fail(at, "is not a tensor of a component of the index")
        if not isinstance(entry, dict):
            raise c.fail(at, f"is {show(entry)}: expected a dict")
        dtype = c.get(entry, at, "dtype", str)
        itemsize = _itemsize(dtype)
        if not itemsize:
            raise c.fail((*at, "dtype"), f"is {show(dtype)}: not a dtype sharded saves store")
        shape = c.get(entry, at, "shape", list)
        if len(shape) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in shape):
            raise c.fail((*at, "shape"),
                         f"is {show(shape)}: expected at most {MAX_DIMS} sizes >= 0")
        rows = shape[0] if shape else 1
        row_bytes = math.prod(shape[1:]) * itemsize
        end = 0
        for i, piece in enumerate(c.get(entry, at, "slices", list)):
            where = (*at, "slices", i)
            if not isinstance(piece, dict):
                raise c.fail(where, f"is {show(piece)}: expected a dict")
            file = c.name(c.get(piece, where, "file", str), (*where, "file"))
            if file not in files:
                raise c.fail((*where, "file"), f"is {file!r}, which is not among the shards")
            start = c.integer(piece, where, "start")
            stop = c.integer(piece, where, "stop")
            if start != end or not start < stop <= rows:
                raise c.fail(where, f"holds rows {start}..{stop}: expected rows from {end} on, "
                             f"at most {rows}")
            end = stop
            nbytes = c.integer(piece, where, "nbytes")
            if nbytes != (stop - start) * row_bytes:
                raise c.fail((*where, "nbytes"), f"is {nbytes}: rows {start}..{stop} of {dtype} "
                             f"{shape} hold {(stop - start) * row_bytes} bytes")
            offset = c.integer(piece, where, "offset")
            per_block = c.integer(piece, where, "rows_per_block", low=1)
            digests = c.get(piece, where, "xxh3", list)
            if len(digests) != -(-(stop - start) // per_block) or not all(
                isinstance(d, str) and _HEX16.match(d) for d in digests
            ):
                raise c.fail((*where, "xxh3"), f"is {show(digests)}: expected one xxh3 (16 hex "
                             f"digits) per {per_block} rows")
            extents.setdefault(file, []).append((offset, nbytes, at, f"slices[{i}]"))
        if end != (rows if row_bytes and rows else 0):
            raise c.fail((*at, "slices"), f"cover rows 0..{end} of {rows}")
    return sliced


_INT = {int}


def _entry_ok(entry: Any, files: set[str]) -> bool:
    """The common case of _check_entry, fast (an index holds an entry per tensor)."""
    if type(entry) is not dict:
        return False
    dtype, shape, nbytes = entry.get("dtype"), entry.get("shape"), entry.get("nbytes")
    offset, digest = entry.get("offset", 0), entry.get("xxh3")
    itemsize = _itemsize(dtype) if type(dtype) is str else None
    return (
        itemsize is not None
        and entry.get("file") in files
        and type(shape) is list
        and len(shape) <= MAX_DIMS
        and set(map(type, shape)) <= _INT
        and (not shape or min(shape) >= 0)
        and type(nbytes) is int
        and (nbytes == math.prod(shape) * itemsize if itemsize else nbytes >= 0)
        and type(offset) is int
        and offset >= 0
        and type(digest) is str
        and _HEX16.match(digest) is not None
    )


def _check_entry(c: Checker, entry: Any, at: tuple, files: set[str]) -> None:
    """What is wrong with an entry _entry_ok refused, in words."""
    if not isinstance(entry, dict):
        raise c.fail(at, f"is {show(entry)}: expected a dict")
    file = c.name(c.get(entry, at, "file", str), (*at, "file"))
    if file not in files:
        raise c.fail((*at, "file"), f"is {file!r}, which is not among this part's files")
    dtype = c.get(entry, at, "dtype", str)
    itemsize = _itemsize(dtype)
    if itemsize is None:
        raise c.fail((*at, "dtype"), f"is {show(dtype)}: not a dtype mpaccel stores")
    shape = c.get(entry, at, "shape", list)
    if len(shape) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in shape):
        raise c.fail((*at, "shape"), f"is {show(shape)}: expected at most {MAX_DIMS} sizes >= 0")
    nbytes = c.integer(entry, at, "nbytes")
    if itemsize and nbytes != math.prod(shape) * itemsize:
        raise c.fail((*at, "nbytes"), f"is {nbytes}: {dtype} {shape} holds "
                     f"{math.prod(shape) * itemsize} bytes")
    digest = c.get(entry, at, "xxh3", str)
    if not _HEX16.match(digest):
        raise c.fail((*at, "xxh3"), f"is {show(digest)}: expected 16 hex digits")
    c.integer(entry, at, "offset", optional=True)


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int | None:
    """Bytes per element of an index's dtype name (0: known only to the file, e.g. a structured
    numpy type or a torch dtype this torch lacks); None for names mpaccel never writes."""
    if len(dtype) > 4096:
        return None
    if not dtype.startswith("numpy."):
        if not TORCH_NAME.match(dtype):
            return None
        stored = storage_dtype(dtype)
        return 0 if stored is None else stored.itemsize
    try:
        parsed = np.dtype(dtype.removeprefix("numpy."))
    except (TypeError, ValueError, SyntaxError):
        # str() of a structured type does not parse back: the file's dtype decides
        return 0 if dtype.startswith(("numpy.[", "numpy.{")) else None
    if parsed.hasobject or not _numpy_storable(parsed):
        return None
    return parsed.itemsize


def _check_extents(c: Checker, extents: dict[str, list[_Extent]], sizes: dict[str, int]) -> None:
    """Each tensor's bytes lie inside its file (as the index records its size) and apart from
    every other tensor's: what loads take into memory is bounded by what the files hold."""
    for file, spans in extents.items():
        spans.sort(key=lambda span: span[0])
        size = sizes.get(file)
        end, previous = 0, ()
        for offset, nbytes, where, key in spans:
            at = (*where, "tensors", key, "offset")
            if size is not None and offset + nbytes > size:
                raise c.fail(at, f"is {offset}: {nbytes} bytes from there end past the {size} "
                             f"bytes of {file!r}")
            if offset < end:
                raise c.fail(at, f"is {offset}: its bytes overlap those of {field_path(previous)}")
            end, previous = max(end, offset + nbytes), (*where, "tensors", key)
