"""MPIComm: the control plane over MPI. Host-side, never the GPU.

`MPIComm` is a thin adapter over an mpi4py communicator whose every collective is non-blocking
and polled: a short spin keeps latency at raw-MPI level when everyone is already there, then
yielding and finally sleeping free the CPU (MPICH's blocking calls busy-poll, stealing cores from
the rank that is still working) and let Python run signal handlers. Each call has a deadline; on
expiry the waiting ranks ask each other where they are and raise one error naming the ranks that
never came.
"""

from __future__ import annotations

import math
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .. import lifecycle
from ..errors import (
    CollectiveError,
    CollectiveMismatchError,
    MpaccelError,
    PeerFailedError,
    RankFailure,
)
from .base import failure_of
from .diagnosis import Diagnosis
from .presence import Presence
from .progress import ProgressThread

# Waiting has three phases. Spin: test in a tight loop (everyone is there: raw-MPI latency).
# Yield: test, then sched_yield() so a rank that shares this core and still works (more ranks
# than cores) gets it, while this one keeps driving MPI progress for the collective's rounds.
# Sleep: growing sleeps free the CPU entirely for long waits (rank 0 writing a checkpoint).
# Python runs signal handlers between polls in every phase.
_SPIN_SECONDS = 1e-3  # where the node has a core per rank; 0 where it has fewer (discovery)
_YIELD_SECONDS = 0.05
_YIELD_SECONDS_OVERSUBSCRIBED = 2e-4  # see MPIComm(oversubscribed=True)
_MAX_SLEEP = 1e-3  # cap of the growing sleep: bounds the wake-up latency of a long wait
# After this long in one collective, a rank asks one other rank (rank 0; rank 0 asks rank 1)
# where it is: see comm/diagnosis.py.
_PROBE_AFTER = 5.0


class AlertSource(Protocol):
    """Notices that a rank failed (the pytest plugin's `mpaccel.testing.alerts.Alerts`)."""

    def waiting(self) -> bool: ...

    def poll(self) -> tuple[int, str] | None: ...


