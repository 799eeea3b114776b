"""Sharded checkpoints of fully_shard models and their optimizers (checkpoint/sharded*.py): each
rank writes its rows only, loads read the rows each rank owns at any world size, into sharded
or plain targets, all or nothing; full-tensor export without a gather."""

from __future__ import annotations

import json
import os
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mpaccel.checkpoint import AsyncSaver, load_model_state
from mpaccel.checkpoint.reader import CheckpointReader
from mpaccel.checkpoint.sharded import save as sharded_module
from mpaccel.checkpoint.sharded.export import export_full
from mpaccel.checkpoint.sharded.load import load_sharded, verify_sliced
from mpaccel.checkpoint.sharded.save import save_sharded
from mpaccel.checkpoint.writer import write_checkpoint
from mpaccel.errors import CheckpointCollectiveError

pytestmark = pytest.mark.mpi_timeout(300)


def flip_byte(path, offset: int) -> None:
    """Damage a checkpoint file after the save: invert the byte at `offset`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def build(seed: int, shard: bool = True, hidden: int = 7) -> torch.nn.Module:
    """5 -> hidden -> 3: at 4 ranks the 3-row weight leaves one rank an empty shard, at 3 the
    7-row one splits 3/3/1."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 3))
    if shard:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model


def stepped(model: torch.nn.Module, lr: float, seed: int) -> torch.optim.Optimizer:
    """An Adam that has taken one step (so it has state)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(seed)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state, whole (a gather: for checking only)."""
    out = {f"model/{k}": full(v).clone() for k, v in model.state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        out.update({f"optim/{pid}.{k}": full(v).clone() for k, v in state.items()})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("block_bytes", [4 << 20, 24])
def test_round_trip_restores_model_and_adam_state(group, mpi_tmp_path, monkeypatch, block_bytes):
    # 24 bytes: one checksum per row of the 5-wide weights, so loads verify block by block
    monkeypatch.setattr(sharded_module, "BLOCK_BYTES", block_bytes)
    model = build(0)
    opt = stepped(model, 0.1, 0)
    index = save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict(),
                                                        "optim": opt.state_dict()})
    saved = full_state(model, opt)
    # each tensor's rows come from the ranks that hold them, none from a gathered copy
    weight = index["sliced"]["model/0.weight"]
    assert [(p["start"], p["stop"]) for p in weight["slices"]] == {
        1: [(0, 7)], 2: [(0, 4), (4, 7)], 4: [(0, 2), (2, 4), (4, 6), (6, 7)]
    }.get(group.size, [(p["start"], p["stop"]) for p in weight["slices"]])
    assert len({p["file"] for p in weight["slices"]}) == len(weight["slices"])
    if block_bytes == 24:
        assert all(len(p["xxh3"]) == p["stop"] - p["start"] for p in weight["slices"])

    other = build(1)
    other_opt = stepped(other, 0.5, 1)
    loaded = load_sharded(group, mpi_tmp_path / "ckpt", {"model": other.state_dict(),
                                                         "optim": other_opt.state_dict()})
    other_opt.load_state_dict(loaded["optim"])
    assert other_opt.param_groups[0]["lr"] == 0.1
    assert_same(full_state(other, other_opt), saved)
    with CheckpointReader(str(mpi_tmp_path / "ckpt"), "sharded") as reader:
        assert verify_sliced(reader) == (len(index["sliced"]), [])


def test_sharded_checkpoint_loads_into_a_plain_model(group, mpi_tmp_path):
    model = build(0)
    opt = stepped(model, 0.1, 0)
    save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict(),
                                                "optim": opt.state_dict()})
    saved = full_state(model, opt)
    plain = build(3, shard=False)  # as DDP or a single process holds it: whole tensors
    plain_opt = stepped(plain, 0.5, 3)
    loaded = load_sharded(group, mpi_tmp_path / "ckpt", {"model": plain.state_dict(),
                                                         "optim": plain_opt.state_dict()})
    plain_opt.load_state_dict(loaded["optim"])
    assert_same(full_state(plain, plain_opt), saved)


