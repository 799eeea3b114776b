"""Accelerate's `accelerate.parallelism_config` path: ParallelismConfig (mpaccel.config.fsdp's)."""

from .config.fsdp import ParallelismConfig

__all__ = ["ParallelismConfig"]
