"""Dataloader sharding: each rank iterates over its share of every global batch.

Batches, not samples, are dealt round-robin (split_batches=False: rank r takes batches r, r+N, ...;
split_batches=True: every batch is cut into N equal slices). With even_batches, the last round is
completed with samples from the start of the epoch so every rank takes the same number of
batches of the same size; `remainder` says how many samples of that last round are real, which is
what gather_for_metrics uses to drop the duplicates. A map-style dataset is dealt through its
batch sampler (ShardedBatchSampler); an iterable one is read whole by every rank, which keeps its
slice of each global round (IterableDatasetShard).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

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
    """torch's RandomSampler (with its `replacement` and `num_samples`) drawing the same on every
    rank: seeded by (seed, epoch)."""

    def __init__(
        self,
        data_source: Sized,
        seed: int,
        replacement: bool = False,
        num_samples: int | None = None,
    ) -> None:
        super().__init__(seed)
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self) -> Iterator[int]:
        generator = self._next_generator()
        yield from RandomSampler(self.data_source, self.replacement, self._num_samples, generator)

    def __len__(self) -> int:
        return self.num_samples


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


class _Shares:
    """How a global round is dealt out; what both kinds of shard have in common. `batch_size` is
    the original loader's (None: unknown, as for a batch sampler of variable-size batches)."""

    def __init__(
        self,
        batch_size: int | None,
        num_processes: int,
        process_index: int,
        split_batches: bool,
        even_batches: bool,
        drop_last: bool,
    ) -> None:
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.drop_last = drop_last
        # One process has nothing to even out: its batches are the loader's own, unchanged (no
        # samples repeated at the end), as in a plain run and as in Accelerate.
        self.pads_last_round = even_batches and num_processes > 1
        if split_batches and batch_size is None:
            raise ConfigurationError(
                "split_batches=True needs the loader's batch size, and this loader has none "
                "(a batch sampler without a batch_size attribute, or batch_size=None)",
                "use split_batches=False (each process then takes whole batches), or give the "
                "batch sampler a batch_size attribute.",
            )
        if split_batches and batch_size is not None and batch_size % num_processes:
            raise ConfigurationError(
                f"split_batches=True needs a batch size divisible by the {num_processes} "
                f"processes, got batch_size={batch_size!r}",
                "use a multiple of the number of processes, or split_batches=False (each "
                "process then takes whole batches of that size).",
            )

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global round (None if the batch size is unknown)."""
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    @property
    def process_batch_size(self) -> int | None:
        """Samples in one batch of this process (None if the batch size is unknown)."""
        if self.batch_size is None or not self.split_batches:
            return self.batch_size
        return self.batch_size // self.num_processes

    @property
    def sampler(self) -> Any:
        """The sampler whose epoch a checkpoint records (None: nothing to record)."""
        return None


class ShardedBatchSampler(_Shares, Sampler[list[int]]):
    """This rank's batches of a global batch sampler (see the module docstring). A batch sampler
    without a `batch_size` attribute (variable-size batches) is dealt whole batches round-robin;
    even_batches then completes the last round with the epoch's first batches, as in Accelerate."""

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int,
        process_index: int,
        split_batches: bool,
        even_batches: bool,
    ) -> None:
        size = getattr(batch_sampler, "batch_size", None)
        super().__init__(
            int(size) if size else None,
            num_processes,
            process_index,
            split_batches,
            even_batches,
            bool(getattr(batch_sampler, "drop_last", False)),
        )
        self.batch_sampler = batch_sampler

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def _rounds(self) -> Iterator[list[list[int]]]:
        """Global rounds: lists of N per-rank batches (the last one possibly short)."""
        n = self.num_processes
        part = self.process_batch_size
        if self.split_batches and part is not None:
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
        if self.batch_size is None:
            return self._whole_batches()
        return self._sized_batches(self.batch_size)

    def _whole_batches(self) -> Iterator[list[int]]:
        n, r = self.num_processes, self.process_index
        first: list[list[int]] = []  # the epoch's first batches, to complete the last round
        for shares in self._rounds():
            first.extend(shares[: n - len(first)])
            if r < len(shares) and (len(shares) == n or not self.drop_last):
                yield shares[r]
            elif self.pads_last_round and not self.drop_last:
                yield first[(r - len(shares)) % len(first)]

    def _sized_batches(self, size: int) -> Iterator[list[int]]:
        n, r = self.num_processes, self.process_index
        total = size if self.split_batches else size * n
        first: list[int] = []  # samples of the epoch's start, to complete the last round
        for shares in self._rounds():
            if len(first) < total:
                first.extend(i for share in shares for i in share)
            complete = len(shares) == n and all(len(s) == len(shares[0]) for s in shares)
            full = (self.split_batches and len(shares[0]) * n == size) or (
                not self.split_batches and all(len(s) == size for s in shares)
            )
            if complete and (full or not self.pads_last_round):
                yield shares[r]
            elif self.drop_last and not self.split_batches:
                return  # an incomplete last round is dropped, like the incomplete last batch
            elif self.pads_last_round:
                yield self._completed(shares, first, size)[r]
            elif r < len(shares) and shares[r]:
                yield shares[r]

    def _completed(self, shares: list[list[int]], first: list[int], size: int) -> list[list[int]]:
        """The last round with every share filled up to its full size from the epoch's start."""
        n = self.num_processes
        per_rank = size // n if self.split_batches else size
        flat = [i for share in shares for i in share]
        need = per_rank * n - len(flat)
        filler = (first * (need // max(len(first), 1) + 1))[:need] if first else []
        flat += filler
        return [flat[i * per_rank : (i + 1) * per_rank] for i in range(n)]

    def __len__(self) -> int:
        batches = len(self.batch_sampler)  # type: ignore[arg-type]
        if self.split_batches:
            return batches
        if self.drop_last:
            return batches // self.num_processes
        if self.pads_last_round:
            return -(-batches // self.num_processes)
        return batches // self.num_processes + int(
            self.process_index < batches % self.num_processes
        )


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
        self.iteration = 0
        self._skip = 0
        self.batches_yielded = 0
        length = self.total_dataset_length
        total = self.total_batch_size
        self.remainder = -1
        if length is not None and total is not None and not sharding.drop_last:
            self.remainder = length % total

    def __len__(self) -> int:
        return len(self.base_dataloader) - self._skip

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
        """Reshuffle for `epoch` (same order on every rank); a dataset with `set_epoch` (an
        iterable one, typically) is told the epoch too."""
        self.iteration = epoch
        sampler = self._sampler()
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        self._announce_epoch()

    def _announce_epoch(self) -> None:
        # The loader's dataset: the user's map-style one, or the IterableDatasetShard (which
        # passes the epoch on to the user's iterable dataset).
        dataset = self.base_dataloader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.iteration)

    def _sampler(self) -> Any:
        return self.sharding.sampler

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next iteration start after its first `num_batches` batches (resuming)."""
        self._skip = int(num_batches)

    def __iter__(self) -> Iterator[Any]:
        self.gradient_state._add_dataloader(self)
        self.end_of_dataloader = False
        skip, self._skip = self._skip, 0
        self.batches_yielded = skip
        try:
            self._announce_epoch()
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


def _synchronized(batch_sampler: Iterable[list[int]], seed: int) -> Iterable[list[int]]:
    """`batch_sampler`, its random sampler (if any) drawing the same on every rank."""
    if not isinstance(batch_sampler, BatchSampler):
        return batch_sampler
    sampler: Any = batch_sampler.sampler
    if isinstance(sampler, RandomSampler):
        # The same shuffled order on every rank, different each epoch; as many samples, with or
        # without replacement, as the user's sampler draws.
        sampler = SeedableRandomSampler(
            sampler.data_source, seed, sampler.replacement, sampler._num_samples
        )
    elif hasattr(sampler, "generator"):
        # Any other random sampler: drawing from each rank's own RNG, ranks would shard
        # different orders, seeing some samples twice and others never.
        sampler = SynchronizedSampler(sampler, seed)
    else:
        return batch_sampler
    return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)


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
    kwargs = {name: getattr(dataloader, name) for name in _COPIED if hasattr(dataloader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
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
        if dataloader.batch_sampler is None:
            raise ConfigurationError(
                "cannot shard a DataLoader built with batch_size=None",
                "give the DataLoader a batch_size (or a batch_sampler).",
            )
        sharding = ShardedBatchSampler(
            _synchronized(dataloader.batch_sampler, seed),
            num_processes,
            process_index,
            split_batches,
            even_batches,
        )
        rebuilt = DataLoader(dataset, batch_sampler=sharding, generator=generator, **kwargs)
    return DataLoaderShard(rebuilt, sharding, dataset, device, gradient_state, non_blocking)
