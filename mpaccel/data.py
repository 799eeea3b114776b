"""The prepared dataloader: this rank's batches, dealt out by mpaccel.samplers (or, for an
iterable dataset, by IterableDatasetShard), on its device, with the end-of-epoch tracking
gather_for_metrics relies on (`remainder`: how many samples of the last round are real).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .samplers import (
    SeedableRandomSampler,
    ShardedBatchSampler,
    SingleItems,
    SynchronizedSampler,
    Unbatched,
    _Shares,
    synchronized,
    synchronized_batches,
)
from .utils.operations import send_to_device

__all__ = [
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "ShardedBatchSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "SynchronizedSampler",
    "prepare_data_loader",
    "skip_first_batches",
]


class IterableDatasetShard(_Shares, IterableDataset):
    """This rank's samples of an iterable dataset. Every rank reads the whole stream, cuts it into
    global rounds of `total_batch_size` samples and keeps its slice of each (rank r: samples
    [r*b, (r+1)*b) of the round, b = this process's batch size), so the loader built on it
    deals batches as ShardedBatchSampler does. The last, short round is completed with the
    stream's first samples (even_batches), left short (even_batches=False), or dropped
    (drop_last). With batch_size=None (the dataset yields whole batches) b is one element.

    The stream must be the same on every rank: a dataset with `set_epoch` gets the epoch; one
    without it, but with a torch.Generator `generator` attribute, has it seeded by (seed, epoch)
    before each pass, as SynchronizedSampler does."""

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int | None,
        num_processes: int,
        process_index: int,
        split_batches: bool,
        even_batches: bool,
        drop_last: bool,
        seed: int,
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


class DataLoaderShard:
    """A prepared dataloader: this rank's batches, on its device, with end-of-epoch tracking.

    Iterating is local (no collective). `end_of_dataloader` is True while the last batch is out;
    `remainder` is the number of real samples in the last global round: the dataset's length
    modulo the total batch size (0: the last round is full; -1: no length, drop_last, or a batch
    size that is not known). A dataset with `set_epoch` is told the epoch before every pass.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        sharding: _Shares,
        dataset: Any,
        device: torch.device | None,
        gradient_state: Any,
        non_blocking: bool = False,
    ) -> None:
        self.base_dataloader = dataloader
        self.sharding = sharding
        self.batch_sampler = dataloader.batch_sampler
        self.dataset = dataset
        self.device = device
        self.gradient_state = gradient_state
        self.non_blocking = non_blocking
        self.end_of_dataloader = False
        self.iteration = 0  # the epoch of the pass under way, or of the next one
        self._started = False  # a pass of `iteration` has begun: the next pass moves on
        self._skip = 0  # batches the next pass skips (skip_first_batches, or load_state)
        self._skip_counted = False  # ... and len() counts them (skip_first_batches only)
        self._skipped = 0  # batches the pass under way skipped, as len() counts them
        self._epoch_seen: int | None = None  # load_state: every batch of this epoch was seen
        self.batches_yielded = 0
        length = self.total_dataset_length
        total = self.total_batch_size
        self.remainder = -1
        if length is not None and total is not None and not sharding.drop_last:
            self.remainder = length % total

    def __len__(self) -> int:
        pending = self._skip if self._skip_counted else 0
        return len(self.base_dataloader) - (pending or self._skipped)

    def __getattr__(self, name: str) -> Any:
        # Anything else a script reads from its loader (num_workers, collate_fn, pin_memory...)
        # is the DataLoader's inside, as in Accelerate.
        if name == "base_dataloader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        # isinstance(loader, torch.utils.data.DataLoader) holds, as for Accelerate's prepared
        # loaders: code that checks it (a trainer choosing its path) takes this for a DataLoader.
        # type(loader) is still DataLoaderShard, and so is isinstance(loader, DataLoaderShard).
        base = self.__dict__.get("base_dataloader")
        return DataLoaderShard if base is None else type(base)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # pickle's own way would check __class__ against the real class, and refuse.
        return (_new_shard, (), self.__dict__)

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global round (None when the batch size is not known)."""
        return self.sharding.total_batch_size

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this process (None when not known)."""
        return self.sharding.process_batch_size

    @property
    def total_dataset_length(self) -> int | None:
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use `epoch`'s order (the same on every rank); a dataset with
        `set_epoch` (an iterable one, typically) is told the epoch too."""
        self.iteration = int(epoch)
        self._started = False
        self._tell_epoch()

    def _tell_epoch(self) -> None:
        sampler = self._sampler()
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.iteration)
        # The loader's dataset: the user's map-style one, or the IterableDatasetShard (which
        # passes the epoch on to the user's iterable dataset).
        dataset = self.base_dataloader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.iteration)

    def _sampler(self) -> Any:
        return self.sharding.sampler

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next pass start after its first `num_batches` batches (resuming); len()
        counts the batches that pass gives until it has run to its end."""
        self._skip, self._skip_counted = int(num_batches), True

    def _resume_at(self, num_batches: int) -> None:
        """load_state: the next pass starts after `num_batches` batches, as with
        skip_first_batches, but len() stays the whole epoch's: Accelerate's load_state leaves
        loaders alone, and scripts written for it work out where to resume from len(loader)."""
        self._skip, self._skip_counted = int(num_batches), False

    def __iter__(self) -> Iterator[Any]:
        # Every pass is a new epoch, whether the last one ran to its end or was left early (a
        # break after K steps, a peek): otherwise a loop that stops each epoch early would see
        # the same batches every epoch. set_epoch() and load_state() say which epoch comes next.
        if self._started:
            self.iteration += 1
        self._started = True
        # Saved while this epoch's last batch was out, and resumed into the same epoch (a loop
        # that calls set_epoch(epoch) with its own, checkpointed, epoch counter): nothing is left.
        seen, self._epoch_seen = self._epoch_seen == self.iteration, None
        self._tell_epoch()
        skip, counted = self._skip, self._skip_counted
        self._skip, self._skip_counted = 0, False
        self._skipped = skip if counted else 0
        self.gradient_state._add_dataloader(self)
        self.end_of_dataloader = False
        self.batches_yielded = skip
        try:
            if seen:
                self.end_of_dataloader = True
                return
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
                current, upcoming = upcoming, next(iterator, _END)
                self.end_of_dataloader = upcoming is _END
                self.batches_yielded += 1
                if self.device is not None:
                    current = send_to_device(current, self.device, self.non_blocking)
                yield current
            self.end_of_dataloader = True
            self._skipped = 0  # the resumed pass is over: len() counts whole passes again
        finally:
            self.gradient_state._remove_dataloader(self)


