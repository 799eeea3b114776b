"""How an mpaccel process ends: the one module that aborts the job, ends it cleanly, and runs the
exit hooks in their order.

The exit order, once the script is done (or calls `end_job`):

1. threading's shutdown hooks, before any atexit hook (`finish_before_exit`): a background
   checkpoint save is committed. It needs the thread pools of checkpoint/rawio.py, which refuse
   work once concurrent.futures' own hook has run: registered later, ours runs first.
2. mpaccel's atexit hook (`at_exit`), by stage:
   a. STOP_PROGRESS: the MPI progress thread stops; it must make no MPI call once MPI is
      finalised, and the main thread drives MPI itself in the barrier that follows.
   b. END_OF_PROGRAM: the job's communicator waits for every rank in a barrier of its own. A
      rank left in a collective that this one will never join learns it there in seconds
      (CollectiveMismatchError, then `abort_job`), instead of at the timeout.
   c. BACKEND_THREADS: torch.distributed's gloo worker threads finish what they hold. A worker
      drops a finished collective a moment after the caller was released, and the drop may
      need the GIL (a collective started inside backward() holds a Python object). A thread
      that asks for the GIL once finalisation has begun is ended by Python, the unwind meets
      C++ and the process aborts after a clean end: "terminate called without an active
      exception" (distributed.settle_gloo_workers).
3. mpi4py's own exit hook: MPI_Finalize. Ours was registered after mpi4py.MPI was imported
   (the first `at_exit` comes from a communicator), so it runs before.

An exception nobody caught on one rank of a multi-rank job (`install_abort_hook`): the rank
prints its traceback, each line tagged with the rank, and aborts the job (MPI_Abort): none of
the hooks above runs, and no rank waits for the one that failed. An error that every rank
has (a CollectiveError: one rank failed, the others learnt it) is aborted by the failing rank
alone, whose output the launcher then delivers; the others print theirs and wait for it.
`abort_job` is that abort, for everything else that must end the whole job at once (a
diverged end of the program, the pytest plugin's deadline). mpi4py's `mpi4py.run`
(set_abort_status and one try/except around the user's code) is the model.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import os
import stat
import sys
import termios
import threading
import time
import traceback
from collections.abc import Callable
from enum import IntEnum
from typing import Any, NoReturn

from . import envvars
from .errors import CollectiveError

# How long a rank whose uncaught CollectiveError names another rank waits for that rank to
# abort the job (see _aborting_rank). It only delays the end when that rank does not abort.
ABORT_GRACE = 5.0
# How long an aborting rank waits for the launcher to read what it wrote (see _drain).
DRAIN_LIMIT = 2.0


class Stage(IntEnum):
    """When an `at_exit` hook runs: lower first."""

    STOP_PROGRESS = 1
    END_OF_PROGRAM = 2
    BACKEND_THREADS = 3


_hooks: list[tuple[Stage, Callable[[], object]]] = []
_registered = False
_abort_hook_installed = False


def at_exit(stage: Stage, hook: Callable[[], object]) -> None:
    """Not collective. Run `hook` at the normal end of the process, in `stage` (see the module
    docstring); hooks of one stage run last registered first, as atexit's do. Register only
    once mpi4py.MPI is imported (a communicator exists), so that they run before MPI_Finalize."""
    global _registered
    _hooks.append((stage, hook))
    if not _registered:
        atexit.register(_run_exit_hooks)
        _registered = True


def _run_exit_hooks() -> None:
    # sorted() is stable: reversing first keeps "last registered first" within a stage
    for _, hook in sorted(reversed(_hooks), key=lambda item: item[0]):
        try:
            hook()
        except BaseException:  # as atexit does: report it and run the next hook
            print("Exception ignored in an mpaccel exit hook:", file=sys.stderr)
            traceback.print_exc()


def finish_before_exit(hook: Callable[[], object]) -> None:
    """Not collective. Run `hook` first of all at the normal end of the process, while thread
    pools still take work (step 1 of the exit order): the async saver's commit."""
    register = getattr(threading, "_register_atexit", None)
    (register or atexit.register)(hook)


