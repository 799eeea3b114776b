"""Preemption: a signal -> a flag -> a collective check at a step boundary -> checkpoint ->
requeue -> exit; on restart, load_state() resumes.

The signal handler only records the signal (no I/O, no collectives: it may run in the middle of
anything). The training loop asks `should_stop()` at step boundaries; that is one MPI all-reduce
of an int, so every rank learns at the same step that some rank was signalled.
"""

from __future__ import annotations

import signal
import subprocess
import warnings
from collections.abc import Iterable
from typing import Any

from . import envvars, lifecycle
from .errors import MpaccelRuntimeWarning, with_hint

DEFAULT_SIGNALS = ("SIGUSR1", "SIGTERM")


def _signal_number(sig: int | str) -> int:
    if isinstance(sig, int):
        return sig
    name = sig.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return int(getattr(signal, name))
    except AttributeError:
        raise ValueError(f"unknown signal {sig!r}") from None


class Preemption:
    """Records preemption signals; `check(comm)` turns them into a collective decision.

    Args:
        signals: the signals to record, by number or name ("SIGUSR1", "TERM").
        requeue: whether the main process requeues the Slurm job once the preemption
            checkpoint is written.

    Raises:
        ValueError: for a signal name that does not exist.
    """

    def __init__(self, signals: Iterable[int | str] = DEFAULT_SIGNALS, requeue: bool = True):
        self.signals = [_signal_number(s) for s in signals]
        self.requeue = requeue
        self.received: int | None = None  # first signal seen by this process
        self.decided = False  # a check() answered True: every rank knows
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Not collective. Replaces the handlers of the chosen signals (main thread only)."""
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)

    def uninstall(self) -> None:
        """Not collective. Puts back the handlers install() replaced (main thread only)."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def _handle(self, number: int, frame: Any) -> None:
        if self.received is None:
            self.received = number

    def check(self, comm: Any) -> bool:
        """Collective: every rank must call it (one MPI all-reduce of an int, until it has
        answered True once). True on every rank once any rank has received a signal.

        Args:
            comm: the job's communicator (PartialState().comm).
        """
        if self.decided:
            return True
        self.decided = bool(
            comm.allreduce(
                1 if self.received is not None else 0, "max", "should_stop (preemption check)"
            )
        )
        return self.decided

    @property
    def signal_name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name


def job_id_for_requeue(env: envvars.Snapshot | None = None) -> str | None:
    """Not collective. The id `scontrol requeue` needs: ARRAYJOB_TASK for array tasks, else
    the job id; None outside Slurm.

    Args:
        env: the environment to read; None: the process's snapshot.
    """
    array_job = envvars.get("slurm_array_job_id", env)
    array_task = envvars.get("slurm_array_task_id", env)
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return envvars.get("slurm_job_id", env)


def requeue(env: envvars.Snapshot | None = None) -> bool:
    """Not collective (rank 0 calls it). Puts this Slurm job back in the queue with `scontrol
    requeue`; a failure is a warning. The job must have been submitted with --requeue (or
    JobRequeue=1).

    Args:
        env: the environment to read the job id from; None: the process's snapshot.

    Returns:
        Whether Slurm accepted.
    """
    job = job_id_for_requeue(env)
    if job is None:
        warnings.warn("not in a Slurm job: nothing to requeue", MpaccelRuntimeWarning, stacklevel=2)
        return False
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        warnings.warn(f"scontrol requeue {job} failed: {exc}", MpaccelRuntimeWarning, stacklevel=2)
        return False
    if result.returncode != 0:
        warnings.warn(
            with_hint(
                f"scontrol requeue {job} failed: {result.stderr.strip()}.",
                "submit the job with `#SBATCH --requeue`; the checkpoint was written, so "
                "resubmitting resumes.",
                " ",
            ),
            MpaccelRuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def restart_count(env: envvars.Snapshot | None = None) -> int:
    """Not collective. How many times Slurm restarted this job (0 on the first run or outside
    Slurm).

    Args:
        env: the environment to read; None: the process's snapshot.
    """
    return envvars.get_int("slurm_restart_count", env) or 0


def exit_cleanly(code: int = 0) -> None:
    """Not collective, but every rank should call it: flush and leave; SystemExit lets MPI
    finalise normally (lifecycle.end_job).

    Args:
        code: the exit status.
    """
    lifecycle.end_job(code)
