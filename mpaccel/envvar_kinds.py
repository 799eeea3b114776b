"""The kinds of value an environment variable can hold, each with its parser: what mpaccel.envvars's
table gives every variable. A parse is bounded: a number has a bounded number of digits, and
Slurm's compressed lists are counted, never expanded, before they are accepted. Nothing here
reads the environment (mpaccel.envvars does, through its table)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_INT = 2**31 - 1  # MPI counts and ranks are C ints
# A Slurm job of more nodes than this is not one Slurm made (python-hostlist's own limit).
MAX_NODES = 100_000
YEAR = 365 * 24 * 3600.0  # the longest deadline in seconds: Python's timedelta and torch take it


class Kind:
    """What a variable holds: `parse` returns its value or raises ValueError, and `accepted()`
    says, after "is not", what a valid value looks like."""

    def accepted(self) -> str:
        return "any text"

    def parse(self, text: str) -> Any:
        return text


class Text(Kind):
    pass


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Integer(Kind):
    low: int = 0
    high: int = MAX_INT

    def accepted(self) -> str:
        return f"an integer from {self.low} to {self.high}"

    def parse(self, text: str) -> int:
        stripped = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,19}", stripped, re.ASCII):
            raise ValueError(text)
        value = int(stripped)
        if not self.low <= value <= self.high:
            raise ValueError(text)
        return value


@dataclass(frozen=True)
class CountOrAuto(Kind):
    """A number of processes from 1, or "auto" (mpaccel chooses it from the job's nodes)."""

    def accepted(self) -> str:
        return f"an integer from 1 to {MAX_INT}, or 'auto'"

    def parse(self, text: str) -> int | str:
        if text.strip().lower() == "auto":
            return "auto"
        return Integer(1).parse(text)


@dataclass(frozen=True)
class Number(Kind):
    """A finite float in [low, high] (`low` excluded when `open_low`), in `unit`."""

    low: float
    high: float
    unit: str
    open_low: bool = False

    def accepted(self) -> str:
        low = f"> {_number(self.low)}" if self.open_low else f">= {_number(self.low)}"
        return f"a number of {self.unit} {low} and <= {_number(self.high)}"

    def parse(self, text: str) -> float:
        if len(text) > 64:
            raise ValueError(text)
        value = float(text)  # ValueError for anything else; nan and inf are refused below
        if not math.isfinite(value) or value > self.high:
            raise ValueError(text)
        if value < self.low or (self.open_low and value == self.low):
            raise ValueError(text)
        return value


_TRUE = ("1", "true", "yes", "on", "y", "t")  # Accelerate's str_to_bool takes y/t/n/f too
_FALSE = ("0", "false", "no", "off", "n", "f")


class Flag(Kind):
    def accepted(self) -> str:
        return "a boolean (1/0, true/false, yes/no, on/off)"

    def parse(self, text: str) -> bool:
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError(text)


@dataclass(frozen=True)
class Choice(Kind):
    """One of `choices`, in any case; the value is returned in lower case."""

    choices: tuple[str, ...]

    def accepted(self) -> str:
        return "one of " + ", ".join(map(repr, self.choices)) + " (in any case)"

    def parse(self, text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in self.choices:
            raise ValueError(text)
        return lowered


@dataclass(frozen=True)
class JsonObject(Kind):
    """A JSON object, `{"key": "value", ...}`, of at most `limit` characters (json.loads of a
    bounded text: deep nesting is refused, not a RecursionError)."""

    limit: int = 65536

    def accepted(self) -> str:
        return 'a JSON object ({"key": "value", ...})'

    def parse(self, text: str) -> dict[str, Any]:
        if len(text) > self.limit:
            raise ValueError(text)
        try:
            value = json.loads(text)  # a JSONDecodeError is a ValueError
        except RecursionError:
            raise ValueError(text) from None
        if not isinstance(value, dict):
            raise ValueError(text)
        return value


_RUN = re.compile(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?", re.ASCII)


class PerNode(Kind):
    """Slurm's compressed per-node counts, `2(x3),1`, as runs ((2, 3), (1, 1)): never expanded,
    so a value naming millions of nodes costs what its text costs."""

    def accepted(self) -> str:
        return f"Slurm's per-node counts such as '2(x3),1' (counts >= 1, at most {MAX_NODES} nodes)"

    def parse(self, text: str) -> tuple[tuple[int, int], ...]:
        runs = []
        nodes = 0
        for part in text.split(","):
            match = _RUN.fullmatch(part.strip())
            if match is None:
                raise ValueError(part)
            count, repeat = int(match.group(1)), int(match.group(2) or 1)
            nodes += repeat
            if count < 1 or repeat < 1 or nodes > MAX_NODES:
                raise ValueError(part)
            runs.append((count, repeat))
        return tuple(runs)


_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", re.ASCII)


class NodeList(Kind):
    """A Slurm host list (`gpu[01-03,07],login1`): checked and its names counted without
    expanding it; environments.slurm expands it once it is known to be small."""

    def accepted(self) -> str:
        return f"a Slurm node list such as 'gpu[01-03,07],login1' (at most {MAX_NODES} nodes)"

    def parse(self, text: str) -> str:
        total = 0
        for part in _top_level_parts(text):
            if "[" in _GROUP.sub("", part) or "]" in _GROUP.sub("", part):
                raise ValueError(part)
            names = 1
            for group in _GROUP.findall(part):
                names *= _names_in(group)
                if names > MAX_NODES:
                    raise ValueError(part)
            total += names
            if total > MAX_NODES:
                raise ValueError(part)
        return text


def _names_in(rangelist: str) -> int:
    """How many names `01-03,07` (inside a host list's brackets) stands for."""
    count = 0
    for item in rangelist.split(","):
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(item)
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise ValueError(item)
        count += high - low + 1
        if count > MAX_NODES:
            raise ValueError(item)
    return count


def _top_level_parts(text: str) -> list[str]:
    """`a[1,2],b` -> ['a[1,2]', 'b']: the commas outside brackets separate host expressions."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]
