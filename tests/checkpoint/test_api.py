"""HDF5 checkpoints. The bodies run at size 1 and under mpiexec -n 2 / -n 4."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mpaccel import Accelerator, AcceleratorState, CollectiveError
from mpaccel.checkpoint import CheckpointError, CheckpointReader, load_model_state
from mpaccel.checkpoint.format import flatten, parse_size, unflatten
from mpaccel.testing import reset_state
from mpaccel.utils import DistributedDataParallelKwargs, ProjectConfiguration
from tests.conftest import params

# Also run under Open MPI's mpiexec (docs/testing.md, "Which stage runs what").
pytestmark = pytest.mark.openmpi


class Progress:
    """A custom object: registered for checkpointing."""

    def __init__(self):
        self.epoch, self.step, self.history = 0, 0, []

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step, "history": list(self.history)}

    def load_state_dict(self, state):
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]


def _setup(seed_model=0, mixed_precision="no", **kwargs):
    reset_state()
    acc = Accelerator(mixed_precision=mixed_precision, **kwargs)
    torch.manual_seed(seed_model)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(42)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    torch.manual_seed(7)  # the shuffling seed agreed in prepare() follows this on rank 0
    loader = DataLoader(data, batch_size=24 // acc.num_processes, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    return acc, model, opt, sched, loader, progress


def _train(acc, model, opt, sched, loader, progress, epochs, stop_at=None, save_to=None):
    """Train; save_state(save_to) and stop (returning True) right after global step `stop_at`
    (saving inside the loop: the dataloader is mid-epoch)."""
    for epoch in range(progress.epoch, epochs):
        progress.epoch = epoch
        loader.set_epoch(epoch)
        for x, y in loader:
            noise = torch.randn(1).item() * 1e-3  # consumes the torch RNG: must resume equal
            loss = torch.nn.functional.mse_loss(model(x), y) + noise
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.step += 1
            progress.history.append(round(acc.reduce(loss.detach(), "mean").item(), 6))
            if stop_at is not None and progress.step == stop_at:
                random.random(), np.random.rand()  # RNG use before the save...
                acc.save_state(save_to)
                random.random(), np.random.rand()  # ...and after it must not matter
                return True
        progress.epoch = epoch + 1
    return False


def _params(acc, model):
    return params(acc.unwrap_model(model))


@pytest.mark.parametrize("find_unused_parameters", [False, True])
@pytest.mark.parametrize("stop_at", [6, 8], ids=["mid-epoch", "last-batch"])
def test_resume_equals_uninterrupted_run(mpi_tmp_path, comm, find_unused_parameters, stop_at):
    # 4 batches per epoch: step 8 is the last of epoch 1, saved while the loop (and its epoch
    # counter) is still in epoch 1; set_epoch(1) after the resume replayed the whole epoch.
    ddp = [DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)]
    acc, model, opt, sched, loader, progress = _setup(kwargs_handlers=ddp)
    _train(acc, model, opt, sched, loader, progress, epochs=3)
    expected_params, expected_history = _params(acc, model), list(progress.history)

    # Interrupted: stop mid-epoch, save, "restart" with other initial weights, load, go on.
    acc, model, opt, sched, loader, progress = _setup(kwargs_handlers=ddp)
    assert _train(acc, model, opt, sched, loader, progress, epochs=3, stop_at=stop_at,
                  save_to=mpi_tmp_path / "ckpt")
    acc, model, opt, sched, loader, progress = _setup(seed_model=123, kwargs_handlers=ddp)
    acc.load_state(mpi_tmp_path / "ckpt")
    assert progress.step == stop_at and acc.step == 0
    # The same loop: set_epoch() replays the interrupted epoch's order, minus what was seen.
    _train(acc, model, opt, sched, loader, progress, epochs=3)
    assert progress.history == expected_history
    params = _params(acc, model)
    if comm.size <= 2 or find_unused_parameters:
        assert torch.equal(params, expected_params)
    else:
        # DDP's first step after construction reduces gradients in its initial bucket layout,
        # later steps in the rebuilt one; a sum of 3+ ranks then rounds differently, once.
        torch.testing.assert_close(params, expected_params, rtol=0, atol=1e-6)
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.get_last_lr()[0])


def test_every_loader_whose_pass_is_under_way_resumes_where_it_was(mpi_tmp_path, comm):
    """Two prepared loaders iterated together (zip): only the one started last was saved as
    mid-epoch; the other started a new, differently shuffled pass after the resume."""

    def setup():
        reset_state()
        acc = Accelerator()
        torch.manual_seed(3)
        data = TensorDataset(torch.arange(64.0))
        per_rank = 8 // acc.num_processes
        a, b = (DataLoader(data, batch_size=per_rank, shuffle=True) for _ in range(2))
        return acc, *acc.prepare(a, b)

    def run(a, b, stop=None, acc=None):
        seen = []
        for step, ((x,), (y,)) in enumerate(zip(a, b)):
            seen.append((x.tolist(), y.tolist()))
            if step == stop:
                acc.save_state(mpi_tmp_path / "two")
                break
        return seen

    acc, a, b = setup()
    expected = run(a, b)
    acc, a, b = setup()
    before = run(a, b, stop=2, acc=acc)
    acc, a, b = setup()
    acc.load_state(mpi_tmp_path / "two")
    assert before + run(a, b) == expected


def test_round_trip_of_every_component(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup(mixed_precision="fp16")
    _train(acc, model, opt, sched, loader, progress, epochs=1)
    random.seed(comm.rank)
    np.random.seed(comm.rank)
    torch.manual_seed(99 + comm.rank)
    acc.save_state(mpi_tmp_path / "all")
    expected = {
        "model": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
        "opt": opt.state_dict(), "sched": sched.state_dict(), "scaler": acc.scaler.state_dict(),
        "py": random.random(), "np": np.random.rand(), "torch": torch.rand(1),
    }
    random.seed(1000)
    np.random.seed(1000)
    acc2, model2, opt2, sched2, _, progress2 = _setup(seed_model=5, mixed_precision="fp16")
    acc2.load_state(mpi_tmp_path / "all")
    for key, value in acc2.unwrap_model(model2).state_dict().items():
        assert torch.equal(value, expected["model"][key]), key
    got = opt2.state_dict()
    assert got["param_groups"] == expected["opt"]["param_groups"]
    for pid, state in expected["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)
    assert sched2.state_dict() == expected["sched"]
    assert acc2.scaler.state_dict() == expected["scaler"]
    assert progress2.state_dict() == progress.state_dict()
    assert random.random() == expected["py"] and np.random.rand() == expected["np"]
    assert torch.equal(torch.rand(1), expected["torch"])


def test_load_fills_the_live_tensors_in_place(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup()
    _train(acc, model, opt, sched, loader, progress, epochs=1)
    acc.save_state(mpi_tmp_path / "inplace")
    module = acc.unwrap_model(model)
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    saved_opt = {(pid, n): v.clone() for pid, st in opt.state_dict()["state"].items()
                 for n, v in st.items()}
    memory = {k: v.data_ptr() for k, v in module.state_dict().items()}
    opt_memory = {key: opt.state_dict()["state"][key[0]][key[1]].data_ptr() for key in saved_opt}
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-3.0)
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            v.zero_()
    acc.load_state(mpi_tmp_path / "inplace")
    for key, value in module.state_dict().items():
        assert value.data_ptr() == memory[key], f"{key} got new memory"
        assert torch.equal(value, saved[key]), key
    for (pid, name), value in saved_opt.items():
        now = opt.state_dict()["state"][pid][name]
        assert now.data_ptr() == opt_memory[(pid, name)], (pid, name)
        assert torch.equal(now, value), (pid, name)
    # tensors that cannot take the bytes as they are (another dtype) are loaded by copy
    acc2, model2, *_ = _setup(seed_model=3)
    module2 = acc2.unwrap_model(model2).double()
    acc2.load_state(mpi_tmp_path / "inplace")
    for key, value in module2.state_dict().items():
        assert value.dtype == torch.float64 and torch.equal(value, saved[key].double()), key


def test_a_cold_load_reads_behind_the_first_rank_of_the_node(mpi_tmp_path, comm, monkeypatch):
    """With the files out of the page cache, the node's other ranks copy behind its first one
    (rawio.preadv_following) and every rank still ends up with every byte. The data is read at
    the offsets the index records, without opening HDF5 (whose metadata reads would be small
    waits on the disk before the data streams)."""
    from mpaccel.checkpoint import rawio
    from mpaccel.checkpoint import reader as reader_module

    monkeypatch.setattr(rawio, "PIECE", 64 << 10)  # many pieces per tensor
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 256)).square().mean())
    opt.step()
    target = mpi_tmp_path / "cold"
    acc.save_state(target)
    index = json.loads((target / "state.index.json").read_text())
    files = set(index["shards"]) | {part["file"] for part in index["per_rank"]}
    assert index["file_sizes"] == {name: os.path.getsize(target / name) for name in files}
    entries = [*index["tensors"].values()]
    entries += [e for part in index["per_rank"] for e in part["tensors"].values()]
    assert all("offset" in e for e in entries if e["nbytes"]), entries
    module = acc.unwrap_model(model)
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    saved_opt = [v.clone() for st in opt.state_dict()["state"].values() for v in st.values()]
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            v.fill_(7)
    if acc.is_local_main_process:  # one page cache per node
        for path in glob.glob(os.path.join(target, "*.h5")):
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    acc.wait_for_everyone()
    following = []
    real = rawio.preadv_following
    monkeypatch.setattr(rawio, "preadv_following", lambda *a: following.append(1) or real(*a))
    opened, real_file = [], reader_module.CheckpointReader._file

    def opening(self, name):
        opened.append(name)
        return real_file(self, name)

    monkeypatch.setattr(reader_module.CheckpointReader, "_file", opening)
    acc.load_state(target)
    assert opened == []
    for key, value in module.state_dict().items():
        assert torch.equal(value, saved[key]), key
    now = [v for st in opt.state_dict()["state"].values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(now, saved_opt, strict=True))
    assert bool(following) == (acc.local_process_index > 0), acc.local_process_index


def _rewrite_chunked(directory, **options):
    """Rewrite every dataset of the model's shards chunked, as another tool may (h5repack)."""
    for shard in glob.glob(os.path.join(directory, "model-*.h5")):
        with h5py.File(shard, "r+") as f:
            for name in list(f["model"]):
                data, attrs = f["model"][name][()], dict(f["model"][name].attrs)
                del f["model"][name]
                ds = f["model"].create_dataset(name, data=data, chunks=True, **options)
                ds.attrs.update(attrs)


