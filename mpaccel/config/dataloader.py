"""`DataLoaderConfiguration`: how prepared dataloaders deal out their batches
(Accelerator(dataloader_config=...))."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError
from .kwargs import KwargsHandler


@dataclass
class DataLoaderConfiguration(KwargsHandler):
    """How prepared dataloaders deal out their batches (see docs/training.md). Accelerate's
    fields, in Accelerate's order: `DataLoaderConfiguration(False, None, True)` is split_batches,
    dispatch_batches, even_batches.

    split_batches: cut each batch into one slice per process (else each takes whole batches).
    dispatch_batches: rank 0 reads the loader and sends every rank its part over MPI (None:
    for iterable datasets). even_batches: complete the last round with the epoch's first
    samples. use_seedable_sampler: shuffle with `SeedableRandomSampler` (order drawn from
    seed + epoch, even for a loader given a generator of its own). data_seed: the seed shuffles
    start from (None: rank 0's `torch.initial_seed()`). non_blocking: asynchronous copies to the
    device. use_stateful_dataloader: build the loaders on torchdata's StatefulDataLoader.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        seed = self.data_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigurationError(
                f"DataLoaderConfiguration(data_seed={seed!r}) must be an int or None",
                "pass an integer seed, e.g. data_seed=42, or None to follow torch.manual_seed.",
            )
