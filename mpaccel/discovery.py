"""Process discovery: launcher variables (read before MPI_Init) + MPI communicator -> ProcessInfo.

Every rank computes the same verdict from the same gathered facts, so a launch mistake raises the
same LaunchError everywhere, with no extra collective and no hang.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import envvars
from .comm import Comm, MPIComm, NullComm
from .environments import (
    Launcher,
    ProcessInfo,
    SingleProcess,
    SlurmFacts,
    detect_launcher,
    layout_from_node_keys,
)
from .environments.mpi import check_pmix_before_init
from .errors import ConfigurationError, LaunchError, MpaccelError, MpaccelRuntimeWarning


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
    # this rank's fair share of the CPUs it may run on (core_share; a process alone: unused)
    cpu_share: int = 1


def import_mpi() -> Any:
    """Import mpi4py.MPI *without* MPI_Init (init_mpi does that).

    The library is then known before MPI_Init: with the wrong launcher, MPI_Init itself can abort
    the process before any check could explain why (check_pmix_before_init). mpi4py.rc decides
    at import whether mpi4py initialises MPI, and whether it finalises it at exit; a module
    imported earlier (MPI already initialised by then) is returned as it is. Raises ImportError
    (no mpi4py) or RuntimeError (mpi4py 4: no libmpi it can load).
    """
    import mpi4py

    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        return MPI
    rc = mpi4py.rc
    saved = rc.initialize, rc.finalize
    # finalize=None means "if initialised at import": keep mpi4py's MPI_Finalize at exit
    rc.initialize, rc.finalize = False, True if rc.finalize is None else rc.finalize
    try:
        from mpi4py import MPI
    finally:
        rc.initialize, rc.finalize = saved
    return MPI


def check_mpi_loaded(launcher: Launcher, missing: Exception) -> None:
    """mpi4py could not load an MPI library (`missing` says why): fine for one process, a
    LaunchError when `launcher` started several."""
    expected = launcher.expected_world_size()
    if not expected or expected == 1:
        return
    raise LaunchError(
        f"{launcher.name} started {expected} processes but mpi4py cannot load an MPI "
        f"library: {missing}",
        "install one into the environment (`pip install mpaccel[mpich]` or "
        "`pip install mpich`), or point mpi4py at the cluster's: MPI4PY_LIBMPI=/path/to/"
        "libmpi.so (`module load` the MPI your mpiexec belongs to).",
    ) from missing


def init_mpi(MPI: Any) -> None:
    """MPI_Init_thread at the thread level mpi4py would have asked for at import (mpi4py.rc)."""
    if MPI.Is_initialized():
        return
    import mpi4py

    if not mpi4py.rc.threads:
        MPI.Init()
        return
    level = str(mpi4py.rc.thread_level).upper()
    MPI.Init_thread(getattr(MPI, f"THREAD_{level}", MPI.THREAD_MULTIPLE))


def check_world_size(launcher: Launcher, size: int, mpi_library: str) -> None:
    """The launcher's own count against the MPI world: a world of 1 in each process (the
    launcher and the library do not talk to each other) or another size (the launcher's
    variables describe another launch)."""
    expected = launcher.expected_world_size()
    if expected is None or expected == size:
        return
    said = f"{launcher.size_variable()}={expected}"
    if size == 1:
        raise LaunchError(
            f"{launcher.name} started {expected} processes ({said}), but MPI sees a world of 1 "
            f"in each: {expected} separate copies of the job are running (silent singletons)",
            launcher.singleton_hint(mpi_library),
        )
    raise LaunchError(
        f"{launcher.name} says the job has {expected} processes ({said}), but MPI sees a "
        f"world of {size}",
        launcher.mismatch_hint(mpi_library),
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


@dataclass(frozen=True)
class _LaunchVariables:
    """Everything discover() reads from the environment, parsed before MPI_Init."""

    slurm: SlurmFacts
    launcher: Launcher
    skip_checks: bool
    progress_ms: float | None

    @classmethod
    def parse(cls, env: envvars.Snapshot, mpi_library: str | None) -> _LaunchVariables:
        """`mpi_library`: what mpi4py loaded (None: no library), which decides between the
        variables of two MPI launchers."""
        envvars.check(env)  # every variable of the table, whoever reads it later
        launcher = detect_launcher(env, mpi_library)
        launcher.expected_world_size()  # parses the launcher's count now, not after MPI_Init
        return cls(
            SlurmFacts.from_env(env),
            launcher,
            envvars.get_bool("skip_launch_checks", False, env),
            envvars.get_float("mpi_progress", env),
        )


class RankFacts(NamedTuple):
    """What each rank tells the others in discovery's one gather."""

    node_key: Hashable  # the launcher's name for this rank's node, else its shared memory's
    host: str
    slurm: SlurmFacts
    cores: frozenset[int]  # the CPUs this rank may run on
    problem: MpaccelError | None  # this rank's launch or configuration mistake


