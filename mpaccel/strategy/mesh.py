"""The device mesh models are sharded over, laid out from discovery's node facts: its shape from
a ParallelismConfig, else one shard group per node (HYBRID_SHARD), else one dimension over every
rank. A new parallel dimension (tensor parallelism) is one more named dimension here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import distributed
from ..comm import agreement
from ..errors import CollectiveError, ConfigurationError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"


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
            "dp_shard_size=S) shards over consecutive ranks.",
        )
    return [[members[i] for i in range(len(members))] for _, members in sorted(nodes.items())]


def build_mesh(partial: Any, hybrid: bool, parallelism_config: Any) -> DeviceMesh:
    """Collective: every rank calls this, with the same `hybrid` and `parallelism_config`. The
    DeviceMesh models are sharded over, from the PartialState `partial`. Its shape:
    parallelism_config's (replicate, shard), a 2-D ('dp_replicate', 'dp_shard') mesh of
    consecutive ranks; else, with `hybrid` (HYBRID_SHARD), one shard group per node (from
    discovery's node_index and local_process_index, the MPI shared-memory split, gathered over
    MPI), replicated across nodes; else one dimension ('dp_shard') over every rank. A job of
    one process gets a process group of its own (FSDP needs one)."""
    from torch.distributed.device_mesh import DeviceMesh

    if partial.num_processes == 1:
        partial.backend = distributed.init_world_of_one(partial.device, partial.backend)
    comm = partial.comm
    shape = None
    with agreement(comm, "building the FSDP device mesh", passing=(CollectiveError,)):
        if parallelism_config is not None:
            shape = (parallelism_config.dp_replicate_size, parallelism_config.dp_shard_size)
            if shape[0] * shape[1] != partial.num_processes:
                raise ConfigurationError(
                    f"ParallelismConfig(dp_replicate_size={shape[0]}, dp_shard_size={shape[1]}) "
                    f"makes a mesh of {shape[0] * shape[1]} ranks; the job has "
                    f"{partial.num_processes}",
                    "make dp_replicate_size * dp_shard_size the number of processes.",
                )
    device_type = partial.device.type
    if hybrid:
        node = (partial.node_index, partial.local_process_index)
        layout = comm.allgather(node, what="building the hybrid sharding mesh")
        grid = torch.tensor(node_grid([tuple(x) for x in layout]), dtype=torch.int)
    elif shape is not None:
        grid = torch.arange(comm.size, dtype=torch.int).reshape(shape)
    else:
        ranks = torch.arange(comm.size, dtype=torch.int)
        return DeviceMesh(device_type, ranks, mesh_dim_names=(SHARD_DIM,))
    return DeviceMesh(device_type, grid, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
