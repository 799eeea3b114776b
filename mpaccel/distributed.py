"""The data plane's bootstrap and teardown: torch.distributed, rendezvous brokered over MPI.

The only module that initialises torch.distributed; besides it, only mpaccel/strategy/ imports
torch.distributed's APIs (FSDP2, DeviceMesh, DTensor), and checkpoint/ reads DTensors. Rank 0
opens a TCPStore on a port the kernel picks (no MASTER_PORT race), broadcasts its address over
MPI, and every rank joins with its MPI rank and size. No MASTER_ADDR, no torchrun.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import envvars, lifecycle
from .comm import Comm, agreement
from .environments import ProcessInfo
from .errors import ConfigurationError, LaunchError

_SIOCGIFADDR = 0x8915


def interface_address(ifname: str) -> str:
    """IPv4 address of a network interface (Linux), e.g. 'ib0' -> '10.1.2.3'."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(
                s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode())
            )
        except OSError as exc:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise LaunchError(
                f"MPACCEL_IFNAME={ifname!r} has no IPv4 address on {socket.gethostname()}: {exc}",
                f"pick one of this host's interfaces: {names}",
            ) from exc
    return socket.inet_ntoa(packed[20:24])


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def routable_address() -> str:
    """This host's address as other nodes should reach it: the hostname's address unless that is
    loopback (a common /etc/hosts setup), then the first non-loopback interface."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    if not _is_loopback(address):
        return address
    for _, name in socket.if_nameindex():
        try:
            candidate = interface_address(name)
        except LaunchError:
            continue
        if not _is_loopback(candidate):
            return candidate
    return address


def address_override(env: envvars.Snapshot | None = None) -> tuple[str, str] | None:
    """(logical name, value) of the variable that decides rank 0's address, MPACCEL_MASTER_ADDR
    before MPACCEL_IFNAME; None when neither is set."""
    for logical in ("master_addr", "ifname"):
        value = envvars.get(logical, env)
        if value:
            return logical, value
    return None


def choose_master_addr(info: ProcessInfo, env: envvars.Snapshot | None = None) -> str:
    """Address rank 0 listens on: MPACCEL_MASTER_ADDR, else MPACCEL_IFNAME's, else loopback for a
    single node, else this host's routable address."""
    override = address_override(env)
    if override is not None:
        logical, value = override
        return value if logical == "master_addr" else interface_address(value)
    if info.num_nodes == 1:
        return "127.0.0.1"
    return routable_address()


def check_master_addr(address: str) -> None:
    """Not collective; rank 0, before it opens its store: MPACCEL_MASTER_ADDR=`address` must
    resolve, and to an address of this host (one rank 0 can listen on). Unchecked, the store's
    own client retries such an address for longer than the timeout, the other ranks waiting."""
    host = socket.gethostname()
    hint = (
        f"set MPACCEL_MASTER_ADDR to an address or hostname of {host} (the node running "
        "rank 0) that the other nodes can reach, or unset it to let mpaccel choose."
    )
    try:
        found = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise LaunchError(
            f"MPACCEL_MASTER_ADDR={address!r} does not resolve on {host} (rank 0): {exc}", hint
        ) from exc
    refused: OSError | None = None
    for family, kind, proto, _, sockaddr in found:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(sockaddr)  # an address of another host fails here: EADDRNOTAVAIL
                probe.listen(1)
            return
        except OSError as exc:
            refused = refused or exc
    resolved = ", ".join(dict.fromkeys(str(sockaddr[0]) for *_, sockaddr in found))
    shown = "" if resolved == address else f" ({resolved})"
    raise LaunchError(
        f"MPACCEL_MASTER_ADDR={address!r}{shown} is not an address of {host} (rank 0): "
        f"cannot listen on it: {refused}",
        hint,
    ) from refused


