"""What every launcher environment provides: the immutable process facts and one small interface."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..envvars import Snapshot

if TYPE_CHECKING:
    from .slurm_facts import SlurmFacts


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job. Computed once, from the MPI communicator."""

    process_index: int
    num_processes: int
    local_process_index: int
    local_num_processes: int
    node_index: int
    num_nodes: int
    hostname: str

    def __post_init__(self) -> None:
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"process_index {self.process_index} not in [0, {self.num_processes})")
        if not 0 <= self.local_process_index < self.local_num_processes:
            raise ValueError(
                f"local_process_index {self.local_process_index} not in "
                f"[0, {self.local_num_processes})"
            )
        if not 0 <= self.node_index < self.num_nodes:
            raise ValueError(f"node_index {self.node_index} not in [0, {self.num_nodes})")

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @classmethod
    def single(cls, hostname: str) -> ProcessInfo:
        return cls(0, 1, 0, 1, 0, 1, hostname)


def layout_from_node_keys(keys: Sequence[Hashable], rank: int, hostname: str) -> ProcessInfo:
    """ProcessInfo of `rank` given every rank's node key (same key = same node).

    Nodes are numbered by the lowest rank they hold; local ranks follow world rank order within
    a node. Pure function: discovery gathers the keys, tests feed synthetic ones.
    """
    first_rank: dict[Hashable, int] = {}
    members: dict[Hashable, list[int]] = {}
    for r, key in enumerate(keys):
        first_rank.setdefault(key, r)
        members.setdefault(key, []).append(r)
    node_order = sorted(first_rank, key=first_rank.__getitem__)
    mine = keys[rank]
    return ProcessInfo(
        process_index=rank,
        num_processes=len(keys),
        local_process_index=members[mine].index(rank),
        local_num_processes=len(members[mine]),
        node_index=node_order.index(mine),
        num_nodes=len(node_order),
        hostname=hostname,
    )


def mpi_family(library_version: str) -> str:
    """'mpich', 'openmpi', 'intel', 'mvapich' or 'unknown', from MPI_Get_library_version()."""
    text = library_version.lower()
    if "open mpi" in text:
        return "openmpi"
    if "intel" in text:
        return "intel"
    if "mvapich" in text:
        return "mvapich"
    if "mpich" in text:
        return "mpich"
    return "unknown"


class Launcher:
    """One way a job gets started (mpiexec of some MPI, srun, plain python).

    Subclasses answer from an environment snapshot taken before MPI_Init; they never write it.
    Their launch checks are the methods below the hints: discover() calls each of them on
    every rank, for whichever launcher it detected, and a launcher overrides those it has
    something to check; the defaults find nothing. (The checks every launcher shares, the
    world's size against expected_world_size() and a PMIx launcher before MPI_Init, are
    discovery's own.)
    """


    name = "unknown"
    # The MPI library families (mpi_family) whose launcher this is; empty: not an MPI library's.
    families: tuple[str, ...] = ()

    @classmethod
    def detect(cls, env: Snapshot) -> bool:
        raise NotImplementedError

    def __init__(self, env: Snapshot) -> None:
        self.env = env

    def expected_world_size(self) -> int | None:
        """How many processes this launcher started, by its own account (None: it does not say)."""
        return None

    def size_variable(self) -> str | None:
        """The variable expected_world_size() comes from (for messages)."""
        return None

    def node_key(self) -> Hashable | None:
        """A key naming this process's node when the launcher is more reliable than shared memory
        (None: group by MPI shared-memory domain)."""
        return None

    def singleton_hint(self, mpi_library: str) -> str:
        """What to change when the launcher started N processes but MPI sees a world of 1."""
        return (
            "the launcher and the MPI library mpi4py loaded do not talk to each other; launch with "
            "the mpiexec that belongs to the MPI library mpi4py uses (see `mpaccel env`)."
        )

    def mismatch_hint(self, mpi_library: str) -> str:
        """What to change when the launcher's count and an MPI world larger than 1 disagree."""
        return (
            f"{self.size_variable()} does not describe this MPI world: it was inherited from "
            "another launch (a launcher started inside another one's ranks, such as an mpiexec "
            "inside srun or inside another mpiexec), or exported by hand. Start the ranks with one "
            "launcher, and do not export a launcher's variables yourself."
        )

    def leftover_notes(self, mpi_library: str) -> list[str]:
        """Warnings for variables that another launch left in this process's environment,
        once the MPI library is known."""
        return []

    def check_layout(
        self, slurm: Sequence[SlurmFacts], keys: Sequence[Hashable], hosts: Sequence[str]
    ) -> None:
        """Raise LaunchError when every rank's facts (`slurm[r]`, node key `keys[r]` and host
        `hosts[r]` of rank r, gathered by discovery) contradict how this launcher placed the
        ranks. The same facts on every rank: every rank raises the same error."""

    def allocation_notes(
        self, slurm: SlurmFacts, world: int, nodes: int | None = None
    ) -> list[str]:
        """Warnings for a Slurm allocation that this launch of `world` processes (on `nodes`
        Slurm nodes, if known) leaves partly idle or overfills."""
        return []
