"""checkpoint/index.py: the typed index reads every index mpaccel writes and gives back the very
document, byte for byte (to_json(from_json(x)) == x), and upgrades the layouts of older
indexes in from_json."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from test_checkpoint_sharded import build, stepped

from mpaccel import PartialState
from mpaccel.checkpoint.format import INDEX_DIGEST
from mpaccel.checkpoint.index import CheckpointIndex, RowSlice, TensorEntry
from mpaccel.checkpoint.reader import CheckpointReader
from mpaccel.checkpoint.sharded import save_sharded
from mpaccel.checkpoint.storage import write_checkpoint

pytestmark = pytest.mark.mpi_timeout(300)


def _state() -> dict:
    return {
        "model_0": {"w": torch.arange(12.0).reshape(3, 4), "empty": torch.zeros(3, 0),
                    "scalar": torch.tensor(7, dtype=torch.int64)},
        "custom_0": {"table": np.arange(6, dtype=np.int16), "pair": (1.5, float("nan")),
                     "keys": {3: "three"}},
    }


def _read_back(path) -> tuple[str, dict, CheckpointIndex]:
    text = path.read_text()
    document = json.loads(text)
    return text, document, CheckpointIndex.from_json(document, str(path))


def _check_round_trip(path) -> CheckpointIndex:
    text, document, index = _read_back(path)
    assert index.to_json() == document
    # what storage.write_index writes, to the byte: the format did not change
    assert json.dumps(index.to_json(), indent=1, allow_nan=False) == text
    with CheckpointReader(str(path.parent), path.name.split(".")[0]) as reader:
        assert reader.index == index
    return index


def test_state_and_model_indexes_round_trip_byte_for_byte(mpi_tmp_path):
    comm = PartialState().comm
    rank = comm.rank
    write_checkpoint(comm, str(mpi_tmp_path / "s"), "state", _state(),
                     per_rank={"rng": {"seed": torch.tensor([rank, 1])}},
                     metadata={"kind": "state", "iteration": 3})
    index = _check_round_trip(mpi_tmp_path / "s" / "state.index.json")
    assert (index.format_version, index.world_size, index.is_sharded) == (1, comm.size, False)
    assert index.metadata == {"kind": "state", "iteration": 3}
    assert index.tensors["model_0/w"].shape == (3, 4)
    assert index.tensors["model_0/empty"].offset is None  # empty: no bytes, no offset
    assert [part.file for part in index.per_rank] == sorted(
        part.file for part in index.per_rank)
    assert len(index.per_rank) == comm.size and index.index_xxh3 is not None
    assert set(index.file_sizes) == {*index.shards, *(p.file for p in index.per_rank)}
    assert dict(index.entries()).keys() == {*index.tensors, "rng/seed"}

    write_checkpoint(comm, str(mpi_tmp_path / "m"), "model",
                     {"model": {f"layer{i}": torch.full((8,), float(i)) for i in range(6)}},
                     max_shard_bytes=64, metadata={"kind": "model"})
    index = _check_round_trip(mpi_tmp_path / "m" / "model.index.json")
    assert len(index.shards) == 3 and index.per_rank == ()


def test_sharded_index_round_trips_byte_for_byte(group, mpi_tmp_path):
    model = build(0)
    opt = stepped(model, 0.1, 0)
    save_sharded(group, mpi_tmp_path / "ckpt", {"model": model.state_dict(),
                                                "optim": opt.state_dict()})
    index = _check_round_trip(mpi_tmp_path / "ckpt" / "sharded.index.json")
    assert index.is_sharded and index.format_version == 2 and index.tensors == {}
    weight = index.sliced["model/0.weight"]
    assert weight.shape == (7, 5)
    assert [(p.start, p.stop) for p in weight.slices][-1][1] == 7
    assert all(isinstance(p, RowSlice) and p.xxh3 for p in weight.slices)


def test_older_indexes_are_upgraded_in_one_place(mpi_tmp_path):
    comm = PartialState().comm
    write_checkpoint(comm, str(mpi_tmp_path / "old"), "state", _state(),
                     per_rank={"rng": {"seed": torch.tensor([1, 2])}},
                     metadata={"kind": "state"})
    path = mpi_tmp_path / "old" / "state.index.json"
    _, document, _ = _read_back(path)
    # what indexes of earlier versions lack: checksum, recorded offsets and file sizes,
    # metadata, who wrote them and when
    old = {k: v for k, v in document.items()
           if k not in (INDEX_DIGEST, "file_sizes", "metadata", "stem", "save_id", "created",
                        "mpaccel_version")}
    for part in [old, *old["per_rank"]]:
        for entry in part["tensors"].values():
            entry.pop("offset", None)
    old["sliced"] = {"model_0/w": "ignored: format 1 has no sliced tensors"}
    comm.barrier()
    if comm.rank == 0:
        path.write_text(json.dumps(old, indent=1))
    comm.barrier()
    index = CheckpointIndex.from_json(json.loads(path.read_text()), str(path))
    assert index.file_sizes == {} and index.metadata == {} and index.sliced == {}
    assert (index.stem, index.save_id, index.created, index.index_xxh3) == (None,) * 4
    assert all(entry.offset is None for _, entry in index.entries())
    upgraded = {k: v for k, v in old.items() if k != "sliced"}
    assert index.to_json() == {**upgraded, "metadata": {}, "file_sizes": {}}
    # and it loads, through HDF5 (no offsets to read at)
    with CheckpointReader(str(mpi_tmp_path / "old"), "state") as reader:
        assert reader.index == index
        assert torch.equal(reader.component("model_0")["w"], torch.arange(12.0).reshape(3, 4))
        assert reader.verify() == []
    comm.barrier()


def test_entries_pickle_as_themselves():
    # the ranks allgather their entries at every save
    entries = {"a/w": TensorEntry("f.h5", "float32", (2, 3), 24, "0" * 16, 4096),
               "a/e": TensorEntry("f.h5", "float32", (0,), 0, "1" * 16, None)}
    assert pickle.loads(pickle.dumps(entries)) == entries