class MPIComm:
    """Adapter over an mpi4py communicator (duplicated, so mpaccel's traffic stays apart)."""

    def __init__(
        self,
        comm: Any,
        default_timeout: float = 1800.0,
        interruptible: bool = True,
        *,
        hosts: Sequence[str] = (),
        oversubscribed: bool = False,
        spin_seconds: float | None = None,
        yield_seconds: float | None = None,
        progress_interval: float | None = None,
    ) -> None:
        """Collective over `comm`, which is duplicated (Dup, 2 or 3 times).

        `default_timeout`: the deadline, in seconds, of a call given none. `interruptible`:
        this is the communicator user code waits on: after 5 s in one collective it asks
        another rank where it is (comm/diagnosis.py), at exit it waits for every rank in a
        barrier of its own (_end_of_program), and it can listen() to the pytest plugin's
        alerts; the plugin's own communicator and the async saver's are not. `hosts`: each
        rank's host name, for the errors (discovery gathers them). `oversubscribed`: this
        node runs more ranks than they have cores, so a waiting rank that spins, or yields
        for long, keeps the ranks yet to arrive off the CPU: no spin, and 200 us of yielding
        (docs/benchmarks.md, "Waiting on an oversubscribed node"). `spin_seconds` and
        `yield_seconds` override those two phases of a wait (the async saver, waiting beside
        the training thread, sleeps at once: 0 and 0). `progress_interval`: start a
        ProgressThread probing every that many seconds (MPACCEL_MPI_PROGRESS)."""
        from mpi4py import MPI

        self._MPI = MPI
        self._parent = comm
        self._comm = comm.Dup()
        self._diag = comm.Dup()
        self._diagnosis = Diagnosis(self._diag, comm.Get_rank(), comm.Get_size())
        # saves that one rank may make alone ask who is here (comm/presence.py)
        self.presence = Presence(
            self._comm, comm.Get_rank(), comm.Get_size(), lambda: self._seq
        )
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        # set here only: a communicator that waits differently is made with dup(...)
        self.hosts: Sequence[str] = tuple(hosts)
        self.default_timeout = default_timeout
        self.interruptible = interruptible
        if spin_seconds is None:
            spin_seconds = 0.0 if oversubscribed else _SPIN_SECONDS
        if yield_seconds is None:
            yield_seconds = _YIELD_SECONDS_OVERSUBSCRIBED if oversubscribed else _YIELD_SECONDS
        self.spin_seconds = spin_seconds
        self.yield_seconds = yield_seconds
        self._seq = 0
        # (label, sequence number, MPI operation) of the collective this rank waits in
        self._current: tuple[str, int, str] | None = None
        # the user-facing communicator looks for ranks in different collectives; the pytest
        # plugin's and the async saver's (interruptible=False) do not
        self.probe_after: float | None = _PROBE_AFTER if interruptible else None
        self._broken: str | None = None
        self._ops = {"max": MPI.MAX, "min": MPI.MIN, "sum": MPI.SUM}
        self._send = np.zeros(1, dtype=np.int64)
        self._recv = np.zeros(1, dtype=np.int64)
        self._persistent: dict[str, Any] = {}
        self._set_up_persistent()
        self.progress: ProgressThread | None = None
        if progress_interval is not None:
            self.progress = ProgressThread(self._diag, progress_interval)
        self._alerts: AlertSource | None = None
        self._end: Any = None
        if self.probe_after is not None and self.size > 1:
            self._end = comm.Dup()
            lifecycle.at_exit(lifecycle.Stage.END_OF_PROGRAM, self._end_of_program)

    def dup(
        self,
        *,
        interruptible: bool | None = None,
        default_timeout: float | None = None,
        spin_seconds: float | None = None,
        yield_seconds: float | None = None,
    ) -> MPIComm:
        """Collective over this communicator's ranks: a new MPIComm on the same ranks, with this
        one's settings but those given (the async saver's: `dup(interruptible=False,
        spin_seconds=0, yield_seconds=0)`). It starts no second progress thread."""
        return MPIComm(
            self._parent,
            self.default_timeout if default_timeout is None else default_timeout,
            self.interruptible if interruptible is None else interruptible,
            hosts=self.hosts,
            spin_seconds=self.spin_seconds if spin_seconds is None else spin_seconds,
            yield_seconds=self.yield_seconds if yield_seconds is None else yield_seconds,
        )

    def free(self) -> None:
        """Collective: release the MPI communicators and requests (nothing may use this object
        afterwards). Needed only for a communicator made for a while (discovery's first one)."""
        for request in self._persistent.values():
            request.Free()
        self._persistent = {}
        for comm in (self._comm, self._diag, self._end):
            if comm is not None:
                comm.Free()
        self._end = None  # the exit hook has nothing to do

    def set_default_timeout(self, seconds: float) -> None:
        """Not collective. The deadline of the calls given none from now on: PartialState sets
        it when it is created again, after _reset_state(), with another timeout (discovery and
        its communicator outlive the reset)."""
        self.default_timeout = seconds

    def _end_of_program(self) -> None:
        """At exit, before MPI_Finalize: a barrier named "the end of the program". While a rank
        waits here it answers where it is, so a rank stuck in a collective this one will never
        join (`if is_main_process: check_trigger()` at the end of a script) learns it within
        seconds (_check_divergence) instead of after the timeout. It runs on a communicator of
        its own, so that it can never complete against a stray wait_for_everyone() on another
        rank, and without a time limit: a rank still busy (rank 0 writing a report after
        training) cannot be told from a hung one, and MPI_Finalize would wait for it anyway. A
        rank whose communicator an abandoned collective left out of step comes too (that
        communicator is not used here), but asks no one where they are: its collective
        numbers no longer line up with the others'."""
        if self._MPI.Is_finalized() or self._end is None:
            return
        what, kind = "the end of the program", "end-of-program barrier"
        try:
            if self._broken is None:
                self._begin(what, kind)
            else:
                # It answers with the number of the collective it abandoned, so that a rank
                # still waiting in that one learns that this rank will never come.
                self._broken, self.probe_after = None, None
                self._current = (what, self._seq, kind)
            self._wait(self._end.Ibarrier(), what, math.inf)
        except CollectiveMismatchError as exc:
            self._abort_at_exit(f"{type(exc).__name__}: {exc}")
        except PeerFailedError:
            pass  # the pytest plugin reported it; the job is ending anyway
        except KeyboardInterrupt:
            # Python ignores exceptions from exit hooks: MPI_Finalize would then wait, out of
            # reach of any signal, for every other rank to finish.
            self._abort_at_exit(f"interrupted while waiting in {what}: aborting all ranks")

    def _abort_at_exit(self, text: str) -> None:
        print(f"[mpaccel rank {self.rank}] {text}", file=sys.stderr, flush=True)
        self.abort(1)

    def _set_up_persistent(self) -> None:
        """Collective, like Dup: MPI-4 persistent barrier and int all-reduces on `_comm`. Their
        schedule is built once, which makes each call cheaper than its Ixxx form (measured:
        docs/benchmarks.md, "Persistent collectives"). Without MPI-4 the Ixxx calls are used."""
        self._persistent = {}
        try:
            requests = {"barrier": self._comm.Barrier_init()}
            for name, op in self._ops.items():
                requests[name] = self._comm.Allreduce_init(self._send, self._recv, op)
        except (AttributeError, NotImplementedError, self._MPI.Exception):
            # mpi4py 3 has no *_init, an MPI-3 library raises: the same on every rank, so
            # every rank takes this path and uses the Ixxx calls.
            return
        self._persistent = requests

    def _start(self, kind: str, fallback: Callable[[], Any]) -> Any:
        request = self._persistent.get(kind)
        if request is None:
            return fallback()
        request.Start()
        return request

    @property
    def mpi_comm(self) -> Any:
        """The duplicated mpi4py communicator (for code that wants raw MPI on mpaccel's world)."""
        return self._comm

    # -- waiting -------------------------------------------------------------------------------

    def _begin(self, what: str, kind: str) -> int:
        if self._broken is not None:
            raise MpaccelError(
                f"cannot run {what}: the communicator is unusable since {self._broken}",
                "a timed-out collective leaves its partners out of step; end the job "
                "(the usual outcome) instead of catching the timeout and carrying on.",
            )
        self._seq += 1
        self._current = (what, self._seq, kind)
        return self._seq

    def _wait(self, request: Any, what: str, timeout: float | None) -> None:
        """Poll `request` to completion; on deadline, diagnose and raise on this rank. Anything
        that ends the wait early (Ctrl-C too) leaves the request pending: the communicator is
        then marked unusable rather than reused with a collective still in flight."""
        try:
            self._poll(request, what, timeout)
        except BaseException as exc:
            if self._broken is None:
                self._broken = f"{what} was interrupted ({type(exc).__name__})"
            raise

    def _poll(self, request: Any, what: str, timeout: float | None) -> None:
        limit = self.default_timeout if timeout is None else float(timeout)
        start = time.monotonic()
        spin_until = start + self.spin_seconds
        test = request.Test
        while time.monotonic() < spin_until:
            if test():
                self._current = None
                return
        deadline = start + limit
        yield_until = start + self.yield_seconds
        every = math.inf  # seconds between questions to another rank (see _check_divergence)
        if self.probe_after is not None and self.size > 1:
            every = self.probe_after
        probe_at = ask_at = start + every
        # presence.answer has nothing to say before then; not calling it keeps short waits cheap
        answer_at = start + self.presence.answer_after
        pause = 2e-5
        while not test():
            self._diagnosis.answer(self._current)
            if self._alerts is not None and self._alerts.waiting():
                if test():  # done after all: the alert is about a later collective
                    break
                self._check_alerts(what)
            now = time.monotonic()
            if now >= answer_at and self._current is not None:
                self.presence.answer(now - start, test, self._current[1])
            if now >= ask_at:
                # again every probe_after: the rank asked may move on, e.g. to the end of the
                # program after abandoning this collective for an error of its own
                self._diagnosis.ask(self._current)
                ask_at = now + every
            if now >= probe_at:
                self._check_divergence(what)
            if now >= deadline:
                self._timed_out(what, limit)
            if now < yield_until:
                os.sched_yield()
                continue
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 1.5, _MAX_SLEEP)
        self._current = None

    def listen(self, alerts: AlertSource | None) -> None:
        """Not collective. Give up waiting in a collective, with PeerFailedError, when `alerts`
        says a rank failed (the pytest plugin hands its alerts to the job's communicator; None
        stops listening). A communicator made with interruptible=False never listens."""
        self._alerts = alerts if self.interruptible else None

    def _check_alerts(self, what: str) -> None:
        assert self._alerts is not None
        alert = self._alerts.poll()
        if alert is None:
            return
        rank, text = alert
        self._broken = f"{what} was abandoned because rank {rank} failed"
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        raise PeerFailedError(
            what,
            {rank: RankFailure(rank, host, "failure", text, "")},
            f"this rank was waiting in {what}, which rank {rank} will never join; see rank "
            f"{rank}'s own report for the cause.",
        )

    def resync(self) -> None:
        """Collective over the parent communicator: replace communicators left out of step by an
        abandoned collective (pytest plugin, between tests). The old ones are leaked on purpose:
        a pending collective request cannot be cancelled."""
        self._comm = self._parent.Dup()
        self._diag = self._parent.Dup()
        self._diagnosis = Diagnosis(self._diag, self.rank, self.size)
        self.presence = Presence(self._comm, self.rank, self.size, lambda: self._seq)
        if self._end is not None:
            self._end = self._parent.Dup()
        self._set_up_persistent()
        self._broken = None
        self._current = None
        self._seq = 0  # numbers count from here again on every rank (see diagnosis.py)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def _check_divergence(self, what: str) -> None:
        """Raise if the rank asked (Diagnosis.ask) waits in a collective that can never match
        this one (Diagnosis.divergence)."""
        error = self._diagnosis.divergence(what, self._current, self.hosts)
        if error is not None:
            self._broken = f"{what} cannot complete: the ranks took different code paths"
            raise error

    def _timed_out(self, what: str, limit: float) -> None:
        error = self._diagnosis.timed_out(what, limit, self._current, self.hosts)
        self._broken = f"{what} timed out"
        raise error

    # -- collectives ---------------------------------------------------------------------------

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        self._begin(what, "barrier")
        self._wait(self._start("barrier", self._comm.Ibarrier), what, timeout)

    def allreduce(
        self, value: int, op: str = "max", what: str = "allreduce", timeout: float | None = None
    ) -> int:
        if op not in self._ops:
            raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(self._ops)}")
        self._begin(what, "allreduce")
        self._send[0] = value
        request = self._start(
            op, lambda: self._comm.Iallreduce(self._send, self._recv, self._ops[op])
        )
        self._wait(request, what, timeout)
        return int(self._recv[0])

    def allgather(self, obj: Any, what: str = "allgather", timeout: float | None = None) -> list:
        self._begin(what, "allgather")
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([payload.size], dtype=np.int64)
        self._wait(self._comm.Iallgather(mine, sizes), what, timeout)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        counts = sizes.tolist()
        request = self._comm.Iallgatherv(payload, [out, counts, offsets.tolist(), self._MPI.BYTE])
        self._wait(request, what, timeout)
        return [pickle.loads(out[o : o + n].tobytes()) for o, n in zip(offsets.tolist(), counts)]

    def gather(
        self, obj: Any, root: int = 0, what: str = "gather", timeout: float | None = None
    ) -> list[Any] | None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for a world of size {self.size}")
        self._begin(what, "gather")
        # The sizes go to every rank (8 bytes each): every rank then waits until all have
        # come, so a rank that never does is named by everyone's timeout, as in allgather; a
        # plain gather would let the others return at once and look absent to the root.
        # The root keeps its own object as it is (nothing pickled for it), as scatter does.
        payload = np.zeros(0, dtype=np.uint8)
        if self.rank != root:
            payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([payload.size], dtype=np.int64)
        self._wait(self._comm.Iallgather(mine, sizes), what, timeout)
        out = np.empty(int(sizes.sum()) if self.rank == root else 0, dtype=np.uint8)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        counts = sizes.tolist()
        receive = [out, counts, offsets, self._MPI.BYTE] if self.rank == root else None
        self._wait(self._comm.Igatherv(payload, receive, root=root), what, timeout)
        if self.rank != root:
            return None
        return [obj if r == root else pickle.loads(out[o : o + n].tobytes())
                for r, (o, n) in enumerate(zip(offsets, counts))]

    def bcast(self, obj: Any, root: int = 0, what: str = "bcast", timeout=None) -> Any:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for a world of size {self.size}")
        self._begin(what, "bcast")
        size = np.zeros(1, dtype=np.int64)
        payload = None
        if self.rank == root:
            payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
            size[0] = payload.size
        self._wait(self._comm.Ibcast(size, root=root), what, timeout)
        if self.rank != root:
            payload = np.empty(int(size[0]), dtype=np.uint8)
        self._wait(self._comm.Ibcast(payload, root=root), what, timeout)
        return obj if self.rank == root else pickle.loads(payload.tobytes())  # type: ignore[union-attr]

    def scatter(
        self,
        objs: Sequence[Any] | None,
        root: int = 0,
        what: str = "scatter",
        timeout: float | None = None,
    ) -> Any:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for a world of size {self.size}")
        if self.rank == root and (objs is None or len(objs) != self.size):
            # Checked before the collective starts; the other ranks then wait for the root.
            raise ValueError(f"scatter needs one object per rank ({self.size}) on the root")
        self._begin(what, "scatter")
        # Sizes first, then every rank's bytes in one Scatterv: each rank receives only its own.
        # The root keeps its own object as it is (nothing pickled for it), as bcast does.
        sizes = np.zeros(self.size, dtype=np.int64)
        payload = np.zeros(0, dtype=np.uint8)
        if self.rank == root:
            assert objs is not None
            parts = [
                b"" if r == root else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                for r, obj in enumerate(objs)
            ]
            sizes[:] = [len(part) for part in parts]
            payload = np.frombuffer(b"".join(parts), np.uint8)
        mine = np.zeros(1, dtype=np.int64)
        self._wait(self._comm.Iscatter(sizes, mine, root=root), what, timeout)
        out = np.empty(int(mine[0]), dtype=np.uint8)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        send = [payload, sizes.tolist(), offsets, self._MPI.BYTE] if self.rank == root else None
        self._wait(self._comm.Iscatterv(send, out, root=root), what, timeout)
        if self.rank == root:
            assert objs is not None
            return objs[root]
        return pickle.loads(out.tobytes())

    def agree(
        self,
        error: BaseException | None,
        what: str,
        timeout: float | None = None,
        kind: type[CollectiveError] = CollectiveError,
    ) -> None:
        failed = self.allreduce(0 if error is None else 1, "max", what, timeout)
        if not failed:
            return
        host = self.hosts[self.rank] if self.hosts else "?"
        mine = None if error is None else failure_of(self.rank, host, error)
        reports = self.allgather(mine, what, timeout)
        failures = {r.rank: r for r in reports if r is not None}
        raise kind(what, failures) from error

    def abort(self, code: int = 1) -> None:
        lifecycle.abort_job(code)

    def finalize(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if not self._MPI.Is_finalized():
            for request in self._persistent.values():
                request.Free()
            self._persistent = {}
            self._MPI.Finalize()
