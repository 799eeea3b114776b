"""Which ranks form which group of an N-D mesh, from the nodes discovery found: sizes left "auto"
chosen from the nodes, ranks ordered node by node so that a tensor- (and context-) parallel
group is consecutive ranks of one node, and a layout that would put one across nodes refused.
Pure (no torch, no MPI): `mpaccel env` shows the same layout the Accelerator builds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config.parallelism import AUTO, DIM_ORDER
from ..errors import ConfigurationError

#: the dimensions whose ranks must share a node (they exchange activations every layer)
INTRA_NODE = ("cp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """An N-D mesh over world ranks: `names` and `shape` of its dimensions (Accelerate's order),
    `ranks` the world ranks in row-major mesh order, `hosts[rank]` each rank's host."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]

    def coordinates(self, rank: int) -> dict[str, int]:
        """Not collective. `rank`'s index along each dimension."""
        flat = self.ranks.index(rank)
        out: dict[str, int] = {}
        for name, size in reversed(list(zip(self.names, self.shape))):
            flat, out[name] = divmod(flat, size)
        return out

    def groups(self, dims: Sequence[str]) -> list[list[int]]:
        """Not collective. The groups of ranks that differ only along `dims` (each group's
        ranks in mesh order)."""
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in self.ranks:
            where = self.coordinates(rank)
            key = tuple(where[n] for n in self.names if n not in dims)
            found.setdefault(key, []).append(rank)
        return list(found.values())

    def describe(self) -> list[str]:
        """Not collective. One line for the mesh, then one per dimension: its groups with the
        hosts they run on (for the log and `mpaccel env`)."""
        shape = " x ".join(f"{n}={s}" for n, s in zip(self.names, self.shape)) or "one process"
        lines = [f"mesh {shape} over {len(self.ranks)} ranks"]
        for name in self.names:
            parts = []
            for group in self.groups([name]):
                hosts = sorted({self.hosts[r] for r in group})
                parts.append(f"{group} on {', '.join(hosts)}")
            lines.append(f"  {name}: " + "; ".join(parts))
        return lines


def resolve_sizes(
    sizes: dict[str, int | str], world: int, nodes: int, per_node: int
) -> dict[str, int]:
    """Not collective. `sizes` (DIM_ORDER's names) with "auto" ones chosen for a job of `world`
    ranks on `nodes` nodes of `per_node` ranks: tp the ranks per node left by cp; then the
    data-parallel sizes from what remains: dp_replicate the number of nodes where that leaves
    dp_shard > 1 on each (HSDP across nodes), else 1; dp_shard the rest. A given size that
    does not divide what remains is a ConfigurationError."""
    out = dict(sizes)
    if out["tp"] == AUTO:
        out["tp"] = max(1, per_node // int(out["cp"]))
    fixed = math.prod(int(v) for v in out.values() if v != AUTO)
    if world % fixed:
        raise ConfigurationError(
            f"ParallelismConfig sizes {_shown(out)} do not divide the {world} processes",
            "make the product of the sizes the number of processes, or set the data-parallel "
            "sizes to 'auto'.",
        )
    left = world // fixed
    if out["dp_replicate"] == AUTO and out["dp_shard"] == AUTO:
        across = nodes if nodes > 1 and left % nodes == 0 and left // nodes > 1 else 1
        out["dp_replicate"], out["dp_shard"] = across, left // across
    elif out["dp_replicate"] == AUTO:
        out["dp_replicate"] = left
    elif out["dp_shard"] == AUTO:
        out["dp_shard"] = left
    return {name: int(out[name]) for name in DIM_ORDER}


def _shown(sizes: dict[str, int | str]) -> str:
    return ", ".join(f"{n}_size={v!r}" for n, v in sizes.items())


def lay_out(
    sizes: dict[str, int],
    nodes_of: Sequence[tuple[int, int]],
    hosts: Sequence[str],
    keep: Sequence[str] = (),
    across_nodes: bool = False,
) -> MeshLayout:
    """Not collective. The mesh of `sizes` over the world whose `nodes_of[rank] = (node_index,
    local_process_index)`, on `hosts[rank]`. Dimensions of size 1 are left out (as Accelerate
    builds its mesh) but for those in `keep`. Ranks are taken node by node, each node's in
    local order, so that consecutive mesh positions share a node (one node's ranks need not be
    consecutive world ranks). A tp or cp group that spans nodes is a ConfigurationError naming
    them, unless `across_nodes` (MPACCEL_TP_ACROSS_NODES)."""
    world = len(nodes_of)
    total = math.prod(sizes.values())
    if total != world:
        raise ConfigurationError(
            f"ParallelismConfig({_shown(dict(sizes))}) makes a mesh of {total} ranks; the job "
            f"has {world}",
            "make the product of the sizes the number of processes (or set sizes to 'auto').",
        )
    order = tuple(sorted(range(world), key=lambda r: (nodes_of[r][0], nodes_of[r][1])))
    names = tuple(n for n in DIM_ORDER if sizes[n] > 1 or n in keep)
    shape = tuple(sizes[n] for n in names)
    layout = MeshLayout(names, shape, order, tuple(hosts))
    inner = [n for n in names if n in INTRA_NODE]
    if inner and not across_nodes:
        for group in layout.groups(inner):
            spanned = sorted({nodes_of[r][0] for r in group})
            if len(spanned) > 1:
                named = ", ".join(
                    f"node {n} ({hosts[next(r for r in group if nodes_of[r][0] == n)]})"
                    for n in spanned
                )
                per_node = sum(1 for r in range(world) if nodes_of[r][0] == spanned[0])
                raise ConfigurationError(
                    f"the {'x'.join(inner)} group of ranks {group} would span {named}: "
                    f"{'tp' if 'tp' in inner else 'cp'} exchanges activations in every layer, "
                    "across the network it would crawl",
                    f"make tp_size * cp_size divide the ranks per node ({per_node}), e.g. "
                    f"tp_size={_largest_divisor(per_node, sizes['tp'])}, or launch as many "
                    "ranks on each node; to lay it across nodes anyway set "
                    "MPACCEL_TP_ACROSS_NODES=1.",
                )
    return layout


def _largest_divisor(limit: int, wanted: int) -> int:
    return max(d for d in range(1, max(1, min(limit, wanted)) + 1) if limit % d == 0)