def core_share(keys: Sequence[Any], cores: Sequence[frozenset[int]], rank: int) -> int:
    """How many of `rank`'s CPUs are its own: each CPU it may use counts 1/k when k ranks of its
    node may use it. Ranks bound to CPUs of their own (srun --cpu-bind, --cpus-per-task) keep
    all of theirs; unbound ranks split the node's CPUs evenly. At least 1."""
    mine = [r for r, key in enumerate(keys) if key == keys[rank]]
    share = sum(1 / sum(cpu in cores[r] for r in mine) for cpu in cores[rank])
    return max(1, int(share + 1e-9))


def discover(
    default_timeout: float = 1800.0,
    env: envvars.Snapshot | None = None,
    problem: MpaccelError | None = None,
) -> Discovery:
    """Collective over COMM_WORLD: every process of the job must call this, once.

    In this order: the MPI library is loaded without MPI_Init; the environment's variables
    are checked, and the launcher detected, once, knowing the library; a PMIx launcher is
    checked against the library; MPI_Init; the launcher's count against the world's size; one
    gather of every rank's RankFacts; then the launcher's own checks (Launcher.check_layout)
    and warnings (leftover_notes, allocation_notes). MPACCEL_SKIP_LAUNCH_CHECKS skips the
    checks, not the warnings.

    A malformed variable on some ranks only is raised on every rank once MPI is up: raised
    before MPI_Init on those ranks alone, it would leave the others waiting in MPI_Init.
    `problem` is such an error the caller found (a malformed setting of its own).
    """
    env = envvars.snapshot() if env is None else env
    host = socket.gethostname()
    MPI: Any = None
    missing: Exception | None = None
    try:
        MPI = import_mpi()
    except (ImportError, RuntimeError) as exc:  # no libmpi (mpi4py 4 raises RuntimeError)
        missing = exc
    library = None if MPI is None else MPI.Get_library_version().strip()  # before MPI_Init too
    parsed: _LaunchVariables | None = None
    try:
        parsed = _LaunchVariables.parse(env, library)
    except (ConfigurationError, LaunchError) as exc:
        problem = problem or exc
    launcher = parsed.launcher if parsed else SingleProcess(env)
    if MPI is None:
        assert missing is not None
        check_mpi_loaded(launcher, missing)
        if problem is not None:
            raise problem
        assert parsed is not None
        comm: Comm = NullComm(host, default_timeout)
        return Discovery(
            ProcessInfo.single(host), launcher, comm, "no MPI library", None,
            parsed.slurm, (host,),
        )
    assert library is not None
    version = MPI.Get_version()
    notes = launcher.leftover_notes(library)
    skip = parsed.skip_checks if parsed else False
    if not skip and not MPI.Is_initialized():
        try:
            check_pmix_before_init(launcher, env, library)
        except (LaunchError, ConfigurationError):
            if problem is not None:  # MPI_Init would abort: this rank's own mistake first
                raise problem from None
            raise
    init_mpi(MPI)
    world = MPI.COMM_WORLD
    if not skip and problem is None:
        try:
            check_world_size(launcher, world.Get_size(), library)
        except LaunchError as exc:
            problem = exc
    slurm = parsed.slurm if parsed else SlurmFacts()
    if world.Get_size() == 1:
        if problem is not None:
            raise problem
        comm = NullComm(host, default_timeout)
        notes += launcher.allocation_notes(slurm, 1, 1 if slurm.nodename else None)
        return Discovery(
            ProcessInfo.single(host), launcher, comm, library, version, slurm, (host,), tuple(notes)
        )

    # The job's communicator is made once its settings are known (hosts, oversubscription):
    # the facts are gathered on a communicator of discovery's own, freed afterwards.
    gathering = MPIComm(world, default_timeout, interruptible=False)
    # Every rank splits, whatever its launcher says, so that the collectives are the same on
    # every rank even when one of them could not read its variables.
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    shm_key = ("shm", local.allreduce(world.Get_rank(), op=MPI.MIN))
    local.Free()
    key = launcher.node_key() if parsed else None
    # A rank's own launcher variables may disagree with the others' (a hand-made value): the
    # verdict is taken from everyone's, so every rank raises the same error and none waits.
    mine = RankFacts(shm_key if key is None else key, host, slurm, _cores(), problem)
    gathered: list[RankFacts] = gathering.allgather(mine, what="process discovery")
    gathering.free()
    failed = [r for r, g in enumerate(gathered) if g.problem is not None]
    if failed:
        first = gathered[failed[0]].problem
        assert first is not None
        raise _named(first, failed, len(gathered), [g.host for g in gathered])
    assert parsed is not None  # else this rank's problem was raised above
    progress = parsed.progress_ms
    keys = [g.node_key for g in gathered]
    hosts = tuple(g.host for g in gathered)
    cores = [g.cores for g in gathered]
    rank = gathering.rank
    mpi_comm = MPIComm(
        world,
        default_timeout,
        hosts=hosts,
        oversubscribed=node_oversubscribed(keys, cores, rank),
        progress_interval=progress / 1000.0 if progress is not None and progress > 0 else None,
    )
    info = layout_from_node_keys(keys, rank, host)
    share = core_share(keys, cores, rank)
    facts = [g.slurm for g in gathered]
    if not skip:
        launcher.check_layout(facts, keys, hosts)
    names = {f.nodename for f in facts}
    nodes = None if None in names else len(names)
    notes += launcher.allocation_notes(slurm, mpi_comm.size, nodes)
    return Discovery(
        info, launcher, mpi_comm, library, version, slurm, hosts, tuple(notes), share
    )


