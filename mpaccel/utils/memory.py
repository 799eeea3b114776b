"""Memory helpers with Accelerate's names: `release_memory` and `find_executable_batch_size`,
which retries a function with smaller batches after an out-of-memory error, every rank together."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..comm import agreement
from ..device import clear_device_cache as clear_device_cache
from ..device import release_memory as release_memory
from ..errors import ConfigurationError

# What torch's allocators say when memory runs out (CUDA/HIP/XPU, MPS, CPU, Gaudi), and cuDNN's
# failure on batches too large for it: the errors Accelerate retries with a smaller batch.
_OUT_OF_MEMORY = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True for the out-of-memory errors find_executable_batch_size retries."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(text in str(exception.args[0]) for text in _OUT_OF_MEMORY)
    return False


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable:
    """Collective: every rank must call the decorated function (decorating is not collective).
    Calls `function(batch_size, *args, **kwargs)` with `starting_batch_size`, and again with a
    smaller one while it fails with an out-of-memory error; `function` starts over each time
    (build the model and loaders inside it).

    After each attempt the ranks agree, over MPI, on its outcome: if any rank ran out of
    memory, every rank tries again with the same smaller batch size (the smallest any rank
    would use), so that no rank goes on alone into collectives the others left. Any other error
    ends the attempt on every rank (the same CollectiveError everywhere, naming the rank). A
    rank that runs out of memory inside a data-plane collective (DDP's all-reduce) leaves the
    others waiting there until the process group's timeout: out-of-memory errors usually
    strike every rank in the same forward pass, before the first all-reduce.

    Args:
        function: the function to decorate; None when used as
            `@find_executable_batch_size(starting_batch_size=...)`.
        starting_batch_size: the first batch size tried.
        reduce_batch_size_fn: called (on every rank) for the next batch size after an
            out-of-memory error; default: 0.9 times the last one.

    Raises:
        ConfigurationError: when the batch size reaches 0 (nothing fits in memory).
        CollectiveError: on every rank, when an attempt failed on any rank with another error.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def smaller() -> int:
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn or smaller

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        from ..state import PartialState

        comm = PartialState().comm
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{p}={a!r}" for p, a in zip(params[1:], args[1:]))
            raise TypeError(
                f"batch_size was passed to {function.__name__}() as its first argument; the "
                f"decorator passes it itself: call {function.__name__}({passed})"
            )
        clear_device_cache(garbage_collection=True)
        while True:
            if batch_size <= 0:
                raise ConfigurationError(
                    f"{function.__name__}: no batch size fits in memory, down to "
                    f"{batch_size!r} from {starting_batch_size!r}",
                    "free memory (a smaller model, gradient checkpointing, mixed precision) "
                    "or start from a batch size that fits.",
                )
            out_of_memory = False
            result = None
            what = f"find_executable_batch_size({function.__name__}, batch_size={batch_size})"
            with agreement(comm, what):
                try:
                    result = function(batch_size, *args, **kwargs)
                except Exception as exc:
                    if not should_reduce_batch_size(exc):
                        raise
                    out_of_memory = True
            retry = comm.allreduce(int(out_of_memory), "max", what)
            if not retry:
                return result
            clear_device_cache(garbage_collection=True)
            batch_size = comm.allreduce(reduce(), "min", what)

    return decorator
