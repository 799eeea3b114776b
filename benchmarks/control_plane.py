"""Control-plane latency: mpaccel's wait_for_everyone / check_trigger against raw MPI and gloo.

Collective: run it under a launcher, e.g. `mpiexec -n 2 python benchmarks/control_plane.py`.
Every rank times every op; rank 0 prints the table. A benchmark, not a test: it prints PASS/MISS
per target and exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from mpaccel import Accelerator, PartialState

MISSING = -1  # a sample slot an op skipped (the triggered check runs on some iterations only)


@dataclass
class Op:
    name: str
    run: Callable[[int], Any]
    every: int = 1  # measured on iterations where it % every == 0
    prepare: Callable[[int], None] | None = None  # untimed, before the aligning barrier
    expect: Any = None  # what run() must return on every rank (None: not checked)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000, help="timed iterations (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="untimed iterations first (default 200)")
    p.add_argument(
        "--trigger-every",
        type=int,
        default=5,
        help="measure a triggered check_trigger on every Nth iteration (default 5)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--mpi-only",
        action="store_true",
        help="only mpaccel's and raw MPI's ops: gloo and Accelerate ops slow down whatever "
        "runs after them, so this isolates mpaccel vs raw MPI",
    )
    return p.parse_args(argv)


def accelerate_ops(every: int, trigger_every: int) -> tuple[list[Op], str]:
    """Hugging Face Accelerate's wait_for_everyone / check_trigger, if it is importable.

    Accelerate's PartialState reuses the process group mpaccel already initialised, so both
    measure the same gloo group; only the Python wrapped around it differs."""
    try:
        import accelerate
    except ImportError:
        return [], "accelerate: not installed"
    state = accelerate.PartialState(cpu=True)
    acc = accelerate.Accelerator(cpu=True)
    last = state.num_processes - 1
    if state.num_processes != MPI.COMM_WORLD.Get_size():
        return [], (
            f"accelerate {accelerate.__version__}: sees {state.num_processes} processes, "
            f"not {MPI.COMM_WORLD.Get_size()}; skipped"
        )

    def arm(it: int) -> None:
        if state.process_index == last:
            acc.set_trigger()

    ops = [
        Op("accelerate wait_for_everyone", lambda it: state.wait_for_everyone(), every),
        Op("accelerate check_trigger", lambda it: acc.check_trigger(), every, expect=False),
        Op(
            "accelerate check_trigger (triggered)",
            lambda it: acc.check_trigger(),
            every * trigger_every,
            prepare=arm,
            expect=True,
        ),
    ]
    return ops, f"accelerate {accelerate.__version__}"


def build_ops(args: argparse.Namespace) -> tuple[list[Op], list[str]]:
    world = MPI.COMM_WORLD
    state = PartialState()
    acc = Accelerator()
    last = state.num_processes - 1

    def arm(it: int) -> None:
        if state.process_index == last:
            acc.set_trigger()

    notes = []
    ops = [
        Op("mpaccel wait_for_everyone", lambda it: state.wait_for_everyone()),
        Op("mpaccel check_trigger", lambda it: acc.check_trigger(), expect=False),
        Op(
            "mpaccel check_trigger (triggered)",
            lambda it: acc.check_trigger(),
            args.trigger_every,
            prepare=arm,
            expect=True,
        ),
        Op("MPI Barrier", lambda it: world.Barrier()),
        Op("MPI allreduce(int, MAX)", lambda it: world.allreduce(it, op=MPI.MAX)),
    ]
    if args.mpi_only:
        notes.append("--mpi-only: no gloo, no Accelerate ops in this run")
        return ops, notes
    if dist.is_initialized():
        # mpaccel's PartialState set this group up (gloo over a TCPStore brokered by MPI).
        flag = torch.zeros(1, dtype=torch.int64)
        ops += [
            Op("gloo barrier", lambda it: dist.barrier()),
            Op("gloo all_reduce(1 elem)", lambda it: dist.all_reduce(flag, op=dist.ReduceOp.MAX)),
            # the same through mpaccel: a copy, then gloo, then the wait for gloo to let go
            Op("mpaccel reduce(1 elem)", lambda it: acc.reduce(flag, "max")),
        ]
        notes.append(f"gloo: {dist.get_backend()} default group from mpaccel")
    else:
        notes.append("gloo: no process group (size 1)")
    extra, note = accelerate_ops(1, args.trigger_every)
    ops += extra
    notes.append(note)
    return ops, notes


def measure(ops: list[Op], iters: int, warmup: int) -> tuple[np.ndarray, int]:
    """Collective. Interleaved rounds: every iteration runs each op once, in a random order
    drawn from the iteration number (so the same on every rank), each behind a raw MPI Barrier
    that aligns the ranks. A random order, not a rotation, because an op slows down whatever
    follows it (gloo's threads stay busy for a while): under a rotation every op would always
    follow the same neighbour. Returns this rank's durations in ns, shape (ops, iters), and
    the count of results that differed from `Op.expect`."""
    world = MPI.COMM_WORLD
    samples = np.full((len(ops), iters), MISSING, dtype=np.int64)
    wrong = 0
    clock = time.perf_counter_ns
    n = len(ops)
    for it in range(warmup + iters):
        for k in np.random.default_rng(it).permutation(n):
            op = ops[k]
            if it % op.every:
                continue
            if op.prepare is not None:
                op.prepare(it)
            world.Barrier()
            t0 = clock()
            result = op.run(it)
            t1 = clock()
            if op.expect is not None and result != op.expect:
                wrong += 1
            if it >= warmup:
                samples[k, it - warmup] = t1 - t0
    return samples, wrong


def stats(row: np.ndarray) -> dict[str, float]:
    x = row[row != MISSING] / 1e3
    if x.size == 0:
        return {"n": 0, "median_us": float("nan"), "p10_us": float("nan"), "p90_us": float("nan")}
    p10, p50, p90 = np.percentile(x, [10, 50, 90])
    return {"n": int(x.size), "median_us": p50, "p10_us": p10, "p90_us": p90}


# (name, numerator, denominator, comparison, target)
RATIOS = [
    ("mpaccel wait_for_everyone / MPI Barrier", "mpaccel wait_for_everyone", "MPI Barrier",
     "<=", 1.5),
    ("gloo barrier / mpaccel wait_for_everyone", "gloo barrier", "mpaccel wait_for_everyone",
     ">=", 10.0),
    ("mpaccel check_trigger / MPI allreduce(int)", "mpaccel check_trigger",
     "MPI allreduce(int, MAX)", "<=", 1.5),
    ("gloo all_reduce / mpaccel check_trigger", "gloo all_reduce(1 elem)",
     "mpaccel check_trigger", ">=", 10.0),
    ("mpaccel reduce / gloo all_reduce", "mpaccel reduce(1 elem)", "gloo all_reduce(1 elem)",
     None, None),
    ("accelerate wait_for_everyone / mpaccel", "accelerate wait_for_everyone",
     "mpaccel wait_for_everyone", None, None),
    ("accelerate check_trigger / mpaccel", "accelerate check_trigger",
     "mpaccel check_trigger", None, None),
]  # fmt: skip


def ratios(table: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, num, den, cmp, target in RATIOS:
        if num not in table or den not in table:
            continue
        value = table[num]["median_us"] / table[den]["median_us"]
        entry: dict[str, Any] = {"value": value, "target": target, "cmp": cmp}
        if target is not None:
            entry["pass"] = bool(value <= target if cmp == "<=" else value >= target)
        out[name] = entry
    return out


def report(
    ops: list[Op],
    worst: np.ndarray,
    mine: np.ndarray,
    wrong: int,
    notes: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    size = MPI.COMM_WORLD.Get_size()
    table = {}
    for k, op in enumerate(ops):
        table[op.name] = stats(worst[k])
        table[op.name]["rank0_median_us"] = stats(mine[k])["median_us"]
    rat = ratios(table)
    lib = MPI.Get_library_version().strip().splitlines()[0]
    print(f"control plane, {size} ranks on {os.cpu_count()} cores; {args.iters} iterations after "
          f"{args.warmup} warm-up; per iteration, the slowest rank's time")  # fmt: skip
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"mpi4py {sys.modules['mpi4py'].__version__}, {lib}")  # fmt: skip
    for note in notes:
        print(note)
    print()
    print(f"{'op':40} {'n':>6} {'median µs':>10} {'p10':>9} {'p90':>9}")
    for name, s in table.items():
        print(f"{name:40} {s['n']:>6} {s['median_us']:>10.1f} {s['p10_us']:>9.1f} "
              f"{s['p90_us']:>9.1f}")  # fmt: skip
    print()
    for name, r in rat.items():
        verdict = ""
        if r["target"] is not None:
            verdict = f"(target {r['cmp']} {r['target']:g}x)  {'PASS' if r['pass'] else 'MISS'}"
        print(f"{name:44} {r['value']:7.2f}x  {verdict}")
    if wrong:
        print(f"WARNING: {wrong} check_trigger results differed from the expected value")
    return {
        "ranks": size,
        "cores": os.cpu_count(),
        "iters": args.iters,
        "warmup": args.warmup,
        "trigger_every": args.trigger_every,
        "statistic": "per-iteration max over ranks; rank0_median_us is rank 0's own",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi4py": sys.modules["mpi4py"].__version__,
        "mpi_library": lib,
        "notes": notes,
        "wrong_results": wrong,
        "ops": table,
        "ratios": rat,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    ops, notes = build_ops(args)
    # Other work on the machine skews everything here (2 ranks already fill 2 cores): say so.
    notes.append("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    mine, wrong = measure(ops, args.iters, args.warmup)
    worst = np.empty_like(mine) if world.Get_rank() == 0 else None
    world.Reduce(mine, worst, op=MPI.MAX, root=0)
    wrong = world.reduce(wrong, op=MPI.SUM, root=0)
    if world.Get_rank() == 0:
        assert worst is not None
        result = report(ops, worst, mine, wrong, notes, args)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
    world.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
