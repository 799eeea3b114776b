"""Sharded checkpoints of a fully_shard model and its AdamW state: mpaccel's save_sharded /
load_sharded against torch.distributed.checkpoint (DCP: save/load with FileSystemWriter /
FileSystemReader) on the same state dict, with dd as the disk's limit; and full-tensor export
(mpaccel's export_full: each rank writes its rows in place) against gathering the full state
dict to rank 0 and writing it there (what Accelerate's save_model does under FSDP).

A benchmark, not a test: it prints figures and ratios and asserts nothing about them.

Every rank builds the same model (`--layers` square Linear layers of `--param-mib` MiB of float32
parameters in all), shards it with fully_shard (each layer, then the root) and takes one AdamW
step; the state (torch.distributed.checkpoint.state_dict.get_state_dict: parameters, exp_avg,
exp_avg_sq as DTensors) is 3x the parameters. Round after round, in a fresh random order:

  mpaccel   save_sharded(comm, dir, state) / load_sharded(comm, dir, state) (in place)
  dcp       dcp.save(state, storage_writer=FileSystemWriter(dir)) / dcp.load(state, ...)
  dd        rank 0: dd if=/dev/zero bs=64M conv=fdatasync of the state's bytes / dd read back
  export    export_full(comm, dir, model.state_dict()) (save_model's layout, no gather)
  gather    get_model_state_dict(full_state_dict=True, cpu_offload=True) (a gather to rank 0),
            then rank 0 writes it: safetensors save_file (torch.save without safetensors) + fsync

Times run from a common barrier to the last rank's return. Loads are cold where the page cache
can be dropped (root: `echo 3 > /proc/sys/vm/drop_caches`), else warm (the table says which).

Resharded load (saved at one size, loaded at another): run once with --keep at the size that
saves, then with --resharded at the size that loads, on the same --dir and model options:

  mpiexec -n 4 python benchmarks/fsdp_checkpoint.py --dir /tmp/fsdp-bench --keep
  mpiexec -n 2 python benchmarks/fsdp_checkpoint.py --dir /tmp/fsdp-bench --resharded
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--param-mib", type=float, default=256.0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/mpaccel-fsdp-bench")
    parser.add_argument("--keep", action="store_true",
                        help="keep the last round's checkpoints (for a later --resharded run)")
    parser.add_argument("--resharded", action="store_true",
                        help="only load the checkpoints a --keep run saved at another size")
    return parser.parse_args()


def build(param_mib: float, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    width = max(8, int((param_mib * 2**20 / 4 / layers) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the whole (global) state: every tensor's global size."""
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(state)
    return total


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dd_seconds(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args], capture_output=True, check=True)
    return time.perf_counter() - start


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Bench:
    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.times: dict[str, list[float]] = {}

    def timed(self, name: str, work: Callable[[], Any], cold: bool = False) -> None:
        if cold and self.comm.rank == 0:
            drop_caches()
        self.comm.barrier()
        start = time.perf_counter()
        work()
        self.comm.barrier()
        self.times.setdefault(name, []).append(time.perf_counter() - start)

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def gather_and_write(model: torch.nn.Module, path: str, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank != 0:
        return
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "model.safetensors")
    try:
        from safetensors.torch import save_file
    except ImportError:
        target = os.path.join(path, "model.bin")
        torch.save(full, target)
    else:
        save_file({k: v.contiguous() for k, v in full.items()}, target)
    fsync_path(target)


