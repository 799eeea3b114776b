"""Dataloader sharding through Accelerator.prepare: iterable datasets, batch samplers of
variable-size batches, random samplers with replacement. The same bodies run at size 1 and under
mpiexec -n 2/4; the batches expected on each rank are Accelerate's (1.15, prepare_data_loader)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from mpaccel import Accelerator, DataLoaderConfiguration
from mpaccel.errors import ConfigurationError
from mpaccel.testing import reset_state
from tests.conftest import accelerator


def _sharded(**config) -> Accelerator:
    """An accelerator whose loaders of iterable datasets are sharded (every rank reads the
    stream) instead of dispatched from rank 0, Accelerate's default for them."""
    return accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False, **config))


def _lists(loader) -> list:
    return [batch.tolist() for batch in loader]


def _items(loader) -> list:
    return [item.tolist() if isinstance(item, torch.Tensor) else item for item in loader]


class Stream(IterableDataset):
    """range(n) as a stream, in an order that follows set_epoch (identity at epoch 0)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.epochs_heard = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_heard.append(epoch)

    def __iter__(self):
        if self.epoch == 0:
            return iter(range(self.n))
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)))


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


class GeneratorStream(IterableDataset):
    """Shuffles with its `generator` attribute, seeded differently on every rank."""

    def __init__(self, n: int, rank: int) -> None:
        self.n, self.generator = n, torch.Generator().manual_seed(1000 + rank)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


class VariableBatches(Sampler):
    """A batch sampler without a batch_size attribute."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class BatchStream(IterableDataset):
    """An iterable dataset that yields whole batches (used with batch_size=None)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return (torch.tensor(batch) for batch in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even_batches", [True, False])
@pytest.mark.parametrize("split_batches", [False, True])
def test_an_iterable_dataset_is_dealt_like_the_same_samples_in_a_list(
    comm, split_batches, even_batches, drop_last
):
    for length, batch_size in [(10, 2), (23, 4), (3, 4), (16, 4)]:
        acc = _sharded(split_batches=split_batches, even_batches=even_batches)
        if split_batches and batch_size % comm.size:
            with pytest.raises(ConfigurationError, match="divisible"):
                acc.prepare(DataLoader(Stream(length), batch_size=batch_size))
            continue
        stream = acc.prepare(DataLoader(SizedStream(length), batch_size, drop_last=drop_last))
        listed = acc.prepare(DataLoader(list(range(length)), batch_size, drop_last=drop_last))
        got = _lists(stream)  # one pass: the next would hear epoch 1 and reshuffle
        assert got == _lists(listed), (length, batch_size)
        assert len(stream) == len(got)
        assert stream.remainder == listed.remainder
        assert stream.total_batch_size == listed.total_batch_size
        if comm.size == 1:  # the loader's own batches, unchanged
            plain = DataLoader(list(range(length)), batch_size, drop_last=drop_last)
            assert got == _lists(plain)


@pytest.mark.parametrize("even_batches", [True, False])
def test_an_iterable_dataset_gives_each_rank_accelerates_batches(comm, even_batches):
    acc = _sharded(even_batches=even_batches)
    loader = acc.prepare(DataLoader(Stream(10), batch_size=2))
    expected = {
        # even_batches: the first samples are repeated to complete the last round
        True: {
            1: [[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]],
            2: [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]],
            3: [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [0, 1]]],
            4: [[[0, 1], [8, 9]], [[2, 3], [0, 1]], [[4, 5], [2, 3]], [[6, 7], [4, 5]]],
        },
        # nothing repeated: the ranks past the last samples take one batch less
        False: {
            1: [[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]],
            2: [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]],
            3: [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5]]],
            4: [[[0, 1], [8, 9]], [[2, 3]], [[4, 5]], [[6, 7]]],
        },
    }[even_batches][comm.size]
    seen, flags = [], []
    for batch in loader:
        assert batch.device == acc.device
        seen.append(batch.tolist())
        flags.append(acc.gradient_state.end_of_dataloader)
    assert seen == expected[comm.rank]
    assert flags[-1] is True and not any(flags[:-1])
    assert loader.remainder == -1  # the stream has no length
    with pytest.raises(TypeError):
        len(loader)


@pytest.mark.parametrize("dispatch", [False, True])
def test_an_iterable_dataset_with_a_length_gathers_each_sample_once(comm, dispatch):
    acc = accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
    loader = acc.prepare(DataLoader(SizedStream(23), batch_size=3))
    assert len(loader) == -(-23 // (3 * comm.size))  # at size 1: the loader's 8 batches
    gathered = [acc.gather_for_metrics(batch) for batch in loader]
    assert loader.remainder == 23 % (3 * comm.size)
    assert len(gathered) == len(loader)
    assert torch.cat(gathered).tolist() == list(range(23))


@pytest.mark.parametrize("dispatch", [False, True])
def test_an_iterable_dataset_hears_the_epoch_and_its_generator_is_agreed(comm, dispatch):
    torch.manual_seed(1234 + comm.rank)  # each rank's own RNG differs: it must not matter
    acc = accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
    dataset = Stream(40)
    loader = acc.prepare(DataLoader(dataset, batch_size=2))
    loader.set_epoch(3)
    assert dataset.epoch == 3
    first = [v for batch in loader for v in batch.tolist()]
    second = [v for batch in loader for v in batch.tolist()]  # no set_epoch: the next epoch
    assert dataset.epochs_heard[-2:] == [3, 4]
    assert first != second

    # A stream drawing from its own `generator` (each rank's seeded differently) is made to
    # draw the same on every rank: together the ranks see each sample once, new each pass.
    loader = acc.prepare(DataLoader(GeneratorStream(40, comm.rank), batch_size=2))
    orders = []
    for _ in range(2):
        mine = [v for batch in loader for v in batch.tolist()]
        orders.append(mine)
        everyone = [v for part in comm.allgather(mine) for v in part]
        if 40 % (2 * comm.size) == 0:
            assert sorted(everyone) == list(range(40))
    assert orders[0] != orders[1]


B4 = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9]]
B5 = [*B4, [10, 11]]
# Accelerate's batches per rank for these batch samplers (even_batches: the last round is
# completed with the epoch's first batches, whole).
WHOLE_BATCHES = {
    (4, True): {
        1: [B4],
        2: [[B4[0], B4[2]], [B4[1], B4[3]]],
        3: [[B4[0], B4[3]], [B4[1], B4[0]], [B4[2], B4[1]]],
        4: [[B4[0]], [B4[1]], [B4[2]], [B4[3]]],
    },
    (4, False): {
        1: [B4],
        2: [[B4[0], B4[2]], [B4[1], B4[3]]],
        3: [[B4[0], B4[3]], [B4[1]], [B4[2]]],
        4: [[B4[0]], [B4[1]], [B4[2]], [B4[3]]],
    },
    (5, True): {
        1: [B5],
        2: [[B5[0], B5[2], B5[4]], [B5[1], B5[3], B5[0]]],
        3: [[B5[0], B5[3]], [B5[1], B5[4]], [B5[2], B5[0]]],
        4: [[B5[0], B5[4]], [B5[1], B5[0]], [B5[2], B5[1]], [B5[3], B5[2]]],
    },
    (5, False): {
        1: [B5],
        2: [[B5[0], B5[2], B5[4]], [B5[1], B5[3]]],
        3: [[B5[0], B5[3]], [B5[1], B5[4]], [B5[2]]],
        4: [[B5[0], B5[4]], [B5[1]], [B5[2]], [B5[3]]],
    },
}


def _unknown_size(source: str, batches: list[list[int]]) -> DataLoader:
    if source == "batch_sampler":
        return DataLoader(list(range(12)), batch_sampler=VariableBatches(batches))
    if source == "iterable":  # an iterable dataset yielding whole batches
        return DataLoader(BatchStream(batches), batch_size=None)
    # a map-style dataset whose items are whole batches, read unbatched
    return DataLoader([torch.tensor(batch) for batch in batches], batch_size=None)


@pytest.mark.parametrize("source", ["batch_sampler", "iterable", "map_unbatched"])
@pytest.mark.parametrize("even_batches", [True, False])
@pytest.mark.parametrize("batches", [B4, B5], ids=["4_batches", "5_batches"])
def test_batches_of_unknown_size_are_dealt_whole(comm, batches, even_batches, source):
    acc = _sharded(even_batches=even_batches)
    loader = acc.prepare(_unknown_size(source, batches))
    seen, flags = [], []
    for batch in loader:
        seen.append(batch.tolist())
        flags.append(acc.gradient_state.end_of_dataloader)
    assert seen == WHOLE_BATCHES[len(batches), even_batches][comm.size][comm.rank]
    assert flags[-1] is True and not any(flags[:-1])
    assert len(loader) == len(seen)
    assert loader.remainder == -1  # no batch size: how many samples are real is unknown
    assert loader.total_batch_size is None and loader.batch_size is None


@pytest.mark.parametrize("source", ["batch_sampler", "iterable", "map_unbatched"])
def test_split_batches_needs_a_batch_size(comm, source):
    acc = accelerator(split_batches=True)
    with pytest.raises(ConfigurationError, match="batch size") as error:
        acc.prepare(_unknown_size(source, B4))
    assert "HINT: use split_batches=False" in str(error.value)


@pytest.mark.parametrize("dispatch", [False, True])
@pytest.mark.parametrize("source", ["iterable", "batch_sampler"])
def test_resume_mid_epoch(comm, mpi_tmp_path, source, dispatch):
    def prepared():
        acc = accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        if source == "iterable":
            original = DataLoader(SizedStream(48), batch_size=2)
        else:
            original = DataLoader(list(range(40)), batch_sampler=VariableBatches([*B5, *B5]))
        return acc, acc.prepare(original)

    acc, loader = prepared()
    loader.set_epoch(1)
    whole_epoch = _lists(loader)
    loader.set_epoch(1)
    for _ in loader:
        acc.save_state(mpi_tmp_path / "ckpt")  # after the first batch, mid-epoch
        break
    acc, loader = prepared()
    acc.load_state(mpi_tmp_path / "ckpt")
    assert _lists(loader) == whole_epoch[1:]


@pytest.mark.parametrize("flow", ["accelerate", "load_state_only"])
@pytest.mark.parametrize("where", ["mid_epoch", "second_epoch", "after_last_batch"])
def test_resuming_the_way_accelerate_scripts_do(comm, mpi_tmp_path, flow, where):
    """The resume block of Accelerate's examples (complete_nlp_example, checkpointing.py):
    load_state, then the epoch and step to start from worked out with len(train_dataloader),
    then skip_first_batches. load_state must leave len() alone for that arithmetic (it gave
    the wrong epoch, or none); a checkpoint saved as the last batch of an epoch was out must
    resume at the next epoch (it gave an empty pass, or that epoch's order again). Without the
    skip (load_state alone) the loader resumes where it was, too."""

    def prepared():
        acc = accelerator()
        return acc, acc.prepare(DataLoader(list(range(10 * comm.size)), batch_size=2, shuffle=True))

    acc, loader = prepared()
    length = len(loader)
    epochs = 3
    stop = {"mid_epoch": 2, "second_epoch": length + 3, "after_last_batch": length}[where]
    stream, step = [], 0
    for _ in range(epochs):
        for batch in loader:
            stream.append(batch.tolist())
            step += 1
            if step == stop:
                acc.save_state(mpi_tmp_path / f"step_{step}")
    acc, loader = prepared()
    acc.load_state(mpi_tmp_path / f"step_{stop}")
    assert len(loader) == length
    seen = []
    if flow == "accelerate":
        resume_step = stop
        starting_epoch = resume_step // len(loader)
        resume_step -= starting_epoch * len(loader)
        for epoch in range(starting_epoch, epochs):
            active = loader
            if epoch == starting_epoch and resume_step is not None:
                active = acc.skip_first_batches(loader, resume_step)
            seen += [batch.tolist() for batch in active]
    else:
        while len(seen) < len(stream) - stop:
            before = len(seen)
            seen += [batch.tolist() for batch in loader]
            assert len(seen) > before  # no empty pass
    assert seen == stream[stop:]


class Counting(torch.utils.data.Dataset):
    """range(n), counting the samples loaded (in this process and in its loader's workers)."""

    def __init__(self, n: int) -> None:
        import multiprocessing

        self.n = n
        self.loaded = multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        with self.loaded.get_lock():
            self.loaded.value += 1
        return index


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("unbatched", [False, True])
def test_a_resumed_pass_loads_none_of_the_samples_it_skips(comm, workers, unbatched):
    """Resuming at batch K of an epoch of a map-style dataset loads only the batches after K
    (as Accelerate's skip at the batch sampler does): a resume deep into an epoch of costly
    samples must not read them all first. With loader workers too."""
    dataset = Counting(12 * comm.size)
    options = {"batch_size": None} if unbatched else {"batch_size": 2}
    context = "fork" if workers else None
    acc = accelerator()
    loader = acc.prepare(
        DataLoader(dataset, shuffle=True, num_workers=workers, multiprocessing_context=context,
                   **options)
    )
    loader.set_epoch(3)
    whole = _items(loader)
    per_batch = 1 if unbatched else 2
    assert dataset.loaded.value == len(whole) * per_batch
    dataset.loaded.value = 0
    loader.set_epoch(3)
    loader.skip_first_batches(4)
    assert _items(loader) == whole[4:]
    assert dataset.loaded.value == (len(whole) - 4) * per_batch
    dataset.loaded.value = 0
    assert _items(loader) != whole and dataset.loaded.value == len(whole) * per_batch


@pytest.mark.parametrize("source", ["batched", "unbatched", "iterable"])
def test_skip_first_batches_of_a_loader_that_was_not_prepared(comm, source):
    """As in Accelerate: a new loader that leaves out the first batches on every pass (the
    original is untouched); a map-style dataset's skipped batches are not loaded."""
    import mpaccel

    acc = accelerator()
    dataset = Counting(10)
    if source == "batched":
        original = DataLoader(dataset, batch_size=3)
    elif source == "unbatched":
        original = DataLoader(dataset, batch_size=None)
    else:
        original = DataLoader(SizedStream(10), batch_size=3)
    whole = _items(original)
    skipped = acc.skip_first_batches(original, 2)
    assert skipped is not original and isinstance(skipped, DataLoader)
    assert len(skipped) == len(whole) - 2
    dataset.loaded.value = 0
    for _ in range(2):  # on every pass
        assert _items(skipped) == whole[2:]
    if source != "iterable":  # two passes over the batches after the first two, no more
        assert dataset.loaded.value == 2 * sum(
            len(b) if isinstance(b, list) else 1 for b in whole[2:]
        )
    assert _items(original) == whole
    assert _items(mpaccel.skip_first_batches(original, 3)) == whole[3:]


def test_random_sampler_with_replacement_keeps_its_num_samples(comm):
    torch.manual_seed(1234 + comm.rank)  # each rank's own RNG differs: it must not matter
    acc = accelerator()
    sampler = RandomSampler(range(10), replacement=True, num_samples=40)
    loader = acc.prepare(DataLoader(list(range(10)), batch_size=5, sampler=sampler))
    n, r = comm.size, comm.rank
    assert len(loader) == -(-8 // n)  # 40 samples, 8 batches of 5, dealt out to n ranks
    epochs = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        mine = _lists(loader)
        # This rank's view of the epoch's draw (the sampler a checkpoint records): one and the
        # same on every rank, and this rank's batches are its share of it.
        loader.set_epoch(epoch)
        draw = list(loader.get_sampler())
        assert len(draw) == 40 and len(set(draw)) < 40  # drawn with replacement
        assert comm.allgather(draw) == [draw] * n
        batches = [draw[i : i + 5] for i in range(0, 40, 5)]
        assert mine[: len(batches[r::n])] == batches[r::n]
        if 8 % n == 0:
            assert sum(comm.allgather(sum(len(b) for b in mine))) == 40
        epochs.append(draw)
    assert epochs[0] != epochs[1]  # a new draw each epoch...
    assert epochs[0] == epochs[2]  # ...and the same one for the same epoch


def test_an_unbatched_loader_keeps_its_items_and_shuffles_them_alike(comm):
    """DataLoader(batch_size=None) over a map-style dataset: items, not batches, as in torch (at
    size 1 the loader's own items, as Accelerate gives them), dealt out as batches of no fixed
    size are; shuffled, one draw on every rank."""
    torch.manual_seed(1234 + comm.rank)  # each rank's own RNG differs: it must not matter
    acc = accelerator()
    plain = list(DataLoader(list(range(8)), batch_size=None))  # ints, as torch gives them
    loader = acc.prepare(DataLoader(list(range(8)), batch_size=None))
    items = list(loader)
    shuffled = acc.prepare(DataLoader(list(range(8)), batch_size=None, shuffle=True))
    draws = [comm.allgather(list(shuffled)) for _ in range(2)]  # before any assert: no rank
    # may leave for an assertion while the others wait in the collective
    expected = plain[comm.rank :: comm.size]
    short = len(plain) % comm.size
    if short and comm.rank >= short:  # even_batches: the last round ends with the first items
        expected.append(plain[comm.rank - short])
    assert items == expected
    assert len(loader) == len(items)
    for everyone in draws:
        assert {v for mine in everyone for v in mine} == set(range(8))
        assert {len(mine) for mine in everyone} == {len(expected)}  # even_batches
    assert draws[0] != draws[1]  # a new draw each epoch


@pytest.mark.parametrize("leave", ["peek", "break"])
@pytest.mark.parametrize("source", ["shuffled", "iterable", "dispatched"])
def test_a_pass_left_early_still_moves_on_to_the_next_epoch(comm, leave, source):
    """Every pass is a new epoch: a loop that leaves each epoch after K steps sees new batches
    every epoch (as with Accelerate's default sampler, whose generator moves on), instead of the
    same K batches again. set_epoch() chooses the epoch of the next pass."""

    def prepared():
        acc = accelerator()
        if source == "shuffled":
            return acc.prepare(DataLoader(list(range(24)), batch_size=2, shuffle=True))
        if source == "dispatched":
            acc.dataloader_config.dispatch_batches = True
        return acc.prepare(DataLoader(Stream(24), batch_size=2))

    reference = prepared()
    epochs = [_lists(reference) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    loader = prepared()
    if leave == "peek":
        assert next(iter(loader)).tolist() == epochs[0][0]
    else:
        for batch in loader:
            assert batch.tolist() == epochs[0][0]
            break
    assert [_lists(loader), _lists(loader)] == epochs[1:]
    loader.set_epoch(0)
    assert _lists(loader) == epochs[0]


def test_a_skip_asked_for_between_passes_applies_to_the_next_one(comm):
    acc = accelerator()
    loader = acc.prepare(DataLoader(list(range(24)), batch_size=2, shuffle=True))
    reference = acc.prepare(DataLoader(list(range(24)), batch_size=2, shuffle=True))
    epochs = [_lists(reference) for _ in range(3)]
    assert _lists(loader) == epochs[0]
    loader.skip_first_batches(2)
    assert len(loader) == len(epochs[1]) - 2
    assert _lists(loader) == epochs[1][2:]
    assert len(loader) == len(epochs[2]) and _lists(loader) == epochs[2]


def test_the_prepared_loader_answers_for_the_dataloaders_attributes(comm):
    """Attributes a script reads from its DataLoader (num_workers, collate_fn, pin_memory, ...)
    are there on the prepared one, as Accelerate's delegates them to the DataLoader inside."""
    acc = accelerator()

    def collate(samples):
        return torch.tensor(samples)

    original = DataLoader(
        list(range(12)), batch_size=2, collate_fn=collate, timeout=5, in_order=False
    )
    loader = acc.prepare(original)
    assert loader.collate_fn is collate
    assert loader.in_order is False and loader.pin_memory_device == ""
    assert loader.num_workers == 0 and loader.timeout == 5 and loader.pin_memory is False
    assert loader.prefetch_factor is None and loader.persistent_workers is False
    assert loader.worker_init_fn is None and loader.multiprocessing_context is None
    with pytest.raises(AttributeError, match="no_such_attribute"):
        loader.no_such_attribute  # noqa: B018


def test_the_prepared_loader_passes_for_a_dataloader_and_is_prepared_once(comm):
    """isinstance(loader, DataLoader) holds (code that checks it takes the prepared loader as
    Accelerate's), preparing it again returns it as it is, and it pickles."""
    import pickle

    from mpaccel.data.sharded import DataLoaderShard

    acc = accelerator()
    loader = acc.prepare(DataLoader(list(range(10 * comm.size)), batch_size=3, shuffle=True))
    assert isinstance(loader, DataLoader) and isinstance(loader, DataLoaderShard)
    assert type(loader) is DataLoaderShard
    assert acc.prepare(loader) is loader and acc.prepare_data_loader(loader) is loader
    assert len(acc._dataloaders) == 1
    copied = pickle.loads(pickle.dumps(loader))
    assert type(copied) is DataLoaderShard and isinstance(copied, DataLoader)
    assert _lists(copied) == _lists(loader) and len(copied) == len(loader)


def test_a_loader_resumed_with_skip_first_batches_counts_the_batches_it_will_give(comm):
    """len() of a loader given to skip_first_batches is what the resumed pass gives, before and
    during that pass (a script's `step == len(loader) - 1` test then finds its last step, as with
    Accelerate's skipping loader); once the pass has run to its end the loader is whole again."""
    acc = accelerator()
    loader = acc.prepare(DataLoader(list(range(24)), batch_size=2))
    whole = _lists(loader)
    resumed = acc.skip_first_batches(loader, 2)
    assert len(resumed) == len(whole) - 2
    seen = []
    for step, batch in enumerate(resumed):
        seen.append(batch.tolist())
        assert len(resumed) == len(whole) - 2
        assert acc.gradient_state.end_of_dataloader == (step == len(resumed) - 1)
    assert seen == whole[2:]
    assert len(loader) == len(whole) and _lists(loader) == whole


class Rows(Dataset):
    """A dataset that reads a list of indices at once (as a Hugging Face dataset does)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, indices):
        return torch.tensor(indices)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_batch_sampler_given_as_sampler_is_dealt_like_a_batch_sampler(comm, shuffle):
    """DataLoader(dataset, sampler=BatchSampler(...), batch_size=None): the batches are dealt
    as those of DataLoader(samples, batch_size, shuffle) are, in the same shuffled order."""
    for length, batch_size in [(10, 2), (23, 4), (3, 4)]:
        acc = accelerator()
        inner = RandomSampler(range(length)) if shuffle else SequentialSampler(range(length))
        sampler = BatchSampler(inner, batch_size, drop_last=False)
        given = acc.prepare(DataLoader(Rows(length), sampler=sampler, batch_size=None))
        listed = acc.prepare(DataLoader(list(range(length)), batch_size, shuffle=shuffle))
        for _ in range(2):  # two epochs: reshuffled alike
            assert _lists(given) == _lists(listed), (length, batch_size)
        assert len(given) == len(listed)
        assert given.remainder == listed.remainder
        assert given.total_batch_size == listed.total_batch_size


def test_a_shuffling_loader_still_has_a_random_sampler(comm):
    """Scripts look at the sampler to know whether a loader shuffles: the one drawing the same
    on every rank is still a RandomSampler, with its data source, replacement and num_samples."""
    acc = accelerator()
    loader = acc.prepare(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    for sampler in (loader.batch_sampler.sampler, loader.batch_sampler.batch_sampler.sampler):
        assert isinstance(sampler, RandomSampler)
        assert sampler.data_source == list(range(12)) and sampler.replacement is False
        assert sampler.num_samples == len(sampler) == 12
    plain = acc.prepare(DataLoader(list(range(12)), batch_size=2))
    assert not isinstance(plain.batch_sampler.sampler, RandomSampler)


# -- Accelerate's configuration, its shuffling generators and prepare_data_loader -------------


def test_the_dataloader_configuration_has_accelerates_fields_in_its_order(comm):
    config = DataLoaderConfiguration(False, None, True)  # split, dispatch, even, as Accelerate
    assert (config.split_batches, config.dispatch_batches, config.even_batches) == (
        False,
        None,
        True,
    )
    fields = DataLoaderConfiguration(True, True, False, True, 7, True, True)
    assert fields == DataLoaderConfiguration(
        split_batches=True,
        dispatch_batches=True,
        even_batches=False,
        use_seedable_sampler=True,
        data_seed=7,
        non_blocking=True,
        use_stateful_dataloader=True,
    )
    assert DataLoaderConfiguration(dispatch_batches=True).to_kwargs() == {"dispatch_batches": True}
    with pytest.raises(ConfigurationError, match=r"data_seed='7'") as error:
        DataLoaderConfiguration(data_seed="7")
    assert "HINT:" in str(error.value)
    with pytest.raises(AttributeError, match="custom_sampler"):
        DataLoaderConfiguration().custom_sampler = True


def _global_order(comm, loader, passes: int, split: bool) -> list[list[int]]:
    """The samples of each pass in the order one process would have seen them: the ranks'
    batches put back together, round after round (split_batches: their slices of each batch)."""
    mine = [[batch.tolist() for batch in loader] for _ in range(passes)]
    everyone = comm.allgather(mine)
    orders = []
    for p in range(passes):
        rounds = zip(*(rank[p] for rank in everyone))
        orders.append([v for parts in rounds for part in parts for v in part])
    return orders


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_generator_gives_the_order_of_the_plain_loader(comm, split, workers):
    """DataLoader(..., shuffle=True, generator=g): at any world size the prepared loader deals
    out the order the plain loader draws from g, epoch after epoch, including the draw torch
    takes from g for its worker seeds (it ignored g and drew from its own seed)."""
    n = comm.size
    length, batch = 12 * n, 3 * n if split else 3
    options = {"num_workers": workers, "multiprocessing_context": "fork" if workers else None}
    plain_loader = DataLoader(
        list(range(length)), batch_size=batch * (1 if split else n), shuffle=True,
        generator=torch.Generator().manual_seed(42), **options,
    )  # fmt: skip
    plain = [[v for b in plain_loader for v in b.tolist()] for _ in range(3)]
    torch.manual_seed(1234 + comm.rank)  # neither torch's RNG nor its seed may matter
    g = torch.Generator().manual_seed(7 + comm.rank)  # rank 0's generator is the one followed
    acc = accelerator(split_batches=split)
    loader = acc.prepare(
        DataLoader(list(range(length)), batch_size=batch, shuffle=True, generator=g, **options)
    )
    g.manual_seed(42)  # after prepare, as Accelerate's training_check does
    assert _global_order(comm, loader, 3, split) == plain
    loader.set_epoch(1)  # any epoch again, exactly
    assert _global_order(comm, loader, 1, split) == plain[1:2]


def test_a_generator_reseeded_between_passes_is_followed(comm):
    """The plain loader draws from its generator as it stands: reseeding it before each epoch
    repeats the order; the prepared loader does the same."""
    g = torch.Generator()
    acc = accelerator()
    data = list(range(8 * comm.size))
    loader = acc.prepare(DataLoader(data, batch_size=2, shuffle=True, generator=g))
    plain_g = torch.Generator()
    plain_loader = DataLoader(data, batch_size=2 * comm.size, shuffle=True, generator=plain_g)
    orders, expected = [], []
    for seed in (5, 5, 6):
        g.manual_seed(seed)
        plain_g.manual_seed(seed)
        orders += _global_order(comm, loader, 1, False)
        expected.append([v for b in plain_loader for v in b.tolist()])
    assert orders == expected
    assert orders[0] == orders[1] != orders[2]


def test_a_checkpoint_resumes_the_order_of_a_loader_generator(comm, mpi_tmp_path):
    """Saved in the middle of the third epoch of a loader shuffled by a generator of the user's,
    and resumed by the same script (its generator seeded as before): the rest of that epoch
    and the next are those of the uninterrupted run."""

    def prepared():
        acc = accelerator()
        g = torch.Generator().manual_seed(3)
        data = list(range(6 * comm.size))
        return acc, acc.prepare(DataLoader(data, batch_size=2, shuffle=True, generator=g))

    acc, loader = prepared()
    stream = []
    for epoch in range(4):
        for step, batch in enumerate(loader):
            stream.append(batch.tolist())
            if epoch == 2 and step == 1:
                acc.save_state(mpi_tmp_path / "ckpt")
    acc, loader = prepared()
    acc.load_state(mpi_tmp_path / "ckpt")
    resumed = [batch.tolist() for _ in range(2) for batch in loader]
    assert resumed == stream[len(stream) - len(resumed):]
    assert len(resumed) == 1 + 3  # the rest of epoch 2 (3 batches per epoch), and epoch 3


class Line(Dataset):
    """y = 2x + 3 plus noise, as dicts of 0-d tensors."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, generator=g)
        self.y = 2 * self.x + 3 + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))
        self.b = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, x):
        return self.a * x + self.b


def _shuffled(data, batch_size: int, g: torch.Generator, seedable: bool) -> DataLoader:
    if seedable:
        from mpaccel.data_loader import SeedableRandomSampler

        sampler = SeedableRandomSampler(data_source=data, generator=g, num_samples=len(data))
        return DataLoader(data, batch_size=batch_size, sampler=sampler)
    return DataLoader(data, batch_size=batch_size, shuffle=True, generator=g)


def _train(loader, model, step) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for batch in loader:
            opt.zero_grad()
            step(torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]))
            opt.step()


