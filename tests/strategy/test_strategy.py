"""mpaccel.strategy: AcceleratorState picks one strategy, the Accelerator holds it and asks it, and
each strategy wraps, unwraps, synchronises, clips and gives state as prepare() did before it was
one (DDP or the model itself; FSDP2 over the mesh). Runs at every world size."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

import pytest
import torch

import mpaccel.accelerator
from mpaccel import Accelerator, PartialState
from mpaccel.checkpoint import TrainingState
from mpaccel.errors import CheckpointError, ConfigurationError
from mpaccel.strategy import DataParallel, FullySharded, Strategy, choose_plugin
from mpaccel.strategy.fully_sharded import (
    OptimizerState,
    SummedGradients,
    mixed_precision_policy,
)
from mpaccel.testing import reset_state
from mpaccel.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig
from tests.strategy.test_fsdp import Tiny


def plugin(**fields) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"], **fields
    )


def _accelerator(**kwargs) -> Accelerator:
    reset_state()
    return Accelerator(**kwargs)


def _grads(model: torch.nn.Module) -> None:
    model(torch.ones(4, 6)).sum().backward()


# -- choosing ------------------------------------------------------------------------------------


def test_without_a_plugin_the_strategy_is_data_parallel():
    acc = _accelerator()
    assert isinstance(acc.strategy, DataParallel)
    assert acc.strategy is acc.state.strategy
    assert acc.state.device_mesh is None and acc.strategy.mesh is None
    assert acc.distributed_type is PartialState().distributed_type  # the process's own
    assert (acc.strategy.data_parallel_size, acc.strategy.data_parallel_rank) == (
        acc.num_processes,
        acc.process_index,
    )


@pytest.mark.usefixtures("no_group_left_behind")
def test_with_a_plugin_the_strategy_is_fully_sharded_over_the_state_mesh():
    acc = _accelerator(fsdp_plugin=plugin())
    assert isinstance(acc.strategy, FullySharded)
    assert acc.distributed_type == DistributedType.FSDP
    assert acc.strategy.mesh is acc.state.device_mesh is not None
    assert acc.strategy.plugin is acc.state.fsdp_plugin
    assert acc.strategy.data_parallel_size == acc.num_processes  # every rank reads its batches
    assert acc.strategy.mesh_rank("dp_shard") == acc.process_index


def test_the_facade_holds_no_strategy_of_its_own_and_never_asks_which():
    acc = _accelerator()
    assert "strategy" not in vars(acc)  # the state's, one per job
    assert pickle.loads(pickle.dumps(acc)).strategy is acc.strategy
    source = inspect.getsource(mpaccel.accelerator)
    for question in ("DistributedType.FSDP", "fsdp_plugin is", "isinstance(self.strategy"):
        assert question not in source


def test_choose_plugin_refuses_a_mesh_without_a_plugin_and_wrong_types():
    assert choose_plugin(None, None) is None
    given = plugin()
    assert choose_plugin(given, None) is given
    with pytest.raises(ConfigurationError, match="no fsdp_plugin was given"):
        choose_plugin(None, ParallelismConfig(dp_shard_size=2))
    with pytest.raises(ConfigurationError, match="fsdp_plugin must be a"):
        choose_plugin(object(), None)


def test_the_base_strategy_is_the_protocol():
    for name in ("place", "no_sync", "clip_grad_norm_"):
        assert getattr(DataParallel, name) is not getattr(Strategy, name)
        assert getattr(FullySharded, name) is not getattr(Strategy, name)


# -- DataParallel: what prepare() did without a plugin -------------------------------------------


def test_data_parallel_wraps_in_ddp_on_several_ranks_only(comm):
    acc = _accelerator()
    model = acc.prepare(Tiny())
    wrapped = type(model).__name__ == "DistributedDataParallel"
    assert wrapped == (comm.size > 1)
    assert acc.strategy.is_prepared(model) == wrapped
    assert acc.unwrap_model(model) is (model.module if wrapped else model)
    frozen = Tiny().requires_grad_(False)
    assert acc.prepare_model(frozen) is frozen  # nothing trains: nothing to synchronise


def test_data_parallel_no_sync_keeps_gradients_local_and_clips_as_torch(comm):
    acc = _accelerator()
    model = acc.prepare(Tiny(seed=comm.rank + 1))
    with acc.no_sync(model):
        model(torch.full((4, 6), float(comm.rank))).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    mine = Tiny(seed=comm.rank + 1)
    mine.load_state_dict(acc.unwrap_model(model).state_dict())
    mine(torch.full((4, 6), float(comm.rank))).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(local, mine.parameters()))
    expected = torch.nn.utils.clip_grad_norm_(mine.parameters(), 0.5)
    assert torch.equal(acc.clip_grad_norm_(model.parameters(), 0.5), expected)


def test_data_parallel_state_is_whole_and_no_checkpoint_entry_is_sharded():
    acc = _accelerator()
    model = acc.prepare(Tiny())
    inner = acc.unwrap_model(model)
    whole = acc.strategy.full_state_dict(inner, everywhere=False)
    assert whole.keys() == Tiny().state_dict().keys()
    assert acc.get_state_dict(model).keys() == whole.keys()
    assert not acc.strategy.is_sharded(inner) and acc.strategy.tied_aliases(inner) == set()
    assert acc.strategy.checkpoint_entries({"model_0": inner}, {}, loading=False) == {}
    with pytest.raises(NotImplementedError, match="shards no model"):
        acc.strategy.summed_gradients(inner, None)


# -- FullySharded: what prepare() did with a plugin ----------------------------------------------


@pytest.mark.usefixtures("no_group_left_behind")
def test_fully_sharded_shards_in_place_and_repoints_the_optimizer(comm):
    from torch.distributed.tensor import DTensor

    acc = _accelerator(fsdp_plugin=plugin())
    original = Tiny()
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, opt = acc.prepare(model, optimizer)
    assert prepared is model and acc.strategy.is_prepared(model)
    assert acc.unwrap_model(prepared) is model
    params = [p for group in opt.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert all(isinstance(p, DTensor) for p in params)
    whole = acc.strategy.full_state_dict(model, everywhere=True)
    assert all(torch.equal(whole[k], v) for k, v in original.state_dict().items())
    assert acc.strategy.is_sharded(model)
    assert acc.strategy.sharded_state_dict(model).keys() == whole.keys()
    entries = acc.strategy.checkpoint_entries({"model_0": model}, {"optimizer_0": opt}, False)
    assert entries["model_0"] is model and isinstance(entries["optimizer_0"], OptimizerState)
    # mid-accumulation gradients: the strategy's Stateful, whose rows are sharded as the params
    _grads(model)
    grads = acc.strategy.summed_gradients(model, None)
    assert isinstance(grads, SummedGradients)
    state = grads.state_dict()
    assert state.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(isinstance(g, DTensor) for g in state.values())
    # a TrainingState without the strategy's callable refuses, rather than drop them
    objects = TrainingState(sharded={"model_0": model}, gradients={"gradients_0": model})
    assert objects.sharded_gradients() == {"gradients_0": model}
    with pytest.raises(CheckpointError, match="summed_gradients"):
        objects.gradient_rows(model, None)


@pytest.mark.usefixtures("no_group_left_behind")
def test_fully_sharded_clips_the_whole_models_norm(comm):
    acc = _accelerator(fsdp_plugin=plugin())
    model = acc.prepare(Tiny())
    _grads(model)
    reference = Tiny()
    _grads(reference)
    # every rank computed the same gradients: FSDP's reduce-scatter averages them
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    norm = acc.clip_grad_norm_(model.parameters(), 0.1)
    assert type(norm) is torch.Tensor
    torch.testing.assert_close(norm, expected)
    calls = []
    model.set_requires_gradient_sync = calls.append  # FSDPModule's switch, on this instance
    with acc.no_sync(model):  # off inside, on again after
        assert calls == [False]
    assert calls == [False, True]


def test_the_plugin_keeps_its_precision_policy_and_the_strategy_builds_torchs():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    given = plugin(mixed_precision_policy="bf16")
    built = mixed_precision_policy(given.mixed_precision_policy)
    assert isinstance(built, MixedPrecisionPolicy)
    assert (built.param_dtype, built.reduce_dtype, built.output_dtype) == (torch.bfloat16,) * 3
    assert mixed_precision_policy(None) is None
    again = plugin(mixed_precision_policy=built)  # torch's own policy is accepted as before
    assert again.mixed_precision_policy == given.mixed_precision_policy


@pytest.mark.launches
def test_configuring_fsdp_and_training_ddp_import_no_torch_fsdp():
    body = (
        "import sys; from mpaccel.utils import FullyShardedDataParallelPlugin as P;"
        "P(mixed_precision_policy='bf16'); import mpaccel.accelerator, mpaccel.strategy;"
        "bad = [m for m in sys.modules if m.startswith(('torch.distributed.fsdp',"
        " 'torch.distributed.tensor'))]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stderr
