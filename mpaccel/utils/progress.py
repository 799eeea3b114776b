"""`tqdm` with Accelerate's module path (`mpaccel.utils.tqdm`): one progress bar per node."""

from __future__ import annotations

from typing import Any


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """tqdm.auto.tqdm(*args, **kwargs), shown only on each node's local main process when
    `main_process_only` (the others get a disabled bar: same iteration, no output). Needs the
    `tqdm` package (`pip install tqdm`, or mpaccel's `examples` extra)."""
    try:
        from tqdm.auto import tqdm as progress_bar
    except ImportError as exc:
        raise ImportError(
            "mpaccel.utils.tqdm needs the tqdm package: pip install tqdm"
        ) from exc
    if args and isinstance(args[0], bool):
        raise ValueError(
            "tqdm(True/False, ...): pass main_process_only= as a keyword; the first argument is "
            "the iterable"
        )
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        from ..state import PartialState

        disable = PartialState().local_process_index != 0
    return progress_bar(*args, disable=disable, **kwargs)
