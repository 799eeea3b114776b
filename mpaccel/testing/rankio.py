"""`python -m mpaccel.testing.rankio DIR [--launcher-output] (script.py | -m module) [args]`: run a
script or module with this rank's stdout and stderr in DIR/rank-R.out and DIR/rank-R.err (with
--launcher-output: left to the launcher, as in a terminal), and the exit code it ended with in
DIR/rank-R.rc (none when it died of a signal or an abort). First of all it writes
DIR/rank-R.pid, "PID STARTTIME", so that run_mpi can kill a rank its launcher left behind."""

from __future__ import annotations

import os
import runpy
import sys

from ..envvars import rank_before_init
from .launch import start_time


def write_pid_file(path: str) -> None:
    """PATH := "PID STARTTIME" of this process, whole or not at all (a reader may look any time).
    Nothing without /proc: there is no start time to tell this process from a later one."""
    start = start_time(os.getpid())
    if start is None:
        return
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {start}\n")
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(
            "usage: python -m mpaccel.testing.rankio DIR [--launcher-output] "
            "(script.py | -m module) ..."
        )
    directory, target = argv[0], argv[1:]
    to_files = target[0] != "--launcher-output"
    if not to_files:
        target = target[1:]
    rank = rank_before_init() or 0
    write_pid_file(os.path.join(directory, f"rank-{rank}.pid"))
    for fd, suffix in ((1, "out"), (2, "err")) if to_files else ():
        handle = os.open(
            os.path.join(directory, f"rank-{rank}.{suffix}"),
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
            0o644,
        )
        os.dup2(handle, fd)
        os.close(handle)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    code: object = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        raise
    except BaseException:
        code = 1  # an uncaught exception exits 1
        raise
    finally:
        if code is None:
            code = 0
        elif not isinstance(code, int):
            code = 1  # SystemExit("message") exits 1
        with open(os.path.join(directory, f"rank-{rank}.rc"), "w") as f:
            f.write(f"{code}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
