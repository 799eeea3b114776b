"""The device mesh models are parallelised over, laid out from discovery's node facts: a
ParallelismConfig's N-D mesh (Accelerate's dimensions dp_replicate, dp_shard, cp, tp and the
flattened dp, dp_shard_cp, dp_cp; which ranks form a group: strategy/layout.py), else one
shard group per node (HYBRID_SHARD), else one dimension over every rank."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from .. import distributed, envvars
from ..comm import agreement
from ..errors import CollectiveError, ConfigurationError
from .layout import MeshLayout, lay_out, resolve_sizes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"
#: the flattened dimensions, from their parts (Accelerate builds the same ones)
FLATTENED = (
    ("dp", ("dp_replicate", "dp_shard")),
    ("dp_shard_cp", ("dp_shard", "cp")),
    ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
)

logger = logging.getLogger("mpaccel.strategy")


def node_grid(layout: list[tuple[int, int]]) -> list[list[int]]:
    """Ranks by node: `layout[rank] = (node_index, local_process_index)` -> grid[node][local] =
    rank. Ranks of a node need not be consecutive (round-robin placement); every node must run
    as many ranks, else there is no rectangular mesh (ConfigurationError)."""
    nodes: dict[int, dict[int, int]] = {}
    for rank, (node, local) in enumerate(layout):
        nodes.setdefault(node, {})[local] = rank
    sizes = {node: len(members) for node, members in sorted(nodes.items())}
    if len(set(sizes.values())) > 1:
        raise ConfigurationError(
            f"HYBRID_SHARD needs the same number of ranks on every node; ranks per node: {sizes}",
            "launch as many tasks on each node (srun --ntasks-per-node=K, mpiexec -ppn K), or "
            "give the mesh shape yourself: ParallelismConfig(dp_replicate_size=R, "
            "dp_shard_size=S) takes the ranks node by node and accepts nodes of different "
            "sizes (a shard group may then span nodes).",
        )
    return [[members[i] for i in range(len(members))] for _, members in sorted(nodes.items())]


def node_facts(partial: Any) -> tuple[list[tuple[int, int]], list[str]]:
    """Collective. Every rank's (node_index, local_process_index) and host, gathered over MPI."""
    mine = (partial.node_index, partial.local_process_index, partial.process_info.hostname)
    rows = partial.comm.allgather(mine, what="laying out the device mesh")
    return [(int(n), int(local)) for n, local, _ in rows], [str(h) for *_, h in rows]


def resolve_auto(partial: Any, parallelism_config: Any) -> None:
    """Collective: every rank calls this with the same config. Its "auto" sizes chosen from
    the job's nodes (strategy/layout.py's resolve_sizes) and written into it."""
    nodes_of, _ = node_facts(partial)
    with agreement(partial.comm, "choosing the mesh sizes", passing=(CollectiveError,)):
        counts = list(Counter(node for node, _ in nodes_of).values())
        resolved = resolve_sizes(
            parallelism_config.sizes(), len(nodes_of), len(counts), min(counts)
        )
        parallelism_config.set_sizes(resolved)


def plan_layout(partial: Any, parallelism_config: Any, fsdp: bool) -> MeshLayout:
    """Collective: every rank calls this with the same config. The N-D layout of
    `parallelism_config` (its "auto" sizes resolved: resolve_auto) over the job's nodes, groups
    checked (strategy/layout.py). With `fsdp`, a 'dp_shard' dimension is
    kept even at size 1 when no cp dimension exists, so that FSDP2 has one to shard over."""
    nodes_of, hosts = node_facts(partial)
    layout: MeshLayout | None = None
    with agreement(partial.comm, "laying out the device mesh", passing=(CollectiveError,)):
        sizes = parallelism_config.sizes()
        keep = (SHARD_DIM,) if fsdp and sizes["dp_shard"] == 1 and sizes["cp"] == 1 else ()
        layout = lay_out(
            sizes, nodes_of, hosts, keep=keep,
            across_nodes=envvars.get_bool("tp_across_nodes", False),
        )  # fmt: skip
    assert layout is not None
    return layout


def build_nd_mesh(partial: Any, parallelism_config: Any, fsdp: bool) -> DeviceMesh | None:
    """Collective: every rank calls this with the same config. The DeviceMesh of
    plan_layout, with Accelerate's flattened dimensions (dp, dp_shard_cp, dp_cp) where their
    parts exist; None for a layout of no dimension (one process, nothing to shard). The
    main process logs the mesh and the hosts of each group."""
    from torch.distributed.device_mesh import DeviceMesh

    layout = plan_layout(partial, parallelism_config, fsdp)
    if partial.is_main_process:
        logger.info("\n".join(layout.describe()))
    if not layout.names:
        return None
    if partial.num_processes == 1:
        partial.backend = distributed.init_world_of_one(partial.device, partial.backend)
    grid = torch.tensor(layout.ranks, dtype=torch.int).reshape(layout.shape)
    mesh = DeviceMesh(partial.device.type, grid, mesh_dim_names=layout.names)
    for name, parts in FLATTENED:
        present = tuple(p for p in parts if p in layout.names)
        if name == "dp_shard_cp" and SHARD_DIM in layout.names:
            present = present or (SHARD_DIM,)
        if present:
            mesh[present]._flatten(name)  # torch's own way to name a group of dimensions
    parallelism_config.device_mesh = mesh
    return mesh


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Not collective. The (sub-)mesh FSDP2 shards over: Accelerate's fsdp_dim_names
    ('dp_replicate' if present, then the flattened 'dp_shard_cp') of an N-D mesh; the mesh
    itself where it has no flattened dimension (the 1-D and HYBRID_SHARD meshes)."""
    names = tuple(mesh.mesh_dim_names or ())
    try:
        mesh["dp_shard_cp"]
    except (KeyError, RuntimeError, ValueError):  # no such (flattened) dimension
        return mesh
    dims = ((REPLICATE_DIM,) if REPLICATE_DIM in names else ()) + ("dp_shard_cp",)
    return mesh[dims]


def build_mesh(partial: Any, hybrid: bool, parallelism_config: Any) -> DeviceMesh:
    """Collective: every rank calls this, with the same `hybrid` and `parallelism_config`. The
    DeviceMesh models are sharded over, from the PartialState `partial`: parallelism_config's
    N-D mesh (build_nd_mesh, always with a dimension to shard over); else, with `hybrid`
    (HYBRID_SHARD), one shard group per node (from discovery's node_index and
    local_process_index, the MPI shared-memory split, gathered over MPI), replicated across
    nodes; else one dimension ('dp_shard') over every rank. A job of one process gets a
    process group of its own (FSDP needs one)."""
    from torch.distributed.device_mesh import DeviceMesh

    if parallelism_config is not None:
        mesh = build_nd_mesh(partial, parallelism_config, fsdp=True)
        assert mesh is not None  # fsdp keeps a dp_shard dimension
        return mesh
    if partial.num_processes == 1:
        partial.backend = distributed.init_world_of_one(partial.device, partial.backend)
    comm = partial.comm
    device_type = partial.device.type
    if hybrid:
        node = (partial.node_index, partial.local_process_index)
        layout = comm.allgather(node, what="building the hybrid sharding mesh")
        grid = torch.tensor(node_grid([tuple(x) for x in layout]), dtype=torch.int)
        return DeviceMesh(device_type, grid, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
    ranks = torch.arange(comm.size, dtype=torch.int)
    return DeviceMesh(device_type, ranks, mesh_dim_names=(SHARD_DIM,))
