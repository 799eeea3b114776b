"""Fully sharded training on CPU: what a rank holds, and what mpaccel's FSDP2 costs per step.

A benchmark, not a test: it prints figures and asserts nothing about them.

memory      One job per (mode, n): the same model of `--gib` GiB of fp32 parameters (blocks of
            Linear(d, d) + GELU), AdamW, `--steps` training steps, under mpaccel's DDP
            (`Accelerator()`) and under mpaccel's FSDP2 (`Accelerator(fsdp_plugin=...)`,
            one block per `fully_shard` unit). Each rank reports its resident memory above
            what it held before the model existed: the peak while training (the kernel's
            high-water mark, reset with /proc/self/clear_refs once `prepare` returned, so the
            full model every rank builds before sharding is not counted) and the bytes of
            parameters + gradients + optimizer state it holds locally (counted from the
            tensors). The target: FSDP's peak <= 1.2/n of DDP's at n = 2, 4.
throughput  One job per n: the step time of a model prepared by mpaccel's FSDP2 against the
            same model sharded by raw `torch.distributed.fsdp.fully_shard` in the same
            processes, on the same gloo group, interleaved window by window (the order rotates
            every round) so a noisy machine hits both alike. A window's time is the slowest
            rank's; the job reports the median window of each and their ratio (target >= 0.97).

Usage (from the repository root, mpaccel's venv):

  python benchmarks/fsdp.py                         # memory at n=1,2,4, throughput at n=2,4
  python benchmarks/fsdp.py --what memory --n 2 4 --gib 0.5
  python benchmarks/fsdp.py --json results.json
  mpiexec -n 2 python benchmarks/fsdp.py --job memory --mode fsdp   # one job by hand
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULT_TAG = "FSDP_BENCH_RESULT "
GIB = 1 << 30


# -- one job (every rank) -------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    # Linux: writing 5 resets the high-water mark (VmHWM) to the current resident size.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(d: int, blocks: int) -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(self.linear(x)) + x

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    return Net()


def _blocks_for(gib: float, d: int) -> int:
    return max(1, round(gib * GIB / (4 * (d * d + d))))


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _held_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    import torch

    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _local_bytes(params), "grads": _local_bytes(grads),
            "optimizer": _local_bytes(state)}


def _plugin(blocks_class: str = "Block") -> Any:
    from mpaccel.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[blocks_class], reshard_after_forward=True,
    )


def job_memory(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mpaccel import Accelerator

    accelerator = Accelerator(fsdp_plugin=_plugin() if args.mode == "fsdp" else None)
    baseline = _status_kib("VmRSS")
    model = _model(args.d, _blocks_for(args.gib, args.d))
    total = sum(p.numel() * 4 for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    prepare_peak = _status_kib("VmHWM")
    _reset_peak()
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.d, generator=g)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        held = _held_bytes(model, optimizer)  # before zero_grad frees the gradients
        optimizer.zero_grad()
    mine = {
        "rank": accelerator.process_index,
        "train_peak": (_status_kib("VmHWM") - baseline) * 1024,
        "prepare_peak": (prepare_peak - baseline) * 1024,
        "model_bytes": total,
        **held,
    }
    from mpaccel.utils import gather_object

    ranks = gather_object([mine])
    return {"what": "memory", "mode": args.mode, "n": accelerator.num_processes, "ranks": ranks}


def job_throughput(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from mpaccel import Accelerator

    accelerator = Accelerator(fsdp_plugin=_plugin())
    blocks = args.blocks
    g = torch.Generator().manual_seed(accelerator.process_index)
    data = [torch.randn(args.batch, args.d, generator=g) for _ in range(8)]

    ours = _model(args.d, blocks)
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    ours, ours_opt = accelerator.prepare(ours, ours_opt)

    raw = _model(args.d, blocks)
    for block in raw.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(raw, reshard_after_forward=True)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-4)

    def step_ours(x: torch.Tensor) -> None:
        accelerator.backward(ours(x).pow(2).mean())
        ours_opt.step()
        ours_opt.zero_grad()

    def step_raw(x: torch.Tensor) -> None:
        raw(x).pow(2).mean().backward()
        raw_opt.step()
        raw_opt.zero_grad()

    variants = {"mpaccel": step_ours, "raw fully_shard": step_raw}
    windows: dict[str, list[float]] = {name: [] for name in variants}
    for step in variants.values():  # warm up both
        for x in data[:2]:
            step(x)
    names = list(variants)
    for round_ in range(args.rounds):
        order = names[round_ % 2:] + names[:round_ % 2]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.window):
                variants[name](data[i % len(data)])
            seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            windows[name].append(seconds.item())
    return {"what": "throughput", "n": accelerator.num_processes, "window": args.window,
            "batch": args.batch, "windows": windows}


def run_job(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = job_memory(args) if args.job == "memory" else job_throughput(args)
    from mpaccel import PartialState

    if PartialState().is_main_process:
        print(RESULT_TAG + json.dumps(result), flush=True)


# -- the driver (one process, starts the jobs) ----------------------------------------------------


def _launch(n: int, job_args: list[str], timeout: float) -> dict[str, Any]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    argv = [mpiexec, "-n", str(n), sys.executable, __file__, *job_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")


def _mib(value: float) -> str:
    return f"{value / (1 << 20):8.0f}"


def render_memory(results: list[dict[str, Any]]) -> list[str]:
    lines = ["memory per rank (MiB, max over ranks): training peak above the pre-model baseline;",
             "params + grads + optimizer state held locally (counted from the tensors)", "",
             f"{'mode':6} {'n':>2} {'train peak':>10} {'held':>8} {'prepare peak':>12}"]
    peaks: dict[tuple[str, int], float] = {}
    for r in results:
        peak = max(x["train_peak"] for x in r["ranks"])
        held = max(x["params"] + x["grads"] + x["optimizer"] for x in r["ranks"])
        prep = max(x["prepare_peak"] for x in r["ranks"])
        peaks[(r["mode"], r["n"])] = peak
        lines.append(f"{r['mode']:6} {r['n']:>2} {_mib(peak):>10} {_mib(held):>8} {_mib(prep):>12}")
    lines.append("")
    for (mode, n), peak in sorted(peaks.items()):
        ddp = peaks.get(("ddp", n))
        if mode == "fsdp" and ddp:
            lines.append(f"n={n}: FSDP peak / DDP peak = {peak / ddp:.3f} "
                         f"(x n = {n * peak / ddp:.2f}; target <= 1.2)")
    return lines


def render_throughput(results: list[dict[str, Any]]) -> list[str]:
    lines = ["step time (median window, slowest rank), mpaccel FSDP2 vs raw fully_shard", ""]
    for r in results:
        ours = statistics.median(r["windows"]["mpaccel"]) / r["window"]
        raw = statistics.median(r["windows"]["raw fully_shard"]) / r["window"]
        paired = [b / a for a, b in zip(r["windows"]["mpaccel"], r["windows"]["raw fully_shard"])]
        lines.append(f"n={r['n']}: mpaccel {ours * 1e3:.1f} ms/step, raw {raw * 1e3:.1f} ms/step, "
                     f"throughput ratio {raw / ours:.3f} (paired windows: median "
                     f"{statistics.median(paired):.3f}, {min(paired):.3f}-{max(paired):.3f}; "
                     f"target >= 0.97)")
    return lines


def drive(args: argparse.Namespace) -> None:
    common = ["--d", str(args.d), "--batch", str(args.batch), "--steps", str(args.steps)]
    memory, throughput = [], []
    lines_failed: list[str] = []
    if args.what in ("memory", "all"):
        for n in args.n:
            for mode in ("ddp", "fsdp"):
                print(f"memory: {mode} at n={n} ...", file=sys.stderr, flush=True)
                try:
                    memory.append(_launch(n, ["--job", "memory", "--mode", mode, "--gib",
                                              str(args.gib), *common], args.timeout))
                except RuntimeError as exc:  # a job the machine cannot hold (OOM-killed)
                    print(f"memory: {mode} at n={n} failed: {str(exc).splitlines()[0]}",
                          file=sys.stderr, flush=True)
                    lines_failed.append(f"{mode} n={n}: failed (killed: out of memory?)")
    if args.what in ("throughput", "all"):
        for n in [n for n in args.n if n > 1]:
            print(f"throughput at n={n} ...", file=sys.stderr, flush=True)
            throughput.append(_launch(n, ["--job", "throughput", "--blocks", str(args.blocks),
                                          "--rounds", str(args.rounds), "--window",
                                          str(args.window), "--d", str(args.throughput_d),
                                          "--batch", str(args.batch)], args.timeout))
    lines = list(lines_failed)
    if memory:
        lines += [*render_memory(memory), ""]
    if throughput:
        lines += render_throughput(throughput)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"memory": memory, "throughput": throughput}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", choices=["memory", "throughput"], help="run one job (under mpiexec)")
    p.add_argument("--mode", choices=["ddp", "fsdp"], default="fsdp")
    p.add_argument("--what", choices=["memory", "throughput", "all"], default="all")
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--gib", type=float, default=1.0, help="model size for the memory jobs")
    p.add_argument("--d", type=int, default=4096, help="block width for the memory jobs")
    p.add_argument("--throughput-d", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8, help="blocks for the throughput jobs")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.job:
        run_job(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
