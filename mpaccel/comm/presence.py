"""Is every rank here? A non-blocking presence handshake, for calls that are collective when
every rank makes them and may also be made by one rank alone (Accelerate's `if
accelerator.is_main_process: accelerator.save_model(...)`). No collective: point-to-point
messages on a tag of their own, which never match a collective nor another rank's traffic.

A rank entering such a call (`who`):

1. reads what its peers sent it and drops every exchange that ended (a HERE followed by that
   peer's decision); if one of them was a peer that gave up on this same call (same key)
   while this rank was busy (it did not turn it away), and the peer is not in a newer one,
   this rank came late and that peer wrote the result alone: OTHERS, at once;
2. sends HERE (its own sequence number, the key) to every peer and waits for a HERE from each,
   for at most `wait` seconds; a peer that waits in a collective of this communicator
   (wait_for_everyone, the end of the program...) that this rank has not begun cannot come,
   and says so at once (AWAY, `answer`, called from MPIComm's wait loop, naming the
   collective's number), so the usual idiom is decided in milliseconds;
3. with every HERE it sends READY, then reads each peer's decision: all READY -> COLLECTIVE;
   a WITHDRAW -> OTHERS (the withdrawing rank writes the result);
4. when a peer is AWAY, or `wait` passes, it sends WITHDRAW to every peer: ALONE.

Ranks that all make the call agree on COLLECTIVE unless one arrives more than `wait` seconds
after another while computing (not waiting in a collective): the first then does it ALONE and
the late ones, seeing its WITHDRAW for the same key, return: one result, never a hang.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

TAG = 23166  # point-to-point only, on the communicator's own duplicate
HERE, READY, WITHDRAW, AWAY = 1, 2, 3, 4
COLLECTIVE, ALONE, OTHERS = "collective", "alone", "others"
# A rank answers AWAY once it has waited this long in a collective: a collective that is about
# to complete (its last message in flight) must not turn away a rank that is on its way.
_GRACE = 0.05


class Presence:
    """One communicator's side of the handshake. Not collective: `who` is called by the ranks
    entering a call, `answer` by ranks waiting in a collective."""

    def __init__(self, comm: Any, rank: int, size: int, position: Callable[[], int]) -> None:
        """`position()`: how many collectives this rank has begun on the communicator (the
        same count on every rank for the same collective)."""
        self._comm = comm
        self._position = position
        self.rank = rank
        self.size = size
        self._seq = 0
        # (kind, seq, key) per peer, in MPI's order (kept between two ranks on one tag)
        self._inbox: dict[int, deque[tuple[int, int, str]]] = {}
        self._away: dict[int, int] = {}  # peer -> the sequence number of ours it turned away
        self._sends: list[Any] = []
        self._answered: set[tuple[int, int]] = set()
        # Seconds into a wait before `answer` has anything to do: the wait loop calls it only
        # from then on, so that the short waits of the common path pay neither a call nor a
        # probe (docs/benchmarks.md, "Control plane: the presence answer"). Never at size 1.
        self.answer_after = math.inf if size == 1 else _GRACE

    def _drain(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while self._comm.Iprobe(MPI.ANY_SOURCE, TAG, status):
            source = status.Get_source()
            message = self._comm.recv(source=source, tag=TAG)
            if message[0] != AWAY:
                self._inbox.setdefault(source, deque()).append(message)
            elif int(message[2]) > self._position():
                # from a rank in a collective this one has not begun; one in a collective this
                # rank has finished already is merely behind, on its way here
                self._away[source] = message[1]

    def _send(self, kind: int, seq: int, key: str, peers: list[int]) -> None:
        self._sends = [request for request in self._sends if not request.Test()]
        self._sends.extend(
            self._comm.isend((kind, seq, key), dest=peer, tag=TAG) for peer in peers
        )

    def answer(self, waited: float, done: Callable[[], bool], at: int) -> None:
        """Called while this rank waits in collective number `at` for `waited` seconds
        (`done()` tests it), at least `answer_after`: tell each rank that is waiting for it in
        a presence handshake that it will not come (the asker ignores it if it has finished
        that collective)."""
        if waited < self.answer_after:
            return
        self._drain()
        waiting = [
            (peer, box[-1][1]) for peer, box in self._inbox.items()
            # the last HERE without a decision after it: that peer waits now
            if box and box[-1][0] == HERE and (peer, box[-1][1]) not in self._answered
        ]
        # Reading the messages moved MPI on: the collective may be complete now, and this rank
        # on its way to the same save as the asking one (a broadcast's root leaves first).
        if not waiting or done():
            return
        for peer, seq in waiting:
            self._answered.add((peer, seq))
            self._send(AWAY, seq, str(at), [peer])

    def _ended(self, peer: int, key: str) -> bool:
        """Drop `peer`'s finished exchanges; True if the last one gave up on `key` and the peer
        is in no newer exchange (it wrote this call's result alone). Not when this rank turned
        that exchange away (AWAY): it was elsewhere then, so that was another save (the main
        process saving alone earlier into the same place)."""
        box = self._inbox.get(peer)
        gave_up = False
        while box and len(box) >= 2 and box[0][0] == HERE and box[1][0] != HERE:
            here, decision = box.popleft(), box.popleft()
            gave_up = (decision[0] == WITHDRAW and here[2] == key
                       and (peer, here[1]) not in self._answered)
        while box and box[0][0] != HERE:  # a decision whose HERE was taken already
            box.popleft()
        return gave_up and not box

    def who(self, key: str, wait: float) -> str:
        """COLLECTIVE, ALONE or OTHERS for the call named `key` (see the module docstring)."""
        if self.size == 1:
            return COLLECTIVE
        others = [r for r in range(self.size) if r != self.rank]
        self._drain()
        if [peer for peer in others if self._ended(peer, key)]:
            return OTHERS  # sends nothing: this rank took no part in that exchange
        self._seq += 1
        seq = self._seq
        self._send(HERE, seq, key, others)
        deadline = time.monotonic() + wait
        pause = 2e-5
        while True:
            self._drain()
            states = [self._state(peer) for peer in others]
            if WITHDRAW in states:  # a peer does it alone; tell those waiting for this rank
                self._send(WITHDRAW, seq, key, others)
                return OTHERS
            if None not in states:
                break
            away = any(self._away.get(peer) == seq for peer in others)
            if away or time.monotonic() >= deadline:
                self._send(WITHDRAW, seq, key, others)
                return ALONE
            time.sleep(pause)
            pause = min(pause * 1.5, 0.005)
        self._send(READY, seq, key, others)
        # Each peer that sent HERE decides within its own wait: READY, or WITHDRAW.
        decisions: dict[int, int] = {}
        pause = 2e-5
        while True:
            self._drain()
            for peer in others:
                found = self._state(peer)
                if peer not in decisions and found in (READY, WITHDRAW):
                    decisions[peer] = found
                    self._inbox[peer].popleft()
                    self._inbox[peer].popleft()
            if len(decisions) == len(others):
                break
            time.sleep(pause)
            pause = min(pause * 1.5, 0.005)
        return COLLECTIVE if all(d == READY for d in decisions.values()) else OTHERS

    def _state(self, peer: int) -> int | None:
        """None (no HERE yet), HERE (present, undecided) or its decision (READY, WITHDRAW)."""
        box = self._inbox.get(peer)
        if not box:
            return None
        return box[1][0] if len(box) >= 2 else HERE
