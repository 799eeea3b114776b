"""The checkpoint format's building blocks: state trees split into tensors + JSON, tensor <-> HDF5
encoding that keeps the true dtype, and checksums. No pickle anywhere.

A state tree (a state_dict, an RNG state, ...) becomes a JSON document in which each tensor or
array is replaced by {"__tensor__": "<dataset name>"}; the tensors go to HDF5 datasets. Tuples,
non-string dict keys, and numpy/torch scalars are tagged so the tree comes back as it went in.
Anything that cannot come back as it went in is refused here, naming its key, before a file is
written.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import CheckpointError
from .rawio import byte_view

FORMAT_NAME = "mpaccel-checkpoint"
FORMAT_VERSION = 1  # what save_state/save_model write: their layout did not change
# sharded checkpoints (sharded/: "sliced" tensors) are format 2
SHARDED_FORMAT_VERSION = 2
# sharded checkpoints with N-D blocks (a slice with "inner": tensor parallelism) are format 3,
# which readers of formats up to 2 refuse; without blocks (FSDP alone) they stay format 2, which
# those readers read as well as this one does
BLOCK_FORMAT_VERSION = 3
NEWEST_FORMAT_VERSION = BLOCK_FORMAT_VERSION  # readers take every version up to this one
# Levels of nesting a state tree may have: its document in the index nests at most 3 JSON levels
# per level (a dict with other than str keys is {"__items__": [[key, value]]}), under 5 of the
# index's own, which stays within what readers accept (index_check.MAX_DEPTH).
MAX_NESTING = 64


# torch dtypes numpy (and so HDF5) cannot hold: stored as same-width unsigned ints.
_VIEW_AS = {
    torch.bfloat16: torch.uint16,
    torch.complex32: torch.uint32,  # two float16s
    **{
        getattr(torch, name): torch.uint8
        for name in (
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "float4_e2m1fn_x2",  # two float4s in a byte
        )
        if hasattr(torch, name)
    },
}
# torch dtypes stored as they are (tensor.numpy() takes them). Quantized and sub-byte types are
# neither: they are refused, naming the key.
_NUMPY_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
    if hasattr(torch, name)
)
# numpy array kinds HDF5 stores losslessly: bool, int, uint, float, complex, fixed-size bytes,
# structured/opaque (of these). Not str (U), object (O), datetime64 (M), timedelta64 (m).
_NUMPY_KINDS = "biufcSV"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint")
    return dtype


def storage_dtype(name: str) -> np.dtype | None:
    """The numpy dtype in which a tensor of dtype `name` (an index entry's "dtype") is stored,
    where it is a plain number type (None for anything else, or a name this torch lacks)."""
    try:
        if name.startswith("numpy."):
            stored = np.dtype(name.removeprefix("numpy."))
        else:
            dtype = torch_dtype(name)
            stored = torch.empty(0, dtype=_VIEW_AS.get(dtype, dtype)).numpy().dtype
    except (CheckpointError, TypeError, RuntimeError):
        return None
    return stored if stored.kind in "biufc" else None


def contiguous(array: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU numpy array with the tensor's bytes (bf16/fp8 viewed as uint16/uint8)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()  # lazy conjugates (z.conj()): numpy() refuses them
    view = _VIEW_AS.get(t.dtype)
    if view is not None:
        t = t.contiguous().view(view)
    return contiguous(t.contiguous().numpy())


def from_numpy(array: np.ndarray, name: str) -> torch.Tensor:
    dtype = torch_dtype(name)
    tensor = torch.from_numpy(contiguous(array))
    if dtype in _VIEW_AS:
        tensor = tensor.view(dtype)
    return tensor


def checksum(array: np.ndarray) -> str:
    """xxh3-64 of the array's bytes (about 20 GB/s: cheap next to the disk)."""
    return xxhash.xxh3_64(byte_view(contiguous(array))).hexdigest()


INDEX_DIGEST = "index_xxh3"


def index_digest(index: Mapping[str, Any], parsed: bool = False) -> str:
    """xxh3-64 of the index without its own digest, as canonical JSON (sorted keys, no spaces,
    after a JSON round trip, so that a written and a read index give the same text): the
    non-tensor state (learning rates, steps, positions) lives only in the index, and a change
    to it is caught as a change to a tensor's bytes is. `parsed`: the index is as json.loads
    gave it, which a round trip would not change (it would cost a third of opening a large
    index)."""
    body = {k: v for k, v in index.items() if k != INDEX_DIGEST}
    if not parsed:
        body = json.loads(json.dumps(body))
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_64(text.encode("utf-8", "surrogatepass")).hexdigest()


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _where(prefix: str, path: str) -> str:
    return f"{prefix}/{path}" if path else prefix


def _check_array(value: Any, prefix: str, path: str) -> None:
    """Refuse, naming the key, a tensor or array whose data cannot be stored as it is."""
    where = _where(prefix, path)
    if isinstance(value, np.ndarray):
        if isinstance(value, np.ma.MaskedArray):
            raise CheckpointError(
                f"cannot store masked array at key {where}: checkpoints hold plain numpy arrays, "
                "and its mask would be lost",
                "store its .data and .mask as two arrays.",
            )
        if not numpy_storable(value.dtype):
            raise CheckpointError(
                f"cannot store numpy array of dtype {value.dtype} at key {where}: checkpoints "
                "hold numpy arrays of bool, integer, float, complex, fixed-size bytes (S) and "
                "structured types of these",
                "convert it: text as a list of str (arr.tolist()), datetimes as integers "
                "(arr.astype('int64')); mpaccel never pickles objects.",
            )
        return
    if value.is_nested or value.layout != torch.strided:
        layout = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        raise CheckpointError(
            f"cannot store {layout} tensor at key {where}: checkpoints hold dense (strided) "
            "tensors only",
            "store t.to_dense(), or the parts it is made of (t.coalesce().indices() and "
            ".values() of a sparse tensor, t.unbind() of a nested one).",
        )
    if value.is_meta:
        raise CheckpointError(
            f"cannot store meta tensor at key {where}: checkpoints hold tensors with data (on any "
            "device), and a meta tensor has a shape only",
            "materialize it first (e.g. module.to_empty(device='cpu'), then initialize or load "
            "its weights).",
        )
    if value.dtype not in _NUMPY_DTYPES and value.dtype not in _VIEW_AS:
        raise CheckpointError(
            f"cannot store tensor of dtype {dtype_name(value.dtype)} at key {where}: checkpoints "
            "hold bool, integer, float (float16, bfloat16, float8, ...) and complex tensors",
            "convert it to one of these (e.g. t.int_repr() and its scales for a quantized "
            "tensor).",
        )


def numpy_storable(dtype: np.dtype) -> bool:
    if dtype.fields is not None:
        return all(numpy_storable(field[0]) for field in dtype.fields.values())
    if dtype.subdtype is not None:
        return numpy_storable(dtype.subdtype[0])
    return dtype.kind in _NUMPY_KINDS


def _npscalar(value: np.generic, prefix: str, path: str) -> dict[str, Any]:
    """A numpy scalar as {"__npscalar__": dtype, "value": JSON}, where np.dtype(dtype).type(value)
    gives it back exactly; else a CheckpointError naming its key."""
    kind, size = value.dtype.kind, value.dtype.itemsize
    item: Any
    if kind in "biuU" or (kind == "f" and size <= 8):
        item = value.item()
        if kind == "f" and not math.isfinite(item):
            item = str(value)  # "nan", "inf", "-inf": numpy parses them, JSON has no such number
        return {"__npscalar__": str(value.dtype), "value": item}
    raise CheckpointError(
        f"cannot store numpy scalar {type(value).__name__} {value!r:.80} at key "
        f"{_where(prefix, path)}: checkpoints hold numpy scalars of bool, integer, float (up to "
        "float64) and str types",
        "convert it (e.g. [z.real, z.imag] for a complex number, str(d) for a datetime64, "
        "b.decode() for bytes); mpaccel never pickles.",
    )


def flatten(tree: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """Split `tree` into a JSON-able document and {dataset name: tensor or ndarray}.

    Raises CheckpointError naming the key of anything that is neither (no pickle fallback), or
    that cannot be stored as it is (sparse or meta tensors, str or object arrays, ...)."""
    # (document entry, structural path, tensor): named once the whole tree has been seen
    found: list[tuple[dict[str, Any], tuple, Any]] = []

    def walk(value: Any, path: str, steps: tuple) -> Any:
        if len(steps) > MAX_NESTING:
            raise CheckpointError(
                f"cannot store the state at key {_where(prefix, path)}: it is nested more than "
                f"{MAX_NESTING} levels deep (readers refuse deeper indexes: see "
                "docs/checkpoint-format.md, 'Loading untrusted checkpoints')",
                "flatten the state_dict(): join nested keys into one, or store deep structures "
                "as arrays.",
            )
        if _is_array(value):
            _check_array(value, prefix, path)
            entry: dict[str, Any] = {
                "__tensor__": path or "value",
                "__kind__": "torch" if torch.is_tensor(value) else "numpy",
            }
            if isinstance(value, torch.nn.Parameter):
                entry["__parameter__"] = bool(value.requires_grad)
            elif torch.is_tensor(value) and value.requires_grad:
                entry["__requires_grad__"] = True
            found.append((entry, steps, value))
            return entry
        _check_exact_type(value, prefix, path)
        # before bool/str/int/float: np.float64 is a float and np.str_ a str, and their type
        # must come back
        if isinstance(value, np.generic):
            return _npscalar(value, prefix, path)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            return {"__float__": repr(value)}
        if isinstance(value, torch.dtype):
            return {"__torch_dtype__": dtype_name(value)}
        if isinstance(value, Mapping):
            kind = _MAPPING_TAGS.get(type(value))
            if kind is None and all(type(k) is str and not k.startswith("__") for k in value):
                return {
                    k: walk(v, f"{path}.{k}" if path else k, (*steps, ("key", k)))
                    for k, v in value.items()
                }
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int, float, bool, np.generic)) and k is not None:
                    raise CheckpointError(
                        f"cannot store dict key {k!r} ({type(k).__name__}) at {path or prefix!r}",
                        "keys must be str, int, float, bool, None or numpy scalars.",
                    )
                child = walk(v, f"{path}.{k}" if path else str(k), (*steps, ("key", k)))
                # A key is written as a value is: numpy scalars and NaN or infinite floats tagged
                # (JSON has no such number), subclasses (an IntEnum, a str subclass) refused.
                items.append([walk(k, f"{path}[key {k!r}]", steps), child])
            return {"__items__": items, **({"__type__": kind} if kind else {})}
        if isinstance(value, tuple):
            entries = [walk(v, f"{path}.{i}", (*steps, ("index", i))) for i, v in enumerate(value)]
            if isinstance(value, torch.Size):
                return {"__tuple__": entries, "__type__": "torch.Size"}
            return {"__tuple__": entries}
        if isinstance(value, list):
            return [walk(v, f"{path}.{i}", (*steps, ("index", i))) for i, v in enumerate(value)]
        raise CheckpointError(
            f"cannot store {type(value).__name__} {value!r:.80} at key {prefix}/{path}: "
            "checkpoints hold tensors, arrays, numbers, strings, lists, tuples and dicts only",
            "give the object a state_dict() that returns such values (mpaccel never pickles).",
        )

    document = walk(tree, "", ())
    return document, _name_tensors(found, prefix)


