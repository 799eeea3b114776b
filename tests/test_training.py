"""Training through Accelerator.prepare: the same bodies run at size 1 and under mpiexec -n 2/4.

The reference for a run on N ranks is computed in the same test, on one process, with N times
the batch size: data-parallel training must end with the same parameters."""

from __future__ import annotations

import gc
import sys
import warnings
from typing import NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mpaccel import Accelerator, AcceleratorState, distributed, ops
from mpaccel.errors import CollectiveMismatchError, ConfigurationError
from mpaccel.testing import reset_state
from mpaccel.utils import (
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
)
from tests.conftest import accelerator, params

# Also run under Open MPI's mpiexec (docs/testing.md, "Which stage runs what").
pytestmark = pytest.mark.openmpi

GLOBAL_BATCH = 16


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def _model(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _reference(dataset, steps_per_update, epochs, lr=0.05, clip=None):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH * steps_per_update)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return model


@pytest.mark.parametrize("accumulation", [1, 2])
def test_data_parallel_matches_single_process(comm, accumulation):
    acc = accelerator(gradient_accumulation_steps=accumulation)
    n = acc.num_processes
    dataset = _data()
    # Different initialisation on each rank: prepare() must make rank 0's parameters win.
    model = _model(seed=1 if acc.is_main_process else 100 + acc.process_index)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // n)
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 0
    for _ in range(3):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                norm = acc.clip_grad_norm_(model.parameters(), 10.0)
                opt.step()
                opt.zero_grad()
                steps += acc.sync_gradients
    assert steps == 3 * len(dataset) // (GLOBAL_BATCH * accumulation)
    assert torch.isfinite(norm)
    mine = params(acc.unwrap_model(model))
    expected = params(_reference(dataset, accumulation, epochs=3, clip=10.0))
    assert torch.allclose(mine, expected, atol=1e-5), (mine - expected).abs().max()
    everyone = comm.allgather(mine)
    assert all(torch.equal(everyone[0], other) for other in everyone)


