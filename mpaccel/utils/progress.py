"""`tqdm` with Accelerate's module path (`mpaccel.utils.tqdm`), made for launchers: a live bar
where the user's terminal can be reached, plain periodic lines in batch logs.

mpiexec and srun give their ranks pipes, not the terminal, so tqdm's own test (`isatty`)
cannot see one. MPACCEL_PROGRESS chooses: `bar`, `lines`, `off`, or `auto` (the default):
a bar if this process writes to a terminal, or if the launcher that copies its output (mpiexec,
mpirun, prterun and their node proxies, found among this process's parents in /proc) writes
to one; lines otherwise (sbatch's output file, a pipe to tee, a remote node's proxy, srun).
"""

from __future__ import annotations

import functools
import os
import stat
import sys
import time
from typing import Any

from .. import envvars

# MPACCEL_PROGRESS values, each to the mode it asks for
_MODES = {
    "auto": "auto",
    "bar": "bar",
    "1": "bar",
    "true": "bar",
    "yes": "bar",
    "on": "bar",
    "lines": "lines",
    "off": "off",
    "0": "off",
    "false": "off",
    "no": "off",
}
# Launchers that copy their ranks' output into their own (mpiexec -> hydra_pmi_proxy -> rank;
# prterun -> prted -> rank), as /proc/<pid>/comm names them (15 characters at most).
_FORWARDERS = frozenset(
    {
        "mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpirun.mpich",
        "mpiexec.openmpi", "mpirun.openmpi", "hydra_pmi_proxy", "prterun", "prted", "prte",
        "orterun", "orted",
    }
)  # fmt: skip
_TERMINALS = ("/dev/pts/", "/dev/tty", "/dev/console")
LINE_EVERY_PERCENT = 10
LINE_EVERY_SECONDS = 30.0


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """Not collective. A tqdm progress bar, shown by the main process only by default.
    Accelerate shows one per node; under mpiexec and srun every node's output reaches the same
    terminal or log, so one per job. How it shows is MPACCEL_PROGRESS's choice (module
    docstring). Needs the `tqdm` package.

    Args:
        *args: tqdm's positional arguments (the iterable first).
        main_process_only: show it on the main process only; False: on every process.
        **kwargs: tqdm's keyword arguments (desc=, total=, ...); `disable=True` hides it.

    Raises:
        ImportError: when tqdm is not installed.
        ValueError: when the first argument is a bool (Accelerate's old positional
            main_process_only): pass it as a keyword.
    """
    try:
        from tqdm.auto import tqdm as live_bar
    except ImportError as exc:
        raise ImportError(
            "mpaccel.utils.tqdm needs the tqdm package: pip install tqdm"
        ) from exc
    if args and isinstance(args[0], bool):
        raise ValueError(
            "tqdm(True/False, ...): pass main_process_only= as a keyword; the first argument is "
            "the iterable"
        )
    stream = kwargs.get("file") or sys.stderr
    wanted = _wanted()  # read on every process: a bad value is an error on all of them
    if kwargs.pop("disable", False) is True or (main_process_only and not _is_main()):
        wanted = "off"
    mode = _auto(stream) if wanted == "auto" else wanted
    if mode == "lines":
        return _lines_class()(*args, **kwargs)
    if mode == "bar" and not _isatty(stream) and "ncols" not in kwargs:
        # the launcher's terminal, not this process's pipe, sets the width
        kwargs.setdefault("dynamic_ncols", False)
        kwargs["ncols"] = _launcher_columns(stream)
    return live_bar(*args, disable=mode == "off", **kwargs)


def _wanted() -> str:
    # the table checks the value (a ConfigurationError naming MPACCEL_PROGRESS otherwise)
    return _MODES[envvars.get_choice("progress") or "auto"]


def _auto(stream: Any) -> str:
    if _isatty(stream) or _launcher_terminal(stream) or "ipykernel" in sys.modules:
        return "bar"  # a notebook's widget counts as a terminal, as in tqdm.auto
    return "lines"


def _is_main() -> bool:
    from ..state import PartialState

    return PartialState().is_main_process


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _fd(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, ValueError, OSError):  # StringIO, pytest's capture, closed
        return None


def _parent(pid: int) -> tuple[str, int] | None:
    """(comm, ppid) of process `pid` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode(errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ")"
    name = text[text.find("(") + 1 : text.rfind(")")]
    return name, int(text[text.rfind(")") + 2 :].split()[1])


def _launcher_terminal(stream: Any) -> str | None:
    """The terminal (e.g. /dev/pts/3) to which the launcher that started this process copies
    what this process writes to `stream`, or None: no launcher among the parents, the
    launcher writes to a file or a pipe, or this is not Linux."""
    fd = _fd(stream)
    if fd not in (1, 2):
        return None
    try:  # launchers hand their ranks pipes or sockets; a file here is not theirs to copy
        if not (stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode)):
            return None
    except OSError:
        return None
    pid, target = os.getppid(), None
    for _ in range(8):  # rank -> node proxy -> launcher; a few more for wrappers
        found = _parent(pid)
        if found is None or found[0] not in _FORWARDERS:
            break
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            return None
        pid = found[1]
    return target if target and target.startswith(_TERMINALS) else None


def _launcher_columns(stream: Any) -> int | None:
    path = _launcher_terminal(stream)
    if path is None:
        return None
    try:  # O_NOCTTY: looking at the size must not make it this process's terminal
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.get_terminal_size(fd).columns or None  # 0: a terminal that never said
    except OSError:
        return None
    finally:
        os.close(fd)


class _Discard:
    """Where the plain-lines bar sends tqdm's own drawing (carriage returns, clearing)."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


@functools.cache  # built on first use: tqdm is an optional dependency
def _lines_class() -> type:
    from tqdm.std import tqdm as std_tqdm

    class Lines(std_tqdm):  # type: ignore[misc, unused-ignore]
        """A tqdm bar written as plain lines: one every LINE_EVERY_PERCENT of the total or
        every LINE_EVERY_SECONDS (whichever comes first; time alone without a total), and
        one when it closes. No carriage returns: a log file stays readable."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._out = kwargs.get("file") or sys.stderr
            kwargs["file"] = _Discard()
            self._said = (0, time.monotonic())  # (n, when) of the last line
            super().__init__(*args, **kwargs)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if msg is None and self.n != self._said[0] and self._due():
                self._say()
            return True

        def _due(self) -> bool:
            if time.monotonic() - self._said[1] >= LINE_EVERY_SECONDS:
                return True
            if not self.total:
                return False
            step = self.total * LINE_EVERY_PERCENT / 100
            return int(self.n / step) > int(self._said[0] / step)

        def _say(self) -> None:
            line = self.format_meter(**{**self.format_dict, "ncols": 0})
            self._out.write(line + "\n")
            self._out.flush()
            self._said = (self.n, time.monotonic())

        def close(self) -> None:
            if not self.disable and self.n != self._said[0]:
                self._say()
            super().close()

    return Lines
