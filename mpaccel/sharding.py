"""What the Accelerator and its state do for fully sharded training (FSDP2): choose the plugin,
build the device mesh from discovery's node layout, shard prepared models and re-point their
optimizers at the shards. The torch side is mpaccel/fsdp.py."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from . import _env, distributed, shared_settings
from .comm import Comm, agreement
from .config_fsdp import FullyShardedDataParallelPlugin, ParallelismConfig
from .errors import CollectiveError, ConfigurationError


def choose_plugin(
    fsdp_plugin: Any, parallelism_config: Any
) -> FullyShardedDataParallelPlugin | None:
    """Not collective (the caller makes a bad value every rank's error). The plugin to train
    with: the one given, else one built from Accelerate's variables when ACCELERATE_USE_FSDP
    (or MPACCEL_USE_FSDP) is true, else None (DistributedDataParallel)."""
    for name, value, kind in (
        ("fsdp_plugin", fsdp_plugin, FullyShardedDataParallelPlugin),
        ("parallelism_config", parallelism_config, ParallelismConfig),
    ):
        if value is not None and not isinstance(value, kind):
            raise ConfigurationError(
                f"{name} must be a {kind.__name__}, got {value!r}",
                f"build it with mpaccel.utils.{kind.__name__}(...) (docs/training.md).",
            )
    if fsdp_plugin is None and _env.get_bool("use_fsdp", False):
        fsdp_plugin = FullyShardedDataParallelPlugin()
    if fsdp_plugin is None and parallelism_config is not None and parallelism_config.total_size > 1:
        raise ConfigurationError(
            f"ParallelismConfig(dp_replicate_size={parallelism_config.dp_replicate_size}, "
            f"dp_shard_size={parallelism_config.dp_shard_size}) shapes a fully sharded mesh, "
            "but no fsdp_plugin was given",
            "pass fsdp_plugin=FullyShardedDataParallelPlugin() as well, or drop "
            "parallelism_config (mpaccel then trains with DistributedDataParallel).",
        )
    return fsdp_plugin


def build_mesh(
    partial: Any, plugin: FullyShardedDataParallelPlugin, parallelism_config: Any
) -> Any:
    """Collective: the DeviceMesh models are sharded over, from the PartialState `partial`. Its
    shape: parallelism_config's; else, for HYBRID_SHARD, (nodes, ranks per node) from
    discovery's node_index and local_process_index (the MPI shared-memory split), gathered over
    MPI; else one dimension over every rank. A job of one process gets a process group of
    its own (FSDP needs one)."""
    from . import fsdp

    if partial.num_processes == 1:
        partial.backend = distributed.init_world_of_one(partial.device, partial.backend)
    shape = None
    with agreement(partial.comm, "building the FSDP device mesh", passing=(CollectiveError,)):
        if parallelism_config is not None:
            shape = (parallelism_config.dp_replicate_size, parallelism_config.dp_shard_size)
            if shape[0] * shape[1] != partial.num_processes:
                raise ConfigurationError(
                    f"ParallelismConfig(dp_replicate_size={shape[0]}, dp_shard_size={shape[1]}) "
                    f"makes a mesh of {shape[0] * shape[1]} ranks; the job has "
                    f"{partial.num_processes}",
                    "make dp_replicate_size * dp_shard_size the number of processes.",
                )
    node = (partial.node_index, partial.local_process_index)
    return fsdp.build_mesh(partial.comm, partial.device.type, node, plugin.hybrid, shape)


def _fingerprint(model: torch.nn.Module) -> str:
    """A digest of the model's state-dict names, shapes and dtypes, to compare across ranks."""
    from . import fsdp

    return hashlib.sha1(repr(fsdp.structure(model)).encode()).hexdigest()


def _check_model(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin, rank: int) -> None:
    """This rank's model can be sharded as the plugin says (raised, then agreed on)."""
    from . import fsdp

    on_meta = fsdp.has_meta_tensors(model)
    if on_meta and not plugin.cpu_ram_efficient_loading:
        raise ConfigurationError(
            f"the model given to prepare() ({type(model).__name__}) has tensors on the meta "
            "device: there are no weights to shard",
            "create the model with real weights, or pass FullyShardedDataParallelPlugin("
            "cpu_ram_efficient_loading=True) and give rank 0 a model with real weights (the "
            "other ranks may build theirs on the meta device).",
        )
    if on_meta and rank == 0:
        raise ConfigurationError(
            f"cpu_ram_efficient_loading: rank 0's model ({type(model).__name__}) is on the meta "
            "device, but rank 0 holds the weights every rank receives",
            "load the real weights on rank 0 (the other ranks may use the meta device).",
        )


def shard_model(
    model: torch.nn.Module,
    plugin: FullyShardedDataParallelPlugin,
    mesh: Any,
    comm: Comm,
    device: torch.device,
    placement: bool,
) -> torch.nn.Module:
    """Collective: every rank calls this with its copy of the same model. Applies fully_shard
    per the plugin's wrap policy (blocks first, then the root) over `mesh`, in place, starting
    from rank 0's weights; returns the model (the same object, now an FSDP module), whose
    `generate` (where it has one) and the plugin's forward_methods gather the parameters as
    forward does, and whose transformers `save_pretrained` writes whole tensors
    (fsdp.WholeSavePretrained). Tied parameters stay tied (fsdp.retie). A model
    whose ranks disagree (structure, meta device) is one CollectiveError on every rank."""
    from . import fsdp

    blocks: list[torch.nn.Module] = []
    methods: list[str] = []
    note = ""
    with agreement(comm, "preparing a model for FSDP", passing=(CollectiveError,)):
        _check_model(model, plugin, comm.rank)
        methods = fsdp.forward_methods(model, plugin.forward_methods or [])
        blocks, note = fsdp.blocks_to_wrap(model, plugin)
        if plugin.ignored_modules is not None:
            fsdp.ignored_parameters(model, plugin.ignored_modules)  # a bad regex fails here
    units = shared_settings.of_units(model, blocks)
    gathered = comm.allgather((_fingerprint(model), units), what="comparing the models to shard")
    prints = [p for p, _ in gathered]
    if len(set(prints)) > 1:
        odd = [r for r, p in enumerate(prints) if p != prints[0]]
        raise ConfigurationError(
            f"the model given to prepare() differs between ranks: ranks {odd} hold a model with "
            "other parameter names, shapes or dtypes than rank 0's",
            "build the same model on every rank before prepare().",
        )
    mismatch = shared_settings.mismatch([[u] for _, u in gathered], "prepare()")
    if mismatch is not None:  # a wrap policy that decides by the rank or its environment
        raise mismatch
    if note and comm.rank == 0:
        fsdp.warn(note)
    if placement and not fsdp.has_meta_tensors(model):
        model = model.to(device)
    if plugin.activation_checkpointing:
        blocks = fsdp.checkpoint_blocks(model, blocks)
    options: dict[str, Any] = {}
    if plugin.mixed_precision_policy is not None:
        options["mp_policy"] = plugin.mixed_precision_policy
    if plugin.offloads and device.type != "cpu":  # on the CPU the parameters are there already
        options["offload_policy"] = fsdp.offload_policy(plugin.cpu_offload)
    fsdp.shard(
        model, blocks, mesh, options, plugin.reshard_after_forward, plugin.ignored_modules,
        from_rank0=bool(plugin.cpu_ram_efficient_loading), is_main=comm.rank == 0, device=device,
    )  # fmt: skip
    fsdp.register_forward_methods(model, methods)
    fsdp.WholeSavePretrained.install(model, comm)
    return model


def check_optimizers(
    optimizers: Iterable[torch.optim.Optimizer], prepared: Iterable[torch.nn.Module]
) -> None:
    """Not collective (the same on every rank). An optimizer prepared without its model must
    already hold the sharded parameters of prepared models (built after prepare(model)); one
    over the whole tensors of before would train nothing."""
    known = {id(p) for model in prepared for p in model.parameters()}
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stale = sum(id(p) not in known for p in params)
        if stale:
            raise ConfigurationError(
                f"{type(optimizer).__name__} was passed to prepare() without its model, and "
                f"{stale} of its {len(params)} parameters belong to no prepared (sharded) model",
                "pass the model and its optimizer to the same prepare() call (as Accelerate "
                "requires under FSDP2), or build the optimizer over the prepared model's "
                "parameters.",
            )


def detach_optimizers(
    models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]
) -> list[tuple[torch.nn.Module, list[list[Any]]]]:
    """Not collective. Take the models' parameters out of the optimizers (placeholders naming
    them), so that sharding frees the whole tensors; attach_optimizers puts the shards in."""
    from . import fsdp

    optimizers = list(optimizers)
    return [(model, fsdp.detach_optimizers(model, optimizers)) for model in models]


def attach_optimizers(detached: list[tuple[torch.nn.Module, list[list[Any]]]]) -> None:
    """Not collective. The optimizers of detach_optimizers now hold the sharded parameters (the
    param groups and their hyperparameters are kept)."""
    from . import fsdp

    for model, groups in detached:
        fsdp.attach_optimizers(model, groups)