def test_replicated_checkpoint_loads_into_a_sharded_model(group, mpi_tmp_path):
    plain = build(4, shard=False)
    plain_opt = stepped(plain, 0.2, 4)
    # an ordinary mpaccel checkpoint (format 1): every tensor whole, written once
    write_checkpoint(group, str(mpi_tmp_path / "plain"), "state",
                     {"model_0": plain.state_dict(), "optimizer_0": plain_opt.state_dict()})
    saved = {k.replace("model_0", "model").replace("optimizer_0", "optim"): v
             for k, v in full_state(plain, plain_opt).items()}
    model = build(5)
    opt = stepped(model, 0.5, 5)
    loaded = load_sharded(group, mpi_tmp_path / "plain",
                          {"model_0": model.state_dict(), "optimizer_0": opt.state_dict()},
                          stem="state")
    opt.load_state_dict(loaded["optimizer_0"])
    assert opt.param_groups[0]["lr"] == 0.2
    assert_same(full_state(model, opt), saved)


def test_key_or_shape_mismatch_is_one_error_naming_the_key(group, mpi_tmp_path):
    model = build(0)
    save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict()})
    wider = build(6, hidden=8)
    before = {k: full(v).clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointCollectiveError) as info:
        load_sharded(group, mpi_tmp_path / "ckpt", {"model": wider.state_dict()})
    assert "'model/0.weight' has shape [8, 5] in the state to load and [7, 5]" in str(info.value)
    assert info.value.failed_ranks == list(range(group.size))
    assert_same({k: full(v) for k, v in wider.state_dict().items()}, before)

    extra = build(7)
    extra.register_buffer("extra", torch.zeros(2))
    with pytest.raises(CheckpointCollectiveError, match="'model/extra' is in the state to load "
                       "but not in the checkpoint"):
        load_sharded(group, mpi_tmp_path / "ckpt", {"model": extra.state_dict()})


def test_a_corrupted_slice_fails_on_every_rank_and_changes_nothing(group, mpi_tmp_path):
    model = build(0)
    index = save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict()})
    last = index["sliced"]["model/0.weight"]["slices"][-1]  # read by the last rank at any size
    if group.rank == 0:
        flip_byte(mpi_tmp_path / "ckpt" / last["file"], last["offset"] + last["nbytes"] - 1)
    group.barrier()
    other = build(1)
    before = {k: full(v).clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointCollectiveError, match=r"checksum mismatch for 'model/0\.weight'"):
        load_sharded(group, mpi_tmp_path / "ckpt", {"model": other.state_dict()})
    assert_same({k: full(v) for k, v in other.state_dict().items()}, before)


def test_a_corrupted_replicated_tensor_fails_and_changes_no_sharded_target(group, mpi_tmp_path):
    # format 1 into DTensors: each rank verifies the whole tensor in the file, then reads its
    # rows in place; the damage is in the last rank's rows of the last tensor (found last)
    plain = build(4, shard=False)
    index = write_checkpoint(group, str(mpi_tmp_path / "plain"), "state",
                             {"model_0": plain.state_dict()})
    entry = index["tensors"]["model_0/2.weight"]
    if group.rank == 0:
        flip_byte(mpi_tmp_path / "plain" / entry["file"], entry["offset"] + entry["nbytes"] - 1)
    group.barrier()
    model = build(5)
    before = {k: full(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointCollectiveError,
                       match=r"checksum mismatch for 'model_0/2\.weight'"):
        load_sharded(group, mpi_tmp_path / "plain", {"model_0": model.state_dict()},
                     stem="state")
    assert_same({k: full(v) for k, v in model.state_dict().items()}, before)


def test_export_full_writes_save_model_layout_without_gathering(group, mpi_tmp_path):
    model = build(0)
    model.register_buffer("scale", torch.tensor(2.5))  # 0-d: no storage until written
    index = export_full(group, mpi_tmp_path / "model", model.state_dict(), max_shard_size=100)
    assert len(index["shards"]) > 1
    saved = {k: full(v) for k, v in model.state_dict().items()}
    back = load_model_state(str(mpi_tmp_path / "model"))
    assert back.keys() == saved.keys()
    for key in saved:
        assert torch.equal(back[key], saved[key]), key
    if group.rank == 0:
        with CheckpointReader(str(mpi_tmp_path / "model"), "model") as reader:
            assert reader.verify() == []


def test_async_save_writes_the_state_of_the_moment_it_was_called(group, mpi_tmp_path):
    model = build(0)
    opt = stepped(model, 0.1, 0)
    saved = full_state(model, opt)
    saver = AsyncSaver()
    assert save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict(),
                                                       "optim": opt.state_dict()},
                        saver=saver) is None
    with torch.no_grad():  # training goes on meanwhile
        for p in model.parameters():
            p.to_local().add_(1.0)
    saver.wait()
    other = build(1)
    other_opt = stepped(other, 0.5, 1)
    loaded = load_sharded(group, mpi_tmp_path / "ckpt", {"model": other.state_dict(),
                                                         "optim": other_opt.state_dict()})
    other_opt.load_state_dict(loaded["optim"])
    assert_same(full_state(other, other_opt), saved)


