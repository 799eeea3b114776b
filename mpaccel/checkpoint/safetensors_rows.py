"""save_model(safe_serialization=True) of a fully sharded model: the same Hugging Face files as
safetensors_out.py (cut into shards the same way), written without gathering a tensor.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape and
byte range) and the tensors' bytes, C order: the rows of a tensor along dimension 0 are one
byte range. Collective: every rank computes the same headers from the global shapes; shard i's
owner (rank i mod N) creates it under a temporary name at its full size with the header in
place; every rank writes its rows at their offsets and fsyncs; the owners rename the files into
place; rank 0 writes the index. All ranks agree after each step."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from ..comm import Comm, agreement
from .format import CheckpointCollectiveError, CheckpointError
from .safetensors_out import (
    _SHARD,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    file_names,
    split,
)
from .sharded import Rows, _dtensor_rows

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
            rows = _dtensor_rows(value, key)
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
    covered = comm.allgather({k: (r.start, r.stop) for k, (r, _) in mine.items()}, what=what)
    with agreement(comm, what + " (checking the rows)", kind=CheckpointCollectiveError):
        for key, (_, shape, nbytes) in meta.items():
            rows = sum(stop - start for part in covered for start, stop in [part.get(key, (0, 0))])
            if nbytes and rows != (shape[0] if shape else 1):
                raise CheckpointError(
                    f"save_model: the ranks that called it hold {rows} of the rows of {key!r}",
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
                    data = local.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                    row_bytes = meta[key][2] // max(1, meta[key][1][0] if meta[key][1] else 1)
                    os.pwrite(fd, data.numpy().tobytes(),
                              layout[i][1][key] + rows.start * row_bytes)
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
