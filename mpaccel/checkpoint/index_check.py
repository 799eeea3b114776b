"""The one schema a checkpoint index read from disk must meet before anything uses it: its
bytes bounded (size cap, string and number lengths, and the memory its values take once
parsed, by scan()), then the parsed document's types, ranges, plain file names, extents that
fit the files and well-formed state documents (check_index). Pure functions of bytes and JSON
values; index.py does the I/O and builds the typed index from what passed. Every failure is a
CheckpointError naming the file and the field (Checker).

One concept, past 600 lines: every rule a hostile index must pass, in one place. The numpy
pre-lexer (scan) stays because it is what keeps the memory bound that
tests/test_checkpoint_index.py measures (a padded index costs at most ~6x its size once
parsed): json.loads refuses deep nesting itself, but not a document of many tiny values (an
empty `{}` is 3 bytes of text and 64 of Python), which only counting them before parsing
bounds."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import random
import re
import reprlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import CheckpointError
from .format import (
    BLOCK_FORMAT_VERSION,
    FORMAT_NAME,
    MAX_NESTING,
    NEWEST_FORMAT_VERSION,
    SHARDED_FORMAT_VERSION,
    dataset_name,
    numpy_storable,
    storage_dtype,
)

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
        raise CheckpointError(f"{path!r} is not UTF-8 text: {exc}", HINT) from None


def decode_index(text: str, path: str) -> Any:
    """The JSON document in `text` (the whole file, already fed through an IndexScanner), not
    yet checked: CheckpointIndex.from_json checks it. Call it under no_collection()."""
    try:
        return json.loads(text, parse_constant=_parse_constant)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path!r} is not valid JSON: {exc}", HINT) from exc
    except ValueError as exc:  # int() under a lower sys.set_int_max_str_digits() than ours
        raise CheckpointError(f"{path!r}: {exc}", HINT) from exc


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
        raise CheckpointError(f"{path!r} is not an mpaccel checkpoint index", HINT)
    version = index.get("format_version", 0)
    if not is_int(version) or version < 0:
        raise c.fail(("format_version",), f"is {show(version)}: expected an integer >= 0")
    if version > NEWEST_FORMAT_VERSION:
        raise _newer_format(path, version, index.get("mpaccel_version"))
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
    sliced = (_check_sliced(c, index, files, extents, version)
              if version >= SHARDED_FORMAT_VERSION else {})
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


def _newer_format(path: str, version: int, writer: Any) -> CheckpointError:
    """The refusal of an index of a format version this mpaccel does not read: what a later
    version added (format 3's N-D blocks, to a reader of format 2) would be misread."""
    by = f" (written by mpaccel {show(writer)})" if isinstance(writer, str) else ""
    return CheckpointError(
        f"{path!r} has format version {show(version)}{by}; this mpaccel ({__version__}) reads "
        f"format versions up to {NEWEST_FORMAT_VERSION} and would misread it",
        "load it with an mpaccel at least as recent as the one that wrote it (upgrade mpaccel "
        "where it loads), or save it again with this one.",
    )


def _check_sliced(
    c: Checker, index: dict, files: set[str], extents: dict[str, list[_Extent]], version: int
) -> dict:
    """The `sliced` tensors of formats 2 and 3: {key: {dtype, shape (global), slices: [{file,
    start, stop, offset, nbytes, rows_per_block, xxh3: [one per block]}]}}, rows along
    dimension 0 (a 0-d tensor has one), the slices in order, covering every row once; or, from
    format 3 on, N-D blocks (a slice with `inner`) covering every element once."""
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
        pieces = c.get(entry, at, "slices", list)
        blocks = any(isinstance(piece, dict) and "inner" in piece for piece in pieces)
        if blocks and version < BLOCK_FORMAT_VERSION:
            i = next(i for i, p in enumerate(pieces) if isinstance(p, dict) and "inner" in p)
            raise c.fail((*at, "slices", i, "inner"), f"is in an index of format version "
                         f"{version}: N-D blocks are format {BLOCK_FORMAT_VERSION}'s")
        end = 0
        boxes = []
        for i, piece in enumerate(pieces):
            where = (*at, "slices", i)
            if not isinstance(piece, dict):
                raise c.fail(where, f"is {show(piece)}: expected a dict")
            file = c.name(c.get(piece, where, "file", str), (*where, "file"))
            if file not in files:
                raise c.fail((*where, "file"), f"is {file!r}, which is not among the shards")
            start = c.integer(piece, where, "start")
            stop = c.integer(piece, where, "stop")
            if blocks:  # N-D blocks: in any order, their cover checked below
                if not start < stop <= rows:
                    raise c.fail(where, f"holds rows {start}..{stop}: expected rows within "
                                 f"0..{rows}")
                inner = (_check_inner(c, piece, where, shape) if "inner" in piece
                         else [(0, d) for d in shape[1:]])
                piece_row = math.prod(b - a for a, b in inner) * itemsize
                boxes.append(((start, *(a for a, _ in inner)), (stop, *(b for _, b in inner))))
            else:
                if start != end or not start < stop <= rows:
                    raise c.fail(where, f"holds rows {start}..{stop}: expected rows from {end} "
                                 f"on, at most {rows}")
                end = stop
                piece_row = row_bytes
            nbytes = c.integer(piece, where, "nbytes")
            if nbytes != (stop - start) * piece_row:
                raise c.fail((*where, "nbytes"), f"is {nbytes}: rows {start}..{stop} of {dtype} "
                             f"{shape} hold {(stop - start) * piece_row} bytes")
            offset = c.integer(piece, where, "offset")
            per_block = c.integer(piece, where, "rows_per_block", low=1)
            digests = c.get(piece, where, "xxh3", list)
            if len(digests) != -(-(stop - start) // per_block) or not all(
                isinstance(d, str) and _HEX16.match(d) for d in digests
            ):
                raise c.fail((*where, "xxh3"), f"is {show(digests)}: expected one xxh3 (16 hex "
                             f"digits) per {per_block} rows")
            extents.setdefault(file, []).append((offset, nbytes, at, f"slices[{i}]"))
        if blocks:
            problem = block_cover_problem(shape, boxes)
            if problem is not None:
                raise c.fail((*at, "slices"), problem)
        elif end != (rows if row_bytes and rows else 0):
            raise c.fail((*at, "slices"), f"cover rows 0..{end} of {rows}")
    return sliced


def _check_inner(c: Checker, piece: dict, where: tuple, shape: list) -> list[tuple[int, int]]:
    """A block's `inner`: [start, stop] along each dimension after the first, inside the
    tensor and not empty."""
    inner = c.get(piece, where, "inner", list)
    if len(shape) < 2 or len(inner) != len(shape) - 1:
        raise c.fail((*where, "inner"), f"is {show(inner)}: expected {max(0, len(shape) - 1)} "
                     f"[start, stop] pair(s), one per dimension after the first, for shape "
                     f"{shape}")
    out = []
    for d, pair in enumerate(inner, start=1):
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(v) for v in pair)
                and 0 <= pair[0] < pair[1] <= shape[d]):
            raise c.fail((*where, "inner", d - 1), f"is {show(pair)}: expected [start, stop] "
                         f"with 0 <= start < stop <= {shape[d]}")
        out.append((pair[0], pair[1]))
    return out


