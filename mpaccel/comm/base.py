"""The control plane's interface: `Comm`, what mpaccel needs from a communicator, and `NullComm`,
the world of one process (identities for collectives, so callers never branch on "am I
distributed")."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import CollectiveError, RankFailure

OPS = {"max", "min", "sum"}


def failure_of(rank: int, host: str, exc: BaseException) -> RankFailure:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RankFailure(rank, host, type(exc).__name__, str(exc), tb)


class Comm(Protocol):
    """What mpaccel needs from a communicator. Every method is collective unless noted."""

    rank: int
    size: int
    hosts: Sequence[str]
    default_timeout: float

    def set_default_timeout(self, seconds: float) -> None:
        """Not collective: the deadline of the calls given none, from now on."""
        ...

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None: ...

    def allreduce(
        self, value: int, op: str = "max", what: str = "allreduce", timeout: float | None = None
    ) -> int: ...

    def allgather(
        self, obj: Any, what: str = "allgather", timeout: float | None = None
    ) -> list[Any]: ...

    def bcast(
        self, obj: Any, root: int = 0, what: str = "bcast", timeout: float | None = None
    ) -> Any: ...

    def scatter(
        self,
        objs: Sequence[Any] | None,
        root: int = 0,
        what: str = "scatter",
        timeout: float | None = None,
    ) -> Any:
        """Rank r gets `objs[r]` of the root (`objs`, one per rank, is read on the root only)."""
        ...

    def agree(
        self,
        error: BaseException | None,
        what: str,
        timeout: float | None = None,
        kind: type[CollectiveError] = CollectiveError,
    ) -> None:
        """Raise the same CollectiveError (or `kind`, a subclass) on every rank if `error` is
        set on any rank."""
        ...

    def abort(self, code: int = 1) -> None:
        """Not collective: end the whole job now."""
        ...

    def finalize(self) -> None:
        """Collective: shut MPI down (nothing may use it afterwards)."""
        ...


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
        import os

        os._exit(code)

    def finalize(self) -> None:
        return None
