"""Names Accelerate's own examples import and call beyond the specification documents:
set_seed, send_to_device, LoggerType, get_state_dict, the accelerate.data_loader module path."""

from __future__ import annotations

import collections
import importlib.util
import random

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader

from mpaccel import Accelerator
from mpaccel.errors import ConfigurationError
from mpaccel.testing import reset_state
from mpaccel.utils import LoggerType, send_to_device, set_seed


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_set_seed_seeds_python_numpy_and_torch(comm):
    set_seed(1234)
    first = _draws()
    set_seed(1234)
    assert _draws() == first
    assert len(set(comm.allgather(first))) == 1  # the same on every rank
    reset_state()
    set_seed(1234, device_specific=True)
    mine = _draws()
    assert len(set(comm.allgather(mine))) == comm.size  # one stream per rank
    assert (mine == first) == (comm.rank == 0)
    set_seed(2**40 + 3)  # larger than numpy's 32-bit seeds
    was = torch.are_deterministic_algorithms_enabled()
    try:
        set_seed(1, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)


class Encoding(collections.UserDict):
    """Like a tokenizer's BatchEncoding: a mapping with its own .to(), without non_blocking."""

    moved_to: list = []

    def to(self, device):
        Encoding.moved_to.append(str(device))
        return Encoding({k: v.to(device) for k, v in self.data.items()})


def test_send_to_device_keeps_types_and_skips_keys():
    Point = collections.namedtuple("Point", "x y")
    t = torch.ones(2)
    data = {
        "a": [t, (t, "text")],
        "p": Point(t, 3),
        "skip": t,
        "enc": Encoding(ids=t),
        "n": None,
    }
    out = send_to_device(data, "cpu", non_blocking=True, skip_keys="skip")
    assert type(out["a"]) is list and type(out["a"][1]) is tuple and out["a"][1][1] == "text"
    assert type(out["p"]) is Point and out["p"].y == 3
    assert out["skip"] is t and out["n"] is None
    assert isinstance(out["enc"], Encoding) and Encoding.moved_to[-1] == "cpu"
    assert send_to_device([t], torch.device("cpu"), skip_keys=["x"])[0].device.type == "cpu"


def test_the_prepared_loader_moves_batches_with_their_own_to(comm):
    # A data collator's BatchEncoding batch goes to the device through its .to() (it was left
    # where it was: not a dict).
    reset_state()
    acc = Accelerator()
    Encoding.moved_to.clear()
    loader = acc.prepare(
        DataLoader(list(range(4 * comm.size)), batch_size=2, collate_fn=lambda s: Encoding(
            ids=torch.tensor(s)))
    )
    batches = list(loader)
    assert all(isinstance(b, Encoding) for b in batches)
    assert len(Encoding.moved_to) == len(batches)


def test_logger_type_names_the_trackers(comm, tmp_path):
    assert LoggerType.TENSORBOARD == "tensorboard" and str(LoggerType.ALL) == "all"
    reset_state()
    with pytest.raises(ConfigurationError, match="unknown tracker"):
        Accelerator(log_with=[LoggerType.TENSORBOARD, "tensorbored"])
    if importlib.util.find_spec("tensorboard") is None:
        return
    reset_state()
    acc = Accelerator(log_with=[LoggerType.TENSORBOARD], project_dir=str(tmp_path))
    acc.init_trackers("run")
    acc.log({"x": 1.0}, step=0)
    assert acc.get_tracker("tensorboard") is not None
    acc.end_training()


def test_get_state_dict_is_the_unwrapped_models(comm):
    reset_state()
    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    state = acc.get_state_dict(model)
    assert list(state) == ["0.weight", "0.bias"]  # no "module." from DDP at size > 1
    assert torch.equal(state["0.weight"], acc.unwrap_model(model)[0].weight)
    wrapped = acc.get_state_dict(model, unwrap=False)
    prefix = "module." if comm.size > 1 else ""
    assert list(wrapped) == [f"{prefix}0.weight", f"{prefix}0.bias"]


