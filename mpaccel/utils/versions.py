"""Accelerate's `accelerate.utils.versions`: version comparisons (mpaccel.utils.imports')."""

from .imports import compare_versions, is_torch_version

__all__ = ["compare_versions", "is_torch_version"]
