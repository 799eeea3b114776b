"""`accelerate.test_utils.testing`: the helpers the scripts use, nothing more."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mpaccel.state import PartialState
from mpaccel.utils import gather

# These machines have no GPU; a CUDA device would be named "cuda".
torch_device = "cuda" if torch.cuda.is_available() else "cpu"


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Collective: True on every rank when every rank holds an equal `tensor`."""
    mine = tensor.detach().clone().to(PartialState().device)
    everyone = gather(mine[None]).cpu()
    return all(torch.equal(other, mine.cpu()) for other in everyone)


@contextlib.contextmanager
def assert_exception(
    exception_class: type[BaseException], msg: str | None = None
) -> Iterator[None]:
    """The block must raise `exception_class` (whose text contains `msg`, when given)."""
    try:
        yield
    except Exception as exc:
        assert isinstance(exc, exception_class), (
            f"expected {exception_class.__name__}, got {type(exc).__name__}: {exc}"
        )
        assert msg is None or msg in str(exc), f"{msg!r} is not in {str(exc)!r}"
    else:
        raise AssertionError(f"expected {exception_class.__name__}; nothing was raised")
