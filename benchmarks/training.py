"""Training-step throughput on CPU: mpaccel vs raw torch DDP vs Hugging Face Accelerate.

A benchmark, not a test: it prints figures and asserts nothing about them.

The same MLP (64 -> 512 -> 512 -> 10, AdamW), the same synthetic data (generated locally from a
fixed seed), batch 64 per rank, the same torch thread count everywhere. One mpiexec job per
framework; inside a job the variants are interleaved window by window (the order rotates every
round), so slow phases of a noisy machine hit every variant alike:

  mpaccel job:     mpaccel, mpaccel + check_trigger() every step,
                   raw DDP, raw DDP + a 1-element gloo all_reduce every step
                   (raw DDP runs on the gloo process group mpaccel created)
  accelerate job:  accelerate, accelerate + check_trigger() every step,
                   raw DDP, raw DDP + all_reduce (on the group Accelerate created)

Each window is `--steps` timed steps after a few untimed ones, between gloo barriers; its
throughput is global samples / the slowest rank's time. A job reports the median window.

Usage (from the repository root, mpaccel's venv active):

  python benchmarks/training.py                       # everything available, one table:
                                                      # n=2 and n=4, 3 jobs per framework each
  python benchmarks/training.py --n 2 --repeats 1     # quicker
  python benchmarks/training.py --accelerate-python /path/to/venv/bin/python
  python benchmarks/training.py --json results.json   # also keep every window

  # one job by hand (prints its own summary from rank 0):
  OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/training.py --framework mpaccel
  OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 \\
      mpiexec -n 2 /tmp/venv-accel/bin/python benchmarks/training.py --framework accelerate

Accelerate is looked for at /tmp/venv-accel/bin/python (a separate venv:
`python3 -m venv /tmp/venv-accel && /tmp/venv-accel/bin/pip install torch==2.13.0 mpi4py mpich
accelerate numpy`); without it the accelerate rows are skipped. Under mpiexec Accelerate reads
PMI_RANK/PMI_SIZE/MPI_LOCALRANKID/MPI_LOCALNRANKS (MPICH) and needs MASTER_ADDR/MASTER_PORT and
`Accelerator(cpu=True)` to choose MULTI_CPU over gloo; the job checks that it did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RESULT_TAG = "TRAINING_BENCH_RESULT "
BATCH = 64
FEATURES = 64
CLASSES = 10
DEFAULT_ACCELERATE_PYTHON = "/tmp/venv-accel/bin/python"

# Variant names, in table order.
MPACCEL, MPACCEL_TRIGGER = "mpaccel", "mpaccel + check_trigger"
DDP, DDP_ALLREDUCE = "raw DDP", "raw DDP + all_reduce"
ACCEL, ACCEL_TRIGGER = "accelerate", "accelerate + check_trigger"
ORDER = [MPACCEL, MPACCEL_TRIGGER, ACCEL, ACCEL_TRIGGER, DDP, DDP_ALLREDUCE]


# -- one job (runs on every rank) ------------------------------------------------------------------


def _model(hidden: int) -> Any:
    import torch

    torch.manual_seed(0)  # the same initial weights for every variant and framework
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


def _dataset(samples: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def _forever(loader: Any, set_epoch: Callable[[int], None] | None) -> Iterator[Any]:
    epoch = 0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1


class Variant:
    """One way of running a training step; keeps its own model, optimizer and data.

    `timed_call` variants add a per-step collective (check_trigger, or the 1-element all_reduce)
    and add the seconds spent inside it to `in_call`."""

    def __init__(self, name: str, timed_call: bool = False) -> None:
        self.name = name
        self.timed_call = timed_call
        self.step: Callable[[], None] = lambda: None
        self.in_call = 0.0
        self.windows: list[float] = []  # seconds per window, this rank
        self.call_seconds: list[float] = []  # per window: seconds inside the collective
        self.cpu_seconds: list[float] = []  # per window: CPU time of this process, all threads


def _ddp_variants(dist: Any, hidden: int, dataset: Any, lr: float) -> list[Variant]:
    """Raw torch DDP on the already initialised default (gloo) group."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    out = []
    for name in (DDP, DDP_ALLREDUCE):
        model = DistributedDataParallel(_model(hidden))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
        batches = _forever(loader, sampler.set_epoch)
        v = Variant(name, timed_call=name == DDP_ALLREDUCE)

        def step(model=model, opt=opt, batches=batches, v=v):
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if v.timed_call:  # as Accelerate's check_trigger: all_reduce a 0-d tensor, .item()
                t0 = time.perf_counter()
                flag = torch.tensor(0)
                dist.all_reduce(flag)
                flag.item()
                v.in_call += time.perf_counter() - t0

        v.step = step
        out.append(v)
    return out