def _named(
    problem: MpaccelError, failed: list[int], size: int, hosts: list[str]
) -> MpaccelError:
    """The first failing rank's error, raised on every rank: named by rank and host when only
    some ranks have it (everyone's own variables are then not to blame)."""
    if len(failed) == size:
        return problem
    where = ", ".join(f"{r} ({hosts[r]})" for r in failed[:8])
    more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
    return type(problem)(f"on rank {where}{more} only: {problem.message}", problem.hint)


def emit_warnings(discovery: Discovery) -> None:
    if discovery.info.is_main_process:
        for note in discovery.warnings:
            warnings.warn(note, MpaccelRuntimeWarning, stacklevel=3)


# -- once per process ----------------------------------------------------------------------
# PartialState and the pytest plugin share the job's Discovery through these. They live here,
# not in state.py, so that a process that only needs discovery (the plugin of a test session
# under mpiexec, a control-only script) does not import torch: 1.0-1.4 s of CPU per rank.

DEFAULT_TIMEOUT = 1800.0  # seconds, like torch.distributed's default; MPACCEL_TIMEOUT overrides

_discovery: Discovery | None = None


def discover_once(timeout: float, problem: MpaccelError | None = None) -> Discovery:
    """Collective the first time (every rank must call it): the job's Discovery, made once per
    process and kept across `_reset_state()`; later calls return it without communicating.

    Args:
        timeout: seconds the discovery's collectives may wait for the other ranks.
        problem: this rank's own error, raised on every rank once MPI is up (see
            `discovery.discover`), so that no rank is left waiting in MPI_Init.

    Raises:
        MpaccelError: `problem`, or what discovery found wrong with the launch.
    """
    global _discovery
    if _discovery is None:
        _discovery = discover(timeout, problem=problem)
        emit_warnings(_discovery)
    elif problem is not None:
        raise problem
    return _discovery


def discovered() -> Discovery | None:
    """Not collective. The job's Discovery if `discover_once` has run in this process, else None."""
    return _discovery
