"""Accelerate's `accelerate.parallelism_config` path: ParallelismConfig
(mpaccel.config.parallelism's)."""

from .config.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