# Containers of these types come back as themselves (tagged "__type__"): MultiStepLR keeps its
# milestones in a Counter, and calls Counter methods on it after a load.
_MAPPING_TAGS: dict[type, str] = {collections.Counter: "Counter"}
_MAPPINGS = {tag: kind for kind, tag in _MAPPING_TAGS.items()}
# Stored as they are. An OrderedDict (every module's state_dict) comes back as a dict, which
# keeps its order too.
_PLAIN = (bool, int, float, str, dict, list, tuple, type(None), collections.OrderedDict)


def _check_exact_type(value: Any, prefix: str, path: str) -> None:
    """Refuse a subclass of a plain type that is not known to come back as itself (a named
    tuple, an IntEnum, a defaultdict...): it would be loaded as its base type, silently."""
    if type(value) in _PLAIN or type(value) in _MAPPING_TAGS:
        return
    if isinstance(value, (np.generic, torch.Size)):
        return  # tagged further on
    base = next((kind for kind in (*_PLAIN, Mapping) if isinstance(value, kind)), None)
    if base is None:
        return  # not a plain type at all: stored (tensors, dtypes) or refused further on
    raise CheckpointError(
        f"cannot store {type(value).__name__} {value!r:.80} at key {prefix}/{path}: it would "
        f"come back as a plain {getattr(base, '__name__', base)}",
        "store it as the plain type in state_dict() and rebuild it in load_state_dict() "
        "(mpaccel keeps Counter and torch.Size as they are).",
    )


