"""Opening a checkpoint's index: read through the checks of index_scan.py, then parsed into a
CheckpointIndex (index.py: the checks of index_check.py, its own checksum); a missing index
explained (an interrupted save, or the other kind of checkpoint)."""

from __future__ import annotations

import os

from .files import read_regular
from .format import CheckpointError
from .index import CheckpointIndex
from .index_check import decode_index, decode_text, no_collection
from .index_scan import MAX_INDEX_BYTES, scan


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
    MAX_INDEX_BYTES) and the bounds of index_scan.py, not yet parsed (parse_index)."""
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
