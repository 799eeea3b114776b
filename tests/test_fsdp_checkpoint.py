"""Checkpoints of fully sharded training through the Accelerator: save_state writes each rank's
rows (the sharded part) beside the rest of the training state; load_state reads them back at
any world size, into FSDP or into DDP / one process, and DDP checkpoints load into FSDP."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from mpaccel import Accelerator
from mpaccel.checkpoint import CheckpointCollectiveError, load_model_state
from mpaccel.testing import reset_state
from mpaccel.utils import ProjectConfiguration

from test_fsdp import GLOBAL_BATCH, Tiny, _data, _plugin

pytestmark = pytest.mark.mpi_timeout(300)


def _accelerator(sharded: bool = True, **kwargs) -> Accelerator:
    reset_state()
    if sharded:
        kwargs["fsdp_plugin"] = _plugin()
    return Accelerator(**kwargs)


def _prepared(acc: Accelerator, seed: int = 1):
    model = Tiny(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // acc.num_processes)
    return acc.prepare(model, opt, loader, sched)


def _steps(acc, model, opt, loader, sched, count: int) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= count:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def _full(acc, model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, whole (a gather: for checking only)."""
    def whole(v):
        return v.full_tensor() if hasattr(v, "full_tensor") else v

    out = {f"model/{k}": whole(v).detach().clone()
           for k, v in acc.unwrap_model(model).state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        out.update({f"optim/{pid}.{k}": whole(v).clone() for k, v in state.items()})
    return out


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_resume_equals_uninterrupted_training(comm, mpi_tmp_path):
    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    lr = sched.get_last_lr()
    after = _steps(acc, model, opt, loader, sched, 2)
    expected = _full(acc, model, opt)

    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc, seed=7)  # other weights, a fresh optimizer
    acc.load_state(directory)
    assert sched.get_last_lr() == lr
    resumed = _steps(acc, model, opt, loader, sched, 2)
    assert resumed == pytest.approx(after, rel=1e-5)
    _close(_full(acc, model, opt), expected)
    index = json.loads((mpi_tmp_path / "ckpt" / "sharded.index.json").read_text())
    slices = index["sliced"]["model_0/blocks.0.fc.weight"]["slices"]
    assert len(slices) == comm.size  # 10 rows: every rank stored its own
    state = json.loads((mpi_tmp_path / "ckpt" / "state.index.json").read_text())
    assert state["metadata"]["sharded"] == index["save_id"]
    assert "model_0" not in state["components"]
