"""Accelerate's `skip_first_batches` and the loaders it builds (`SkipBatchSampler`,
`SkipDataLoader`): a pass that leaves out its first batches, for a prepared loader (either
kind) or a plain DataLoader."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler

from .loader import PreparedLoader, loader_options

__all__ = ["SkipBatchSampler", "SkipDataLoader", "skip_first_batches"]


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
