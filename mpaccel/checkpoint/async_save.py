"""Saves written in the background: the host-memory snapshot they write from, and the thread
(on a communicator of its own) that writes one checkpoint at a time."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from .. import lifecycle
from ..comm import Comm, MPIComm
from .format import flatten, unflatten


def snapshot(trees: dict[str, Any]) -> dict[str, Any]:
    """{component: tree} deep-copied, every tensor cloned to host memory (for a save in the
    background), tied tensors once (so the copies stay tied, and are stored once). Errors name
    the component and key, as a synchronous save's do."""
    out = {}
    for component, tree in trees.items():
        document, tensors = flatten(tree, component)
        copies: dict[str, Any] = {}

        def load(name: str, kind: str, tensors: dict[str, Any] = tensors,
                 copies: dict[str, Any] = copies) -> Any:
            if name not in copies:
                value = tensors[name]
                copies[name] = (value.copy() if kind == "numpy"
                                else value.detach().to("cpu", copy=True))
            return copies[name]

        out[component] = unflatten(document, load)
    return out


def threads_ok() -> bool:
    """Whether MPI lets a second thread make calls (a background save needs it)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return True
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class AsyncSaver:
    """Writes checkpoints in a background thread on its own communicator, one at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._comm: Comm | None = None
        self._exit_hook = False

    def comm_for(self, comm: Comm) -> Comm:
        """Collective the first time (every rank saves together): the background thread's
        communicator, a duplicate of `comm`'s ranks."""
        if self._comm is None:
            # It waits beside the training thread: sleep at once, never spin or yield; and it
            # is nobody's to interrupt (its errors are agreed on by the save itself).
            self._comm = (
                comm.dup(interruptible=False, spin_seconds=0.0, yield_seconds=0.0)
                if comm.size > 1 and isinstance(comm, MPIComm)
                else comm
            )
        return self._comm

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, target: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=run, name="mpaccel-async-save")
        if not self._exit_hook:
            # A script may end right after save_state(async_save=True). The save must still be
            # committed, and it needs the thread pools of rawio, which refuse new work once
            # the interpreter shuts down: so wait in a hook of threading's shutdown, which runs
            # (last registered, first run) before concurrent.futures' own and before atexit
            # (MPI is finalized there, after this).
            lifecycle.finish_before_exit(self._finish_at_exit)
            self._exit_hook = True
        self._thread.start()

    def _finish_at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:
            # Every rank has the same error (the save's collectives agree on it). The process
            # must not end with status 0 as if the checkpoint were there.
            print(
                f"mpaccel: the background save_state(async_save=True) failed and the script "
                f"ended without wait_for_checkpoint(): {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            lifecycle.leave_now(1)

    def wait(self) -> None:
        """Block until the background save is committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
