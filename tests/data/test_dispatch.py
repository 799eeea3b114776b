"""dispatch_batches=True (DataLoaderDispatcher): rank 0 reads, every rank gets its part of each
global batch over MPI. The same bodies run at size 1 and under mpiexec -n 2/4; the batches
expected on each rank are those Accelerate 1.15's dispatcher gave under `accelerate launch`."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from mpaccel import Accelerator, DataLoaderConfiguration
from mpaccel.data_loader import DataLoaderDispatcher, prepare_data_loader
from mpaccel.errors import CollectiveError, ConfigurationError
from mpaccel.state import PartialState
from mpaccel.testing import reset_state


def _dispatching(**config) -> Accelerator:
    reset_state()
    return Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True, **config))


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


# Accelerate 1.15's dispatched batches, rank by rank (n=3 too, though the tests run at 1, 2, 4).
ACCELERATE = {
    "range10_b2": {
        2: [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]],
        3: [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [0, 1]]],
        4: [[[0, 1], [8]], [[2, 3], [9]], [[4, 5], [0]], [[6, 7], [1]]],
    },
    "stream23_b3": {
        2: [
            [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
            [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 0]],
        ],
        3: [
            [[0, 1, 2], [9, 10, 11], [18, 19]],
            [[3, 4, 5], [12, 13, 14], [20, 21]],
            [[6, 7, 8], [15, 16, 17], [22, 0]],
        ],
        4: [
            [[0, 1, 2], [12, 13, 14]],
            [[3, 4, 5], [15, 16, 17]],
            [[6, 7, 8], [18, 19, 20]],
            [[9, 10, 11], [21, 22, 0]],
        ],
    },
    "range3_b1": {
        2: [[[0], [2]], [[1], [0]]],
        3: [[[0]], [[1]], [[2]]],
        4: [[[0]], [[1]], [[2]], [[0]]],
    },
}
MAKE = {
    "range10_b2": lambda: DataLoader(list(range(10)), batch_size=2),
    "stream23_b3": lambda: DataLoader(Stream(23), batch_size=3),
    "range3_b1": lambda: DataLoader(list(range(3)), batch_size=1),
}


@pytest.mark.parametrize("case", sorted(ACCELERATE))
def test_each_rank_gets_accelerates_dispatched_batches(comm, case):
    acc = _dispatching()
    loader = acc.prepare(MAKE[case]())
    seen, flags = [], []
    for batch in loader:
        seen.append(batch.tolist())
        flags.append(acc.gradient_state.end_of_dataloader)
    if comm.size == 1:  # the loader's own batches
        assert seen == [b.tolist() for b in MAKE[case]()]
    else:
        assert seen == ACCELERATE[case][comm.size][comm.rank]
    assert flags[-1] is True and not any(flags[:-1])


def test_an_iterable_dataset_is_dispatched_by_default(comm):
    """As in Accelerate: a loader of an iterable dataset placed on the device is read by rank 0
    alone; gather_for_metrics gives each of its samples once (test_metrics' iterable case)."""
    reset_state()
    acc = Accelerator()
    loader = acc.prepare(DataLoader(SizedStream(30), batch_size=4))
    assert isinstance(loader, DataLoaderDispatcher) and isinstance(loader, DataLoader)
    gathered = torch.cat([acc.gather_for_metrics(batch) for batch in loader])
    assert gathered.tolist() == list(range(30))
    assert type(acc.prepare(DataLoader(list(range(4)), batch_size=2))) is not DataLoaderDispatcher
    placed_elsewhere = acc.prepare_data_loader(DataLoader(Stream(4), batch_size=2), False)
    assert type(placed_elsewhere) is not DataLoaderDispatcher


@pytest.mark.parametrize("length", [99, 512])
@pytest.mark.parametrize("split", [False, True])
def test_metrics_over_dispatched_batches_see_each_sample_once(comm, split, length):
    """test_metrics' torch case: 99 samples in batches of 16 (the last global batch completed
    with the first samples), and 512 (no remainder), split or not."""
    acc = _dispatching(split_batches=split)
    loader = acc.prepare(DataLoader(torch.arange(length), batch_size=16))
    gathered = [acc.gather_for_metrics(batch) for batch in loader]
    assert torch.cat(gathered).tolist() == list(range(length))
    total = 16 if split else 16 * comm.size
    assert len(gathered) == len(loader) == -(-length // total)
    assert loader.total_batch_size == (16 if split else 16 * comm.size)
    assert loader.batch_size == (16 // comm.size if split else 16)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_prepare_data_loader_dispatches_as_accelerates_central_check(comm, split, shuffle):
    """Accelerate's central_dl_preparation_check: the module function with dispatch_batches;
    gathered, the batches are the loader's samples (in order, unless shuffled)."""
    torch.manual_seed(comm.rank)  # only rank 0's draw counts
    state = PartialState()
    length = 32 * comm.size
    plain = DataLoader(range(length), batch_size=8, shuffle=shuffle)
    loader = prepare_data_loader(
        plain, state.device, put_on_device=True, split_batches=split, dispatch_batches=True
    )
    from mpaccel.utils import gather

    got = torch.cat([gather(batch) for batch in loader]).tolist()
    assert (sorted(got) if shuffle else got) == list(range(length))
    # Without device placement too (Accelerate refuses that): batches stay where they are.
    kept = prepare_data_loader(plain, dispatch_batches=True, data_seed=0)
    assert isinstance(kept, DataLoaderDispatcher) and kept.device is None


def test_batches_of_varying_size_lose_no_sample(comm):
    """Batches of a custom batch sampler joined into a global batch whose size does not divide:
    the first ranks take one sample more (Accelerate drops the extra samples)."""

    class Varying:
        def __iter__(self):
            return iter([[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11]])

        def __len__(self):
            return 5

    acc = _dispatching()
    loader = acc.prepare(DataLoader(list(range(12)), batch_sampler=Varying()))
    gathered = [acc.gather_for_metrics(batch) for batch in loader]
    assert sorted(torch.cat(gathered).tolist()) == list(range(12))


def test_a_custom_slice_fn_cuts_each_global_batch(comm):
    """slice_fn_for_dispatch(batch, slice, process_index=, num_processes=) decides each rank's
    part (here: a list of strings beside the tensors, cut too)."""
    calls = []

    def cut(batch, part, process_index=None, num_processes=None):
        calls.append((process_index, num_processes))
        return {"x": batch["x"][part], "names": batch["names"][part]}

    def collate(samples):
        return {"x": torch.tensor(samples), "names": [f"s{v}" for v in samples]}

    acc = _dispatching(split_batches=True)
    loader = acc.prepare_data_loader(
        DataLoader(list(range(8 * comm.size)), batch_size=2 * comm.size, collate_fn=collate),
        slice_fn_for_dispatch=cut,
    )
    batches = list(loader)
    assert all(batch["names"] == [f"s{v}" for v in batch["x"].tolist()] for batch in batches)
    mine = [b["x"].tolist() for b in batches]
    everyone = [v for rank in comm.allgather(mine) for b in rank for v in b]
    assert sorted(everyone) == list(range(8 * comm.size))
    if comm.rank == 0:  # rank 0 cuts every rank's part
        assert {index for index, _ in calls} == set(range(comm.size))
        assert {count for _, count in calls} == {comm.size}


class Faulty(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        if index == 13:
            raise ValueError(f"sample {index!r} is corrupt")
        return index


def test_a_failure_while_rank_0_reads_is_raised_on_every_rank(comm):
    """The dataset fails on rank 0, the only reader: every rank raises the same CollectiveError
    naming rank 0 and the cause (no rank is left waiting for a batch)."""
    acc = _dispatching()
    loader = acc.prepare(DataLoader(Faulty(), batch_size=2))
    seen = 0
    with pytest.raises(CollectiveError) as error:
        for _ in loader:
            seen += 1
    assert error.value.failed_ranks == [0]
    assert "sample 13 is corrupt" in str(error.value)
    assert "rank 0 reads every rank's batches" in str(error.value)
    if comm.rank == 0:
        assert isinstance(error.value.__cause__, ValueError)
    assert comm.allgather(seen) == [seen] * comm.size
    # A batch that cannot be sent (pickle refuses it), or joined: the same, with the reason.
    acc = _dispatching(split_batches=True)  # the batch is cut, not joined: it reaches pickle

    def collate(samples):
        return {"x": torch.tensor(samples), "callback": lambda: samples}

    unsendable = acc.prepare(
        DataLoader(list(range(4 * comm.size)), batch_size=comm.size, collate_fn=collate)
    )
    if comm.size > 1:
        with pytest.raises(CollectiveError, match="pickle"):
            list(unsendable)
    acc = _dispatching()
    shapes = acc.prepare(
        DataLoader([torch.zeros(1 + i % 2) for i in range(8 * comm.size)], batch_size=1)
    )
    if comm.size > 1:
        with pytest.raises(CollectiveError, match="cannot put together batches"):
            list(shapes)


def test_skip_first_batches_leaves_the_skipped_samples_unread(comm):
    """A dispatched pass resumed after K batches: rank 0 reads the epoch's first global batch
    (whose samples complete the last one, as before) and then only what follows the skip."""

    class Counting(Dataset):
        def __init__(self) -> None:
            self.read = 0

        def __len__(self) -> int:
            return 10 * 2 * comm.size + 1

        def __getitem__(self, index: int) -> int:
            self.read += 1
            return index

    dataset = Counting()
    acc = _dispatching()
    loader = acc.prepare(DataLoader(dataset, batch_size=2))
    whole = [batch.tolist() for batch in loader]
    dataset.read = 0
    assert acc.skip_first_batches(loader, 4) is loader
    assert len(loader) == len(whole) - 4
    assert [batch.tolist() for batch in loader] == whole[4:]
    reads = comm.allgather(dataset.read)
    global_batch = 2 * comm.size
    assert reads[0] == global_batch + (len(dataset) - 4 * global_batch)
    assert reads[1:] == [0] * (comm.size - 1)  # only rank 0 reads


def test_an_empty_loader_ends_on_every_rank(comm):
    acc = _dispatching()
    loader = acc.prepare(DataLoader(Stream(0), batch_size=2))
    assert list(loader) == []
    assert acc.gradient_state.end_of_dataloader is False  # no pass under way any more


def test_the_scatter_collective_gives_each_rank_its_object(comm):
    reset_state()
    mpaccel_comm = PartialState().comm
    objects = [{"rank": r, "rows": torch.arange(r + 1)} for r in range(comm.size)]
    got = mpaccel_comm.scatter(objects if comm.rank == 0 else None, 0, "test scatter")
    assert got["rank"] == comm.rank and got["rows"].tolist() == list(range(comm.rank + 1))
    if comm.rank == 0:
        with pytest.raises(ValueError, match="one object per rank"):
            mpaccel_comm.scatter(objects[:-1] + objects + objects, 0)


def test_dispatch_refuses_what_it_cannot_do(comm):
    with pytest.raises(ConfigurationError, match="batch size") as error:
        _dispatching(split_batches=True).prepare(DataLoader(Stream(4), batch_size=None))
    assert "HINT:" in str(error.value)


Pair = namedtuple("Pair", "x y")


def test_dispatched_parts_keep_their_dtypes_and_structure(comm):
    """Tensors of any dtype (bfloat16 has no numpy twin), in named tuples and dicts."""

    def collate(samples):
        rows = torch.tensor(samples)
        return {"pair": Pair(rows.to(torch.bfloat16), rows.to(torch.bool)), "id": rows}

    acc = _dispatching()
    loader = acc.prepare(DataLoader(list(range(4 * comm.size)), batch_size=2, collate_fn=collate))
    for batch in loader:
        assert isinstance(batch["pair"], Pair)
        assert batch["pair"].x.dtype == torch.bfloat16 and batch["pair"].y.dtype == torch.bool
        assert batch["pair"].x.tolist() == batch["id"].float().tolist()
        assert batch["id"].dtype == torch.int64
