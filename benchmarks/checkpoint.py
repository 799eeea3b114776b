"""Checkpoint save/load throughput: mpaccel save_state/load_state vs torch.save, safetensors,
numpy.tofile and the disk itself (dd), all in one run on the same disk.

A benchmark, not a test: it prints figures and asserts nothing about them.

Every rank builds the same model (`--layers` square Linear layers holding `--param-gib` GiB of
float32 parameters), prepares it with AdamW and takes one step, so the training state is
params + exp_avg + exp_avg_sq = 3x the parameters (1.5 GiB by default). Then, round after round
(in a fresh random order every round, so slow phases of the disk hit every method alike):

  mpaccel       collective, every rank: acc.save_state(dir) / acc.load_state(dir). Time: from a
                common barrier until the call has returned on every rank (max over ranks), so a
                save includes fsync and the index commit, a load the checksum verification
                and load_state_dict. Each rank of a load reads the whole state.
  torch         save, rank 0 only: torch.save({"model":..., "optimizer":...}) + fsync.
                load, every rank (as Accelerate's load_state does): torch.load, then the
                model's and the optimizer's load_state_dict. Also timed: torch.load alone.
  safetensors   save, rank 0 only: save_file(flat dict) + fsync. load, every rank: load_file
                (default mmap backend) + one byte of every page touched (load_file alone maps
                the file and reads nothing), then load_state_dict as above. Also timed: the
                file part alone.
  numpy         rank 0 only: ndarray.tofile of every tensor into one file + fsync / readinto
  dd            rank 0 only, the disk limit: dd if=/dev/zero bs=64M conv=fdatasync of the same
                byte count / dd of=/dev/null. At n > 1 also "dd x n": n dd readers of the
                file at once, cold (the disk plus one private copy per process) and warm (the
                copies alone: a load at n ranks takes at least as long as they do, which caps
                its ratio to the disk; the table prints that cap round by round).
While rank 0 alone measures something, the other ranks wait, untimed, in a sleeping barrier
(MPICH's blocking collectives busy-poll and would steal a core from rank 0 at n=4 on 2 cores).
After a peer's load, untimed, the optimizer gets its own state tensors back (a safetensors load
leaves it holding copy-on-write file mappings, which would slow whatever writes to them next).

Each method per round: save, load from the page cache ("warm", the file was just written),
drop the page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`, root only), load again ("cold"),
delete the files, sync, settle. Before each timed step, untimed, rank 0 touches and frees
enough fresh memory for it (see prefault(): this VM's balloon hands freed memory back to the
host, and touching it again costs ~2-3 s per GiB, which would land at random in timed steps;
--no-prefault to see that). Warm-up (untimed): one dd and one mpaccel save of the full size.
Warm loads of safetensors only map cached pages (no copy): not comparable with the others.

Throughput = state bytes (tensors of the model and optimizer state dicts) / seconds, in GiB/s.
"x disk" in the table divides medians; the line after it divides mpaccel's time by dd's in the
same round, round by round (the disk's slow phases outlast one method's turn).
mpaccel saves are also broken down per phase (timers wrapped around mpaccel's functions from
outside: to_numpy, create_dataset, data writes/reads, checksum, HDF5 close, collectives).
CPU steal (/proc/stat: time the hypervisor gave to other guests) is recorded per round, so a
slow round can be told apart from a slow method.

Usage (from the repository root, mpaccel's venv active):

  python benchmarks/checkpoint.py                       # n=1, 1.5 GiB state, 5 rounds
  python benchmarks/checkpoint.py --rounds 9 --json /tmp/ckpt-n1.json    # as in the results
  mpiexec -n 2 python benchmarks/checkpoint.py
  mpiexec -n 4 python benchmarks/checkpoint.py
  python benchmarks/checkpoint.py --param-gib 0.25 --rounds 3 --json /tmp/ckpt.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

GIB = 2**30
METHODS = ["mpaccel", "torch", "safetensors", "numpy", "dd"]
# save; loads from the page cache (warm) and from the disk (cold); for peers also the file part
# of their loads (warm_file, cold_file); for dd at n > 1, n readers at once (warm_n, cold_n)
KINDS = ["save", "warm", "cold", "warm_file", "cold_file", "warm_n", "cold_n"]
PEERS = ("torch", "safetensors")


# -- synchronisation (benchmark plumbing, not mpaccel's) -------------------------------------------


class World:
    """Barrier and max-reduce over the job's ranks; identities at size 1."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.comm: Any = None
        self.rank = 0
        if size > 1:
            from mpi4py import MPI

            self.MPI = MPI
            self.comm = MPI.COMM_WORLD
            self.rank = self.comm.Get_rank()

    def barrier(self) -> None:
        """A barrier that sleeps while waiting: leaves the cores to the rank doing the work."""
        if self.comm is None:
            return
        request = self.comm.Ibarrier()
        while not request.Test():
            time.sleep(0.001)

    # Blocking MPICH collectives busy-poll: a rank waiting in one for rank 0's timed step would
    # take a core from it (measured: dd alone at n=4 dropped from ~1.5 to ~0.8 GiB/s). So every
    # collective here starts with the sleeping barrier and then completes at once.

    def max(self, value: float) -> float:
        if self.comm is None:
            return value
        self.barrier()
        return float(self.comm.allreduce(value, op=self.MPI.MAX))

    def bcast(self, value: Any) -> Any:
        if self.comm is None:
            return value
        self.barrier()
        return self.comm.bcast(value, root=0)

    def allgather(self, value: Any) -> list:
        if self.comm is None:
            return [value]
        self.barrier()
        return self.comm.allgather(value)


