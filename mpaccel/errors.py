"""mpaccel's exceptions and warnings. Each message says what went wrong and ends with a HINT to
act on, written by with_hint()."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar


def with_hint(message: str, hint: str | None, separator: str = "\n") -> str:
    """`message` followed by `HINT: hint` (just `message` when there is no hint): the one way
    mpaccel writes a HINT. Errors give it a line of its own; warnings, which are one line,
    pass separator=" "."""
    return message if hint is None else f"{message}{separator}HINT: {hint}"


# The attribute on an Accelerate name mpaccel keeps importable but refuses to use (set by
# refused()): (message, hint), what using it raises (a ConfigurationError; an AttributeError
# for an attribute, so that hasattr() still answers). scripts/compat_table.py reads it to list
# the name as refused in docs/compatibility.md.
REFUSED = "__mpaccel_refused__"

_T = TypeVar("_T")


def refused(message: str, hint: str) -> Callable[[_T], _T]:
    """Decorator marking a class, function or property getter as one of Accelerate's names that
    mpaccel has only to refuse it: using it must raise ConfigurationError(message, hint). The
    marker states that refusal for the compatibility table; the object still raises it itself."""

    def mark(obj: _T) -> _T:
        setattr(obj, REFUSED, (message, hint))
        return obj

    return mark


class MpaccelWarning(UserWarning):
    """Base class of every warning mpaccel emits, so that one filter takes them all:
    warnings.filterwarnings("ignore", category=mpaccel.MpaccelWarning)."""


class MpaccelRuntimeWarning(MpaccelWarning, RuntimeWarning):
    """A warning about how the job runs (a launch that leaves part of a Slurm allocation idle,
    a block that may hang, a requeue Slurm refused). Also a RuntimeWarning, the category these
    warnings had before mpaccel had its own, so filters written for that still match."""


class MpaccelError(Exception):
    """Base class of every error mpaccel raises on purpose."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(with_hint(message, hint))

    def __reduce__(self):  # keep the (message, hint) split when pickled by mpi4py
        return (type(self), (self.message, self.hint))


class LaunchError(MpaccelError):
    """The way the job was launched does not add up (MPI vs Slurm vs launcher variables)."""


class ConfigurationError(MpaccelError, ValueError):
    """A configuration object or argument was given a value it cannot take."""


class RankFailure:
    """What one rank reports when it fails inside a collective operation."""

    __slots__ = ("exc_type", "host", "message", "rank", "traceback")

    def __init__(self, rank: int, host: str, exc_type: str, message: str, traceback: str) -> None:
        self.rank = rank
        self.host = host
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback

    def __reduce__(self):
        return (RankFailure, (self.rank, self.host, self.exc_type, self.message, self.traceback))

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, {self.exc_type}: {self.message})"


class CollectiveError(MpaccelError):
    """One or more ranks failed inside a collective operation; every rank raises this same error.

    `failures` maps each failing rank to its `RankFailure` (exception type, message, traceback).
    """

    def __init__(
        self,
        operation: str,
        failures: Mapping[int, RankFailure],
        hint: str | None = None,
    ) -> None:
        self.operation = operation
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [f"{operation} failed on rank(s) {ranks}:"]
        for failure in self.failures.values():
            lines.append(
                f"  rank {failure.rank} ({failure.host}): {failure.exc_type}: {failure.message}"
            )
        super().__init__("\n".join(lines), hint)

    def __reduce__(self):
        return (type(self), (self.operation, self.failures, self.hint))

    @property
    def failed_ranks(self) -> list[int]:
        return list(self.failures)

    def tracebacks(self) -> str:
        """Each failing rank's traceback, every line tagged with its rank."""
        out: list[str] = []
        for failure in self.failures.values():
            out.extend(f"[rank {failure.rank}] {line}" for line in failure.traceback.splitlines())
        return "\n".join(out)


class _Disagreement(CollectiveError, ConfigurationError):
    """Ranks that disagree, found on every rank from the same gathered facts: every rank
    raises the same error; `failures` stays empty (no rank failed), so rank 0 alone aborts
    the job when nobody catches it. Also a ConfigurationError."""

    def __init__(self, message: str, hint: str | None = None, operation: str = "") -> None:
        self.operation = operation
        self.failures = {}
        MpaccelError.__init__(self, message, hint)

    def __reduce__(self):
        return (type(self), (self.message, self.hint, self.operation))


class DistributedOperationException(_Disagreement):
    """Ranks passed tensors that a collective operation cannot combine (shapes or dtypes that
    differ across ranks), as Accelerate's exception of this name. The check runs on every rank
    on the same gathered facts, so every rank raises this same error; `failures` stays empty
    (no rank failed: they disagree) and the message lists what each rank passed. Also a
    ConfigurationError, which it was before it had Accelerate's name."""


class SettingsMismatchError(_Disagreement):
    """Ranks resolved a setting they must share (the FSDP plugin, mixed precision, the mesh,
    gradient accumulation, ...) to different values (mpaccel/shared_settings.py). The message
    names each setting, its values and the ranks holding each."""


class PeerFailedError(CollectiveError):
    """This rank was waiting in a collective when another rank reported a failure (under the
    pytest plugin: a failed test); the collective is abandoned instead of waiting forever."""


class CollectiveMismatchError(MpaccelError):
    """Ranks wait in different collectives that can never match (they took different code
    paths); raised after a few seconds instead of waiting for the timeout."""


class CollectiveTimeoutError(MpaccelError, TimeoutError):
    """A collective did not complete in time; names the ranks that never arrived."""

    def __init__(
        self,
        operation: str,
        timeout: float,
        missing: Sequence[int],
        hosts: Mapping[int, str],
        arrived: Sequence[int],
        hint: str | None = None,
    ) -> None:
        self.operation = operation
        self.timeout = timeout
        self.missing = list(missing)
        self.arrived = list(arrived)
        self.hosts = dict(hosts)
        where = ", ".join(f"{r} ({self.hosts.get(r, '?')})" for r in self.missing) or "unknown"
        message = (
            f"{operation} timed out after {timeout:g} s: rank(s) {where} never arrived; "
            f"rank(s) {', '.join(map(str, self.arrived)) or 'none'} were waiting"
        )
        if hint is None:
            hint = (
                "look at what the missing rank(s) were doing (py-spy dump --pid, or their "
                "traceback); a rank that skipped this call, or is stuck in another collective, "
                "is the usual cause. If they had gone past this call (stuck in gloo or NCCL, "
                "or their logs show them further on), the MPI library may move a message only "
                "while its sender is inside MPI: set MPACCEL_MPI_PROGRESS=1 (docs/slurm.md). "
                "Raise the limit with wait_for_everyone(timeout=...), "
                "InitProcessGroupKwargs(timeout=...) or MPACCEL_TIMEOUT=<seconds>."
            )
        super().__init__(message, hint)

    def __reduce__(self):
        return (
            type(self),
            (self.operation, self.timeout, self.missing, self.hosts, self.arrived, self.hint),
        )


class CheckpointError(MpaccelError):
    """A checkpoint cannot be written, found, read or trusted; names the file and key."""


class CheckpointCollectiveError(CollectiveError, CheckpointError):
    """A save or load failed on one or more ranks: raised on every rank, naming each failing
    rank's error (`.failures`). Both a CollectiveError and a CheckpointError, so that either
    `except` catches it."""


class StalledIOError(MpaccelError, TimeoutError):
    """No checkpoint I/O of this process ended within the limit (see within())."""
