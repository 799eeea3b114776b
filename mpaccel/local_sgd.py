"""Local SGD, with Accelerate's `accelerate.local_sgd.LocalSGD` interface: each rank takes
optimizer steps on its own gradients, and the ranks average their parameters every few steps."""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch

from .enums import DistributedType
from .errors import ConfigurationError


class LocalSGD:
    """Run `local_sgd_steps` optimizer steps independently on every rank, then average the
    model's parameters over all ranks (one all-reduce), and so on.

        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in loader:
                with accelerator.accumulate(model):
                    ...
                    optimizer.step()
                    local_sgd.step()

    Inside the block DDP does not all-reduce gradients (the model is in no_sync), so between
    averages the ranks' parameters drift apart; step() averages them every `local_sgd_steps`
    calls, and leaving the block averages them once more. Collective: every rank must make the
    same calls (step() averages on the same call everywhere). In a job of one process, or with
    enabled=False, it does nothing. If the block raises, the final average is skipped (the
    other ranks would wait for it): the error ends the job, or is the caller's to handle.

    Args:
        accelerator: the Accelerator that prepared `model` (one process or DDP; FSDP is
            refused).
        model: the prepared model whose parameters are averaged.
        local_sgd_steps: how many optimizer steps each rank takes between averages (>= 1).
        enabled: False makes the whole thing a no-op (as does a job of one process).

    Raises:
        ConfigurationError: with FSDP, or a `local_sgd_steps` that is not an int >= 1.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        local_sgd_steps: int,
        enabled: bool = True,
    ) -> None:
        if accelerator.distributed_type not in (
            DistributedType.NO,
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
        ):
            raise ConfigurationError(
                f"LocalSGD averages whole models; it cannot run with "
                f"{accelerator.distributed_type}",
                "use it with DistributedDataParallel training (mpaccel's default).",
            )
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or (
            local_sgd_steps < 1
        ):
            raise ConfigurationError(
                f"LocalSGD(local_sgd_steps={local_sgd_steps!r}) must be an int >= 1",
                "pass how many optimizer steps each rank takes between averages, e.g. 8.",
            )
        self.enabled = enabled and accelerator.num_processes > 1
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.ExitStack | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = contextlib.ExitStack()
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._no_sync is None:
            return
        try:
            if exc_type is None:
                self._sync_and_avg_model_params()
        finally:
            self._no_sync.close()
            self._no_sync = None

    def step(self) -> None:
        """Collective every `local_sgd_steps`-th call, when it averages the parameters over the
        ranks; every rank must call it after each optimizer step. Counts one optimizer step."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        """Collective: every parameter replaced by its mean over the ranks. One reduction of
        all the parameters, flattened per dtype (ops.reduce checks the shapes agree first)."""
        params = [p for p in self.model.parameters()]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        flats = {
            str(dtype): torch.cat([p.detach().reshape(-1) for p in group])
            for dtype, group in sorted(by_dtype.items(), key=lambda item: str(item[0]))
        }
        means = self.accelerator.reduce(flats, reduction="mean")
        with torch.no_grad():
            for dtype, group in by_dtype.items():
                mean = means[str(dtype)]
                for p, part in zip(group, mean.split([p.numel() for p in group])):
                    p.copy_(part.view_as(p))
