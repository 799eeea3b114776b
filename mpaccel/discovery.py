"""Process discovery: launcher variables (read before MPI_Init) + MPI communicator -> ProcessInfo.

Every rank computes the same verdict from the same gathered facts, so a launch mistake raises the
same LaunchError everywhere, with no extra collective and no hang.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _env
from .comm import Comm, MPIComm, NullComm
from .environments import (
    Launcher,
    ProcessInfo,
    SingleProcess,
    SlurmFacts,
    SrunLauncher,
    detect_launcher,
    layout_from_node_keys,
)
from .environments.slurm import allocation_warnings, check_srun_layout
from .errors import LaunchError


@dataclass(frozen=True)
class Discovery:
    info: ProcessInfo
    launcher: Launcher
    comm: Comm
    mpi_library: str
    mpi_version: tuple[int, int] | None
    slurm: SlurmFacts
    hosts: tuple[str, ...]
    warnings: tuple[str, ...] = field(default=())


def load_mpi(launcher: Launcher) -> Any | None:
    """Import mpi4py.MPI (this calls MPI_Init); None when there is no MPI and none is needed."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:  # no libmpi (mpi4py 4 raises RuntimeError)
        expected = launcher.expected_world_size()
        if isinstance(launcher, SingleProcess) or not expected or expected == 1:
            return None
        raise LaunchError(
            f"{launcher.name} started {expected} processes but mpi4py cannot load an MPI "
            f"library: {exc}",
            "install one into the environment (`pip install mpaccel[mpich]` or "
            "`pip install mpich`), or point mpi4py at the cluster's: MPI4PY_LIBMPI=/path/to/"
            "libmpi.so (`module load` the MPI your mpiexec belongs to).",
        ) from exc
    return MPI


def check_world_size(launcher: Launcher, size: int, mpi_library: str) -> None:
    expected = launcher.expected_world_size()
    if expected is None or expected == size:
        return
    if size == 1:
        raise LaunchError(
            f"{launcher.name} started {expected} processes, but MPI sees a world of 1 in each: "
            f"{expected} separate copies of the job are running (silent singletons)",
            launcher.singleton_hint(mpi_library),
        )
    raise LaunchError(
        f"{launcher.name} says the job has {expected} processes, but MPI sees {size}",
        launcher.singleton_hint(mpi_library),
    )


def _cores() -> frozenset[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def node_oversubscribed(keys: Sequence[Any], cores: Sequence[frozenset[int]], rank: int) -> bool:
    """Whether `rank`'s node runs more of the job's processes than the CPUs they may use
    together (the union of their affinities: ranks bound one per core are not oversubscribed)."""
    mine = [r for r, key in enumerate(keys) if key == keys[rank]]
    usable: set[int] = set()
    for r in mine:
        usable |= cores[r]
    return len(mine) > len(usable)


def discover(default_timeout: float = 1800.0, env: _env.Snapshot | None = None) -> Discovery:
    """Collective over COMM_WORLD: every process of the job must call this, once."""
    env = _env.snapshot() if env is None else env
    launcher = detect_launcher(env)
    slurm = SlurmFacts.from_env(env)
    host = socket.gethostname()
    MPI = load_mpi(launcher)
    if MPI is None:
        comm: Comm = NullComm(host, default_timeout)
        return Discovery(
            ProcessInfo.single(host), launcher, comm, "no MPI library", None, slurm, (host,)
        )
    library = MPI.Get_library_version().strip()
    version = MPI.Get_version()
    world = MPI.COMM_WORLD
    skip = _env.get_bool("skip_launch_checks", False, env)
    if not skip:
        check_world_size(launcher, world.Get_size(), library)
    if world.Get_size() == 1:
        comm = NullComm(host, default_timeout)
        notes = allocation_warnings(slurm, launcher, 1)
        return Discovery(
            ProcessInfo.single(host), launcher, comm, library, version, slurm, (host,), tuple(notes)
        )

    mpi_comm = MPIComm(world, default_timeout)
    progress_ms = _env.get_float("mpi_progress", env)
    if progress_ms is not None and progress_ms > 0:
        mpi_comm.keep_progressing(progress_ms / 1000.0)
    key = launcher.node_key()
    if key is None:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        key = ("shm", local.allreduce(world.Get_rank(), op=MPI.MIN))
        local.Free()
    gathered = mpi_comm.allgather((key, host, slurm, _cores()), what="process discovery")
    keys = [g[0] for g in gathered]
    hosts = tuple(g[1] for g in gathered)
    mpi_comm.hosts = hosts
    rank = mpi_comm.rank
    if node_oversubscribed(keys, [g[3] for g in gathered], rank):
        mpi_comm.oversubscribed()
    info = layout_from_node_keys(keys, rank, host)
    if not skip and isinstance(launcher, SrunLauncher):
        infos = [layout_from_node_keys(keys, r, hosts[r]) for r in range(len(keys))]
        check_srun_layout([g[2] for g in gathered], infos)
    notes = allocation_warnings(slurm, launcher, mpi_comm.size)
    return Discovery(info, launcher, mpi_comm, library, version, slurm, hosts, tuple(notes))


def emit_warnings(discovery: Discovery) -> None:
    if discovery.info.is_main_process:
        for note in discovery.warnings:
            warnings.warn(note, RuntimeWarning, stacklevel=3)