def test_datasets_another_tool_rewrote_chunked_still_load(mpi_tmp_path, comm):
    """Chunked datasets load; compressed ones are refused by name before any byte is read (how
    much memory HDF5's decompression takes is not bounded by the declared size: see
    docs/checkpoint-format.md, "Loading untrusted checkpoints"), until decompressed."""
    acc, model, *_ = _setup()
    expected = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    for options in ({}, {"compression": "gzip"}):
        target = mpi_tmp_path / ("gzip" if options else "chunked")
        acc.save_model(model, target, safe_serialization=False)
        acc.wait_for_everyone()
        if acc.is_main_process:
            _rewrite_chunked(target, **options)
        acc.wait_for_everyone()
        if options:
            with pytest.raises(CheckpointError, match=r"'model/\S+' is stored through HDF5 "
                               r"filters \['deflate'\].*\nHINT: decompress the file first"):
                load_model_state(target)
            acc.wait_for_everyone()
            if acc.is_main_process:
                _rewrite_chunked(target)  # what h5repack -f NONE does
            acc.wait_for_everyone()
        state = load_model_state(target)
        for key, value in expected.items():
            assert torch.equal(state[key], value), key


def test_save_model_shards_by_size_and_removes_stale_shards(mpi_tmp_path, comm, monkeypatch):
    from mpaccel.checkpoint import storage

    acc = Accelerator()
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(torch.bfloat16)
    model = acc.prepare(model)
    target = mpi_tmp_path / "model"
    written, original = [], storage.write_h5
    def recording(path, *args):
        written.append(os.path.basename(path))
        return original(path, *args)

    monkeypatch.setattr(storage, "write_h5", recording)
    acc.save_model(model, target, max_shard_size="20KB", safe_serialization=False)
    index = json.loads((target / "model.index.json").read_text())
    # 8 KiB bf16 weight + 128 B bias per layer: two layers fit in 20 KB, so three shards
    assert len(index["shards"]) == 3
    # written in parallel: shard i (1-based in its name) by rank (i - 1) mod N
    writers = {name: rank for rank, names in enumerate(comm.allgather(written)) for name in names}
    for name in index["shards"]:  # model-<save id>-00002-of-00003.h5
        assert writers[name] == (int(name.split("-")[2]) - 1) % comm.size, name
    per_shard = {}
    for entry in index["tensors"].values():
        per_shard[entry["file"]] = per_shard.get(entry["file"], 0) + entry["nbytes"]
    assert max(per_shard.values()) <= 20_000
    assert set(os.listdir(target)) == set(index["shards"]) | {"model.index.json"}
    state = load_model_state(target)
    for key, value in acc.unwrap_model(model).state_dict().items():
        assert state[key].dtype == torch.bfloat16 and torch.equal(state[key], value), key
    acc.wait_for_everyone()  # every rank has checked the listing above before it changes
    if acc.is_main_process:  # the index temp file of a save that died before its rename
        (target / "model.index.json.tmp-0123456789ab").write_text("{")
    acc.save_model(model, target, max_shard_size="1MB", safe_serialization=False)
    acc.wait_for_everyone()
    index = json.loads((target / "model.index.json").read_text())
    assert index["shards"] == sorted(f for f in os.listdir(target) if f.endswith(".h5"))
    assert len(index["shards"]) == 1
    assert sorted(os.listdir(target)) == index["shards"] + ["model.index.json"]