def test_accumulation_skips_optimizer_and_adjusts_scheduler(comm):
    acc = accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
    n = acc.num_processes
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(_data(n=GLOBAL_BATCH * 5), batch_size=GLOBAL_BATCH // n)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    syncs, lrs = [], []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            syncs.append(acc.sync_gradients)
            lrs.append(opt.param_groups[0]["lr"])
    # 5 batches, 4 per step: a step after the 4th, and one at the end of the dataloader
    assert syncs == [False, False, False, True, True]
    # the scheduler moves num_processes steps per optimizer step (Accelerate's convention)
    assert lrs[3] == pytest.approx(0.5**n) and lrs[4] == pytest.approx(0.5 ** (2 * n))
    assert lrs[:3] == [1.0, 1.0, 1.0]


def test_sync_each_batch_and_no_sync(comm):
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    acc = accelerator(gradient_accumulation_plugin=plugin)
    assert acc.gradient_state.sync_each_batch
    model = acc.prepare(_model())
    x = torch.randn(4, 8) * (acc.process_index + 1)
    with acc.no_sync(model):
        model(x).sum().backward()
    local = [p.grad.clone() for p in acc.unwrap_model(model).parameters()]
    grads = comm.allgather(local[0])
    if acc.num_processes > 1:
        assert not torch.equal(grads[0], grads[1])  # no all-reduce happened


def _count_all_reduces(model):
    """Record DDP's gradient all-reduces (one per bucket) through a communication hook that
    reduces as DDP does by default."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    return calls


def _grads(model):
    return torch.cat([p.grad.detach().flatten().clone() for p in model.parameters()])


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sync_each_batch_decides_which_micro_batches_all_reduce(comm, sync_each_batch):
    steps = 4
    plugin = GradientAccumulationPlugin(num_steps=steps, sync_each_batch=sync_each_batch)
    acc = accelerator(gradient_accumulation_plugin=plugin)
    n = acc.num_processes
    dataset = _data(n=GLOBAL_BATCH * steps * 2)  # two optimizer steps per epoch
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // n)
    model, opt, loader = acc.prepare(model, opt, loader)
    ddp = n > 1
    assert distributed.is_ddp(model) == ddp
    reduces = _count_all_reduces(model) if ddp else []
    syncs, requested, reduced, grads = [], [], [], []
    for _ in range(2):
        for x, y in loader:
            with acc.accumulate(model):
                requested.append(getattr(model, "require_backward_grad_sync", False))
                before = len(reduces)
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                reduced.append(len(reduces) > before)
                syncs.append(acc.sync_gradients)
                grads.append(_grads(acc.unwrap_model(model)))
                opt.step()
                opt.zero_grad()
    assert syncs == [False, False, False, True] * 4
    # each rank's own batches: its gradients are its own until they are all-reduced
    everyone = comm.allgather(grads)
    same = [all(torch.equal(g[i], everyone[0][i]) for g in everyone) for i in range(len(grads))]
    if ddp:
        expected = [sync or sync_each_batch for sync in syncs]
        assert requested == expected  # DDP's no_sync() was on for the others
        assert reduced == expected
        assert same == expected
    else:  # one process: no DDP, nothing to reduce
        assert not any(requested) and reduces == []
    # either way, the same training as one process on the concatenated batches
    mine = params(acc.unwrap_model(model))
    expected_params = params(_reference(dataset, steps, epochs=2))
    assert torch.allclose(mine, expected_params, atol=1e-5), (mine - expected_params).abs().max()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"adjust_scheduler": False},
        {"split_batches": True},
        # it then steps before the optimizer has, which torch warns about
        pytest.param(
            {"step_scheduler_with_optimizer": False},
            marks=pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step"),
        ),
    ],
    ids=["default", "no-adjust", "split-batches", "not-with-optimizer"],
)
def test_prepared_scheduler_steps_with_the_optimizer(comm, options):
    """As Accelerate: a scheduler written for one process counts batches, so it moves
    num_processes steps per optimizer step (one with split_batches) and none while gradients
    accumulate; adjust_scheduler only moves its step counter on those micro-batches.
    step_scheduler_with_optimizer=False steps it on every call."""
    steps, micro_batches = 4, 10
    adjust = options.get("adjust_scheduler", True)
    split = options.get("split_batches", False)
    with_optimizer = options.get("step_scheduler_with_optimizer", True)
    plugin = GradientAccumulationPlugin(num_steps=steps, adjust_scheduler=adjust)
    acc = accelerator(
        gradient_accumulation_plugin=plugin,
        split_batches=split,
        step_scheduler_with_optimizer=with_optimizer,
    )
    n = acc.num_processes
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = sched.scheduler._step_count
    lrs, counted = [], []
    g = torch.Generator().manual_seed(acc.process_index)
    for _ in range(micro_batches):  # no dataloader: no forced sync at its end
        with acc.accumulate(model):
            acc.backward(model(torch.randn(4, 8, generator=g)).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
        counted.append(sched.scheduler._step_count - counter)
    expected_lrs, expected_counts = [], []
    for k in range(1, micro_batches + 1):
        optimizer_steps = k // steps
        if not with_optimizer:
            moved = k
        else:
            moved = optimizer_steps * (1 if split else n)
        expected_lrs.append(1 / (1 + moved))
        accumulating = k - optimizer_steps if with_optimizer and adjust else 0
        expected_counts.append(moved + accumulating)
    assert lrs == pytest.approx(expected_lrs)
    assert counted == expected_counts
    assert sched.get_last_lr() == pytest.approx([expected_lrs[-1]])


def _dataloader_run(acc, dataset, batch_size, **kwargs):
    loader = acc.prepare(DataLoader(dataset, batch_size=batch_size, **kwargs))
    seen, flags = [], []
    for (x,) in loader:
        seen.append(x)
        flags.append(acc.gradient_state.end_of_dataloader)
    return loader, seen, flags


@pytest.mark.parametrize("even_batches", [True, False])
def test_uneven_dataset_and_gather_for_metrics(comm, even_batches):
    acc = accelerator(even_batches=even_batches)
    n = acc.num_processes
    dataset = TensorDataset(torch.arange(23).float())
    loader, seen, flags = _dataloader_run(acc, dataset, batch_size=3)
    assert flags[-1] is True and not any(flags[:-1])
    lengths = comm.allgather(len(seen))
    if even_batches:
        assert len(set(lengths)) == 1
    if even_batches and n > 1:
        assert all(batch.shape[0] == 3 for batch in seen)
    elif n == 1:  # one process: the loader's own batches, nothing repeated (as in Accelerate)
        assert [b.tolist() for b in seen] == [b.tolist() for (b,) in DataLoader(dataset, 3)]
    assert acc.gradient_state.remainder == -1  # outside the loop
    assert loader.remainder == 23 % (3 * n)
    gathered = []
    for (x,) in loader:
        gathered.append(acc.gather_for_metrics(x))
    values = torch.cat(gathered).tolist()
    assert sorted(values) == list(range(23)), (n, values)
    assert acc.gradient_state.end_of_dataloader is False  # reset outside the loop


def test_drop_last_has_no_remainder(comm):
    # As in Accelerate: with drop_last nothing is repeated, remainder is -1 and gather_for_metrics
    # keeps every gathered sample of the last batch.
    acc = accelerator()
    n = acc.num_processes
    loader, seen, _ = _dataloader_run(acc, TensorDataset(torch.arange(23)), 3, drop_last=True)
    assert loader.remainder == -1
    assert len(seen) == 7 // n and all(batch.shape[0] == 3 for batch in seen)
    values = []
    for (x,) in loader:
        values += acc.gather_for_metrics(x).tolist()
    assert len(values) == len(set(values)) == 3 * n * (7 // n)


def test_split_batches(comm):
    acc = accelerator(split_batches=True)
    n = acc.num_processes
    _, seen, _ = _dataloader_run(acc, TensorDataset(torch.arange(32)), batch_size=8)
    assert all(batch.shape[0] == 8 // n for batch in seen)
    assert len(seen) == 4
    everything = sorted(
        v for batches in comm.allgather([b.tolist() for b in seen]) for b in batches for v in b
    )
    assert everything == list(range(32))
    if n in (2, 4):
        AcceleratorState._reset_state(True)
        with pytest.raises(ConfigurationError, match="divisible"):
            acc = Accelerator(split_batches=True)
            acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=6 if n == 4 else 5))


def test_shuffle_same_on_every_rank_and_new_each_epoch(comm):
    torch.manual_seed(1234 + comm.rank)  # rank-dependent torch seed: the data order must not be
    acc = accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=2, shuffle=True))
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([v for (x,) in loader for v in x.tolist()])
    # every rank's share comes from one permutation: together they cover each sample once
    for order in epochs:
        union = sorted(v for part in comm.allgather(order) for v in part)
        assert union == list(range(40))
    assert epochs[0] != epochs[1]
    again = [v for (x,) in loader for v in x.tolist()]  # no set_epoch: advances by itself
    assert again != epochs[1]


@pytest.mark.parametrize("kind", ["subset", "weighted"])
def test_other_random_samplers_draw_the_same_on_every_rank(comm, kind):
    from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

    torch.manual_seed(99 + comm.rank)  # each rank's own RNG differs: it must not matter
    acc = accelerator()
    dataset = TensorDataset(torch.arange(40))
    if kind == "subset":
        sampler = SubsetRandomSampler(list(range(0, 40, 2)))  # 20 even indices
    else:
        # without replacement: one draw of 20 distinct indices, dealt out to the ranks
        sampler = WeightedRandomSampler(torch.ones(40), num_samples=20, replacement=False)
    loader = acc.prepare(DataLoader(dataset, batch_size=2, sampler=sampler))
    epochs, orders = [], []
    for epoch in range(2):
        loader.set_epoch(epoch)
        mine = [v for (x,) in loader for v in x.tolist()]
        orders.append(mine)
        epochs.append(sorted(v for part in comm.allgather(mine) for v in part))
    for union in epochs:
        # ranks drawing on their own would together see other (and more) indices
        assert len(set(union)) == 20
        if kind == "subset":
            assert set(union) == set(range(0, 40, 2))
        if 20 % (2 * comm.size) == 0:  # no even_batches padding: each index exactly once
            assert len(union) == 20
    assert orders[0] != orders[1]  # a new draw each epoch


def test_ops(comm):
    acc = accelerator()
    n, r = acc.num_processes, acc.process_index
    t = torch.full((2, 3), float(r))
    g = acc.gather({"a": t, "b": [torch.tensor(r)]})
    assert g["a"].shape == (2 * n, 3) and g["a"][::2, 0].tolist() == list(range(n))
    assert (g["b"][0].tolist() == list(range(n))) if n > 1 else g["b"][0].item() == 0
    uneven = acc.gather(torch.arange(r + 1))
    assert uneven.tolist() == [i for k in range(n) for i in range(k + 1)]
    assert acc.reduce(t, "sum")[0, 0].item() == sum(range(n))
    assert acc.reduce(t, "mean")[0, 0].item() == pytest.approx(sum(range(n)) / n)
    assert acc.reduce(t, "max")[0, 0].item() == n - 1
    assert t[0, 0].item() == r  # reduce does not modify its input
    padded = acc.pad_across_processes(torch.ones(r + 1, 2), dim=0, pad_index=-1)
    assert padded.shape == (n, 2) and padded[r + 1 :].eq(-1).all()
    first = acc.pad_across_processes(torch.ones(r + 1), pad_first=True)
    assert first[: n - r - 1].eq(0).all()
    from mpaccel.utils import broadcast, gather_object

    b = broadcast(torch.tensor([float(r)]), from_process=n - 1)
    assert b.item() == n - 1
    assert gather_object([f"r{r}"]) == [f"r{k}" for k in range(n)]
    rows = gather_object(torch.full((2, 1), r))  # a tensor contributes its rows, as in Accelerate
    assert [row.tolist() for row in rows] == [[k] for k in range(n) for _ in range(2)]
    assert acc.gather_for_metrics(["x"] * 2) == ["x"] * (2 * n)
    from mpaccel.utils import reduce

    # accelerate.utils.reduce defaults to "mean", Accelerator.reduce to "sum"
    assert reduce(t)[0, 0].item() == pytest.approx(sum(range(n)) / n)
    assert acc.reduce(t)[0, 0].item() == sum(range(n))


@pytest.mark.parametrize("kind", ["objects", "mixed"])
def test_gather_for_metrics_drops_the_repeated_samples_of_objects(comm, kind):
    # 10 samples, batch 3: the last round holds 10 % (3n) real samples, the rest are repeats.
    # "objects": a tensor gathered as objects (a flat list of rows); "mixed": per sample, a
    # prediction with its string id (tensors and strings: the whole input goes as objects).
    acc = accelerator()
    n = acc.num_processes
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3))
    out = []
    for (x,) in loader:
        if kind == "objects":
            out += [row.item() for row in acc.gather_for_metrics(x, use_gather_object=True)]
        else:
            for pred, sample_id in acc.gather_for_metrics([(v, f"id{v.item()}") for v in x]):
                assert sample_id == f"id{pred.item()}"
                out.append(pred.item())
    assert sorted(out) == list(range(10)), (n, out)


@pytest.mark.mpi(min_size=2)
def test_shape_mismatch_is_a_clear_error_everywhere(comm):
    acc = accelerator()
    t = torch.zeros(2, 3 + acc.process_index)
    with pytest.raises(ConfigurationError, match="only the first dimension may differ"):
        acc.gather(t)
    with pytest.raises(ConfigurationError, match="shapes must match"):
        acc.reduce(torch.zeros(acc.process_index + 1))
    with pytest.raises(ConfigurationError, match="dtypes must match"):
        acc.gather(torch.zeros(2, dtype=torch.float32 if acc.is_main_process else torch.int64))
    acc.wait_for_everyone()  # still in step


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    ("first", "others", "expected"),
    [
        ("gather", "reduce", "gather on rank 0; reduce(sum) on {rest}"),
        ("pad", "gather", "pad_across_processes on rank 0; gather on {rest}"),
        ("gather_object", "gather", "gather_object on rank 0; gather on {rest}"),
        ("reduce_max", "reduce", "reduce(max) on rank 0; reduce(sum) on {rest}"),
        ("broadcast_own", "broadcast", "broadcast(from_process=0) on rank 0; broadcast(from_proc"),
    ],
    ids=["gather-reduce", "pad-gather", "objects-gather", "max-sum", "sources"],
)
def test_different_operations_on_different_ranks_are_one_clear_error(
    comm, first, others, expected
):
    """Operations that meet in the same MPI exchange (the shape check) but would then go on to
    different data-plane collectives (a hang, or wrong data): every rank raises the same error
    at once, naming who called what."""
    acc = accelerator()
    t = torch.ones(3)
    calls = {
        "gather": lambda: acc.gather(t),
        "reduce": lambda: acc.reduce(t),
        "reduce_max": lambda: acc.reduce(t, "max"),
        "pad": lambda: acc.pad_across_processes(t),
        "gather_object": lambda: acc.gather_for_metrics(["x"]),
        "broadcast": lambda: ops.broadcast(acc._partial.comm, t, 0),
        "broadcast_own": lambda: ops.broadcast(acc._partial.comm, t, acc.process_index),
    }
    # (broadcast_own: every rank names itself as the source)
    call = calls[first] if acc.process_index == 0 or first == "broadcast_own" else calls[others]
    with pytest.raises(CollectiveMismatchError) as error:
        call()
    text = str(error.value)
    rest = "rank 1" if comm.size == 2 else f"ranks 1-{comm.size - 1}"
    assert expected.format(rest=rest) in text, text
    assert text == comm.allgather(text)[0]  # the same error on every rank
    acc.wait_for_everyone()  # still in step


def test_pad_across_processes_checks_dimensions_on_every_rank(comm):
    acc = accelerator()
    rank = acc.process_index
    # other dimensions may differ: each rank pads only `dim`
    padded = acc.pad_across_processes(torch.ones(rank + 1, 2 + rank), dim=0)
    assert padded.shape == (acc.num_processes, 2 + rank)
    bad = torch.ones(2, 2) if rank == acc.num_processes - 1 else torch.ones(2)
    if acc.num_processes == 1:
        return
    with pytest.raises(ConfigurationError, match="number of dimensions must match"):
        acc.pad_across_processes(bad)


def test_pad_across_processes_leaves_tensors_without_that_dimension_alone(comm):
    """Generation outputs: tokens [B, L] padded along dim=1, labels [B] have no dim 1 and stay
    as they are (they were padded along dim 0 instead: a fake label after gathering)."""
    acc = accelerator()
    rank = acc.process_index
    rows = 2 if rank == 0 else 1  # uneven shares (even_batches=False, split_between_processes)
    batch = {
        "tokens": torch.ones(rows, 3 + rank, dtype=torch.long),
        "labels": torch.arange(rows) + 10 * rank,
    }
    padded = acc.pad_across_processes(batch, dim=1, pad_index=-1)
    assert padded["labels"] is batch["labels"]
    assert padded["tokens"].shape == (rows, 3 + acc.num_processes - 1)
    labels = acc.gather(padded["labels"]).tolist()
    assert labels == [0, 1] + [10 * r for r in range(1, acc.num_processes)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision(comm, precision):
    acc = accelerator(mixed_precision=precision)
    assert acc.mixed_precision == precision
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 8)
    out = model(x)
    assert out.dtype == torch.float32  # outputs come back in float32
    with acc.autocast():
        inner = torch.nn.functional.linear(x, torch.randn(2, 8))
    assert inner.dtype == (torch.bfloat16 if precision == "bf16" else torch.float16)
    loss = out.pow(2).mean()
    acc.backward(loss)
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isfinite(norm)
    before = params(acc.unwrap_model(model)).clone()
    opt.step()
    assert (acc.scaler is not None) == (precision == "fp16")
    if not acc.optimizer_step_was_skipped:
        assert not torch.equal(before, params(acc.unwrap_model(model)))
    bare = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert not hasattr(bare, "_mpaccel_original_forward")


class _Outputs(NamedTuple):
    logits: torch.Tensor
    extra: dict


class _Pair(torch.nn.Module):
    """Returns a named tuple, as some models return their outputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, x):
        out = self.linear(x)
        return _Outputs(out, {"scores": [out * 2]})


