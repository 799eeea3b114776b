"""The N-D layout from the nodes (strategy/layout.py): pure, one process."""

from __future__ import annotations

import pytest

from mpaccel.errors import ConfigurationError
from mpaccel.strategy.layout import lay_out, resolve_sizes

TWO_BY_TWO = [(0, 0), (0, 1), (1, 0), (1, 1)]  # srun -N 2 -n 4: node, local rank
HOSTS = ["n1", "n1", "n2", "n2"]


def _sizes(**given):
    return {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **given}


def test_tp_groups_are_consecutive_ranks_of_one_node():
    layout = lay_out(_sizes(dp_shard=2, tp=2), TWO_BY_TWO, HOSTS)
    assert layout.names == ("dp_shard", "tp") and layout.shape == (2, 2)
    assert layout.groups(["tp"]) == [[0, 1], [2, 3]]
    assert layout.groups(["dp_shard"]) == [[0, 2], [1, 3]]
    assert layout.describe() == [
        "mesh dp_shard=2 x tp=2 over 4 ranks",
        "  dp_shard: [0, 2] on n1, n2; [1, 3] on n1, n2",
        "  tp: [0, 1] on n1; [2, 3] on n2",
    ]


def test_round_robin_ranks_still_group_by_node():
    # ranks 0 and 2 on node 0, 1 and 3 on node 1 (mpiexec's round-robin placement)
    nodes = [(0, 0), (1, 0), (0, 1), (1, 1)]
    layout = lay_out(_sizes(dp_shard=2, tp=2), nodes, ["a", "b", "a", "b"])
    assert layout.groups(["tp"]) == [[0, 2], [1, 3]]
    assert layout.coordinates(2) == {"dp_shard": 0, "tp": 1}


def test_a_tp_group_across_nodes_is_refused_naming_them_unless_asked():
    with pytest.raises(ConfigurationError, match=r"(?s)node 0 \(n1\), node 1 \(n2\).*"
                       r"tp_size=2.*MPACCEL_TP_ACROSS_NODES=1"):
        lay_out(_sizes(tp=4), TWO_BY_TWO, HOSTS)
    layout = lay_out(_sizes(tp=4), TWO_BY_TWO, HOSTS, across_nodes=True)
    assert layout.groups(["tp"]) == [[0, 1, 2, 3]]


def test_sizes_must_multiply_to_the_world_and_size_one_dims_are_left_out():
    with pytest.raises(ConfigurationError, match="makes a mesh of 8 ranks; the job has 4"):
        lay_out(_sizes(dp_shard=4, tp=2), TWO_BY_TWO, HOSTS)
    assert lay_out(_sizes(tp=2, dp_shard=2), TWO_BY_TWO, HOSTS, keep=()).names == (
        "dp_shard", "tp")
    assert lay_out(_sizes(tp=2, dp_replicate=2), TWO_BY_TWO, HOSTS, keep=("dp_shard",)).names \
        == ("dp_replicate", "dp_shard", "tp")
    assert lay_out(_sizes(), [(0, 0)], ["h"]).names == ()


def test_auto_sizes_come_from_the_nodes():
    auto = "auto"
    # 2 nodes x 2 ranks: tp inside each node, dp across (sharded: replicas of one would be DDP)
    assert resolve_sizes(_sizes(tp=auto, dp_replicate=auto, dp_shard=auto), 4, 2, 2) == _sizes(
        tp=2, dp_shard=2)
    # 2 nodes x 4 ranks with tp=2: HSDP, one replica per node
    assert resolve_sizes(_sizes(tp=2, dp_replicate=auto, dp_shard=auto), 8, 2, 4) == _sizes(
        tp=2, dp_replicate=2, dp_shard=2)
    assert resolve_sizes(_sizes(tp=auto, dp_shard=auto), 4, 1, 4) == _sizes(tp=4)
    with pytest.raises(ConfigurationError, match="do not divide the 4 processes"):
        resolve_sizes(_sizes(tp=3, dp_shard=auto), 4, 1, 4)


def test_mpaccel_env_shows_the_mesh_the_variables_ask_for():
    from mpaccel.cli import mesh_facts

    rows = [{"node": n, "local_rank": lr, "host": h} for (n, lr), h in zip(TWO_BY_TWO, HOSTS)]
    assert mesh_facts(rows, {}) is None
    lines = mesh_facts(rows, {"PARALLELISM_CONFIG_TP_SIZE": "auto",
                              "PARALLELISM_CONFIG_DP_SHARD_SIZE": "auto"})
    assert lines[-1] == "  tp: [0, 1] on n1; [2, 3] on n2"
    (refused,) = mesh_facts(rows, {"PARALLELISM_CONFIG_TP_SIZE": "4"})
    assert refused.startswith("not possible:") and "MPACCEL_TP_ACROSS_NODES" in refused