# -- other world sizes, and a crash, in jobs of their own ----------------------------------------

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys
    import numpy as np, torch, torch.distributed as dist
    sys.path.insert(0, ROOT_DIR)
    from mpaccel import PartialState
    from mpaccel.checkpoint.sharded import save as sharded
    from mpaccel.checkpoint.sharded.save import save_sharded
    from mpaccel.checkpoint.sharded.load import load_sharded
    import tests.checkpoint.sharded.test_save_load as t

    mode, directory = sys.argv[1], sys.argv[2]
    comm = PartialState().comm
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    reference = os.path.join(directory, "reference.npz")
    if mode == "save":
        sharded.BLOCK_BYTES = 24  # a checksum per row: other sizes read parts of slices
        model = t.build(0)
        opt = t.stepped(model, 0.1, 0)
        saved = t.full_state(model, opt)
        save_sharded(comm, os.path.join(directory, "ckpt"),
                     {"model": model.state_dict(), "optim": opt.state_dict()})
        if comm.rank == 0:
            np.savez(reference, **{k: v.numpy() for k, v in saved.items()})
    elif mode == "load":
        expected = {k: torch.from_numpy(v) for k, v in np.load(reference).items()}
        for shard in (True, False):  # into fully_shard's DTensors, then into a plain model
            model = t.build(1, shard=shard)
            opt = t.stepped(model, 0.5, 1)
            loaded = load_sharded(comm, os.path.join(directory, "ckpt"),
                                  {"model": model.state_dict(), "optim": opt.state_dict()})
            opt.load_state_dict(loaded["optim"])
            t.assert_same(t.full_state(model, opt), expected)
            print("loaded", comm.size, "sharded" if shard else "plain")
    elif mode == "crash":
        model = t.build(0, shard=True)
        target = os.path.join(directory, "ckpt")
        for value in (1.0, 2.0):
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().fill_(value)
            if value == 2.0 and comm.rank == 1:
                write = sharded._write_rank_file

                def crash(path, local):
                    write(path, local)
                    os.kill(os.getpid(), signal.SIGKILL)  # its file written, nothing committed

                sharded._write_rank_file = crash
            save_sharded(comm, target, {"model": model.state_dict()})
