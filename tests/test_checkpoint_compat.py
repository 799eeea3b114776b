"""Checkpoints as Hugging Face tooling and Accelerate scripts expect them (issue 21): the
safetensors layout of save_model, saves by the main process alone, a directory per rank, and
load_state on a directory Accelerate wrote. The bodies run at size 1 and under mpiexec -n 2."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch

from mpaccel import Accelerator
from mpaccel.testing import reset_state

safetensors_torch = pytest.importorskip("safetensors.torch")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )


def test_a_directory_per_rank_uses_rank_0s(comm):
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model())
    with tempfile.TemporaryDirectory() as mine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.save_state(mine)
            saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            acc.load_state(mine)
        named = [str(w.message) for w in caught if "different directories" in str(w.message)]
        if acc.num_processes > 1:
            # one for the save, one for the load; rank 0 names every rank that passed another
            # path, the others name themselves
            assert [m.split(":")[0] for m in named] == ["save_state", "load_state"], named
            assert all(f"rank {max(1, acc.process_index)} passed" in m for m in named), named
            written = os.path.exists(os.path.join(mine, "state.index.json"))
            assert written == acc.is_main_process
        else:
            assert named == []
        assert all(torch.equal(v, saved[k])
                   for k, v in acc.unwrap_model(model).state_dict().items())
        acc.wait_for_everyone()  # rank 0's directory outlives the others' loads
