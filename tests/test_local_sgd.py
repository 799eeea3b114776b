"""mpaccel.local_sgd.LocalSGD: ranks step on their own gradients (DDP in no_sync) and average
their parameters every `local_sgd_steps` steps. The same bodies at size 1 and under mpiexec."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mpaccel import Accelerator
from mpaccel.errors import ConfigurationError
from mpaccel.local_sgd import LocalSGD
from mpaccel.testing import reset_state
from mpaccel.utils import DistributedType
from tests.conftest import params


def _setup(lr=0.1):
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 * acc.num_processes, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=4))
    return acc, model, opt, loader


def test_parameters_drift_between_averages_and_agree_after(comm):
    acc, model, opt, loader = _setup()
    steps = 3
    agreed = []  # after each step: were the parameters the same on every rank?
    with LocalSGD(acc, model, local_sgd_steps=steps) as local_sgd:
        assert local_sgd.enabled == (comm.size > 1)
        for x, y in loader:
            before = params(model)
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            local_sgd.step()
            mine = params(model)
            assert not torch.equal(mine, before)
            agreed.append(all(torch.equal(mine, other) for other in comm.allgather(mine)))
            if len(agreed) == 2 * steps + 1:
                break
    final = params(model)
    assert all(torch.equal(final, other) for other in comm.allgather(final))  # on leaving
    if comm.size == 1:
        assert all(agreed) and local_sgd.num_steps == 2 * steps + 1
        return
    # each rank its own gradients (no all-reduce), then the average every `steps` steps
    assert agreed == [False, False, True, False, False, True, False]


def test_the_average_is_the_mean_over_ranks(comm):
    acc, model, _, _ = _setup()
    with LocalSGD(acc, model, local_sgd_steps=1) as local_sgd:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(comm.rank))
        local_sgd.step()
    mean = sum(range(comm.size)) / comm.size
    assert all(torch.allclose(p, torch.full_like(p, mean)) for p in model.parameters())


def test_gradients_are_not_all_reduced_inside(comm):
    acc, model, _, _ = _setup()
    x = torch.full((2, 4), float(comm.rank + 1))
    with LocalSGD(acc, model, local_sgd_steps=100):
        model(x).sum().backward()
    grad = acc.unwrap_model(model)[0].weight.grad
    everyone = comm.allgather(grad)
    assert len({tuple(g.reshape(-1).tolist()) for g in everyone}) == comm.size
    model.zero_grad()
    model(x).sum().backward()  # outside the block DDP all-reduces again
    everyone = comm.allgather(acc.unwrap_model(model)[0].weight.grad)
    assert all(torch.equal(everyone[0], g) for g in everyone)


def test_disabled_or_misconfigured(comm):
    acc, model, opt, loader = _setup()
    with LocalSGD(acc, model, local_sgd_steps=2, enabled=False) as local_sgd:
        assert not local_sgd.enabled
        x = torch.full((2, 4), float(comm.rank + 1))
        model(x).sum().backward()  # DDP all-reduces: not in no_sync
        local_sgd.step()
    everyone = comm.allgather(acc.unwrap_model(model)[0].weight.grad)
    assert all(torch.equal(everyone[0], g) for g in everyone)
    with pytest.raises(ConfigurationError, match="local_sgd_steps"):
        LocalSGD(acc, model, local_sgd_steps=0)
    acc.state.distributed_type = DistributedType.DEEPSPEED
    try:
        with pytest.raises(ConfigurationError, match="HINT"):
            LocalSGD(acc, model, local_sgd_steps=2)
    finally:
        del acc.state.distributed_type


def test_an_error_inside_skips_the_final_average(comm):
    """The other ranks would wait in the average for a rank that is unwinding."""
    acc, model, _, _ = _setup()
    calls = []
    local_sgd = LocalSGD(acc, model, local_sgd_steps=5)
    local_sgd._sync_and_avg_model_params = lambda: calls.append(1)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        with local_sgd:
            raise RuntimeError("boom")
    assert calls == []
    with local_sgd:
        pass
    assert calls == ([1] if comm.size > 1 else [])
    x = torch.ones(2, 4)  # no longer in no_sync: DDP all-reduces
    model(x * (comm.rank + 1)).sum().backward()
    everyone = comm.allgather(acc.unwrap_model(model)[0].weight.grad)
    assert all(torch.equal(everyone[0], g) for g in everyone)