@pytest.mark.parametrize("seedable", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_training_on_shuffled_batches_gives_the_single_process_model(comm, split, seedable):
    """Accelerate's training_check: N ranks training on a shuffled loader (a generator of the
    user's, or a SeedableRandomSampler on it) end with the model of one process trained on the
    N-times larger batches of the same loader (parameters differed by 2e-3 to 7e-3)."""
    n, per_rank = comm.size, 8
    data = Line(per_rank * 4 * n)
    g = torch.Generator()
    torch.manual_seed(42)
    g.manual_seed(42)
    reference = Affine()
    _train(_shuffled(data, per_rank * n, g, seedable), reference, lambda loss: loss.backward())
    config = DataLoaderConfiguration(split_batches=split, use_seedable_sampler=seedable)
    acc = accelerator(dataloader_config=config)
    loader, model = acc.prepare(
        _shuffled(data, per_rank * n if split else per_rank, g, seedable), Affine()
    )
    torch.manual_seed(42)
    g.manual_seed(42)
    _train(loader, model, acc.backward)
    trained = acc.unwrap_model(model)
    torch.testing.assert_close(trained.a, reference.a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(trained.b, reference.b, atol=1e-6, rtol=1e-6)


def test_a_seedable_sampler_draws_from_its_seed_and_epoch(comm):
    """SeedableRandomSampler(generator=...) as Accelerate has it: its generator reseeded with
    initial seed + epoch at each pass, the epoch moving on after a pass that ran to its end."""
    from mpaccel.data_loader import SeedableRandomSampler

    g = torch.Generator()
    sampler = SeedableRandomSampler(data_source=range(10), generator=g, data_seed=5)
    assert sampler.initial_seed == 5 and sampler.generator is g
    first, second = list(sampler), list(sampler)
    assert first == torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    assert second == torch.randperm(10, generator=torch.Generator().manual_seed(6)).tolist()
    iterator = iter(sampler)
    next(iterator)
    del iterator  # left early: the same epoch again
    assert sampler.epoch == 2
    sampler.set_epoch(0)
    assert list(sampler) == first
    torch.manual_seed(11)
    assert SeedableRandomSampler(range(3)).initial_seed == 11  # torch.initial_seed()
    with_replacement = SeedableRandomSampler(range(4), True, 9, data_seed=1)
    assert len(list(with_replacement)) == 9


def test_use_seedable_sampler_draws_from_the_seed_not_the_generator(comm):
    """use_seedable_sampler=True: a loader's generator of its own no longer decides the order
    (its state is ignored); the order is data_seed + epoch, as in Accelerate."""
    n = comm.size
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=9)
    orders = []
    for seed in (1, 2):
        acc = accelerator(dataloader_config=config)
        g = torch.Generator().manual_seed(seed)
        data = list(range(8 * n))
        loader = acc.prepare(DataLoader(data, batch_size=2, shuffle=True, generator=g))
        orders.append(_global_order(comm, loader, 2, False))
    assert orders[0] == orders[1]
    expected = [torch.randperm(8 * n, generator=torch.Generator().manual_seed(9 + e)).tolist()
                for e in (0, 1)]
    assert orders[0] == expected
    from mpaccel.data_loader import SeedableRandomSampler

    assert isinstance(loader.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)


def test_prepare_data_loader_takes_accelerates_arguments(comm):
    """The module function, called as Accelerate's scripts call it: the process count and index
    default to the job's; sharded batches, gathered, are the loader's samples in order (also
    with split_batches), and shuffled ones each sample once."""
    from mpaccel.data_loader import prepare_data_loader
    from mpaccel.state import PartialState

    torch.manual_seed(100 + comm.rank)  # shuffles agree whatever each rank was seeded with
    state = PartialState()
    length = 16 * comm.size
    for split in (False, True):
        for shuffle in (False, True):
            plain = DataLoader(range(length), batch_size=4 * comm.size if split else 4,
                               shuffle=shuffle)
            loader = prepare_data_loader(plain, state.device, put_on_device=True,
                                         split_batches=split)
            got = [v for rank in comm.allgather([b.tolist() for b in loader])
                   for b in rank for v in b]
            if shuffle:
                assert sorted(got) == list(range(length))
            else:
                ordered = _global_order(comm, loader, 1, split)[0]
                assert ordered == list(range(length))
    positional = prepare_data_loader(DataLoader(range(8), batch_size=2), None, 2, 1)
    assert [b.tolist() for b in positional] == [[2, 3], [6, 7]]  # rank 1 of 2, as asked


def test_prepare_data_loader_keeps_a_custom_batch_sampler(comm):
    from mpaccel.data_loader import prepare_data_loader

    class Halves:
        batch_size = 4

        def __iter__(self):
            return iter([[0, 1, 2, 3], [4, 5, 6, 7]])

        def __len__(self):
            return 2

    custom = Halves()
    loader = prepare_data_loader(DataLoader(list(range(8)), batch_sampler=custom), data_seed=0)
    assert loader.batch_sampler.batch_sampler is custom
    assert loader.get_sampler() is None


def test_prepare_data_loader_puts_a_seedable_sampler_in_the_batch_sampler_shard(comm):
    from mpaccel.data_loader import SeedableRandomSampler, prepare_data_loader

    loader = prepare_data_loader(
        DataLoader(list(range(10)), batch_size=1, shuffle=True), use_seedable_sampler=True
    )
    assert isinstance(loader.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
    assert loader.get_sampler() is loader.batch_sampler.batch_sampler.sampler


def test_synchronize_rng_states_gives_every_rank_rank_0s_states(comm):
    from mpaccel.errors import CollectiveError
    from mpaccel.utils import synchronize_rng_state, synchronize_rng_states
    from mpaccel.utils.random import synchronize_rng_states as same

    assert same is synchronize_rng_states
    reset_state()
    torch.manual_seed(comm.rank)
    g = torch.Generator().manual_seed(10 + comm.rank)
    synchronize_rng_states(["torch", "generator"], generator=g)
    states = comm.allgather((torch.get_rng_state(), g.get_state()))
    assert all(torch.equal(s[0], states[0][0]) and torch.equal(s[1], states[0][1]) for s in states)
    assert torch.equal(g.get_state(), torch.Generator().manual_seed(10).get_state())
    synchronize_rng_state("torch")
    # A name that cannot be synchronised here: the same error on every rank, none left waiting.
    last = comm.size - 1
    with pytest.raises(CollectiveError) as error:
        synchronize_rng_states(["no_such_rng" if comm.rank == last else "torch"])
    assert error.value.failed_ranks == [last]
    assert "'no_such_rng'" in str(error.value) and "HINT:" in str(error.value)
    if not torch.cuda.is_available():
        with pytest.raises(CollectiveError, match="no cuda device"):
            synchronize_rng_states(["cuda"])


def test_rng_types_synchronise_torchs_generator_at_each_pass(comm):
    """Accelerator(rng_types=["torch"]): every pass starts from rank 0's torch RNG state."""
    acc = accelerator(rng_types=["torch"])
    loader = acc.prepare(DataLoader(list(range(4 * comm.size)), batch_size=2))
    torch.manual_seed(comm.rank)
    for _ in loader:
        drawn = torch.rand(1).item()
        break
    assert comm.allgather(drawn) == [drawn] * comm.size
    with pytest.raises(ConfigurationError, match="'xla'"):
        accelerator(rng_types=["xla"]).prepare(DataLoader(list(range(4)), batch_size=2))


@pytest.mark.parametrize("dispatch", [False, True])
@pytest.mark.parametrize("source", ["shuffled", "iterable"])
def test_the_prepared_loader_state_dict_resumes_mid_epoch(comm, source, dispatch):
    """state_dict() mid-epoch, load_state_dict() later: the next pass gives the rest of that
    epoch (Accelerate's test_stateful_dataloader, without torchdata). Its keys are the position
    a checkpoint records (what mpaccel.checkpoint collects of a per-rank Stateful)."""
    from mpaccel.checkpoint import TrainingState
    from mpaccel.checkpoint.training import collect

    def dataloader_position(loader):
        return collect(comm, TrainingState(per_rank={"dataloader_0": loader}))[1]["dataloader_0"]

    config = DataLoaderConfiguration(dispatch_batches=dispatch)
    acc = accelerator(dataloader_config=config)
    if source == "shuffled":
        original = DataLoader(list(range(32 * comm.size)), batch_size=4, shuffle=True)
    else:
        original = DataLoader(SizedStream(32 * comm.size), batch_size=4)
    loader = acc.prepare(original)
    rest = []
    for step, batch in enumerate(loader):
        if step == 2:
            saved = loader.state_dict()
            assert saved.items() >= dataloader_position(loader).items()
        if step > 2:
            rest.append(batch.tolist())
    assert loader.state_dict()["mid_epoch"] is False
    loader.load_state_dict(saved)
    assert [batch.tolist() for batch in loader] == rest


def _stateful(**config) -> Accelerator:
    return accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, **config))