def _new_shard() -> DataLoaderShard:
    """An empty DataLoaderShard, for unpickling (its __dict__ comes after)."""
    return DataLoaderShard.__new__(DataLoaderShard)


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
    """A prepared loader: the same one, whose next pass starts after `num_batches` batches
    (DataLoaderShard.skip_first_batches). Any other: a new loader that leaves them out on every
    pass, as Accelerate's does. A map-style dataset's skipped batches are not loaded."""
    if type(dataloader) is DataLoaderShard:  # isinstance would say DataLoader too
        dataloader.skip_first_batches(num_batches)
        return dataloader
    kwargs = _loader_options(dataloader)
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


def _loader_options(dataloader: DataLoader) -> dict[str, Any]:
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


def prepare_data_loader(
    dataloader: DataLoader,
    num_processes: int,
    process_index: int,
    device: torch.device | None,
    gradient_state: Any,
    seed: int,
    split_batches: bool = False,
    even_batches: bool = True,
    non_blocking: bool = False,
) -> DataLoaderShard:
    """Wrap `dataloader` so this rank sees its share. Not collective (the seed must already be
    agreed on: the Accelerator broadcasts it over MPI)."""
    kwargs = _loader_options(dataloader)
    # A private generator: starting an iteration then draws its worker seed from here, not from
    # the global torch RNG, so iterating does not shift the RNG a resumed run must reproduce.
    generator = torch.Generator().manual_seed(seed + process_index)
    dataset = dataloader.dataset
    sharding: _Shares
    if isinstance(dataset, IterableDataset):
        # No sampler to shard (torch refuses one with an iterable dataset): shard the stream.
        sharding = IterableDatasetShard(
            dataset,
            dataloader.batch_size,
            num_processes,
            process_index,
            split_batches,
            even_batches,
            dataloader.drop_last,
            seed,
        )
        rebuilt = DataLoader(
            sharding,
            batch_size=sharding.process_batch_size,
            drop_last=dataloader.drop_last,
            generator=generator,
            **kwargs,
        )
    else:
        # Without batch_size (None) the loader reads its sampler's items one by one: a batch
        # sampler given as `sampler` (the dataset reads a list of indices at once) is dealt as
        # if given as `batch_sampler`; the items of any other are dealt out as batches of no
        # fixed size would be (at size 1: the loader's own items).
        unbatched = dataloader.batch_sampler is None
        batches: Any = dataloader.sampler if unbatched else dataloader.batch_sampler
        if unbatched and not isinstance(batches, BatchSampler):
            batches = SingleItems(synchronized(batches, seed))
        sharding = ShardedBatchSampler(
            synchronized_batches(batches, seed),
            num_processes,
            process_index,
            split_batches,
            even_batches,
        )
        if not unbatched:
            kwargs["batch_sampler"] = sharding
        else:
            single = isinstance(batches, SingleItems)
            kwargs.update(batch_size=None, sampler=Unbatched(sharding) if single else sharding)
        rebuilt = DataLoader(dataset, generator=generator, **kwargs)
    return DataLoaderShard(rebuilt, sharding, dataset, device, gradient_state, non_blocking)