def _framework_variants(
    acc_cls: Any, names: tuple[str, str], hidden: int, dataset: Any, lr: float, **acc_kwargs: Any
) -> tuple[Any, list[Variant]]:
    """The Accelerator API, mpaccel's or Accelerate's: prepare, backward, (check_trigger)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    acc = acc_cls(**acc_kwargs)
    out = []
    for name in names:
        model = _model(hidden)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        batches = _forever(loader, getattr(loader, "set_epoch", None))
        v = Variant(name, timed_call=name == names[1])

        def step(model=model, opt=opt, batches=batches, v=v):
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if v.timed_call:
                t0 = time.perf_counter()
                acc.check_trigger()
                v.in_call += time.perf_counter() - t0

        v.step = step
        out.append(v)
    return acc, out


def _default_threads(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)  # one node: every rank is local


def run_job(args: argparse.Namespace) -> None:
    """Collective: every rank of the mpiexec job runs this."""
    import torch

    lr = 1e-3
    dataset = _dataset(args.samples)
    if args.framework == "mpaccel":
        from mpaccel import Accelerator

        acc, variants = _framework_variants(
            Accelerator, (MPACCEL, MPACCEL_TRIGGER), args.hidden, dataset, lr
        )
        import torch.distributed as dist  # initialised by mpaccel's PartialState (size > 1)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        acc, variants = _framework_variants(
            Accelerator, (ACCEL, ACCEL_TRIGGER), args.hidden, dataset, lr, cpu=True
        )
        import torch.distributed as dist

        expected = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
        if acc.distributed_type != DistributedType.MULTI_CPU or acc.num_processes != expected:
            raise SystemExit(
                f"Accelerate did not set up MULTI_CPU over {expected} processes: got "
                f"distributed_type={acc.distributed_type!r}, num_processes={acc.num_processes!r}"
            )
    if not dist.is_initialized():
        raise SystemExit("torch.distributed is not initialised: run this under mpiexec -n N, N > 1")
    world, rank = dist.get_world_size(), dist.get_rank()
    threads = args.threads or _default_threads(world)
    torch.set_num_threads(threads)  # after the Accelerator: both may have set their own
    variants += _ddp_variants(dist, args.hidden, dataset, lr)

    for v in variants:
        for _ in range(args.warmup):
            v.step()
    k = len(variants)
    for r in range(args.rounds):
        for v in variants[r % k :] + variants[: r % k]:
            for _ in range(args.rewarm):
                v.step()
            dist.barrier()
            v.in_call = 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                v.step()
            v.windows.append(time.perf_counter() - t0)
            v.cpu_seconds.append(time.process_time() - c0)
            v.call_seconds.append(v.in_call)

    # Slowest rank per window; threads from every rank.
    seconds = torch.tensor([w for v in variants for w in v.windows], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    calls = torch.tensor([c for v in variants for c in v.call_seconds], dtype=torch.float64)
    dist.all_reduce(calls, op=dist.ReduceOp.SUM)
    # CPU over all ranks: the work done, whatever else the machine was running (a waiting rank
    # that spins shows up here, one that sleeps does not).
    cpu = torch.tensor([c for v in variants for c in v.cpu_seconds], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    per_rank_threads: list[Any] = [None] * world
    dist.all_gather_object(per_rank_threads, torch.get_num_threads())
    if rank != 0:
        return
    samples = BATCH * world * args.steps
    result: dict[str, Any] = {
        "framework": args.framework,
        "n": world,
        "threads": per_rank_threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "backend": dist.get_backend(),
        "distributed_type": str(acc.distributed_type),
        "num_processes": acc.num_processes,
        "hidden": args.hidden,
        "steps": args.steps,
        "rounds": args.rounds,
        "variants": {},
    }
    if args.framework == "accelerate":
        import accelerate

        result["accelerate"] = accelerate.__version__
    per = args.rounds
    for i, v in enumerate(variants):
        windows = seconds[i * per : (i + 1) * per].tolist()
        in_call = calls[i * per : (i + 1) * per].tolist()
        cpu_us = [c / args.steps * 1e6 for c in cpu[i * per : (i + 1) * per].tolist()]
        result["variants"][v.name] = {
            "samples_per_s": [samples / w for w in windows],
            "cpu_us_per_step": cpu_us,  # summed over ranks
            # mean over ranks of the time spent in the per-step collective, µs per step
            "in_call_us": [c / world / args.steps * 1e6 for c in in_call] if v.timed_call else None,
        }
    print(RESULT_TAG + json.dumps(result), flush=True)
    if args.print_summary:
        print(render([result]), flush=True)


# -- summary -----------------------------------------------------------------------------------


def _step_us(samples_per_s: float, n: int) -> float:
    return BATCH * n / samples_per_s * 1e6


def _job_medians(job: dict) -> dict[str, float]:
    return {name: statistics.median(v["samples_per_s"]) for name, v in job["variants"].items()}


def _job_cpu(job: dict, name: str) -> float:
    return statistics.median(job["variants"][name]["cpu_us_per_step"])


def _fmt_range(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def render(jobs: list[dict]) -> str:
    """Markdown tables: per n, the median over jobs of each job's median window, the spread of
    the job medians, and the ratios and per-step overheads asked for."""
    lines: list[str] = []
    for n in sorted({j["n"] for j in jobs}):
        at_n = [j for j in jobs if j["n"] == n]
        by_fw: dict[str, list[dict]] = {}
        for j in at_n:
            by_fw.setdefault(j["framework"], []).append(j)
        threads = sorted({t for j in at_n for t in j["threads"]})
        lines.append(
            f"\n### n = {n}  (torch threads per rank: {threads}; batch {BATCH}/rank; "
            f"jobs: " + ", ".join(f"{fw} x{len(js)}" for fw, js in by_fw.items()) + ")\n"
        )
        lines.append(
            "| variant | job | samples/s (median) | spread of job medians | "
            "step (µs) | windows min-max | in-call µs/step | CPU µs/step, all ranks |"
        )
        lines.append("|---|---|---:|---|---:|---|---:|---:|")
        for fw, js in by_fw.items():
            names = [name for name in ORDER if name in js[0]["variants"]]
            for name in names:
                meds = [_job_medians(j)[name] for j in js]
                allw = [w for j in js for w in j["variants"][name]["samples_per_s"]]
                calls = [c for j in js for c in (j["variants"][name]["in_call_us"] or [])]
                med = statistics.median(meds)
                in_call = f"{statistics.median(calls):,.0f}" if calls else ""
                cpus = [_job_cpu(j, name) for j in js if "cpu_us_per_step" in j["variants"][name]]
                cpu = f"{statistics.median(cpus):,.0f}" if cpus else ""
                lines.append(
                    f"| {name} | {fw} | {med:,.0f} | {_fmt_range(meds, ',.0f')} | "
                    f"{_step_us(med, n):,.0f} | {_fmt_range(allw, ',.0f')} | {in_call} | {cpu} |"
                )
        lines.append("")
        lines.extend(_ratios(n, by_fw))
    return "\n".join(lines)


def _paired(job: dict, a: str, b: str, f: Callable[[float, float], float]) -> float:
    """Median over rounds of f(a's window, b's window) in the same round: windows a few seconds
    apart, so a slow phase of the machine mostly hits both."""
    wa, wb = job["variants"][a]["samples_per_s"], job["variants"][b]["samples_per_s"]
    return statistics.median(f(x, y) for x, y in zip(wa, wb))


def _ratios(n: int, by_fw: dict[str, list[dict]]) -> list[str]:
    out = ["| figure | median over jobs | per-job range | note |", "|---|---:|---|---|"]

    def ratio(fw: str, a: str, b: str) -> list[float]:
        return [_paired(j, a, b, lambda x, y: x / y) for j in by_fw.get(fw, [])]

    def delta_us(fw: str, a: str, b: str) -> list[float]:
        return [
            _paired(j, a, b, lambda x, y: _step_us(x, n) - _step_us(y, n))
            for j in by_fw.get(fw, [])
        ]

    def median_of(fw: str, name: str) -> float | None:
        js = by_fw.get(fw)
        return statistics.median(_job_medians(j)[name] for j in js) if js else None

    def row(label: str, values: list[float], fmt: str, note: str = "") -> None:
        if values:
            out.append(
                f"| {label} | {format(statistics.median(values), fmt)} | "
                f"{_fmt_range(values, fmt)} | {note} |"
            )

    row(
        "mpaccel / raw DDP (paired windows)",
        ratio("mpaccel", MPACCEL, DDP),
        ".3f",
        "target >= 0.97",
    )
    row("accelerate / raw DDP (paired windows)", ratio("accelerate", ACCEL, DDP), ".3f")
    for fw, name in (("mpaccel", MPACCEL), ("accelerate", ACCEL)):
        cpu = [
            _job_cpu(j, name) / _job_cpu(j, DDP)
            for j in by_fw.get(fw, [])
            if "cpu_us_per_step" in j["variants"][name]
        ]
        row(f"CPU per step: {name} / raw DDP", cpu, ".3f", "median windows, same job")
    m, a = median_of("mpaccel", MPACCEL), median_of("accelerate", ACCEL)
    if m and a:
        row("mpaccel / accelerate (medians, across jobs)", [m / a], ".3f", "target >= 1.0")
        dm = statistics.median(ratio("mpaccel", MPACCEL, DDP))
        da = statistics.median(ratio("accelerate", ACCEL, DDP))
        row("(mpaccel/DDP) / (accelerate/DDP)", [dm / da], ".3f", "the same, via each job's DDP")
    for label, fw, a_, b_, note in (
        ("mpaccel check_trigger: Δ step µs", "mpaccel", MPACCEL_TRIGGER, MPACCEL, "MPI int"),
        ("accelerate check_trigger: Δ step µs", "accelerate", ACCEL_TRIGGER, ACCEL, "gloo"),
        ("raw DDP + all_reduce: Δ step µs", "mpaccel", DDP_ALLREDUCE, DDP, "in mpaccel's job"),
        ("raw DDP + all_reduce: Δ step µs", "accelerate", DDP_ALLREDUCE, DDP, "in Accelerate's"),
    ):
        row(label, delta_us(fw, a_, b_), ".0f", note)
    loads = [
        j["other_load"] for js in by_fw.values() for j in js if j.get("other_load") is not None
    ]
    if loads:
        row("CPU used by other processes during the jobs (cores)", loads, ".2f", "of 2")
    return out


# -- the driver (plain python: launches the jobs) ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle since boot (Linux), -1 elsewhere."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return -1.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _wait_for_quiet(limit: float, threshold: float = 0.3, sample: float = 2.0) -> float:
    """On a shared machine, wait (at most `limit` seconds) until other processes use less than
    `threshold` cores over `sample` seconds. Returns that last sample (cores in use)."""
    deadline = time.monotonic() + limit
    while True:
        before = _busy_seconds()
        time.sleep(sample)
        used = (_busy_seconds() - before) / sample
        if before < 0 or used < threshold or time.monotonic() >= deadline:
            return used


def _children_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _mpiexec_for(python: str) -> str:
    beside = Path(python).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise SystemExit(f"no mpiexec beside {python} nor on PATH: pip install mpich")
    return found


def _launch(framework: str, python: str, n: int, threads: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if framework == "accelerate":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cmd = [
        _mpiexec_for(python),
        "-n",
        str(n),
        python,
        os.path.abspath(__file__),
        "--framework",
        framework,
        "--threads",
        str(threads),
        "--hidden",
        str(args.hidden),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--warmup",
        str(args.warmup),
        "--rewarm",
        str(args.rewarm),
        "--samples",
        str(args.samples),
        "--no-summary",
    ]
    quiet = _wait_for_quiet(args.wait_idle) if args.wait_idle > 0 else None
    print(f"# OMP_NUM_THREADS={threads} " + " ".join(cmd), file=sys.stderr, flush=True)
    busy0, ours0, t0 = _busy_seconds(), _children_seconds(), time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout)
    busy, ours, wall = _busy_seconds() - busy0, _children_seconds() - ours0, time.monotonic() - t0
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            job = json.loads(line[len(RESULT_TAG) :])
            # The machine may be shared: how many cores, on average, went to other processes.
            job["other_load"] = max(0.0, busy - ours) / wall if busy >= 0 else None
            job["load_before"] = quiet
            return job
    raise SystemExit(
        f"{framework} job (n={n}) failed with exit code {done.returncode}:\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


def _accelerate_usable(python: str) -> bool:
    if not os.path.exists(python):
        return False
    probe = subprocess.run(
        [python, "-c", "import accelerate, torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        print(f"# {python} cannot import accelerate: skipping it", file=sys.stderr)
        return False
    if "+cpu" not in probe.stdout and "cpu" not in probe.stdout:
        print(f"# note: {python} has torch {probe.stdout.strip()}", file=sys.stderr)
    return True


def drive(args: argparse.Namespace) -> None:
    frameworks = ["mpaccel"]
    accel_python = args.accelerate_python
    if accel_python and _accelerate_usable(accel_python):
        frameworks.append("accelerate")
    else:
        print("# Accelerate not available: mpaccel and raw DDP only", file=sys.stderr)
    pythons = {"mpaccel": sys.executable, "accelerate": accel_python}
    jobs = []
    for repeat in range(args.repeats):
        for n in args.n:
            threads = args.threads or _default_threads(n)
            # Alternate which framework goes first, so drifts of the machine do not favour one.
            for fw in frameworks if repeat % 2 == 0 else frameworks[::-1]:
                job = _launch(fw, pythons[fw], n, threads, args)
                jobs.append(job)
                if args.json:  # after every job: a long run interrupted keeps what it measured
                    Path(args.json).write_text(json.dumps(jobs, indent=1))
                brief = ", ".join(f"{k} {v:,.0f}" for k, v in _job_medians(job).items())
                load = job["other_load"]
                print(
                    f"#   n={n} {fw}: {brief} samples/s; other processes' load "
                    + ("?" if load is None else f"{load:.2f} cores"),
                    file=sys.stderr,
                    flush=True,
                )
    print(render(jobs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--framework",
        choices=["mpaccel", "accelerate"],
        help="run one job (under mpiexec) instead of driving all of them",
    )
    p.add_argument("--n", type=int, nargs="+", default=[2, 4], help="process counts (driver)")
    p.add_argument("--repeats", type=int, default=3, help="jobs per framework and n (driver)")
    p.add_argument(
        "--accelerate-python",
        default=DEFAULT_ACCELERATE_PYTHON,
        help="python of a venv with accelerate ('' to skip)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per rank (default: cores // ranks, at least 1)",
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=50, help="timed steps per window")
    p.add_argument("--rounds", type=int, default=20, help="windows per variant per job")
    p.add_argument("--warmup", type=int, default=30, help="untimed steps per variant at start")
    p.add_argument("--rewarm", type=int, default=5, help="untimed steps before each window")
    p.add_argument("--samples", type=int, default=65536, help="synthetic dataset size")
    p.add_argument("--json", help="driver: write every job's raw results here")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=120,
        help="driver: before each job, wait up to this many seconds for other processes to "
        "leave the CPUs (0: don't wait); the CPU they took during each job is reported anyway",
    )
    p.add_argument("--job-timeout", type=float, default=900)
    p.add_argument("--no-summary", dest="print_summary", action="store_false")
    args = p.parse_args(argv)
    if args.framework:
        run_job(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