def test_use_stateful_dataloader_without_torchdata_says_what_to_install(comm):
    import importlib.util

    if importlib.util.find_spec("torchdata") is not None:
        pytest.skip("torchdata is installed here")
    with pytest.raises(ConfigurationError, match="torchdata") as error:
        _stateful().prepare(DataLoader(list(range(4)), batch_size=2))
    assert "HINT: pip install 'torchdata>=0.8'" in str(error.value)


class Resumable(IterableDataset):
    """range(n) as a stream that can say where it is (torchdata's Stateful), counting reads."""

    def __init__(self, n: int) -> None:
        self.n, self.position, self.read = n, 0, 0

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            self.read += 1
            yield self.position - 1
        self.position = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


@pytest.mark.parametrize("dispatch", [False, True])
@pytest.mark.parametrize("source", ["shuffled", "iterable", "resumable"])
def test_a_stateful_dataloader_resumes_through_its_own_state(comm, source, dispatch):
    """use_stateful_dataloader=True (torchdata): the prepared loader is a StatefulDataLoader, its
    state_dict() carries that loader's own state, and load_state_dict() resumes through it; a
    dataset that keeps its own position (rank 0's, when dispatched) is not read again."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    if source == "resumable" and not dispatch:
        pytest.skip("every rank reads its stream through IterableDatasetShard, which re-reads")
    acc = _stateful(dispatch_batches=dispatch)
    length = 32 * comm.size
    if source == "shuffled":
        dataset = list(range(length))
        loader = acc.prepare(DataLoader(dataset, batch_size=4, shuffle=True))
    else:
        dataset = Resumable(length) if source == "resumable" else SizedStream(length)
        loader = acc.prepare(DataLoader(dataset, batch_size=4))
    assert isinstance(loader, stateful.StatefulDataLoader)
    rest = []
    for step, batch in enumerate(loader):
        if step == 2:
            saved = loader.state_dict()
        if step > 2:
            rest.append(batch.tolist())
    if comm.rank == 0 or not dispatch:
        assert saved["dataloader"] is not None
    if source == "resumable":
        dataset.read = 0
    loader.load_state_dict(saved)
    assert [batch.tolist() for batch in loader] == rest
    if source == "resumable" and comm.rank == 0:
        assert dataset.read == length - 3 * 4 * comm.size  # what follows the three batches


@pytest.mark.mpi(min_size=2)
def test_ranks_of_one_tensor_parallel_group_read_the_same_batches(comm):
    """prepare_data_loader(torch_device_mesh=...): the data-parallel world is the mesh's
    dp_replicate x dp_shard; the ranks of one tp group get the same batches (a real gloo mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mpaccel.data_loader import prepare_data_loader

    accelerator()
    n = comm.size
    mesh = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    plain = DataLoader(list(range(4 * n)), batch_size=2)
    loader = prepare_data_loader(plain, torch_device_mesh=mesh)
    everyone = comm.allgather([batch.tolist() for batch in loader])
    groups = [everyone[r : r + 2] for r in range(0, n, 2)]
    assert all(group[0] == group[1] for group in groups)
    assert sorted(v for group in groups for b in group[0] for v in b) == list(range(4 * n))


@pytest.mark.mpi(min_size=2)
def test_a_mesh_out_of_rank_order_places_each_rank_by_its_dp_coordinate(comm):
    """A mesh whose rows are not consecutive world ranks (laid out node by node under a
    round-robin launch): a rank reads the batches of its row (its 'dp' coordinate), not those
    of world rank // tp."""
    from torch.distributed.device_mesh import DeviceMesh

    from mpaccel.data_loader import prepare_data_loader

    accelerator()
    n = comm.size
    tp = 2 if n % 4 == 0 else 1
    order = [*range(1, n, 2), *range(0, n, 2)]  # 2: [1, 0]; 4: [1, 3, 0, 2]
    grid = torch.tensor(order, dtype=torch.int).reshape(n // tp, tp)
    mesh = DeviceMesh("cpu", grid, mesh_dim_names=("dp_shard", "tp"))
    row = next(i for i, ranks in enumerate(grid.tolist()) if comm.rank in ranks)
    loader = prepare_data_loader(DataLoader(list(range(4 * n)), batch_size=2),
                                 torch_device_mesh=mesh)
    first = next(iter(loader)).tolist()
    assert first == [2 * row, 2 * row + 1]  # batch `row` of the dp world's first round


def test_the_shard_classes_take_accelerates_arguments(comm):
    """BatchSamplerShard(batch_sampler, num_processes, process_index, split_batches,
    even_batches) and IterableDatasetShard(dataset, batch_size, drop_last, num_processes,
    process_index, split_batches), positionally as in Accelerate."""
    from mpaccel.data_loader import BatchSamplerShard, IterableDatasetShard

    shard = BatchSamplerShard(BatchSampler(range(10), 2, False), 2, 1, True, True)
    assert list(shard) == [[1], [3], [5], [7], [9]] and shard.total_length == 5
    stream = IterableDatasetShard(Stream(10), 2, False, 2, 1, False)
    assert list(stream) == [2, 3, 6, 7, 0, 1]
    dropped = IterableDatasetShard(Stream(10), 2, True, 2, 0, False)
    assert list(dropped) == [0, 1, 4, 5]