def _name_tensors(found: list[tuple[dict[str, Any], tuple, Any]], prefix: str) -> dict[str, Any]:
    """{name: tensor}, writing each name into its document entry. A tensor is named by its path
    (keys joined by '.'), unless that would not give it a dataset of its own: paths that meet
    ({"a.b": x, "a": {"b": y}}, {1: x, "1": y}, "a/b" and "a%2Fb" once '/' is escaped) or names
    HDF5 cannot hold ('.', NUL) get '~' and 8 hex digits of a hash of their structure (keys with
    their types, list positions) appended: the same for the same tree, whatever its order."""
    counts: dict[str, int] = {}
    for entry, _, _ in found:
        link = _link(entry["__tensor__"])
        counts[link] = counts.get(link, 0) + 1
    tensors: dict[str, Any] = {}
    taken: dict[str, tuple] = {}
    same: dict[tuple, str] = {}  # a view's identity -> the name it was stored under
    for entry, steps, value in found:
        view = view_identity(value)
        if view is not None and view in same:
            entry["__tensor__"] = same[view]  # tied weights: stored once, loaded for both keys
            continue
        name = entry["__tensor__"]
        if counts[_link(name)] > 1 or name == "." or "\x00" in name:
            digest = xxhash.xxh3_64(repr(steps).encode()).hexdigest()[:8]
            name = entry["__tensor__"] = name.replace("\x00", "%00") + "~" + digest
        link = _link(name)
        if link in taken:
            raise CheckpointError(
                f"cannot store {prefix}{_keys(taken[link])} and {prefix}{_keys(steps)}: both "
                f"would be stored as {prefix}/{link}",
                "rename one of the two keys.",
            )
        taken[link] = steps
        tensors[name] = value
        if view is not None:
            same[view] = name
    return tensors