def test_the_data_loader_module_path(comm):
    import mpaccel
    from mpaccel.data_loader import BatchSamplerShard, DataLoaderShard, skip_first_batches

    assert skip_first_batches is mpaccel.skip_first_batches
    shard = BatchSamplerShard(BatchSampler(range(10), 2, False), 2, 1)
    assert list(shard) == [[2, 3], [6, 7], [0, 1]]  # rank 1 of 2; the last round evened out
    reset_state()
    loader = Accelerator().prepare(DataLoader(list(range(4)), batch_size=2))
    assert type(loader) is DataLoaderShard


def test_tqdm_shows_one_bar_per_node(comm, capsys):
    pytest.importorskip("tqdm")
    from mpaccel.state import PartialState
    from mpaccel.utils import tqdm

    reset_state()
    local = PartialState().local_process_index
    assert list(tqdm(range(3), desc="steps")) == [0, 1, 2]
    shown = "steps" in capsys.readouterr().err
    assert shown == (local == 0)
    assert tqdm(range(3)).disable == (local != 0)
    assert not tqdm(range(3), main_process_only=False).disable
    assert tqdm(range(3), disable=True).disable
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))


@pytest.mark.mpi_timeout(60)  # without Join the ranks with more batches hang in DDP
def test_join_uneven_inputs_trains_on_batches_that_do_not_divide_evenly(comm):
    """even_batches=False inside the block: each rank takes only its own batches (the last
    ranks one fewer), and Join keeps the ranks that ran out answering DDP's all-reduces: no
    hang, every sample seen once, the parameters the same on every rank."""
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples = 2 * comm.size + 1  # one more than an even split
    data = [torch.tensor([float(i), 1.0]) for i in range(samples)]
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=1))
    seen = []
    with acc.join_uneven_inputs([model], even_batches=False):
        for batch in loader:
            seen += batch[:, 0].tolist()
            optimizer.zero_grad()
            acc.backward(model(batch).sum())
            optimizer.step()
    assert loader.sharding.even_batches is True  # restored after the block
    everyone = sorted(x for part in comm.allgather(seen) for x in part)
    assert everyone == [float(i) for i in range(samples)]  # once each, none repeated
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert all(torch.equal(weights, w) for w in comm.allgather(weights))
    assert len(list(loader)) == -(-samples // comm.size)  # even again outside the block


@pytest.mark.mpi(min_size=2)
def test_join_uneven_inputs_warns_about_gradient_accumulation(comm):
    """Join cannot pair DDP's all-reduces when a rank that ran out synchronised early under
    accumulation: that combination hung until the timeout without a word."""
    reset_state()
    acc = Accelerator(gradient_accumulation_steps=2)
    model = acc.prepare(torch.nn.Linear(2, 1))
    with pytest.warns(RuntimeWarning, match="with gradient accumulation"):
        with acc.join_uneven_inputs([model], even_batches=False):
            pass


def test_autocast_kwargs(comm):
    """AutocastKwargs in kwargs_handlers reach the prepared model's autocast and
    accelerator.autocast(); autocast(autocast_handler=...) sets them for one block."""
    from mpaccel.utils import AutocastKwargs

    def layer_dtypes(handlers):
        reset_state()
        acc = Accelerator(mixed_precision="bf16", kwargs_handlers=handlers)
        model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        seen = []  # what the layer inside computes in (the model's output is made float32)
        acc.unwrap_model(model)[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        assert model(torch.ones(2, 4)).dtype == torch.float32
        return acc, seen

    acc, seen = layer_dtypes([AutocastKwargs(enabled=False)])
    assert seen == [torch.float32]  # autocast disabled
    with acc.autocast():
        assert not torch.is_autocast_enabled("cpu")
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=True)):
        assert torch.is_autocast_enabled("cpu")
        assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).dtype == torch.bfloat16
    acc, seen = layer_dtypes(None)
    assert seen == [torch.bfloat16]  # by default the layer runs in bf16