def slice_box(piece: dict, shape: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Not collective. (start, stop) along every dimension of a slice entry (its rows, and
    `inner` where it has one)."""
    inner = piece.get("inner") or [[0, d] for d in shape[1:]]
    return ((piece["start"], *(a for a, _ in inner)), (piece["stop"], *(b for _, b in inner)))


MAX_GRID_CELLS = 1 << 22  # cells of the grid of block bounds a cover check may paint


def block_cover_problem(shape: list[int] | tuple[int, ...],
                        boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Not collective. Where N-D blocks ((start, stop) per dimension, each inside the tensor)
    do not cover a tensor of `shape` exactly once, in words (None: they do). The blocks' bounds
    cut each dimension into intervals; the blocks are painted onto that grid (one cell per
    interval product, as many as the blocks in a layout on a mesh), so the check costs the
    grid's size, which is bounded: a layout cut finer than blocks on a mesh make is refused."""
    total = math.prod(shape)
    volume = sum(math.prod(b - a for a, b in zip(start, stop)) for start, stop in boxes)
    if volume < total:
        return (f"hold {volume} of the tensor's {total} elements in {len(boxes)} block(s): "
                "elements are missing")
    if volume > total:
        return (f"hold {volume} elements in {len(boxes)} block(s) of a tensor of {total}: "
                "elements are stored twice")
    if not boxes:
        return None
    cuts = [np.unique(np.array([0, size] + [b[0][d] for b in boxes] + [b[1][d] for b in boxes]))
            for d, size in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > max(MAX_GRID_CELLS // 64, 64 * len(boxes)) or cells > MAX_GRID_CELLS:
        return (f"cut the tensor into a grid of {cells} cells with {len(boxes)} blocks: not "
                "a layout of blocks on a device mesh")
    grid = np.zeros([len(c) - 1 for c in cuts], np.uint8)
    for i, (start, stop) in enumerate(boxes):
        region = grid[tuple(slice(int(np.searchsorted(c, a)), int(np.searchsorted(c, b)))
                            for c, a, b in zip(cuts, start, stop))]
        if region.any():
            return f"block {i} ({_box_text(start, stop)}) overlaps another block"
        region += 1
    return None


def _box_text(start: tuple[int, ...], stop: tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(start, stop)) + "]"


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
    if parsed.hasobject or not numpy_storable(parsed):
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


TORCH_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")  # a torch dtype's name, as torch spells it


def field_path(path: tuple) -> str:
    """('tensors', 'model/w', 'offset') -> tensors['model/w']['offset']"""
    return (str(path[0]) + "".join(f"[{part!r}]" for part in path[1:])) if path else "the index"


def _fail(file: str, path: tuple, message: str) -> CheckpointError:
    return CheckpointError(f"{file!r}: {field_path(path)} {message}", HINT)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother = 2, 3, 4, 300, 80


def show(value: Any) -> str:
    """repr(value), cut to about a line (without building the whole repr of a large value), a
    file name in full."""
    return _REPR.repr(value)


def is_int(value: Any) -> bool:
    return type(value) is int


def is_number(value: Any) -> bool:
    return type(value) in (int, float)


def plain_name(name: Any) -> bool:
    """A file name that stays in its directory: no separator, not '.' or '..', no NUL."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\x00")
    )


class Checker:
    """Field checks whose failures name the index file and the field."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: tuple, message: str) -> CheckpointError:
        return _fail(self.path, where, message)

    def get(self, obj: dict, where: tuple, key: str, kind: type, optional: bool = False) -> Any:
        """obj[key], of type `kind` (exactly: a bool is no int)."""
        if key not in obj:
            if optional:
                return None
            raise self.fail((*where, key), "is missing")
        value = obj[key]
        if type(value) is not kind:
            raise self.fail((*where, key), f"is {show(value)}: expected {article(kind.__name__)}")
        return value

    def integer(
        self, obj: dict, where: tuple, key: str, low: int = 0, optional: bool = False
    ) -> Any:
        if key not in obj:
            if optional:
                return None
            raise self.fail((*where, key), "is missing")
        value = obj[key]
        if not is_int(value) or value < low:
            raise self.fail((*where, key), f"is {show(value)}: expected an integer >= {low}")
        return value

    def name(self, value: Any, where: tuple) -> str:
        if not plain_name(value):
            raise self.fail(
                where,
                f"is {show(value)}: expected a plain file name in the checkpoint directory (no "
                "directory part, not '.' or '..')",
            )
        return value


def article(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name


_SCALAR_DTYPE = re.compile(r"[<>=|]?(bool|u?int(8|16|32|64)|float(16|32|64)|U\d{1,6})\Z")

_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__", "__npscalar__", "__torch_dtype__")


def check_document(c: Checker, document: Any, where: tuple, component: str, tensors: dict) -> None:
    """A state document holds JSON values and the tags format.unflatten reads, each well formed
    (what unflatten would otherwise fail on with a raw Python error), and names tensors of the
    index only. Iterative (the depth was bounded by the scanner); each value's path is kept as
    (parent's path, key) and spelt out on failure only."""
    stack: list[tuple[Any, Any]] = [(document, (None, where))]
    while stack:
        value, at = stack.pop()
        if type(value) is list:
            stack.extend((v, (at, i)) for i, v in enumerate(value))
        elif type(value) is dict:
            name = value.get("__tensor__")
            if type(name) is str and _tensor_ok(value, dataset_name(component, name), tensors):
                continue  # (the common case, fast)
            for tag in _TAGS:
                if tag in value:
                    stack.extend(_TAG_CHECKS[tag](_Tag(c, value, at), component, tensors))
                    break
            else:
                stack.extend((v, (at, k)) for k, v in value.items())


def _tensor_ok(value: dict, key: str, tensors: dict) -> bool:
    return (
        key in tensors
        and value.get("__kind__", "torch") in ("torch", "numpy")
        and type(value.get("__parameter__", False)) is bool
        and type(value.get("__requires_grad__", False)) is bool
    )


class _Tag:
    """A tagged dict of a document and its path (as check_document keeps it)."""

    def __init__(self, c: Checker, value: dict, at: Any) -> None:
        self.c, self.value, self.at = c, value, at

    def path(self, *more: Any) -> tuple:
        parts, linked = list(reversed(more)), self.at
        while linked[0] is not None:
            linked, key = linked
            parts.append(key)
        return (*linked[1], *reversed(parts))

    def fail(self, key: str, message: str) -> CheckpointError:
        return self.c.fail(self.path(key), message)

    def get(self, key: str, kind: type) -> Any:
        value = self.value.get(key)
        if type(value) is not kind:
            raise self.fail(key, f"is {show(value)}: expected {article(kind.__name__)}")
        return value

    def child(self, value: Any, *keys: Any) -> tuple[Any, Any]:
        at = self.at
        for key in keys:
            at = (at, key)
        return value, at


def _tensor_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    name = tag.get("__tensor__", str)
    if dataset_name(component, name) not in tensors:
        raise tag.fail("__tensor__", f"names {name!r}, a tensor the index does not hold")
    if tag.value.get("__kind__", "torch") not in ("torch", "numpy"):
        raise tag.fail("__kind__", f"is {show(tag.value['__kind__'])}: expected torch or numpy")
    for flag in ("__parameter__", "__requires_grad__"):
        if flag in tag.value:
            tag.get(flag, bool)
    return iter(())


def _tuple_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    items = tag.get("__tuple__", list)
    if tag.value.get("__type__") == "torch.Size" and not all(is_int(i) for i in items):
        raise tag.fail("__tuple__", f"is {show(items)}: a torch.Size holds integers")
    return (tag.child(v, "__tuple__", i) for i, v in enumerate(items))


def _items_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    items = tag.get("__items__", list)
    for i, pair in enumerate(items):
        if type(pair) is not list or len(pair) != 2:
            raise tag.c.fail(tag.path("__items__", i),
                             f"is {show(pair)}: expected a [key, value] pair")
        key = pair[0]
        hashable = key is None or type(key) in (str, int, float, bool) or (
            type(key) is dict and (set(key) in ({"__npscalar__", "value"}, {"__float__"}))
        )
        if not hashable:
            raise tag.c.fail(tag.path("__items__", i, 0), f"is {show(key)}: not a dict key")
    return (
        child
        for i, (k, v) in enumerate(items)
        for child in (tag.child(k, "__items__", i, 0), tag.child(v, "__items__", i, 1))
    )


def _float_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    text = tag.get("__float__", str)
    try:
        if len(text) > 64:
            raise ValueError
        float(text.removeprefix("np.float64(").removesuffix(")"))
    except ValueError:
        raise tag.fail("__float__", f"is {show(text)}: expected a float") from None
    return iter(())


def _npscalar_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    name = tag.get("__npscalar__", str)
    if not _SCALAR_DTYPE.match(name):
        raise tag.fail("__npscalar__", f"is {show(name)}: not a numpy scalar type mpaccel "
                       "stores (bool, integer, float up to float64, str)")
    dtype = np.dtype(name)
    item, kind = tag.value.get("value"), dtype.kind
    if kind in "iu":
        info = np.iinfo(dtype)
        fits = is_int(item) and int(info.min) <= int(item or 0) <= int(info.max)
    else:
        fits = (
            (kind == "b" and type(item) is bool)
            or (kind == "f" and (is_number(item) or item in ("nan", "inf", "-inf")))
            or (kind == "U" and type(item) is str)
        )
    if not fits:
        raise tag.fail("value", f"is {show(item)}: not a value of numpy {name}")
    return iter(())


def _dtype_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    import torch

    name = tag.get("__torch_dtype__", str)
    if not TORCH_NAME.match(name) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise tag.fail("__torch_dtype__", f"is {show(name)}: not a torch dtype")
    return iter(())


_TAG_CHECKS: dict[str, Callable[..., Iterator]] = {
    "__tensor__": _tensor_tag,
    "__tuple__": _tuple_tag,
    "__items__": _items_tag,
    "__float__": _float_tag,
    "__npscalar__": _npscalar_tag,
    "__torch_dtype__": _dtype_tag,
}


MAX_INDEX_BYTES = 1 << 30  # an index holds the non-tensor state: ~10 KiB per rank (its RNG states)
MAX_DEPTH = 200  # JSON nesting; json.loads and the readers of the state recurse once per level
assert 5 + 3 * MAX_NESTING + 1 <= MAX_DEPTH  # what writers write, readers read
MAX_STRING_BYTES = 16 << 20  # as written in the file (escapes included)
MAX_INT_DIGITS = 4300  # Python's own default limit for int(str)
# What json.loads builds, at most, per value (CPython 3.11, 64-bit, as tracemalloc counts it;
# tests/test_checkpoint_index.py measures it): a dict (up to 184 bytes holding up to 5 items),
# a list (56, and room for 4 items), an item (a reference, or a number: 40), a key (its entry
# in the dict), a key not met before (a string of 49 bytes beside its text, and its place in
# json's table of keys seen: json.loads makes each key once), any other string (49 bytes,
# less the item counted for it; the strings' text costs what it takes in the file). An index
# may hold values costing at most MAX_VALUE_COST times its size (and FREE_COST): with the
# text itself, opening it then takes at most 10x its size, plus a few MiB
# (docs/checkpoint-format.md, "Loading untrusted checkpoints"). Indexes mpaccel writes cost
# about 4.5x (indented text; the smallest, up to ~7x, are dominated by their tags).
DICT_COST = 168
LIST_COST = 88
ITEM_COST = 40
ENTRY_COST = 48
NEW_KEY_COST = 72
STRING_COST = 24
MAX_VALUE_COST = 6
FREE_COST = 1 << 20  # beside it: a small index is refused for nothing (its tags are dense)
HINT = "the index was damaged or crafted; restore it from a copy, or load another checkpoint."

_DIGITS = b"0123456789"
_AS_ZEROS = bytes.maketrans(_DIGITS, b"0" * 10)  # every digit a "0", nothing else is
_LONG_NUMBER = b"0" * (MAX_INT_DIGITS + 1)
_ZEROS = re.compile(b"0+")


SCAN_CHUNK = 1 << 16  # numpy's work arrays for a chunk take up to ~40x its size
_BASE = random.getrandbits(64) | 1  # of the keys' hashes: odd, so invertible modulo 2**64


def scan(data: bytes | bytearray, path: str) -> None:
    """Refuse, before any parsing, the bytes of an index (the whole file) that break a bound of
    IndexScanner; nothing if they keep them."""
    scanner = IndexScanner(path)
    for start in range(0, len(data), SCAN_CHUNK):
        scanner.feed(bytes(data[start:start + SCAN_CHUNK]))
    scanner.finish()


def _powers(base: int, count: int) -> np.ndarray:
    """base ** i modulo 2**64, for i in range(count)."""
    out = np.ones(count, dtype=np.uint64)
    np.cumprod(np.full(count - 1, base, dtype=np.uint64), dtype=np.uint64, out=out[1:])
    return out


class IndexScanner:
    """Refuses JSON nested deeper than MAX_DEPTH, holding a string longer than MAX_STRING_BYTES
    or a number of more than MAX_INT_DIGITS digits, from the bytes, chunk by chunk, before
    json.loads (which recurses, builds the string, and fails in int()) sees them. Vectorised:
    the structural bytes are found with numpy, long numbers with a regular expression.

    finish() then refuses an index whose values would take more than MAX_VALUE_COST times its
    size in memory once parsed.

    It tracks only quotes, backslashes, brackets, separators and digits. Where the text is not
    JSON, the two may disagree only after the first byte json.loads refuses, which it reaches
    first."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pos = 0  # bytes fed so far
        self.depth = 0
        self.inside = False  # within a string
        self.start = 0  # where the string we are within opened
        self.slashes = 0  # backslashes that ended the previous chunk
        self.digits = 0  # digits that ended it
        self.quotes = 0  # string quotes so far
        self.keys = 0  # ":" so far (outside strings): a key each
        self.cost = 0  # what the dicts, lists, items and keys so far cost once parsed
        self.seen: set[int] = set()  # hashes of the keys met so far
        self.powers = np.ones(0, dtype=np.uint64)  # _BASE ** i, and its inverse's, mod 2**64
        self.inverses = np.ones(0, dtype=np.uint64)

    def feed(self, chunk: bytes) -> None:
        a = np.frombuffer(chunk, dtype=np.uint8)
        if not a.size:
            return
        quotes = np.flatnonzero(a == 0x22)
        quotes = quotes[~self._escaped(a, quotes)]
        # brackets outside strings: an even number of string quotes before them
        brackets = np.flatnonzero((a == 0x5B) | (a == 0x5D) | (a == 0x7B) | (a == 0x7D))
        outside = (np.searchsorted(quotes, brackets) + self.inside) % 2 == 0
        brackets = brackets[outside]
        if brackets.size:
            opening = (a[brackets] == 0x5B) | (a[brackets] == 0x7B)
            depths = self.depth + np.cumsum(np.where(opening, 1, -1))
            deepest = int(depths.argmax())
            if depths[deepest] > MAX_DEPTH:
                raise CheckpointError(
                    f"{self.path!r}: nested more than {MAX_DEPTH} levels deep (at byte "
                    f"{self.pos + int(brackets[deepest])})",
                    HINT,
                )
            self.depth = int(depths[-1])
            dicts = int(np.count_nonzero(a[brackets] == 0x7B))
            lists = int(np.count_nonzero(opening)) - dicts
            self.cost += DICT_COST * dicts + LIST_COST * lists
        commas = np.flatnonzero(a == 0x2C)  # outside strings: an even number of quotes before
        self.cost += ITEM_COST * int(np.count_nonzero(
            (np.searchsorted(quotes, commas) + self.inside) % 2 == 0))
        colons = np.flatnonzero(a == 0x3A)
        before = np.searchsorted(quotes, colons)
        colons, before = colons[(before + self.inside) % 2 == 0], before[
            (before + self.inside) % 2 == 0]
        if colons.size:
            self._count_keys(a, quotes, before - 1)
        self.quotes += quotes.size
        self._check_numbers(chunk, quotes)
        marks = quotes + self.pos
        if self.inside:
            marks = np.concatenate(([self.start], marks))
        pairs = marks.size // 2
        if pairs:
            lengths = marks[1 : 2 * pairs : 2] - marks[0 : 2 * pairs : 2] - 1
            self._check_length(int(lengths.max()), int(marks[2 * int(lengths.argmax())]))
        self.inside = bool(marks.size % 2)
        if self.inside:
            self.start = int(marks[-1])
            self._check_length(self.pos + a.size - self.start - 1, self.start)
        self.slashes = self._trailing_slashes(a)
        self.pos += a.size

    def _count_keys(self, a: np.ndarray, quotes: np.ndarray, closing: np.ndarray) -> None:
        """Count the keys before this chunk's colons (`closing`: the index in `quotes` of the
        quote that ends each key), and those not met before: by a hash of their bytes, with a
        base drawn at random (a key whose string began in an earlier chunk counts as new)."""
        self.keys += closing.size
        whole = closing >= 1
        new = int(closing.size - np.count_nonzero(whole))
        closing = closing[whole]
        if closing.size:
            if self.powers.size <= a.size:
                self.powers = _powers(_BASE, a.size + 1)
                self.inverses = _powers(pow(_BASE, -1, 1 << 64), a.size + 1)
            prefix = np.zeros(a.size + 1, dtype=np.uint64)
            np.cumsum(a * self.powers[: a.size], dtype=np.uint64, out=prefix[1:])
            starts, ends = quotes[closing - 1] + 1, quotes[closing]
            hashes = ((prefix[ends] - prefix[starts]) * self.inverses[starts]
                      + (ends - starts).astype(np.uint64))
            known = len(self.seen)
            self.seen.update(np.unique(hashes).tolist())
            new += len(self.seen) - known
        self.cost += NEW_KEY_COST * new

    def finish(self) -> None:
        """Once every chunk was fed: refuse an index whose values would take more than
        MAX_VALUE_COST times its size in memory once parsed."""
        self.seen.clear()
        self.powers = self.inverses = np.ones(0, dtype=np.uint64)
        strings = max(0, self.quotes // 2 - self.keys)  # (keys are strings too)
        cost = self.cost + ENTRY_COST * self.keys + STRING_COST * strings
        if cost > MAX_VALUE_COST * self.pos + FREE_COST:
            raise CheckpointError(
                f"{self.path!r}: {self.pos} bytes holding values that would take {cost} bytes "
                f"of memory once parsed, more than {MAX_VALUE_COST}x its size (many small "
                "JSON values: a padded or crafted index)",
                HINT,
            )

    def _check_numbers(self, chunk: bytes, quotes: np.ndarray) -> None:
        """No run of digits outside strings longer than MAX_INT_DIGITS (one may go on from the
        previous chunk)."""
        lead = len(chunk) - len(chunk.lstrip(_DIGITS))
        starts = [0] if self.digits and self.digits + lead > MAX_INT_DIGITS else []
        zeros = chunk.translate(_AS_ZEROS)  # a substring search, not a regex: linear and fast
        found = zeros.find(_LONG_NUMBER)
        while found >= 0:
            starts.append(found)
            end = _ZEROS.match(zeros, found)
            found = zeros.find(_LONG_NUMBER, end.end() if end else found + 1)
        for start in starts:
            if (np.searchsorted(quotes, start) + self.inside) % 2 == 0:
                raise CheckpointError(
                    f"{self.path!r}: a number of more than {MAX_INT_DIGITS} digits (at byte "
                    f"{self.pos + start})",
                    HINT,
                )
        trail = len(chunk) - len(chunk.rstrip(_DIGITS))
        self.digits = self.digits + lead if lead == len(chunk) else trail

    def _check_length(self, length: int, at: int) -> None:
        if length > MAX_STRING_BYTES:
            raise CheckpointError(
                f"{self.path!r}: a string of more than {MAX_STRING_BYTES} bytes (at byte {at})",
                HINT,
            )

    def _escaped(self, a: np.ndarray, quotes: np.ndarray) -> np.ndarray:
        """Which quotes follow an odd run of backslashes (runs may start in the last chunk)."""
        escaped = np.zeros(quotes.size, dtype=bool)
        slashes = np.flatnonzero(a == 0x5C)
        if not quotes.size or (not slashes.size and not self.slashes):
            return escaped
        if slashes.size:
            breaks = np.flatnonzero(np.diff(slashes) != 1) + 1
            starts = slashes[np.concatenate(([0], breaks))]
            ends = slashes[np.concatenate((breaks - 1, [slashes.size - 1]))]
            lengths = ends - starts + 1
            if starts[0] == 0:
                lengths[0] += self.slashes
            run = np.minimum(np.searchsorted(ends, quotes - 1), ends.size - 1)
            escaped = (ends[run] == quotes - 1) & (lengths[run] % 2 == 1)
        if quotes[0] == 0:
            escaped[0] = self.slashes % 2 == 1
        return escaped

    def _trailing_slashes(self, a: np.ndarray) -> int:
        if a[-1] != 0x5C:
            return 0
        others = np.flatnonzero(a != 0x5C)
        run = a.size - 1 - int(others[-1]) if others.size else a.size + self.slashes
        return int(run)
