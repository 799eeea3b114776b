"""Accelerate's module path for its dataloader classes (`accelerate.data_loader`): the same
objects as mpaccel.data, mpaccel.dispatch, mpaccel.prepare and mpaccel.samplers.
BatchSamplerShard is mpaccel's ShardedBatchSampler (same arguments)."""

from .data import (
    DataLoaderShard,
    IterableDatasetShard,
    SkipBatchSampler,
    SkipDataLoader,
    get_sampler,
    skip_first_batches,
)
from .dispatch import DataLoaderDispatcher
from .prepare import prepare_data_loader
from .samplers import SeedableRandomSampler, ShardedBatchSampler

BatchSamplerShard = ShardedBatchSampler


__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]
