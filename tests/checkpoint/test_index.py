"""checkpoint/index.py: the typed index reads every index mpaccel writes and gives back the very
document, byte for byte (to_json(from_json(x)) == x), and upgrades the layouts of older
indexes in from_json."""

from __future__ import annotations

import gc
import json
import pickle
import tracemalloc

import numpy as np
import pytest
import torch

from mpaccel import PartialState
from mpaccel.checkpoint import CheckpointError
from mpaccel.checkpoint.format import INDEX_DIGEST
from mpaccel.checkpoint.index import CheckpointIndex, RowSlice, TensorEntry
from mpaccel.checkpoint.reader import CheckpointReader
from mpaccel.checkpoint.sharded.save import save_sharded
from mpaccel.checkpoint.writer import write_checkpoint
from tests.checkpoint.sharded.test_save_load import build, stepped

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


@pytest.mark.mpi(size=1)  # the check of one index: the same on every rank
def test_an_index_of_a_newer_format_version_is_refused_with_a_hint(tmp_path):
    from mpaccel import __version__
    from mpaccel.checkpoint.format import NEWEST_FORMAT_VERSION

    comm = PartialState().comm
    write_checkpoint(comm, str(tmp_path / "ckpt"), "state", _state())
    path = tmp_path / "ckpt" / "state.index.json"
    document = json.loads(path.read_text())
    document.pop(INDEX_DIGEST)
    newer = NEWEST_FORMAT_VERSION + 1
    path.write_text(json.dumps({**document, "format_version": newer, "mpaccel_version": "9.0"}))
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(str(tmp_path / "ckpt"), "state")
    assert str(info.value).startswith(
        f"{str(path)!r} has format version {newer} (written by mpaccel '9.0'); this mpaccel "
        f"({__version__}) reads format versions up to {NEWEST_FORMAT_VERSION} and would "
        "misread it")
    assert "HINT: load it with an mpaccel at least as recent as the one that wrote it" in str(
        info.value)


def test_entries_pickle_as_themselves():
    # the ranks allgather their entries at every save
    entries = {"a/w": TensorEntry("f.h5", "float32", (2, 3), 24, "0" * 16, 4096),
               "a/e": TensorEntry("f.h5", "float32", (0,), 0, "1" * 16, None)}
    assert pickle.loads(pickle.dumps(entries)) == entries


class _Listed:
    """A Stateful whose state is a list of small values (what a registered object may hold)."""

    def __init__(self, values):
        self.values = values

    def state_dict(self):
        return {"values": self.values}

    def load_state_dict(self, state):
        self.values = state["values"]


def _peak(work) -> tuple[int, BaseException | None]:
    """(peak bytes Python allocated while `work` ran (tracemalloc), what it raised)."""
    gc.collect()
    tracemalloc.start()
    error = None
    try:
        work()
    except Exception as exc:  # the caller checks it
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, error


def _objects(seed: int):
    from mpaccel.checkpoint import TrainingState

    torch.manual_seed(seed)
    return TrainingState(models={"model_0": torch.nn.Linear(4, 3)})


@pytest.mark.mpi(max_size=2)  # a memory bound per rank: 4 ranks on 2 cores add 14 s, no fact
def test_an_index_padded_with_empty_dicts_costs_at_most_10x_its_size(mpi_tmp_path, capsys):
    """Issue 27, item 6: an index padded to tens of MB with `{}` items under `metadata` (an
    unknown field, allowed) cost 26-28x its size in `mpaccel ckpt ls` and `load_state`. Now
    it is refused before it is parsed: listing it and loading it (every rank) take at most
    10x its size, and the model is unchanged."""
    from mpaccel.checkpoint import CheckpointCollectiveError, load_state, save_state
    from mpaccel.cli import main

    comm = PartialState().comm
    directory = save_state(comm, _objects(0), str(mpi_tmp_path / "ckpt"))
    path = mpi_tmp_path / "ckpt" / "state.index.json"
    comm.barrier()
    if comm.rank == 0:
        document = json.loads(path.read_text())
        document["metadata"]["pad"] = "PAD"
        pad = "[" + ",".join(["{}"] * (8 << 20)) + "]"  # 24 MiB
        path.write_text(json.dumps(document).replace('"PAD"', pad))
        del pad
    comm.barrier()
    size = path.stat().st_size
    assert size > 24 << 20

    # (its checksum no longer matches: it is refused before that is looked at)
    peak, _ = _peak(lambda: main(["ckpt", "ls", directory]))
    assert peak <= 10 * size, f"mpaccel ckpt ls took {peak / size:.1f}x its size"
    assert "once parsed" in capsys.readouterr().err

    objects = _objects(1)
    before = {k: v.clone() for k, v in objects.models["model_0"].state_dict().items()}
    peak, error = _peak(lambda: load_state(comm, objects, directory))
    assert peak <= 10 * size, f"load_state took {peak / size:.1f}x the index's size"
    assert isinstance(error, CheckpointCollectiveError) and "once parsed" in str(error), error
    for key, value in objects.models["model_0"].state_dict().items():
        assert torch.equal(value, before[key]), key
    comm.barrier()


