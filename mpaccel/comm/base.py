"""The control plane's interface: `Comm`, what mpaccel needs from a communicator, and `NullComm`,
the world of one process (identities for collectives, so callers never branch on "am I
distributed")."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from .. import lifecycle
from ..errors import CollectiveError, RankFailure

OPS = {"max", "min", "sum"}


def failure_of(rank: int, host: str, exc: BaseException) -> RankFailure:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RankFailure(rank, host, type(exc).__name__, str(exc), tb)


class Comm(Protocol):
    """What mpaccel needs from a communicator: `MPIComm` over MPI, `NullComm` for one process.

    Collective means every rank of the communicator calls the method, the collectives in the
    same order on every rank. `what` names the call in errors ("wait_for_everyone", "saving
    checkpoint '...'"). `timeout` is in seconds (None: `default_timeout`); past it the rank
    raises CollectiveTimeoutError naming the ranks that never came, and the communicator is
    unusable from then on (the job should end). Costs are MPIComm's on one node (MPICH;
    docs/benchmarks.md); NullComm's calls cost nothing but a Python call.
    """

    rank: int  # this process's rank, 0 .. size-1
    size: int  # how many ranks
    hosts: Sequence[str]  # each rank's host name (for errors; may be empty: "?")
    default_timeout: float  # seconds a call given no timeout may wait

    def set_default_timeout(self, seconds: float) -> None:
        """Not collective, free: the deadline of the calls given none, from now on."""
        ...

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        """Collective: return once every rank has called it. One MPI barrier (persistent where
        MPI-4 has it): a few µs at 2 ranks."""
        ...

    def allreduce(
        self, value: int, op: str = "max", what: str = "allreduce", timeout: float | None = None
    ) -> int:
        """Collective: `op` ("max", "min" or "sum") of every rank's int `value`, on every rank.
        One MPI all-reduce of an int64 (persistent where MPI-4 has it): a few µs at 2 ranks."""
        ...

    def allgather(
        self, obj: Any, what: str = "allgather", timeout: float | None = None
    ) -> list[Any]:
        """Collective: every rank's `obj` (picklable), in rank order, on every rank. Two MPI
        collectives (the sizes, then the pickled bytes); cost grows with the objects."""
        ...

    def gather(
        self, obj: Any, root: int = 0, what: str = "gather", timeout: float | None = None
    ) -> list[Any] | None:
        """Collective: every rank's `obj` (picklable), in rank order, on `root` only (the
        others get None; the root's own object is its own, not a copy). For what one rank
        needs of everyone (rank 0 writing an index): the others hold and move only their own
        bytes, where allgather costs every rank the sum of all. Two MPI collectives: an
        all-gather of the sizes (8 bytes a rank, so that every rank waits until all have
        come and a timeout names the ranks that never did), then a gather of the pickled
        bytes."""
        ...

    def bcast(
        self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None
    ) -> Any:
        """Collective: `root`'s `obj` on every rank (the others' `obj` is ignored; the root
        gets its own object back, not a copy). Two MPI broadcasts (size, pickled bytes)."""
        ...

    def scatter(
        self,
        objs: Sequence[Any] | None,
        root: int = 0,
        what: str = "scatter",
        timeout: float | None = None,
    ) -> Any:
        """Collective: rank r gets `objs[r]` of the root (`objs`, one per rank, is read on the
        root only; the root keeps its own object). Two MPI collectives (sizes, then each rank
        receives only its own pickled bytes)."""
        ...

    def agree(
        self,
        error: BaseException | None,
        what: str,
        timeout: float | None = None,
        kind: type[CollectiveError] = CollectiveError,
    ) -> None:
        """Collective: raise the same CollectiveError (or `kind`, a subclass) on every rank if
        `error` is set on any rank, naming each failing rank, its exception and traceback
        (chained from `error` where it is this rank's). One int all-reduce when nobody failed;
        an all-gather of the failures more when somebody did. `agreement` is the usual way to
        call it."""
        ...

    def abort(self, code: int = 1) -> None:
        """Not collective: end the whole job now with `code` (MPI_Abort; os._exit for one
        process). Exit hooks do not run. Does not return."""
        ...

    def finalize(self) -> None:
        """Collective: stop the progress thread and shut MPI down (nothing may use MPI
        afterwards; the end-of-program barrier then has nothing to do)."""
        ...


@contextmanager
def agreement(
    comm: Comm,
    what: str,
    *,
    kind: type[CollectiveError] = CollectiveError,
    timeout: float | None = None,
    wrap: Callable[[Exception], BaseException] | None = None,
    cleanup: Callable[[], object] | None = None,
    catch: tuple[type[Exception], ...] = (Exception,),
    passing: tuple[type[Exception], ...] = (),
) -> Iterator[None]:
    """Collective: run the block on every rank, then agree (Comm.agree): if it raised on any
    rank, every rank raises the same `kind` naming each rank that failed; else every rank goes
    on. For work that one rank does alone (rank 0 creates the directory), put it under `if
    comm.rank == 0:` inside the block: the others still take part in the agreement.

    `wrap(exc)`: the exception reported for this rank instead of the one the block raised (a
    message naming the file it was writing, say). `cleanup()`: run on every rank when the
    agreement raises, before the error leaves (remove the files of a save that will not be
    committed). `catch`: the exceptions agreed on (others leave the block as they are, on the
    ranks that raise them). `passing`: exceptions agreed already on every rank (a
    CollectiveError from a nested agreement): they leave the block as they are, with no second
    agreement that the other ranks would not join.

        with agreement(comm, "creating the cache directory"):
            if comm.rank == 0:
                os.makedirs(path)
    """
    error: BaseException | None = None
    try:
        yield
    except passing:
        raise
    except catch as exc:
        error = exc if wrap is None else wrap(exc)
    try:
        comm.agree(error, what, timeout, kind)
    except Exception:
        if cleanup is not None:
            cleanup()
        raise


class NullComm:
    """The world of one process. Collectives are identities; errors still come out collective."""

    rank = 0
    size = 1

    def __init__(self, host: str = "localhost", default_timeout: float = 1800.0) -> None:
        self.hosts: Sequence[str] = (host,)
        self.default_timeout = default_timeout

    def set_default_timeout(self, seconds: float) -> None:
        self.default_timeout = seconds

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        return None

    def allreduce(
        self, value: int, op: str = "max", what: str = "allreduce", timeout: float | None = None
    ) -> int:
        if op not in OPS:
            raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(OPS)}")
        return int(value)

    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list:
        return [obj]

    def gather(
        self, obj: Any, root: int = 0, what: str = "gather", timeout: float | None = None
    ) -> list[Any] | None:
        if root != 0:
            raise ValueError(f"root {root} out of range for a world of size 1")
        return [obj]

    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout=None) -> Any:
        if root != 0:
            raise ValueError(f"root {root} out of range for a world of size 1")
        return obj

    def scatter(
        self,
        objs: Sequence[Any] | None,
        root: int = 0,
        what: str = "scatter",
        timeout: float | None = None,
    ) -> Any:
        if root != 0:
            raise ValueError(f"root {root} out of range for a world of size 1")
        if objs is None or len(objs) != 1:
            raise ValueError(f"scatter needs one object per rank (1) on the root, got {objs!r}")
        return objs[0]

    def agree(
        self,
        error: BaseException | None,
        what: str,
        timeout: float | None = None,
        kind: type[CollectiveError] = CollectiveError,
    ) -> None:
        if error is not None:
            raise kind(what, {0: failure_of(0, self.hosts[0], error)}) from error

    def abort(self, code: int = 1) -> None:
        lifecycle.abort_job(code)

    def finalize(self) -> None:
        return None
