"""Fully sharded training (FSDP2) through Accelerator(fsdp_plugin=...): the same bodies run at
size 1 and under mpiexec -n 2, 3 (uneven shards) and 4.

The reference for a run on N ranks is computed in the same test, on one process, with the whole
global batch: sharded data-parallel training must give the same losses and parameters."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from mpaccel import Accelerator, AcceleratorState
from mpaccel.errors import CollectiveError, ConfigurationError, MpaccelWarning
from mpaccel.testing import reset_state
from mpaccel.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig
from tests.conftest import accelerator

pytestmark = pytest.mark.usefixtures("no_group_left_behind")

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
WIDTH = 10  # rows split 10 | 5/5 | 4/4/2 | 3/3/3/1: uneven at 3 and 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(6, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _plugin(**fields) -> FullyShardedDataParallelPlugin:
    fields.setdefault("auto_wrap_policy", "transformer_based_wrap")
    fields.setdefault("transformer_cls_names_to_wrap", ["Block"])
    return FullyShardedDataParallelPlugin(**fields)


def _fresh(**kwargs) -> Accelerator:
    kwargs.setdefault("fsdp_plugin", _plugin())
    return accelerator(**kwargs)


def _reference(dataset, accumulation, epochs, clip=None):
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, norms = [], []
    for _ in range(epochs):
        for x, y in DataLoader(dataset, batch_size=GLOBAL_BATCH * accumulation):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
    return model, losses, norms


def _train(acc, accumulation, epochs, clip=None, model=None):
    n = acc.num_processes
    dataset = _data()
    # Different initialisation on each rank: prepare() must shard rank 0's weights.
    model = model or Tiny(seed=1 if acc.is_main_process else 100 + acc.process_index)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // n)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, norms, pending = [], [], 0.0
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                pending += acc.reduce(loss.detach(), "mean").item() / accumulation
                if acc.sync_gradients:
                    losses.append(pending)
                    pending = 0.0
                    if clip is not None:
                        norms.append(acc.clip_grad_norm_(model.parameters(), clip).item())
                opt.step()
                opt.zero_grad()
    return model, opt, losses, norms


@pytest.mark.parametrize("accumulation", [1, 2])
def test_sharded_training_matches_single_process(comm, accumulation):
    acc = _fresh(gradient_accumulation_steps=accumulation)
    assert acc.distributed_type == DistributedType.FSDP and acc.is_fsdp2
    model, _, losses, _ = _train(acc, accumulation, epochs=2)
    ref, ref_losses, _ = _reference(_data(), accumulation, epochs=2)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    full = acc.get_state_dict(model, all_ranks=True)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_parameters_gradients_and_optimizer_state_are_sharded(comm):
    acc = _fresh()
    n = acc.num_processes
    model, opt, _, _ = _train(acc, 1, epochs=1)
    acc.backward(model(torch.ones(2, 6)).sum())  # gradients to look at
    local = {"param": 0, "grad": 0, "exp_avg": 0, "exp_avg_sq": 0}
    total = 0
    for p in model.parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
        rows = p.shape[0]
        assert p.to_local().shape[0] <= math.ceil(rows / n)
        state = opt.optimizer.state[p]
        for name, tensor in (("param", p), ("grad", p.grad), *state.items()):
            if name in local:
                local[name] += tensor.to_local().numel()
        total += p.numel()
    counts = {name: comm.allgather(v) for name, v in local.items()}
    for name, per_rank in counts.items():
        assert sum(per_rank) == total, name  # every element on exactly one rank
        assert max(per_rank) <= math.ceil(total / n) + 3 * WIDTH, (name, per_rank)
    assert sum(p.numel() for p in Tiny().parameters()) == total


def test_a_sharded_model_prepared_again_comes_back_as_it_is(comm):
    """transformers' Trainer prepares in evaluate(), calls free_memory(), then prepares the
    sharded model again in train(): it is not sharded a second time, and it trains as one
    process does."""
    acc = _fresh()
    model = acc.prepare(Tiny())
    acc.free_memory()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    again, opt, loader = acc.prepare(model, opt, DataLoader(_data(), GLOBAL_BATCH // comm.size))
    assert again is model and acc._models == [model]
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        losses.append(acc.reduce(loss.detach(), "mean").item())
        opt.step()
        opt.zero_grad()
    assert losses == pytest.approx(_reference(_data(), 1, 1)[1], rel=1e-5)


def test_clip_grad_norm_is_the_whole_models(comm):
    acc = _fresh()
    model, _, _, norms = _train(acc, 1, epochs=1, clip=0.05)
    ref, _, ref_norms = _reference(_data(), 1, epochs=1, clip=0.05)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert comm.allgather(norms) == [norms] * comm.size  # the same number on every rank
    full = acc.get_state_dict(model, all_ranks=True)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_no_sync_holds_gradients_back_until_the_synchronising_backward(comm):
    acc = _fresh()
    model = acc.prepare(Tiny())
    x = torch.randn(3, 6)
    with acc.no_sync(model):
        acc.backward(model(x).sum())
    assert all(p.grad is None for p in model.parameters())  # nothing reduce-scattered yet
    acc.backward(model(x).sum())
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_an_optimizer_prepared_apart_must_hold_the_shards(comm):
    acc = _fresh()
    model = Tiny()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    model = acc.prepare(model)
    with pytest.raises(ConfigurationError, match=r"(?s)without its model.*HINT: pass the model"):
        acc.prepare(stale)
    fresh = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))  # built after: fine
    assert all(isinstance(p, DTensor) for p in fresh.param_groups[0]["params"])


def test_get_state_dict_is_full_on_rank_0_only_by_default(comm):
    acc = _fresh()
    model = acc.prepare(Tiny())
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        assert {k: v.shape for k, v in state.items()} == {
            k: v.shape for k, v in Tiny().state_dict().items()
        }
        assert all(type(v) is torch.Tensor for v in state.values())
    else:
        assert state == {}
    assert acc.unwrap_model(model) is model


def test_mixed_precision_gather_and_metrics_under_fsdp(comm):
    acc = _fresh(mixed_precision="bf16")
    assert acc.state.fsdp_plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    model, _, losses, _ = _train(acc, 1, epochs=1)
    assert all(math.isfinite(v) for v in losses)
    out = model(torch.ones(2, 6))
    assert out.dtype == torch.bfloat16  # the policy's output_dtype, as in Accelerate
    gathered = acc.gather(out.detach())
    assert gathered.shape == (2 * acc.num_processes, 1)
    assert acc.gather_for_metrics(torch.tensor([acc.process_index])).tolist() == list(
        range(acc.num_processes)
    )


def test_low_precision_weights_get_float32_masters_under_mixed_precision(comm):
    # A model loaded in bfloat16 trains in bf16 under the policy, but its sharded weights (the
    # optimizer's master copy) are float32, as Accelerate upcasts them: lr 1e-4 steps are far
    # below bf16's rounding step at these magnitudes and were lost before.
    acc = _fresh(mixed_precision="bf16")
    model = Tiny(seed=1).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with pytest.warns(MpaccelWarning, match="upcast to float32") if acc.is_main_process else (
            contextlib.nullcontext()):
        model, opt = acc.prepare(model, opt)
    assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}
    before = [p.to_local().clone() for p in model.parameters()]
    acc.backward(model(torch.ones(4, 6)).sum())
    opt.step()
    held = [(b, p.to_local()) for b, p in zip(before, model.parameters()) if b.numel()]
    assert held and all(not torch.equal(b, now) for b, now in held)  # every step kept


def test_activation_checkpointing_and_size_policy_train_the_same(comm):
    ref, ref_losses, _ = _reference(_data(), 1, epochs=1)
    for plugin in (
        _plugin(activation_checkpointing=True),
        FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap", min_num_params=50),
        FullyShardedDataParallelPlugin(auto_wrap_policy=lambda m: isinstance(m, Block)),
        FullyShardedDataParallelPlugin(reshard_after_forward=False),
        _plugin(sharding_strategy="HYBRID_SHARD"),
    ):
        acc = _fresh(fsdp_plugin=plugin)
        model, _, losses, _ = _train(acc, 1, epochs=1)
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), plugin
        assert set(acc.get_state_dict(model, all_ranks=True)) == set(ref.state_dict())


def test_ignored_modules_stay_whole(comm):
    acc = _fresh(fsdp_plugin=_plugin(ignored_modules=r"head"))
    model = acc.prepare(Tiny())
    assert not isinstance(model.head.weight, DTensor)
    assert isinstance(model.embed.weight, DTensor)


def test_cpu_ram_efficient_loading_sends_rank_0s_weights(comm):
    acc = _fresh(fsdp_plugin=_plugin(cpu_ram_efficient_loading=True))
    if acc.is_main_process:
        model = Tiny()
    else:
        with torch.device("meta"):
            model = Tiny()
    model = acc.prepare(model)
    assert not any(p.to_local().is_meta for p in model.parameters())
    full = acc.get_state_dict(model, all_ranks=True)
    for key, value in Tiny().state_dict().items():
        torch.testing.assert_close(full[key], value, msg=key)


def test_a_model_on_the_meta_device_is_one_collective_error(comm):
    acc = _fresh()
    last = acc.num_processes - 1
    if acc.process_index == last:
        with torch.device("meta"):
            model = Tiny()
    else:
        model = Tiny()
    with pytest.raises(CollectiveError, match="meta device") as info:
        acc.prepare(model)
    assert info.value.failed_ranks == [last]
    assert "cpu_ram_efficient_loading" in str(info.value)


@pytest.mark.mpi(min_size=2)
def test_models_that_differ_between_ranks_are_refused_on_every_rank(comm):
    acc = _fresh()
    last = acc.num_processes - 1
    model = torch.nn.Linear(6, 3) if acc.process_index == last else Tiny()
    with pytest.raises(ConfigurationError, match=rf"differs between ranks: ranks \[{last}\]"):
        acc.prepare(model)


def test_unmatched_class_names_warn_naming_the_classes_found(comm):
    acc = _fresh(fsdp_plugin=_plugin(transformer_cls_names_to_wrap=["DecoderLayer"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.prepare(Tiny())
    if acc.is_main_process:
        (warning,) = [w for w in caught if issubclass(w.category, MpaccelWarning)]
        assert "['DecoderLayer']" in str(warning.message)
        assert "Block" in str(warning.message) and "Tiny" in str(warning.message)


@pytest.mark.parametrize("spelling", ["HYBRID_SHARD", "hybrid_shard", 4, "HYBRID_SHARD_ZERO2"])
def test_hybrid_shard_mesh_is_nodes_by_ranks_per_node(comm, spelling):
    acc = _fresh(fsdp_plugin=_plugin(sharding_strategy=spelling))
    state = AcceleratorState()
    mesh = acc.torch_device_mesh
    assert mesh is state.device_mesh
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert tuple(mesh.shape) == (state.num_nodes, acc.num_processes // state.num_nodes)
    assert mesh["dp_shard"].get_local_rank() == state.local_process_index
    assert mesh["dp_replicate"].get_local_rank() == state.node_index


def test_parallelism_config_replicates_and_trains_the_same(comm):
    # At even sizes a true HSDP mesh on one machine: 2 replicas, each sharded over n/2 ranks.
    n = comm.size
    shape = (2, n // 2) if n % 2 == 0 else (1, n)
    reset_state()
    acc = Accelerator(
        fsdp_plugin=_plugin(),
        parallelism_config=ParallelismConfig(dp_replicate_size=shape[0], dp_shard_size=shape[1]),
    )
    # Accelerate's dimensions of size > 1, and dp_shard, which FSDP shards over
    kept = tuple(s for s, name in zip(shape, ("dp_replicate", "dp_shard"))
                 if s > 1 or name == "dp_shard")  # fmt: skip
    assert tuple(acc.torch_device_mesh.shape) == kept
    model, _, losses, _ = _train(acc, 1, epochs=1)
    _, ref_losses, _ = _reference(_data(), 1, epochs=1)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    rows = model.embed.weight.to_local().shape[0]
    assert rows == math.ceil(WIDTH / shape[1]) or comm.rank % shape[1] == shape[1] - 1
    reset_state()
    with pytest.raises(CollectiveError, match=f"makes a mesh of {n + 1} ranks; the job has {n}"):
        Accelerator(fsdp_plugin=_plugin(),
                    parallelism_config=ParallelismConfig(dp_replicate_size=1, dp_shard_size=n + 1))
    reset_state()
    with pytest.raises(ConfigurationError, match="no fsdp_plugin"):
        Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2))


def test_parallel_ranks_follow_the_parallelism_config(comm):
    reset_state()
    acc = Accelerator()  # no ParallelismConfig: Accelerate's errors
    for name in ("data_parallel_rank", "data_parallel_shard_rank", "tensor_parallel_rank"):
        with pytest.raises(RuntimeError, match=r"(?s)no parallelism_config.*HINT"):
            getattr(acc, name)
    for name in ("context_parallel_rank", "pipeline_parallel_rank"):
        with pytest.raises(NotImplementedError, match=r"(?s)not (supported|configured).*HINT"):
            getattr(acc, name)
    n = comm.size
    shape = (2, n // 2) if n % 2 == 0 else (1, n)
    reset_state()
    acc = Accelerator(
        fsdp_plugin=_plugin(),
        parallelism_config=ParallelismConfig(dp_replicate_size=shape[0], dp_shard_size=shape[1]),
    )
    assert acc.data_parallel_rank == comm.rank // shape[1]
    assert acc.data_parallel_shard_rank == comm.rank % shape[1]
    assert acc.tensor_parallel_rank == 0
    reset_state()


def test_full_shard_mesh_is_every_rank(comm):
    acc = _fresh()
    assert acc.torch_device_mesh.mesh_dim_names == ("dp_shard",)
    assert acc.torch_device_mesh.size() == acc.num_processes
    assert acc.state.fsdp_plugin is AcceleratorState().fsdp_plugin


def test_plugin_fields_and_variables(comm, monkeypatch):
    with pytest.raises(ConfigurationError, match=r"(?s)FSDP2.*HINT"):
        FullyShardedDataParallelPlugin(fsdp_version=1)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigurationError, match=r"fsdp_version=1\) \(from FSDP_VERSION=1\)"):
        FullyShardedDataParallelPlugin()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block, Other")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Other"]
    assert plugin.state_dict_type.value == "FULL_STATE_DICT"
    assert plugin.reshard_after_forward is False  # SHARD_GRAD_OP keeps them gathered
    assert FullyShardedDataParallelPlugin(state_dict_type=None).state_dict_type == (
        "FULL_STATE_DICT"
    )
    monkeypatch.delenv("FSDP_STATE_DICT_TYPE")
    assert FullyShardedDataParallelPlugin().state_dict_type == "SHARDED_STATE_DICT"
    with pytest.raises(ConfigurationError, match="wrap policy"):
        FullyShardedDataParallelPlugin(auto_wrap_policy="by_mood")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    reset_state()
    acc = Accelerator()
    assert acc.is_fsdp2 and acc.state.fsdp_plugin.transformer_cls_names_to_wrap == [
        "Block",
        "Other",
    ]


def test_node_grid_groups_ranks_by_node_and_refuses_unequal_nodes():
    from mpaccel.strategy.mesh import node_grid

    # round-robin placement: ranks 0, 2 on node 0 and 1, 3 on node 1
    assert node_grid([(0, 0), (1, 0), (0, 1), (1, 1)]) == [[0, 2], [1, 3]]
    assert node_grid([(0, 0), (0, 1), (1, 0), (1, 1)]) == [[0, 1], [2, 3]]
    uneven = [(0, 0), (0, 1), (1, 0)]
    with pytest.raises(ConfigurationError, match=r"(?s)ranks per node: \{0: 2, 1: 1\}.*"
                       r"ParallelismConfig\(dp_replicate_size=R, dp_shard_size=S\) takes"):
        node_grid(uneven)
    # what the HINT promises: a ParallelismConfig mesh over the same nodes
    from mpaccel.strategy.layout import lay_out

    sizes = {"dp_replicate": 1, "dp_shard": 3, "cp": 1, "tp": 1}
    assert lay_out(sizes, uneven, ["a", "a", "b"]).groups(["dp_shard"]) == [[0, 1, 2]]
