"""How a model is parallelised: the interface the Accelerator calls, chosen once per job by
AcceleratorState (strategy/choice.py) and never asked which one it is.

A strategy answers, for the models prepare() is given: where a model lives and what wraps it
for training (`place`, `wrap`), how optimizers built over the user's parameters follow the
parameters that train (`optimizers_follow`), how gradients are kept local or synchronised
(`no_sync`), how their norm is clipped (`clip_grad_norm_`), what a model's state is whole and
as this rank holds it (`full_state_dict`, `sharded_state_dict`), which checkpoint entries hold
rows per rank (`checkpoint_entries`, `is_sharded`: save_model's choice of writer;
`check_savable`: what cannot be saved yet), and over how many ranks data loaders shard their
batches (`data_parallel_size`, `data_parallel_rank`).

Three strategies exist: `DataParallel` (one process, or DistributedDataParallel),
`FullySharded` (torch's FSDP2 over a 1-D mesh, or HSDP over a 2-D replicate x shard mesh) and
`TensorParallel` (strategy/tensor_parallel.py), which composes with either as follows.

How tensor parallelism composes with either, without a change to the Accelerator: a
`TensorParallel` strategy holds a data-parallel strategy (FullySharded over the data-parallel
dimensions of the mesh, or DataParallel when they are all of size 1: pure TP) and the N-D mesh
(strategy/mesh.py builds it). `place` first splits the model over mesh['tp'] (torch's
parallelize_module), then hands it to the inner strategy's `place`; every other method
delegates to the inner strategy, except where the tensor-parallel dimension changes the answer:
`data_parallel_size`, `data_parallel_rank` and `reports_metrics` count tensor-parallel groups,
not ranks (the ranks of one group read the same batches), `wrap` and `joins_uneven_inputs` (no
DDP around DTensors), `optimizers_follow`, `clip_grad_norm_` and `full_state_dict` (DTensor
parameters, even without FSDP2), `context_parallel` (over mesh['cp']) and the checkpoint
methods, which hand a tensor-parallel model, its optimizers and its gradients to the
checkpoint's N-D blocks. The Accelerator keeps calling this interface;
AcceleratorState picks the composed strategy from the ParallelismConfig's tp_size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from .. import distributed
from ..enums import DistributedType


class Strategy:
    """A parallelism strategy, built once by AcceleratorState from the process facts (the
    PartialState `partial`). Methods say which ranks call them; the collective ones are called
    by every rank, in the same order."""

    #: what AcceleratorState.distributed_type says; None: the process's (PartialState's)
    distributed_type: DistributedType | None = None

    def __init__(self, partial: Any) -> None:
        self.comm = partial.comm
        self.device: torch.device = partial.device
        self.num_processes: int = partial.num_processes
        self.process_index: int = partial.process_index

    #: the DeviceMesh models are parallelised over; None where there is none (DataParallel)
    mesh: Any = None

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step reads: the ranks that data loaders shard over."""
        return self.num_processes

    @property
    def data_parallel_rank(self) -> int:
        """Which of those batches this rank reads."""
        return self.process_index

    @property
    def reports_metrics(self) -> bool:
        """Whether this rank's samples count in gather_for_metrics: every rank's, but where
        several ranks read the same batches (a tensor-parallel group), the first one's."""
        return True

    def context_parallel(
        self, buffers: list[Any], buffer_seq_dims: list[int], no_restore_buffers: set[Any]
    ) -> AbstractContextManager[Any]:
        """Not collective to enter. Where the strategy splits sequences over a 'cp' mesh
        dimension, the block sees each rank's part of `buffers`; a null context elsewhere."""
        del buffers, buffer_seq_dims, no_restore_buffers
        return nullcontext()

    def mesh_rank(self, dim: str) -> int:
        """Not collective. This rank's index along the mesh dimension `dim` ('dp_replicate',
        'dp_shard', 'cp', 'tp'); 0 where there is no mesh."""
        if self.mesh is None:
            return 0
        return int(self.mesh.get_local_rank(dim))

    def joins_uneven_inputs(self, distributed_type: DistributedType) -> bool:
        """Whether join_uneven_inputs can keep the ranks that ran out of batches answering the
        others' gradient collectives (torch's Join of DDP models), for the set-up as
        AcceleratorState names it when asked (`distributed_type`: Accelerate's tests patch
        it)."""
        del distributed_type
        return False

    # -- preparing a model --------------------------------------------------------------------

    def is_prepared(self, model: torch.nn.Module) -> bool:
        """Not collective. `model` is what a prepare() made (a DDP; a sharded model): preparing
        it again would wrap a DDP in another, or shard the shards."""
        return distributed.ddp_of(model) is not None

    def place(self, model: torch.nn.Module, placement: bool) -> torch.nn.Module:
        """Put `model` where it trains: on the device (with `placement`) or parallelised over
        the mesh. Collective where the strategy shards (every rank, its copy of one model)."""
        raise NotImplementedError

    def wrap(self, model: torch.nn.Module, ddp_handler: Any = None) -> torch.nn.Module:
        """The model training calls, around a placed, trainable model (DistributedDataParallel,
        configured by the Accelerator's DistributedDataParallelKwargs `ddp_handler`); the
        model itself where nothing wraps it. Collective where it wraps (DDP broadcasts)."""
        del ddp_handler
        return model

    @contextmanager
    def optimizers_follow(
        self, models: list[torch.nn.Module], optimizers: list[Any], prepared: Iterable[Any]
    ) -> Iterator[None]:
        """Not collective. Around the preparing of `models`: the `optimizers` passed with them
        hold, after the block, the parameters that train (the same ones where placing keeps the
        parameter objects; `prepared`: the models prepared before)."""
        del models, optimizers, prepared
        yield

    # -- the training step ----------------------------------------------------------------------

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        """Not collective. Gradients computed inside the block stay this rank's (no all-reduce,
        no reduce-scatter) until a synchronising backward; a null context where nothing
        synchronises. Never a generator of its own: its frame would keep the model, and DDP's
        process group, alive longer (a gloo teardown race: strategy/fully_sharded.py)."""
        raise NotImplementedError

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients' total norm to `max_norm`; returns the norm before clipping, the
        same on every rank. Collective where gradients are sharded."""
        raise NotImplementedError

    # -- a model's state --------------------------------------------------------------------------

    def full_state_dict(self, model: torch.nn.Module, everywhere: bool) -> dict[str, Any]:
        """The model's state with whole tensors; where they are sharded, collective and gathered
        on rank 0 only (the others get {}) unless `everywhere`."""
        del everywhere
        return model.state_dict()

    def sharded_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """Not collective. The model's state as this rank holds it (its rows, as DTensors, of
        a sharded model; whole tensors otherwise)."""
        return model.state_dict()

    def is_sharded(self, model: torch.nn.Module) -> bool:
        """Not collective. Whether `model`'s state is held in rows across ranks: saving it
        needs every rank (save_model writes each rank's rows, no gather)."""
        del model
        return False

    def tied_aliases(self, model: torch.nn.Module) -> set[str]:
        """Not collective. The state names a saved file leaves out because another name holds
        the same parameter (where the strategy's state dict shows them apart)."""
        del model
        return set()

    def check_savable(self, model: torch.nn.Module) -> None:
        """Not collective (every rank answers alike). Raise a ConfigurationError, before
        anything is written, where this strategy's checkpoints cannot hold `model` (an
        unwrapped, prepared model) yet; nothing where they can."""
        del model

    def checkpoint_entries(
        self, models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, Any], loading: bool
    ) -> dict[str, Any]:
        """Not collective. The checkpoint entries, by name, that hold each rank's rows (the
        `sharded` Statefuls of a TrainingState), out of the named unwrapped `models` and their
        `optimizers`; the others are saved whole. `loading`: a fresh optimizer over shards gets
        its state created to load into."""
        del models, optimizers, loading
        return {}

    def summed_gradients(self, model: torch.nn.Module, keys: list[str] | None) -> Any:
        """Not collective to build; its state_dict() is collective over the model's ranks. The
        gradients one of this strategy's sharded models (a checkpoint_entries model) summed so
        far mid-accumulation, as a Stateful whose rows a checkpoint holds; `keys`, on a load,
        the gradients the checkpoint holds. A strategy that shards no model has none."""
        raise NotImplementedError(f"{type(self).__name__} shards no model: {type(model).__name__}")
