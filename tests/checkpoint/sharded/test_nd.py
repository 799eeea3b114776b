"""N-D sharded checkpoints (checkpoint/sharded/save.py, load.py): tensor parallelism composed
with fully_shard gives DTensors placed on several mesh dimensions (strided shards, Shard(1),
Replicate); each rank writes only the blocks it owns, once across replicas, and a load onto
another mesh (FSDP alone, pure TP, TP with replicas, whole tensors) reads the blocks it needs,
bit-equal, model and optimizer state.

Each body runs at size 1, 2 and 4 (a 2 x 2 mesh at 4: dp_shard x tp); the meshes are made
from the ranks there are (`mesh_shape`)."""

from __future__ import annotations

import json
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from mpaccel.checkpoint.sharded.load import load_sharded
from mpaccel.checkpoint.sharded.save import (
    SHARDED_STEM,
    Box,
    LocalState,
    check_joined,
    collect_local,
    dtensor_rows,
    save_sharded,
    write_local,
)
from mpaccel.checkpoint.writer import write_checkpoint
from mpaccel.errors import CheckpointCollectiveError

pytestmark = pytest.mark.mpi_timeout(300)


@pytest.fixture
def world():
    """mpaccel's communicator over every rank, for tests that make no device mesh (no
    torch.distributed group is needed)."""
    from mpaccel import PartialState

    return PartialState().comm


def mesh_shape(size: int, kind: str) -> tuple[int, int]:
    """(data-parallel, tp) sizes of a mesh of `kind` over `size` ranks."""
    if kind == "nd":  # tp 2 x dp_shard 2 at 4
        return size // min(size, 2), min(size, 2)
    if kind == "tp":  # pure tensor parallelism
        return 1, size
    if kind == "tp_replicate":  # tp 2 x dp_replicate 2 at 4
        return size // min(size, 2), min(size, 2)
    return size, 1  # fsdp: every rank shards