def test_mixed_precision_outputs_of_any_structure_come_back_in_float32(comm):
    """The prepared forward's outputs went through a float32 conversion of its own, which left
    named tuples alone (bfloat16 logits); it is now convert_to_fp32, Accelerate's, which
    rebuilds named tuples, mappings, lists and tuples at any depth."""
    acc = accelerator(mixed_precision="bf16")
    out = acc.prepare(_Pair())(torch.randn(4, 8))
    assert type(out) is _Outputs
    assert out.logits.dtype == torch.float32
    assert out.extra["scores"][0].dtype == torch.float32


class _Branchy(torch.nn.Module):
    """A model whose forward skips a parameter on odd steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.common, self.sometimes = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def forward(self, x, use_both):
        return self.common(x) + (self.sometimes(x) if use_both else 0)


def test_ddp_kwargs_reach_ddp_and_allow_unused_parameters(comm):
    handler = DistributedDataParallelKwargs(
        find_unused_parameters=True, bucket_cap_mb=1, gradient_as_bucket_view=True
    )
    assert handler.to_kwargs() == {
        "find_unused_parameters": True, "bucket_cap_mb": 1, "gradient_as_bucket_view": True,
    }
    acc = accelerator(kwargs_handlers=[handler])
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    if acc.num_processes > 1:
        assert model.find_unused_parameters and model.gradient_as_bucket_view
        assert model.bucket_bytes_cap == 1024 * 1024
    for step in range(4):  # without find_unused_parameters DDP raises on the second step
        loss = model(torch.full((2, 8), float(acc.process_index)), use_both=step % 2 == 0)
        acc.backward(loss.sum())
        opt.step()
        opt.zero_grad()
    everyone = acc.gather(params(acc.unwrap_model(model))[None])
    assert all(torch.equal(everyone[0], other) for other in everyone)


def test_grad_scaler_kwargs(comm):
    acc = accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    assert acc.scaler.get_scale() == 1024.0
    assert accelerator(mixed_precision="no", kwargs_handlers=[GradScalerKwargs()]).scaler is None


def test_kwargs_handlers_are_checked():
    with pytest.raises(AttributeError, match="find_unused_params"):
        DistributedDataParallelKwargs().find_unused_params = True
    with pytest.raises(ConfigurationError, match="bucket_cap_mb"):
        DistributedDataParallelKwargs(bucket_cap_mb=0)
    with pytest.raises(ConfigurationError, match="more than one"):
        accelerator(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])
    with pytest.raises(ConfigurationError, match="mpaccel understands"):
        accelerator(kwargs_handlers=[GradientAccumulationPlugin()])


def test_fp16_clipping_sees_unscaled_gradients(comm):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    reference = _model()
    reference(x).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    acc = accelerator(mixed_precision="fp16")
    assert acc.scaler.get_scale() > 1000  # the loss is scaled up before backward
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(x).pow(2).mean())  # the same batch on every rank: the mean is the same
    norm = acc.clip_grad_norm_(model.parameters(), 1e-3)
    # unscaled before measuring (fp16 autocast rounds a little); then clipped to the max norm
    torch.testing.assert_close(norm, expected, rtol=2e-2, atol=0)
    clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert clipped <= 1e-3 * 1.01


def test_fp16_clipping_while_accumulating_is_refused(comm):
    # Unscaling on a micro-batch that accumulates would let the next backward add scaled
    # gradients to unscaled ones (Accelerate: torch raises only at the next unscale, after
    # the damage). Refused at once; clipping when sync_gradients is set works.
    acc = accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    with acc.accumulate(model):
        acc.backward(model(x).pow(2).mean())
        assert not acc.sync_gradients
        with pytest.raises(ConfigurationError, match="micro-batch that accumulates"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(ConfigurationError, match=r"if accelerator\.sync_gradients"):
            acc.clip_grad_value_(model.parameters(), 1.0)
    with acc.accumulate(model):
        acc.backward(model(x).pow(2).mean())
        assert acc.sync_gradients
        assert torch.isfinite(acc.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()


def test_clip_grad_value_and_save(comm, mpi_tmp_path):
    acc = accelerator()
    model = acc.prepare(_model())
    (model(torch.randn(4, 8)) * 1000).sum().backward()
    acc.clip_grad_value_(model.parameters(), 0.01)
    assert all(p.grad.abs().max() <= 0.01 + 1e-9 for p in model.parameters())
    path = mpi_tmp_path / "weights.pt"
    acc.save({"w": torch.ones(3)}, path)
    acc.wait_for_everyone()
    assert torch.load(path)["w"].sum() == 3
    a, b = acc.free_memory(model, path)
    assert a is None and b is None and acc._models == []


@pytest.mark.parametrize("set_up_again", [True, False])
def test_a_paused_pass_collected_after_a_reset_leaves_the_new_state_alone(comm, set_up_again):
    # A peeked pass ends only when its iterator is collected, possibly after reset_state: it
    # raised ValueError from GradientState then (printed as an unraisable exception), and
    # AttributeError before any new state was set up.
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    paused = iter(loader)
    next(paused)
    reset_state()
    fresh = Accelerator(cpu=True) if set_up_again else None
    seen = []
    previous, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        del paused
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert seen == []
    if fresh is not None:
        assert fresh.gradient_state.active_dataloader is None


def test_fp16_clipping_with_two_optimizers_unscales_each_step(comm):
    """GAN-style: two models, two optimizers, one GradScaler. Each clip must see unscaled
    gradients: one optimizer's step updates the shared scaler, which makes the other's next
    gradients scaled again (the second one's norm came out x the loss scale)."""
    acc = accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(second.parameters(), lr=0.01)
    first, second, opt_a, opt_b = acc.prepare(first, second, opt_a, opt_b)
    x = torch.ones(2, 4)
    for _ in range(3):
        for model, opt in ((first, opt_a), (second, opt_b)):
            acc.backward(model(x).sum())
            scale = acc.scaler.get_scale()
            expected = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])) / scale
            norm = acc.clip_grad_norm_(model.parameters(), 1e9)
            assert torch.allclose(norm, expected, rtol=1e-3), (float(norm), float(expected))
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("kind", ["onecycle", "plateau"])
def test_schedulers_under_gradient_accumulation(comm, kind):
    """OneCycleLR sized for the optimizer steps runs its whole cycle under accumulation (it
    stopped a quarter of the way), and ReduceLROnPlateau steps under accumulation (it raised
    AttributeError: no _step_count)."""
    acc = accelerator(gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(list(torch.ones(32 * comm.size, 2)), batch_size=1)
    micro_batches = len(loader) // comm.size  # per rank, once prepared
    steps = micro_batches // 4
    if kind == "onecycle":
        # as Hugging Face's examples size it: per-rank batches / accumulation, x processes
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1.0, total_steps=steps * comm.size
        )
    else:
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    model, opt, loader, scheduler = acc.prepare(model, opt, loader, scheduler)
    for batch in loader:
        with acc.accumulate(model):
            acc.backward(model(batch).sum())
            opt.step()
            if kind == "onecycle":
                scheduler.step()
            else:
                scheduler.step(1.0)  # a metric that never improves
            opt.zero_grad()
    if kind == "onecycle":
        assert scheduler.scheduler.last_epoch == steps * comm.size  # the whole cycle
        plain = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        reference = torch.optim.lr_scheduler.OneCycleLR(
            plain, max_lr=1.0, total_steps=steps * comm.size
        )
        for _ in range(steps * comm.size):
            plain.step()
            reference.step()
        assert scheduler.get_last_lr() == reference.get_last_lr()
    else:
        assert opt.param_groups[0]["lr"] < 0.1  # reduced, as it should


