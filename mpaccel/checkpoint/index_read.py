"""Opening a checkpoint's index: read through the checks of index_scan.py, then parsed into a
CheckpointIndex (index.py: the checks of index_check.py, its own checksum); a missing index
explained (an interrupted save, or the other kind of checkpoint)."""

from __future__ import annotations

import os

from .format import CheckpointError
from .index import CheckpointIndex
from .index_check import decode_index, no_collection
from .index_scan import MAX_INDEX_BYTES, IndexScanner
from .shard_check import open_regular


def index_path(directory: str, stem: str) -> str:
    return os.path.join(directory, f"{stem}.index.json")


def read_index(directory_fd: int, directory: str, stem: str) -> CheckpointIndex:
    """Not collective. The index `stem`.index.json of the checkpoint `directory` (open as
    `directory_fd`): a regular file of bounded size, read without following links and without
    blocking, nested and sized within bounds, of the index's schema, and matching its checksum
    (indexes of earlier versions have none)."""
    name = f"{stem}.index.json"
    path = index_path(directory, stem)
    try:
        fd = open_regular(directory_fd, directory, name)
    except FileNotFoundError:
        raise no_index(directory, stem) from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(
                f"{path!r} holds {size} bytes, more than an index may ({MAX_INDEX_BYTES})",
                "the index was damaged or crafted; load another checkpoint.",
            )
        scanner, data = IndexScanner(path), bytearray()
        while True:
            chunk = os.read(fd, 4 << 20)
            if not chunk:
                break
            if len(data) + len(chunk) > MAX_INDEX_BYTES:  # it grew while being read
                raise CheckpointError(f"{path!r} holds more than {MAX_INDEX_BYTES} bytes")
            scanner.feed(chunk)
            data += chunk
    except OSError as exc:
        raise CheckpointError(f"cannot read {path!r}: {exc}") from exc
    finally:
        os.close(fd)
    with no_collection():
        return CheckpointIndex.from_json(decode_index(data, path), path)


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
