"""Preemption handling without Slurm: the requeue id, `scontrol requeue` success and refusal
(a stand-in scontrol on PATH), and signals turned into one collective decision. The round trip
on a real Slurm is in environments/test_slurm.py."""

from __future__ import annotations

import os
import signal
import stat

import pytest
import torch

from mpaccel import Accelerator
from mpaccel import preemption as slurm_support
from mpaccel.testing import reset_state
from mpaccel.utils import gather_object


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"SLURM_JOB_ID": "812"}, "812"),
        ({"SLURM_JOB_ID": "815", "SLURM_ARRAY_JOB_ID": "812", "SLURM_ARRAY_TASK_ID": "3"}, "812_3"),
        ({}, None),
    ],
)
def test_job_id_for_requeue(env, expected):
    assert slurm_support.job_id_for_requeue(env) == expected


def _fake_scontrol(tmp_path, monkeypatch, exit_code: int, message: str = ""):
    log = tmp_path / "calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "{message}" >&2\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    return log


@pytest.mark.mpi(size=1)
def test_requeue_asks_scontrol_for_the_array_task(tmp_path, monkeypatch):
    log = _fake_scontrol(tmp_path, monkeypatch, 0)
    env = {"SLURM_JOB_ID": "815", "SLURM_ARRAY_JOB_ID": "812", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm_support.requeue(env) is True
    assert log.read_text().split() == ["requeue", "812_3"]


@pytest.mark.mpi(size=1)
def test_a_refused_requeue_warns_with_a_hint(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, monkeypatch, 1, "Requested operation is presently disabled")
    with pytest.warns(RuntimeWarning, match="presently disabled.*--requeue"):
        assert slurm_support.requeue({"SLURM_JOB_ID": "812"}) is False
    with pytest.warns(RuntimeWarning, match="not in a Slurm job"):
        assert slurm_support.requeue({}) is False


@pytest.mark.parametrize("accumulation", [1, 3])
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(comm, accumulation):
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=accumulation)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.handle_preemption()
    signalled_rank, signal_at = acc.num_processes - 1, 4
    try:
        stopped_at = None
        for batch in range(1, 20):
            if acc.process_index == signalled_rank and batch == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # Slurm's wall-time / preemption signal
            with acc.accumulate(model):
                acc.backward(model(torch.randn(2, 4)).sum())
                opt.step()
                opt.zero_grad()
            if acc.should_stop():
                stopped_at = batch
                break
    finally:
        acc._preemption.uninstall()
    # the first optimizer-step boundary at or after the signal: never mid-accumulation
    expected = -(-signal_at // accumulation) * accumulation
    assert stopped_at == expected
    assert gather_object([stopped_at]) == [expected] * acc.num_processes
    assert acc.preempted == ("SIGTERM" if acc.process_index == signalled_rank else None)
