"""Dataloader sharding: each rank iterates over its share of every global batch.

Batches, not samples, are dealt round-robin (split_batches=False: rank r takes batches r, r+N, ...;
split_batches=True: every batch is cut into N equal slices). With even_batches, the last round is
completed with samples from the start of the epoch so every rank takes the same number of
batches of the same size; `remainder` says how many samples of that last round are real, which is
what gather_for_metrics uses to drop the duplicates.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from .errors import ConfigurationError


class _EpochSeeded:
    """Seeding by (seed, epoch), the same on every rank. The epoch advances by itself at every
    new pass, or is set with `set_epoch` (a pass after set_epoch uses that epoch)."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.epoch = 0
        self._started = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self._started = False

    def _next_generator(self) -> torch.Generator:
        if self._started:  # a new pass without set_epoch(): move on to a new order
            self.epoch += 1
        self._started = True
        return torch.Generator().manual_seed(self.seed + self.epoch)


class SeedableRandomSampler(_EpochSeeded, Sampler[int]):
    """A random permutation that is the same on every rank: seeded by (seed, epoch)."""

    def __init__(self, data_source: Sequence[Any], seed: int) -> None:
        super().__init__(seed)
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        generator = self._next_generator()
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.data_source)


class SynchronizedSampler(_EpochSeeded, Sampler[Any]):
    """Another random sampler (SubsetRandomSampler, WeightedRandomSampler, or any that draws
    from its `generator` attribute, as torch's do) made to draw the same on every rank: before
    each pass it gets a generator seeded by (seed, epoch)."""

    def __init__(self, sampler: Sampler[Any], seed: int) -> None:
        super().__init__(seed)
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        self.sampler.generator = self._next_generator()  # type: ignore[attr-defined]
        yield from self.sampler

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's batches of a global batch sampler (see the module docstring)."""

    def __init__(
        self,
        batch_sampler: BatchSampler,
        num_processes: int,
        process_index: int,
        split_batches: bool,
        even_batches: bool,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        # One process has nothing to even out: its batches are the loader's own, unchanged (no
        # samples repeated at the end), as in a plain run and as in Accelerate.
        self.pads_last_round = even_batches and num_processes > 1
        self.batch_size = int(getattr(batch_sampler, "batch_size", 0) or 0)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches and self.batch_size % num_processes:
            raise ConfigurationError(
                f"split_batches=True needs a batch size divisible by the {num_processes} "
                f"processes, got batch_size={self.batch_size}",
                "use a multiple of the number of processes, or split_batches=False (each "
                "process then takes whole batches of that size).",
            )

    @property
    def total_batch_size(self) -> int:
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    def _rounds(self) -> Iterator[list[list[int]]]:
        """Global rounds: lists of N per-rank batches (the last one possibly short)."""
        n, size = self.num_processes, self.batch_size
        if self.split_batches:
            part = size // n
            for batch in self.batch_sampler:
                yield [batch[i * part : (i + 1) * part] for i in range(n)]
            return
        current: list[list[int]] = []
        for batch in self.batch_sampler:
            current.append(list(batch))
            if len(current) == n:
                yield current
                current = []
        if current:
            yield current

    def __iter__(self) -> Iterator[list[int]]:
        n, r = self.num_processes, self.process_index
        first: list[int] = []  # samples of the epoch's start, to complete the last round
        for shares in self._rounds():
            if len(first) < self.total_batch_size:
                first.extend(i for share in shares for i in share)
            complete = len(shares) == n and all(len(s) == len(shares[0]) for s in shares)
            full = (self.split_batches and len(shares[0]) * n == self.batch_size) or (
                not self.split_batches and all(len(s) == self.batch_size for s in shares)
            )
            if complete and (full or not self.pads_last_round):
                yield shares[r]
            elif self.drop_last and not self.split_batches:
                return  # an incomplete last round is dropped, like the incomplete last batch
            elif self.pads_last_round:
                yield self._completed(shares, first)[r]
            elif r < len(shares) and shares[r]:
                yield shares[r]

    def _completed(self, shares: list[list[int]], first: list[int]) -> list[list[int]]:
        """The last round with every share filled up to its full size from the epoch's start."""
        n = self.num_processes
        per_rank = self.batch_size // n if self.split_batches else self.batch_size
        flat = [i for share in shares for i in share]
        need = per_rank * n - len(flat)
        filler = (first * (need // max(len(first), 1) + 1))[:need] if first else []
        flat += filler
        return [flat[i * per_rank : (i + 1) * per_rank] for i in range(n)]

    def __len__(self) -> int:
        batches = len(self.batch_sampler)
        if self.split_batches:
            return batches
        if self.drop_last:
            return batches // self.num_processes
        if self.pads_last_round:
            return -(-batches // self.num_processes)
        return batches // self.num_processes + int(
            self.process_index < batches % self.num_processes
        )


def _move(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)({k: _move(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_move(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(v, device, non_blocking) for v in batch)
    return batch


class DataLoaderShard:
    """A prepared dataloader: this rank's batches, on its device, with end-of-epoch tracking.

    Iterating is local (no collective). `end_of_dataloader` is True while the last batch is out;
    `remainder` is the number of real samples in the last global round: the dataset's length
    modulo the total batch size (0: the last round is full; -1: no length, or drop_last).
    """

    def __init__(
        self,
        dataloader: DataLoader,
        sharded: ShardedBatchSampler | None,
        device: torch.device | None,
        gradient_state: Any,
        non_blocking: bool = False,
    ) -> None:
        self.base_dataloader = dataloader
        self.batch_sampler = sharded
        self.device = device
        self.gradient_state = gradient_state
        self.non_blocking = non_blocking
        self.end_of_dataloader = False
        self.iteration = 0
        self._skip = 0
        self.batches_yielded = 0
        length = _dataset_length(dataloader)
        total = self.total_batch_size
        drop_last = sharded.drop_last if sharded is not None else dataloader.drop_last
        self.remainder = -1 if length is None or drop_last else length % total
        self.dataset = dataloader.dataset

    def __len__(self) -> int:
        return len(self.base_dataloader) - self._skip

    @property
    def total_batch_size(self) -> int:
        if self.batch_sampler is None:
            return self.base_dataloader.batch_size or 1
        return self.batch_sampler.total_batch_size

    @property
    def batch_size(self) -> int:
        """Samples per batch on this process."""
        sharded = self.batch_sampler
        if sharded is None:
            return self.base_dataloader.batch_size or 1
        return (
            sharded.batch_size // sharded.num_processes
            if sharded.split_batches
            else (sharded.batch_size)
        )

    @property
    def total_dataset_length(self) -> int | None:
        return _dataset_length(self.base_dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch` (same order on every rank)."""
        self.iteration = epoch
        sampler = self._sampler()
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def _sampler(self) -> Any:
        inner = self.batch_sampler.batch_sampler if self.batch_sampler else None
        return getattr(inner, "sampler", None)

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next iteration start after its first `num_batches` batches (resuming)."""
        self._skip = int(num_batches)

    def __iter__(self) -> Iterator[Any]:
        self.gradient_state._add_dataloader(self)
        self.end_of_dataloader = False
        skip, self._skip = self._skip, 0
        self.batches_yielded = skip
        try:
            iterator = iter(self.base_dataloader)
            for _ in range(skip):
                next(iterator, None)
            try:
                upcoming = next(iterator)
            except StopIteration:
                self.end_of_dataloader = True
                return
            while True:
                current = upcoming
                try:
                    upcoming = next(iterator)
                except StopIteration:
                    self.end_of_dataloader = True
                self.batches_yielded += 1
                if self.device is not None:
                    current = _move(current, self.device, self.non_blocking)
                yield current
                if self.end_of_dataloader:
                    break
        finally:
            self.iteration += 1
            self.gradient_state._remove_dataloader(self)


def _dataset_length(dataloader: DataLoader) -> int | None:
    try:
        return len(dataloader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


_COPIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
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
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        raise ConfigurationError(
            "cannot shard a DataLoader built with batch_size=None",
            "give the DataLoader a batch_size (or a batch_sampler).",
        )
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(batch_sampler, BatchSampler) and isinstance(sampler, RandomSampler):
        # The same shuffled order on every rank, different each epoch.
        batch_sampler = BatchSampler(
            SeedableRandomSampler(dataloader.dataset, seed),  # type: ignore[arg-type]
            batch_sampler.batch_size,
            batch_sampler.drop_last,
        )
    elif isinstance(batch_sampler, BatchSampler) and hasattr(sampler, "generator"):
        # Any other random sampler: drawing from each rank's own RNG, ranks would shard
        # different orders, seeing some samples twice and others never.
        batch_sampler = BatchSampler(
            SynchronizedSampler(sampler, seed),  # type: ignore[arg-type]
            batch_sampler.batch_size,
            batch_sampler.drop_last,
        )
    sharded = ShardedBatchSampler(
        batch_sampler,  # type: ignore[arg-type]
        num_processes,
        process_index,
        split_batches,
        even_batches,
    )
    kwargs = {name: getattr(dataloader, name) for name in _COPIED if hasattr(dataloader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    # A private generator: starting an iteration then draws its worker seed from here, not from
    # the global torch RNG, so iterating does not shift the RNG a resumed run must reproduce.
    generator = torch.Generator().manual_seed(seed + process_index)
    rebuilt = DataLoader(dataloader.dataset, batch_sampler=sharded, generator=generator, **kwargs)
    return DataLoaderShard(rebuilt, sharded, device, gradient_state, non_blocking)