# -- phase timers around mpaccel's checkpoint code (wrapped from outside, nothing edited) ----------


class Phases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def reset(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def instrument(acc: Any) -> Phases:
    import h5py
    import torch

    from mpaccel.checkpoint import api, rawio, reader, writer

    phases = Phases()
    phases.wrap(api, "collect", "collect state_dicts")  # the name save_state calls
    phases.wrap(writer, "to_numpy", "to_numpy")
    phases.wrap(writer, "checksum", "xxh3 checksum")
    phases.wrap(reader, "checksum", "xxh3 checksum (load)")
    phases.wrap(writer.ErrorKeepingFile, "finish", "close (shards)")
    phases.wrap(rawio, "write_arrays", "data writes + fsync (threads)")
    phases.wrap(rawio, "read_arrays", "data reads (threads)")
    phases.wrap(writer, "fsync_path", "fsync (directory)")
    phases.wrap(writer, "write_index", "commit index (rank 0)")
    phases.wrap(h5py.File, "__init__", "h5py open")
    phases.wrap(h5py.File, "close", "h5py close (flush)")
    phases.wrap(h5py.Group, "create_dataset", "create_dataset")
    phases.wrap(h5py.Dataset, "write_direct", "write_direct")
    phases.wrap(h5py.Dataset, "read_direct", "read_direct")
    phases.wrap(torch.nn.Module, "load_state_dict", "model load_state_dict")
    phases.wrap(torch.optim.Optimizer, "load_state_dict", "optimizer load_state_dict")
    comm = acc._partial.comm
    for name in ("agree", "allgather", "bcast"):
        phases.wrap(comm, name, f"collectives ({name})")
    return phases


# -- the training state ----------------------------------------------------------------------------


def build_state(param_gib: float, layers: int) -> tuple[Any, Any, Any, int]:
    """Accelerator, prepared model and AdamW after one step; all ranks identical."""
    import torch

    from mpaccel import Accelerator

    acc = Accelerator()
    width = max(64, int(math.sqrt(param_gib * GIB / 4 / layers)) // 64 * 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    acc.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return acc, model, opt, width


def flat_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """{"model.<key>": t, "optimizer.state.<id>.<name>": t} (safetensors and numpy layouts)."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, entry in state["optimizer"]["state"].items():
        for name, value in entry.items():
            out[f"optimizer.state.{pid}.{name}"] = value
    return out


# -- the methods, rank 0 unless said otherwise -----------------------------------------------------


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(state: dict, path: str) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path: str) -> Any:
    import torch

    return torch.load(path, weights_only=True)


def st_save(flat: dict, path: str) -> None:
    from safetensors.torch import save_file

    save_file(flat, path)
    fsync_file(path)


def st_load(path: str) -> Any:
    import torch
    from safetensors.torch import load_file

    loaded = load_file(path)
    for t in loaded.values():  # fault every page in: load_file only maps the file
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()
    return loaded


def into_training_state(model: Any, opt: Any, state: dict) -> None:
    """What a load is for: the model's and the optimizer's load_state_dict."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def unflatten_tensors(flat: dict, opt: Any) -> dict:
    """flat_tensors() undone, with the optimizer's param_groups (safetensors holds tensors only)."""
    model = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    state: dict[int, dict[str, Any]] = defaultdict(dict)
    for k, v in flat.items():
        if k.startswith("optimizer.state."):
            pid, name = k.removeprefix("optimizer.state.").split(".", 1)
            state[int(pid)][name] = v
    groups = opt.state_dict()["param_groups"]
    return {"model": model, "optimizer": {"state": dict(state), "param_groups": groups}}


def timed_parts(read: Callable[[], Any], use: Callable[[Any], None]) -> float:
    """Run read() then use(result); returns read()'s own seconds (the file part)."""
    t0 = time.perf_counter()
    loaded = read()
    seconds = time.perf_counter() - t0
    use(loaded)
    return seconds


def np_save(flat: dict, path: str) -> None:
    with open(path, "wb") as f:
        for t in flat.values():
            t.detach().numpy().tofile(f)
        f.flush()
        os.fsync(f.fileno())


def np_load(flat: dict, path: str) -> Any:
    import numpy as np

    out = {}
    with open(path, "rb", buffering=0) as f:
        for k, t in flat.items():
            a = np.empty(tuple(t.shape), dtype=t.detach().numpy().dtype)
            if a.nbytes:
                f.readinto(a.data.cast("B"))
            out[k] = a
    return out


def dd_seconds(args: list[str]) -> float:
    """dd's own elapsed time ("copied, X s"), which excludes process start-up."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = re.search(r"copied, ([0-9.,e+-]+) s", done.stderr)
    if not match:
        raise RuntimeError(f"cannot parse dd's output: {done.stderr!r}")
    return float(match.group(1).replace(",", "."))


def dd_write(path: str, count: int) -> float:
    return dd_seconds(["if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "conv=fdatasync"])


def dd_read(path: str) -> float:
    return dd_seconds([f"if={path}", "of=/dev/null", "bs=64M"])


def dd_read_many(path: str, count: int) -> float:
    """`count` dd readers of the same file at once; the slowest one's own elapsed time."""
    readers = [
        subprocess.Popen(
            ["dd", f"if={path}", "of=/dev/null", "bs=64M"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    seconds = []
    for reader in readers:
        _, err = reader.communicate()
        match = re.search(r"copied, ([0-9.,e+-]+) s", err)
        if reader.returncode or not match:
            raise RuntimeError(f"dd failed: {err!r}")
        seconds.append(float(match.group(1).replace(",", ".")))
    return max(seconds)


def cpu_times() -> list[int] | None:
    """The machine's cumulative CPU times from /proc/stat (user ... steal), None without it."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def steal_fraction(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of the CPU time between two cpu_times() that the hypervisor gave to others (steal):
    a round with much of it is slow for reasons outside this machine."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta)
    return delta[7] / total if total > 0 else None


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def prefault(gib: float) -> tuple[float, float]:
    """Touch `gib` GiB of fresh anonymous memory and free it; returns (GiB, seconds).

    This VM's balloon reports free pages back to the host (~2 s after they are freed); touching
    a reported page again costs a host fault (~2-3 s per GiB, measured). Page-cache pages of a
    write and the buffers of a load come from the same free memory, so without this a timed
    write or load pays those faults at random. Freed just before a timed step, these pages
    (head of the free lists) are the ones the step gets."""
    import numpy as np

    with open("/proc/meminfo") as f:  # never push the page cache (warm loads) out
        free = next(int(line.split()[1]) for line in f if line.startswith("MemFree:")) * 1024
    gib = max(0.0, min(gib, free / GIB - 1.0))
    t0 = time.perf_counter()
    block = np.empty(int(gib * GIB) // 4, dtype=np.float32)
    block[::1024] = 0.0  # one store per 4 KiB page
    del block
    return gib, time.perf_counter() - t0


def clear(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


# -- the run ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    acc, model, opt, width = build_state(args.param_gib, args.layers)
    world = World(acc.num_processes)
    assert world.size == acc.num_processes and (size == 1 or world.size == size)
    rank = acc.process_index
    if args.threads:
        torch.set_num_threads(args.threads)

    state = {"model": acc.unwrap_model(model).state_dict(), "optimizer": opt.state_dict()}
    flat = flat_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    gib = nbytes / GIB
    count = math.ceil(nbytes / (64 * 2**20))

    base = os.path.abspath(args.dir)
    problem = None
    if rank == 0:
        os.makedirs(base, exist_ok=True)
        clear(base)
        free = shutil.disk_usage(base).free
        if free < 3 * nbytes + 2 * GIB:
            problem = f"{base!r} has {free / GIB:.1f} GiB free; need {3 * gib + 2:.1f}"
    problem = world.bcast(problem)
    if problem:
        raise SystemExit(problem)
    can_drop = world.bcast(drop_caches() if rank == 0 else None)

    phases = instrument(acc)
    results: dict[str, dict[str, list[float]]] = {m: {kind: [] for kind in KINDS} for m in METHODS}
    breakdown: list[dict[str, Any]] = []
    prefaults: list[tuple[float, float]] = []  # (GiB touched, seconds)
    ckpt = os.path.join(base, "mpaccel_state")
    # Enough fresh memory for the page cache of one copy plus the load buffers: every rank's
    # for mpaccel (each rank loads the whole state), rank 0's for the others.
    prefault_all = (world.size + 1) * gib + 1.0 if args.prefault else 0.0
    prefault_one = 2 * gib + 1.0 if args.prefault else 0.0

    module = acc.unwrap_model(model)
    pristine = opt.state_dict()  # the optimizer's own state tensors, given back after a peer load
    part_seconds: list[float] = []  # the file part of the last peer load, max over ranks

    def timed(
        fn: Callable[[], Any],
        everyone: bool,
        cold: bool = False,
        own_clock: bool = False,
        part: bool = False,
    ) -> float:
        """Seconds of `fn` on every rank (max) or on rank 0 alone (the others wait, untimed).
        Before it, untimed: drop the page cache (cold), touch fresh memory (prefault).
        part: fn returns the seconds of its first part, kept (max over ranks) in part_seconds."""
        world.barrier()
        if rank == 0:
            if cold:
                drop_caches()
            if args.prefault:
                prefaults.append(prefault(prefault_all if everyone else prefault_one))
        world.barrier()
        elapsed = first = 0.0
        if everyone or rank == 0:
            t0 = time.perf_counter()
            out = fn()
            elapsed = out if own_clock else time.perf_counter() - t0
            first = out if part else 0.0
        if part:
            part_seconds[:] = [world.max(first)]
        return world.max(elapsed) if everyone else world.bcast(elapsed)

    def settle() -> None:
        world.barrier()
        if rank == 0:
            clear(base)
            os.sync()
            time.sleep(args.settle)
        world.barrier()

    def mpaccel_load() -> None:
        with quiet_warnings():  # none expected at the same world size
            acc.load_state(ckpt)

    def measure(method: str, record: bool) -> None:
        path = os.path.join(base, f"bench.{method}")
        nan = float("nan")
        extra: dict[str, float] = {}
        if method == "mpaccel":
            phases.reset()
            save = timed(lambda: acc.save_state(ckpt), everyone=True)
            times = {"save": world_max_phases(world, phases.reset())}
            warm = timed(mpaccel_load, everyone=True)
            times["warm"] = world_max_phases(world, phases.reset())
            cold = timed(mpaccel_load, everyone=True, cold=True) if can_drop else nan
            times["cold"] = world_max_phases(world, phases.reset())
            if record:
                breakdown.append(times)
        elif method == "dd":
            # dd's own elapsed time, scaled to the state's bytes (dd writes whole 64 MiB blocks,
            # a little more): the seconds the same bytes take at dd's rate.
            scale = nbytes / (count * 64 * 2**20)
            save = timed(lambda: dd_write(path, count), False, own_clock=True) * scale
            warm = timed(lambda: dd_read(path), False, own_clock=True) * scale
            if world.size > 1:
                many = lambda: dd_read_many(path, world.size)  # noqa: E731
                extra["warm_n"] = timed(many, False, own_clock=True) * scale
            cold = nan
            if can_drop:
                cold = timed(lambda: dd_read(path), False, cold=True, own_clock=True) * scale
                if world.size > 1:
                    extra["cold_n"] = timed(many, False, cold=True, own_clock=True) * scale
        elif method == "numpy":
            save = timed(lambda: np_save(flat, path), everyone=False)
            warm = timed(lambda: np_load(flat, path), everyone=False)
            cold = timed(lambda: np_load(flat, path), False, cold=True) if can_drop else nan
        else:  # a peer: saved by rank 0, loaded by every rank into the model and optimizer
            read, use = {
                "torch": (
                    lambda: torch_load(path),
                    lambda st: into_training_state(module, opt, st),
                ),
                "safetensors": (
                    lambda: st_load(path),
                    lambda flat: into_training_state(module, opt, unflatten_tensors(flat, opt)),
                ),
            }[method]
            save_fn = {
                "torch": lambda: torch_save(state, path),
                "safetensors": lambda: st_save(flat, path),
            }[method]

            def load() -> float:
                return timed_parts(read, use)

            save = timed(save_fn, everyone=False)
            warm = timed(load, everyone=True, part=True)
            extra["warm_file"] = part_seconds[0]
            opt.load_state_dict(pristine)
            cold = nan
            if can_drop:
                cold = timed(load, everyone=True, cold=True, part=True)
                extra["cold_file"] = part_seconds[0]
                opt.load_state_dict(pristine)
        if record:
            results[method]["save"].append(save)
            results[method]["warm"].append(warm)
            results[method]["cold"].append(cold)
            for kind, seconds in extra.items():
                results[method][kind].append(seconds)
        if rank == 0 and args.verbose:
            print(
                f"  {method:12s} save {gib / save:5.2f}  warm load {gib / warm:5.2f}  "
                f"cold load {gib / cold:5.2f} GiB/s",
                flush=True,
            )
        settle()

    if rank == 0:
        print(
            f"checkpoint benchmark: n={world.size}, state {gib:.3f} GiB ({nbytes} bytes: "
            f"{args.layers} x Linear({width}, {width}) + AdamW exp_avg, exp_avg_sq), "
            f"dir {base}, page-cache drop {'yes' if can_drop else 'NO (loads from cache)'}, "
            f"prefault {prefault_all:.1f} GiB (mpaccel) / {prefault_one:.1f} GiB (others)",
            flush=True,
        )
        print("warm-up (untimed): dd + mpaccel save", flush=True)
    for method in ("dd", "mpaccel"):
        for _ in range(args.warmup if method in args.methods.split(",") else 0):
            measure(method, record=False)
    methods = [m for m in METHODS if m in args.methods.split(",")]
    shuffler = random.Random(args.seed)  # the same order on every rank
    steal: list[float | None] = []  # the hypervisor's share of this machine's CPU time, per round
    for r in range(args.rounds):
        # A fresh order every round: each method follows each other one (the file it deletes,
        # the memory it frees) about equally often; slow phases hit every method alike.
        order = shuffler.sample(methods, len(methods))
        if rank == 0 and args.verbose:
            print(f"round {r + 1}/{args.rounds}: {' '.join(order)}", flush=True)
        before = cpu_times()
        for method in order:
            measure(method, record=True)
        steal.append(steal_fraction(before, cpu_times()))

    report = {
        "ranks": world.size,
        "state_bytes": nbytes,
        "state_gib": gib,
        "layers": args.layers,
        "width": width,
        "rounds": args.rounds,
        "dir": base,
        "page_cache_dropped": can_drop,
        "prefault_gib": [prefault_all, prefault_one],
        "prefault_seconds": statistics.median(t for _, t in prefaults) if prefaults else None,
        "prefault_seconds_max": max((t for _, t in prefaults), default=None),
        "seconds": results,
        "mpaccel_phases": breakdown,
        "steal_per_round": steal,
        "versions": versions(),
    }
    if rank == 0:
        print_table(report)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        clear(base)
    world.barrier()
    return report


def world_max_phases(world: World, mine: dict[str, float]) -> dict[str, Any]:
    """Per phase: max over ranks and rank 0's own seconds."""
    everyone = world.allgather(mine)
    keys = sorted({k for part in everyone for k in part})
    return {
        k: {"max": max(p.get(k, 0.0) for p in everyone), "rank0": everyone[0].get(k, 0.0)}
        for k in keys
    }


def versions() -> dict[str, str]:
    import h5py
    import numpy
    import safetensors
    import torch

    import mpaccel

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "numpy": numpy.__version__,
        "safetensors": safetensors.__version__,
        "mpaccel": mpaccel.__version__,
    }


def print_table(report: dict[str, Any]) -> None:
    gib = report["state_gib"]
    rates = {
        m: {kind: [gib / s for s in secs if not math.isnan(s)] for kind, secs in per.items()}
        for m, per in report["seconds"].items()
    }
    med = {
        m: {k: statistics.median(v) if v else float("nan") for k, v in r.items()}
        for m, r in rates.items()
    }
    nan = float("nan")
    disk = med["dd"]
    best_peer = {
        k: max((med[p][k] for p in PEERS if not math.isnan(med[p][k])), default=nan)
        for k in ("save", "warm", "cold")
    }

    def cell(m: str, kind: str) -> str:
        values = rates[m][kind]
        if not values:
            return "n/a"
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    print(
        f"\nn={report['ranks']}, state {gib:.3f} GiB, {report['rounds']} rounds, "
        "GiB/s median [min-max]; x disk = / dd median, x peer = / best of torch, safetensors"
    )
    header = (
        f"{'method':12s} {'save':>18s} {'x disk':>6s} {'x peer':>6s} "
        f"{'cold load':>18s} {'x disk':>6s} {'x peer':>6s} {'warm load':>18s} {'x peer':>6s}"
    )
    print(header)
    print("-" * len(header))
    for m in METHODS:
        if not rates[m]["save"]:
            continue
        print(
            f"{m:12s} {cell(m, 'save'):>18s} {med[m]['save'] / disk['save']:6.2f} "
            f"{med[m]['save'] / best_peer['save']:6.2f} "
            f"{cell(m, 'cold'):>18s} {med[m]['cold'] / disk['cold']:6.2f} "
            f"{med[m]['cold'] / best_peer['cold']:6.2f} "
            f"{cell(m, 'warm'):>18s} {med[m]['warm'] / best_peer['warm']:6.2f}"
        )
    # the disk's slow phases last longer than one method's turn: mpaccel against dd in the same
    # round (every method runs once per round, in a random order) is less noisy than medians
    paired = []
    for kind in ("save", "cold"):
        ratios = [
            d / m
            for m, d in zip(report["seconds"]["mpaccel"][kind], report["seconds"]["dd"][kind])
            if not (math.isnan(m) or math.isnan(d))
        ]
        if ratios:
            paired.append(
                f"{kind} {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
    print("mpaccel / dd in the same round, median [min-max]: " + ", ".join(paired))
    # the peers' loads without their load_state_dict (the file part), and dd x n
    file_best = {
        k: max(
            (med[p][f"{k}_file"] for p in PEERS if not math.isnan(med[p][f"{k}_file"])), default=nan
        )
        for k in ("warm", "cold")
    }
    print(
        "\nfile part of the peers' loads (every rank; no load_state_dict), GiB/s; "
        "mpaccel / best of them:"
    )
    for p in PEERS:
        print(f"  {p:12s} cold {cell(p, 'cold_file'):>18s}   warm {cell(p, 'warm_file'):>18s}")
    print(
        f"  mpaccel / best: cold {med['mpaccel']['cold'] / file_best['cold']:.2f}, "
        f"warm {med['mpaccel']['warm'] / file_best['warm']:.2f}"
    )
    if rates["dd"]["cold_n"]:
        print(
            f"dd x {report['ranks']} (that many readers at once, cold): {cell('dd', 'cold_n')} "
            f"GiB/s; mpaccel cold load / that: {med['mpaccel']['cold'] / med['dd']['cold_n']:.2f}"
        )
    if rates["dd"]["warm_n"]:
        # n private copies of the state cost this much with no disk at all; a load at n ranks
        # must make them, so at best it takes max(disk, copies): the ceiling of "x disk".
        seconds = report["seconds"]["dd"]
        ceilings = [
            min(1.0, cold / copies)
            for cold, copies in zip(seconds["cold"], seconds["warm_n"])
            if not (math.isnan(cold) or math.isnan(copies))
        ]
        ceiling = (
            f"\n  so cold load / disk is at most (dd cold / dd x n warm, round by round): "
            f"{statistics.median(ceilings):.2f} [{min(ceilings):.2f}-{max(ceilings):.2f}]"
            if ceilings
            else ""
        )
        print(
            f"dd x {report['ranks']} warm (that many private copies from the page cache, no "
            f"disk): {cell('dd', 'warm_n')} GiB/s{ceiling}"
        )
    steal = [f"{100 * v:.1f}%" if v is not None else "?" for v in report.get("steal_per_round", [])]
    if steal:
        print(f"CPU steal (hypervisor) per round: {' '.join(steal)}")
    if report["prefault_seconds"] is not None:  # None with --no-prefault
        print(
            f"\nprefault before each timed step: {report['prefault_gib'][0]:.1f} GiB (mpaccel), "
            f"{report['prefault_gib'][1]:.1f} GiB (others); median "
            f"{report['prefault_seconds']:.2f} s, max {report['prefault_seconds_max']:.2f} s"
        )
    if report["mpaccel_phases"]:
        print("\nmpaccel phases, seconds, median over rounds of the max over ranks (rank 0's):")
        for kind in ("save", "cold", "warm"):
            rows = report["mpaccel_phases"]
            keys = sorted({k for r in rows for k in r[kind]})
            total = statistics.median(report["seconds"]["mpaccel"][kind])
            parts = []
            for k in keys:
                mx = statistics.median(r[kind].get(k, {"max": 0})["max"] for r in rows)
                r0 = statistics.median(r[kind].get(k, {"rank0": 0})["rank0"] for r in rows)
                if mx >= 0.005:
                    parts.append(f"{k} {mx:.3f} ({r0:.3f})")
            print(f"  {kind} (total {total:.3f} s): " + "; ".join(parts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--param-gib",
        type=float,
        default=0.5,
        help="float32 parameter GiB (state = 3x with AdamW); default 0.5",
    )
    parser.add_argument("--layers", type=int, default=4, help="square Linear layers (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed dd + mpaccel saves")
    parser.add_argument(
        "--dir",
        default="/tmp/mpaccel-ckpt-bench",
        help="scratch directory, emptied (default /tmp/mpaccel-ckpt-bench)",
    )
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds to wait after deleting files (default 1)"
    )
    parser.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_false",
        help="do not touch fresh memory before each timed step (see prefault())",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {','.join(METHODS)} (default: all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the method order")
    parser.add_argument("--json", help="write every measurement here (rank 0)")
    parser.add_argument("--verbose", action="store_true", help="print every measurement")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
