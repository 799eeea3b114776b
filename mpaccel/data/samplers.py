"""Who takes which samples: the samplers that draw the same on every rank, and how each global
round of batches is dealt out to the ranks.

Batches, not samples, are dealt round-robin (split_batches=False: rank r takes batches r, r+N, ...;
split_batches=True: every batch is cut into N equal slices). With even_batches, the last round is
completed with samples from the start of the epoch so every rank takes the same number of
batches of the same size. A map-style dataset is dealt through its batch sampler
(ShardedBatchSampler); an iterable one through data/sharded.py's IterableDatasetShard, which deals
its stream the same way (both are Shares).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler

from ..errors import ConfigurationError


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


class SeedableRandomSampler(RandomSampler):
    """torch's RandomSampler (same arguments) whose draw is a function of the seed and the epoch:
    before each pass its `generator` (the one given, else its own) is seeded with
    `initial_seed + epoch`, and a pass that runs to its end moves on to the next epoch.
    `data_seed` (keyword) is the initial seed; None takes `torch.initial_seed()`."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = int(data_seed) if data_seed is not None else torch.initial_seed()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator(device=torch.get_default_device())
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from RandomSampler.__iter__(self)
        self.set_epoch(self.epoch + 1)  # not reached when the pass is left early


class GeneratorReplay:
    """Draws of a sampler that shuffles with a generator of the user's (`DataLoader(...,
    shuffle=True, generator=g)`): what a plain loader would draw, epoch after epoch, and any
    epoch again on demand.

    A plain loader draws each pass from the generator as it stands: `begin(epoch)` takes the
    generator as the first pass finds it for epoch 0, or, if the script changed it since the
    last pass (reseeded it), for the epoch about to start; any other epoch's starting state is
    that of the passes before it, drawn in full (each pass draws as a whole pass would, even
    when left early). So set_epoch(e), or a resume at epoch e, replays epoch e exactly.
    `base_draw`: the plain loader draws one integer from this generator before each pass
    (the generator was also the DataLoader's own, from which torch takes its worker seed);
    with persistent workers only before the first."""

    def __init__(self, sampler: Any, base_draw: bool, persistent: bool) -> None:
        self.sampler = sampler
        self.base_draw = base_draw
        self.persistent = persistent
        self.starts: dict[int, torch.Tensor] = {}  # the generator's state as each epoch starts
        self.left: torch.Tensor | None = None  # the state the last pass left it in

    @property
    def generator(self) -> torch.Generator:
        return self.sampler.generator

    def begin(self, epoch: int) -> None:
        """Before the pass of `epoch` draws: set the generator to that epoch's start."""
        now = self.generator.get_state()
        if self.left is None or not torch.equal(now, self.left):
            base = 0 if self.left is None else epoch
            self.starts = {e: s for e, s in self.starts.items() if e < base}
            self.starts[base] = now
        self.generator.set_state(self._start(epoch))
        self._draw_base(self.generator, epoch)

    def end(self, epoch: int) -> None:
        """After the pass of `epoch` (run to its end or left): the generator as a whole pass
        leaves it."""
        self.left = self._start(epoch + 1)
        self.generator.set_state(self.left)

    def _draw_base(self, generator: torch.Generator, epoch: int) -> None:
        if self.base_draw and (not self.persistent or epoch == 0):
            torch.empty((), dtype=torch.int64).random_(generator=generator)

    def _start(self, epoch: int) -> torch.Tensor:
        known = max((e for e in self.starts if e <= epoch), default=None)
        if known is None:  # before the first epoch drawn: nothing earlier to draw from
            known = min(self.starts)
            return self.starts[known]
        state = self.starts[known]
        for e in range(known, epoch):
            state = self._after(state, e)
            self.starts[e + 1] = state
        return state

    def _after(self, state: torch.Tensor, epoch: int) -> torch.Tensor:
        """The state a whole pass of `epoch` leaves, drawn on a scratch generator."""
        scratch = torch.Generator(device=self.generator.device)
        scratch.set_state(state)
        self._draw_base(scratch, epoch)
        own = self.sampler.generator
        self.sampler.generator = scratch
        try:
            for _ in self.sampler:
                pass
        finally:
            self.sampler.generator = own
        return scratch.get_state()


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