def view_identity(value: Any) -> tuple | None:
    """What makes two tensors the same view of the same memory (tied weights: a state_dict holds
    two tensor objects for them); None for arrays and tensors without memory of their own."""
    if not torch.is_tensor(value) or value.layout != torch.strided or value.is_meta:
        return None
    pointer = value.untyped_storage().data_ptr()
    if not pointer:
        return None
    return (str(value.device), pointer, value.storage_offset(), value.dtype,
            tuple(value.shape), value.stride(), value.is_conj(), value.is_neg())


def _link(name: str) -> str:
    """The name of a tensor's dataset in its component's group (see dataset_name)."""
    return name.replace("/", "%2F")


def _keys(steps: tuple) -> str:
    """A structural path as subscripts: ['a']['b'], [1], ['layers'][0]."""
    return "".join(f"[{key!r}]" for _, key in steps)


def unflatten(document: Any, load: Any) -> Any:
    """Rebuild the tree; `load(name, kind)` returns the tensor or array stored under `name`."""

    def walk(value: Any) -> Any:
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "__tensor__" in value:
            tensor = load(value["__tensor__"], value.get("__kind__", "torch"))
            if not torch.is_tensor(tensor):  # an array, or no tensor (a walk over the names)
                return tensor
            if "__parameter__" in value and not isinstance(tensor, torch.nn.Parameter):
                return torch.nn.Parameter(tensor, requires_grad=value["__parameter__"])
            if value.get("__requires_grad__") and not tensor.requires_grad:
                # a new tensor object on the same memory: load() hands one object out for every
                # key tied to it, and a detached alias must not start requiring grad too
                return tensor.detach().requires_grad_(True)
            return tensor
        if "__tuple__" in value:
            entries = tuple(walk(v) for v in value["__tuple__"])
            return torch.Size(entries) if value.get("__type__") == "torch.Size" else entries
        if "__items__" in value:
            items = {walk(k): walk(v) for k, v in value["__items__"]}
            kind = _MAPPINGS.get(value.get("__type__", ""))
            return kind(items) if kind is not None else items
        if "__float__" in value:
            # np.float64 NaN and infinities were once written here as repr(): under numpy 2,
            # "np.float64(nan)"
            return float(value["__float__"].removeprefix("np.float64(").removesuffix(")"))
        if "__npscalar__" in value:
            return np.dtype(value["__npscalar__"]).type(value["value"])
        if "__torch_dtype__" in value:
            return torch_dtype(value["__torch_dtype__"])
        return {k: walk(v) for k, v in value.items()}

    return walk(document)


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """`10GB`, `500MB`, `1GiB` or an int of bytes -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    text = str(size).strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return int(value * _UNITS[unit])
    raise ValueError(f"max_shard_size={size!r} is not a size like 10GB, 500MB, 2GiB or 1000000")


def dataset_name(component: str, name: str) -> str:
    """The HDF5 dataset path of tensor `name` of `component` ('/' in names escaped)."""
    return f"{component}/{_link(name)}"
