"""A phase of checkpoint I/O under a deadline: within() runs it on a thread of its own and gives
up on it, with StalledIOError, when none of its operations has ended for too long (a file system
that stopped answering); Watch is how the phase's operations report that they ended."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import MpaccelError

T = TypeVar("T")


class StalledIOError(MpaccelError, TimeoutError):
    """No checkpoint I/O of this process ended within the limit (see within())."""


class Watch:
    """One phase of checkpoint I/O run by within(): when an operation of it last ended, which
    ones are under way, and whether its caller gave up on it (`cancelled`: start nothing new)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.cancelled = False
        self._doing: dict[int, str] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """Around one operation that may block: an open, a piece read or written, an fsync."""
        ident = threading.get_ident()
        with self._lock:
            self._doing[ident] = what
        try:
            yield
        finally:
            with self._lock:
                self._doing.pop(ident, None)
            self.last = time.monotonic()

    def under_way(self) -> list[str]:
        with self._lock:
            return sorted(set(self._doing.values()))

    def check(self) -> None:
        """Raise in a thread that within() gave up on, before it changes anything more."""
        if self.cancelled:
            raise StalledIOError("this phase of I/O was given up (see within())")


_local = threading.local()


def current_watch() -> Watch:
    """The Watch of the within() phase this thread runs (outside any: a fresh one)."""
    watch = getattr(_local, "watch", None)
    return watch if watch is not None else Watch()


def stall_limit(timeout: float) -> float:
    """within()'s limit for a phase between two collectives of `timeout` seconds: a little less,
    so that a rank whose file system hangs reports in the next collective before the ranks
    already waiting there give up on it (they would name it too, but it would hang on)."""
    return timeout - min(0.1 * timeout, 30.0)


def within(limit: float, what: str, work: Callable[[], T]) -> T:
    """work() on a thread of its own; returns its result or raises its exception. When none of
    its operations (Watch.doing(): rawio's reads and writes, piece by piece, count) has ended for
    `limit` seconds, raises StalledIOError naming what was under way, and cancels the phase: its
    threads, blocked in the kernel on a file system that stopped answering, cannot be
    interrupted and are left behind (daemons: they do not keep the interpreter from exiting).
    Interrupted here (Ctrl-C), it cancels the phase too. Not collective: the caller agrees."""
    watch = Watch()
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        _local.watch = watch
        try:
            outcome.append((True, work()))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="mpaccel-io", daemon=True)
    thread.start()
    try:
        while not outcome:
            idle = time.monotonic() - watch.last
            if idle >= limit:
                break
            thread.join(min(limit - idle, 1.0))
        else:
            ok, value = outcome[0]
            if ok:
                return value
            raise value
    finally:
        if not outcome:
            watch.cancelled = True
    raise StalledIOError(
        f"{what}: no checkpoint I/O of this process ended for {limit:g} s (under way: "
        f"{'; '.join(watch.under_way()) or 'no read or write of its own: an open, a listing'})",
        "the file system stopped answering (a hung network mount, a file held by another "
        "process's lease, a frozen file system). The thread waiting on it cannot be interrupted "
        "and is left behind: end the job. If the storage is merely this slow, raise the "
        "collective timeout (MPACCEL_TIMEOUT=<seconds> or InitProcessGroupKwargs(timeout=...)).",
    )