def _dataset_kinds(path):
    found = []
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: found.append((name, obj.dtype.kind))
                     if isinstance(obj, h5py.Dataset) else None)
    return found


def test_no_pickle_anywhere(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup()
    _train(acc, model, opt, sched, loader, progress, epochs=1)
    acc.save_state(mpi_tmp_path / "s")
    acc.wait_for_everyone()
    for path in glob.glob(str(mpi_tmp_path / "s" / "*.h5")):
        kinds = _dataset_kinds(path)
        assert kinds and all(kind in "biuf" for _, kind in kinds), (path, kinds)
        assert b"\x80\x04\x95" not in open(path, "rb").read()
    json.loads((mpi_tmp_path / "s" / "state.index.json").read_text())  # plain JSON


def test_unserialisable_custom_state_names_the_key(mpi_tmp_path, comm):
    acc, *_ = _setup()

    class Bad:
        def state_dict(self):
            return {"ok": 1, "callback": (lambda: 0) if acc.process_index == comm.size - 1 else 1}

        def load_state_dict(self, state):
            pass

    acc.register_for_checkpointing(Bad())
    with pytest.raises(CollectiveError) as info:
        acc.save_state(mpi_tmp_path / "bad")
    assert info.value.failed_ranks == [comm.size - 1]
    assert "custom_1/callback" in str(info.value) and "function" in str(info.value)
    with pytest.raises(CollectiveError) as info:  # the same key when the snapshot refuses it
        acc.save_state(mpi_tmp_path / "bad", async_save=True)
    assert "at key custom_1/callback" in str(info.value), str(info.value)
    with pytest.raises(TypeError, match="state_dict"):
        acc.register_for_checkpointing(object())


def _corrupt_one_byte(directory):
    shard = sorted(glob.glob(os.path.join(directory, "state-*-00001-of-*.h5")))[0]
    with h5py.File(shard, "r") as f:
        name = next(n for n in f["model_0"])
        offset = f["model_0"][name].id.get_offset()
    with open(shard, "r+b") as raw:
        raw.seek(offset + 3)
        byte = raw.read(1)
        raw.seek(offset + 3)
        raw.write(bytes([byte[0] ^ 0xFF]))
    return shard, name


def test_an_edited_index_is_caught_like_a_corrupted_tensor(mpi_tmp_path, comm):
    """Learning rates, steps and positions live only in the JSON index: a one-character change
    there (lr 0.01 -> 0.03) fails load_state on every rank and `mpaccel ckpt verify`, as a
    flipped byte in a shard does (it loaded silently)."""
    acc, model, opt, sched, loader, progress = _setup()
    acc.save_state(mpi_tmp_path / "edited")
    index = mpi_tmp_path / "edited" / "state.index.json"
    acc.wait_for_everyone()
    if acc.is_main_process:
        text = index.read_text()
        assert '"lr": 0.01' in text
        index.write_text(text.replace('"lr": 0.01', '"lr": 0.03', 1))
    acc.wait_for_everyone()
    with pytest.raises(CheckpointError, match="does not match its checksum") as info:
        acc.load_state(mpi_tmp_path / "edited")
    assert info.value.failed_ranks == list(range(comm.size))
    assert opt.param_groups[0]["lr"] == 1e-2
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        CheckpointReader(str(mpi_tmp_path / "edited"), "state")
    # an index of an earlier version, without its digest, still loads
    acc.save_state(mpi_tmp_path / "old")
    acc.wait_for_everyone()
    if acc.is_main_process:
        old = mpi_tmp_path / "old" / "state.index.json"
        document = json.loads(old.read_text())
        del document["index_xxh3"]
        old.write_text(json.dumps(document))
    acc.wait_for_everyone()
    acc.load_state(mpi_tmp_path / "old")


def test_errors_are_raised_on_every_rank(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup()
    good = mpi_tmp_path / "good"
    acc.save_state(good)
    # missing checkpoint; `except CheckpointError` catches it too, as any failed save or load
    with pytest.raises(CheckpointError, match="does not exist") as info:
        acc.load_state(mpi_tmp_path / "nowhere")
    assert isinstance(info.value, CollectiveError)
    # unwritable directory (a file stands where a directory must go)
    if acc.is_main_process:
        (mpi_tmp_path / "afile").write_text("x")
    acc.wait_for_everyone()
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        acc.save_state(mpi_tmp_path / "afile" / "ckpt")
    # incomplete checkpoint: no index
    if acc.is_main_process:
        os.makedirs(mpi_tmp_path / "partial")
    acc.wait_for_everyone()
    with pytest.raises(CollectiveError, match=r"state\.index\.json is missing"):
        acc.load_state(mpi_tmp_path / "partial")
    # corrupted byte
    acc.wait_for_everyone()
    if acc.is_main_process:
        _corrupt_one_byte(good)
    acc.wait_for_everyone()
    torch.rand(1)  # the RNG moves on from the saved state; a failed load must not restore it
    rng_before = torch.get_rng_state()
    with pytest.raises(CollectiveError) as info:
        acc.load_state(good)
    assert torch.equal(torch.get_rng_state(), rng_before)
    # The ranks of a node read one page cache and split the checksums: the rank that verified
    # the corrupted tensor fails, and every rank raises its error.
    assert len(info.value.failed_ranks) == 1
    assert "checksum mismatch" in str(info.value) and "00001-of-" in str(info.value)
    # ... and every rank stopped at the same point: the same bytes in the model, nothing else
    # (step, RNG, dataloader position) applied anywhere
    digest = hashlib.sha256(_params(acc, model).numpy().tobytes()).hexdigest()
    assert len(set(comm.allgather((digest, acc.step)))) == 1
    with CheckpointReader(str(good), "state") as reader:  # alone, a reader verifies everything
        assert len(reader.verify()) == 1
    # a shard file gone missing: named, on every rank
    acc.save_state(mpi_tmp_path / "fresh")
    acc.save_state(mpi_tmp_path / "lost")
    lost = sorted((mpi_tmp_path / "lost").glob("state-*-00001-of-*.h5"))[0]
    acc.wait_for_everyone()  # every rank has found it before it goes
    if acc.is_main_process:
        lost.unlink()
    acc.wait_for_everyone()
    with pytest.raises(CollectiveError) as info:
        acc.load_state(mpi_tmp_path / "lost")
    assert info.value.failed_ranks == list(range(comm.size)) and lost.name in str(info.value)
    # mismatched model: the missing and the unexpected keys, named, with the failing ranks
    AcceleratorState._reset_state(True)
    acc2 = Accelerator()
    other = acc2.prepare(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 2)))
    acc2.prepare(torch.optim.AdamW(other.parameters()))
    with pytest.raises(CollectiveError) as info:
        acc2.load_state(mpi_tmp_path / "fresh")
    message = str(info.value)
    assert "model_0" in message and "1.weight" in message and "2.weight" in message, message
    assert info.value.failed_ranks == list(range(comm.size)) and "rank 0" in message


