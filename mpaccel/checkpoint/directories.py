"""One directory for a collective save or load, even when the ranks pass different ones
(Accelerate's own tests give each rank a TemporaryDirectory): rank 0's, with a warning."""

from __future__ import annotations

import os
import warnings
from typing import Any

from ..errors import MpaccelRuntimeWarning


def agree_directory(comm: Any, path: Any, what: str, fact: Any = None) -> tuple[str, Any]:
    """Collective: (rank 0's directory, rank 0's `fact` about it), one all-gather. Ranks that
    passed another path warn, naming it and rank 0's (rank 0 warns naming every such rank):
    Accelerate writes the shared files from the main process into its directory, so rank 0's
    is the one that holds the checkpoint."""
    mine = os.path.abspath(os.fspath(path))
    everyone = comm.allgather((mine, fact), what)
    chosen, chosen_fact = everyone[0]
    others = {rank: p for rank, (p, _) in enumerate(everyone) if p != chosen}
    if others and (comm.rank == 0 or comm.rank in others):
        shown = others if comm.rank == 0 else {comm.rank: mine}
        listed = ", ".join(f"rank {rank} passed {p!r}" for rank, p in sorted(shown.items()))
        warnings.warn(
            f"{what}: the ranks passed different directories ({listed}; rank 0 passed "
            f"{chosen!r}): every rank uses rank 0's. Pass the same directory on every rank "
            "(on a file system they all see).",
            MpaccelRuntimeWarning,
            stacklevel=3,
        )
    return (os.fspath(path) if not others else chosen), chosen_fact
