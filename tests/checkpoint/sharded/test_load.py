"""A sharded (FSDP2) load_state is all or nothing (checkpoint/sharded_state.py, api.py): a
checkpoint the live objects cannot take is refused on every rank before anything is applied
(model, optimizer state and param groups, scheduler, RNG); and an FSDP save that not every
rank joins is refused before anything is written, naming the ranks that did not join.

Each body runs at size 1 and under mpiexec -n 2 and -n 4 (docs/testing.md)."""

from __future__ import annotations

import copy
import os
import random
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mpaccel import Accelerator
from mpaccel.checkpoint import CheckpointCollectiveError, CheckpointError
from mpaccel.testing import reset_state
from tests.strategy.test_fsdp import GLOBAL_BATCH, Tiny, _data, _plugin

pytestmark = [pytest.mark.mpi_timeout(300), pytest.mark.usefixtures("no_group_left_behind")]


class Bigger(Tiny):
    """Tiny and one layer more, after all of Tiny's: the optimizer's state of Tiny's
    parameters lines up with Tiny's own, only the last layer's is extra."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.out = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(super().forward(x))


def _model(kind: str, seed: int) -> torch.nn.Module:
    """Tiny, or Tiny changed as `kind` says."""
    model = Bigger(seed) if kind == "bigger" else Tiny(seed=seed)
    if kind == "buffer":  # one tensor more, not a parameter
        model.register_buffer("extra", torch.arange(3.0))
    elif kind == "buffer64":  # the same tensor in another dtype
        model.register_buffer("extra", torch.arange(3.0, dtype=torch.float64))
    elif kind == "wide_head":  # another shape
        model.head = torch.nn.Linear(model.head.in_features, 2)
    return model


def _optimizer(model: torch.nn.Module, groups: int) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if groups == 1:
        return torch.optim.AdamW(params, lr=0.01)
    return torch.optim.AdamW([{"params": params[:-2]}, {"params": params[-2:], "lr": 0.02}],
                             lr=0.01)


def _trained(kind: str, groups: int, seed: int, steps: int):
    """A fresh FSDP Accelerator, its prepared objects, after `steps` training steps."""
    reset_state()
    acc = Accelerator(fsdp_plugin=_plugin())
    model = _model(kind, seed)
    opt = _optimizer(model, groups)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // acc.num_processes)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    for i, (x, y) in enumerate(loader):
        if i >= steps:
            break
        acc.backward(torch.nn.functional.mse_loss(model(x)[:, :1], y))
        opt.step()
        sched.step()
        opt.zero_grad()
    return acc, model, opt, sched


def _whole(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _snapshot(acc, model, opt, sched) -> dict:
    """Everything a load could change, as copies (a gather of the shards: checking only)."""
    state = opt.state_dict()
    return {
        "model": {k: _whole(v).detach().clone()
                  for k, v in acc.unwrap_model(model).state_dict().items()},
        "optimizer": {f"{pid}.{k}": _whole(v).clone()
                      for pid, s in state["state"].items() for k, v in s.items()},
        "param_groups": copy.deepcopy(state["param_groups"]),
        "scheduler": copy.deepcopy(sched.state_dict()),
        "rng": (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()),
    }


def _assert_unchanged(now: dict, before: dict) -> None:
    for part in ("model", "optimizer"):
        assert now[part].keys() == before[part].keys(), part
        for key in now[part]:
            assert torch.equal(now[part][key], before[part][key]), f"{part} {key}"
    assert now["param_groups"] == before["param_groups"]
    assert now["scheduler"] == before["scheduler"]
    assert now["rng"][0] == before["rng"][0]
    assert np.array_equal(now["rng"][1], before["rng"][1])
    assert torch.equal(now["rng"][2], before["rng"][2])


CASES = {  # saved (model, param groups), live (model, param groups), the error names
    "a tensor the live model lacks": (("buffer", 1), ("plain", 1), r"'model_0/extra'"),
    "a checkpoint of a bigger model": (("bigger", 1), ("plain", 1), r"'model_0/out\.weight'"),
    "another number of param groups": (("plain", 1), ("plain", 2), r"parameter groups"),
    "a tensor the checkpoint lacks": (("plain", 1), ("buffer", 1), r"'model_0/extra'"),
    "another shape": (("plain", 1), ("wide_head", 1), r"head\.weight"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_sharded_load_changes_nothing_on_any_rank(comm, mpi_tmp_path, case):
    (saved, saved_groups), (live, live_groups), names = CASES[case]
    acc, model, opt, sched = _trained(saved, saved_groups, seed=1, steps=2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    acc, model, opt, sched = _trained(live, live_groups, seed=7, steps=1)
    torch.manual_seed(1234 + comm.rank)  # RNG states other than the checkpoint's
    random.seed(5)
    np.random.seed(6)
    before = _snapshot(acc, model, opt, sched)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointCollectiveError, match=names) as info:
            acc.load_state(directory)
    assert f"rank(s) {', '.join(map(str, range(comm.size)))}" in str(info.value)
    assert not [w for w in warned if "not everything could be given back" in str(w.message)]
    _assert_unchanged(_snapshot(acc, model, opt, sched), before)


def test_another_dtype_is_converted_as_on_the_hdf5_path(comm, mpi_tmp_path):
    """A tensor saved in float32 loads into a float64 one as torch's load_state_dict (and
    the HDF5 path) converts it, on every rank."""
    acc, model, opt, sched = _trained("buffer", 1, seed=1, steps=2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    saved = _snapshot(acc, model, opt, sched)
    acc, model, opt, sched = _trained("buffer64", 1, seed=7, steps=1)
    acc.load_state(directory)
    extra = acc.unwrap_model(model).extra
    assert extra.dtype == torch.float64
    assert torch.equal(extra, saved["model"]["extra"].double())
    now = _snapshot(acc, model, opt, sched)
    for key in saved["optimizer"]:
        assert torch.equal(now["optimizer"][key], saved["optimizer"][key]), key


@pytest.mark.mpi(min_size=2)
def test_an_fsdp_save_by_one_rank_alone_is_refused_before_writing(
        comm, mpi_tmp_path, monkeypatch):
    acc, model, opt, sched = _trained("plain", 1, seed=1, steps=1)
    # a save pre-hook: the refusal comes before it could create the directory
    acc.register_save_state_pre_hook(lambda models, weights, directory: None)
    target = mpi_tmp_path / "ckpt"
    others = ", ".join(map(str, range(1, comm.size)))
    if acc.is_main_process:  # Accelerate's idiom, which a sharded checkpoint cannot follow
        with pytest.raises(CheckpointError, match=rf"rank\(s\) \[{others}\] did not join"):
            acc.save_state(str(target))
    acc.wait_for_everyone()
    assert os.listdir(mpi_tmp_path) == []  # not even the directory
    # the others come late, after rank 0 began alone: they are refused too, not let go
    monkeypatch.setenv("MPACCEL_SOLO_SAVE_WAIT", "0.2")
    if acc.is_main_process:
        with pytest.raises(CheckpointError, match=r"did not join"):
            acc.save_state(str(target))
    else:
        time.sleep(1.0)
        with pytest.raises(CheckpointError, match=r"after another rank began it alone"):
            acc.save_state(str(target))
    acc.wait_for_everyone()
    assert os.listdir(mpi_tmp_path) == []


def test_an_io_error_after_the_checks_gives_back_what_it_can_and_says_what_not(
        comm, mpi_tmp_path, monkeypatch):
    """Past step 1 (everything checked, every rank agreed) only I/O can fail: the last rank's
    in-place read of its rows fails. Every rank raises, gives the scheduler and the optimizer's
    param groups back, leaves the RNG states alone, and warns naming the tensors read in
    place (those of the other ranks may hold the checkpoint's bytes)."""
    from mpaccel.checkpoint.sharded import state as sharded_state

    acc, model, opt, sched = _trained("plain", 1, seed=1, steps=2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    acc, model, opt, sched = _trained("plain", 1, seed=7, steps=1)
    torch.manual_seed(99)
    before = _snapshot(acc, model, opt, sched)
    last = comm.size - 1
    if comm.rank == last:
        def broken(reader, planned):
            raise OSError(5, "Input/output error (injected)")

        monkeypatch.setattr(sharded_state, "fill_plan", broken)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointCollectiveError,
                           match=rf"failed on rank\(s\) {last}:(.|\n)*injected"):
            acc.load_state(directory)
    said = [str(w.message) for w in warned if "could be given back" in str(w.message)]
    assert len(said) == 1, said
    assert "the tensors of model_0, optimizer_0 read in place" in said[0]
    now = _snapshot(acc, model, opt, sched)
    assert now["scheduler"] == before["scheduler"]
    assert now["param_groups"] == before["param_groups"]
    assert torch.equal(now["rng"][2], before["rng"][2])