def main() -> None:
    args = parse()
    import torch.distributed.checkpoint as dcp

    from mpaccel import PartialState
    from mpaccel.checkpoint.sharded.export import export_full
    from mpaccel.checkpoint.sharded.load import load_sharded
    from mpaccel.checkpoint.sharded.save import save_sharded

    comm = PartialState().comm
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, opt = build(args.param_mib, args.layers)
    state = state_of(model, opt)
    nbytes = state_bytes(state)
    paths = {name: os.path.join(args.dir, name) for name in ("mpaccel", "dcp", "export",
                                                              "gather", "dd")}
    bench = Bench(comm)
    cold = comm.rank == 0 and drop_caches()
    cold = comm.bcast(cold)
    if comm.rank == 0:
        print(f"{comm.size} rank(s); state {nbytes / 2**20:.0f} MiB (params + AdamW), "
              f"loads {'cold' if cold else 'warm (cannot drop the page cache)'}", flush=True)

    def load_mpaccel() -> None:
        load_sharded(comm, paths["mpaccel"], state)

    def load_dcp() -> None:
        dcp.load(state, storage_reader=dcp.FileSystemReader(paths["dcp"]))

    if args.resharded:
        for round_no in range(args.rounds):
            for name, load in random.Random(round_no).sample(
                    [("mpaccel resharded load", load_mpaccel),
                     ("dcp resharded load", load_dcp)], 2):
                bench.timed(name, load, cold=cold)
        if comm.rank == 0:
            a, b = bench.median("mpaccel resharded load"), bench.median("dcp resharded load")
            print(f"resharded load: mpaccel {a:.3f} s ({nbytes / a / 2**30:.2f} GiB/s), "
                  f"dcp {b:.3f} s; mpaccel / dcp speed: {b / a:.2f}x")
        return

    os.makedirs(args.dir, exist_ok=True)

    def dd_round() -> None:
        if comm.rank == 0:
            count = max(1, -(-nbytes // (64 << 20)))
            write = dd_seconds([f"of={paths['dd']}", "if=/dev/zero", "bs=64M",
                                f"count={count}", "conv=fdatasync"])
            if cold:
                drop_caches()
            read = dd_seconds([f"if={paths['dd']}", "of=/dev/null", "bs=64M"])
            scale = nbytes / (count * (64 << 20))  # dd writes whole 64 MiB blocks
            bench.times.setdefault("dd save", []).append(write * scale)
            bench.times.setdefault("dd load", []).append(read * scale)
            os.remove(paths["dd"])
        comm.barrier()

    for round_no in range(args.rounds):
        steps: list[tuple[str, Callable[[], None]]] = [
            ("mpaccel", lambda: (
                bench.timed("mpaccel save", lambda: save_sharded(comm, paths["mpaccel"], state)),
                bench.timed("mpaccel load", load_mpaccel, cold=cold))),
            ("dcp", lambda: (
                remove(paths["dcp"]) if comm.rank == 0 else None, comm.barrier(),
                bench.timed("dcp save", lambda: dcp.save(
                    state, storage_writer=dcp.FileSystemWriter(paths["dcp"]))),
                bench.timed("dcp load", load_dcp, cold=cold))),
            ("dd", dd_round),
            ("export", lambda: bench.timed(
                "export_full", lambda: export_full(comm, paths["export"], model.state_dict()))),
            ("gather", lambda: bench.timed(
                "gather to rank 0 + write",
                lambda: gather_and_write(model, paths["gather"], comm.rank))),
        ]
        for _, step in random.Random(round_no).sample(steps, len(steps)):
            step()

    if comm.rank == 0:
        print(f"{'method':<28}{'median s':>10}{'GiB/s':>8}   ({args.rounds} rounds)")
        model_bytes = state_bytes(state["model"])
        for name in bench.times:
            seconds = bench.median(name)
            size = model_bytes if name.startswith(("export", "gather")) else nbytes
            print(f"{name:<28}{seconds:>10.3f}{size / seconds / 2**30:>8.2f}")
        ratio = {
            "save: mpaccel / dcp speed": ("dcp save", "mpaccel save"),
            "load: mpaccel / dcp speed": ("dcp load", "mpaccel load"),
            "save: mpaccel / dd speed": ("dd save", "mpaccel save"),
            "load: mpaccel / dd speed": ("dd load", "mpaccel load"),
            "export_full / gather+write speed": ("gather to rank 0 + write", "export_full"),
        }
        for label, (slow, fast) in ratio.items():
            print(f"{label:<36}{bench.median(slow) / bench.median(fast):.2f}x")
        print("(export and gather write the model's parameters only: a third of the state)")
    if not args.keep and comm.rank == 0:
        remove(args.dir)


if __name__ == "__main__":
    main()