''')


def _script(tmp_path: Path) -> Path:
    """The job above, importing this module's helpers from the tests directory."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("ROOT_DIR", repr(str(Path(__file__).parents[3]))))
    return script


@pytest.mark.mpi(size=1)  # nests mpiexec
@pytest.mark.launches
def test_saved_at_4_loads_at_1_and_3(tmp_path):
    from mpaccel.testing import run_mpi

    script = _script(tmp_path)
    run_mpi([str(script), "save", str(tmp_path)], n=4, timeout=240).check()
    index = json.loads((tmp_path / "ckpt" / "sharded.index.json").read_text())
    assert index["world_size"] == 4
    assert len(index["sliced"]["model/2.weight"]["slices"]) == 3  # 3 rows: one rank had none
    # The loads only read: one job per size, all at once (each spends much of its time
    # starting up and waiting on the others, which one after another summed).
    sizes = (3, 1)  # rows across the saved shards' bounds; every row in one rank
    with ThreadPoolExecutor(len(sizes)) as pool:
        runs = pool.map(
            lambda n: run_mpi([str(script), "load", str(tmp_path)], n=n, timeout=240), sizes
        )
    for n, run in zip(sizes, runs):
        assert f"loaded {n} sharded\nloaded {n} plain" in run.check().stdout[0], run.describe()


@pytest.mark.mpi(size=1)  # nests mpiexec
@pytest.mark.launches
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from mpaccel.testing import run_mpi

    script = _script(tmp_path)
    run = run_mpi([str(script), "crash", str(tmp_path)], n=2, timeout=240)
    assert run.returncode != 0 and not run.timed_out, run.describe()
    leftovers = [n for n in os.listdir(tmp_path / "ckpt") if n.endswith((".h5", ".partial"))]
    assert len(leftovers) > 2  # the second save got as far as writing files
    plain = build(2, shard=False)
    from mpaccel.comm import NullComm

    load_sharded(NullComm(), tmp_path / "ckpt", {"model": plain.state_dict()})
    for value in plain.state_dict().values():
        assert torch.all(value == 1.0)


@pytest.mark.parametrize("change", ["overlap", "gap", "file", "digests"])
def test_a_crafted_sliced_index_is_refused_naming_the_field(group, mpi_tmp_path, change):
    model = build(0)
    save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict()})
    path = mpi_tmp_path / "ckpt" / "sharded.index.json"
    group.barrier()
    if group.rank == 0:
        index = json.loads(path.read_text())
        slices = index["sliced"]["model/0.weight"]["slices"]
        if change == "overlap":
            slices.append(dict(slices[-1]))  # the last rows stored twice
        elif change == "gap":
            slices.pop()  # the last rows are stored nowhere
        elif change == "file":
            slices[0]["file"] = "../elsewhere.h5"
        else:
            slices[0]["xxh3"].append("0" * 16)
        path.write_text(json.dumps(index))
    group.barrier()
    expected = {"overlap": r"\['slices'\]\[\d+\] holds rows",
                "gap": r"\['slices'\] cover rows 0\.\.\d of 7",
                "file": "expected a plain file name", "digests": "expected one xxh3"}[change]
    with pytest.raises(CheckpointCollectiveError, match=expected):
        load_sharded(group, mpi_tmp_path / "ckpt", {"model": build(1).state_dict()})


def test_ckpt_ls_verify_and_export_read_sharded_checkpoints(group, mpi_tmp_path, capsys):
    from mpaccel.cli import main

    model = build(0)
    opt = stepped(model, 0.1, 0)
    index = save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict(),
                                                        "optim": opt.state_dict()})
    saved = {k: full(v) for k, v in model.state_dict().items()}
    directory = str(mpi_tmp_path / "ckpt")
    if group.rank == 0:
        capsys.readouterr()
        assert main(["ckpt", "ls", directory]) == 0
        listing = capsys.readouterr().out
        slices = index["sliced"]["model/0.weight"]["slices"]
        line = next(row for row in listing.splitlines() if row.startswith("model/0.weight "))
        assert "7x5" in line and f"{len(slices)} slice(s) 0:{slices[0]['stop']}" in line, line
        assert "sharded checkpoint, format 2" in listing
        assert main(["ckpt", "verify", directory]) == 0
        count = len(index["sliced"])
        assert f"{count} of {count} tensors verified" in capsys.readouterr().out
        out = str(mpi_tmp_path / "model.safetensors")
        assert main(["ckpt", "export", directory, "--output", out]) == 0
        from safetensors.torch import load_file

        exported = load_file(out)
        assert exported.keys() == saved.keys()
        for key in saved:
            assert torch.equal(exported[key], saved[key]), key
        last = slices[-1]
        flip_byte(mpi_tmp_path / "ckpt" / last["file"], last["offset"])
        capsys.readouterr()
        assert main(["ckpt", "verify", directory]) == 1
        captured = capsys.readouterr()
        assert f"{count - 1} of {count} tensors verified, 1 FAILED" in captured.out
        assert "checksum mismatch for 'model/0.weight'" in captured.err
    group.barrier()


@pytest.mark.mpi(size=1)  # nests mpiexec
@pytest.mark.launches
def test_fsdp_checkpoint_benchmark_runs(tmp_path):
    # not a test of speed (nothing timed is asserted): the script must keep running
    from mpaccel.testing import run_mpi

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "fsdp_checkpoint.py"
    tiny = ["--param-mib", "0.05", "--layers", "2", "--rounds", "1", "--dir", str(tmp_path)]
    run = run_mpi([str(script), *tiny, "--keep"], n=2, timeout=240).check()
    assert "load: mpaccel / dcp speed" in run.stdout[0], run.describe()
    assert "export_full / gather+write speed" in run.stdout[0], run.describe()
    run = run_mpi([str(script), *tiny, "--resharded"], n=1, timeout=240).check()
    assert "resharded load: mpaccel" in run.stdout[0], run.describe()
