"""The bounds a checkpoint index's bytes must keep before json.loads parses them: size, nesting
depth, string and number lengths (json.loads recurses once per level, builds every string, and
converts every integer with int()), and the memory its values take once parsed (an empty `{}`
is 3 bytes of text and 64 of Python). Fed chunk by chunk by index_read.py (and by
storage.write_index, so that what saves loads); index_check.py then checks the parsed index's
schema."""

from __future__ import annotations

import random
import re

import numpy as np

from .format import MAX_NESTING, CheckpointError

MAX_INDEX_BYTES = 1 << 30  # an index holds the non-tensor state: ~10 KiB per rank (its RNG states)
MAX_DEPTH = 200  # JSON nesting; json.loads and the readers of the state recurse once per level
assert 5 + 3 * MAX_NESTING + 1 <= MAX_DEPTH  # what writers write, readers read
MAX_STRING_BYTES = 16 << 20  # as written in the file (escapes included)
MAX_INT_DIGITS = 4300  # Python's own default limit for int(str)
# What json.loads builds, at most, per value (CPython 3.11, 64-bit, as tracemalloc counts it;
# tests/test_checkpoint_index.py measures it): a dict (up to 184 bytes holding up to 5 items),
# a list (56, and room for 4 items), an item (a reference, or a number: 40), a key (its entry
# in the dict), a key not met before (a string of 49 bytes beside its text, and its place in
# json's table of keys seen: json.loads makes each key once), any other string (49 bytes,
# less the item counted for it; the strings' text costs what it takes in the file). An index
# may hold values costing at most MAX_VALUE_COST times its size (and FREE_COST): with the
# text itself, opening it then takes at most 10x its size, plus a few MiB
# (docs/checkpoint-format.md, "Loading untrusted checkpoints"). Indexes mpaccel writes cost
# about 4.5x (indented text; the smallest, up to ~7x, are dominated by their tags).
DICT_COST = 168
LIST_COST = 88
ITEM_COST = 40
ENTRY_COST = 48
NEW_KEY_COST = 72
STRING_COST = 24
MAX_VALUE_COST = 6
FREE_COST = 1 << 20  # beside it: a small index is refused for nothing (its tags are dense)
HINT = "the index was damaged or crafted; restore it from a copy, or load another checkpoint."

_DIGITS = b"0123456789"
_AS_ZEROS = bytes.maketrans(_DIGITS, b"0" * 10)  # every digit a "0", nothing else is
_LONG_NUMBER = b"0" * (MAX_INT_DIGITS + 1)
_ZEROS = re.compile(b"0+")


SCAN_CHUNK = 1 << 16  # numpy's work arrays for a chunk take up to ~40x its size
_BASE = random.getrandbits(64) | 1  # of the keys' hashes: odd, so invertible modulo 2**64


def scan(data: bytes | bytearray, path: str) -> None:
    """Refuse, before any parsing, the bytes of an index (the whole file) that break a bound of
    IndexScanner; nothing if they keep them."""
    scanner = IndexScanner(path)
    for start in range(0, len(data), SCAN_CHUNK):
        scanner.feed(bytes(data[start:start + SCAN_CHUNK]))
    scanner.finish()


def _powers(base: int, count: int) -> np.ndarray:
    """base ** i modulo 2**64, for i in range(count)."""
    out = np.ones(count, dtype=np.uint64)
    np.cumprod(np.full(count - 1, base, dtype=np.uint64), dtype=np.uint64, out=out[1:])
    return out


class IndexScanner:
    """Refuses JSON nested deeper than MAX_DEPTH, holding a string longer than MAX_STRING_BYTES
    or a number of more than MAX_INT_DIGITS digits, from the bytes, chunk by chunk, before
    json.loads (which recurses, builds the string, and fails in int()) sees them. Vectorised:
    the structural bytes are found with numpy, long numbers with a regular expression.

    finish() then refuses an index whose values would take more than MAX_VALUE_COST times its
    size in memory once parsed.

    It tracks only quotes, backslashes, brackets, separators and digits. Where the text is not
    JSON, the two may disagree only after the first byte json.loads refuses, which it reaches
    first."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pos = 0  # bytes fed so far
        self.depth = 0
        self.inside = False  # within a string
        self.start = 0  # where the string we are within opened
        self.slashes = 0  # backslashes that ended the previous chunk
        self.digits = 0  # digits that ended it
        self.quotes = 0  # string quotes so far
        self.keys = 0  # ":" so far (outside strings): a key each
        self.cost = 0  # what the dicts, lists, items and keys so far cost once parsed
        self.seen: set[int] = set()  # hashes of the keys met so far
        self.powers = np.ones(0, dtype=np.uint64)  # _BASE ** i, and its inverse's, mod 2**64
        self.inverses = np.ones(0, dtype=np.uint64)

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
            dicts = int(np.count_nonzero(a[brackets] == 0x7B))
            lists = int(np.count_nonzero(opening)) - dicts
            self.cost += DICT_COST * dicts + LIST_COST * lists
        commas = np.flatnonzero(a == 0x2C)  # outside strings: an even number of quotes before
        self.cost += ITEM_COST * int(np.count_nonzero(
            (np.searchsorted(quotes, commas) + self.inside) % 2 == 0))
        colons = np.flatnonzero(a == 0x3A)
        before = np.searchsorted(quotes, colons)
        colons, before = colons[(before + self.inside) % 2 == 0], before[
            (before + self.inside) % 2 == 0]
        if colons.size:
            self._count_keys(a, quotes, before - 1)
        self.quotes += quotes.size
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

    def _count_keys(self, a: np.ndarray, quotes: np.ndarray, closing: np.ndarray) -> None:
        """Count the keys before this chunk's colons (`closing`: the index in `quotes` of the
        quote that ends each key), and those not met before: by a hash of their bytes, with a
        base drawn at random (a key whose string began in an earlier chunk counts as new)."""
        self.keys += closing.size
        whole = closing >= 1
        new = int(closing.size - np.count_nonzero(whole))
        closing = closing[whole]
        if closing.size:
            if self.powers.size <= a.size:
                self.powers = _powers(_BASE, a.size + 1)
                self.inverses = _powers(pow(_BASE, -1, 1 << 64), a.size + 1)
            prefix = np.zeros(a.size + 1, dtype=np.uint64)
            np.cumsum(a * self.powers[: a.size], dtype=np.uint64, out=prefix[1:])
            starts, ends = quotes[closing - 1] + 1, quotes[closing]
            hashes = ((prefix[ends] - prefix[starts]) * self.inverses[starts]
                      + (ends - starts).astype(np.uint64))
            known = len(self.seen)
            self.seen.update(np.unique(hashes).tolist())
            new += len(self.seen) - known
        self.cost += NEW_KEY_COST * new

    def finish(self) -> None:
        """Once every chunk was fed: refuse an index whose values would take more than
        MAX_VALUE_COST times its size in memory once parsed."""
        self.seen.clear()
        self.powers = self.inverses = np.ones(0, dtype=np.uint64)
        strings = max(0, self.quotes // 2 - self.keys)  # (keys are strings too)
        cost = self.cost + ENTRY_COST * self.keys + STRING_COST * strings
        if cost > MAX_VALUE_COST * self.pos + FREE_COST:
            raise CheckpointError(
                f"{self.path!r}: {self.pos} bytes holding values that would take {cost} bytes "
                f"of memory once parsed, more than {MAX_VALUE_COST}x its size (many small "
                "JSON values: a padded or crafted index)",
                HINT,
            )

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
