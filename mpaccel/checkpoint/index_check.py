"""The schema a checkpoint index read from disk must have before anything uses it (types,
ranges, plain file names, extents that fit the files, well-formed state documents), once
index_scan.py bounded its bytes. Pure functions of bytes and JSON values; reader.py does the I/O.
Every failure is a CheckpointError naming the file and the field."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import re
import reprlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .format import (
    FORMAT_NAME,
    SHARDED_FORMAT_VERSION,
    CheckpointError,
    _numpy_storable,
    dataset_name,
    storage_dtype,
)
from .index_scan import HINT as _HINT

MAX_DIMS = 64  # numpy's
_HEX16 = re.compile(r"[0-9a-f]{16}\Z")
_TORCH_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
# components mpaccel writes whose state is a dict (custom_N hold whatever their state_dict gives)
_STATE_DICTS = re.compile(
    r"(model|scaler|accelerator|rng|(model|optimizer|scheduler|dataloader|gradients)_\d+)\Z"
)
_SCALAR_DTYPE = re.compile(r"[<>=|]?(bool|u?int(8|16|32|64)|float(16|32|64)|U\d{1,6})\Z")


_Extent = tuple[int, int, tuple, str]  # offset, bytes, where the part is, tensor key


def _field(path: tuple) -> str:
    """('tensors', 'model/w', 'offset') -> tensors['model/w']['offset']"""
    return (str(path[0]) + "".join(f"[{part!r}]" for part in path[1:])) if path else "the index"


def _fail(file: str, path: tuple, message: str) -> CheckpointError:
    return CheckpointError(f"{file!r}: {_field(path)} {message}", _HINT)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother = 2, 3, 4, 300, 80


def _show(value: Any) -> str:
    """repr(value), cut to about a line (without building the whole repr of a large value), a
    file name in full."""
    return _REPR.repr(value)


def _parse_constant(name: str) -> float:
    # Indexes of earlier versions hold bare NaN / Infinity for some values of the state (see
    # docs/checkpoint-format.md); the schema refuses them in every field of the format itself.
    return float(name)


def parse_index(data: bytes | bytearray, path: str) -> dict[str, Any]:
    """The checked index in `data` (the whole file, already fed through an IndexScanner)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path!r} is not UTF-8 text: {exc}", _HINT) from None
    with _no_collection():
        try:
            index = json.loads(text, parse_constant=_parse_constant)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path!r} is not valid JSON: {exc}", _HINT) from exc
        except ValueError as exc:  # int() under a lower sys.set_int_max_str_digits() than ours
            raise CheckpointError(f"{path!r}: {exc}", _HINT) from exc
        return check_index(index, path)


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
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


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def plain_name(name: Any) -> bool:
    """A file name that stays in its directory: no separator, not '.' or '..', no NUL."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\x00")
    )


class _Checker:
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
            raise self.fail((*where, key), f"is {_show(value)}: expected {_article(kind.__name__)}")
        return value

    def integer(
        self, obj: dict, where: tuple, key: str, low: int = 0, optional: bool = False
    ) -> Any:
        if key not in obj:
            if optional:
                return None
            raise self.fail((*where, key), "is missing")
        value = obj[key]
        if not _is_int(value) or value < low:
            raise self.fail((*where, key), f"is {_show(value)}: expected an integer >= {low}")
        return value

    def name(self, value: Any, where: tuple) -> str:
        if not plain_name(value):
            raise self.fail(
                where,
                f"is {_show(value)}: expected a plain file name in the checkpoint directory (no "
                "directory part, not '.' or '..')",
            )
        return value


def _article(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name


def check_index(index: Any, path: str) -> dict[str, Any]:
    """`index` (parsed JSON) if it has the shape of a checkpoint index, else a CheckpointError
    naming `path` and the field. Unknown fields are left alone (later writers of format version
    1 may add optional ones)."""
    c = _Checker(path)
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path!r} is not an mpaccel checkpoint index", _HINT)
    version = index.get("format_version", 0)
    if not _is_int(version) or version < 0:
        raise c.fail(("format_version",), f"is {_show(version)}: expected an integer >= 0")
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
        raise c.fail(("index_xxh3",), f"is {_show(digest)}: expected 16 hex digits")
    world = c.integer(index, (), "world_size", low=1)
    metadata = c.get(index, (), "metadata", dict, optional=True) or {}
    kind = c.get(metadata, ("metadata",), "kind", str, optional=True)
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
            raise c.fail(where, f"is {_show(part)}: expected a dict")
        own = c.name(c.get(part, where, "file", str), (*where, "file"))
        _check_part(c, part, where, {own}, extents)
    _check_extents(c, extents, sizes)
    for name in sizes:  # (after the tensors: an error there names the tensor as well)
        c.name(name, ("file_sizes",))
    return index


def _check_part(
    c: _Checker,
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
            raise c.fail((*where, "components"), f"names a component {_show(component)}")
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
            raise c.fail(at, f"is {_show(document)}: expected the object's state_dict")
        if component == "accelerator":
            c.integer(document, at, "step")
        _check_document(c, document, at, component, {**tensors, **sliced} if sliced else tensors)


def _check_sliced(
    c: _Checker, index: dict, files: set[str], extents: dict[str, list[_Extent]]
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
            raise c.fail(at, f"is {_show(entry)}: expected a dict")
        dtype = c.get(entry, at, "dtype", str)
        itemsize = _itemsize(dtype)
        if not itemsize:
            raise c.fail((*at, "dtype"), f"is {_show(dtype)}: not a dtype sharded saves store")
        shape = c.get(entry, at, "shape", list)
        if len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
            raise c.fail((*at, "shape"),
                         f"is {_show(shape)}: expected at most {MAX_DIMS} sizes >= 0")
        rows = shape[0] if shape else 1
        row_bytes = math.prod(shape[1:]) * itemsize
        end = 0
        for i, piece in enumerate(c.get(entry, at, "slices", list)):
            where = (*at, "slices", i)
            if not isinstance(piece, dict):
                raise c.fail(where, f"is {_show(piece)}: expected a dict")
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
                raise c.fail((*where, "xxh3"), f"is {_show(digests)}: expected one xxh3 (16 hex "
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


def _check_entry(c: _Checker, entry: Any, at: tuple, files: set[str]) -> None:
    """What is wrong with an entry _entry_ok refused, in words."""
    if not isinstance(entry, dict):
        raise c.fail(at, f"is {_show(entry)}: expected a dict")
    file = c.name(c.get(entry, at, "file", str), (*at, "file"))
    if file not in files:
        raise c.fail((*at, "file"), f"is {file!r}, which is not among this part's files")
    dtype = c.get(entry, at, "dtype", str)
    itemsize = _itemsize(dtype)
    if itemsize is None:
        raise c.fail((*at, "dtype"), f"is {_show(dtype)}: not a dtype mpaccel stores")
    shape = c.get(entry, at, "shape", list)
    if len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise c.fail((*at, "shape"), f"is {_show(shape)}: expected at most {MAX_DIMS} sizes >= 0")
    nbytes = c.integer(entry, at, "nbytes")
    if itemsize and nbytes != math.prod(shape) * itemsize:
        raise c.fail((*at, "nbytes"), f"is {nbytes}: {dtype} {shape} holds "
                     f"{math.prod(shape) * itemsize} bytes")
    digest = c.get(entry, at, "xxh3", str)
    if not _HEX16.match(digest):
        raise c.fail((*at, "xxh3"), f"is {_show(digest)}: expected 16 hex digits")
    c.integer(entry, at, "offset", optional=True)


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int | None:
    """Bytes per element of an index's dtype name (0: known only to the file, e.g. a structured
    numpy type or a torch dtype this torch lacks); None for names mpaccel never writes."""
    if len(dtype) > 4096:
        return None
    if not dtype.startswith("numpy."):
        if not _TORCH_NAME.match(dtype):
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


def _check_extents(c: _Checker, extents: dict[str, list[_Extent]], sizes: dict[str, int]) -> None:
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
                raise c.fail(at, f"is {offset}: its bytes overlap those of {_field(previous)}")
            end, previous = max(end, offset + nbytes), (*where, "tensors", key)


_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__", "__npscalar__", "__torch_dtype__")


def _check_document(
    c: _Checker, document: Any, where: tuple, component: str, tensors: dict
) -> None:
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
    """A tagged dict of a document and its path (as _check_document keeps it)."""

    def __init__(self, c: _Checker, value: dict, at: Any) -> None:
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
            raise self.fail(key, f"is {_show(value)}: expected {_article(kind.__name__)}")
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
        raise tag.fail("__kind__", f"is {_show(tag.value['__kind__'])}: expected torch or numpy")
    for flag in ("__parameter__", "__requires_grad__"):
        if flag in tag.value:
            tag.get(flag, bool)
    return iter(())


def _tuple_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    items = tag.get("__tuple__", list)
    if tag.value.get("__type__") == "torch.Size" and not all(_is_int(i) for i in items):
        raise tag.fail("__tuple__", f"is {_show(items)}: a torch.Size holds integers")
    return (tag.child(v, "__tuple__", i) for i, v in enumerate(items))


def _items_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    items = tag.get("__items__", list)
    for i, pair in enumerate(items):
        if type(pair) is not list or len(pair) != 2:
            raise tag.c.fail(tag.path("__items__", i),
                             f"is {_show(pair)}: expected a [key, value] pair")
        key = pair[0]
        hashable = key is None or type(key) in (str, int, float, bool) or (
            type(key) is dict and (set(key) in ({"__npscalar__", "value"}, {"__float__"}))
        )
        if not hashable:
            raise tag.c.fail(tag.path("__items__", i, 0), f"is {_show(key)}: not a dict key")
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
        raise tag.fail("__float__", f"is {_show(text)}: expected a float") from None
    return iter(())


def _npscalar_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    name = tag.get("__npscalar__", str)
    if not _SCALAR_DTYPE.match(name):
        raise tag.fail("__npscalar__", f"is {_show(name)}: not a numpy scalar type mpaccel "
                       "stores (bool, integer, float up to float64, str)")
    dtype = np.dtype(name)
    item, kind = tag.value.get("value"), dtype.kind
    if kind in "iu":
        info = np.iinfo(dtype)
        fits = _is_int(item) and int(info.min) <= int(item or 0) <= int(info.max)
    else:
        fits = (
            (kind == "b" and type(item) is bool)
            or (kind == "f" and (_is_number(item) or item in ("nan", "inf", "-inf")))
            or (kind == "U" and type(item) is str)
        )
    if not fits:
        raise tag.fail("value", f"is {_show(item)}: not a value of numpy {name}")
    return iter(())


def _dtype_tag(tag: _Tag, component: str, tensors: dict) -> Iterator:
    import torch

    name = tag.get("__torch_dtype__", str)
    if not _TORCH_NAME.match(name) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise tag.fail("__torch_dtype__", f"is {_show(name)}: not a torch dtype")
    return iter(())


_TAG_CHECKS: dict[str, Callable[..., Iterator]] = {
    "__tensor__": _tensor_tag,
    "__tuple__": _tuple_tag,
    "__items__": _items_tag,
    "__float__": _float_tag,
    "__npscalar__": _npscalar_tag,
    "__torch_dtype__": _dtype_tag,
}