_LOADER_FIELDS = ("iteration", "_started", "_epoch_seen", "_skip", "_skip_counted")


def _everything(acc, model, opt, sched, loader, objects):
    """Every part of the state a load may change, as values."""
    optimizer = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
        "optimizer": {(pid, n): v.clone() if torch.is_tensor(v) else v
                      for pid, st in optimizer["state"].items() for n, v in st.items()},
        "groups": optimizer["param_groups"],
        "scheduler": sched.state_dict(),
        "objects": [json.dumps(o.state_dict()) for o in objects],
        "step": acc.step,
        "loader": {name: loader.__dict__[name] for name in _LOADER_FIELDS},
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
    }


def _assert_unchanged(before, after):
    for part in ("model", "optimizer"):
        assert before[part].keys() == after[part].keys(), part
        for key, value in before[part].items():
            same = torch.equal(value, after[part][key]) if torch.is_tensor(value) else (
                value == after[part][key])
            assert same, (part, key)
    for part in ("groups", "scheduler", "objects", "step", "loader"):
        assert before[part] == after[part], part
    (torch_rng, py_rng, np_rng), (torch_now, py_now, np_now) = before["rng"], after["rng"]
    assert torch.equal(torch_rng, torch_now) and py_rng == py_now
    assert np_rng[0] == np_now[0] and np.array_equal(np_rng[1], np_now[1])
    assert np_rng[2:] == np_now[2:]


def _edit_index(directory, edit):
    """Change the index as an attacker would, its checksum made to match."""
    from mpaccel.checkpoint.format import INDEX_DIGEST, index_digest

    path = directory / "state.index.json"
    index = json.loads(path.read_text())
    index.pop(INDEX_DIGEST)
    edit(index)
    path.write_text(json.dumps({**index, INDEX_DIGEST: index_digest(index)}))


def _last_rank_part(index):
    return index["per_rank"][-1]["components"]


_DAMAGE = {
    # (what is done to the checkpoint, the ranks whose check fails: "one" = the one rank that
    # verifies the tensor, "last" = the last rank, "all")
    "a flipped byte in a tensor": (lambda d: _corrupt_one_byte(d), "one"),
    "a crafted RNG state on one rank": (
        lambda d: _edit_index(d, lambda index: _last_rank_part(index)["rng"].update(
            python={"__tuple__": [3, {"__tuple__": [1, 2, 3]}, None]})), "last"),
    "a crafted loader position on one rank": (
        lambda d: _edit_index(d, lambda index: _last_rank_part(index)["dataloader_0"].update(
            iteration=-5)), "last"),
    "a scheduler state its load_state_dict refuses": (
        lambda d: _edit_index(d, lambda index: index["components"].update(
            scheduler_0=["not", "a", "dict"])), "all"),
    "an accumulation step that is not a count": (
        lambda d: _edit_index(d, lambda index: index["components"]["accelerator"].update(
            step="7")), "all"),
}


class _RefusingOnce(Progress):
    """A registered object whose load_state_dict changes itself, then refuses (once)."""

    def __init__(self, refuse):
        super().__init__()
        self.refuse = refuse

    def load_state_dict(self, state):
        self.epoch = -1
        if self.refuse:
            self.refuse = False
            raise ValueError("this rank refuses the state")
        super().load_state_dict(state)


@pytest.mark.parametrize("damage", [*_DAMAGE, "a registered object refusing on one rank"])
def test_a_failed_load_changes_nothing_on_any_rank(mpi_tmp_path, comm, damage):
    """Whatever fails, on whichever rank: models, optimizers, schedulers, registered objects,
    loader positions, step and RNG states are on every rank as they were before the call (the
    model held a corrupted tensor's bytes; a crafted RNG state failed after the model, optimizer,
    scheduler and registered objects had taken the checkpoint's)."""
    last = comm.size - 1
    acc, model, opt, sched, loader, progress = _setup()
    refusing = _RefusingOnce(refuse=acc.process_index == last
                             and damage == "a registered object refusing on one rank")
    acc.register_for_checkpointing(refusing)
    _train(acc, model, opt, sched, loader, progress, epochs=2, stop_at=6,
           save_to=mpi_tmp_path / "ckpt")  # mid-epoch
    for step, (x, y) in enumerate(loader):  # training goes on: everything moves on from it
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step(), sched.step(), opt.zero_grad()
        progress.step += 1
        refusing.step += 2
        if step == 1:
            break
    acc.step = 1
    random.random(), np.random.rand(), torch.rand(1)
    acc.wait_for_everyone()
    damaged, failing = _DAMAGE.get(damage, (None, "last"))
    if damaged is not None and acc.is_main_process:
        damaged(mpi_tmp_path / "ckpt")
    acc.wait_for_everyone()
    before = _everything(acc, model, opt, sched, loader, [progress, refusing])
    with pytest.raises(CollectiveError) as info:
        acc.load_state(mpi_tmp_path / "ckpt")
    _assert_unchanged(before, _everything(acc, model, opt, sched, loader, [progress, refusing]))
    expected = {"one": None, "last": [last], "all": list(range(comm.size))}[failing]
    if expected is None:
        assert len(info.value.failed_ranks) == 1, info.value
    else:
        assert info.value.failed_ranks == expected, info.value


