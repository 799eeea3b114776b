"""The index of a sharded save is built from slice entries gathered to rank 0 only: the other
ranks receive no one's entries (checkpoint/sharded.py, Comm.gather)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from mpaccel.checkpoint.sharded.save import save_sharded

pytestmark = pytest.mark.mpi_timeout(300)


class Received:
    """The real communicator, counting the pickled bytes each collective hands this rank that
    another rank contributed (its own object is not counted)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def _count(self, values: list) -> None:
        self.bytes += sum(len(pickle.dumps(v)) for v in values)

    def allgather(self, obj, what="allgather", timeout=None):
        out = self._comm.allgather(obj, what, timeout)
        self._count([v for r, v in enumerate(out) if r != self.rank])
        return out

    def gather(self, obj, root=0, what="gather", timeout=None):
        out = self._comm.gather(obj, root, what, timeout)
        if out is not None:
            self._count([v for r, v in enumerate(out) if r != self.rank])
        return out

    def bcast(self, obj, root=0, what="bcast", timeout=None):
        out = self._comm.bcast(obj, root, what, timeout)
        if self.rank != root:
            self._count([out])
        return out


def test_only_rank_0_receives_the_slice_entries(group, mpi_tmp_path):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(60)])
    for layer in model:
        fully_shard(layer)
    comm = Received(group)
    index = save_sharded(comm, mpi_tmp_path / "ckpt", {"model": model.state_dict()})
    assert index is not None and len(index["sliced"]) == 120
    entries = len(pickle.dumps(index["sliced"]))  # the index's slice entries: ~n x 120 x 130 B
    if group.rank == 0:
        assert comm.bytes > entries // 4 or group.size == 1  # the others' entries
    else:
        # a save id, the layout digests and the agreements' flags: no entries
        assert comm.bytes < 200 * group.size, (comm.bytes, entries)
    # every rank's index is the committed one (the others read it from the file)
    assert dict(index)["sliced"] == group.bcast(dict(index)["sliced"] if group.rank == 0 else None)
