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
import os
import re
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..comm.base import agreement
from ..errors import MpaccelRuntimeWarning
from .format import CheckpointCollectiveError, CheckpointError, parse_size

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
