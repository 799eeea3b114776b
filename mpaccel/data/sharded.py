"""The prepared dataloader whose ranks each read their own batches (`DataLoaderShard`), dealt
out by data/samplers.py or, for an iterable dataset, by `IterableDatasetShard`. The other kind,
where rank 0 reads for everyone, is data/dispatch.py; what both share is data/loader.py."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from .loader import PreparedLoader
from .samplers import ShardedBatchSampler, Shares

__all__ = ["DataLoaderShard", "IterableDatasetShard"]


class IterableDatasetShard(Shares, IterableDataset):
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
