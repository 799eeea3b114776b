"""`prepare_data_loader`: a DataLoader rebuilt as a prepared loader (DataLoaderShard, or
DataLoaderDispatcher when rank 0 reads for everyone), with Accelerate's arguments."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ..errors import ConfigurationError
from .dispatch import DataLoaderDispatcher, Window
from .loader import PreparedLoader, loader_options
from .samplers import (
    GeneratorReplay,
    ShardedBatchSampler,
    Shares,
    SingleItems,
    Unbatched,
    synchronized,
    synchronized_batches,
)
from .sharded import DataLoaderShard, IterableDatasetShard

__all__ = ["agreed_seed", "prepare_data_loader"]


def agreed_seed(comm: Any) -> int:
    """Collective: rank 0's torch.initial_seed(), the seed shuffles start from everywhere
    (so torch.manual_seed(s) makes runs repeatable, whatever the other ranks were seeded with)."""
    return int(comm.bcast(torch.initial_seed() % 2**62, what="prepare_data_loader (seed)"))


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[Any] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> DataLoader:
    """Collective (unless `data_seed` is given: the shuffling seed is agreed over MPI). This
    process's share of `dataloader`, with Accelerate's arguments and meanings (see
    docs/training.md): `num_processes`/`process_index` default to the PartialState's;
    `dispatch_batches=None` dispatches iterable datasets when `put_on_device`; `rng_types`
    are synchronised from rank 0 as each pass starts; `data_seed` is the seed every shuffle
    starts from (default: rank 0's torch.initial_seed()); with `torch_device_mesh`, the
    data-parallel world is the mesh's 'dp' dimension (dp_replicate x dp_shard) and this rank
    reads the batches of its coordinate along it, as do the other ranks of its tp/cp group.
    Returns a prepared loader that passes for a DataLoader."""
    from ..state import GradientState, PartialState

    state = PartialState()
    if data_seed is None:
        data_seed = agreed_seed(state.comm)
    prepared = build(
        dataloader,
        device=device if put_on_device else None,
        num_processes=state.num_processes if num_processes is None else num_processes,
        process_index=state.process_index if process_index is None else process_index,
        world=(state.num_processes, state.process_index),
        split_batches=split_batches,
        put_on_device=put_on_device,
        rng_types=rng_types,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=use_seedable_sampler,
        seed=data_seed,
        non_blocking=non_blocking,
        use_stateful_dataloader=use_stateful_dataloader,
        torch_device_mesh=torch_device_mesh,
        gradient_state=GradientState(),
    )
    return cast(DataLoader, prepared)  # it passes for one (isinstance holds)


def build(
    dataloader: DataLoader,
    *,
    device: torch.device | None,
    num_processes: int,
    process_index: int,
    world: tuple[int, int],
    split_batches: bool,
    put_on_device: bool,
    rng_types: list[Any] | None,
    dispatch_batches: bool | None,
    even_batches: bool,
    slice_fn_for_dispatch: Callable[..., Any] | None,
    use_seedable_sampler: bool,
    seed: int,
    non_blocking: bool,
    use_stateful_dataloader: bool,
    torch_device_mesh: Any,
    gradient_state: Any,
) -> PreparedLoader:
    """Not collective: prepare_data_loader once the seed is agreed. `world`: the job's
    (num_processes, process_index), which a dispatcher deals to whatever the others say."""
    if issubclass(type(dataloader), PreparedLoader):  # isinstance would say DataLoader too
        return dataloader  # type: ignore[return-value]
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if torch_device_mesh is not None:
        if dispatch_batches:
            raise ConfigurationError(
                "dispatch_batches=True with a torch_device_mesh is not supported by mpaccel",
                "pass dispatch_batches=False: each data-parallel rank then reads its own batches.",
            )
        num_processes, process_index = _mesh_position(torch_device_mesh)
    loader_class = _loader_class(use_stateful_dataloader)
    kwargs = loader_options(dataloader)
    if loader_class is not DataLoader and "in_order" not in _parameters(loader_class):
        kwargs.pop("in_order", None)  # torchdata before 0.11
    # A private generator: starting an iteration then draws its worker seed from here, not from
    # the global torch RNG, so iterating does not shift the RNG a resumed run must reproduce.
    kwargs["generator"] = torch.Generator().manual_seed(seed + process_index)
    persistent = bool(kwargs.get("persistent_workers", False))
    sync = {
        "seed": seed,
        "seedable": use_seedable_sampler,
        "loader_generator": dataloader.generator,
        "persistent": persistent,
    }
    dataset = dataloader.dataset
    if dispatch_batches:
        return _dispatcher(
            dataloader, loader_class, kwargs, sync, world, split_batches, even_batches,
            slice_fn_for_dispatch, device, gradient_state, non_blocking,
        )  # fmt: skip
    sharding: Shares
    replay: GeneratorReplay | None = None
    if isinstance(dataset, IterableDataset):
        # No sampler to shard (torch refuses one with an iterable dataset): shard the stream.
        sharding = IterableDatasetShard(
            dataset,
            dataloader.batch_size,
            dataloader.drop_last,
            num_processes,
            process_index,
            split_batches,
            even_batches=even_batches,
            seed=seed,
        )
        rebuilt = loader_class(
            sharding, batch_size=sharding.process_batch_size, drop_last=dataloader.drop_last,
            **kwargs,
        )  # fmt: skip
    else:
        # Without batch_size (None) the loader reads its sampler's items one by one: a batch
        # sampler given as `sampler` (the dataset reads a list of indices at once) is dealt as
        # if given as `batch_sampler`; the items of any other are dealt out as batches of no
        # fixed size would be (at size 1: the loader's own items).
        unbatched = dataloader.batch_sampler is None
        batches: Any = dataloader.sampler if unbatched else dataloader.batch_sampler
        if unbatched and not isinstance(batches, BatchSampler):
            items, replay = synchronized(batches, **sync)
            batches = SingleItems(items)
        else:
            batches, replay = synchronized_batches(batches, **sync)
        sharding = ShardedBatchSampler(
            batches, num_processes, process_index, split_batches, even_batches
        )
        if not unbatched:
            kwargs["batch_sampler"] = sharding
        else:
            single = isinstance(batches, SingleItems)
            kwargs.update(batch_size=None, sampler=Unbatched(sharding) if single else sharding)
        rebuilt = loader_class(dataset, **kwargs)
    return DataLoaderShard(
        rebuilt, sharding, dataset, device, gradient_state, non_blocking, rng_types, replay
    )


def _dispatcher(
    dataloader: DataLoader,
    loader_class: type,
    kwargs: dict[str, Any],
    sync: dict[str, Any],
    world: tuple[int, int],
    split_batches: bool,
    even_batches: bool,
    slice_fn: Callable[..., Any] | None,
    device: torch.device | None,
    gradient_state: Any,
    non_blocking: bool,
) -> DataLoaderDispatcher:
    """Rank 0 reads the loader as it is (its order drawn as the sharded loaders draw theirs,
    so that a resumed pass replays it); every rank gets its part of each global batch."""
    dataset = dataloader.dataset
    window: Window | None = None
    order: Any = None
    replay: GeneratorReplay | None = None
    if isinstance(dataset, IterableDataset):
        batch_size = dataloader.batch_size
        base = loader_class(
            dataset, batch_size=batch_size, drop_last=dataloader.drop_last, **kwargs
        )
    else:
        unbatched = dataloader.batch_sampler is None
        source: Any = dataloader.sampler if unbatched else dataloader.batch_sampler
        if unbatched and not isinstance(source, BatchSampler):  # items, not batches
            source, replay = synchronized(source, **sync)
            order, batch_size = source, None
        else:
            source, replay = synchronized_batches(source, **sync)
            order = getattr(source, "sampler", None)
            batch_size = getattr(source, "batch_size", None)
        window = Window(source)
        if unbatched:
            base = loader_class(dataset, batch_size=None, sampler=window, **kwargs)
        else:
            base = loader_class(dataset, batch_sampler=window, **kwargs)
    sharding = Shares(
        batch_size, world[0], world[1], split_batches, even_batches, dataloader.drop_last
    )
    return DataLoaderDispatcher(
        base, sharding, dataset, device, gradient_state, non_blocking, replay, slice_fn,
        window, order,
    )  # fmt: skip


def _mesh_position(mesh: Any) -> tuple[int, int]:
    """(num_processes, process_index) of this rank in the data-parallel world of a device mesh:
    the size of the mesh's 'dp' dimension (flattened, as Accelerate and mpaccel build it) and
    this rank's coordinate along it, else those of its dp_replicate x dp_shard dimensions. The
    ranks of one tensor- or context-parallel group share that coordinate and read the same
    batches. A coordinate, not the world rank divided by tp x cp: a mesh laid out node by node
    need not hold consecutive world ranks."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ConfigurationError(
            f"prepare_data_loader(torch_device_mesh=...): this rank is not in the mesh "
            f"{mesh!r}",
            "pass the mesh every rank of the job belongs to (accelerator.torch_device_mesh).",
        )
    try:
        flat = mesh["dp"]  # a dimension of its own, or one flattened from its parts
    except (KeyError, RuntimeError, ValueError):
        flat = None
    if flat is not None:
        return int(flat.size()), int(flat.get_local_rank())
    where = dict(zip(names, coordinate))
    count, index = 1, 0
    for name in ("dp_replicate", "dp_shard"):
        if name in where:
            size = int(mesh[name].size())
            count, index = count * size, index * size + int(where[name])
    return count, index


def _loader_class(stateful: bool) -> type:
    if not stateful:
        return DataLoader
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as exc:
        raise ConfigurationError(
            f"use_stateful_dataloader=True needs torchdata's StatefulDataLoader, which cannot "
            f"be imported here: {exc}",
            "pip install 'torchdata>=0.8' (0.11 installs beside torch 2.13 on CPU), or leave "
            "use_stateful_dataloader=False: prepared loaders still resume mid-epoch through "
            "save_state/load_state and their state_dict().",
        ) from exc
    return StatefulDataLoader


def _parameters(cls: type) -> set[str]:
    return set(inspect.signature(cls).parameters)