def test_load_state_passes_strict_on_to_the_models(mpi_tmp_path, comm):
    """load_state(dir, strict=False), as in Accelerate: a model with a new head loads the keys
    it shares with the checkpoint; other shapes are still refused; unknown keywords are an
    error (they were silently ignored)."""
    def build(head: int | None):
        reset_state()
        acc = Accelerator()
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4, 8)] + ([torch.nn.Linear(8, head)] if head else [])
        net = acc.prepare(torch.nn.Sequential(*layers))
        return acc, net

    acc, net = build(None)
    acc.save_state(mpi_tmp_path / "body")
    saved = {k: v.clone() for k, v in acc.unwrap_model(net).state_dict().items()}
    acc, net = build(3)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    with pytest.raises(CollectiveError, match="missing keys"):
        acc.load_state(mpi_tmp_path / "body")
    acc.load_state(mpi_tmp_path / "body", strict=False)
    live = acc.unwrap_model(net).state_dict()
    assert all(torch.equal(live[k], v) for k, v in saved.items())
    assert not live["1.weight"].any()  # the new head is left as it was
    acc.load_state(mpi_tmp_path / "body", load_kwargs={"map_location": "cpu"}, strict=False)
    with pytest.raises(TypeError, match="bogus"):
        acc.load_state(mpi_tmp_path / "body", bogus=1)
    acc, net = build(None)
    with torch.no_grad():  # another shape: refused whatever strict says
        net_module = acc.unwrap_model(net)
        net_module[0] = torch.nn.Linear(4, 9)
    with pytest.raises(CollectiveError, match="other shapes"):
        acc.load_state(mpi_tmp_path / "body", strict=False)


@pytest.mark.mpi(min_size=2)
def test_a_state_that_differs_between_ranks_is_refused_before_anything_is_written(
    mpi_tmp_path, comm
):
    # The last rank builds another model (a wider layer, an extra buffer): the shards of two
    # different plans would interleave into a checkpoint that cannot load. Every rank raises
    # the same error naming the rank and the key; nothing is committed.
    reset_state()
    acc = Accelerator()
    last = acc.process_index == acc.num_processes - 1
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 9 if last else 3))
    if last:
        net.register_buffer("extra", torch.zeros(2))
    with pytest.raises(CollectiveError) as info:
        acc.save_model(net, mpi_tmp_path / "model", safe_serialization=False)
    message = str(info.value)
    assert info.value.failed_ranks == [comm.size - 1], message
    assert "differs from rank 0's" in message, message
    assert "model/1.weight is float32 [9, 8] (rank 0: float32 [3, 8])" in message, message
    assert "has extra ['model/extra']" in message, message
    assert not (mpi_tmp_path / "model" / "model.index.json").exists()
    # Non-tensor values that differ: saved as rank 0 has them, with a warning on rank 0.
    acc, model, opt, sched, loader, progress = _setup()
    progress.step = acc.process_index
    with pytest.warns(RuntimeWarning, match="'custom_0/step' differs") if acc.is_main_process \
            else _no_warning():
        acc.save_state(mpi_tmp_path / "values")
    progress.step = -1
    acc.load_state(mpi_tmp_path / "values")
    assert progress.step == 0


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def check():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        assert not [w for w in caught if "differs" in str(w.message)]

    return check()


def test_buffers_are_saved_as_rank_0_has_them(mpi_tmp_path, comm):
    # BatchNorm's running statistics: after a forward on its own batch, each rank holds its own
    # (DDP broadcasts rank 0's only at the start of the next forward). The checkpoint holds
    # rank 0's, and the live buffers are left as they are.
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    # buffers changed on each rank, of other dtypes (sent as bytes); float8 would be too, but
    # DDP itself cannot broadcast one over gloo
    net.register_buffer("mask", torch.zeros(3, dtype=torch.bool))
    net.register_buffer("scale", torch.zeros(2, dtype=torch.bfloat16))
    model = acc.prepare(net)
    model(torch.randn(8, 4) + acc.process_index)  # rank-dependent batch statistics
    inner = acc.unwrap_model(model)
    inner.mask[acc.process_index % 3] = True
    inner.scale.fill_(float(acc.process_index + 1))
    live = inner[1].running_mean.clone()
    means = comm.allgather(live.tolist())
    if comm.size > 1:
        assert means[0] != means[1]
    acc.save_model(model, mpi_tmp_path / "bn", safe_serialization=False)
    saved = load_model_state(mpi_tmp_path / "bn")
    assert saved["1.running_mean"].tolist() == means[0]
    assert saved["1.num_batches_tracked"].item() == 1
    assert saved["mask"].tolist() == [True, False, False]
    assert saved["scale"].tolist() == [1.0, 1.0]
    assert torch.equal(inner[1].running_mean, live)  # untouched
    assert inner.scale.tolist() == [acc.process_index + 1.0] * 2
    acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    acc.save_state(mpi_tmp_path / "bn-state")
    with CheckpointReader(str(mpi_tmp_path / "bn-state"), "state") as reader:
        assert reader.component("model_0")["1.running_mean"].tolist() == means[0]


def test_a_buffer_under_two_names_is_saved_once_as_rank_0_has_it(mpi_tmp_path, comm):
    """A module reused under two names (self.bn2 = self.bn1) holds its buffers twice in the
    state_dict; named_buffers() gives them once. The second name kept this rank's running
    statistics (the shard's writer's, at N ranks) in a dataset of its own, and loading put that
    rank's values into the model."""
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    net.add_module("again", net[1])
    model = acc.prepare(net)
    model(torch.randn(8, 4) * (acc.process_index + 1))  # rank-dependent statistics
    means = comm.allgather(acc.unwrap_model(model)[1].running_mean.tolist())
    acc.save_model(model, mpi_tmp_path / "bn", max_shard_size=64,  # a shard per few tensors
                   safe_serialization=False)
    stored = _stored(mpi_tmp_path / "bn", "model")
    assert not [k for k in stored if k.startswith("model/again.")], list(stored)
    saved = load_model_state(mpi_tmp_path / "bn")
    assert saved["1.running_mean"].tolist() == means[0]
    assert saved["again.running_mean"].data_ptr() == saved["1.running_mean"].data_ptr()


def test_every_directory_a_save_creates_is_made_durable(tmp_path, monkeypatch):
    # A save into project/checkpoints/checkpoint_0 may create all three: each one's entry in
    # its parent must be fsynced, or a power loss can lose the committed checkpoint.
    from mpaccel.checkpoint import storage

    synced = []
    monkeypatch.setattr(storage, "fsync_path", synced.append)
    project = tmp_path / "project"
    storage.make_directory(str(project / "checkpoints" / "checkpoint_0"))
    assert synced == [str(tmp_path), str(project), str(project / "checkpoints")]
    assert (project / "checkpoints" / "checkpoint_0").is_dir()
    synced.clear()
    storage.make_directory(str(tmp_path / "project"))  # exists: nothing created, nothing synced
    assert synced == []