_DENSE = {  # JSON values of one kind, each about as costly per byte as JSON allows
    "nested lists": lambda i: "[[[]]]",
    "unique keys and strings": lambda i: f'"{i:x}":"{i:x}"',
}


@pytest.mark.mpi(size=1)  # the same work on every rank would prove nothing more
@pytest.mark.parametrize("kind", list(_DENSE))
def test_the_densest_index_the_bound_lets_through_costs_at_most_10x_its_size(tmp_path, kind):
    """An index padded under `metadata` with the values that cost the most memory per byte,
    spaced out just enough to pass the bound (index_check.MAX_VALUE_COST): opening it (read,
    parse, schema, checksum, typed index) takes at most 10x its size."""
    from mpaccel.checkpoint import index_check
    from mpaccel.checkpoint.format import index_digest

    write_checkpoint(PartialState().comm, str(tmp_path / "d"), "state", _state(),
                     metadata={"kind": "model"})
    path = tmp_path / "d" / "state.index.json"
    make = _DENSE[kind]
    count = 60_000
    items = [make(i) for i in range(count)]
    opened, closed = ("{", "}") if ":" in items[0] and not items[0].startswith("{") else "[]"
    sample = opened + ",".join(items) + closed
    scanner = index_check.IndexScanner("sample")
    scanner.feed(sample.encode())
    strings = scanner.quotes // 2 - scanner.keys
    cost = (scanner.cost + index_check.ENTRY_COST * scanner.keys
            + index_check.STRING_COST * strings)
    # blanks after each item, so that the whole costs just under the bound
    blanks = max(0, -(-cost // (index_check.MAX_VALUE_COST * count)) - len(sample) // count)
    # (FREE_COST lets 1 MiB more through, about what the rest of the index leaves unused)
    pad = opened + ("," + " " * blanks).join(items) + closed
    document = json.loads(path.read_text())
    document.pop(INDEX_DIGEST)
    document["metadata"]["pad"] = json.loads(pad)
    document[INDEX_DIGEST] = index_digest(document)
    text = json.dumps(document)
    path.write_text(text.replace(json.dumps(document["metadata"]["pad"]), pad))
    del document, pad, sample, items
    size = path.stat().st_size
    assert size > 1 << 20

    peak, error = _peak(lambda: CheckpointReader(str(tmp_path / "d"), "state").close())
    assert error is None, error
    assert peak <= 10 * size, f"opening the index took {peak / size:.1f}x its size"


def test_a_save_whose_index_the_readers_would_refuse_is_refused(mpi_tmp_path):
    """What saves loads: a state whose index would break the readers' memory bound (a
    registered object holding many small dicts) is refused by the save, which commits
    nothing."""
    from mpaccel.checkpoint import CheckpointCollectiveError, TrainingState, save_state

    comm = PartialState().comm
    objects = TrainingState(shared={"custom_0": _Listed([{} for _ in range(100_000)])})
    with pytest.raises(CheckpointCollectiveError, match=r"cannot save: .* once parsed"):
        save_state(comm, objects, str(mpi_tmp_path / "dense"))
    assert not (mpi_tmp_path / "dense" / "state.index.json").exists()
    comm.barrier()