def test_preparing_twice_returns_what_was_prepared(comm):
    acc = accelerator()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    prepared, opt, sched = acc.prepare(model, opt, sched)
    again, sched_again = acc.prepare(prepared, sched)
    assert again is prepared and sched_again is sched
    assert acc.prepare(model) is prepared  # the module inside a prepared model too
    assert len(acc._models) == 1 and len(acc._schedulers) == 1
    acc.backward(prepared(torch.ones(1, 2)).sum())
    opt.step()
    sched.step()
    assert sched.scheduler.last_epoch == comm.size  # N steps per optimizer step, not N^2


def test_a_model_prepared_before_free_memory_comes_back_as_it_is(comm):
    """transformers' Trainer prepares in evaluate(), calls free_memory(), then prepares the
    prepared model again in train(): it must come back as it is (no DDP inside a DDP)."""
    acc = accelerator()
    torch.manual_seed(0)
    prepared = acc.prepare(torch.nn.Linear(2, 2))
    acc.free_memory()
    opt = torch.optim.SGD(prepared.parameters(), lr=0.1)
    again, opt = acc.prepare(prepared, opt)
    assert again is prepared and acc._models == [prepared]
    acc.backward(again(torch.ones(1, 2)).sum())
    opt.step()
    weights = acc.unwrap_model(again).weight.detach()
    assert all(torch.equal(weights, w) for w in comm.allgather(weights))


