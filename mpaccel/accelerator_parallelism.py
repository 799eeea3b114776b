"""The Accelerator's facts about model parallelism: the FSDP mesh, the ParallelismConfig that
shaped it, and this rank's place along each of Accelerate's mesh dimensions. A mixin of
Accelerator (accelerator.py); `_Host` lists what it uses of the Accelerator, so this module
needs nothing from accelerator.py."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from .errors import MpaccelWarning, with_hint
from .state import AcceleratorState

_SET_CONFIG = (
    "pass Accelerator(fsdp_plugin=..., parallelism_config=ParallelismConfig("
    "dp_replicate_size=..., dp_shard_size=...))."
)


class _Host(Protocol):
    """What ParallelismFacts use of the Accelerator they are mixed into."""

    state: AcceleratorState


def _mesh_rank(host: _Host, dim: str, what: str) -> int:
    """This rank's index along the mesh dimension `dim` ('dp_replicate', 'dp_shard', 'tp'), 0
    where the ParallelismConfig leaves it at size 1 (tp always: mpaccel drives no tensor
    parallelism); an error without a ParallelismConfig, as Accelerate's."""
    config = host.state.parallelism_config
    if config is None:
        message = f"{what} is not configured: the Accelerator has no parallelism_config"
        raise RuntimeError(with_hint(message, _SET_CONFIG))
    if not getattr(config, f"{dim}_enabled"):
        return 0
    mesh = host.state.device_mesh
    assert mesh is not None  # a dimension > 1 needs an fsdp_plugin, which built the mesh
    return int(mesh.get_local_rank(dim))


class ParallelismFacts:
    """Accelerator's properties about the parallel layout."""

    @property
    def is_fsdp2(self: _Host) -> bool:
        return self.state.is_fsdp2

    @property
    def deepspeed_plugin(self: _Host) -> Any:
        return None

    @property
    def parallelism_config(self: _Host) -> Any:
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self: _Host) -> Any:
        return self.state.device_mesh

    @property
    def is_composable_parallelism_enabled(self: _Host) -> bool:
        return False

    @property
    def data_parallel_rank(self: _Host) -> int:
        """This rank's replica index (mesh dimension 'dp_replicate'): 0 where the
        ParallelismConfig has dp_replicate_size 1. RuntimeError without a ParallelismConfig."""
        return _mesh_rank(self, "dp_replicate", "data parallelism")

    @property
    def data_parallel_shard_rank(self: _Host) -> int:
        """This rank's index in its shard group (mesh dimension 'dp_shard'): 0 where the
        ParallelismConfig has dp_shard_size 1. RuntimeError without a ParallelismConfig."""
        return _mesh_rank(self, "dp_shard", "shard-based data parallelism")

    @property
    def tensor_parallel_rank(self: _Host) -> int:
        """0 with a ParallelismConfig (mpaccel drives no tensor parallelism: every rank holds
        the same slice); RuntimeError without one, as Accelerate's."""
        return _mesh_rank(self, "tp", "tensor parallelism")

    @property
    def context_parallel_rank(self: _Host) -> int:
        """NotImplementedError, as Accelerate's: there is no context parallelism."""
        raise NotImplementedError(with_hint(
            "context parallelism is not supported (in Accelerate neither)",
            "split long sequences yourself; ParallelismConfig's cp_size must be 1.",
        ))  # fmt: skip

    @property
    def pipeline_parallel_rank(self: _Host) -> int:
        """NotImplementedError, as Accelerate's: there is no pipeline parallelism."""
        raise NotImplementedError(with_hint(
            "pipeline parallelism is not supported (in Accelerate neither)",
            "shard the model with an fsdp_plugin instead of splitting it into stages.",
        ))  # fmt: skip

    @contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[Any] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[Any] | None = None,
    ) -> Iterator[None]:
        """No effect, as Accelerate's without context parallelism (cp_size 1, the only size
        mpaccel takes): the buffers stay whole. Warns once per process, as Accelerate's."""
        del buffers, buffer_seq_dims, no_restore_buffers
        global _warned_no_context_parallel
        if not _warned_no_context_parallel:
            _warned_no_context_parallel = True
            warnings.warn(
                "maybe_context_parallel() has no effect: mpaccel drives no context "
                "parallelism (ParallelismConfig's cp_size must be 1), as Accelerate's without "
                "cp_size > 1; every rank sees whole sequences",
                MpaccelWarning,
                stacklevel=3,
            )
        yield


_warned_no_context_parallel = False
