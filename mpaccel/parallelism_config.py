"""Accelerate's `accelerate.parallelism_config` path: ParallelismConfig (mpaccel.config_fsdp's)."""

from .config_fsdp import ParallelismConfig

__all__ = ["ParallelismConfig"]