def _join_error(
    info: ProcessInfo, endpoint: tuple[str, int, str | None, str], exc: Exception
) -> LaunchError:
    """This rank's failure to join rank 0's rendezvous at `endpoint` (as rank 0 broadcast it)."""
    host, port, origin, rank0_host = endpoint
    where = f"{host}:{port}" + (f" ({origin})" if origin else "")
    data_plane = "for gloo also GLOO_SOCKET_IFNAME, for NCCL NCCL_SOCKET_IFNAME."
    if origin is None:
        hint = (
            "on multi-homed nodes set MPACCEL_MASTER_ADDR=<address of rank 0 reachable from "
            f"all nodes> or MPACCEL_IFNAME=<interface, e.g. ib0>; {data_plane}"
        )
    else:
        hint = (
            f"{origin} must give an address of {rank0_host} (the node running rank 0) that "
            f"every node can reach: set another, or unset it to let mpaccel choose; {data_plane}"
        )
    error = LaunchError(
        f"rank {info.process_index} on {info.hostname} could not join the process group at "
        f"{where}: {exc}",
        hint,
    )
    error.__cause__ = exc
    return error


def backend_for(device: torch.device, requested: str | None) -> str:
    """NCCL for CUDA devices, gloo for CPU, unless the user asked for something that can work."""
    if requested is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigurationError(
            f"backend {requested!r} needs CUDA, but this process runs on {device}",
            "drop backend= (mpaccel picks gloo on CPU) or run where GPUs are visible.",
        )
    return requested


def gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# What torch names ProcessGroupGloo's worker threads (pthread names, /proc/<pid>/task/*/comm).
GLOO_WORKER_THREAD = "pt_gloo_runloop"
# The number of futex(2), by machine, as /proc/<pid>/task/<tid>/syscall shows it.
_FUTEX = {"x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}
# How long the end of the program waits for gloo's workers (settle_gloo_workers) at most.
SETTLE_LIMIT = 5.0
_settle_registered = False


def gloo_worker_threads() -> list[int]:
    """Not collective. The thread ids of this process's gloo worker threads (Linux; none
    elsewhere). Every ProcessGroupGloo has its own (two by default)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    workers = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER_THREAD:
                    workers.append(int(tid))
        except OSError:
            continue  # ended meanwhile
    return workers


def _worker_is_idle(tid: int) -> bool:
    """Whether thread `tid` sleeps with no time limit on a futex: a gloo worker waiting for work
    on its queue (or for a mutex another worker holds, which that one's state then shows). A
    worker running, runnable, or in a timed wait is not: the GIL is taken with a timed wait,
    and so is a collective waiting for a peer. An ended thread is idle."""
    base = f"/proc/self/task/{tid}"
    try:
        with open(f"{base}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    if stat[stat.rindex(")") + 2] != "S":
        return False
    futex = _FUTEX.get(os.uname().machine)
    try:
        with open(f"{base}/syscall") as f:
            call = f.read().split()
    except OSError:
        return True  # the state alone, where the system call cannot be read
    if futex is None or len(call) < 5 or not call[0].isdigit():
        return True
    # fields: number, then the arguments; futex's fourth argument is its time limit
    return int(call[0]) == futex and int(call[4], 16) == 0


def settle_gloo_workers(limit: float = SETTLE_LIMIT) -> bool:
    """Not collective. Wait, `limit` seconds at most and with the GIL released, until every gloo
    worker thread of this process is idle on two looks 1 ms apart. True when they are (or there
    are none), False at the limit.

    A gloo worker drops a finished collective a moment after the caller was released. A
    collective started inside backward() (DDP's bucket all-reduce, FSDP's reduce-scatter)
    holds a Python object (the context torch stashes for the backward's device threads), so
    the drop needs the GIL. Once the interpreter is finalising, Python ends a thread that asks
    for the GIL with pthread_exit, the unwind meets C++ code and the process aborts after a
    clean end ("terminate called without an active exception"). mpaccel's last exit hook
    runs this (lifecycle.Stage.BACKEND_THREADS): a worker still holding one is running,
    runnable, or waiting for the GIL, which the sleep here gives it. The same holds for a
    collective outside backward(): its tensors keep their Python objects while gloo holds them.
    Where /proc is missing (not Linux) the workers cannot be seen: a 50 ms sleep stands in.
    NCCL's works end on the GPU; destroy_process_group() (end_training) joins its watchdog."""
    if not os.path.isdir("/proc/self/task"):
        time.sleep(min(limit, 0.05))
        return True
    deadline = time.monotonic() + limit
    quiet = 0
    while True:
        workers = gloo_worker_threads()
        if not workers:
            return True
        quiet = quiet + 1 if all(_worker_is_idle(tid) for tid in workers) else 0
        if quiet == 2:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-3)


def _settle_at_exit() -> None:
    """Once per process, where a process group exists: settle_gloo_workers at the end."""
    global _settle_registered
    if not _settle_registered:
        lifecycle.at_exit(lifecycle.Stage.BACKEND_THREADS, settle_gloo_workers)
        _settle_registered = True


def init_process_group(
    comm: Comm,
    info: ProcessInfo,
    device: torch.device,
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
) -> str | None:
    """Collective: every rank calls this. Joins (or reuses) the default process group.

    Returns the backend in use, None for a world of one (no process group needed).
    """
    if info.num_processes == 1:
        return None
    chosen = backend_for(device, backend)
    _settle_at_exit()
    if is_initialized():
        return dist.get_backend()
    kwargs: dict[str, Any] = {
        "backend": chosen,
        "rank": info.process_index,
        "world_size": info.num_processes,
    }
    if timeout is not None:
        kwargs["timeout"] = timeout
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds the rank to its GPU and lets NCCL connect eagerly
    if init_method is not None:
        kwargs["init_method"] = init_method
        dist.init_process_group(**kwargs)
        return chosen
    store_timeout = timeout or timedelta(minutes=30)
    # A rank that cannot reach the store gives up after store_timeout, give or take torch's
    # backoff sleeps (3.2 s for 2 on a loaded node). Rank 0 has nothing to connect to and waits
    # in the verdicts that follow: they allow more, lest rank 0 time out there first.
    verdict_timeout = 2 * store_timeout.total_seconds() + 10.0
    store = None
    endpoint = None
    with agreement(comm, "torch.distributed rendezvous (opening the store on rank 0)"):
        if info.is_main_process:
            env = envvars.snapshot()
            override = address_override(env)
            origin = None
            if override is not None:
                logical, value = override
                origin = f"{envvars.source_name(logical, env)}={value!r}"
                if logical == "master_addr":
                    check_master_addr(value)
            host = choose_master_addr(info, env)
            store = dist.TCPStore(
                host, 0, info.num_processes, True, store_timeout, wait_for_workers=False
            )
            endpoint = (host, store.port, origin, info.hostname)
    endpoint = comm.bcast(endpoint, root=0, what="torch.distributed rendezvous")
    host, port = endpoint[:2]

    def join_error(exc: Exception) -> BaseException:
        return _join_error(info, endpoint, exc)

    # Everyone connects before anyone starts the backend: a rank that cannot reach rank 0 is
    # reported by every rank, instead of rank 0 waiting in gloo's or NCCL's own connection.
    with agreement(
        comm,
        "torch.distributed rendezvous (connecting to rank 0's store)",
        timeout=verdict_timeout,
        wrap=join_error,
    ):
        if store is None:
            store = dist.TCPStore(host, port, info.num_processes, False, store_timeout)
    with agreement(comm, "torch.distributed rendezvous", timeout=verdict_timeout, wrap=join_error):
        dist.init_process_group(store=store, **kwargs)
    return chosen


def init_world_of_one(device: torch.device, backend: str | None = None) -> str:
    """Not collective (a job of one process). A process group of this process alone, for what
    needs one even then (FSDP's device mesh): in-memory rendezvous, no network. Returns the
    backend; an existing group is kept."""
    _settle_at_exit()
    if is_initialized():
        return dist.get_backend()
    chosen = backend_for(device, backend)
    dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1)
    return chosen


def destroy_process_group(group: Any = None) -> None:
    """Destroy `group`, or the default group when None. A no-op when none exists."""
    if not is_initialized():
        return
    if group is None:
        dist.destroy_process_group()
    else:
        dist.destroy_process_group(group)


_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def all_gather(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Collective over the default group: every rank's `tensor` (same shape on every rank)."""
    out = [torch.empty_like(tensor) for _ in range(world_size)]
    send = tensor.contiguous()
    dist.all_gather(out, send)
    return out


def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """Collective over the default group, in place: 'sum', 'max' or 'min'."""
    reduce_op = getattr(dist.ReduceOp, _REDUCE_OPS[op])
    dist.all_reduce(tensor, op=reduce_op)
    return tensor


def broadcast(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Collective over the default group, in place: rank `src`'s tensor everywhere."""
    dist.broadcast(tensor, src=src)
    return tensor


def wrap_ddp(model: torch.nn.Module, device: torch.device, **kwargs: Any) -> torch.nn.Module:
    """DistributedDataParallel around `model` (parameters and buffers broadcast from rank 0)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **kwargs)


def is_ddp(model: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def ddp_of(model: Any) -> Any:
    """The DistributedDataParallel `model` is, or holds under torch.compile's wrapper (which
    prepare() puts outside DDP); None if there is none."""
    while not is_ddp(model) and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model if is_ddp(model) else None


def join(joinables: list[Any], enable: bool = True) -> AbstractContextManager[Any]:
    """torch.distributed's Join around a block: collective in effect (every rank enters it).
    The Joinables (DDP models) of a rank that ran out of inputs keep answering the others'
    collectives until every rank has left the block. A compiled model's Joinable is the DDP
    inside it. `enable=False`: the block runs as it is."""
    from torch.distributed.algorithms import Join

    inner = [ddp_of(j) or j for j in joinables]
    return Join(inner, enable=enable, throw_on_early_termination=False)


def register_comm_hook(
    model: Any, hook: str, wrapper: str = "no", state_option: dict[str, Any] | None = None
) -> None:
    """Register a DDP communication hook ('fp16', 'bf16', 'power_sgd', 'batched_power_sgd'),
    optionally compressed by `wrapper` ('fp16', 'bf16'), on the DistributedDataParallel
    `model`; PowerSGD's state takes `state_option`. 'no': nothing. Not collective (DDP runs the
    hook in every backward, on every rank: register the same on each)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks: dict[str, Callable] = {
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
        "power_sgd": powerSGD_hook.powerSGD_hook,
        "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
    }
    wrappers: dict[str, Callable] = {
        "fp16": default_hooks.fp16_compress_wrapper,
        "bf16": default_hooks.bf16_compress_wrapper,
    }
    if hook == "no":
        return
    chosen = hooks[hook]
    if wrapper != "no":
        chosen = wrappers[wrapper](chosen)
    state = None
    if hook in ("power_sgd", "batched_power_sgd"):
        state = powerSGD_hook.PowerSGDState(None, **(state_option or {}))
    try:
        model.register_comm_hook(state=state, hook=chosen)
    except TypeError as exc:
        if "bf16" not in (hook, wrapper):
            raise
        raise ConfigurationError(
            f"DDP communication hook {hook!r} (wrapper {wrapper!r}) cannot run here: {exc}",
            "bfloat16 compression needs NCCL on CUDA (or XCCL on XPU); on CPU (gloo) use "
            "comm_hook=DDPCommunicationHookType.FP16, or comm_wrapper=FP16 around PowerSGD.",
        ) from exc
