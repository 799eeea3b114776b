"""Tensor parallelism through Accelerator(parallelism_config=ParallelismConfig(tp_size=...)):
pure TP (every rank one tp group) and 2-D FSDP+TP, at the sizes the CI runs (1, 2, 4).

The reference is one process training the same model on the whole global batch: the losses
(averaged over the ranks) and the gathered weights must match it."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from mpaccel.errors import CollectiveError, ConfigurationError
from mpaccel.parallelism_config import ParallelismConfig
from mpaccel.strategy.base import Strategy
from mpaccel.strategy.tensor_parallel import TensorParallel
from mpaccel.utils import FullyShardedDataParallelPlugin, TorchTensorParallelConfig
from tests.conftest import accelerator

pytestmark = pytest.mark.usefixtures("no_group_left_behind")

WIDTH, HIDDEN = 8, 16  # split by 2 and 4
GLOBAL_BATCH = 8
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(5, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).cos())


def _layout(kind: str, n: int) -> dict:
    if kind == "pure":
        return {"tp_size": n}
    if n % 2:
        pytest.skip("2-D FSDP+TP needs an even number of ranks")
    return {"tp_size": 2, "dp_shard_size": n // 2}


def _accelerator(kind: str, n: int, **kwargs):
    sizes = _layout(kind, n)
    if sizes["tp_size"] == 1:
        pytest.skip("tensor parallelism needs 2 ranks or more")
    config = ParallelismConfig(**sizes, tp_handler=TorchTensorParallelConfig(tp_plan=PLAN))
    if kind == "2d":
        kwargs.setdefault("fsdp_plugin", FullyShardedDataParallelPlugin())
    return accelerator(parallelism_config=config, **kwargs)


def _reference(accumulation: int, clip: float):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, norms = [], []
    for x, y in DataLoader(_data(), batch_size=GLOBAL_BATCH * accumulation):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return model, losses, norms


@pytest.mark.parametrize("kind", ["pure", "2d"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_tensor_parallel_training_matches_one_process(comm, kind, accumulation):
    acc = _accelerator(kind, comm.size, gradient_accumulation_steps=accumulation)
    assert isinstance(acc.strategy, TensorParallel)
    dp = acc.strategy.data_parallel_size
    # another initialisation on each rank: prepare() starts every rank from rank 0's weights
    model = Net(seed=1 if acc.is_main_process else 50 + comm.rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // dp)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    up = model.blocks[0].up.weight
    assert up.to_local().shape[0] * acc.parallelism_config.tp_size * (
        dp if kind == "2d" else 1) == HIDDEN  # split along tp (and dp_shard)
    losses, norms, pending = [], [], 0.0
    for x, y in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            pending += acc.reduce(loss.detach(), "mean").item() / accumulation
            if acc.sync_gradients:
                losses.append(pending)
                pending = 0.0
                norms.append(acc.clip_grad_norm_(model.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
    ref, ref_losses, ref_norms = _reference(accumulation, 0.5)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert norms == pytest.approx(ref_norms, rel=1e-5, abs=1e-6)
    full = acc.get_state_dict(model, all_ranks=True)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("kind", ["pure", "2d"])
def test_mesh_names_ranks_and_the_data_each_rank_reads(comm, kind):
    n = comm.size
    acc = _accelerator(kind, n)
    tp = acc.parallelism_config.tp_size
    mesh = acc.torch_device_mesh
    assert mesh.mesh_dim_names == (("tp",) if kind == "pure" else ("dp_shard", "tp"))
    assert acc.tensor_parallel_rank == comm.rank % tp  # consecutive ranks of one node
    assert acc.data_parallel_rank == 0
    assert acc.data_parallel_shard_rank == (0 if kind == "pure" else comm.rank // tp)
    if kind == "2d":
        assert mesh["dp"].size() == mesh["dp_shard_cp"].size() == n // tp
    assert acc.strategy.data_parallel_size == n // tp
    loader = acc.prepare(DataLoader(list(range(12)), batch_size=2))
    seen = [batch.tolist() for batch in loader]
    everyone = comm.allgather(seen)
    for rank in range(n):  # a tp group reads the same batches, the groups different ones
        assert everyone[rank] == everyone[rank - rank % tp]
    firsts = sorted(x for r in range(0, n, tp) for b in everyone[r] for x in b)
    assert firsts == list(range(12))
    counted = []
    for batch in loader:
        counted += acc.gather_for_metrics(batch).tolist()
    assert sorted(counted) == list(range(12))  # each sample once, not once per tp rank
    objects = []
    for batch in loader:
        objects += acc.gather_for_metrics([f"s{int(v)}" for v in batch])
    assert sorted(objects) == sorted(f"s{v}" for v in range(12))
    dp = acc.strategy.data_parallel_size
    sums = []
    for batch in loader:  # a 0-d tensor (a batch's loss, say) is one row per tp group
        both = acc.gather_for_metrics({"sum": batch.sum(), "rows": batch})
        assert both["sum"].shape == (dp,) and both["rows"].shape == (2 * dp,)
        sums += both["sum"].tolist()
    assert sum(sums) == sum(range(12))


def test_the_model_own_plan_and_an_arriving_tp_model(comm):
    if comm.size == 1:
        pytest.skip("tensor parallelism needs 2 ranks or more")
    acc = accelerator(parallelism_config=ParallelismConfig(tp_size=comm.size))
    model = Net()
    model._tp_plan = PLAN  # transformers' attribute
    model = acc.prepare(model)
    assert model.blocks[1].down.weight.placements[0].is_shard(1)
    ready = Net()  # split by the user (as transformers' tp_plan="auto" does) before prepare()
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    whole = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(ready, acc.torch_device_mesh["tp"], {"blocks.0.down": whole})
    ready = acc.prepare(ready)
    assert ready.blocks[0].up.weight.placements[0].is_replicate()  # no plan: replicated
    out = ready(torch.ones(3, 5))
    assert out.shape == (3, 1) and not isinstance(out, DTensor)


def test_a_missing_or_wrong_plan_is_every_rank_error_and_splits_nothing(comm):
    if comm.size == 1:
        pytest.skip("tensor parallelism needs 2 ranks or more")
    acc = accelerator(parallelism_config=ParallelismConfig(tp_size=comm.size))
    with pytest.raises(CollectiveError, match=r"(?s)no tensor-parallel plan.*HINT"):
        acc.prepare(Net())
    misfit = {"blocks.*.up": "colwise", "blocks.1.norm": "colwise"}  # a LayerNorm
    misfit_says = r"(?s)'blocks\.1\.norm' \(LayerNorm: 'colwise' splits nn\.Linear or .*HINT"
    for plan, error, message in (
        ({"blocks.*.nothing": "colwise"}, CollectiveError, "matches no module"),
        ({"blocks.*.up": "diagonal"}, CollectiveError, "mpaccel applies the styles"),
        (misfit, CollectiveError, misfit_says),
        (PLAN if comm.rank else {"blocks.0.up": "colwise"}, ConfigurationError,
         r"(?s)differs between ranks: ranks \[1.*another tensor-parallel plan"),
    ):
        handler = TorchTensorParallelConfig(tp_plan=plan)
        acc = accelerator(
            parallelism_config=ParallelismConfig(tp_size=comm.size, tp_handler=handler)
        )
        model = Net()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(error, match=message):
            acc.prepare(model)
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # all or nothing
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key


def test_tensor_parallel_answers_every_member_of_the_strategy_protocol():
    """Each member either has the tensor-parallel answer or hands over to the inner strategy:
    none falls back, unseen, to the base class's (mesh_rank reads the N-D mesh already)."""
    members = {name for name, value in vars(Strategy).items()
               if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    inherited = {name for name in members if name not in vars(TensorParallel)}
    assert inherited == {"mesh_rank"}


def test_context_parallel_on_cpu_is_refused_with_the_reason(comm):
    if comm.size == 1:
        pytest.skip("context parallelism needs 2 ranks or more")
    with pytest.raises(ConfigurationError, match="no CPU implementation of context parallel"):
        accelerator(parallelism_config=ParallelismConfig(cp_size=comm.size))


def test_transformers_styles_torch_cannot_express_are_refused_with_a_hint():
    from mpaccel.strategy.tensor_parallel import STYLE_ALIASES, style_of

    assert style_of("lm_head", "colwise_gather_output") == STYLE_ALIASES["colwise_rep"]
    with pytest.raises(ConfigurationError,
                       match=r"(?s)'unit_colwise' \(splits attention heads.*HINT.*tp_plan='auto'"):
        style_of("layers.*.self_attn.k_proj", "unit_colwise")


def test_a_tiny_llama_splits_by_its_own_plan_and_matches_one_process(comm):
    """transformers' LlamaForCausalLM (built from a LlamaConfig, no download): its plan says
    embedding_rowwise, colwise, rowwise and colwise_gather_output."""
    if comm.size == 1:
        pytest.skip("tensor parallelism needs 2 ranks or more")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = build()
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)

    acc = accelerator(parallelism_config=ParallelismConfig(tp_size=comm.size))
    model = acc.prepare(build())
    assert model.model.embed_tokens.weight.placements[0].is_shard(0)  # by vocabulary
    assert model.lm_head.weight.placements[0].is_shard(0)
    assert model.model.layers[0].self_attn.o_proj.weight.placements[0].is_shard(1)
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 8, 64) and not isinstance(out.logits, DTensor)  # gathered
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    acc.backward(out.loss)
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=1e-6)
