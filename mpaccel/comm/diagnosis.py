"""The "where are you" exchange behind MPIComm's errors: a waiting rank asks another which
collective it is in, to find ranks that took different code paths (CollectiveMismatchError)
and, at a deadline, to name the ranks that never came (CollectiveTimeoutError).

Questions and answers travel on a communicator of their own (a duplicate), so user traffic
never matches them. A rank answers only while it waits in a collective (MPIComm polls `answer`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import CollectiveMismatchError, CollectiveTimeoutError

_TAG_QUERY = 7301
_TAG_REPLY = 7302

# (label, sequence number, MPI operation) of the collective a rank waits in; None: in none.
Where = tuple[str, int, str] | None


class Diagnosis:
    """One MPIComm's side of the exchange, on `comm` (its diagnostics duplicate). Not
    collective: each method is called by one waiting rank."""

    def __init__(self, comm: Any, rank: int, size: int) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = comm
        self.rank = rank
        self.size = size
        self._asks: list[Any] = []  # pending sends of ask()

    def answer(self, current: Where) -> dict[int, Any]:
        """While waiting, tell any rank that asked (it timed out, or has waited long) which
        collective this rank is in; the reply repeats the question, so that the asker can tell
        an answer about the collective it still waits in from a late one. Returns, per asking
        rank, the collective it asked from."""
        MPI = self._MPI
        status = MPI.Status()
        asked: dict[int, Any] = {}
        while self._comm.Iprobe(MPI.ANY_SOURCE, _TAG_QUERY, status):
            source = status.Get_source()
            asked[source] = self._comm.recv(source=source, tag=_TAG_QUERY)
            reply = (self.rank, current, asked[source])
            self._comm.send(reply, dest=source, tag=_TAG_REPLY)
        return asked

    def ask(self, current: Where) -> None:
        """Ask one rank (rank 0; rank 0 asks rank 1) where it is: one small message per waiting
        rank, however large the job. Its answer arrives when it next waits in a collective."""
        target = 1 if self.rank == 0 else 0
        self._asks = [request for request in self._asks if not request.Test()]
        self._asks.append(self._comm.isend(current, dest=target, tag=_TAG_QUERY))

    def divergence(
        self, what: str, here: Where, hosts: Sequence[str]
    ) -> CollectiveMismatchError | None:
        """The error to raise if the answer to ask() shows the asked rank waiting in a
        collective of the same number as this one but another MPI operation (a barrier against
        an all-reduce, say): they can never match, so both would wait for the whole timeout
        (30 minutes by default). Names of the same operation are not compared (they may carry
        rank-dependent detail), nor are numbers that differ (a broadcast's root may finish
        early), so a slow rank is never taken for a diverged one."""
        MPI = self._MPI
        status = MPI.Status()
        while self._comm.Iprobe(MPI.ANY_SOURCE, _TAG_REPLY, status):
            rank, where, asked = self._comm.recv(source=status.Get_source(), tag=_TAG_REPLY)
            if asked != here or where is None or here is None:
                continue  # a late answer, or the rank is not in a collective
            if where[1] == here[1] and where[2] != here[2]:
                host = hosts[rank] if rank < len(hosts) else "?"
                return CollectiveMismatchError(
                    f"{what} (collective #{here[1]}, an MPI {here[2]}) cannot complete: rank "
                    f"{rank} ({host}) waits in {where[0]} (its collective #{where[1]}, an MPI "
                    f"{where[2]}): the ranks took different code paths",
                    "every rank must make the same collective calls in the same order. The "
                    "usual cause is a collective (wait_for_everyone, gather, check_trigger, "
                    "load_state...) inside `if accelerator.is_main_process:` or "
                    "another branch taken on some ranks only: call it on every rank.",
                )
        return None

    def timed_out(
        self, what: str, limit: float, here: Where, hosts: Sequence[str]
    ) -> CollectiveTimeoutError:
        """The error of a collective that did not complete in `limit` seconds: ask every other
        rank where it is (up to 5 s for the answers) and name those that never came."""
        MPI = self._MPI
        others = [r for r in range(self.size) if r != self.rank]
        sends = [self._comm.isend(here, dest=r, tag=_TAG_QUERY) for r in others]
        replies: dict[int, Any] = {}
        grace_end = time.monotonic() + min(5.0, max(1.0, 0.05 * limit))
        status = MPI.Status()
        while len(replies) < len(others) and time.monotonic() < grace_end:
            # A rank that timed out in this same collective asks too: its question says where
            # it is, which counts as its answer (it may stop answering before our questions
            # reach it, when timeouts are staggered on a loaded machine).
            for rank, where in self.answer(here).items():
                replies.setdefault(rank, where)
            if self._comm.Iprobe(MPI.ANY_SOURCE, _TAG_REPLY, status):
                rank, where, _ = self._comm.recv(source=status.Get_source(), tag=_TAG_REPLY)
                replies[rank] = where
            else:
                time.sleep(1e-3)
        for req in sends:
            if not req.Test():
                req.Cancel()
        arrived = sorted([self.rank] + [r for r, w in replies.items() if w == here])
        elsewhere = {r: w for r, w in replies.items() if w is not None and w != here}
        missing = sorted(r for r in others if r not in replies or replies[r] is None)
        missing += sorted(elsewhere)
        named = {r: hosts[r] for r in range(len(hosts))}
        hint = None
        if elsewhere:
            detail = "; ".join(f"rank {r} is in {w[0]} #{w[1]}" for r, w in elsewhere.items())
            hint = (
                f"ranks are in different collectives ({detail}; this rank is in {what} "
                f"#{here[1] if here else '?'}): some rank took a different code path, e.g. a "
                "wait_for_everyone() or check_trigger() inside an `if is_main_process:` block."
            )
        return CollectiveTimeoutError(what, limit, missing, named, arrived, hint)
