"""The plugins mpaccel drives, with Accelerate's names: `GradientAccumulationPlugin`
(Accelerator(gradient_accumulation_plugin=...)) and `TorchDynamoPlugin` (dynamo_plugin=...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..enums import DynamoBackend
from ..errors import ConfigurationError
from .kwargs import KwargsHandler


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradient accumulation behaves (see Accelerator(gradient_accumulation_plugin=...)).

    num_steps: micro-batches per optimizer step. adjust_scheduler: step the LR scheduler once per
    optimizer step, not per micro-batch. sync_with_dataloader: force a sync (and a step) at the
    end of the dataloader. sync_each_batch: all-reduce gradients on every micro-batch (less
    memory, more communication).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (
            isinstance(self.num_steps, bool)
            or not isinstance(self.num_steps, int)
            or self.num_steps < 1
        ):
            raise ConfigurationError(
                f"GradientAccumulationPlugin(num_steps={self.num_steps!r}) must be an int >= 1"
            )


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """torch.compile for the prepared models: `Accelerator(dynamo_plugin=...)`, or
    `Accelerator(dynamo_backend="inductor")` for the defaults. backend: a DynamoBackend or its
    name (None: "no", no compilation); mode, fullgraph, dynamic, options, disable: torch.compile's;
    use_regional_compilation: compile each block of a repeated ModuleList on its own
    (mpaccel.utils.compile_regions) instead of the whole model. Unlike Accelerate, the
    ACCELERATE_DYNAMO_* variables are not read."""

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        name = "no" if self.backend is None else str(getattr(self.backend, "value", self.backend))
        if name.upper() not in DynamoBackend:
            raise ConfigurationError(
                f"TorchDynamoPlugin(backend={self.backend!r}) is not a dynamo backend",
                f"use one of {[b.lower() for b in DynamoBackend.list()]}.",
            )
        self.backend = DynamoBackend(name.upper())
        if self.mode is None:
            self.mode = "default"
        if self.fullgraph is None:
            self.fullgraph = False
        if self.use_regional_compilation is None:
            self.use_regional_compilation = False

    def to_kwargs(self) -> dict[str, Any]:
        """torch.compile's keyword arguments: those changed from the defaults, the backend by
        torch's name ("inductor")."""
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        if "backend" in kwargs:
            kwargs["backend"] = self.backend.value.lower()
        return kwargs