def build(kind: str, seed: int, hidden: int = 8, inputs: int = 6) -> torch.nn.Module:
    """inputs -> hidden -> 4, laid out as `kind` says: "nd" (colwise then rowwise on tp,
    fully_shard on dp_shard), "tp" (pure TP on every rank), "tp_replicate" (TP on tp, the
    same on each dp_replicate group), "fsdp" (fully_shard on every rank), "plain"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 4))
    if kind == "plain":
        return model
    size = torch.distributed.get_world_size()
    dp, tp = mesh_shape(size, kind)
    names = ("dp_replicate" if kind == "tp_replicate" else "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=names)
    if kind != "fsdp":
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if kind in ("nd", "fsdp"):
        shard_mesh = mesh["dp_shard"]
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
    return model


def stepped(model: torch.nn.Module, lr: float, seed: int, inputs: int = 6):
    """An Adam that took one step (the same batch on every rank)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(seed)
    model(torch.randn(3, inputs)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full_state(model, opt, names=("model", "optim")) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, whole (a gather: for checking only)."""
    out = {f"{names[0]}/{k}": full(v).detach().clone() for k, v in model.state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        out.update({f"{names[1]}/{pid}.{k}": full(v).clone() for k, v in state.items()})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_blocks_are_where_torch_puts_the_elements(group):
    # Uneven sizes (10 rows over tp 2 then dp 2: 3 + 2 each), checked against the unsharded
    # model of the same seed, not against a gather: what each rank holds at each block.
    plain = build("plain", 7, hidden=10, inputs=5)
    model = build("nd", 7, hidden=10, inputs=5)
    reference = plain.state_dict()
    for key, value in model.state_dict().items():
        rows = dtensor_rows(value, key)
        assert rows is not None, key
        local = value.to_local()
        boxes = rows.boxes or ()
        if boxes:
            assert sum(box.size for box in boxes) == local.numel(), key
            for box in boxes:
                part = reference[key][tuple(slice(a, b) for a, b in zip(box.start, box.stop))]
                assert torch.equal(local[box.local_slices()], part), (key, box)
        else:
            assert torch.equal(local, reference[key][rows.start:rows.stop]), key
    if group.size == 4:  # the rowwise weight is split along dimension 1 as well
        assert dtensor_rows(model.state_dict()["2.weight"], "w").boxes


def test_nd_round_trip_writes_each_block_once(group, mpi_tmp_path):
    model = build("nd", 0)
    opt = stepped(model, 0.1, 0)
    saved = full_state(model, opt)
    index = save_sharded(group, mpi_tmp_path / "ckpt",
                         {"model": model.state_dict(), "optim": opt.state_dict()})
    assert index["format_version"] == (3 if group.size >= 2 else 2)  # 3: it has blocks
    sliced = index["sliced"]
    # the bias after the rowwise layer is replicated on tp: one copy of each of its rows
    bias = sliced["model/2.bias"]["slices"]
    assert sum(p["stop"] - p["start"] for p in bias) == 4
    if group.size >= 2:  # rowwise: blocks of columns
        assert all(len(p["inner"]) == 1 for p in sliced["model/2.weight"]["slices"])
    other = build("nd", 1)
    other_opt = stepped(other, 0.5, 1)
    loaded = load_sharded(group, mpi_tmp_path / "ckpt",
                          {"model": other.state_dict(), "optim": other_opt.state_dict()})
    other_opt.load_state_dict(loaded["optim"])
    assert other_opt.param_groups[0]["lr"] == 0.1
    assert_same(full_state(other, other_opt), saved)


@pytest.mark.parametrize("target", ["fsdp", "tp", "tp_replicate", "plain"])
def test_nd_checkpoint_loads_onto_another_mesh(group, mpi_tmp_path, target):
    model = build("nd", 0)
    opt = stepped(model, 0.1, 0)
    saved = full_state(model, opt)
    save_sharded(group, mpi_tmp_path / "ckpt",
                 {"model": model.state_dict(), "optim": opt.state_dict()})
    other = build(target, 2)
    other_opt = stepped(other, 0.5, 2)
    loaded = load_sharded(group, mpi_tmp_path / "ckpt",
                          {"model": other.state_dict(), "optim": other_opt.state_dict()})
    other_opt.load_state_dict(loaded["optim"])
    assert_same(full_state(other, other_opt), saved)


@pytest.mark.parametrize("source", ["fsdp", "tp", "tp_replicate", "plain"])
def test_other_checkpoints_load_into_an_nd_model(group, mpi_tmp_path, source):
    # FSDP -> ND, pure TP -> ND, TP on replicas (one of them writes) -> ND, DDP (an ordinary
    # checkpoint, format 1) -> ND
    model = build(source, 3)
    opt = stepped(model, 0.2, 3)
    saved = full_state(model, opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    if source == "plain":
        write_checkpoint(group, str(mpi_tmp_path / "ckpt"), "sharded", state)
    else:
        save_sharded(group, mpi_tmp_path / "ckpt", state)
    other = build("nd", 4)
    other_opt = stepped(other, 0.5, 4)
    loaded = load_sharded(group, mpi_tmp_path / "ckpt",
                          {"model": other.state_dict(), "optim": other_opt.state_dict()})
    other_opt.load_state_dict(loaded["optim"])
    assert other_opt.param_groups[0]["lr"] == 0.2
    assert_same(full_state(other, other_opt), saved)


def test_copies_are_matched_per_tensor_not_per_mesh_shape(world):
    # "a" and "b" lie on meshes of one shape at different ranks (each stage of a model on ranks
    # of its own): not copies of each other, both are written. "c" lies on one mesh per
    # data-parallel replica (rank parity here): only the copy on the lowest ranks is.
    local = LocalState({}, {}, {}, {})
    for key in ("m/a", "m/b", "m/c"):
        local.arrays[key] = np.zeros((2, 3), np.float32)
    local.mesh_of = {"m/a": ((2,), 0), "m/b": ((2,), 2), "m/c": ((2,), 2 * (world.rank % 2))}
    check_joined(world, local, "saving")
    assert sorted(local.arrays) == ["m/a", "m/b"] + (["m/c"] if world.rank % 2 == 0 else [])


@pytest.mark.mpi(min_size=2)
def test_tensors_on_meshes_of_one_shape_at_other_ranks_are_each_saved(group, mpi_tmp_path):
    # "a" on rank 0 alone, "b" on rank 1 alone: one-rank meshes of the same shape
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    whole = {name: torch.arange(6.0).reshape(3, 2) + i for i, name in enumerate("ab")}
    state = {name: distribute_tensor(whole[name], DeviceMesh("cpu", [i]), [Shard(0)])
             for i, name in enumerate("ab")}
    save_sharded(group, mpi_tmp_path / "ckpt", {"model": state})
    target = {name: torch.zeros(3, 2) for name in "ab"}
    load_sharded(group, mpi_tmp_path / "ckpt", {"model": target})
    assert_same(target, whole)


WHOLE = torch.arange(24, dtype=torch.float32).reshape(4, 6)


def save_blocks(comm, directory: Path) -> None:
    """Save WHOLE as `model/w` in four 2 x 3 blocks, all of them written by rank 0 (the others
    write nothing): a checkpoint with N-D blocks at any world size, without a device mesh."""
    local = collect_local({"model": {"w": WHOLE}}, comm.rank)
    array = local.arrays.pop("model/w", None)
    if array is not None:  # rank 0: plain tensors are its to write
        boxes = [Box((r, c), (r + 2, c + 3), (r, c)) for r in (0, 2) for c in (0, 3)]
        local.blocks["model/w"] = [(box, array[box.local_slices()].copy()) for box in boxes]
    write_local(comm, str(directory), SHARDED_STEM, local)


def edit_index(comm, directory: Path, change) -> None:
    """Rank 0 applies `change` to the parsed index (without its checksum) and writes it back;
    every rank waits for it."""
    path = directory / f"{SHARDED_STEM}.index.json"
    comm.barrier()
    if comm.rank == 0:
        index = json.loads(path.read_text())
        index.pop("index_xxh3", None)
        change(index)
        path.write_text(json.dumps(index))
    comm.barrier()


def test_a_checkpoint_with_blocks_is_format_3_one_of_rows_stays_2(world, mpi_tmp_path):
    save_blocks(world, mpi_tmp_path / "blocks")
    save_sharded(world, mpi_tmp_path / "rows", {"model": {"w": WHOLE}})
    for name, version in (("blocks", 3), ("rows", 2)):
        index = json.loads((mpi_tmp_path / name / "sharded.index.json").read_text())
        assert index["format_version"] == version, name
        target = torch.zeros(4, 6)
        load_sharded(world, mpi_tmp_path / name, {"model": {"w": target}})
        assert torch.equal(target, WHOLE), name


@pytest.mark.mpi(size=1)  # what the index check finds does not depend on the world size
def test_blocks_in_a_format_2_index_are_refused(world, mpi_tmp_path):
    save_blocks(world, mpi_tmp_path / "ckpt")
    edit_index(world, mpi_tmp_path / "ckpt", lambda index: index.update(format_version=2))
    with pytest.raises(CheckpointCollectiveError,
                       match=r"\['inner'\] is in an index of format version 2: N-D blocks are "
                             r"format 3's"):
        load_sharded(world, mpi_tmp_path / "ckpt", {"model": {"w": torch.zeros(4, 6)}})


# A change to the blocks of save_blocks ([0:2, 0:3], [0:2, 3:6], [2:4, 0:3], [2:4, 3:6] in
# the index's order) -> the one error every rank raises for it
CRAFTED = {
    "outside the tensor's columns": (
        lambda s: s[1]["inner"].__setitem__(0, [3, 7]),
        r"\['slices'\]\[1\]\['inner'\]\[0\] is \[3, 7\]: expected \[start, stop\] with 0 <= "
        r"start < stop <= 6"),
    "outside the tensor's rows": (
        lambda s: s[3].update(start=3, stop=5),
        r"\['slices'\]\[3\] holds rows 3\.\.5: expected rows within 0\.\.4"),
    "overlapping another": (
        lambda s: s[1]["inner"].__setitem__(0, [2, 5]),
        r"\['slices'\] block 1 \(\[0:2, 2:5\]\) overlaps another block"),
    "stored twice": (
        lambda s: s.append(dict(s[0])),
        r"\['slices'\] hold 30 elements in 5 block\(s\) of a tensor of 24: elements are "
        r"stored twice"),
    "missing (a hole)": (
        lambda s: s.pop(1),
        r"\['slices'\] hold 18 of the tensor's 24 elements in 3 block\(s\): elements are "
        r"missing"),
    "cut for another rank count": (  # 2 columns where a save at 3 ranks would cut
        lambda s: s[0].update(inner=[[0, 2]], nbytes=16),
        r"hold 22 of the tensor's 24 elements in 4 block\(s\): elements are missing"),
    "of more dimensions than the tensor": (
        lambda s: s[0]["inner"].append([0, 1]),
        r"\['slices'\]\[0\]\['inner'\] is \[\[0, 3\], \[0, 1\]\]: expected 1 \[start, stop\] "
        r"pair\(s\), one per dimension after the first, for shape \[4, 6\]"),
}


def refused(comm, directory: Path, change: str) -> CheckpointCollectiveError:
    """Load the blocks of save_blocks after `change` into a target that holds other values:
    the error, once checked that it is CRAFTED's and that the target did not change."""
    edit_index(comm, directory, lambda index: CRAFTED[change][0](
        index["sliced"]["model/w"]["slices"]))
    target = torch.full((4, 6), -1.0)
    with pytest.raises(CheckpointCollectiveError, match=CRAFTED[change][1]) as info:
        load_sharded(comm, directory, {"model": {"w": target}})
    assert str(directory / "sharded.index.json") in str(info.value)
    assert torch.equal(target, torch.full((4, 6), -1.0)), "the target changed"
    return info.value


@pytest.mark.mpi(size=1)  # what the index check finds does not depend on the world size
@pytest.mark.parametrize("change", list(CRAFTED))
def test_a_crafted_block_is_refused_before_anything_changes(world, mpi_tmp_path, change):
    save_blocks(world, mpi_tmp_path / "ckpt")
    refused(world, mpi_tmp_path / "ckpt", change)


def test_every_rank_refuses_a_crafted_block_with_the_same_error(world, mpi_tmp_path):
    save_blocks(world, mpi_tmp_path / "ckpt")
    error = refused(world, mpi_tmp_path / "ckpt", "missing (a hole)")
    assert error.failed_ranks == list(range(world.size))
    assert len(set(world.allgather(str(error)))) == 1


@pytest.mark.parametrize("safe", [True, False])
def test_save_model_of_an_nd_model_writes_whole_tensors_without_a_gather(
    group, mpi_tmp_path, safe
):
    # safetensors (save_model's default for Hugging Face) and mpaccel's HDF5 layout, in
    # files of at most 200 bytes: every rank writes its blocks at their place in them
    from mpaccel.checkpoint import load_model_state, save_model

    model = build("nd", 5, hidden=10, inputs=5)
    expected = {k: v for k, v in build("plain", 5, hidden=10, inputs=5).state_dict().items()}
    save_model(group, model, mpi_tmp_path / "out", "200B", safe_serialization=safe)
    group.barrier()
    if safe:
        from safetensors.torch import load_file

        found = {}
        for name in sorted(p.name for p in (mpi_tmp_path / "out").glob("*.safetensors")):
            found.update(load_file(str(mpi_tmp_path / "out" / name)))
    else:
        found = load_model_state(mpi_tmp_path / "out")
    assert_same({k: v.detach() for k, v in found.items()},
                {k: v.detach() for k, v in expected.items()})


JOB = textwrap.dedent('''
    import os, sys
    import numpy as np, torch, torch.distributed as dist
    sys.path.insert(0, ROOT_DIR)
    from mpaccel import PartialState
    from mpaccel.checkpoint.sharded.save import save_sharded
    from mpaccel.checkpoint.sharded.load import load_sharded
    import tests.checkpoint.sharded.test_nd as t

    mode, directory = sys.argv[1], sys.argv[2]
    comm = PartialState().comm
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    reference = os.path.join(directory, "reference.npz")
    if mode == "save":  # at 4: tp 2 x dp_shard 2
        model = t.build("nd", 0, hidden=10, inputs=5)
        opt = t.stepped(model, 0.1, 0, inputs=5)
        saved = t.full_state(model, opt)
        save_sharded(comm, os.path.join(directory, "ckpt"),
                     {"model": model.state_dict(), "optim": opt.state_dict()})
        if comm.rank == 0:
            np.savez(reference, **{k: v.numpy() for k, v in saved.items()})
    else:  # fully_shard on every rank, no tp (at 1: whole tensors)
        expected = {k: torch.from_numpy(v) for k, v in np.load(reference).items()}
        kind = "fsdp" if comm.size > 1 else "plain"
        model = t.build(kind, 1, hidden=10, inputs=5)
        opt = t.stepped(model, 0.5, 1, inputs=5)
        loaded = load_sharded(comm, os.path.join(directory, "ckpt"),
                              {"model": model.state_dict(), "optim": opt.state_dict()})
        opt.load_state_dict(loaded["optim"])
        t.assert_same(t.full_state(model, opt), expected)
        print("loaded", comm.size, kind)
''')


@pytest.mark.mpi(size=1)  # nests mpiexec
@pytest.mark.launches
def test_saved_at_tp2_dp2_loads_at_2_without_tp_and_at_1(tmp_path):
    from mpaccel.testing import run_mpi

    script = tmp_path / "job.py"
    script.write_text(JOB.replace("ROOT_DIR", repr(str(Path(__file__).parents[3]))))
    run_mpi([str(script), "save", str(tmp_path)], n=4, timeout=240).check()
    sizes = (2, 1)
    with ThreadPoolExecutor(len(sizes)) as pool:
        runs = pool.map(
            lambda n: run_mpi([str(script), "load", str(tmp_path)], n=n, timeout=240), sizes
        )
    for n, run in zip(sizes, runs):
        assert f"loaded {n} {'fsdp' if n > 1 else 'plain'}" in run.check().stdout[0], (
            run.describe())
