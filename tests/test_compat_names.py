"""Names and behaviours Accelerate scripts rely on beyond the training loop: enums, availability
helpers, memory helpers, nested-structure helpers, the state objects' attributes, pickling and
reset, save/load pre-hooks, refused plugins, and Accelerate's signatures."""

from __future__ import annotations

import pickle

import pytest
import torch

from mpaccel import Accelerator
from mpaccel.errors import CollectiveError
from mpaccel.testing import reset_state


@pytest.mark.mpi(min_size=2)
def test_shape_mismatches_raise_distributed_operation_exception(comm):
    """Accelerate's test_op_checker: shapes that cannot be combined raise its
    DistributedOperationException (on every rank), which is also a CollectiveError here."""
    from mpaccel.errors import DistributedOperationException as Raised
    from mpaccel.utils import broadcast, pad_across_processes, reduce
    from mpaccel.utils.operations import DistributedOperationException

    assert DistributedOperationException is Raised
    reset_state()
    acc = Accelerator()
    if comm.rank == 0:
        data = {"tensor": torch.tensor([[0.0, 1, 2, 3, 4]])}
    else:
        data = {"tensor": torch.tensor([[[0.0, 1, 2, 3, 4, 5]]])}
    for call in (lambda: pad_across_processes(data, dim=0), lambda: reduce(data),
                 lambda: broadcast(data), lambda: acc.gather(data)):
        with pytest.raises(DistributedOperationException) as info:
            call()
        assert isinstance(info.value, CollectiveError) and isinstance(info.value, ValueError)
        assert "rank 0: (1, 5)" in str(info.value)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is DistributedOperationException and str(copy) == str(info.value)
    acc.wait_for_everyone()  # still in step