class _Tied(torch.nn.Module):
    def __init__(self, tie):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_a_tied_model_loads_an_untied_checkpoint_as_torch_does(mpi_tmp_path, comm):
    # Two keys of the live state_dict share memory: reading both in place would let the second
    # overwrite the first before its checksum is checked ("corrupted"). torch's
    # load_state_dict copies one after the other: the tensor ends up with the last key's values.
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    untied = acc.prepare(_Tied(tie=False))
    acc.save_state(mpi_tmp_path / "untied")
    saved = acc.unwrap_model(untied).state_dict()
    reset_state()
    acc = Accelerator()
    tied = acc.prepare(_Tied(tie=True))
    acc.load_state(mpi_tmp_path / "untied")
    expected = _Tied(tie=True)
    expected.load_state_dict(saved)
    inner = acc.unwrap_model(tied)
    assert inner.head.weight is inner.emb.weight
    assert torch.equal(inner.emb.weight, expected.emb.weight)
    assert torch.equal(inner.emb.weight, saved["head.weight"])


def _stored(directory, stem):
    with open(os.path.join(directory, f"{stem}.index.json")) as f:
        return json.load(f)["tensors"]


def test_tied_weights_are_stored_once_and_come_back_tied(mpi_tmp_path, comm, monkeypatch):
    """An embedding tied to the output layer (GPT-2, T5, small Llamas) was written twice by
    save_model and save_state (a quarter of a small LLM's checkpoint, for nothing). Stored once
    now; both keys load, sharing memory as torch.load gives them, into a tied model in place
    (still tied), into an untied one, and from a background save."""
    reset_state()
    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(_Tied(tie=True))
    inner = acc.unwrap_model(model)
    saved = {k: v.clone() for k, v in inner.state_dict().items()}
    acc.save_state(mpi_tmp_path / "plain")  # for the untied model below (no optimizer)
    acc.prepare(torch.optim.AdamW(model.parameters(), lr=0.1))
    acc.save_model(model, mpi_tmp_path / "model", safe_serialization=False)
    acc.save_state(mpi_tmp_path / "state")
    acc.save_state(mpi_tmp_path / "async", async_save=True)
    acc.wait_for_checkpoint()
    assert list(_stored(mpi_tmp_path / "model", "model")) == ["model/emb.weight"]
    for name in ("state", "async"):
        stored = _stored(mpi_tmp_path / name, "state")
        assert [k for k in stored if k.startswith("model_0/")] == ["model_0/emb.weight"], name

    loaded = load_model_state(mpi_tmp_path / "model")
    assert list(loaded) == ["emb.weight", "head.weight"]
    assert loaded["head.weight"].data_ptr() == loaded["emb.weight"].data_ptr()
    assert torch.equal(loaded["head.weight"], saved["head.weight"])
    for tie in (True, False):
        fresh = _Tied(tie=tie)
        fresh.load_state_dict(loaded)
        assert torch.equal(fresh.head.weight, saved["head.weight"]), tie
        assert torch.equal(fresh.emb.weight, saved["emb.weight"]), tie

    for name in ("state", "async"):
        with torch.no_grad():
            inner.emb.weight.zero_()
        where = inner.emb.weight.data_ptr()
        acc.load_state(mpi_tmp_path / name)
        assert inner.head.weight is inner.emb.weight, name
        assert inner.emb.weight.data_ptr() == where, name  # read in place
        assert torch.equal(inner.emb.weight, saved["emb.weight"]), name

    reset_state()
    acc = Accelerator()
    untied = acc.prepare(_Tied(tie=False))
    wanted = []
    read_arrays = CheckpointReader.read_arrays

    def spy(self, items, *args, **kwargs):
        wanted.extend(key for key, *_ in items)
        return read_arrays(self, items, *args, **kwargs)

    monkeypatch.setattr(CheckpointReader, "read_arrays", spy)
    acc.load_state(mpi_tmp_path / "plain")
    assert wanted.count("model_0/emb.weight") == 1, wanted  # one dataset, read once
    inner = acc.unwrap_model(untied)
    assert inner.head.weight is not inner.emb.weight
    assert torch.equal(inner.head.weight, saved["head.weight"])
    assert torch.equal(inner.emb.weight, saved["emb.weight"])


@pytest.mark.mpi(min_size=2)
def test_a_model_that_differs_on_one_rank_fails_the_load_before_any_rank_applies_it(
    mpi_tmp_path, comm
):
    def build():
        reset_state()
        acc = Accelerator()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
        model = acc.prepare(net)
        acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
        acc.register_for_checkpointing(progress := Progress())
        return acc, model, progress

    acc, model, progress = build()
    progress.epoch = 5
    acc.step = 3
    acc.save_state(mpi_tmp_path / "saved")
    acc, model, progress = build()
    if acc.process_index == acc.num_processes - 1:  # after prepare: DDP would refuse it
        acc.unwrap_model(model)[1].running_mean = torch.zeros(5)
    torch.rand(1)
    rng = torch.get_rng_state()
    with pytest.raises(CollectiveError) as info:
        acc.load_state(mpi_tmp_path / "saved")
    assert info.value.failed_ranks == [comm.size - 1]
    assert "other shapes: 1.running_mean: [4] in the checkpoint, [5] here" in str(info.value)
    # no rank applied anything: RNG states, step and custom objects as they were, everywhere
    assert torch.equal(torch.get_rng_state(), rng) and progress.epoch == 0 and acc.step == 0


def test_loading_the_other_kind_of_checkpoint_says_so(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup()
    acc.save_model(model, mpi_tmp_path / "weights", safe_serialization=False)
    acc.save_state(mpi_tmp_path / "state")
    with pytest.raises(CollectiveError, match=r"holds a save_model\(\) checkpoint"):
        acc.load_state(mpi_tmp_path / "weights")
    with pytest.raises(CheckpointError, match=r"holds a save_state\(\) checkpoint"):
        load_model_state(mpi_tmp_path / "state")


def test_a_failed_commit_removes_the_new_files_and_keeps_the_old_checkpoint(
    mpi_tmp_path, comm, monkeypatch
):
    from mpaccel.checkpoint import storage

    acc, model, opt, sched, loader, progress = _setup()
    target = mpi_tmp_path / "ckpt"
    acc.save_state(target)
    before = sorted(os.listdir(target))

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "write_index", full_disk)
    with pytest.raises(CollectiveError, match="committing the index"):
        acc.save_state(target)
    acc.wait_for_everyone()  # every rank has removed its files
    assert sorted(os.listdir(target)) == before  # no shard of the failed save is left behind
    acc.load_state(target)
    # A failure once the index is in place (here: removing the previous save's files) is an
    # error too, but the new checkpoint is committed: its files stay.
    monkeypatch.undo()
    monkeypatch.setattr(storage, "remove_stale", full_disk)
    with pytest.raises(CollectiveError, match="committing the index"):
        acc.save_state(target)
    acc.load_state(target)
    with CheckpointReader(str(target), "state") as reader:
        assert reader.verify() == []


