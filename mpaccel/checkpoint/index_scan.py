"""The bounds a checkpoint index's bytes must keep before json.loads parses them: size, nesting
depth, string and number lengths (json.loads recurses once per level, builds every string, and
converts every integer with int()). Read by reader.py chunk by chunk; index_check.py then checks
the parsed index's schema."""

from __future__ import annotations

import re

import numpy as np

from .format import MAX_NESTING, CheckpointError

MAX_INDEX_BYTES = 1 << 30  # an index holds the non-tensor state: ~10 KiB per rank (its RNG states)
MAX_DEPTH = 200  # JSON nesting; json.loads and the readers of the state recurse once per level
assert 5 + 3 * MAX_NESTING + 1 <= MAX_DEPTH  # what writers write, readers read
MAX_STRING_BYTES = 16 << 20  # as written in the file (escapes included)
MAX_INT_DIGITS = 4300  # Python's own default limit for int(str)
HINT = "the index was damaged or crafted; restore it from a copy, or load another checkpoint."

_DIGITS = b"0123456789"
_AS_ZEROS = bytes.maketrans(_DIGITS, b"0" * 10)  # every digit a "0", nothing else is
_LONG_NUMBER = b"0" * (MAX_INT_DIGITS + 1)
_ZEROS = re.compile(b"0+")


class IndexScanner:
    """Refuses JSON nested deeper than MAX_DEPTH, holding a string longer than MAX_STRING_BYTES
    or a number of more than MAX_INT_DIGITS digits, from the bytes, chunk by chunk, before
    json.loads (which recurses, builds the string, and fails in int()) sees them. Vectorised:
    the structural bytes are found with numpy, long numbers with a regular expression.

    It tracks only quotes, backslashes, brackets and digits. Where the text is not JSON, the two
    may disagree only after the first byte json.loads refuses, which it reaches first."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pos = 0  # bytes fed so far
        self.depth = 0
        self.inside = False  # within a string
        self.start = 0  # where the string we are within opened
        self.slashes = 0  # backslashes that ended the previous chunk
        self.digits = 0  # digits that ended it

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