def leave_now(code: int) -> NoReturn:
    """Not collective, but for an error every rank has: end this process at once with `code`
    (output flushed, no exit hook, MPI not finalised), from an exit hook where SystemExit
    would be swallowed (the async saver's commit at step 1, when that save failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def abort_job(code: int = 1) -> NoReturn:
    """Not collective: end every rank of the job now with `code`; no exit hook runs. MPI_Abort
    where MPI is up; this process alone (os._exit) where it is not, or where MPI_Abort returns
    (MPICH's does, called from another thread than the main one). What this process wrote to
    its stdout and stderr pipes is read by the launcher first (2 s at most, see _drain)."""
    _drain((1, 2), DRAIN_LIMIT)
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def end_job(code: int = 0) -> NoReturn:
    """Leave normally with `code` (every rank calls it): output flushed, SystemExit, so that the
    exit hooks run in their order and MPI is finalised on every rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def install_abort_hook(rank: int, size: int, host: str, abort: Callable[[int], Any]) -> None:
    """Not collective, once per process: from now on an exception nobody caught on this rank of
    a `size`-rank job prints its traceback, tagged, and calls `abort(1)` (the communicator's
    MPI_Abort). Off for a job of one process and with MPACCEL_ABORT_ON_EXCEPTION=0. Install it
    after torch.distributed's process group: torch wraps sys.excepthook there."""
    global _abort_hook_installed
    if _abort_hook_installed or size == 1:
        return
    if not envvars.get_bool("abort_on_exception", True):
        return
    tag = f"[mpaccel rank {rank}/{size} {host}]"

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip()
        lines = [f"{tag} {line}" for line in text.splitlines()]
        if _called_from_running_code():
            # Not an uncaught exception: C extensions report errors they must ignore (Cython's
            # unraisable errors in __dealloc__, e.g. h5py failing to close a file) through
            # PyErr_PrintEx, which calls sys.excepthook while the program goes on.
            lines.append(f"{tag} (reported by an extension while the program runs: not fatal)")
            os.write(2, ("\n".join(lines) + "\n").encode(errors="replace"))
            return
        leader = _aborting_rank(exc)
        if leader is None or leader == rank:
            lines.append(f"{tag} uncaught {exc_type.__name__}: aborting all ranks (MPI_Abort)")
        else:
            lines.append(
                f"{tag} uncaught {exc_type.__name__}: rank {leader} failed and ends the job "
                f"(MPI_Abort); this rank waits for it, {ABORT_GRACE:g} s at most"
            )
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            # Straight to fd 2: sys.stderr may be a wrapper's buffer that MPI_Abort never flushes.
            os.write(2, ("\n".join(lines) + "\n").encode(errors="replace"))
            if leader is not None and leader != rank:
                _drain((1, 2), DRAIN_LIMIT)  # read before the abort kills this rank, if it can be
                time.sleep(ABORT_GRACE)
        finally:
            abort(1)

    sys.excepthook = hook
    _abort_hook_installed = True


def _aborting_rank(exc: BaseException) -> int | None:
    """The one rank that aborts the job for `exc`, when `exc` is the same CollectiveError on
    every rank: the lowest failing rank (rank 0 where none failed: every rank disagreed). None
    for any other error: each rank that has it aborts.

    The launcher delivers the output of the rank that calls MPI_Abort; it kills the others,
    whose output written just before may be lost (MPICH's hydra does). A rank that only learnt
    of another's failure would often abort first, killing the failing rank before it printed
    its traceback. So it waits, ABORT_GRACE at most, for that rank's abort (and aborts itself
    after: that rank may have caught the error)."""
    if not isinstance(exc, CollectiveError):
        return None
    return min(exc.failures, default=0)


def _drain(fds: tuple[int, ...], limit: float) -> None:
    """Wait, `limit` seconds at most, until whoever reads the pipes `fds` lead to (mpiexec's
    proxy) has read everything written to them. An abort right after a write to a pipe can
    lose what the launcher had not read yet: the aborting rank's whole traceback, at times.
    Files and terminals need no wait."""
    deadline = time.monotonic() + limit
    unread = array.array("i", [0])
    for fd in fds:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while time.monotonic() < deadline:
                fcntl.ioctl(fd, termios.FIONREAD, unread, True)
                if unread[0] == 0:
                    break
                time.sleep(1e-3)
        except OSError:
            continue  # closed, or no FIONREAD here: nothing to wait for


def _called_from_running_code() -> bool:
    """True when sys.excepthook runs with Python frames below it. The interpreter calls it for
    an uncaught exception only after unwinding every frame, so then there are none."""
    try:
        sys._getframe(2)  # 0: this function, 1: the hook, 2: whoever called the hook
    except ValueError:
        return False
    return True