@pytest.mark.mpi(min_size=2)
def test_trigger_sync_in_backward_all_reduces_inside_no_sync(comm):
    acc = accelerator()
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(2, 1))
    x = torch.full((1, 2), float(acc.process_index + 1))

    def gradient(trigger: bool) -> torch.Tensor:
        model.zero_grad()
        with acc.no_sync(model):
            if trigger:
                with acc.trigger_sync_in_backward(model):
                    acc.backward(model(x).sum())
            else:
                acc.backward(model(x).sum())
        return acc.unwrap_model(model).weight.grad.clone()

    local = gradient(False)  # each rank its own
    assert len({tuple(g.tolist()[0]) for g in comm.allgather(local)}) == comm.size
    synced = gradient(True)  # the mean over the ranks, the same everywhere
    assert all(torch.equal(synced, g) for g in comm.allgather(synced))
    mean = sum(comm.allgather(local)) / comm.size
    assert torch.allclose(synced, mean)


# -- torch.compile (dynamo_backend / dynamo_plugin) ----------------------------------------------


def _train_steps(acc, model, opt, dataset, steps_per_update):
    loader = acc.prepare(DataLoader(dataset, batch_size=GLOBAL_BATCH // acc.num_processes))
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()


@pytest.mark.slow  # torch's compiler takes 3-8 s to import here
@pytest.mark.parametrize("accumulation", [1, 2])
def test_dynamo_backend_compiles_the_prepared_model(comm, accumulation):
    """Accelerator(dynamo_backend=...) compiled nothing: the model is now torch.compile's
    wrapper (around DDP at size > 1) and trains as the uncompiled single-process reference,
    accumulate() still suppressing DDP's all-reduce through the wrapper."""
    from mpaccel.training import is_compiled_module

    acc = accelerator(dynamo_backend="eager", gradient_accumulation_steps=accumulation)
    assert acc.state.dynamo_plugin.backend == "EAGER"
    inner = _model()
    model, opt = acc.prepare(inner, torch.optim.SGD(inner.parameters(), lr=0.05))
    assert is_compiled_module(model)
    assert acc.prepare(model) is model  # prepared already
    reduces = _count_all_reduces(distributed.ddp_of(model)) if comm.size > 1 else []
    dataset = _data()
    _train_steps(acc, model, opt, dataset, accumulation)
    if comm.size > 1:  # one bucket: one all-reduce per optimizer step, none in between
        assert len(reduces) == len(dataset) // GLOBAL_BATCH // accumulation
    expected = params(_reference(dataset, accumulation, epochs=1))
    assert torch.allclose(params(acc.unwrap_model(model)), expected, atol=1e-5)
    # unwrap_model: compiled around the user's module by default, bare on request
    kept = acc.unwrap_model(model)
    assert is_compiled_module(kept) and kept._orig_mod is inner
    assert acc.unwrap_model(model, keep_torch_compile=False) is inner
    assert list(acc.get_state_dict(model)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert acc._models[0] is not model  # checkpoints see the uncompiled model


def test_dynamo_plugin_options_reach_torch_compile(comm, monkeypatch):
    from mpaccel.utils import TorchDynamoPlugin

    seen = {}

    def fake_compile(model, **kwargs):
        seen.update(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=True, dynamic=False)
    acc = accelerator(dynamo_plugin=plugin)
    acc.prepare(_model())
    assert seen == {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    seen.clear()
    accelerator(dynamo_backend="no").prepare(_model())
    assert seen == {}


class _Stack(torch.nn.Module):
    """A transformer's shape in small: a layer in, a ModuleList of like blocks, a head."""

    def __init__(self, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)
        )
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.slow  # torch's compiler takes 3-8 s to import here
def test_regional_compilation_compiles_each_block_and_trains_the_same(comm):
    """TorchDynamoPlugin(use_regional_compilation=True) was refused: prepare() now returns
    compile_regions' copy (around DDP at size > 1, made last as Accelerate does), each
    repeated block compiled on its own, the rest apart; it trains as the uncompiled
    single-process reference, and checkpoints and unwrap_model see the user's module."""
    from mpaccel.training import is_compiled_module
    from mpaccel.utils import TorchDynamoPlugin

    acc = accelerator(
        dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    inner = _Stack()
    model, opt = acc.prepare(inner, torch.optim.SGD(inner.parameters(), lr=0.05))
    regions = model.module if comm.size > 1 else model
    assert comm.size == 1 or distributed.ddp_of(model) is model  # DDP's copy, outermost
    assert not is_compiled_module(regions) and type(regions) is _Stack
    assert all(is_compiled_module(b) and b._orig_mod is inner.blocks[i]
               for i, b in enumerate(regions.blocks))  # fmt: skip
    assert is_compiled_module(regions.embed) and is_compiled_module(regions.head)
    assert not any(is_compiled_module(m) for m in inner.modules())  # the user's stays as it was
    assert acc.prepare(model) is model  # prepared already
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    dataset = _data()
    loader = acc.prepare(DataLoader(dataset, batch_size=GLOBAL_BATCH // acc.num_processes))
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    # the three blocks share one graph (the compiler's cache): embed, a block, the head
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    reference = _Stack()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for x, y in DataLoader(dataset, batch_size=GLOBAL_BATCH):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    assert torch.allclose(params(inner), params(reference), atol=1e-5)
    assert acc.unwrap_model(model, keep_torch_compile=False) is inner
    assert acc.unwrap_model(model) is regions
    assert list(acc.get_state_dict(model)) == list(inner.state_dict())  # no _orig_mod.


@pytest.mark.slow  # inductor compiles C++ (14 s the first time on this machine)
def test_inductor_backend(comm):
    from mpaccel.training import is_compiled_module

    acc = accelerator(dynamo_backend="inductor")
    model = acc.prepare(_model())
    assert is_compiled_module(model)
    x = torch.randn(4, 8)
    assert torch.allclose(model(x), acc.unwrap_model(model, keep_torch_compile=False)(x))


# -- DDP communication hooks ---------------------------------------------------------------------


class _PerRank(torch.nn.Module):
    """Accelerate's test_ddp_comm_hook model: gradients that differ from rank to rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.p = torch.nn.Parameter(torch.randn(40, 20))

    def forward(self, x, rank):
        return self.p * (x ** (1 + rank))


def _hook_grads(model, rank):
    torch.manual_seed(2024)
    model(torch.randn(40, 20), rank).mean().backward()
    return next(model.parameters()).grad


@pytest.mark.parametrize(
    "hook, wrapper, option",
    [
        ("no", "no", {}),
        ("fp16", "no", {}),
        ("power_sgd", "no", {}),
        ("power_sgd", "fp16", {}),
        ("power_sgd", "no", {"matrix_approximation_rank": 2}),
        ("batched_power_sgd", "no", {}),
        ("batched_power_sgd", "fp16", {}),
    ],
)
def test_ddp_comm_hooks_are_registered_and_reduce(comm, hook, wrapper, option):
    """DistributedDataParallelKwargs(comm_hook=...) is registered on the DDP model: the
    gradients are the all-reduced ones, within the compression's error (Accelerate's test)."""
    from mpaccel.utils import DDPCommunicationHookType

    kwargs = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType(hook), comm_wrapper=wrapper, comm_state_option=option
    )
    assert "comm_hook" not in kwargs.to_kwargs()  # not a DistributedDataParallel argument
    acc = accelerator(kwargs_handlers=[kwargs])
    model = acc.prepare(_PerRank())
    if comm.size > 1:  # DDP names the hook it runs
        named = model._get_ddp_logging_data().get("comm_hook")
        assert (named is not None) == (hook != "no"), named
        if named is not None and wrapper == "no":
            assert hook.replace("_", "").lower() in named.replace("_", "").lower(), named
    grads = _hook_grads(model, acc.local_process_index)
    expected = sum(_hook_grads(_PerRank(), rank) for rank in range(comm.size)) / comm.size
    torch.testing.assert_close(grads, expected, rtol=1e-2, atol=1e-2)


def test_bf16_comm_hooks_on_cpu_are_a_clear_error(comm):
    from mpaccel.utils import DDPCommunicationHookType

    for kwargs in (
        {"comm_hook": DDPCommunicationHookType.BF16},
        {"comm_hook": "power_sgd", "comm_wrapper": "bf16"},
    ):
        acc = accelerator(kwargs_handlers=[DistributedDataParallelKwargs(**kwargs)])
        if comm.size == 1:  # no DDP: nothing registered, as in Accelerate
            acc.prepare(_PerRank())
            continue
        with pytest.raises(ConfigurationError, match="HINT: bfloat16 compression needs NCCL"):
            acc.prepare(_PerRank())
    with pytest.raises(ConfigurationError, match="not a wrapper"):
        DistributedDataParallelKwargs(comm_wrapper="power_sgd")
    with pytest.raises(ConfigurationError, match="not a communication hook"):
        DistributedDataParallelKwargs(comm_hook="fp8")


# -- profiler -----------------------------------------------------------------------------------


def test_profile_refuses_an_activity_torch_does_not_know():
    # profiling itself runs in jobs of its own: tests/test_profile.py
    from mpaccel.utils import ProfileKwargs

    with pytest.raises(ConfigurationError, match="not a profiler activity"):
        ProfileKwargs(activities=["gpu"]).build()


# -- fp16 on CPU ---------------------------------------------------------------------------------


def test_fp16_on_cpu_warns_once(comm, monkeypatch):
    from mpaccel import training

    monkeypatch.setattr(training, "_warned_fp16_on_cpu", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator(mixed_precision="fp16")
        accelerator(mixed_precision="fp16")
        accelerator(mixed_precision="bf16")
    mine = [w for w in caught if "fp16" in str(w.message) and "float32" in str(w.message)]
    assert len(mine) == (1 if comm.rank == 0 else 0)  # once, on the main process
    assert mine == [] or issubclass(mine[0].category, UserWarning)


def test_lomo_optimizers_are_noticed_and_their_backward_refused(comm):
    reset_state()
    acc = Accelerator()
    model = torch.nn.Linear(2, 1)
    acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.has_lomo_optimizer is False
    # identified by its package, as lomo-optim is not installed here
    lomo = type("Lomo", (torch.optim.SGD,), {"__module__": "lomo_optim.lomo"})
    acc.prepare_optimizer(lomo(model.parameters(), lr=0.1))
    assert acc.has_lomo_optimizer is True
    loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(ConfigurationError, match=r"(?s)not supported by mpaccel.*HINT"):
        acc.lomo_backward(loss, 0.1)
