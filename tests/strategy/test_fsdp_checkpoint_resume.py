"""save_state under FSDP in the middle of gradient accumulation: the gradients summed so far are
saved as rows of the sharded part (averaged over the ranks and sharded like the parameters, as
the next synchronising backward would have) and loaded back, so that resuming equals training
on uninterrupted."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from mpaccel import Accelerator
from mpaccel.testing import reset_state
from tests.strategy.test_fsdp import GLOBAL_BATCH, Tiny, _data, _plugin
from tests.strategy.test_fsdp_checkpoint import _full

pytestmark = [pytest.mark.mpi_timeout(300), pytest.mark.usefixtures("no_group_left_behind")]

ACCUMULATE = 3


def _prepared(seed: int):
    reset_state()
    acc = Accelerator(fsdp_plugin=_plugin(), gradient_accumulation_steps=ACCUMULATE)
    model = Tiny(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(_data(120), batch_size=GLOBAL_BATCH // acc.num_processes)
    return acc, *acc.prepare(model, opt, loader)


def _micro_batches(acc, model, opt, loader, count: int) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= count:
            break
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def test_resume_mid_accumulation_equals_uninterrupted(comm, mpi_tmp_path):
    acc, model, opt, loader = _prepared(1)
    _micro_batches(acc, model, opt, loader, ACCUMULATE + 2)  # a step, then 2 of the next 3
    assert not acc.sync_gradients  # in the middle of an accumulation
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    after = _micro_batches(acc, model, opt, loader, 1 + ACCUMULATE)  # through 2 more steps
    expected = _full(acc, model, opt)

    acc, model, opt, loader = _prepared(7)  # other weights, a fresh optimizer, no gradients
    acc.load_state(directory)
    resumed = _micro_batches(acc, model, opt, loader, 1 + ACCUMULATE)
    assert resumed == pytest.approx(after, rel=1e-5)
    got = _full(acc, model, opt)
    assert got.keys() == expected.keys()
    for key in got:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    # the summed gradients are rows of the sharded part, not per-rank files
    index = json.loads((mpi_tmp_path / "ckpt" / "sharded.index.json").read_text())
    grads = [k for k in index["sliced"] if k.startswith("gradients_0/")]
    assert "gradients_0/blocks.0.fc.weight" in grads
    slices = index["sliced"]["gradients_0/blocks.0.fc.weight"]["slices"]
    assert len(slices) == comm.size  # 10 rows: every rank stored its own


def test_a_save_at_a_step_boundary_holds_no_gradients(comm, mpi_tmp_path):
    acc, model, opt, loader = _prepared(1)
    _micro_batches(acc, model, opt, loader, ACCUMULATE)
    assert acc.sync_gradients
    acc.save_state(str(mpi_tmp_path / "ckpt"))
    index = json.loads((mpi_tmp_path / "ckpt" / "sharded.index.json").read_text())
    assert not [k for k in index["sliced"] if k.startswith("gradients_")]


def _reference_gradients() -> dict[str, torch.Tensor]:
    """The gradients after ACCUMULATE + 2 micro-batches, computed by plain torch in one process
    on the global batches (the loss of each divided by ACCUMULATE, as accumulate() does)."""
    model = Tiny(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = _data(120).tensors
    for i in range(ACCUMULATE + 2):
        rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / ACCUMULATE).backward()
        if i + 1 == ACCUMULATE:
            opt.step()
            opt.zero_grad()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


SCRIPT = """
import sys
sys.path.insert(0, ROOT_DIR)
import torch
import tests.strategy.test_fsdp_checkpoint_resume as t

mode, directory = sys.argv[1], sys.argv[2]
acc, model, opt, loader = t._prepared(1 if mode == "save" else 7)
if mode == "save":
    t._micro_batches(acc, model, opt, loader, t.ACCUMULATE + 2)
    acc.save_state(directory)  # p.grad is None: FSDP holds the pending gradients unreduced
    print("saved", acc.num_processes, flush=True)
    sys.exit(0)
acc.load_state(directory)
expected = t._reference_gradients()
for name, p in acc.unwrap_model(model).named_parameters():
    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
print(mode, acc.num_processes, "gradients equal", flush=True)
"""


@pytest.mark.launches
@pytest.mark.mpi(size=1)  # nests mpiexec
@pytest.mark.mpi_timeout(900)
def test_gradients_saved_at_4_load_at_1_and_3(tmp_path):
    from pathlib import Path

    from mpaccel.testing import run_mpi

    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("ROOT_DIR", repr(str(Path(__file__).parents[2]))))
    directory = str(tmp_path / "ckpt")
    run = run_mpi([str(script), "save", directory], n=4, timeout=300).check()
    assert "saved 4" in run.stdout[0], run.describe()
    for n in (1, 3):  # whole, and split unevenly across the saved shards' bounds
        run = run_mpi([str(script), "load", directory], n=n, timeout=300).check()
        assert f"load {n} gradients equal" in run.stdout[0], run.describe()
