"""Accelerate's `accelerate.utils.fsdp_utils` path: its FSDP checkpoint helpers (mpaccel's,
from mpaccel.fsdp_checkpoint), `get_parameters_from_modules`, and, resolved on first use, the
refusals of the internals of Accelerate's FSDP integration (mpaccel/absent_names.py)."""

from __future__ import annotations

import re
import typing as _typing
from collections.abc import Iterable
from typing import Any

import torch

from .. import absent_names
from ..fsdp_checkpoint import (
    load_fsdp_model,
    load_fsdp_optimizer,
    merge_fsdp_weights,
    save_fsdp_model,
    save_fsdp_optimizer,
)


def get_parameters_from_modules(
    modules: Iterable[torch.nn.Module] | str | None, model: torch.nn.Module, device: Any
) -> set[torch.nn.Parameter]:
    """The parameters of `modules`: modules, or a regular expression matched against the whole
    of each of `model`'s module names (those are moved to `device` first, as Accelerate's
    does for FSDP's ignored modules). None gives an empty set. Not collective."""
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [m.to(device) for name, m in model.named_modules() if pattern.fullmatch(name)]
    return {p for module in modules for p in module.parameters()}


__all__ = [
    "get_parameters_from_modules",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]

if not _typing.TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        return absent_names.resolve("mpaccel.utils", name)
