"""Checkpoints of tensor-parallel training through the Accelerator: save_state writes each rank's
N-D blocks (tp, and dp_shard under FSDP2) of the model, its optimizer and, mid-accumulation,
its gradients; load_state reads them back on another mesh (without TP, at other tp sizes, in
one process); save_model writes the whole tensors, each rank its own parts."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from mpaccel.checkpoint import CheckpointCollectiveError, load_model_state
from mpaccel.parallelism_config import ParallelismConfig
from mpaccel.utils import FullyShardedDataParallelPlugin, TorchTensorParallelConfig
from tests.conftest import accelerator
from tests.strategy.test_fsdp_checkpoint_resume import _micro_batches
from tests.strategy.test_tensor_parallel import GLOBAL_BATCH, HIDDEN, PLAN, WIDTH, Net, _data

pytestmark = [pytest.mark.mpi_timeout(300), pytest.mark.usefixtures("no_group_left_behind")]

ACCUMULATE = 2


def _accelerator(tp: int = 1, dp_shard: int = 1, **kwargs):
    """tp > 1: TensorParallel (with FSDP2 when dp_shard > 1); else FSDP2 over every rank when
    dp_shard > 1, DDP or one process otherwise."""
    if dp_shard > 1:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin()
    if tp > 1:
        handler = TorchTensorParallelConfig(tp_plan=PLAN)
        kwargs["parallelism_config"] = ParallelismConfig(
            tp_size=tp, dp_shard_size=dp_shard, tp_handler=handler)
    return accelerator(**kwargs)


def _prepared(acc, seed: int = 1, model: torch.nn.Module | None = None):
    model = Net(seed=seed) if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(_data(64), batch_size=GLOBAL_BATCH // acc.strategy.data_parallel_size)
    return acc.prepare(model, opt, loader)


def _whole(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _full(acc, model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, whole (a gather: for checking only)."""
    out = {f"model/{k}": _whole(v).detach().clone()
           for k, v in acc.unwrap_model(model).state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        out.update({f"optim/{pid}.{k}": _whole(v).clone() for k, v in state.items()})
    return out


def _equal(got: dict, expected: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    assert got.keys() == expected.keys()
    for key in got:
        torch.testing.assert_close(got[key], expected[key], rtol=rtol, atol=atol, msg=key)


def _needs(comm, *sizes: int) -> None:
    if comm.size not in sizes:
        pytest.skip(f"runs at {' or '.join(map(str, sizes))} ranks")


def test_pure_tp_checkpoint_loads_without_tp_and_back(comm, mpi_tmp_path):
    _needs(comm, 2, 4)
    acc = _accelerator(tp=comm.size)
    model, opt, loader = _prepared(acc)
    _micro_batches(acc, model, opt, loader, 2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    expected = _full(acc, model, opt)
    for tp in (1, comm.size):  # into DDP (no TP), then into TP again
        acc = _accelerator(tp=tp)
        model, opt, loader = _prepared(acc, seed=7)
        acc.load_state(directory)
        _equal(_full(acc, model, opt), expected)


@pytest.mark.parametrize("kind", ["pure", "2d"])
def test_resume_mid_accumulation_equals_uninterrupted(comm, mpi_tmp_path, kind):
    _needs(comm, *((2, 4) if kind == "pure" else (4,)))
    layout = {"tp": comm.size} if kind == "pure" else {"tp": 2, "dp_shard": comm.size // 2}
    acc = _accelerator(**layout, gradient_accumulation_steps=ACCUMULATE)
    model, opt, loader = _prepared(acc)
    _micro_batches(acc, model, opt, loader, ACCUMULATE + 1)  # a step, then 1 of the next 2
    assert not acc.sync_gradients
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    after = _micro_batches(acc, model, opt, loader, 1 + ACCUMULATE)
    expected = _full(acc, model, opt)

    acc = _accelerator(**layout, gradient_accumulation_steps=ACCUMULATE)
    model, opt, loader = _prepared(acc, seed=7)  # other weights, fresh optimizer, no gradients
    acc.load_state(directory)
    resumed = _micro_batches(acc, model, opt, loader, 1 + ACCUMULATE)
    # Pure TP: bit-equal. Under FSDP2 the resumed run adds two averages, the saved one and
    # the next micro-batch's, where the uninterrupted run averages their sum once: the float
    # sums differ in order (measured: 3e-8 at most, one step later).
    tolerance = {"rtol": 0.0, "atol": 0.0} if kind == "pure" else {"rtol": 1e-6, "atol": 1e-7}
    assert resumed == pytest.approx(after, rel=tolerance["rtol"], abs=tolerance["atol"])
    _equal(_full(acc, model, opt), expected, **tolerance)


@pytest.mark.parametrize("kind", ["pure", "2d"])
def test_save_model_writes_the_full_state_dict(comm, mpi_tmp_path, kind):
    _needs(comm, *((2, 4) if kind == "pure" else (4,)))
    layout = {"tp": comm.size} if kind == "pure" else {"tp": 2, "dp_shard": comm.size // 2}
    acc = _accelerator(**layout)
    model, opt, loader = _prepared(acc)
    _micro_batches(acc, model, opt, loader, 1)
    full = acc.get_state_dict(model, all_ranks=True)
    assert model.blocks[0].down.weight.placements[-1].is_shard(1)  # a block of columns
    for safe in (True, False):
        out = mpi_tmp_path / f"model-{safe}"
        acc.save_model(model, str(out), safe_serialization=safe)
        comm.Barrier()
        if safe:
            import safetensors.torch

            written = safetensors.torch.load_file(str(out / "model.safetensors"))
        else:
            written = load_model_state(str(out))
        _equal(written, full)


def test_a_refused_load_changes_nothing_and_every_rank_says_so(comm, mpi_tmp_path):
    _needs(comm, 2, 4)
    acc = _accelerator(tp=comm.size)
    model, opt, loader = _prepared(acc)
    _micro_batches(acc, model, opt, loader, 1)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    acc = _accelerator(tp=comm.size)
    other = Net(seed=3)
    other.blocks[1].up = torch.nn.Linear(WIDTH, 2 * HIDDEN)  # twice the checkpoint's rows
    other.blocks[1].down = torch.nn.Linear(2 * HIDDEN, WIDTH)
    other, opt, loader = _prepared(acc, model=other)
    before = _full(acc, other, opt)
    with pytest.raises(CheckpointCollectiveError, match=r"blocks\.1\.up\.weight") as info:
        acc.load_state(directory)
    assert f"rank(s) {', '.join(map(str, range(comm.size)))}" in str(info.value)
    _equal(_full(acc, other, opt), before)
    assert not opt.state_dict()["state"]  # the fresh optimizer is fresh again


SCRIPT = textwrap.dedent('''
    import os, sys
    import numpy as np, torch
    sys.path.insert(0, ROOT_DIR)
    import tests.strategy.test_tensor_parallel_checkpoint as t

    mode, directory = sys.argv[1], sys.argv[2]
    reference = os.path.join(directory, "reference.npz")
    ckpt = os.path.join(directory, "ckpt")
    if mode == "save":  # 4 ranks: tp=2 x dp_shard=2, then loaded at tp=4
        acc = t._accelerator(tp=2, dp_shard=2)
        model, opt, loader = t._prepared(acc)
        t._micro_batches(acc, model, opt, loader, 2)
        acc.save_state(ckpt)
        expected = t._full(acc, model, opt)
        if acc.is_main_process:
            np.savez(reference, **{k: v.numpy() for k, v in expected.items()})
        layouts = [{"tp": 4}]
    else:  # load2, 2 ranks: FSDP2 over dp_shard=2 without TP; 1: one process
        expected = {k: torch.from_numpy(v) for k, v in np.load(reference).items()}
        layouts = [{"dp_shard": 2} if mode == "load2" else {}]
    for layout in layouts:
        acc = t._accelerator(**layout)
        model, opt, loader = t._prepared(acc, seed=7)
        acc.load_state(ckpt)
        t._equal(t._full(acc, model, opt), expected)
        print("loaded", acc.num_processes, sorted(layout.items()), flush=True)
''')


@pytest.mark.launches
@pytest.mark.mpi(size=1)  # nests mpiexec
@pytest.mark.mpi_timeout(900)
def test_saved_at_tp2_dp2_loads_at_tp4_fsdp2_and_one_process(tmp_path):
    from mpaccel.testing import run_mpi

    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("ROOT_DIR", repr(str(Path(__file__).parents[2]))))
    run = run_mpi([str(script), "save", str(tmp_path)], n=4, timeout=300).check()
    assert "loaded 4 [('tp', 4)]" in run.stdout[0], run.describe()
    sizes = (1, 2)  # the loads only read: both at once
    with ThreadPoolExecutor(len(sizes)) as pool:
        runs = pool.map(
            lambda n: run_mpi([str(script), f"load{n}", str(tmp_path)], n=n, timeout=300), sizes
        )
    said = {1: "loaded 1 []", 2: "loaded 2 [('dp_shard', 2)]"}
    for n, run in zip(sizes, runs):
        assert said[n] in run.check().stdout[0], run.describe()

