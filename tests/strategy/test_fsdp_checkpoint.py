"""Checkpoints of fully sharded training through the Accelerator: save_state writes each rank's
rows (the sharded part) beside the rest of the training state; load_state reads them back at
any world size, into FSDP or into DDP / one process, and DDP checkpoints load into FSDP."""

from __future__ import annotations

import json
import os
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from mpaccel import Accelerator
from mpaccel.checkpoint import CheckpointCollectiveError, load_model_state
from mpaccel.testing import reset_state
from mpaccel.utils import ProjectConfiguration
from tests.strategy.test_fsdp import GLOBAL_BATCH, Tiny, _data, _plugin

pytestmark = [pytest.mark.mpi_timeout(300), pytest.mark.usefixtures("no_group_left_behind")]


def _accelerator(sharded: bool = True, **kwargs) -> Accelerator:
    reset_state()
    if sharded:
        kwargs["fsdp_plugin"] = _plugin()
    return Accelerator(**kwargs)


def _prepared(acc: Accelerator, seed: int = 1):
    model = Tiny(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // acc.num_processes)
    return acc.prepare(model, opt, loader, sched)


def _steps(acc, model, opt, loader, sched, count: int) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= count:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def _full(acc, model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, whole (a gather: for checking only)."""
    def whole(v):
        return v.full_tensor() if hasattr(v, "full_tensor") else v

    out = {f"model/{k}": whole(v).detach().clone()
           for k, v in acc.unwrap_model(model).state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        out.update({f"optim/{pid}.{k}": whole(v).clone() for k, v in state.items()})
    return out


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_resume_equals_uninterrupted_training(comm, mpi_tmp_path):
    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    lr = sched.get_last_lr()
    after = _steps(acc, model, opt, loader, sched, 2)
    expected = _full(acc, model, opt)

    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc, seed=7)  # other weights, a fresh optimizer
    acc.load_state(directory)
    assert sched.get_last_lr() == lr
    resumed = _steps(acc, model, opt, loader, sched, 2)
    assert resumed == pytest.approx(after, rel=1e-5)
    _close(_full(acc, model, opt), expected)
    index = json.loads((mpi_tmp_path / "ckpt" / "sharded.index.json").read_text())
    slices = index["sliced"]["model_0/blocks.0.fc.weight"]["slices"]
    assert len(slices) == comm.size  # 10 rows: every rank stored its own
    state = json.loads((mpi_tmp_path / "ckpt" / "state.index.json").read_text())
    assert state["metadata"]["sharded"] == index["save_id"]
    assert "model_0" not in state["components"]


def _saved_then_loaded(mpi_tmp_path, save_sharded: bool, load_sharded: bool):
    """Train two steps in one mode, save_state; load into a fresh job in the other mode."""
    acc = _accelerator(sharded=save_sharded)
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    expected = _full(acc, model, opt)
    acc = _accelerator(sharded=load_sharded)
    model, opt, loader, sched = _prepared(acc, seed=7)
    acc.load_state(directory)
    _close(_full(acc, model, opt), expected)
    return acc, model, opt


def test_fsdp_checkpoint_loads_into_ddp_or_one_process(comm, mpi_tmp_path):
    _saved_then_loaded(mpi_tmp_path, save_sharded=True, load_sharded=False)


def test_ddp_checkpoint_loads_into_fsdp(comm, mpi_tmp_path):
    acc, model, opt = _saved_then_loaded(mpi_tmp_path, save_sharded=False, load_sharded=True)
    assert type(next(acc.unwrap_model(model).parameters())).__name__ == "DTensor"


def test_a_shape_mismatch_is_one_error_naming_the_key_and_changes_nothing(comm, mpi_tmp_path):
    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 1)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    acc = _accelerator()
    other = Tiny(seed=3)
    other.head = torch.nn.Linear(10, 2)  # 2 outputs where the checkpoint has 1
    opt = torch.optim.AdamW(other.parameters(), lr=0.01)
    other, opt = acc.prepare(other, opt)
    before = _full(acc, other, opt)
    with pytest.raises(CheckpointCollectiveError, match=r"head\.weight") as info:
        acc.load_state(directory)
    assert f"rank(s) {', '.join(map(str, range(comm.size)))}" in str(info.value)
    _close(_full(acc, other, opt), before)
    assert not opt.state_dict()["state"]  # the fresh optimizer is fresh again


def test_async_save_writes_the_state_of_the_moment(comm, mpi_tmp_path):
    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 1)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"), async_save=True)
    expected = _full(acc, model, opt)
    _steps(acc, model, opt, loader, sched, 2)  # changes the shards while it writes
    acc.wait_for_checkpoint()
    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc, seed=7)
    acc.load_state(directory)
    _close(_full(acc, model, opt), expected)


def test_save_model_writes_full_tensors_and_rotation_sees_fsdp_checkpoints(comm, mpi_tmp_path):
    project = str(mpi_tmp_path / "project")
    acc = _accelerator(project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 1)
    acc.save_model(model, str(mpi_tmp_path / "hdf5"), safe_serialization=False)
    full = acc.get_state_dict(model, all_ranks=True)
    _close(load_model_state(str(mpi_tmp_path / "hdf5")), full)
    import safetensors.torch

    for size, files in (("10GB", ["model.safetensors"]), ("600B", None)):  # one file, shards
        target = mpi_tmp_path / f"safetensors-{size}"
        acc.save_model(model, str(target), max_shard_size=size)
        names = sorted(n for n in os.listdir(target) if n.endswith(".safetensors"))
        assert files is None or names == files
        loaded = {}
        for name in names:
            loaded.update(safetensors.torch.load_file(str(target / name)))
        _close(loaded, full)
        if files is None:
            index = json.loads((target / "model.safetensors.index.json").read_text())
            assert len(names) > 1 and set(index["weight_map"]) == set(full)
    for _ in range(3):
        acc.save_state()
    names = sorted(os.listdir(os.path.join(project, "checkpoints")))
    assert names == ["checkpoint_1", "checkpoint_2"]
    acc.load_state()  # the latest


# -- other world sizes, and a crash, in jobs of their own ----------------------------------------

SCRIPT = textwrap.dedent('''
    import os, signal, sys
    import numpy as np, torch
    sys.path.insert(0, ROOT_DIR)
    import tests.strategy.test_fsdp_checkpoint as t
    from mpaccel.checkpoint.sharded import save as sharded
    from mpaccel.utils import ProjectConfiguration

    mode, directory = sys.argv[1], sys.argv[2]
    reference = os.path.join(directory, "reference.npz")
    project = ProjectConfiguration(project_dir=directory, automatic_checkpoint_naming=True)
    if mode in ("save", "crash"):
        acc = t._accelerator(project_config=project)
        model, opt, loader, sched = t._prepared(acc)
        t._steps(acc, model, opt, loader, sched, 2)
        saved = t._full(acc, model, opt)
        acc.save_state()
        if acc.is_main_process:
            np.savez(reference, **{k: v.numpy() for k, v in saved.items()})
        if mode == "crash":
            t._steps(acc, model, opt, loader, sched, 1)
            if acc.process_index == 1:
                write = sharded._write_rank_file

                def crash(path, local):
                    write(path, local)
                    os.kill(os.getpid(), signal.SIGKILL)  # its file written, nothing committed

                sharded._write_rank_file = crash
            acc.save_state()
    else:
        expected = {k: torch.from_numpy(v) for k, v in np.load(reference).items()}
        for fsdp in (True, False):  # into shards, then into DDP / one process
            acc = t._accelerator(sharded=fsdp, project_config=project)
            model, opt, loader, sched = t._prepared(acc, seed=7)
            acc.load_state()
            t._close(t._full(acc, model, opt), expected)
            print("loaded", acc.num_processes, "fsdp" if fsdp else "plain", flush=True)
''')


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("ROOT_DIR", repr(str(Path(__file__).parents[2]))))
    return script


@pytest.mark.launches
@pytest.mark.mpi(size=1)  # nests mpiexec
def test_saved_at_4_loads_at_1_and_3(tmp_path):
    from mpaccel.testing import run_mpi

    script = _script(tmp_path)
    run_mpi([str(script), "save", str(tmp_path)], n=4, timeout=240).check()
    # The loads only read: one job per size, both at once (each spends much of its time
    # starting up and waiting on the other, which one after another summed).
    # 1: every row in one rank; 3: rows split unevenly across the saved shards' bounds
    # (4/4/2 from 3/3/3/1), and ranks with no rows (the head's one). 4 -> 2, whole shards
    # merged, is 4 -> 1's path at half the cost; 4 -> 5 read the same plan as 4 -> 3 (21 s of
    # CPU for no other line of code).
    sizes = (1, 3)
    with ThreadPoolExecutor(len(sizes)) as pool:
        runs = pool.map(
            lambda n: run_mpi([str(script), "load", str(tmp_path)], n=n, timeout=240), sizes
        )
    for n, run in zip(sizes, runs):
        assert f"loaded {n} fsdp\nloaded {n} plain" in run.check().stdout[0], run.describe()


@pytest.mark.launches
@pytest.mark.mpi(size=1)  # nests mpiexec
def test_a_rank_killed_during_a_sharded_save_leaves_the_last_checkpoint(tmp_path):
    from mpaccel.testing import run_mpi

    script = _script(tmp_path)
    run = run_mpi([str(script), "crash", str(tmp_path)], n=2, timeout=240)
    assert run.returncode != 0 and not run.timed_out, run.describe()
    debris = os.listdir(tmp_path / "checkpoints" / "checkpoint_1")
    assert any(name.startswith("sharded-") for name in debris)  # it got as far as its files
    assert "state.index.json" not in debris
    run = run_mpi([str(script), "load", str(tmp_path)], n=2, timeout=240).check()
    assert "loaded 2 fsdp\nloaded 2 plain" in run.stdout[0], run.describe()


def test_ckpt_ls_verify_and_export_see_both_parts(comm, mpi_tmp_path, capsys):
    from mpaccel.checkpoint.cli import run_export, run_ls, run_verify

    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 1)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    full = acc.get_state_dict(model, all_ranks=True)
    if comm.rank != 0:
        return
    import argparse

    import safetensors.torch

    args = argparse.Namespace(directory=directory, stem=None, component=None,
                              output=str(mpi_tmp_path / "model.safetensors"))
    assert run_ls(args) == 0
    listed = capsys.readouterr().out
    assert "state checkpoint" in listed and "sharded checkpoint" in listed
    assert "model_0/blocks.0.fc.weight" in listed
    assert run_verify(args) == 0
    assert " FAILED" not in capsys.readouterr().out
    assert run_export(args) == 0
    _close(safetensors.torch.load_file(args.output), full)


def test_accelerates_fsdp_helpers_save_load_and_merge(comm, mpi_tmp_path):
    from mpaccel.utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        merge_fsdp_weights,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 1)
    plugin, out = acc.state.fsdp_plugin, str(mpi_tmp_path / "out")
    save_fsdp_model(plugin, acc, model, out)
    save_fsdp_optimizer(plugin, acc, opt, model, out)
    expected = _full(acc, model, opt)
    full = acc.get_state_dict(model, all_ranks=True)
    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc, seed=7)
    load_fsdp_model(acc.state.fsdp_plugin, acc, model, out)
    load_fsdp_optimizer(acc.state.fsdp_plugin, acc, opt, model, out)
    _close(_full(acc, model, opt), expected)
    if comm.rank == 0:
        import safetensors.torch

        path = merge_fsdp_weights(os.path.join(out, "pytorch_model_fsdp_0"),
                                  str(mpi_tmp_path / "merged"))
        _close(safetensors.torch.load_file(path), full)


def test_adapter_only_is_ignored_for_a_model_without_adapters(comm, mpi_tmp_path):
    """transformers' Trainer passes adapter_only=True for every model; Accelerate applies it to
    PEFT models alone and saves any other whole."""
    from mpaccel.utils import load_fsdp_model, save_fsdp_model

    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    out = str(mpi_tmp_path / "out")
    save_fsdp_model(acc.state.fsdp_plugin, acc, model, out, adapter_only=True)
    expected = {k: v for k, v in _full(acc, model, opt).items() if k.startswith("model/")}
    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc, seed=7)
    load_fsdp_model(acc.state.fsdp_plugin, acc, model, out, adapter_only=True)
    _close({k: v for k, v in _full(acc, model, opt).items() if k.startswith("model/")}, expected)


def test_adapter_only_saves_and_loads_a_peft_models_adapter_alone(comm, mpi_tmp_path):
    peft = pytest.importorskip("peft")
    from mpaccel.utils import load_fsdp_model, save_fsdp_model

    def lora(seed: int):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=2, target_modules=["fc"], init_lora_weights=False)
        return peft.get_peft_model(Tiny(seed=1), config)

    acc = _accelerator()
    model = acc.prepare(lora(seed=3))
    out = str(mpi_tmp_path / "out")
    save_fsdp_model(acc.state.fsdp_plugin, acc, model, out, adapter_only=True)
    saved = json.loads((mpi_tmp_path / "out" / "pytorch_model_fsdp_0" /
                        "sharded.index.json").read_text())
    names = json.dumps(saved)
    assert "lora_A" in names and "fc.base_layer.weight" not in names
    expected = _full(acc, model, torch.optim.SGD([torch.zeros(1)]))
    acc = _accelerator()
    model = acc.prepare(lora(seed=4))
    load_fsdp_model(acc.state.fsdp_plugin, acc, model, out, adapter_only=True)
    _close(_full(acc, model, torch.optim.SGD([torch.zeros(1)])), expected)


def test_plugin_fields_are_accelerates_in_its_order(comm):
    import dataclasses
    import inspect

    from mpaccel.errors import ConfigurationError
    from mpaccel.utils import FullyShardedDataParallelPlugin

    accelerate = pytest.importorskip("accelerate.utils")
    theirs = list(inspect.signature(accelerate.FullyShardedDataParallelPlugin).parameters)
    ours = [f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)]
    assert ours == [*theirs, "forward_methods"]  # mpaccel's own field last (docs/training.md)
    with pytest.raises(ConfigurationError, match="activation_checkpointing_offload"):
        FullyShardedDataParallelPlugin(activation_checkpointing=True,
                                       activation_checkpointing_offload=True)


def test_a_corrupted_block_of_the_last_rank_fails_every_rank_and_changes_nothing(
        comm, mpi_tmp_path):
    """load_state verifies every rank's rows in the files before any rank reads them into its
    parameters and optimizer state: a block damaged where only the last rank reads it is one
    error on every rank, and every rank's model and optimizer are as they were."""
    from mpaccel.checkpoint import CheckpointReader

    acc = _accelerator()
    model, opt, loader, sched = _prepared(acc)
    _steps(acc, model, opt, loader, sched, 2)
    directory = acc.save_state(str(mpi_tmp_path / "ckpt"))
    if comm.rank == 0:
        with CheckpointReader(directory, "sharded") as reader:
            entry = reader.index.sliced["model_0/blocks.0.fc.weight"]
            last = entry.slices[-1]  # the last rank's rows: read by it alone at this size
            path = reader.path(last.file)
        with open(path, "r+b") as f:
            f.seek(last.offset + last.nbytes - 1)
            byte = f.read(1)
            f.seek(last.offset + last.nbytes - 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    comm.barrier()
    _steps(acc, model, opt, loader, sched, 1)  # the state now differs from the saved one
    before = _full(acc, model, opt)
    with pytest.raises(CheckpointCollectiveError,
                       match=r"checksum mismatch for .model_0/blocks\.0\.fc\.weight"):
        acc.load_state(directory)
    torch.testing.assert_close(_full(acc, model, opt), before, rtol=0, atol=0)
