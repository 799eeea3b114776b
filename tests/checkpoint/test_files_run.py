"""How many files of the checkpoint code one DDP save_state / load_state runs (issue 29).

A trace (sys.setprofile, in every thread) records which mpaccel source files execute during one
`accelerator.save_state(dir)` and one `load_state(dir)` of a prepared model, optimizer,
scheduler and loader. Counted: the files of mpaccel/checkpoint/ and the file that holds the
Accelerator's save_state/load_state (the facade's checkpoint methods). Not counted: comm/ and
errors.py (every collective step passes through them) nor what the facade and the saved objects
run of their own (the loader's and optimizer's state_dict, unwrap_model, the state's
properties): the failure message lists those too. The same count holds at size 1 and under
mpiexec -n 2."""

from __future__ import annotations

import inspect
import os
import sys
import threading

import torch
from torch.utils.data import DataLoader, TensorDataset

import mpaccel
from mpaccel import Accelerator

PACKAGE = os.path.dirname(os.path.abspath(mpaccel.__file__))
SAVE_AT_MOST = 11
LOAD_AT_MOST = 12


def _files_run(call) -> list[str]:
    """The mpaccel files (paths inside the package) that run code while `call()` runs."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    inside = {os.path.abspath(f) for f in seen}
    return sorted(
        os.path.relpath(f, PACKAGE) for f in inside if f.startswith(PACKAGE + os.sep)
    )


def _counted(files: list[str], method) -> list[str]:
    """Of `files`, the checkpoint's: checkpoint/ and the file holding the facade's `method`."""
    facade = os.path.relpath(os.path.abspath(inspect.getsourcefile(method)), PACKAGE)
    return [f for f in files if f.startswith("checkpoint" + os.sep) or f == facade]


def _prepared():
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    for x, y in loader:  # one step, so that the optimizer holds state
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        break
    return acc


def test_a_ddp_save_and_load_run_few_checkpoint_files(mpi_tmp_path):
    acc = _prepared()
    directory = os.path.join(str(mpi_tmp_path), "ckpt")
    acc.save_state(directory)  # the first calls import what they need: not measured
    acc.load_state(directory)
    saved = _files_run(lambda: acc.save_state(directory))
    loaded = _files_run(lambda: acc.load_state(directory))
    counted = _counted(saved, Accelerator.save_state)
    assert len(counted) <= SAVE_AT_MOST, (
        f"save_state ran code in {len(counted)} files of the checkpoint (at most "
        f"{SAVE_AT_MOST}): {counted}; all mpaccel files it ran: {saved}"
    )
    counted = _counted(loaded, Accelerator.load_state)
    assert len(counted) <= LOAD_AT_MOST, (
        f"load_state ran code in {len(counted)} files of the checkpoint (at most "
        f"{LOAD_AT_MOST}): {counted}; all mpaccel files it ran: {loaded}"
    )