def test_an_optimizer_of_another_layout_is_refused_untouched(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup()
    _train(acc, model, opt, sched, loader, progress, epochs=1)
    acc.save_state(mpi_tmp_path / "layout")
    acc2, model2, opt2, sched2, loader2, progress2 = _setup(seed_model=4)
    _train(acc2, model2, opt2, sched2, loader2, progress2, epochs=1)
    inner = opt2.optimizer
    weights = [p for n, p in acc2.unwrap_model(model2).named_parameters() if "weight" in n]
    others = [p for n, p in acc2.unwrap_model(model2).named_parameters() if "weight" not in n]
    inner.param_groups = []  # the same parameters in two groups: a layout the save lacks
    inner.add_param_group({"params": weights, "lr": 1e-2})
    inner.add_param_group({"params": others, "lr": 1e-2})
    before = {(pid, n): v.clone() for pid, st in opt2.state_dict()["state"].items()
              for n, v in st.items()}
    with pytest.raises(CollectiveError, match="optimizer_0"):
        acc2.load_state(mpi_tmp_path / "layout")
    for (pid, name), value in before.items():
        assert torch.equal(opt2.state_dict()["state"][pid][name], value), (pid, name)


def test_automatic_naming_rotation_and_latest(mpi_tmp_path, comm):
    config = ProjectConfiguration(project_dir=str(mpi_tmp_path), automatic_checkpoint_naming=True,
                                  total_limit=2)
    acc, model, *_ = _setup(project_config=config)
    saved = []
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        saved.append(_params(acc, model).clone())
        acc.save_state()
    acc.wait_for_everyone()
    names = sorted(os.listdir(mpi_tmp_path / "checkpoints"))
    assert names == ["checkpoint_2", "checkpoint_3"]
    assert acc.save_iteration == 4
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state()
    assert torch.equal(_params(acc, model), saved[3])
    # debris of an interrupted save (no index) is never taken for the latest
    if acc.is_main_process:
        os.makedirs(mpi_tmp_path / "checkpoints" / "checkpoint_9")
    acc.wait_for_everyone()
    acc.load_state()
    assert acc.save_iteration == 4


def test_rotation_makes_room_before_a_save_removes_debris_and_says_so(
    mpi_tmp_path, comm, monkeypatch, caplog
):
    """As in Accelerate, the oldest checkpoints go before the new one is written (a crash then
    leaves total_limit - 1 of them, never total_limit + 1), with a message on the main process;
    a checkpoint whose deletion was cut short (no index left) is debris the next save removes."""
    import logging

    import mpaccel.checkpoint as checkpoint_module
    from mpaccel.checkpoint import api as save_module  # save_state calls write_checkpoint there

    caplog.set_level(logging.INFO, logger="mpaccel.checkpoint")
    config = ProjectConfiguration(project_dir=str(mpi_tmp_path), automatic_checkpoint_naming=True,
                                  total_limit=2)
    acc, model, *_ = _setup(project_config=config)
    root = mpi_tmp_path / "checkpoints"
    acc.save_state()
    acc.save_state()
    acc.wait_for_everyone()
    if acc.is_main_process:  # killed after its commit was undone: the files without an index
        (root / "checkpoint_0" / "state.index.json").unlink()
    acc.wait_for_everyone()
    assert checkpoint_module.checkpoints_in(str(mpi_tmp_path))[0][2] is False
    complete_at_write = []
    real = checkpoint_module.write_checkpoint

    def writing(*args, **kwargs):
        found = checkpoint_module.checkpoints_in(str(mpi_tmp_path))
        complete_at_write.append([n for n, _, ok in found if ok])
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "write_checkpoint", writing)
    caplog.clear()
    acc.save_state()
    acc.save_state()
    acc.wait_for_everyone()
    assert complete_at_write == [[1], [2]]
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]
    said = [r.getMessage() for r in caplog.records if r.name == "mpaccel.checkpoint"]
    expected = ["[RANK 0] Deleting what interrupted saves or deletions left (no index): "
                "checkpoint_0",
                "[RANK 0] Deleting 1 checkpoint(s) to keep total_limit=2: checkpoint_1"]
    assert said == (expected if acc.is_main_process else []), said


