"""Accelerate's module path for its dataloader classes (`accelerate.data_loader`): the same
objects as mpaccel.data's modules (sharded, dispatch, skip, loader, prepare, samplers).
BatchSamplerShard is mpaccel's ShardedBatchSampler (same arguments)."""

from .data.dispatch import DataLoaderDispatcher
from .data.loader import get_sampler
from .data.prepare import prepare_data_loader
from .data.samplers import SeedableRandomSampler, ShardedBatchSampler
from .data.sharded import DataLoaderShard, IterableDatasetShard
from .data.skip import SkipBatchSampler, SkipDataLoader, skip_first_batches

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
