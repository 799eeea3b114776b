"""mpaccel.comm.presence seen from MPIComm's wait loop: a wait answers the presence handshake
(of saves made by one rank alone) only once it has lasted `presence.answer_after`, so the short
waits of the common path pay nothing for it. Under mpiexec -n 2 / -n 4 (a world of one has no
wait loop); the saves themselves are tested in tests/checkpoint/test_compat.py."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.openmpi, pytest.mark.mpi(min_size=2)]


def _waits_answering(state, monkeypatch, answer_after: float, late: float) -> list[float]:
    """Rank 1 comes `late` seconds after the others to a barrier; returns how long this rank
    had waited at each call of presence.answer (every rank gives its list to every rank)."""
    c = state.comm
    presence = c.presence
    answer = presence.answer
    calls: list[float] = []

    def counting(waited, done, at):
        calls.append(waited)
        return answer(waited, done, at)

    monkeypatch.setattr(presence, "answer", counting)
    monkeypatch.setattr(presence, "answer_after", answer_after)
    state.wait_for_everyone()
    calls.clear()
    if state.process_index == 1:
        time.sleep(late)
    c.barrier("the barrier rank 1 comes late to")
    return calls


def test_a_short_wait_does_not_answer_the_presence_handshake(state, monkeypatch):
    calls = _waits_answering(state, monkeypatch, answer_after=3600.0, late=0.05)
    assert calls == []


def test_a_long_wait_answers_the_presence_handshake(state, monkeypatch):
    calls = _waits_answering(state, monkeypatch, answer_after=0.01, late=0.3)
    if state.process_index != 1:  # the ranks that waited for rank 1
        assert calls and min(calls) >= 0.01