def test_a_new_run_never_saves_over_or_below_existing_checkpoints(mpi_tmp_path, comm):
    def config(**kwargs):
        return ProjectConfiguration(project_dir=str(mpi_tmp_path),
                                    automatic_checkpoint_naming=True, total_limit=2, **kwargs)

    acc, model, *_ = _setup(project_config=config())
    for _ in range(3):
        acc.save_state()  # checkpoint_0..2; rotation keeps 1 and 2
    # A restarted script that forgot load_state() would save checkpoint_0 (and rotation, oldest
    # number first, would delete it at once): refused on every rank, before anything is written.
    acc, model, *_ = _setup(project_config=config())
    with pytest.raises(CollectiveError, match="already holds checkpoint_2") as info:
        acc.save_state()
    assert "load_state()" in str(info.value) and "iteration=3" in str(info.value)
    acc.wait_for_everyone()
    assert sorted(os.listdir(mpi_tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    acc.load_state()  # resuming continues the numbering
    acc.save_state()
    acc, model, *_ = _setup(project_config=config(iteration=4))  # or continuing by hand
    acc.save_state()
    acc.wait_for_everyone()
    assert sorted(os.listdir(mpi_tmp_path / "checkpoints")) == ["checkpoint_3", "checkpoint_4"]


def test_async_save_snapshots_and_commits(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup()
    before = _params(acc, model).clone()
    acc.save_state(mpi_tmp_path / "a1", async_save=True)
    with torch.no_grad():  # training goes on while the save is written
        for p in model.parameters():
            p.mul_(0)
    acc.save_state(mpi_tmp_path / "a2", async_save=True)  # waits for the first
    acc.wait_for_checkpoint()
    acc.load_state(mpi_tmp_path / "a1")
    assert torch.equal(_params(acc, model), before)
    acc.load_state(mpi_tmp_path / "a2")
    assert _params(acc, model).abs().sum() == 0


def test_an_async_save_records_its_own_checkpoint_number(mpi_tmp_path, comm, monkeypatch):
    """The background writer took the checkpoint number from the live ProjectConfiguration,
    which the caller had already moved on to the next save's when the thread started late."""
    import time

    from mpaccel.checkpoint import AsyncSaver

    start = AsyncSaver.start
    monkeypatch.setattr(AsyncSaver, "start",
                        lambda self, target: start(self, lambda: (time.sleep(0.2), target())))
    reset_state()
    config = ProjectConfiguration(project_dir=str(mpi_tmp_path / "p"),
                                  automatic_checkpoint_naming=True, total_limit=5)
    acc = Accelerator(project_config=config)
    acc.prepare(torch.nn.Linear(64, 64))
    for _ in range(3):
        acc.save_state(async_save=True)
    acc.wait_for_checkpoint()
    for number in range(3):
        directory = mpi_tmp_path / "p" / "checkpoints" / f"checkpoint_{number}"
        with CheckpointReader(str(directory), "state") as reader:
            assert reader.index.metadata["iteration"] == number


def test_reader_verify_and_listing(mpi_tmp_path, comm):
    acc, *_ = _setup()
    acc.save_state(mpi_tmp_path / "v")
    acc.wait_for_everyone()
    with CheckpointReader(str(mpi_tmp_path / "v"), "state") as reader:
        assert reader.verify() == []
        assert reader.world_size == comm.size
        assert {"model_0", "optimizer_0", "scheduler_0", "custom_0"} <= set(reader.components())


def test_flatten_round_trip_and_sizes():
    tree = {"a": (1, 2.5, float("inf")), 3: [torch.ones(2, dtype=torch.bfloat16)],
            "n": np.arange(3, dtype=np.uint32), "s": np.float64(1.5), "d": torch.float16,
            "__x": None}
    document, tensors = flatten(tree, "t")
    json.dumps(document)  # JSON all the way down
    back = unflatten(document, lambda name, kind: tensors[name])
    assert back["a"] == (1, 2.5, float("inf")) and back[3][0].dtype == torch.bfloat16
    assert back["n"].dtype == np.uint32 and back["s"] == 1.5 and back["d"] is torch.float16
    assert back["__x"] is None
    assert parse_size("10GB") == 10**10 and parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2 * 2**30 and parse_size(1234) == 1234
    with pytest.raises(ValueError, match="not a size"):
        parse_size("big")


def test_save_mid_accumulation_keeps_partial_gradients(mpi_tmp_path, comm):
    acc, model, opt, sched, loader, progress = _setup(gradient_accumulation_steps=2)
    x, y = next(iter(loader))
    with acc.accumulate(model):
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
    assert not acc.sync_gradients
    grads = [p.grad.clone() for p in acc.unwrap_model(model).parameters()]
    acc.save_state(mpi_tmp_path / "mid")
    acc2, model2, *_ = _setup(seed_model=3, gradient_accumulation_steps=2)
    acc2.load_state(mpi_tmp_path / "mid")
    assert acc2.step == 1
    for p, g in zip(acc2.unwrap_model(model2).parameters(), grads):
        assert torch.equal(p.grad, g)


class _Tally:
    """A Stateful that is not a torch object: a count and a list."""

    def __init__(self):
        self.count, self.seen = 0, []

    def state_dict(self):
        return {"count": self.count, "seen": list(self.seen)}

    def load_state_dict(self, state):
        self.count, self.seen = state["count"], list(state["seen"])


def test_plain_stateful_objects_round_trip_without_an_accelerator(mpi_tmp_path, comm):
    """The checkpoint layer takes a communicator and Stateful objects by name: a module, an
    optimizer, a small Stateful shared by every rank and one of each rank's own come back,
    with each rank's RNG state, and no Accelerator (nor its shared state) is ever made."""
    from mpaccel.checkpoint import TrainingState, load_state, save_state
    from mpaccel.comm import MPIComm
    from mpaccel.state import PartialState

    reset_state()
    control = MPIComm(comm, 120.0, interruptible=False)

    def make(seed):
        torch.manual_seed(seed)
        module = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        tally, own = _Tally(), _Tally()
        objects = TrainingState(models={"net": module}, optimizers={"sgd": opt},
                                shared={"tally": tally}, per_rank={"own": own})
        return module, opt, tally, own, objects

    try:
        module, opt, tally, own, objects = make(0)
        module(torch.ones(2, 4)).sum().backward()
        opt.step()
        tally.count, tally.seen = 5, [1.5, "a", None]
        own.count, own.seen = 10 + control.rank, [control.rank]
        torch.manual_seed(100 + control.rank)
        directory = save_state(control, objects, str(mpi_tmp_path / "plain"))
        drawn = torch.rand(3)
        module2, opt2, tally2, own2, objects2 = make(1)
        assert load_state(control, objects2, directory) == directory
        assert torch.equal(torch.rand(3), drawn)  # this rank's RNG state came back
        for a, b in zip(module.parameters(), module2.parameters(), strict=True):
            assert torch.equal(a, b)
        momentum = [opt.state[p]["momentum_buffer"] for p in module.parameters()]
        assert all(torch.equal(m, opt2.state[p]["momentum_buffer"])
                   for m, p in zip(momentum, module2.parameters(), strict=True))
        assert tally2.state_dict() == {"count": 5, "seen": [1.5, "a", None]}
        assert own2.state_dict() == {"count": 10 + control.rank, "seen": [control.rank]}
        with CheckpointReader(directory, "state") as reader:
            assert reader.components() == ["net", "sgd", "tally"]
            mine = reader.index.per_rank[control.rank].components
            assert list(mine) == ["rng", "own"]
        assert not PartialState._shared_state, "an Accelerator's state was made"
    finally:
        control.free()


def test_two_objects_under_one_entry_name_are_refused():
    """Entry names are the file format: two objects under one name would overwrite each other
    in the checkpoint, so TrainingState refuses them, naming the entry."""
    from mpaccel.checkpoint import TrainingState

    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"\['a'\]"):
        TrainingState(models={"a": module}, shared={"a": _Tally()})
    with pytest.raises(ValueError, match=r"\['rng'\]"):
        TrainingState(per_rank={"rng": _Tally()})
    TrainingState(models={"a": module}, per_rank={"a": _Tally()})  # shared and per-rank: apart
