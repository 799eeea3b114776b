"""save_model(safe_serialization=True): the Hugging Face layout, for `from_pretrained`,
`safetensors.torch.load_file` and `load_checkpoint_in_model`.

One shard: `model.safetensors`. More: `model-00001-of-0000N.safetensors` ... and
`model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {key: file}}`,
sorted keys, indent 2), cut as huggingface_hub's `split_torch_state_dict_into_shards` cuts them:
tensors in state_dict order, a new shard when the next tensor would pass `max_shard_size`, a
tensor larger than the limit alone in a shard of its own. Tensors sharing memory (tied weights)
are stored once, under their first name, as Accelerate's save_model does (it warns; so do we).

Collective when `comm` has N ranks: shard i is written by rank i mod N, each file under a
temporary name renamed into place, then rank 0 writes the index (the commit) and removes shards
of an earlier save that the new one does not use. With a NullComm (a save by one rank alone)
the same steps run on that rank.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..comm import Comm, agreement
from ..errors import CheckpointCollectiveError, CheckpointError, MpaccelRuntimeWarning
from .format import parse_size
from .sharded.save import Box, Rows, block_runs, dtensor_rows

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_PATTERN = "model{suffix}.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _storage_id(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), storage.nbytes())


def untie(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state without the second and later names of tensors that share memory, each tensor
    contiguous (safetensors stores no views)."""
    first: dict[tuple, str] = {}
    dropped = []
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not torch.is_tensor(tensor):
            raise CheckpointError(
                f"save_model(safe_serialization=True): {name!r} is a {type(tensor).__name__}, "
                "not a tensor; safetensors holds tensors only",
                "save with safe_serialization=False (HDF5 holds any state), or leave it out "
                "of the model's state_dict.",
            )
        key = _storage_id(tensor)
        if key in first and tensor.untyped_storage().data_ptr():
            dropped.append(name)
            continue
        first[key] = name
        kept[name] = tensor.detach().contiguous()
    if dropped:
        warn_untied(dropped, stacklevel=4)
    return kept


def tied_aliases(module: torch.nn.Module) -> set[str]:
    """Not collective. The second and later names of each parameter `module` holds under
    several names (one Parameter object: tied weights), which the files store once, under the
    first name. Needed where the tensors' memory cannot tell (a fully sharded module's)."""
    first: dict[int, str] = {}
    return {name for name, p in module.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}


def warn_untied(dropped: list[str], stacklevel: int) -> None:
    """Say that `dropped`, names of tensors shared with other keys, are stored once
    (`stacklevel` as warnings.warn's, counted from the caller of this function)."""
    warnings.warn(
        f"save_model: {sorted(dropped)} share memory with other keys (tied weights) and are "
        "stored once, under the first name, as Accelerate does; a model that ties them "
        "again on load gets them back",
        MpaccelRuntimeWarning,
        stacklevel=stacklevel + 1,
    )


def split(state: Mapping[str, torch.Tensor], max_shard_size: int | str) -> list[list[str]]:
    """The keys of each shard, in order (huggingface_hub's cut; see the module docstring)."""
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes > limit:
            shards.append([name])
            continue
        if size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def file_names(count: int) -> list[str]:
    if count <= 1:
        return [SAFE_WEIGHTS_NAME]
    return [_PATTERN.format(suffix=f"-{i + 1:05d}-of-{count:05d}") for i in range(count)]


