"""The field checks of a checkpoint index (index_check.py, index_documents.py): each failure a
CheckpointError naming the index file and the field, with the bad value quoted, cut to a line."""

from __future__ import annotations

import re
import reprlib
from typing import Any

from .format import CheckpointError
from .index_scan import HINT as _HINT

TORCH_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")  # a torch dtype's name, as torch spells it


def field_path(path: tuple) -> str:
    """('tensors', 'model/w', 'offset') -> tensors['model/w']['offset']"""
    return (str(path[0]) + "".join(f"[{part!r}]" for part in path[1:])) if path else "the index"


def _fail(file: str, path: tuple, message: str) -> CheckpointError:
    return CheckpointError(f"{file!r}: {field_path(path)} {message}", _HINT)


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
