"""Out-of-band "rank r failed" notices of the pytest plugin, so that ranks waiting in a
collective that the failed rank will never join give up at once (`MPIComm.listen`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_TAG_ALERT = 7303  # on a communicator of its own: user traffic never matches it


class Alerts:
    """Notices between the ranks of one pytest run. Create it collectively (it duplicates
    `world`); hand it to the communicator that should give up (`MPIComm.listen`)."""

    def __init__(self, world: Any) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = world.Dup()
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self._pending: list[Any] = []
        self._seen: dict[int, int] = {}

    def post(self, text: str) -> None:
        """Not collective: tell every other rank that this one failed."""
        for r in range(self.size):
            if r != self.rank:
                self._pending.append(self._comm.isend((self.rank, text), dest=r, tag=_TAG_ALERT))

    def waiting(self) -> bool:
        """Not collective: whether an alert has arrived (poll() would return it)."""
        return bool(self._comm.Iprobe(self._MPI.ANY_SOURCE, _TAG_ALERT))

    def poll(self) -> tuple[int, str] | None:
        """Not collective: the next alert that arrived, if any."""
        status = self._MPI.Status()
        if not self._comm.Iprobe(self._MPI.ANY_SOURCE, _TAG_ALERT, status):
            return None
        rank, text = self._comm.recv(source=status.Get_source(), tag=_TAG_ALERT)
        self._seen[rank] = self._seen.get(rank, 0) + 1
        return rank, text

    def drain(self, failed_ranks: Sequence[int]) -> None:
        """Collective in effect: consume exactly one alert from each rank in `failed_ranks`."""
        for rank in failed_ranks:
            if rank == self.rank:
                continue
            if self._seen.get(rank, 0) > 0:
                self._seen[rank] -= 1
            else:
                self._comm.recv(source=rank, tag=_TAG_ALERT)
        self._MPI.Request.Waitall(self._pending)
        self._pending = []
