"""The prepared dataloaders. `DataLoaderShard`: this rank reads its own batches, dealt out by
mpaccel.samplers (or, for an iterable dataset, by IterableDatasetShard). `DataLoaderDispatcher`
(mpaccel.dispatch): rank 0 reads and sends each rank its part. What both share (device
placement, the end-of-epoch tracking gather_for_metrics relies on, their position for resuming)
is mpaccel.prepared_loader.PreparedLoader. Also Accelerate's helpers for plain DataLoaders:
skip_first_batches, get_sampler, SkipBatchSampler, SkipDataLoader."""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .prepared_loader import PreparedLoader
from .samplers import ShardedBatchSampler, _Shares

__all__ = [
    "DataLoaderShard",
    "IterableDatasetShard",
    "SkipBatchSampler",
    "SkipDataLoader",
    "get_sampler",
    "skip_first_batches",
]


class IterableDatasetShard(_Shares, IterableDataset):
    """This rank's samples of an iterable dataset (Accelerate's arguments, in its order). Every
    rank reads the whole stream, cuts it into global rounds of `total_batch_size` samples and
    keeps its slice of each (rank r: samples [r*b, (r+1)*b) of the round, b = this process's
    batch size), so the loader built on it deals batches as ShardedBatchSampler does. The last,
    short round is completed with the stream's first samples (even_batches), left short
    (even_batches=False), or dropped (drop_last). With batch_size=None (the dataset yields whole
    batches) b is one element.

    The stream must be the same on every rank: a dataset with `set_epoch` gets the epoch; one
    without it, but with a torch.Generator `generator` attribute, has it seeded by (seed, epoch)
    before each pass, as SynchronizedSampler does."""

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int | None = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        *,
        even_batches: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size, num_processes, process_index, split_batches, even_batches, drop_last
        )
        self.dataset = dataset
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.seed + self.epoch)
        per = self.process_batch_size or 1
        total = per * self.num_processes
        mine = slice(self.process_index * per, (self.process_index + 1) * per)
        first: list[Any] = []
        current: list[Any] = []
        for sample in self.dataset:
            current.append(sample)
            if len(current) == total:
                yield from current[mine]
                first = first or current
                current = []
        if not current or self.drop_last:
            return
        if self.pads_last_round:
            filler = first or list(current)
            while len(current) < total:
                current += filler
        yield from current[mine]

    def __len__(self) -> int:
        """Samples this rank yields (TypeError if the dataset has no length, as in torch)."""
        length = len(self.dataset)  # type: ignore[arg-type]
        per = self.process_batch_size or 1
        rounds, rest = divmod(length, per * self.num_processes)
        if not rest or self.drop_last:
            return rounds * per
        if self.pads_last_round:
            return (rounds + 1) * per
        return rounds * per + min(max(rest - self.process_index * per, 0), per)


_END = object()  # the end of an iterator, for next(iterator, _END)


class DataLoaderShard(PreparedLoader):
    """A prepared dataloader whose ranks each read their own batches: a map-style dataset's
    batches dealt out by a ShardedBatchSampler, an iterable one's by an IterableDatasetShard.
    Iterating is local, except that a loader shuffled with a generator of the user's has
    rank 0's generator state sent to every rank as each pass starts (rng_types, as in
    Accelerate)."""

    def _pass(self, skip: int) -> Generator[tuple[Any, bool], None, None]:
        self._synchronize()
        if self.replay is not None:
            self.replay.begin(self.iteration)
        try:
            if isinstance(self.sharding, ShardedBatchSampler):
                # Left out as index lists by the sampler: no sample of theirs is loaded.
                self.sharding.skip_next = skip
                try:
                    iterator = iter(self.base_dataloader)
                finally:
                    self.sharding.skip_next = 0
            else:
                # A stream: its samples are read to get past them, and dropped.
                iterator = iter(self.base_dataloader)
                for _ in range(skip):
                    next(iterator, None)
            upcoming = next(iterator, _END)
            while upcoming is not _END:
                current = upcoming
                self._snapshot()
                upcoming = next(iterator, _END)
                yield current, upcoming is _END
        finally:
            if self.replay is not None:
                self.replay.end(self.iteration)


class SkipBatchSampler(Sampler[list[Any]]):
    """The batches of `batch_sampler` after its first `skip_batches`, on every pass (or the
    items of a sampler, for a loader with batch_size=None)."""

    def __init__(self, batch_sampler: Iterable[list[Any]], skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = int(skip_batches)

    def __iter__(self) -> Iterator[list[Any]]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)  # type: ignore[arg-type]

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


class SkipDataLoader(DataLoader):
    """A DataLoader that leaves out its first `skip_batches` batches on every pass (they are
    loaded, then dropped: for loaders whose batches have no batch sampler to skip in)."""

    def __init__(self, dataset: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.skip_batches = int(skip_batches)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return itertools.islice(super().__iter__(), self.skip_batches, None)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A prepared loader (either kind): the same one, whose next pass starts after
    `num_batches` batches (PreparedLoader.skip_first_batches). Any other: a new loader that
    leaves them out on every pass, as Accelerate's does. A map-style dataset's skipped batches
    are not loaded."""
    if issubclass(type(dataloader), PreparedLoader):  # isinstance would say DataLoader too
        dataloader.skip_first_batches(num_batches)  # type: ignore[attr-defined]
        return dataloader
    kwargs = loader_options(dataloader)
    kwargs["generator"] = dataloader.generator
    dataset = dataloader.dataset
    if not isinstance(dataset, IterableDataset) and dataloader.batch_sampler is not None:
        batches = SkipBatchSampler(dataloader.batch_sampler, num_batches)
        return DataLoader(dataset, batch_sampler=batches, **kwargs)
    if not isinstance(dataset, IterableDataset):  # batch_size=None: one item per batch
        items = SkipBatchSampler(dataloader.sampler, num_batches)
        return DataLoader(dataset, batch_size=None, sampler=items, **kwargs)
    return SkipDataLoader(
        dataset,
        skip_batches=num_batches,
        batch_size=dataloader.batch_size,
        drop_last=dataloader.drop_last,
        **kwargs,
    )


def get_sampler(dataloader: DataLoader) -> Any:
    """The sampler that draws `dataloader`'s order: of its batch sampler, or of the batch
    sampler given as `sampler` (a prepared loader's own answer for a prepared one)."""
    if issubclass(type(dataloader), PreparedLoader):
        return dataloader.get_sampler()  # type: ignore[attr-defined]
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def loader_options(dataloader: DataLoader) -> dict[str, Any]:
    """The options of `dataloader` a rebuilt one keeps (workers, collate_fn, pin_memory...)."""
    kwargs = {name: getattr(dataloader, name) for name in _COPIED if hasattr(dataloader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


_COPIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