def _write_atomically(path: str, write: Any) -> None:
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(temporary)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def save_safetensors(
    comm: Any, state: Mapping[str, Any], directory: str, max_shard_size: int | str
) -> list[str]:
    """Collective over `comm` (see the module docstring). Returns the files written."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise CheckpointError(
            "save_model(safe_serialization=True) needs the safetensors package",
            "pip install safetensors (or mpaccel[safetensors]), or save HDF5 with "
            "safe_serialization=False.",
        ) from exc
    what = f"saving model {directory!r} (safetensors)"
    names: list[str] = []
    shards: list[list[str]] = []
    tensors: dict[str, torch.Tensor] = {}
    with agreement(comm, what + " (collecting the state)", kind=CheckpointCollectiveError):
        if os.path.isfile(directory):
            raise CheckpointError(
                f"save_model: {directory!r} is a file, not a directory",
                "pass the directory to save the model in.",
            )
        tensors = untie(state)
        try:
            shards = split(tensors, max_shard_size)
        except ValueError as exc:
            raise CheckpointError(str(exc), "for example max_shard_size='10GB' or '500MB'.") \
                from exc
        names = file_names(len(shards))
        if comm.rank == 0:
            os.makedirs(directory, exist_ok=True)
    with agreement(comm, what, kind=CheckpointCollectiveError):
        for i in range(comm.rank, len(shards), comm.size):
            shard = {name: tensors[name].cpu() for name in shards[i]}
            path = os.path.join(directory, names[i])
            _write_atomically(
                path, lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"})
            )
    with agreement(comm, what + " (the index)", kind=CheckpointCollectiveError):
        if comm.rank == 0:
            index_path = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
            if len(shards) > 1:
                index = {
                    "metadata": {
                        "total_size": sum(t.untyped_storage().nbytes() for t in tensors.values())
                    },
                    "weight_map": {n: names[i] for i, keys in enumerate(shards) for n in keys},
                }
                text = json.dumps(index, indent=2, sort_keys=True) + "\n"

                def write_index(tmp: str) -> None:
                    with open(tmp, "w", encoding="utf-8") as f:
                        f.write(text)

                _write_atomically(index_path, write_index)
            elif os.path.exists(index_path):  # an earlier, sharded save's
                os.remove(index_path)
            for name in os.listdir(directory):
                stale = _SHARD.fullmatch(name) or (name == SAFE_WEIGHTS_NAME and len(shards) > 1)
                if stale and name not in names:
                    os.remove(os.path.join(directory, name))
    return names


_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


class _Sized:
    """What split() needs of a tensor: its bytes (of the whole tensor, not this rank's)."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def untyped_storage(self) -> _Sized:
        return self

    def nbytes(self) -> int:
        return self._nbytes


def _header(keys: list[str], meta: Mapping[str, tuple[str, list[int], int]]) -> tuple[bytes, dict]:
    """(the file's first bytes: length + JSON header padded to 8, {key: data offset})."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, position = {}, 0
    for key in keys:
        dtype, shape, nbytes = meta[key]
        header[key] = {"dtype": dtype, "shape": shape,
                       "data_offsets": [position, position + nbytes]}
        offsets[key] = position
        position += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, {k: start + o for k, o in offsets.items()}


def save_rows(comm: Comm, state: Mapping[str, Any], directory: str,
              max_shard_size: int | str) -> list[str]:
    """Collective. Write `state` (values DTensors of Shard(0)/Replicate placements or plain
    tensors, the same on every rank) as save_model's safetensors files. Returns their names."""
    what = f"saving model {directory!r} (safetensors, each rank its rows)"
    meta: dict[str, tuple[str, list[int], int]] = {}
    mine: dict[str, tuple[Rows, torch.Tensor]] = {}
    names: list[str] = []
    shards: list[list[str]] = []
    with agreement(comm, what + " (collecting the state)", kind=CheckpointCollectiveError):
        for key, value in state.items():
            if not torch.is_tensor(value) or value.dtype not in _DTYPES:
                raise CheckpointError(
                    f"save_model: {key!r} ({type(value).__name__}) cannot be stored in "
                    "safetensors",
                    "save with safe_serialization=False (HDF5 holds any state).",
                )
            rows = dtensor_rows(value, key)
            local = value.to_local() if rows is not None else value  # type: ignore[attr-defined]
            if rows is None:
                rows = Rows(0, value.shape[0] if value.dim() else 1, tuple(value.shape),
                            comm.rank == 0)
            nbytes = value.numel() * value.element_size()
            meta[key] = (_DTYPES[value.dtype], list(rows.shape), nbytes)
            if rows.writer and local.numel():
                mine[key] = (rows, local)
        shards = split({k: _Sized(m[2]) for k, m in meta.items()}, max_shard_size)  # type: ignore[misc]
        names = file_names(len(shards))
        if comm.rank == 0:
            os.makedirs(directory, exist_ok=True)
    covered = comm.allgather({k: _held(r, local) for k, (r, local) in mine.items()}, what=what)
    with agreement(comm, what + " (checking the rows)", kind=CheckpointCollectiveError):
        for key, (_, shape, nbytes) in meta.items():
            held = sum(part.get(key, 0) for part in covered)
            if nbytes and held != math.prod(shape):
                raise CheckpointError(
                    f"save_model: the ranks that called it hold {held} of the "
                    f"{math.prod(shape)} elements of {key!r}",
                    "under FSDP every rank must call save_model (not only the main process).",
                )
    token = comm.bcast(uuid.uuid4().hex[:8] if comm.rank == 0 else None, what=what)
    temps = [os.path.join(directory, f"{name}.tmp-{token}") for name in names]
    layout = [_header(keys, meta) for keys in shards]
    owned = range(comm.rank, len(shards), comm.size)

    def remove() -> None:
        for i in owned:
            if os.path.exists(temps[i]):
                os.remove(temps[i])

    with agreement(comm, what + " (laying out the files)", kind=CheckpointCollectiveError,
                   cleanup=remove):
        for i in owned:
            head = layout[i][0]
            with open(temps[i], "wb") as f:
                f.write(head)
                f.truncate(len(head) + sum(meta[k][2] for k in shards[i]))
    with agreement(comm, what + " (writing rows)", kind=CheckpointCollectiveError,
                   cleanup=remove):
        for i, keys in enumerate(shards):
            todo = [k for k in keys if k in mine]
            if not todo:
                continue
            fd = os.open(temps[i], os.O_WRONLY)
            try:
                for key in todo:
                    rows, local = mine[key]
                    flat = local.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                    data = flat.numpy().reshape(*local.shape, local.element_size())
                    for at, run in _runs(rows, data):
                        os.pwrite(fd, run.tobytes(), layout[i][1][key] + at)
                os.fsync(fd)
            finally:
                os.close(fd)
    with agreement(comm, what + " (renaming)", kind=CheckpointCollectiveError, cleanup=remove):
        for i in owned:
            os.replace(temps[i], os.path.join(directory, names[i]))
    with agreement(comm, what + " (the index)", kind=CheckpointCollectiveError):
        if comm.rank == 0:
            _index(directory, names, shards, meta)
    return names


def _held(rows: Rows, local: torch.Tensor) -> int:
    """Elements of a tensor this rank writes."""
    return sum(box.size for box in rows.boxes) if rows.boxes else int(local.numel())


def _runs(rows: Rows, data: Any) -> Any:
    """(byte offset, bytes) of each run of consecutive elements this rank writes, from `data`
    (its local tensor as bytes: one dimension more, of each element's bytes)."""
    itemsize = data.shape[-1]
    if not rows.shape:
        yield 0, data.reshape(-1)
        return
    shape = (*rows.shape, itemsize)
    boxes = rows.boxes or (Box((rows.start, *[0] * (len(shape) - 2)), (rows.stop, *shape[1:-1]),
                               (0,) * (len(shape) - 1)),)
    for box in boxes:
        block = np.ascontiguousarray(data[(*box.local_slices(), slice(None))])
        yield from block_runs(shape, (*box.start, 0), (*box.stop, itemsize), block)


def _index(directory: str, names: list[str], shards: list[list[str]],
           meta: Mapping[str, tuple[str, list[int], int]]) -> None:
    path = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum(m[2] for m in meta.values())},
            "weight_map": {n: names[i] for i, keys in enumerate(shards) for n in keys},
        }
        temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    elif os.path.exists(path):  # an earlier, sharded save's
        os.remove(path)
    for name in os.listdir(directory):  # shards of an earlier save that this one does not use
        stale = _SHARD.fullmatch(name) or (name == SAFE_WEIGHTS_NAME and len(names) > 1)
        if stale and name not in names:
            os.remove(os.path.join(directory, name))
