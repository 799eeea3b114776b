"""Data parallelism: every rank holds the whole model; several ranks all-reduce gradients
through torch's DistributedDataParallel, one process trains it as it is."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .. import distributed
from ..enums import DistributedType
from .base import Strategy


class DataParallel(Strategy):
    """One process, or DistributedDataParallel over every rank (the strategy without an FSDP
    plugin)."""

    def joins_uneven_inputs(self, distributed_type: DistributedType) -> bool:
        return self.num_processes > 1 and distributed_type in (
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
        )

    def place(self, model: torch.nn.Module, placement: bool) -> torch.nn.Module:
        """Not collective. The model on the device, with `placement`."""
        return model.to(self.device) if placement else model

    def wrap(self, model: torch.nn.Module, ddp_handler: Any = None) -> torch.nn.Module:
        """Collective on several ranks: DistributedDataParallel around `model` (rank 0's
        parameters and buffers broadcast), with the handler's options and communication hook;
        the model itself in a world of one."""
        if self.num_processes == 1:
            return model
        options = ddp_handler.to_kwargs() if ddp_handler is not None else {}
        model = distributed.wrap_ddp(model, self.device, **options)
        if ddp_handler is not None:
            ddp_handler.register_comm_hook(model)
        return model

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        """Not collective. DDP's no_sync (of the DDP inside a compiled model too); a null
        context for a model that is no DDP."""
        ddp = distributed.ddp_of(model)
        return nullcontext() if ddp is None else ddp.no_sync()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Not collective: after DDP's all-reduce the gradients, and so the norm, agree on
        every rank."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