class Shares:
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
    def pads_last_round(self) -> bool:
        # One process has nothing to even out: its batches are the loader's own, unchanged (no
        # samples repeated at the end), as in a plain run and as in Accelerate. (A property:
        # join_uneven_inputs may change even_batches for a while.)
        return self.even_batches and self.num_processes > 1

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


class ShardedBatchSampler(Shares, Sampler[list[int]]):
    """This rank's batches of a global batch sampler (see the module docstring). A batch sampler
    without a `batch_size` attribute (variable-size batches) is dealt whole batches round-robin;
    even_batches then completes the last round with the epoch's first batches, as in Accelerate."""

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
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
        self.skip_next = 0  # batches a pass leaves out (set by the loader for one pass)

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        """The batches of the whole loader (Accelerate's name)."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

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
        """This rank's batches of one pass; the first `skip_next` of them are left out here, as
        index lists, so that a resumed pass loads none of their samples. (torch may ask for
        the iterator twice as a pass starts, with workers: the loader resets skip_next after.)"""
        skip = self.skip_next
        if self.batch_size is None:
            batches = self._whole_batches()
        else:
            batches = self._sized_batches(self.batch_size)
        return itertools.islice(batches, skip, None) if skip else batches

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


def synchronized(
    sampler: Any,
    seed: int,
    seedable: bool = False,
    loader_generator: Any = None,
    persistent: bool = False,
) -> tuple[Any, GeneratorReplay | None]:
    """`sampler`, made to draw the same on every rank, and the GeneratorReplay that follows
    its generator (None when it has none of the user's). A sampler of no randomness is
    returned as it is. `seedable`: a RandomSampler draws from seed + epoch even when it has a
    generator (use_seedable_sampler). `loader_generator`, `persistent`: the DataLoader's own
    generator, and whether it keeps its workers between passes."""
    if isinstance(sampler, SeedableRandomSampler):
        return sampler, None  # its draw is already a function of its seed and the epoch
    generator = getattr(sampler, "generator", None)
    if isinstance(sampler, RandomSampler) and (generator is None or seedable):
        # The same shuffled order on every rank, different each epoch; as many samples, with or
        # without replacement, as the user's sampler draws.
        replaced = SeedableRandomSampler(
            sampler.data_source,
            sampler.replacement,
            sampler._num_samples,
            generator=generator,
            data_seed=seed,
        )
        return replaced, None
    if isinstance(generator, torch.Generator):
        return sampler, GeneratorReplay(sampler, generator is loader_generator, persistent)
    if hasattr(sampler, "generator"):
        # Any other random sampler: drawing from each rank's own RNG, ranks would shard
        # different orders, seeing some samples twice and others never.
        return SynchronizedSampler(sampler, seed), None
    return sampler, None


def synchronized_batches(
    batch_sampler: Iterable[list[int]],
    seed: int,
    seedable: bool = False,
    loader_generator: Any = None,
    persistent: bool = False,
) -> tuple[Iterable[list[int]], GeneratorReplay | None]:
    """`batch_sampler`, its random sampler (if any) drawing the same on every rank (see
    synchronized)."""
    if not isinstance(batch_sampler, BatchSampler):
        return batch_sampler, None
    sampler, replay = synchronized(
        batch_sampler.sampler, seed, seedable, loader_generator, persistent
    )
    if sampler is batch_sampler.sampler:
        return batch_sampler, replay
    return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last), replay


class SingleItems:
    """A sampler's indices as batches of one, of no fixed size: ShardedBatchSampler deals them
    whole, as it deals variable-size batches. For a loader without batches (batch_size=None)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[Any]]:
        return ([index] for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class Unbatched(Sampler[Any]):
    """The indices of a ShardedBatchSampler dealing SingleItems, one by one again."""

    def __init__(self, batches: ShardedBatchSampler) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return (index for batch in self.batches for index in batch)

    def __len__(self) -> int:
        return len(self.batches)
