"""Accelerate's module path for its dataloader classes (`accelerate.data_loader`): the same
objects as mpaccel.data. BatchSamplerShard is mpaccel's ShardedBatchSampler (same arguments)."""

from .data import (
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    ShardedBatchSampler,
    SkipBatchSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)

BatchSamplerShard = ShardedBatchSampler

__all__ = [
    "BatchSamplerShard",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]
